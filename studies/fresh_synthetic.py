"""The synthetic instruments' final rows scored once on a fresh test split (issue 43 item 3, kvtrace and lookahead).

The rows of the same-structure controls' record (``evidence/<task>/controls.json``, :mod:`studies.controls_synthetic`,
which trained every (row, seed) and scored validation only): the best KVpop row, the four ``fixed-finetune[...]``
controls at the model learning rate validation chose, ``oracle[label]`` (not causal: an upper bound), ``dms[tuned]``
at the gate threshold calibrated on validation, each with its seeds (0-2) as trained there (nothing is retrained),
untrained StreamingLLM and the dense model (deterministic: one scoring each).  Each is scored per sequence
(accuracy at the graded positions, teacher-forced, as the controls were scored:
:func:`studies.controls_synthetic.sequence_accuracies`) on ``N_TEST`` fresh test sequences
``test_seed(FRESH2_FIRST + i)`` at the task's L_train and headline budget (kvtrace B = 128 of 2,048, lookahead
B = 64 of 512), sinks 4, window 32.

**Why the seeds are fresh** (:func:`earlier_ranges`): every earlier test scoring of these tasks drew
``test_seed(first + i)`` with ``first`` 0 (the demo's tables ``0..5``, the label study's ``0..63``, the shipped
models' dense checks ``0..31``, the benchmarks' few prompts) or ``FRESH_FIRST`` = 10,000 (the ledger's
``10000..10007``, then ``studies.auto_task_test`` on the same); ``FRESH2_FIRST`` = 20,000 lies above both, and
``test_seed`` is disjoint from ``train_seed`` and ``valid_seed`` by construction (``kvpop.demo.task``: test seeds
from 1e9, validation from 1.5e9), so no training, selection, calibration or earlier test read these sequences.

Every (row, seed) is scored through one :class:`studies.ledger.TestLog` (``OUT/test_log.jsonl``): at most once,
ever; a repeated or resumed call reads the log.  Then the record ``OUT/fresh_test.json`` (per-sequence values, the
figures, the paired intervals (:func:`studies.paired.comparison`, every sequence its own cluster, over seeds) of
the KVpop row against every other row but dense, and of ``oracle[label]`` against ``fixed-finetune[streaming]``),
its tables (``.md``) and, with ``--ledger-runs DIR``, ``DIR/<task>/evidence_rows.json``: the shipped archive's rows
with this split's (``split: test_fresh2``, ``per_sequence``, not headline) and their ``comparisons``, for
``python -m studies.evidence ledger --runs DIR``::

    python -m studies.fresh_synthetic --task kvtrace --out runs/fresh_syn/kvtrace          # scores, then records
    python -m studies.fresh_synthetic --task kvtrace --out runs/fresh_syn/kvtrace --record-only \\
        --record studies/results/evidence/kvtrace/fresh_test.json --ledger-runs runs/fresh_syn/ledger
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from .controls_synthetic import CONTROLS, DMS_ROW, ORACLE, STREAMING_CONTROL, comparisons, figures, mean
from .evidence_synthetic import FRESH_FIRST
from .fresh_realtext import LEGENDS as REALTEXT_LEGENDS
from .ledger import TestLog, summarize, write_json
from .paths import parse

SPLIT = "test_fresh2"
"""The split's name in the ledger (the synthetic tasks' first fresh split was ``test_seed(10000..10007)``)."""
FRESH2_FIRST = 20_000
N_TEST = 128
"""Test sequences per task (8x the 16 of each validation part: each scoring takes seconds to a minute)."""
EARLIER_FIRSTS = (0, FRESH_FIRST)
"""The first test index of every earlier scoring of the synthetic tasks (module docstring)."""
EARLIER_SPAN = FRESH2_FIRST - FRESH_FIRST
"""Each earlier range is shorter than this (the longest: ``test_seed(0..63)``)."""
FINETUNED = tuple(r for r in CONTROLS if r != ORACLE)
UNTRAINED, DENSE = "streaming", "dense"
NOT_CAUSAL = (ORACLE,)
WHY_FRESH = ("every earlier test scoring of the synthetic tasks drew test_seed(first + i) with first 0 (the demo's "
             "tables 0..5, the label study's 0..63, the shipped models' dense checks 0..31, the benchmarks' few "
             "prompts) or 10000 (the ledger's 10000..10007, then studies.auto_task_test on the same); this split "
             "starts at 20000, above both; test seeds are disjoint from training and validation seeds by "
             "construction (kvpop.demo.task: test seeds from 1e9, validation from 1.5e9)")
"""The record's sentence on why the split is fresh (:func:`earlier_ranges` holds the ranges)."""


def rows_of(kvpop_name: str) -> tuple[str, ...]:
    """Every row scored, in order: the KVpop row, the fine-tuned controls, the oracle, DMS, StreamingLLM, dense."""
    return (kvpop_name, *FINETUNED, ORACLE, DMS_ROW, UNTRAINED, DENSE)


def test_seeds(mod, n: int = N_TEST) -> list[int]:
    """The split's seeds: ``test_seed(FRESH2_FIRST + i)``, ``i < n``."""
    return [mod.test_seed(FRESH2_FIRST + i) for i in range(n)]


def earlier_ranges(n_ledger: int = 8) -> list[tuple[int, int]]:
    """``[(first, last)]`` test indices the earlier scorings may have used (module docstring)."""
    return [(f, f + (n_ledger if f == FRESH_FIRST else EARLIER_SPAN) - 1) for f in EARLIER_FIRSTS]


def check_disjoint(first: int, n: int, ranges) -> None:
    """ValueError naming the range when ``first .. first + n - 1`` meets one of ``ranges``."""
    for lo, hi in ranges:
        if first <= hi and lo <= first + n - 1:
            raise ValueError(f"test_seed({first}..{first + n - 1}) meets the earlier test_seed({lo}..{hi})")


def run_table(controls: dict) -> dict[str, dict[str, dict]]:
    """``{row: {seed: run}}`` of :func:`rows_of` from the controls' record (``run``: its ``dir``, ``policy``,
    ``settings``, ``threshold`` as trained and calibrated on validation); ValueError naming a missing row."""
    name = controls["kvpop_row"]["name"]
    out = {}
    for row in rows_of(name)[:-1]:
        seeds = controls["runs"].get(row)
        if not seeds:
            raise ValueError(f"controls.json has no runs of {row}")
        out[row] = {s: {k: r[k] for k in ("dir", "policy", "settings", "threshold", "lr_model") if k in r}
                    for s, r in sorted(seeds.items(), key=lambda x: int(x[0]))}
    if (p := out[UNTRAINED]["0"]["policy"]) != "streaming":
        raise ValueError(f"controls.json's streaming row serves {p!r}, not streaming")
    out[DENSE] = {"0": {"dir": None, "policy": "dense"}}
    return out


def score_all(out: Path, table: dict, evaluate, *, n: int, first: int = FRESH2_FIRST) -> TestLog:
    """Score every (row, seed) of ``table`` not yet in ``out``'s test log, each once: ``evaluate(row, seed, run)``
    returns the per-sequence accuracies; the log keeps them with the run, the split and the time.  Returns the
    log."""
    tl = TestLog(out)
    for row, seeds in table.items():
        for s, run in seeds.items():
            def one(row=row, s=s, run=run) -> dict:
                t0 = time.time()
                per = evaluate(row, s, run)
                if len(per) != n:
                    raise ValueError(f"{row} seed {s}: {len(per)} values for {n} sequences")
                print(f"[fresh {row} seed {s}] {mean(per):.4f} ({time.time() - t0:.1f} s)", flush=True)
                return {"per_sequence": per, "first": first, "n": n, "run": run}

            tl.once(f"{row}|seed{s}", one)
    return tl


def missing(tl: TestLog, table: dict) -> list[str]:
    return [f"{r}|seed{s}" for r, ss in table.items() for s in ss if f"{r}|seed{s}" not in tl.entries]


def record(task: str, controls: dict, tl: TestLog, table: dict, *, n: int, first: int = FRESH2_FIRST,
           n_boot: int = 10_000) -> dict:
    """The record from the test log (refused unless every (row, seed) of ``table`` is logged, on this split):
    per-sequence values, the figures, and the intervals of the KVpop row against every row but dense and of
    the oracle against the fixed-mask control."""
    if lost := missing(tl, table):
        raise ValueError(f"not scored yet: {', '.join(lost)}")
    runs: dict[str, dict] = {}
    for row, seeds in table.items():
        for s in seeds:
            e = tl.entries[f"{row}|seed{s}"]
            if (e["result"]["first"], e["result"]["n"]) != (first, n):
                raise ValueError(f"{row}|seed{s} was scored on test_seed({e['result']['first']}..), "
                                 f"{e['result']['n']} sequences, not on this split ({first}.., {n})")
            runs.setdefault(row, {})[s] = {**e["result"]["run"], "per_sequence": e["result"]["per_sequence"],
                                           "scored": e["date"], "seconds": e["seconds"]}
    st = controls["settings"]
    name, b = controls["kvpop_row"]["name"], st["budget"]
    comps = [*comparisons(task, b, runs, name, against=[r for r in runs if r not in (name, DENSE)], n_boot=n_boot),
             *comparisons(task, b, runs, ORACLE, against=(STREAMING_CONTROL,), n_boot=n_boot)]
    comps = [{**c, "seeds": {"a": c["seeds_a"], "b": c["seeds_b"]}, "split": SPLIT} for c in comps]
    dates = sorted(e["date"] for e in tl.entries.values())
    return {"instrument": task, "split": SPLIT, "test_sequences": f"test_seed({first}..{first + n - 1})",
            "seeds_of_split": {"first": first, "n": n, "earlier": earlier_ranges(), "why_fresh": WHY_FRESH},
            "settings": {"length": st["length"], "budget": b, "sinks": st["sinks"], "window": st["window"],
                         "metric": st["metric"]},
            "kvpop_row": controls["kvpop_row"], "not_causal": list(NOT_CAUSAL),
            "scorings": {k: 1 for k in tl.entries}, "scored": [dates[0], dates[-1]] if dates else [],
            "runs": runs, "figures": figures(runs), "comparisons": comps}


def trials_of(row: str, controls: dict, selection: dict) -> int:
    """The validation trials a row's settings were chosen by: the KVpop row's and DMS's in ``selection.json``,
    each control's learning rates (and, for the key norm, the challenger sign), 0 for the fixed rules."""
    if row == controls["kvpop_row"]["name"]:
        return int(selection["kvpop"][row]["trials"])
    if row == DMS_ROW:
        return len(selection["dms"]["trials"])
    if row in controls["lr_selection"]:
        return len(controls["lr_selection"][row]["trials"]) + int(row == "fixed-finetune[keynorm]")
    return 0


LEGENDS = {
    STREAMING_CONTROL: "the KVpop row's fine-tune (steps, data, model lr chosen on validation) under the fixed "
                       "StreamingLLM mask",
    **{r: REALTEXT_LEGENDS[r] for r in FINETUNED if r != STREAMING_CONTROL},  # the same controls, the same words
    ORACLE: "the same slots and fine-tune, priority the exact label (reads the future: an upper bound, not causal)",
    DMS_ROW: "DMS as the ledger tunes it, gate threshold calibrated on validation",
    UNTRAINED: "StreamingLLM, no training (deterministic: one scoring)",
    DENSE: "the unchanged model, full cache",
}


def ledger_rows(rec: dict, controls: dict, selection: dict) -> dict:
    """``{"rows", "comparisons"}`` for the ledger from a :func:`record`: one row per row at the headline budget and
    L_train (``split``, ``per_sequence``, ``headline`` false), the comparisons in the ledger's keys."""
    st, name = rec["settings"], rec["kvpop_row"]["name"]
    b, L = st["budget"], st["length"]
    dense = mean(rec["runs"][DENSE]["0"]["per_sequence"])
    rows = []
    for row, runs in rec["runs"].items():
        seeds = sorted(runs, key=int)
        per = [list(runs[s]["per_sequence"]) for s in seeds]
        vals = [mean(x) for x in per]
        settings = runs[seeds[0]].get("settings")
        recipe = {"runs": {s: runs[s].get("dir") for s in seeds}, "settings": settings, "sinks": st["sinks"],
                  "window": st["window"], "served_at": b}
        if row == DMS_ROW:
            recipe["threshold"] = {s: runs[s]["threshold"] for s in seeds}
        rows.append({"instrument": rec["instrument"], "policy": row, "recipe": recipe,
                     "steps": int(settings["steps"]) if settings and "steps" in settings else None,
                     "seeds": vals, **summarize(vals), "value": summarize(vals)["mean"], "metric": "accuracy",
                     "trials": trials_of(row, controls, selection),
                     "test_evaluations": max(rec["scorings"].get(f"{row}|seed{s}", 0) for s in seeds),
                     "budget": b, "length": L, "budget_fraction": b / L, "headline": False, "dense": dense,
                     "legend": LEGENDS[row] if row != name else f"the best KVpop row ({rec['kvpop_row']['legend']})",
                     "split": rec["split"],
                     "per_sequence": per, "not_causal": row in NOT_CAUSAL,
                     "test_sequences": f"{rec['test_sequences']} at {L} tokens"})
    keep = ("instrument", "budget", "a", "b", "mean_diff", "ci95", "n_sequences", "n_clusters", "seeds", "method",
            "split", "verdict", "lower_is_better", "n_boot", "seed")
    return {"rows": rows, "comparisons": [{k: c[k] for k in keep if k in c} for c in rec["comparisons"]]}


def markdown(rec: dict) -> str:
    """The record's tables (evidence.md): each row's accuracy (mean over seeds, min .. max, each seed), then every
    interval."""
    b, L = rec["settings"]["budget"], rec["settings"]["length"]
    out = [f"| row | seeds | accuracy at B={b}, L={L} (mean) | min .. max | per seed |", "|---|---|---|---|---|"]
    for f in rec["figures"]:
        name = f"{f['row']} (not causal)" if f["row"] in rec["not_causal"] else f["row"]
        out.append(f"| {name} | {len(f['seeds'])} | {f['mean']:.4f} | {f['min']:.4f} .. {f['max']:.4f} | "
                   + ", ".join(f"{v:.4f}" for v in f["per_seed"].values()) + " |")
    out += ["", "| a | b | a - b | 95 % interval | seeds a / b | verdict |", "|---|---|---|---|---|---|"]
    for c in rec["comparisons"]:
        out.append(f"| {c['a']} | {c['b']} | {c['mean_diff']:+.4f} | [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}] | "
                   f"{c['seeds']['a']} / {c['seeds']['b']} | {c['verdict']} |")
    return "\n".join(out) + "\n"


class Scorer:
    """The models and test sequences of ``task`` at the controls' settings (which it checks against the task's);
    called as ``evaluate(row, seed, run)`` by :func:`score_all`."""

    def __init__(self, task: str, controls: dict, out: Path, n: int):
        import torch

        from kvpop.demo import search as S
        from kvpop.evaluation import evaluate as E

        from .controls_synthetic import headline_budget, kvpop_row
        from .evidence_synthetic import _demo

        torch.set_num_threads(1)
        self.S, self.E = S, E
        _, args, s = _demo(task, out, 16)
        self.mod = S.task_module(task)
        self.budget = headline_budget(task, s)
        st = controls["settings"]
        have = (st["budget"], st["sinks"], st["window"], st["length"], controls["kvpop_row"]["name"])
        want = (self.budget, s["sinks"], s["window"], s["train_len"], kvpop_row(task, s)[0])
        if have != want or controls["instrument"] != task:
            raise ValueError(f"controls.json ({controls['instrument']}: budget, sinks, window, length, row {have}) "
                             f"is not {task}'s {want}")
        self.base = E.load_base_model(S.base_model_dir(args, task))
        self.pm = dict(sinks=s["sinks"], window=s["window"], budget=self.budget)
        seeds = test_seeds(self.mod, n)
        check_disjoint(FRESH2_FIRST, n, earlier_ranges())
        valid = {*controls["split"]["fit"], *controls["split"]["select"], *controls["split"]["dms_threshold_on"]}
        if valid & set(seeds):
            raise ValueError("the test seeds meet the controls' validation seeds")
        self.examples = [self.mod.make_example(v, s["train_len"]) for v in seeds]

    def model(self, run: dict):
        p = run["policy"]
        if p == "dense":
            return self.base
        if p == "streaming":
            return self.E.policy_model(self.base, "streaming", **self.pm)
        if p == "dms":
            from .controls_synthetic import dms_model

            return dms_model(self.E, self.base, Path(run["dir"]), self.pm)
        return self.S.policy_model(self.E, self.base, p, Path(run["dir"]), self.pm)

    def __call__(self, row: str, seed: str, run: dict) -> list[float]:
        from .controls_synthetic import sequence_accuracies

        return sequence_accuracies(self.E, self.model(run), self.examples, run["policy"], self.budget,
                                   threshold=run.get("threshold"))


def main(argv: list[str] | None = None) -> int:
    from .paths import RESULTS_DIR

    p = argparse.ArgumentParser(prog="python -m studies.fresh_synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, choices=("kvtrace", "lookahead"))
    p.add_argument("--out", required=True, help="run directory: the test log and the record")
    p.add_argument("--controls", default=None,
                   help="the controls' record (default studies/results/evidence/<task>/controls.json)")
    p.add_argument("--n-test", type=int, default=N_TEST, help=f"test sequences (default {N_TEST})")
    p.add_argument("--record-only", action="store_true", help="score nothing: the record from the test log")
    p.add_argument("--record", default=None,
                   help="also write the record here (FILE.json), its tables (FILE.md) and the test log beside it "
                        "(FILE's stem + _log.jsonl)")
    p.add_argument("--ledger-runs", default=None,
                   help="also write DIR/<task>/evidence_rows.json: the shipped archive's rows with this split's "
                        "rows and comparisons, for python -m studies.evidence ledger --runs DIR")
    a = parse(p, argv)
    try:
        if a.n_test < 2:
            raise ValueError(f"--n-test must be >= 2 (one sequence has no interval), got {a.n_test}")
        from .paths import check_out_dir

        out = check_out_dir(a.out)
        cpath = Path(a.controls) if a.controls else RESULTS_DIR / "evidence" / a.task / "controls.json"
        controls = json.loads(cpath.read_text())
        table = run_table(controls)
        if a.record_only:
            tl = TestLog(out)
        else:
            tl = score_all(out, table, Scorer(a.task, controls, out, a.n_test), n=a.n_test)
        rec = {**record(a.task, controls, tl, table, n=a.n_test), "controls": str(cpath),
               "command": f"python -m studies.fresh_synthetic --task {a.task} --out {out} --n-test {a.n_test}"}
        targets = [out / "fresh_test.json"] + ([Path(a.record)] if a.record else [])
        for f in targets:
            write_json(f, rec)
            f.with_suffix(".md").write_text(markdown(rec))
        if a.record:
            shutil.copy2(tl.path, Path(a.record).with_name(Path(a.record).stem + "_log.jsonl"))
        if a.ledger_runs:
            from .ledger import write_split_rows

            sel = json.loads((RESULTS_DIR / "evidence" / a.task / "selection.json").read_text())
            write_split_rows(a.ledger_runs, a.task, SPLIT, ledger_rows(rec, controls, sel))
        print(markdown(rec), end="")
        return 0
    except (ValueError, OSError) as e:
        print(f"python -m studies.fresh_synthetic: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
