"""The real-text rows' one scoring on a fresh test split (issue 43 item 3, item 5; issue 44 item 1).

The final rows of the same-structure controls (``controls.json``: ``kvpop-mlp-joint[auto]``, the four
``fixed-finetune[...]`` controls at the learning rate validation chose, ``oracle[label]``, each with its seeds),
the dense fine-tune (``fixed-finetune[dense]``: the control's ``kvpop train`` at budget 1,023 of 1,024, the most
``kvpop train`` allows) and untrained StreamingLLM, scored on ``kvpop/data/realtext/test_fresh2.jsonl`` (no
earlier split's file, nothing scored it before) through ``kvpop eval --data ... --run DIR`` at B = 64 / 128 /
256, sinks 4, window 32, positions >= 256, against the original dense model; and against the row's own weights
served densely (each sequence's dense NLL of ``DIR/model`` minus the original's, :func:`dense_per_sequence`).

Every (row, seed) is scored through one :class:`studies.ledger.TestLog` (``OUT/test_log.jsonl``): at most once,
ever.  ``--record`` scores nothing: it reads the log and writes the record (figures, paired intervals).

``--split FILE`` scores another fresh split (``test_fresh3``: issue 44's final rows), ``--tag TEXT`` names rows
whose recipe departs from the controls record's the same way (``--tag "lm 0.1"``: ``fixed-finetune[streaming,
lm 0.1]``), with ``--controls`` a record of the same form holding those rows' seed directories.

    python -m studies.fresh_realtext --out DIR --controls studies/results/evidence/realtext/controls.json \\
        --dense-ft RUNS/fixed-finetune[dense]/lr1e-4 [--only ROW ...]
    python -m studies.fresh_realtext --out DIR --controls ... --dense-ft ... --record FILE
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .controls_realtext import (
    AUTO_ROW,
    EVAL_BUDGETS,
    ORACLE,
    SEQ_LEN,
    SINKS,
    STREAMING_CONTROL,
    WINDOW,
    clusters_of,
    per_sequence,
)
from .ledger import TestLog, check_ledger_runs, run_logged, write_json
from .paths import DATA, ROOT, parse

MODEL = DATA / "tiny_qwen3_code"
SPLIT = DATA / "realtext" / "test_fresh2.jsonl"
N_RECORDS = 48
DENSE_FT = "fixed-finetune[dense]"
UNTRAINED = "streaming"
CONTROLS = ("fixed-finetune[streaming]", "fixed-finetune[random]", "fixed-finetune[keynorm]",
            "fixed-finetune[window-attention]")
DMS_ROW = "dms[tuned]"
"""DMS, the learned rival, at the settings its real-text search chose (``selection.json``'s ``dms.rechosen``):
scored only where a controls record lists its runs (issue 44 item 4's larger model)."""
ROWS = (AUTO_ROW, *CONTROLS, ORACLE, DENSE_FT, UNTRAINED)
"""Every row scored by default, in the order they are scored (the KVpop row and its first control first)."""
ORDER = (AUTO_ROW, *CONTROLS, ORACLE, DMS_ROW, DENSE_FT, UNTRAINED)
"""Every row a record can hold (:data:`ROWS` and DMS), in the record's order."""
STEPS = {DMS_ROW: 600}
"""Training steps of rows that did not train the controls' 250."""
NOT_CAUSAL = (ORACLE,)
"""Rows whose priority reads the future (an upper bound, not a policy a decoder can run)."""


def dense_per_sequence(model_dir: Path, data: Path, n: int, *, seq_len: int = SEQ_LEN,
                       start: int = max(EVAL_BUDGETS)) -> list[float]:
    """Each of the first ``n`` sequences' dense NLL (nats/token) over the positions ``kvpop eval --data`` scores
    (predictions from position ``start`` on: the largest budget), by the code it scores with
    (``policy_logits(..., "dense")``, ``sequence_scores``), the records cut as ``kvpop eval --seq-len`` cuts them."""
    import torch

    from kvpop.evaluation.evaluate import policy_logits
    from kvpop.evaluation.trace_eval import load_model, sequence_scores
    from kvpop.training import data as data_io

    model = load_model(str(model_dir))
    records = data_io.read_jsonl(str(data), vocab_size=model.config.vocab_size)
    traces = data_io.chunk(records, seq_len, source=f"--data {data}")[:n]
    if len(traces) < n:
        raise ValueError(f"{data} holds {len(traces)} sequences of {seq_len} tokens, fewer than n={n}")
    out = []
    with torch.no_grad():
        for t in traces:
            t = t.reshape(-1).long()
            nll, _ = sequence_scores(policy_logits(model, t, "dense"), t, 0)
            out.append(float(nll[start:].mean()))
    return out


def eval_command(run: Path | None, policy: str, data: Path, n: int, out: Path, model: Path = MODEL) -> list[str]:
    """``kvpop eval --data`` of one (row, seed), as the controls' evaluations ran (``studies/controls_realtext``'s
    ``eval_args``) on ``n`` sequences of ``data``; ``model``: the base model (the original dense reference)."""
    return ["kvpop", "eval", "--model", str(model), "--data", str(data), "--seq-len", str(SEQ_LEN),
            "--budgets", ",".join(map(str, EVAL_BUDGETS)), "--sinks", str(SINKS), "--window", str(WINDOW),
            "--n-sequences", str(n), "--no-plot", "--no-progress", "--threads", "1",
            *(["--run", str(run)] if run is not None else []), "--policies", f"dense,{policy}", "--out", str(out)]


def same_weights(vs_original: dict[int, list[float]], shift: list[float]) -> dict[int, list[float]]:
    """Per-sequence increase over the row's own weights served densely: over the original minus the dense shift
    (the row's dense NLL minus the original's, on the same positions)."""
    for b, v in vs_original.items():
        if len(v) != len(shift):
            raise ValueError(f"B={b}: {len(v)} sequences against a dense shift of {len(shift)}")
    return {b: [x - s for x, s in zip(v, shift)] for b, v in vs_original.items()}


def run_dirs(controls: dict, dense_ft: Path | None, rows: tuple[str, ...] | None = None
             ) -> dict[str, dict[int, Path | None]]:
    """``{row: {seed: run directory}}`` of :data:`ROWS` (``None``: no run, the untrained rule); ``rows``: only
    these of the KVpop row, the controls and the oracle (the KVpop row always; the untrained rule always)."""
    out: dict[str, dict[int, Path | None]] = {}
    trained = (AUTO_ROW, *CONTROLS, ORACLE, DMS_ROW)
    if rows is not None and (bad := [r for r in rows if r not in trained]):
        raise ValueError(f"--rows {bad}: not a trained row (rows: {', '.join(trained)})")
    for row in trained:
        if row == DMS_ROW and rows is None:
            continue  # DMS only where asked for by name
        if rows is not None and row != AUTO_ROW and row not in rows:
            continue
        seeds = controls["runs"].get(row)
        if not seeds:
            raise ValueError(f"controls.json has no runs of {row}")
        out[row] = {int(s): Path(r["dir"]) for s, r in seeds.items()}
    if dense_ft is not None:
        out[DENSE_FT] = {int(d.name[4:]): d for d in sorted(Path(dense_ft).glob("seed*")) if (d / "done").exists()}
    out[UNTRAINED] = {0: None}
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it, else as given."""
    where = Path(path).resolve()
    return str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else str(path)


def view_of(run: Path, view: Path, model: Path = MODEL) -> tuple[Path, str | None]:
    """``run`` itself when its base model (``args.json``'s ``model``) is still there; else ``view``: a directory of
    links to every file of ``run`` but ``args.json``, which is ``run``'s with ``model`` set to ``model`` (a run whose
    base was the shipped model in a worktree since removed; the shipped model's files are the same bytes, which
    the caller must have checked).  Returns the directory and the base it replaced (None: none)."""
    args = json.loads((run / "args.json").read_text())
    base = args.get("model")
    if not isinstance(base, str) or Path(base).is_dir():
        return run, None
    if view.exists():
        if json.loads((view / "args.json").read_text()).get("model") != str(model):
            raise ValueError(f"{view} is there with another base model than {model}")
        return view, base
    view.mkdir(parents=True)
    for f in run.iterdir():
        if f.name not in ("args.json", "last.pt"):
            (view / f.name).symlink_to(f.resolve())
    (view / "args.json").write_text(json.dumps({**args, "model": str(model)}, indent=1))
    return view, base


def tagged(row: str, tag: str | dict[str, str] | None) -> str:
    """``row``'s name in a record whose rows' recipe departs from the controls record's by ``tag`` (one for every
    row, or ``{row: tag}``; untrained StreamingLLM has no recipe to depart from, so only a dict naming it tags it,
    e.g. with its base model): ``kvpop-mlp-joint[auto]`` -> ``kvpop-mlp-joint[auto, TAG]``."""
    if isinstance(tag, dict):
        tag = tag.get(row)  # a dict may tag untrained StreamingLLM too (a base model's name, not a recipe)
    elif row == UNTRAINED:
        tag = None
    if not tag:
        return row
    return f"{row[:-1]}, {tag}]" if row.endswith("]") else f"{row}[{tag}]"


def policy_of(row: str) -> str:
    return {UNTRAINED: "streaming", STREAMING_CONTROL: "fixed-finetune", DENSE_FT: "fixed-finetune",
            DMS_ROW: "dms"}.get(
        row, "kvpop-mlp-joint")


def score_all(out: Path, dirs: dict, *, data: Path = SPLIT, n: int = N_RECORDS, only=None,
              model: Path = MODEL) -> dict:
    """Score every (row, seed) of ``dirs`` (of ``only`` when given) not yet in the test log, each once; returns
    ``{"original": [...], "rows": {row: {seed: result}}}`` of what the log holds.  A run whose base model is gone
    is served through :func:`view_of` (``OUT/views/<row>/seed<s>``)."""
    tl = TestLog(out)
    log = out / "commands.log"
    orig = tl.once("dense|original", lambda: {"dense_nll": dense_per_sequence(model, data, n)})["dense_nll"]
    rows: dict[str, dict[int, dict]] = {}
    order = [*(r for r in (only or ()) if r in dirs), *(r for r in dirs if r not in (only or ()))]
    for row in order:  # --only's rows in its order
        for s, d in dirs[row].items():
            key = f"{row}|seed{s}"
            if key not in tl.entries and only is not None and row not in only:
                continue

            def evaluate(row=row, s=s, d=d, key=key) -> dict:
                if d is not None:
                    d = view_of(d, out / "views" / row / f"seed{s}", model)[0]
                o = out / "test" / row / f"seed{s}"
                cmd = eval_command(d, policy_of(row), data, n, o, model)
                if not (o / "results.json").exists():
                    run_logged(cmd, log, name=f"test {row} seed {s}")
                res = json.loads((o / "results.json").read_text())
                vo = per_sequence(res, policy_of(row))
                own = orig if d is None else dense_per_sequence(d / "model", data, n)
                dense_mean = next(r["dense_nll"] for r in res["rows"] if "dense_nll" in r)
                if abs(dense_mean - sum(orig) / n) > 1e-6:
                    raise ValueError(f"{key}: kvpop eval's dense NLL {dense_mean} is not the original's "
                                     f"{sum(orig) / n} on the same positions")
                shift = [a - b for a, b in zip(own, orig)]
                return {"dir": None if d is None else str(d), "command": " ".join(cmd),
                        "vs_original": {str(b): v for b, v in vo.items()},
                        "vs_same_weights": {str(b): v for b, v in same_weights(vo, shift).items()},
                        "dense_shift": shift, "dense_nll_original": sum(orig) / n, "dense_nll_same_weights":
                            sum(own) / n}

            rows.setdefault(row, {})[s] = tl.once(key, evaluate)
    return {"original": orig, "rows": rows, "log": tl}


def row_values(r: dict, row: str, b: int, ref: str) -> list[float]:
    """A (row, seed)'s per-sequence values at ``b`` against ``ref`` (``original`` / ``same weights``): the dense
    fine-tune's row is its weights served densely (its dense shift, at every budget; against its own weights 0)."""
    if row == DENSE_FT:
        return list(r["dense_shift"]) if ref == "original" else [0.0] * len(r["dense_shift"])
    return list(r["vs_original" if ref == "original" else "vs_same_weights"][str(b)])


def record(scored: dict, *, data: Path = SPLIT, n: int = N_RECORDS, n_boot: int = 10_000,
           tag: str | dict[str, str] | None = None, model: Path = MODEL) -> dict:
    """The record: per (row, budget) the per-seed means against the original and the same weights, and the paired
    intervals (clustered by source file, over sequences and seeds) of the KVpop row against every other row, and
    of ``oracle[label]`` against the fixed-mask control, at every budget, against both references.  Rows are
    named by :func:`tagged` (``base``: the name in :data:`ROWS`); the test log's keys stay the base names."""
    from .paired import comparison

    rows = scored["rows"]
    clusters = clusters_of(data, n)
    figures = []
    for row in ORDER:
        if row not in rows:
            continue
        for b in EVAL_BUDGETS:
            f = {"row": tagged(row, tag), "base": row, "budget": b, "seeds": sorted(rows[row]),
                 "not_causal": row in NOT_CAUSAL}
            for ref, key in (("original", "vs_original"), ("same weights", "vs_same_weights")):
                per_seed = {s: sum(row_values(rows[row][s], row, b, ref)) / n for s in sorted(rows[row])}
                f[key] = per_seed
                f[f"{key}_mean"] = sum(per_seed.values()) / len(per_seed)
            f["dense_shift_mean"] = sum(sum(r["dense_shift"]) / n for r in rows[row].values()) / len(rows[row])
            figures.append(f)
    comps = []
    pairs = [(AUTO_ROW, b) for b in ORDER if b != AUTO_ROW] + [(ORACLE, STREAMING_CONTROL)]
    for a, other in pairs:
        if a not in rows or other not in rows:
            continue
        for b in EVAL_BUDGETS:
            for ref in ("original", "same weights"):
                if other == DENSE_FT and ref == "same weights":
                    continue  # the dense fine-tune served densely is its own weights' dense cache: 0 by definition
                va = [row_values(rows[a][s], a, b, ref) for s in sorted(rows[a])]
                vb = [row_values(rows[other][s], other, b, ref) for s in sorted(rows[other])]
                c = comparison(instrument="realtext", budget=b, a=tagged(a, tag), b=tagged(other, tag), values_a=va,
                               values_b=vb, lower_is_better=True, clusters=clusters, n_boot=n_boot)
                comps.append({**c, "seeds": {"a": len(va), "b": len(vb)}, "reference": ref,
                              "split": data.stem})
    tl = scored["log"]
    scorings = {k: 1 for k in tl.entries}
    split_file = _shown(data)
    return {"instrument": "realtext", "split": data.stem, "split_file": split_file,
            "n_sequences": n, "clusters": clusters, "tag": tag, "settings": {
                "model": _shown(model), "seq_len": SEQ_LEN, "sinks": SINKS, "window": WINDOW,
                "budgets": list(EVAL_BUDGETS),
                "scored_from": max(EVAL_BUDGETS), "metric": "NLL increase over dense (nats/token), lower is better"},
            "original_dense_nll": {"mean": sum(scored["original"]) / n, "per_sequence": scored["original"]},
            "scorings": scorings, "not_causal": list(NOT_CAUSAL), "figures": figures, "comparisons": comps,
            "runs": {tagged(row, tag): {str(s): r for s, r in rows[row].items()} for row in ORDER if row in rows}}


LEGENDS = {
    AUTO_ROW: "kvpop train --auto's real-text choice (MLP scorer and model together, mean label, head budgets by "
              "ablation, scorer lr 1e-3, model lr 1e-4; 6 trials), its best fit state of 250 steps",
    "fixed-finetune[streaming]": "the same fine-tune (250 steps, data, model lr chosen on validation) under the fixed "
                                 "StreamingLLM mask",
    "fixed-finetune[random]": "the same slots and fine-tune, priority a frozen seeded untrained scorer",
    "fixed-finetune[keynorm]": "the same slots and fine-tune, priority the pre-RoPE key norm (sign chosen on "
                               "validation)",
    "fixed-finetune[window-attention]": "the same slots and fine-tune, priority the attention the token got from "
                                        "the window's queries",
    ORACLE: "the same slots and fine-tune, priority the exact mean label (reads the future: an upper bound, not "
            "causal)",
    DENSE_FT: "the control's kvpop train at budget 1,023 of 1,024 (no eviction but at the last query), served densely",
    DMS_ROW: "DMS (learned per-token eviction gates, the model fine-tuned with them) at the settings its real-text "
             "search chose on validation (gate lr 1e-2, model lr 3e-4, 600 steps, target keep 0.125)",
    UNTRAINED: "StreamingLLM, no training (deterministic: one scoring)",
}


def ledger_rows(rec: dict, trials: dict[str, int]) -> dict:
    """``{"rows", "comparisons"}`` for the ledger from a :func:`record`: one row per (row, budget) of the fresh
    split (``split``, ``per_sequence`` against the original dense model, ``headline`` false: the README's headline
    table keeps the rows it had), and the record's comparisons in the ledger's keys.  ``trials``: the validation
    trials each row's settings were chosen by."""
    from .ledger import summarize

    n, split = rec["n_sequences"], rec["split"]
    rows = []
    for f in rec["figures"]:
        name, row, b = f["row"], f.get("base", f["row"]), f["budget"]
        runs = rec["runs"][name]
        seeds = sorted(runs, key=int)
        per = [row_values(runs[s], row, b, "original") for s in seeds]
        vals = [sum(x) / n for x in per]
        t = rec.get("tag")
        legend = LEGENDS[row] + (f"; {t.get(row) if isinstance(t, dict) else t}" if name != row else "")
        rows.append({"instrument": "realtext", "policy": name, "recipe": {
                         "runs": {s: runs[s]["dir"] for s in seeds}, "commands": {s: runs[s]["command"] for s in seeds},
                         "sinks": SINKS, "window": WINDOW, "trained_at": None if row == UNTRAINED else 128},
                     "steps": None if row == UNTRAINED else STEPS.get(row, 250), "seeds": vals, **summarize(vals),
                     "value": summarize(vals)["mean"], "metric": "delta_nll", "trials": trials.get(name, 0),
                     "test_evaluations": rec["scorings"].get(f"{row}|seed{seeds[0]}", 0), "budget": b,
                     "budget_fraction": b / SEQ_LEN, "headline": False, "legend": legend, "split": split,
                     "per_sequence": per, "reference": "the original dense model", "not_causal": row in NOT_CAUSAL,
                     "test_sequences": f"{n} records of {rec['split_file']}, scored from position "
                                       f"{rec['settings']['scored_from']}"})
    keep = ("instrument", "budget", "a", "b", "mean_diff", "ci95", "n_sequences", "n_clusters", "seeds", "method",
            "split", "reference", "verdict", "lower_is_better", "n_boot", "seed")
    return {"rows": rows, "comparisons": [{k: c[k] for k in keep if k in c} for c in rec["comparisons"]]}


def markdown(rec: dict) -> str:
    """The record's tables (evidence.md): per row and budget the mean over seeds (min .. max) against the original
    dense model and against the row's own weights served densely, with the dense shift; then every interval."""
    def cell(per_seed: dict) -> str:
        v = list(per_seed.values())
        m = sum(v) / len(v)
        return f"{m:+.4f}" + (f" ({min(v):+.4f} .. {max(v):+.4f})" if len(v) > 1 else "")

    fig = {(f["row"], f["budget"]): f for f in rec["figures"]}
    rows = list(dict.fromkeys(f["row"] for f in rec["figures"]))
    bs = sorted({f["budget"] for f in rec["figures"]})
    head = " | ".join(f"B={b} {ref}" for b in bs for ref in ("vs original", "vs same weights"))
    out = [f"| row | seeds | {head} | dense shift |", "|---|---|" + "---|" * (2 * len(bs) + 1)]
    for r in rows:
        f0 = fig[(r, bs[0])]
        name = f"{r} (not causal)" if f0["not_causal"] else r
        cells = " | ".join(cell(fig[(r, b)][k]) for b in bs for k in ("vs_original", "vs_same_weights"))
        out.append(f"| {name} | {len(f0['seeds'])} | {cells} | {f0['dense_shift_mean']:+.4f} |")
    out += ["", "| B | reference | a | b | a - b | 95 % interval | seeds a / b | verdict |",
            "|---|---|---|---|---|---|---|---|"]
    for c in rec["comparisons"]:
        out.append(f"| {c['budget']} | {c['reference']} | {c['a']} | {c['b']} | {c['mean_diff']:+.4f} | "
                   f"[{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}] | {c['seeds']['a']} / {c['seeds']['b']} | "
                   f"{c['verdict']} |")
    return "\n".join(out) + "\n"


def write_ledger_runs(dest: Path, rec: dict, controls: dict) -> Path:
    """``dest/realtext/evidence_rows.json``: the shipped archive's real-text rows (the earlier split's, as they
    are) with :func:`ledger_rows` of ``rec`` (trials: ``controls``' ``trials_of``), checked by the ledger's rules
    before it is written; the archive's other records copied beside it (:func:`studies.ledger.write_split_rows`)."""
    from .ledger import write_split_rows

    return write_split_rows(dest, "realtext", rec["split"], ledger_rows(rec, {**controls.get("trials_of", {})}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.fresh_realtext", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory: the test log, evaluations and commands")
    p.add_argument("--controls", required=True, help="controls.json (its runs: the final rows' seed directories)")
    p.add_argument("--dense-ft", default=None, help="the dense fine-tune's seed directories' parent")
    p.add_argument("--only", nargs="*", default=None, help="score only these rows (a second process takes others)")
    p.add_argument("--record", default=None,
                   help="score nothing: write the record (FILE.json) and its tables (FILE.md) from the test log")
    p.add_argument("--ledger-runs", default=None,
                   help="--record: also write DIR/realtext/evidence_rows.json, the shipped archive's real-text rows "
                        "with the fresh split's rows and comparisons (ledger_rows), and copy the archive's other "
                        "records there, for python -m studies.evidence ledger --runs DIR")
    p.add_argument("--rows", nargs="*", default=None,
                   help="only these trained rows (besides the KVpop row and untrained StreamingLLM): a smaller "
                        "comparison, e.g. on a second corpus")
    p.add_argument("--split", default=str(SPLIT), help=f"the fresh split scored (default {SPLIT.name})")
    p.add_argument("--tag", default=None, help="how every row but untrained StreamingLLM departs from the controls "
                                               "record's recipe, put in their names (tagged; default: the "
                                               "record's own \"tags\", {row: tag}, if it has them)")
    p.add_argument("--model", default=str(MODEL),
                   help="the base model every row was fine-tuned from and the original dense reference (default the "
                        "shipped tiny_qwen3_code; issue 44 item 4: the pre-trained 3M-parameter model)")
    p.add_argument("--partial", action="store_true",
                   help="--record: write what is scored, the rest named in the record's missing (else refused)")
    a = parse(p, argv)
    try:
        out, data, model = Path(a.out), Path(a.split), Path(a.model)
        if not data.is_file():
            raise ValueError(f"--split {data}: no such file")
        if not (model / "config.json").is_file():
            raise ValueError(f"--model {model}: no config.json there (a model directory is needed)")
        controls = json.loads(Path(a.controls).read_text())
        tag = a.tag if a.tag is not None else controls.get("tags")
        dirs = run_dirs(controls, Path(a.dense_ft) if a.dense_ft else None,
                        None if a.rows is None else tuple(a.rows))
        if a.only is not None and (bad := [r for r in a.only if r not in ORDER]):
            raise ValueError(f"--only {bad}: not a row (rows: {', '.join(ORDER)})")
        if a.record:
            if a.ledger_runs:  # before the record is written: nothing half done
                check_ledger_runs(a.ledger_runs, "realtext")
            tl = TestLog(out)
            missing = [f"{r}|seed{s}" for r, ss in dirs.items() for s in ss if f"{r}|seed{s}" not in tl.entries]
            if missing and not a.partial:
                raise ValueError(f"not scored yet: {', '.join(missing)}; --record writes only a complete record "
                                 f"(or give --partial)")
            rec = {**record(score_all(out, dirs, data=data, only=(), model=model), data=data, tag=tag, model=model),
                   "missing": missing}
            write_json(Path(a.record), rec)
            Path(a.record).with_suffix(".md").write_text(markdown(rec))
            if a.ledger_runs:
                write_ledger_runs(Path(a.ledger_runs), rec, json.loads(Path(a.controls).read_text()))
            return 0
        score_all(out, dirs, data=data, only=a.only, model=model)
        return 0
    except ValueError as e:
        print(f"fresh_realtext: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
