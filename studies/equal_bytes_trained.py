"""The 16-bit equal-bytes row trained at its budget (issue 61 item 3): ``studies.equal_bytes``' real-text
comparison (8-bit slots at B = 128 against 16-bit slots at B16 = 75, window 32) with the 16-bit side served by a
model trained at B16, not the B = 128-trained model served at 75.

::

    python -m studies.equal_bytes_trained train --out /work/eqb75 --budget 75 --seed 0
    python -m studies.equal_bytes_trained test --out /work/eqb75 --split /work/eqb75/corpus4/test.jsonl \\
        --record studies/results/evidence/realtext --write-shipped

1. **Train** (``train``): ``kvpop-mlp-joint[auto]``'s recipe (the real-text KVpop row of
   ``studies/results/evidence/realtext/controls.json``: ``kvpop train --auto``'s trial
   ``allocate-ablation_..._label-mean_lrscorer-0.001_...``: mean label, ``--allocate ablation`` measured on the fit
   part of validation, scorer lr 1e-3, model lr 1e-4, 250 steps, seq-len 1024, sinks 4, window 32), trained as the
   search trains its trials (:func:`studies.controls_realtext.auto_trial`: ``kvpop train`` in quarters of the
   steps, each followed by the fit score at the run's own budget, the best fit state kept), at ``--budget`` 75 and
   128, into ``OUT/runs/B{budget}/seed{seed}``.  The train split is ``--data`` (default :data:`TRAIN`), the fit part
   the 8 fit sequences of ``--valid-data`` (default :data:`VALID`; split as ``kvpop train --auto`` splits it).
2. **Score** (``test``): each (row, seed) once through :class:`studies.ledger.TestLog` (``OUT/test``) on
   ``--split`` (a fresh real-text test split), decoded token by token through ``KVpopCache`` as
   :func:`studies.equal_bytes.decode` decodes (the sinks prefilled, model in bfloat16), the figure per sequence the
   NLL increase over the original dense model (float32) on positions >= 256, clusters the source files.  Rows
   (:func:`rows`): ``int8@B=128,w=32``, ``bf16@B=128,w=32`` and ``bf16@B=75,w=32`` on the 128-trained runs,
   ``bf16@B=75,w=32[trained at 75]`` on the 75-trained runs; the bytes of every scoring recorded
   (``KVpopCache.nbytes()``), the 16-bit rows at 75 checked to hold no more than ``int8@B=128``.
3. **Intervals** (:data:`COMPARISONS`): :func:`studies.paired.comparison` over files and seeds, the seed-level
   t-interval (:func:`studies.paired.seed_t_interval`) and :func:`studies.paired.strength`.

The record ``RECORD/equal_bytes_trained.json`` (every per-sequence value, bytes, the runs' training records, the
split's manifest, commands, dates) and ``.md`` generated from it; writing into ``studies/results`` needs
``--write-shipped``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .equal_bytes import BF16, SINKS, WINDOW, row_name
from .ledger import TestLog, write_json
from .paths import check_out_dir, parse

BUDGET, B16 = 128, 75
"""The 8-bit rows' budget and the 16-bit side's at equal bytes (``equal_bytes.json``: window 32 chosen on
validation, 81,504 bytes against int8@128's 81,824)."""
BUDGETS = (B16, BUDGET)
SEEDS = ("0", "1", "2")
TRAIN = "/work/auto62/corpus/train.jsonl"
VALID = "/work/auto62/valid_clean.jsonl"
MODEL = "kvpop/data/tiny_qwen3_code"
START = 256
TRAINED = "[trained at 75]"
RECIPE = {"method": "kvpop", "label": "mean", "allocate": "ablation", "lr_scorer": 1e-3, "lr_model": 1e-4,
          "steps": 250, "seq_len": 1024, "sinks": SINKS, "window": WINDOW, "scorer": "mlp", "lm_weight": 0.0,
          "target_source": "student", "decay_nats": None, "checkpoint_every": 25, "threads": 1, "no_progress": True}
"""``kvpop-mlp-joint[auto]``'s options (its trial directory's name and ``auto/realtext_v4/selection.json``'s
chosen settings; every other option ``kvpop train``'s default)."""


def run_dir(out: Path, budget: int, seed: str) -> Path:
    return Path(out) / "runs" / f"B{budget}" / f"seed{seed}"


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------

def fit_part(valid: str, out: Path, model_dir: Path) -> tuple[Path, list[int]]:
    """``out/fit.jsonl``: the fit sequences of ``valid`` as ``kvpop train --auto`` splits it (its first 1024-token
    sequences, up to :data:`kvpop.training.auto_data.MAX_VALID`, by :func:`kvpop.training.search.split_keys` with
    seed :data:`kvpop.training.auto_data.SPLIT_SEED` and 8 to fit), and their indices."""
    import torch

    from kvpop.models import load_model_dir
    from kvpop.training import allocation as A
    from kvpop.training.auto_data import MAX_VALID, SPLIT_SEED
    from kvpop.training.search import split_keys

    m = load_model_dir(model_dir, dtype=torch.float32)
    seqs, _, _ = A.validation_file(valid, RECIPE["seq_len"], MAX_VALID, vocab_size=m.config.vocab_size,
                                   model_dir=model_dir, pack=False, eos_token_id=getattr(m.config, "eos_token_id",
                                                                                         None),
                                   train_digests=None, train_path=None)
    keys = [",".join(map(str, x.tolist())) for x in seqs]
    fit, _ = split_keys(keys, SPLIT_SEED, n_fit=A.VALID_SEQUENCES)
    f = Path(out) / "fit.jsonl"
    text = "".join(json.dumps({"input_ids": seqs[i].tolist()}) + "\n" for i in fit)
    if not f.exists() or f.read_text() != text:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return f, fit


def trial_args(budget: int, *, data: str, fit_file: Path, model: str, n_fit: int) -> dict:
    """The recipe's ``args.json`` at ``budget`` (what :func:`studies.controls_realtext.auto_trial` trains from)."""
    from kvpop.cli import build_parser
    from kvpop.training import rundir

    args = build_parser().parse_args(["train", "--out", "unused"])
    d = {**rundir.arg_dict(args), **RECIPE, "budget": budget, "data": data, "model": model,
         "valid_data": str(fit_file), "valid_sequences": n_fit, "seed": 0, "out": None, "auto": False}
    return d


def train(out: Path, budget: int, seed: str, *, data: str = TRAIN, valid: str = VALID, model: str = MODEL) -> dict:
    """One (budget, seed) of the recipe under ``OUT/runs`` (resumable; the result kept in ``train.json``)."""
    from .controls_realtext import auto_trial

    out = Path(out)
    rd = run_dir(out, budget, seed)
    done = rd / "train.json"
    if done.exists():
        return json.loads(done.read_text())
    model = str(Path(model).resolve())
    fit, idx = fit_part(valid, out, Path(model))
    spec = out / "recipe" / f"B{budget}" / "args.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    write_json(spec, trial_args(budget, data=data, fit_file=fit, model=model, n_fit=len(idx)))
    t0 = time.time()
    r = auto_trial(spec, int(seed), rd, fit, served=budget)
    rec = {**r, "budget": budget, "seed": seed, "dir": str(rd), "args": str(spec), "fit": {"file": str(fit),
           "valid_data": valid, "indices": idx}, "seconds": round(time.time() - t0, 1),
           "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    write_json(done, rec)
    return rec


# ---------------------------------------------------------------------------------------------------------------
# the rows and the comparisons
# ---------------------------------------------------------------------------------------------------------------

def rows() -> list[dict]:
    """The test rows: name, slot dtype, served budget and window, and the budget its runs were trained at."""
    return [{"row": row_name("int8", BUDGET, WINDOW), "dtype": "int8", "budget": BUDGET, "window": WINDOW,
             "trained_at": BUDGET},
            {"row": row_name(BF16, BUDGET, WINDOW), "dtype": BF16, "budget": BUDGET, "window": WINDOW,
             "trained_at": BUDGET},
            {"row": row_name(BF16, B16, WINDOW), "dtype": BF16, "budget": B16, "window": WINDOW,
             "trained_at": BUDGET},
            {"row": row_name(BF16, B16, WINDOW) + TRAINED, "dtype": BF16, "budget": B16, "window": WINDOW,
             "trained_at": B16}]


INT8, BF16_128, BF16_75_SERVED, BF16_75_TRAINED = (r["row"] for r in rows())
COMPARISONS = ((INT8, BF16_75_TRAINED, "equal bytes, the 16-bit model trained at 75 (the headline)"),
               (INT8, BF16_75_SERVED, "equal bytes, the 16-bit side the 128-trained model served at 75 (the old row)"),
               (BF16_75_TRAINED, BF16_75_SERVED, "what training at the budget buys (16-bit at 75)"),
               (INT8, BF16_128, "equal slots (what 8-bit slots cost)"))
"""``(a, b, what)``: each interval is ``a - b`` (NLL increase; negative: ``a`` better)."""


def compare(runs: dict, clusters: list, *, n_boot: int = 10_000) -> list[dict]:
    """Each of :data:`COMPARISONS` on ``runs`` (``{row: {seed: {"per_sequence": [...]}}}``, the same seeds in
    every row): :func:`studies.paired.comparison` over clusters and seeds (seeds drawn independently), the same
    bootstrap with the seeds paired, :func:`studies.paired.seed_t_interval` of the per-seed means (seed ``s``
    against seed ``s``) and :func:`studies.paired.strength` of the first interval."""
    from .paired import comparison, paired_interval, seed_t_interval, strength, verdict

    out = []
    for a, b, what in COMPARISONS:
        seeds = sorted(runs[a], key=int)
        if sorted(runs[b], key=int) != seeds:
            raise ValueError(f"{a} has seeds {seeds}, {b} {sorted(runs[b], key=int)}: the comparison pairs them")
        va = [runs[a][s]["per_sequence"] for s in seeds]
        vb = [runs[b][s]["per_sequence"] for s in seeds]
        c = comparison(instrument="realtext", budget=BUDGET, a=a, b=b, values_a=va, values_b=vb,
                       lower_is_better=True, clusters=clusters, n_boot=n_boot)
        ps = paired_interval(va, vb, clusters=clusters, n_boot=n_boot, pair_seeds=True) if len(seeds) > 1 else None
        st = seed_t_interval([sum(v) / len(v) for v in va], [sum(v) / len(v) for v in vb])
        out.append({**c, "at": what, "seeds": seeds, "strength": strength(c["ci95"], lower_is_better=True),
                    "seeds_paired": None if ps is None else {
                        "mean_diff": ps.mean_diff, "ci95": list(ps.ci95),
                        "verdict": verdict(ps, lower_is_better=True)},
                    "seed_t": None if st is None else {
                        **st, "verdict": verdict({"ci95": st["ci95"]}, lower_is_better=True)}})
    return out


def check_bytes(runs: dict) -> dict:
    """The bytes per sequence of each row (one figure over its seeds); ValueError when a row's seeds differ or a
    16-bit row at 75 holds more than ``int8@B=128``."""
    per_row = {}
    for row, seeds in runs.items():
        b = {r["bytes_per_sequence"] for r in seeds.values()}
        if len(b) != 1:
            raise ValueError(f"{row}: its seeds held different bytes per sequence {sorted(b)}")
        per_row[row] = b.pop()
    for row in (BF16_75_SERVED, BF16_75_TRAINED):
        if row in per_row and INT8 in per_row and per_row[row] > per_row[INT8]:
            raise ValueError(f"{row} holds {per_row[row]:,.0f} bytes per sequence, more than {INT8}'s "
                             f"{per_row[INT8]:,.0f}: not equal bytes")
    return per_row


# ---------------------------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------------------------

def digests(path: str | Path, n: int | None = None) -> set[bytes]:
    """The digests (:func:`kvpop.training.data.digests`) of the first ``n`` records of a token-id JSONL file (all
    when ``n`` is None), whole records as written."""
    import torch

    from kvpop.training import data as data_io

    recs = data_io.read_jsonl(str(path))
    return data_io.digests([torch.tensor(r, dtype=torch.int64) for r in recs[:n]])


class Split:
    """The test split: its first ``n`` 1024-token records, each's original dense NLL (float32, positions >= 256,
    :func:`studies.fresh_realtext.dense_per_sequence`) and source file (:func:`studies.controls_realtext
    .clusters_of`)."""

    def __init__(self, path: Path, n: int, *, model: Path):
        from kvpop.training import data as data_io

        from .controls_realtext import SEQ_LEN, clusters_of
        from .fresh_realtext import dense_per_sequence

        self.path, self.n = Path(path), n
        recs = data_io.read_jsonl(str(path), vocab_size=260)
        self.tokens = data_io.chunk(recs, SEQ_LEN, source=f"--split {path}")[:n]
        if len(self.tokens) < n:
            raise ValueError(f"--split {path} holds {len(self.tokens)} sequences of {SEQ_LEN} tokens, fewer than {n}")
        self.dense = dense_per_sequence(model, path, n, start=START)
        self.clusters = clusters_of(path, n)

    def ids(self):
        import torch

        return torch.stack([t.reshape(-1).long() for t in self.tokens])

    def values(self, dec: dict) -> list[float]:
        nll = -dec["log_probs"][:, START:]
        return [float(nll[i].mean()) - self.dense[i] for i in range(nll.shape[0])]


def served(base, run: Path, budget: int, window: int):
    """The run in ``run`` served as ``kvpop eval --run`` serves it (its model, scorers and head plan, the head
    budgets shared anew at ``budget``), in bfloat16 (``studies.equal_bytes.RealText.model``)."""
    import torch

    from kvpop.cli.trained import read_run
    from kvpop.evaluation import evaluate as E
    from kvpop.evaluation.trace_eval import load_model

    t = read_run(str(run))
    ft = load_model(t.model) if t.model is not None else None
    m = E.policy_model(base, t.policy, scorers=t.scorers, finetuned=ft, sinks=SINKS, window=window, budget=budget,
                       head_plan=t.head_plan)
    return m.to(torch.bfloat16)


def score(out: Path, split: Split, seeds, *, model: Path) -> TestLog:
    """Each (row, seed) once through ``OUT/test/test_log.jsonl``."""
    from kvpop.evaluation.trace_eval import load_model

    from .equal_bytes import decode

    tl = TestLog(Path(out) / "test")
    base = load_model(str(model))
    ids = split.ids()
    for s in seeds:
        for r in rows():
            key = f"{r['row']}|seed{s}"
            run = run_dir(out, r["trained_at"], s)

            def one(r=r, s=s, run=run) -> dict:
                d = decode(served(base, run, r["budget"], r["window"]), ids, None if r["dtype"] == BF16 else r["dtype"],
                           label=f"test {r['row']} seed {s}")
                per = split.values(d)
                print(f"[equal_bytes_trained] {r['row']} seed {s}: {sum(per) / len(per):+.4f} ({d['seconds']} s)",
                      flush=True)
                return {**r, "seed": s, "run": str(run), "per_sequence": per,
                        "bytes_per_sequence": d["bytes_per_sequence"], "decode_seconds": d["seconds"], "n": len(per)}

            tl.once(key, one)
    return tl


# ---------------------------------------------------------------------------------------------------------------
# the record
# ---------------------------------------------------------------------------------------------------------------

def figures(runs: dict) -> list[dict]:
    out = []
    for r in rows():
        seeds = runs.get(r["row"])
        if not seeds:
            continue
        per = {s: sum(v["per_sequence"]) / len(v["per_sequence"]) for s, v in sorted(seeds.items(),
                                                                                     key=lambda x: int(x[0]))}
        out.append({**r, "per_seed": per, "mean": sum(per.values()) / len(per), "min": min(per.values()),
                    "max": max(per.values()),
                    "bytes_per_sequence": next(iter(seeds.values()))["bytes_per_sequence"],
                    "decode_seconds": {s: v["decode_seconds"] for s, v in seeds.items()}})
    return out


def build_record(out: Path, split: Split, tl: TestLog, seeds, *, manifest: dict | None, overlap: dict,
                 commands: list[str], n_boot: int = 10_000) -> dict:
    runs: dict = {}
    for r in rows():
        for s in seeds:
            e = tl.entries.get(f"{r['row']}|seed{s}")
            if e is not None:
                runs.setdefault(r["row"], {})[s] = {**e["result"], "scored": e["date"]}
    missing = [f"{r['row']}|seed{s}" for r in rows() for s in seeds if f"{r['row']}|seed{s}" not in tl.entries]
    trained = {}
    for b in BUDGETS:
        for s in seeds:
            f = run_dir(out, b, s) / "train.json"
            if f.exists():
                trained.setdefault(str(b), {})[s] = json.loads(f.read_text())
    bts = check_bytes(runs)
    return {
        "study": "the 16-bit equal-bytes row trained at its budget (issue 61 item 3)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "metric": f"NLL increase over the original dense model (float32) on positions >= {START}, nats/token per "
                  f"sequence, lower is better",
        "row": "kvpop-mlp-joint[auto] (its recipe, retrained at each budget)",
        "recipe": {**RECIPE, "trained_by": "studies.controls_realtext.auto_trial (kvpop train in quarters of the "
                                           "steps, the fit score at the run's budget after each, the best fit "
                                           "state served)", "data": TRAIN, "valid_data": VALID},
        "budget": BUDGET, "b16": B16, "sinks": SINKS, "window": WINDOW,
        "decode": "token by token through KVpopCache, the sinks prefilled, every sequence of a scoring in one batch, "
                  "model in bfloat16 (studies.equal_bytes.decode)",
        "served_by": "kvpop.cli.trained.read_run(DIR) and kvpop.evaluation.evaluate.policy_model(base, policy, "
                     "scorers=, finetuned=DIR/model, sinks=4, window=32, budget=b, head_plan=), then "
                     ".to(torch.bfloat16)",
        "split": {"file": str(split.path), "records": split.n, "clusters": split.clusters,
                  "n_clusters": len(set(split.clusters)), "manifest": manifest, "overlap": overlap,
                  "dense_nll_original": {"mean": sum(split.dense) / len(split.dense), "per_sequence": split.dense}},
        "seeds": list(seeds), "training": trained, "bytes_per_sequence": bts,
        "test": {"rows": rows(), "runs": runs, "figures": figures(runs), "missing": missing,
                 "scorings": {k: 1 for k in tl.entries},
                 "comparisons": compare(runs, split.clusters, n_boot=n_boot) if not missing else []},
        "commands": commands}


def markdown(rec: dict) -> str:
    """The record's tables (never typed)."""
    f4 = "{:+.4f}".format
    out = [f"**{rec['study']}**: {rec['row']}, sinks {rec['sinks']}, window {rec['window']}; seeds "
           f"{', '.join(rec['seeds'])}; test split {rec['split']['file']} ({rec['split']['records']} records, "
           f"{rec['split']['n_clusters']} source files, positions >= {START}); {rec['metric']}", "",
           "training (auto_trial: best fit state of 4 validations over 250 steps):", "",
           "| trained at | seed | best step | fit scores | seconds |", "|---|---|---|---|---|"]
    for b, seeds in rec["training"].items():
        for s, t in sorted(seeds.items(), key=lambda x: int(x[0])):
            fits = ", ".join(f"{v['step']}: {v['fit_score']:.4f}" for v in t["validations"])
            out.append(f"| {b} | {s} | {t['best_step']} | {fits} | {t['seconds']} |")
    out += ["", "| row | trained at | bytes / sequence | vs int8@128 | seeds | mean | min .. max | per seed | decode s "
                "(per seed) |", "|---|---|---|---|---|---|---|---|---|"]
    ref = rec["bytes_per_sequence"].get(INT8)
    for f in rec["test"]["figures"]:
        ratio = "-" if not ref else f"{f['bytes_per_sequence'] / ref:.4f}"
        out.append(f"| {f['row']} | {f['trained_at']} | {f['bytes_per_sequence']:,.0f} | {ratio} | "
                   f"{len(f['per_seed'])} | {f4(f['mean'])} | {f4(f['min'])} .. {f4(f['max'])} | "
                   + ", ".join(f4(v) for v in f["per_seed"].values()) + " | "
                   + ", ".join(str(v) for v in f["decode_seconds"].values()) + " |")
    if rec["test"]["comparisons"]:
        out += ["", "| a | b | what | a - b | 95 % interval (files, seeds) | verdict | seeds paired | seed-level t "
                    "interval | seed-level verdict |", "|---|---|---|---|---|---|---|---|---|"]
        for c in rec["test"]["comparisons"]:
            ps, st = c["seeds_paired"], c["seed_t"]
            pss = "-" if ps is None else f"[{ps['ci95'][0]:+.4f}, {ps['ci95'][1]:+.4f}]"
            sts = "-" if st is None else f"[{st['ci95'][0]:+.4f}, {st['ci95'][1]:+.4f}] (n = {st['n_seeds']})"
            out.append(f"| {c['a']} | {c['b']} | {c['at']} | {c['mean_diff']:+.4f} | [{c['ci95'][0]:+.4f}, "
                       f"{c['ci95'][1]:+.4f}] | {c['strength']} | {pss} | {sts} | "
                       f"{'-' if st is None else st['verdict']} |")
    if rec["test"]["missing"]:
        out += ["", f"not scored: {', '.join(rec['test']['missing'])}"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------------

def log_command(out: Path, command: str) -> list[str]:
    """``command`` appended, dated, to ``OUT/commands.json`` (every stage's); the list."""
    cpath = Path(out) / "commands.json"
    commands = json.loads(cpath.read_text()) if cpath.exists() else []
    commands.append(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  {command}")
    write_json(cpath, commands)
    return commands


def test(out: Path, split_path: Path, seeds, *, n: int, record: Path, command: str, model: str = MODEL,
         data: str = TRAIN, valid: str = VALID) -> dict:
    """Score, then write ``RECORD/equal_bytes_trained.json`` and ``.md``; the split is refused when one of its
    records is a record of the train split (``data``) or of validation (``valid``)."""
    out = Path(out)
    for s in seeds:
        for b in BUDGETS:
            if not (run_dir(out, b, s) / "train.json").exists():
                raise ValueError(f"seed {s} at B = {b} is not trained ({run_dir(out, b, s)}): run the train stage")
    have = digests(split_path, n)
    overlap = {"train": {"file": data, "records_shared": len(have & digests(data))},
               "validation": {"file": valid, "records_shared": len(have & digests(valid))}}
    for k, v in overlap.items():
        if v["records_shared"]:
            raise ValueError(f"--split {split_path}: {v['records_shared']} of its records are in the {k} split")
    mf = Path(split_path).parent / "manifest.json"
    manifest = json.loads(mf.read_text()) if mf.exists() else None
    commands = log_command(out, command)
    split = Split(split_path, n, model=Path(model))
    tl = score(out, split, seeds, model=Path(model))
    rec = build_record(out, split, tl, seeds, manifest=manifest, overlap=overlap, commands=commands)
    record = Path(record)
    record.mkdir(parents=True, exist_ok=True)
    write_json(record / "equal_bytes_trained.json", rec)
    (record / "equal_bytes_trained.md").write_text(markdown(rec))
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.equal_bytes_trained", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="one (budget, seed) of the recipe into OUT/runs/B{budget}/seed{seed}")
    t.add_argument("--out", required=True)
    t.add_argument("--budget", type=int, required=True, help=f"one of {', '.join(map(str, BUDGETS))}")
    t.add_argument("--seed", required=True, help=f"one of {', '.join(SEEDS)}")
    q = sub.add_parser("test", help="score every (row, seed) once and write the record")
    q.add_argument("--out", required=True, help="the train stage's OUT (the runs, the test log)")
    q.add_argument("--split", required=True, help="the test split (a realtext_corpus JSONL; its manifest beside)")
    q.add_argument("--n", type=int, default=48, help="its first N records (default 48)")
    q.add_argument("--seeds", default=",".join(SEEDS), help="comma-separated (default 0,1,2)")
    q.add_argument("--record", required=True, help="where equal_bytes_trained.json / .md are written")
    for x in (t, q):
        x.add_argument("--data", default=TRAIN, help=f"the train split (default {TRAIN})")
        x.add_argument("--valid-data", default=VALID, help=f"validation (default {VALID})")
    a = parse(p, argv)  # the one write rule: --write-shipped for a path the project ships
    shipped = getattr(a, "write_shipped", False)
    try:
        import torch

        torch.set_num_threads(1)
        out = check_out_dir(a.out, write_shipped=shipped)
        for flag, path in (("--data", a.data), ("--valid-data", a.valid_data)):
            if not Path(path).is_file():  # the defaults are the files the study used on its machine
                raise ValueError(f"{flag} {path}: no such file; build the real-text train split with python -m "
                                 f"studies.realtext_corpus --out CORPUS --splits train and pass {flag}")
        if a.cmd == "train":
            if a.budget not in BUDGETS or a.seed not in SEEDS:
                raise ValueError(f"--budget {a.budget} --seed {a.seed}: allowed budgets {BUDGETS}, seeds {SEEDS}")
            log_command(out, " ".join(["python -m studies.equal_bytes_trained",
                                       *(argv if argv is not None else sys.argv[1:])]))
            r = train(out, a.budget, a.seed, data=a.data, valid=a.valid_data)
            print(json.dumps({k: r[k] for k in ("budget", "seed", "best_step", "steps", "seconds")}))
            return 0
        record = check_out_dir(a.record, "--record", write_shipped=shipped)
        seeds = [s for s in a.seeds.split(",") if s]
        if not seeds or any(s not in SEEDS for s in seeds):
            raise ValueError(f"--seeds {a.seeds}: allowed {', '.join(SEEDS)}")
        cmd = " ".join(["python -m studies.equal_bytes_trained", *(argv if argv is not None else sys.argv[1:])])
        rec = test(out, Path(a.split), seeds, n=a.n, record=record, command=cmd, data=a.data, valid=a.valid_data)
    except (ValueError, OSError) as e:
        print(f"python -m studies.equal_bytes_trained: error: {e}", file=sys.stderr)
        return 2
    print(markdown(rec), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
