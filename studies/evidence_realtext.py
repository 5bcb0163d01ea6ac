"""The real-text instrument's evidence (``python -m studies.evidence realtext``): a fresh test split,
DMS tuned on validation by the same rule as KVpop, the fixed-mask and dense fine-tune controls, every row
trained with three seeds and scored once on the fresh split.

Stages (each resumable; ``--stage all`` runs them in order):

1. ``split``: the fresh test split (:func:`fresh_test_split`): files of the corpus's test bucket (seed 0's hash)
   that no shipped split used, ordered by the hash with another seed, ``--test-records`` records; written
   beside the shipped splits as ``test_fresh.jsonl`` with ``test_fresh.json`` (its file list and hash).
   ``--split-name NAME --hash-seed N`` makes another (``NAME.jsonl``), excluding the files of every earlier
   ``test_fresh*.json`` too: ``test_fresh2`` (seed 3) replaced the spent ``test_fresh``, and the final rows'
   one scoring on it is :mod:`studies.fresh_realtext`'s.
2. ``select``: DMS's validation grid (:data:`DMS_GRID`, staged) chosen by :func:`studies.evidence.choose`;
   KVpop's recipe is the argmin of the shipped validation trials (``studies/results/realtext/validation``)
   by the same function; writes ``selection.json`` before anything touches the test split.
3. ``seeds``: every recipe of :func:`recipes` with every seed.
4. ``test``: each (row, seed) scored once on the fresh split (:class:`~studies.evidence.TestLog`), then
   ``evidence_rows.json``.

``--stage controls`` (not part of ``all``): the same-structure controls of the best KVpop row, ``kvpop train
--auto``'s real-text choice (``--auto-run``), on the validation sequences only
(:func:`studies.controls_realtext.run_stage`; its record ``controls.json``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpop.training.search import confirm_choice

from .ledger import TestLog, choose, run_logged, summarize, write_json
from .paths import DATA, RESULTS_DIR, is_shipped

MODEL = DATA / "tiny_qwen3_code"
SHIPPED = DATA / "realtext"
SHIPPED_VALID_TRIALS = RESULTS_DIR / "realtext" / "validation"
BUDGET, SEQ_LEN, SINKS, WINDOW = 128, 1024, 4, 32
EVAL_BUDGETS = (64, 128, 256)
VALID_SEQUENCES = 16
SPLIT = {"of": f"the first {VALID_SEQUENCES} sequences of kvpop/data/realtext/validation.jsonl (index in the file)",
         "fit": [], "select": list(range(VALID_SEQUENCES)),
         "note": "DMS learns nothing from validation (no fit part); the shipped KVpop trials measured their "
                 "head-adaptive budgets on the first 8 of these sequences before the split existed (records "
                 "kept as they are, not re-run)"}
"""The record's ``split``."""
DENSE_CONTROL_SEED = 0
"""The dense fine-tune control's one seed (:func:`recipes`)."""
JOINT_STEPS = 250
"""Steps of the joint retrofits (chosen on validation by the earlier study: 40 / 120 / 250); the controls get
the same."""

DMS_GRID = {"lr_gate": (0.02, 0.05, 0.1, 0.01, 0.005), "lr_model": (1e-4, 3e-4), "steps": (150, 250, 400),
            "target_keep": (0.125,)}
"""DMS's candidates, staged: every lr_gate at the first lr_model, steps and keep, then the best with each other
lr_model and step count (a longer run only while the last one helped), one setting at a time (8-9 trials with
the one of an earlier grid; the best KVpop row's selection ran 6).  The keep target stays at the evaluation
budget's fraction, 0.125 (B = 128 of 1,024, KVpop's training budget too): a keep stage (0.1) was dropped for
the machine's CPU time before it ran.
0.01, then 0.005, were added when the lowest gate rate so far was the best (the grid's edge), before any test."""


DMS_EXTENSION = {"steps": (600, 800), "target_keep": (0.1, 0.15), "schedule_steps": (0.5,)}
"""The extension of DMS's search (``--stage dms-extend``), run after the test split scored the first choice:
the factors the first grid left out.  From the first choice, one factor at a time: longer runs (the step stage
ended at its grid's last value, 400, while it still helped; 800 only if 600 helped), the keep target around the
budget's fraction, and the compression schedule (``schedule_steps`` as a fraction of the steps: the keep target
is reached halfway, then held).  Its trials are validation only; a different winner is recorded as
``dms.rechosen`` beside the first ``dms.chosen`` (whose test figures stand as scored)."""


EXTENDED = "dms[tuned,extended]"
"""The row of the extension's new choice (``dms.rechosen``), when the extension found one."""


def _common(corpus: Path) -> list[str]:
    return ["--model", str(MODEL), "--data", str(corpus / "train.jsonl"), "--seq-len", str(SEQ_LEN),
            "--sinks", str(SINKS), "--window", str(WINDOW), "--checkpoint-every", "25", "--no-progress"]


def recipes(corpus: Path) -> dict[str, dict]:
    """Every KVpop and control row's recipe: ``args`` of ``kvpop train`` (beside :func:`_common`), ``legend``,
    ``steps``, ``kind`` (``kvpop``, ``control``, ``dense-control``)."""
    kv = ["--budget", str(BUDGET), "--lr-scorer", "3e-3"]
    chosen = [*kv, "--scorer", "mlp", "--label", "mean", "--decay-nats", "2.05", "--gamma-init", "0.999",
              "--allocate", "ablation", "--valid-data", str(SHIPPED / "validation.jsonl")]
    return {
        "kvpop-mlp-joint[paper]": {"policy": "kvpop-mlp-joint",
            "args": [*kv, "--scorer", "mlp", "--label", "mean", "--lr-model", "1e-4", "--steps", str(JOINT_STEPS)],
            "kind": "kvpop", "steps": JOINT_STEPS,
            "legend": "the paper's method: MLP scorer and model together, mean label, the paper's decay range "
                      "[0.999, 0.999999] from 0.9999, uniform budgets, the student's sparse label"},
        "kvpop-mlp-joint[mean,ctx-decay,adaptive]": {"policy": "kvpop-mlp-joint",
            "args": [*chosen, "--lr-model", "1e-4", "--steps", str(JOINT_STEPS)], "kind": "kvpop",
            "steps": JOINT_STEPS,
            "legend": "validation's choice: mean label, decay tied to the context (2.05 nats over 1,024 tokens, "
                      "from 0.999), head-adaptive budgets by ablation on validation, student label, model and "
                      "scorers together"},
        "kvpop-mlp[mean,ctx-decay,adaptive]": {"policy": "kvpop-mlp",
            "args": [*chosen, "--no-train-model", "--steps", "200"], "kind": "kvpop", "steps": 200,
            "legend": "the same scorers trained alone (model frozen), 200 steps"},
        "fixed-finetune[streaming]": {"policy": "fixed-finetune",
            "args": [*kv, "--mask-source", "streaming", "--lr-model", "1e-4", "--steps", str(JOINT_STEPS)],
            "kind": "control", "steps": JOINT_STEPS,
            "legend": "the control: the same model fine-tuned the same steps, data and learning rate under the fixed "
                      "StreamingLLM mask (no learned eviction)"},
        "fixed-finetune[dense]": {"policy": "dense",
            "args": ["--budget", str(SEQ_LEN - 1), "--lr-scorer", "3e-3", "--mask-source", "streaming", "--lr-model",
                     "1e-4", "--steps", str(JOINT_STEPS)],
            "kind": "dense-control", "steps": JOINT_STEPS,  # one seed: its KL to an identical dense teacher is
            # zero but for rounding, so a seed can only move noise; not a headline row
            "legend": "a dense fine-tune of the same steps (budget 1,023 of 1,024 tokens: one token evicted at "
                      "the last query only), served densely: what the same training does without eviction"},
    }


def _dms_args(corpus: Path, c: dict, seed: int) -> list[str]:
    return ["kvpop", "train", "--method", "dms", *_common(corpus), "--target-keep", f"{c['target_keep']:g}",
            "--lr-model", f"{c['lr_model']:g}", "--lr-scorer", f"{c['lr_gate']:g}", "--steps", str(c["steps"]),
            *(["--schedule-steps", str(c["schedule_steps"])] if "schedule_steps" in c else []), "--seed", str(seed)]


def _tag(c: dict) -> str:
    return "_".join(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}" for k, v in sorted(c.items()))


def _eval(out: Path, log: Path, name: str, data: Path, budgets, n: int, extra: list[str]) -> dict:
    res = out / "results.json"
    if not res.exists():
        run_logged(["kvpop", "eval", "--model", str(MODEL), "--data", str(data), "--seq-len", str(SEQ_LEN),
                    "--budgets", ",".join(map(str, budgets)), "--sinks", str(SINKS), "--window", str(WINDOW),
                    "--n-sequences", str(n), "--no-plot", "--no-progress", *extra, "--out", str(out)], log, name=name)
    return json.loads(res.read_text())


def _delta(results: dict, policy: str, budget: int) -> float:
    return next(r["delta_nll"] for r in results["rows"] if r["policy"] == policy and r["budget"] == budget)


def _per_sequence(results: dict, policy: str, budget: int) -> list[float] | None:
    """Each validation sequence's delta NLL (``None`` in a ``results.json`` written before rows carried it)."""
    each = next(r.get("per_sequence") for r in results["rows"] if r["policy"] == policy and r["budget"] == budget)
    return None if each is None else [x for x in each if x is not None]  # None: a trace too short to score


def fresh_test_split(corpus: Path, out_dir: Path, *, n_records: int, hash_seed: int = 2,
                     name: str = "test_fresh", exclude: tuple[Path, ...] = (), command: str | None = None,
                     site: Path | None = None, write_shipped: bool = False) -> Path:
    """``out_dir/<name>.jsonl``: records of test-bucket files (``split_of(key, seed=0) == "test"``) that
    neither shipped split used, nor any earlier fresh split (``exclude``: the ``<name>.json`` records of earlier
    fresh splits, their ``files``), ordered by the seeded hash with ``hash_seed``, 2 records per file (the
    corpus's rule); ``<name>.json`` lists the files, their listing's hash (``files_used_hash``, as the shipped
    manifest hashes its splits' files), the files excluded and the JSONL's hash.  The model never saw these
    files (its pre-training read the train bucket only) and no earlier evaluation scored them.  ValueError when
    an ``exclude`` record lists no files, or ``name`` would overwrite a shipped split.  ``command``: the command
    line that made it, kept in the record.  ``site``: the directory the corpus's packages are read from (default
    this interpreter's ``purelib``; give one holding the versions the shipped manifest names to draw from the
    files the earlier splits were drawn from).  ``out_dir`` in what the project ships (the package's realtext
    corpus) is refused without ``write_shipped`` (``--write-shipped``), before any work."""
    import hashlib
    import sysconfig

    from studies import realtext_corpus as C

    if name in ("train", "validation", "test") or not name.replace("_", "").isalnum():
        raise ValueError(f"name must be a new split's name (letters, digits, _; not train/validation/test), "
                         f"got {name!r}")
    if is_shipped(out_dir) and not write_shipped:
        raise ValueError(f"--split-name {name}: a new fresh split would be drawn into {out_dir} (what the project "
                         f"ships); add --write-shipped to write it there")
    shipped = json.loads((SHIPPED / "manifest.json").read_text())
    st = shipped["settings"]
    used = set(shipped["splits"]["test"]["files"]) | set(shipped["splits"]["validation"]["files"])
    earlier: dict[str, int] = {}
    for e in exclude:
        files = json.loads(Path(e).read_text()).get("files")
        if not isinstance(files, list) or not files:
            raise ValueError(f"{e}: not a fresh split's record (no files list); exclude takes <split>.json files")
        earlier[Path(e).name] = len(set(files) - used)
        used |= set(files)
    read_from = Path(site) if site is not None else Path(sysconfig.get_paths()["purelib"])
    files = C.list_files(read_from, st["packages"], stdlib=Path(sysconfig.get_paths()["stdlib"]))
    bucket = [(k, p) for k, p in files if C.split_of(k, st["seed"], st["valid_frac"], st["test_frac"]) == "test"
              and k not in used]
    order = sorted(bucket, key=lambda kp: (C._unit(hash_seed, kp[0]), kp[0]))
    records, chosen = [], []
    for key, p in order:
        if len(records) >= n_records:
            break
        data = C._text_bytes(p)
        recs = C.file_records(data, st["seq_len"], min(st["max_records_per_file"], n_records - len(records))) \
            if data is not None else []
        if recs:
            records += recs
            chosen.append(key)
    if len(records) < n_records:
        raise ValueError(f"only {len(records)} fresh test records could be made (asked for {n_records})")
    path = out_dir / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r}, separators=(",", ":")) + "\n" for r in records))
    rule = ("files of the corpus's test bucket (split_of seed 0) used by no shipped split"
            + (f" nor by the earlier fresh splits {', '.join(sorted(earlier))}" if earlier else "")
            + f", ordered by the hash with seed {hash_seed}, at most {st['max_records_per_file']} records per file")
    write_json(out_dir / f"{name}.json", {
        "rule": rule, **({"command": command} if command else {}), "records": len(records), "files": sorted(chosen),
        "files_used_hash": hashlib.blake2b("\n".join(sorted(chosen)).encode(), digest_size=16).hexdigest(),
        "excluded_shipped_files": len(set(shipped["splits"]["test"]["files"])
                                      | set(shipped["splits"]["validation"]["files"])),
        **({"excluded_earlier_fresh_files": earlier} if earlier else {}),
        "hash_seed": hash_seed, "package_versions": C._versions(st["packages"], site),
        "jsonl_blake2b": C.file_hash(path),
        "corpus_train_blake2b": C.file_hash(corpus / "train.jsonl") if (corpus / "train.jsonl").exists() else None})
    return path


def _last_step(d: Path) -> int | None:
    """The last step ``history.jsonl`` records in a ``kvpop train --out`` directory (``None``: none)."""
    h = d / "history.jsonl"
    lines = [x for x in h.read_text().splitlines() if x.strip()] if h.exists() else []
    return json.loads(lines[-1])["step"] if lines else None


def shipped_kvpop_trials() -> list[dict]:
    """The validation trials of the joint MLP retrofit that chose its recipe (kvpop eval on 16 validation
    sequences at B = 128, ``studies/results/realtext/validation``): file, settings, score."""
    named = {"pilot.json": "mean label, uniform, 40 steps", "j120m.json": "mean label, uniform, 120 steps",
             "j250m.json": "mean label, uniform, 250 steps", "j250_maxlabel.json": "max label, uniform, 250 steps",
             "head_adaptive_trained.json": "mean label, head-adaptive (ablation), 250 steps",
             "lookahead_setting_joint.json": "max label, paper decay, head-adaptive, teacher label, 250 steps"}
    out = []
    for f, what in named.items():
        r = json.loads((SHIPPED_VALID_TRIALS / f).read_text())
        out.append({"file": f"studies/results/realtext/validation/{f}", "settings": what,
                    "score": _delta(r, "kvpop-mlp-joint", BUDGET)})
    return out


def _dms_trial(corpus: Path, out: Path, log: Path, c: dict, seed: int = 0) -> dict:
    """One DMS validation trial of settings ``c`` (seed ``seed``, 0 but for the confirmation): trained (resumed
    when interrupted) and scored on the validation sequences; ``{"settings", "score", "per_sequence", "dir"}``."""
    d = out / "dms_select" / _tag(c)
    d = d / f"seed{seed}" if seed else d
    if _last_step(d) != c["steps"]:  # unfinished (an interrupted run writes its outputs too)
        run_logged([*_dms_args(corpus, c, seed), "--out", str(d),
                    *(["--resume"] if (d / "last.pt").exists() else [])], log, name=f"dms select {_tag(c)} {seed}")
    res = _eval(d / "valid_eval", log, f"dms select eval {_tag(c)} {seed}", SHIPPED / "validation.jsonl", [BUDGET],
                VALID_SEQUENCES, ["--run", str(d), "--policies", "dense,dms"])
    t = {"settings": c, "score": _delta(res, "dms", BUDGET), "per_sequence": _per_sequence(res, "dms", BUDGET),
         "dir": str(d)}
    print(f"[evidence realtext] dms {c}: validation +{t['score']:.4f}", flush=True)
    return t


def _extend_dms(a, corpus: Path, out: Path, log: Path) -> dict:
    """``--stage dms-extend``: :data:`DMS_EXTENSION`'s trials from the first choice, in parallel (``--jobs``),
    recorded in ``selection.json`` under ``dms.extension``; the best of every DMS trial by :func:`choose` is
    ``dms.rechosen`` when it differs from ``dms.chosen``."""
    from concurrent.futures import ThreadPoolExecutor

    sel_file = out / "selection.json"
    if not sel_file.exists() or not json.loads(sel_file.read_text()).get("final"):
        raise ValueError(f"--stage dms-extend needs the final {sel_file} (run --stage select, or copy the "
                         f"archived one from studies/results/evidence/realtext)")
    record = json.loads(sel_file.read_text())
    first = record["dms"]["chosen"]
    c0, g = first["settings"], DMS_EXTENSION
    ext = record["dms"].setdefault("extension", {"from": c0, "trials": []})
    done = {json.dumps(t["settings"], sort_keys=True): t for t in ext["trials"]}

    def trials(cs: list[dict]) -> list[dict]:
        todo = [c for c in cs if json.dumps(c, sort_keys=True) not in done]
        with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            for t in pool.map(lambda c: _dms_trial(corpus, out, log, c), todo):
                done[json.dumps(t["settings"], sort_keys=True)] = t
                ext["trials"].append(t)
                write_json(sel_file, record)
        return [done[json.dumps(c, sort_keys=True)] for c in cs]

    first_wave = [{**c0, "steps": g["steps"][0]}, *({**c0, "target_keep": k} for k in g["target_keep"]),
                  *({**c0, "schedule_steps": int(f * c0["steps"])} for f in g["schedule_steps"])]
    longer = trials(first_wave)[0]
    for n in g["steps"][1:]:  # a longer run only while the last one helped
        if longer["score"] >= first["score"]:
            break
        prev, longer = longer, trials([{**c0, "steps": n}])[0]
        if longer["score"] >= prev["score"]:
            break
    every = [first, *[t for t in record["dms"]["trials"] if t is not first], *ext["trials"]]
    best = choose(every, higher_is_better=False, decisions=record.setdefault("decisions", []),
                  stage="dms extension (every trial)")
    ext["complete"] = True
    record["dms"]["rechosen"] = best if best["settings"] != c0 else None
    record["trials_of"]["dms_with_extension"] = len(record["dms"]["trials"]) + len(ext["trials"])
    write_json(sel_file, record)
    print(f"[evidence realtext] dms extension: {len(ext['trials'])} trials; best of all "
          f"{record['trials_of']['dms_with_extension']}: {best['settings']} +{best['score']:.4f} "
          f"({'a new choice' if record['dms']['rechosen'] else 'the first choice stands'})", flush=True)
    return record


def _select(a, corpus: Path, out: Path, log: Path) -> dict:
    sel_file = out / "selection.json"
    record = json.loads(sel_file.read_text()) if sel_file.exists() else {}
    if record.get("final"):
        return record
    kv = shipped_kvpop_trials()
    decisions: list = []
    record = {"instrument": "realtext", "criterion": f"NLL increase over dense at B={BUDGET}, "
              f"{VALID_SEQUENCES} validation sequences (kvpop eval --data validation.jsonl), lower is better",
              "rule": "kvpop.training.search.prefer (2 paired standard errors; a trial without per-sequence "
                      "scores, the shipped KVpop trials, compared by its mean), DMS confirmed with seed 1",
              "split": SPLIT, "decisions": decisions,
              "kvpop": {"trials": kv, "chosen": choose(kv, higher_is_better=False, decisions=decisions,
                                                       stage="kvpop (shipped trials)")},
              "dms": {"trials": []}}
    trials = record["dms"]["trials"]

    def trial(c: dict) -> dict:
        t = _dms_trial(corpus, out, log, c)
        trials.append(t)
        write_json(sel_file, record)
        return t

    g = DMS_GRID
    best = choose([trial({"lr_gate": lg, "lr_model": g["lr_model"][0], "steps": g["steps"][0],
                          "target_keep": g["target_keep"][0]}) for lg in g["lr_gate"]], higher_is_better=False,
                  decisions=decisions, stage="dms lr_gate")
    for key in ("lr_model", "steps", "target_keep"):
        for v in g[key][1:]:  # one value at a time; a longer run is tried only while the last one helped
            t = trial({**best["settings"], key: v})
            best = choose([best, t], higher_is_better=False, decisions=decisions, stage=f"dms {key}")
            if key == "steps" and best is not t:
                break
    ran = {t["dir"] for t in trials}
    for d in sorted((out / "dms_select").iterdir()):  # a trial of an earlier grid counts too (none is hidden)
        res = d / "valid_eval" / "results.json"
        if str(d) not in ran and res.exists():
            cfg = json.loads((d / "args.json").read_text())
            trials.append({"settings": {"lr_gate": cfg["lr_scorer"], "lr_model": cfg["lr_model"], "steps": cfg["steps"],
                                        "target_keep": cfg["target_keep"]}, "dir": str(d), "off_path": True,
                           "score": _delta(json.loads(res.read_text()), "dms", BUDGET)})
    best = choose([t for t in trials if t is best] + [t for t in trials if t is not best], higher_is_better=False,
                  decisions=decisions, stage="dms (every trial)")
    best, record["confirmation"] = confirm_choice(
        best, trials, lambda t: _dms_trial(corpus, out, log, t["settings"], 1), seed=("seed", 1),
        higher_is_better=False)
    record["dms"]["chosen"] = best
    record["trials_of"] = {"kvpop": len(kv), "dms": len(trials)}
    record["final"] = True
    write_json(sel_file, record)
    return record


def run(a: argparse.Namespace) -> int:
    out, corpus = Path(a.out), Path(a.corpus)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    from kvpop.cli.trained import parse_ints

    seeds = parse_ints(a.seeds, "--seeds")
    if len(seeds) < 1:
        raise ValueError(f"--seeds lists no seed: {a.seeds!r}")
    if not (corpus / "train.jsonl").exists():
        raise ValueError(f"{corpus}/train.jsonl is missing: python -m studies.realtext_corpus --out {corpus} "
                         f"--splits train,validation,test")
    if a.stage == "controls":
        from .controls_realtext import run_stage

        run_stage(out, model=MODEL, data=corpus / "train.jsonl", valid=SHIPPED / "validation.jsonl",
                  auto=Path(a.auto_run), seeds=seeds, jobs=a.jobs, train=not a.record_only)
        return 0
    stages = ("split", "select", "seeds", "test") if a.stage == "all" else (a.stage,)
    fresh = SHIPPED / f"{a.split_name}.jsonl"
    if "split" in stages and not fresh.exists():
        earlier = tuple(sorted(x for x in SHIPPED.glob("test_fresh*.json") if x.stem != a.split_name))
        fresh_test_split(corpus, SHIPPED, n_records=a.test_records, hash_seed=a.hash_seed, name=a.split_name,
                         exclude=earlier, write_shipped=a.write_shipped,
                         command=f"python -m studies.evidence realtext --out {a.out} --corpus "
                         f"{a.corpus} --stage split --split-name {a.split_name} --hash-seed {a.hash_seed} "
                         f"--test-records {a.test_records}")
    if "select" in stages:
        _select(a, corpus, out, log)
    if a.stage == "dms-extend":
        _extend_dms(a, corpus, out, log)
        return 0
    sel = json.loads((out / "selection.json").read_text()) if (out / "selection.json").exists() else {}
    rs = recipes(corpus)
    dms_c = sel.get("dms", {}).get("chosen", {}).get("settings")
    dms_x = (sel.get("dms", {}).get("rechosen") or {}).get("settings")
    scored = TestLog(out).entries  # a (row, seed) already scored on the test split needs no training again
    if "seeds" in stages:  # the KVpop recipes and controls are fixed; DMS's waits for its selection
        for s in seeds:
            for name, r in rs.items():
                if a.only_dms or (r["kind"] == "dense-control" and s != DENSE_CONTROL_SEED) or \
                        f"{name}|seed{s}" in scored:
                    continue  # one seed: see recipes()
                d = out / name / f"seed{s}"
                if not (d / "done").exists():
                    run_logged(["kvpop", "train", *_common(corpus), *r["args"], "--seed", str(s), "--out", str(d),
                                *(["--resume"] if (d / "last.pt").exists() else [])], log, name=f"{name} seed {s}")
                    (d / "done").write_text("")
            d = out / "dms[tuned]" / f"seed{s}"
            if not sel.get("final"):
                print(f"[evidence realtext] dms seed {s}: not trained yet (its selection is not final)", flush=True)
            elif not (d / "done").exists() and f"dms[tuned]|seed{s}" not in scored:
                run_logged([*_dms_args(corpus, dms_c, s), "--out", str(d),
                            *(["--resume"] if (d / "last.pt").exists() else [])], log, name=f"dms seed {s}")
                (d / "done").write_text("")
        if dms_x:  # the extension's new choice: every seed at once (--jobs), beside the first choice's
            from concurrent.futures import ThreadPoolExecutor

            def train_x(s: int) -> None:
                d = out / EXTENDED / f"seed{s}"
                if not (d / "done").exists():
                    run_logged([*_dms_args(corpus, dms_x, s), "--out", str(d),
                                *(["--resume"] if (d / "last.pt").exists() else [])], log, name=f"{EXTENDED} seed {s}")
                    (d / "done").write_text("")

            with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
                list(pool.map(train_x, seeds))
    if "test" in stages:
        _test(a, out, log, seeds, rs, sel, fresh)
    return 0


def _test(a, out: Path, log: Path, seeds, rs: dict, sel: dict, fresh: Path) -> None:
    early = getattr(a, "skip_dms", False)  # the KVpop rows' and controls' recipes are fixed before DMS's are
    if not sel.get("final") and not (early and sel.get("kvpop", {}).get("chosen")):
        raise ValueError("the test stage needs the final selection.json written before it (run --stage select)")
    if not fresh.exists():
        raise ValueError(f"{fresh} is missing (run --stage split)")
    tl = TestLog(out)
    n = a.test_records
    fx = tl.once("fixed", lambda: _eval(out / "test" / "fixed", log, "test fixed", fresh, EVAL_BUDGETS, n,
                                        ["--policies", "dense,streaming"]))
    per: dict[str, dict[int, dict]] = {}
    dms_rows = {"dms[tuned]": {"kind": "dms", "policy": "dms"},
                **({EXTENDED: {"kind": "dms", "policy": "dms"}} if (sel.get("dms") or {}).get("rechosen") else {})}
    for name, r in {**rs, **({} if early else dms_rows)}.items():
        for s in ([x for x in seeds if x == DENSE_CONTROL_SEED] if r["kind"] == "dense-control" else seeds):
            d = out / name / f"seed{s}"
            key = f"{name}|seed{s}"
            if r["kind"] == "dense-control":
                res = tl.once(key, lambda d=d, s=s, name=name: _dense_eval(d, fx, log, out, name, s, fresh, n))
            else:
                extra = ["--run", str(d), "--policies", f"dense,{r['policy']}"]
                if r["kind"] == "dms":
                    extra += ["--dms-valid-data", str(SHIPPED / "validation.jsonl")]
                res = tl.once(key, lambda d=d, s=s, name=name, extra=extra: _eval(
                    out / "test" / f"{name}_seed{s}", log, f"test {name} seed {s}", fresh, EVAL_BUDGETS, n, extra))
            per.setdefault(name, {})[s] = res
    if early:
        print("[evidence realtext] every row but DMS's scored (--skip-dms); the rows are written with DMS's",
              flush=True)
        return
    rows = []
    dms_sel = sel["dms"]
    for b in EVAL_BUDGETS:
        for pol in ("streaming",):
            v = _delta(fx, pol, b)
            rows.append(_row(pol, b, [v], None, 0, {"rule": "StreamingLLM", "sinks": SINKS, "window": WINDOW},
                             "fixed rule (no training, deterministic: one evaluation)", tl.count("fixed")))
        for name, r in {**rs, **dms_rows}.items():
            vals = []
            for s in per[name]:
                res = per[name][s]
                vals.append(res["delta"] if r["kind"] == "dense-control" else _delta(res, r["policy"], b))
            if name == EXTENDED:
                x, n_all = dms_sel["rechosen"]["settings"], sel["trials_of"]["dms_with_extension"]
                recipe = {**x, "threshold": "chosen on validation per budget"}
                trials, steps, legend = n_all, x["steps"], (
                    f"DMS re-chosen on validation after the search's extension ({n_all} trials: the first grid's "
                    f"and {len(dms_sel['extension']['trials'])} more from its choice, one factor at a time: longer "
                    f"runs, keep targets {'/'.join(map(str, DMS_EXTENSION['target_keep']))}, the schedule reached "
                    f"halfway), {_tag(x)}; the first choice, dms[tuned], was scored on the test split before the "
                    f"extension ran")
            elif r["kind"] == "dms":
                recipe = {**dms_sel["chosen"]["settings"], "threshold": "chosen on validation per budget"}
                trials, steps, legend = len(dms_sel["trials"]), dms_sel["chosen"]["settings"]["steps"], (
                    "DMS, gates and model together, its gate lr, model lr and steps chosen on validation "
                    f"({len(dms_sel['trials'])} trials; keep target 0.125), gate threshold per budget chosen on "
                    "validation traces")
            else:
                recipe = {"kvpop_train_args": r["args"]}
                trials = len(sel["kvpop"]["trials"]) if "adaptive" in name else 0
                steps, legend = r["steps"], r["legend"]
            row = _row(name, b, vals, steps, trials, recipe, legend,
                       tl.count(*(f"{name}|seed{s}" for s in per[name])))
            row["headline"] = row["headline"] and r["kind"] != "dense-control"
            rows.append(row)
    write_json(out / "evidence_rows.json", {"rows": rows, "seeds": seeds, "test_split": str(fresh.name),
                                            "test_records": n})
    print(json.dumps([(r["policy"], r["budget"], round(r["mean"], 4)) for r in rows]), flush=True)


def _dense_eval(d: Path, fixed: dict, log: Path, out: Path, name: str, s: int, fresh: Path, n: int) -> dict:
    """The dense fine-tune served densely: its dense NLL minus the base model's on the same positions (each
    ``kvpop eval --data`` row carries its model's dense NLL; ``fixed`` is the base model's evaluation)."""
    o = out / "test" / f"{name}_seed{s}"
    if not (o / "results.json").exists():
        run_logged(["kvpop", "eval", "--model", str(d / "model"), "--data", str(fresh), "--seq-len", str(SEQ_LEN),
                    "--budgets", ",".join(map(str, EVAL_BUDGETS)), "--sinks", str(SINKS), "--window", str(WINDOW),
                    "--n-sequences", str(n), "--no-plot", "--no-progress", "--policies", "dense,streaming",
                    "--out", str(o)], log, name=f"test {name} seed {s}")
    ft = json.loads((o / "results.json").read_text())
    bd = next(r["dense_nll"] for r in fixed["rows"] if "dense_nll" in r)
    fd = next(r["dense_nll"] for r in ft["rows"] if "dense_nll" in r)
    return {"delta": fd - bd, "dense_nll": fd, "base_dense_nll": bd}


def _row(policy: str, budget: int, vals: list[float], steps, trials: int, recipe: dict, legend: str,
         test_evaluations: int) -> dict:
    return {"instrument": "realtext", "policy": policy, "recipe": recipe, "steps": steps, "seeds": vals,
            **summarize(vals), "value": summarize(vals)["mean"], "metric": "delta_nll", "trials": trials,
            "test_evaluations": test_evaluations, "budget": budget, "budget_fraction": budget / SEQ_LEN,
            "headline": budget == BUDGET, "legend": legend}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run directory (every training run, evaluation and record)")
    p.add_argument("--corpus", default="runs/realtext",
                   help="the regenerated corpus with train.jsonl (python -m studies.realtext_corpus --out DIR "
                        "--splits train,validation,test)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--stage", default="all",
                   choices=("all", "split", "select", "seeds", "test", "dms-extend", "controls"),
                   help="dms-extend (not part of all): DMS_EXTENSION's validation trials after the first choice; "
                        "controls (not part of all): the same-structure controls on validation "
                        "(studies.controls_realtext)")
    p.add_argument("--jobs", type=int, default=2,
                   help="--stage dms-extend / controls: runs trained at once (default 2)")
    p.add_argument("--auto-run", default="runs/rt/auto",
                   help="--stage controls: the kvpop train --auto --out directory of the best KVpop row (its trials "
                        "of the chosen settings, seeds 0 and 1, are reused; seed 2 is trained as they were)")
    p.add_argument("--record-only", action="store_true",
                   help="--stage controls: run nothing; write controls.json from the runs and evaluations there "
                        "(the rest named in its missing)")
    p.add_argument("--test-records", type=int, default=48, help="records of the fresh test split (default 48)")
    p.add_argument("--split-name", default="test_fresh",
                   help="--stage split / test: the fresh split's name (kvpop/data/realtext/NAME.jsonl and NAME.json; "
                        "default test_fresh, the first one, now spent); a new name excludes the files of every "
                        "earlier test_fresh*.json there")
    p.add_argument("--hash-seed", type=int, default=2,
                   help="--stage split: the seed of the hash that orders the candidate files (default 2, the first "
                        "fresh split's; give a new one for a new split)")
    p.add_argument("--skip-dms", action="store_true",
                   help="--stage test: score every row but DMS's (their recipes are fixed; DMS's selection may still "
                        "run); a later --stage test scores DMS's and writes the rows")
    p.add_argument("--only-dms", action="store_true",
                   help="--stage seeds: train only DMS's seeds (beside a seeds run of the other rows)")
