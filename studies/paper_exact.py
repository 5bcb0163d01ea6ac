"""The paper's method exactly, on all three instruments (issue 43 item 4): ``kvpop-mlp-joint[paper-exact]``.

The ledger's ``kvpop-mlp-joint[paper]`` rows depart from the paper's method: kvtrace's was trained at B = 40 and
served at 128, with the demo's scorer lr 1e-2 (no selection); lookahead's at B = 48, served at 64; real text's at the
served 128 but with scorer lr 3e-3 where its validation preferred 1e-3.  They keep their names in the records
that scored them; this row is the method with no departure:

* the MLP scorer and the model trained together, the mean label over the student's sparse normaliser, the paper's
  decay range (``gamma`` in [0.999, 0.999999] from 0.9999), uniform budgets, fresh scorers;
* **trained at the budget it is served at** (the headline budget: kvtrace 128 of 2,048, lookahead 64 of 512, real
  text 128 of 1,024), the same sinks (4), window (32), training data and steps as the best KVpop row and the
  controls;
* **its learning rates chosen from the same candidates as everyone's**, by the one rule
  (:func:`kvpop.training.search.choose`: a later trial replaces the incumbent only past 2 paired standard errors) on
  the select part of validation, seed 0: first the scorer lr from ``kvpop train --auto``'s candidates
  (:data:`LR_SCORER`: 1e-3, 3e-3, 1e-2, the default first) at model lr 1e-4, then the model lr from the controls'
  candidates (each instrument's ``LR_MODEL``, 1e-4 the incumbent; on real text 1e-3 only after 3e-4 was adopted,
  as for the controls); then seeds 1 and 2 at the choice.

Then each seed is scored **once** on the fresh test split its instrument's final rows were scored on
(kvtrace and lookahead: ``test_seed(20000..20127)``, ``studies.fresh_synthetic``; real text: ``test_fresh2`` and
``test_fresh3``, ``studies.fresh_realtext``) through a :class:`studies.ledger.TestLog` of its own, and compared
by paired intervals with every row those records hold, on the same sequences (their logged per-sequence values).

::

    python -m studies.paper_exact synthetic --task kvtrace --out runs/paper/kvtrace       # validation, seeds
    python -m studies.paper_exact synthetic --task kvtrace --out runs/paper/kvtrace --test   # then the test, once
    python -m studies.paper_exact realtext --out runs/paper/realtext --data CORPUS/train.jsonl [--test]

Every training, validation scoring and test scoring is kept under ``--out`` and never redone (resumable).  The
record ``OUT/paper_exact.json`` (and ``.md``) holds the trials, the decisions, the validation figures and
intervals against the validation records' rows, and with ``--test`` the test figures and intervals.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvpop.training.auto import LR_FACTORS

from .ledger import write_json
from .paths import parse

ROW = "kvpop-mlp-joint[paper-exact]"
LR_SCORER = tuple(1e-3 * f for f in LR_FACTORS)
"""The scorer learning rates tried, in order (the default first): ``kvpop train --auto``'s second stage's."""
LEGEND = ("the paper's method exactly: MLP scorer and model together, mean label, the paper's decay range, uniform "
          "budgets, the student's sparse label, trained at the served budget; scorer lr and model lr chosen on "
          "validation from the candidates every row draws from")


def _g(x: float) -> str:
    return f"{x:g}"


def select(trials_of, lr_scorer=LR_SCORER, lr_model=(1e-4,), *, higher_is_better: bool, stop_early: bool):
    """The two-stage choice: ``trials_of(lr_s, lr_m)`` returns a trial (``{"settings", "per_sequence", ...}``: the
    select part) or ``None`` (not there yet).  Stage 1: every ``lr_scorer`` at ``lr_model[0]``; stage 2: every
    later ``lr_model`` at the chosen scorer lr (``stop_early``: the next one only when the last was adopted).
    Returns ``{"trials", "decisions", "chosen" (settings or None while incomplete)}``."""
    from kvpop.training.search import choose

    trials, decisions = [], []
    first = [trials_of(ls, lr_model[0]) for ls in lr_scorer]
    if any(t is None for t in first):
        return {"trials": [t for t in first if t is not None], "decisions": [], "chosen": None}
    trials += first
    best = choose(first, higher_is_better=higher_is_better, decisions=decisions, stage="paper-exact lr_scorer")
    for lm in lr_model[1:]:
        t = trials_of(best["settings"]["lr_scorer"], lm)
        if t is None:
            return {"trials": trials, "decisions": decisions, "chosen": None}
        trials.append(t)
        before = best
        best = choose([best, t], higher_is_better=higher_is_better, decisions=decisions,
                      stage="paper-exact lr_model")
        if stop_early and best is before:
            break
    return {"trials": trials, "decisions": decisions, "chosen": dict(best["settings"])}


def _strip(trials: list[dict]) -> list[dict]:
    return [{k: v for k, v in t.items() if k != "run"} for t in trials]


# ---------------------------------------------------------------------------------------------------------------
# kvtrace and lookahead
# ---------------------------------------------------------------------------------------------------------------

def synthetic_settings(task: str, s: dict, budget: int) -> dict:
    """The row's settings in the demo's vocabulary: the best KVpop row's steps (its training data and length are
    the demo's), the paper's recipe (:data:`studies.evidence_synthetic.PAPER`), uniform budgets, and ``k`` so that
    it trains at ``budget``."""
    from .controls_synthetic import kvpop_row
    from .evidence_synthetic import PAPER

    _, row = kvpop_row(task, s)
    c = {k: v for k, v in row["settings"].items() if k not in ("head_budgets",)}
    c.update(PAPER)
    c["k"] = budget - s["sinks"] - s["window"]
    return c


class Synthetic:
    """The row on ``task`` under ``out``: trials ``trials/ls<lr>_lm<lr>/seed<s>``, their validation scores (the
    controls' :class:`studies.controls_synthetic.Stage` scoring: the fit part, then the select part)."""

    def __init__(self, task: str, out: Path, *, n_valid: int = 16, train: bool = True):
        from .controls_synthetic import Stage

        self.st = Stage(task, out, n_valid=n_valid, train=train)
        self.task, self.out = task, Path(out)
        self.settings = synthetic_settings(task, self.st.s, self.st.budget)

    def run(self, lr_s: float, lr_m: float, seed: int) -> dict | None:
        from kvpop.demo import retrofit as R

        st, p = self.st, "kvpop-mlp-joint"
        tag = f"ls{_g(lr_s)}_lm{_g(lr_m)}/seed{seed}"
        d = self.out / "trials" / tag
        c = {**self.settings, "lr_scorer": lr_s, "lr_model": lr_m}
        cfg = replace(st.S.retrofit_config(st.s, p, c), seed=seed)
        if cfg.budget != st.budget or cfg.head_allocation is not None:
            raise ValueError(f"{ROW} would train at B={cfg.budget} ({cfg.head_allocation}), not the served "
                             f"B={st.budget} with uniform budgets")
        if not (d / "done.json").exists():
            if not st.train:
                st.missing.append(f"{ROW} {tag} (not trained)")
                return None
            t0 = time.time()
            R.retrofit(st.base, p, d, cfg, resume=True, progress=False, task=st.mod)
            (d / "train_seconds.txt").write_text(f"{time.time() - t0:.1f}\n")
            print(f"[paper-exact {self.task}] trained {tag} in {time.time() - t0:.0f} s", flush=True)
        r = st.score(f"paper-exact/{tag}", lambda: st.S.policy_model(st.E, st.base, p, d, st.pm), p)
        if r is None:
            return None
        return {**r, "seed": seed, "dir": str(d), "policy": p, "settings": c, "lr_model": lr_m}

    def trial(self, lr_s: float, lr_m: float) -> dict | None:
        r = self.run(lr_s, lr_m, 0)
        if r is None:
            return None
        sel = self.st.select_part(r)
        return {"settings": {"lr_scorer": lr_s, "lr_model": lr_m}, "per_sequence": sel,
                "score": sum(sel) / len(sel), "run": r}


def run_synthetic(task: str, out: Path, *, seeds=(0, 1, 2), n_valid: int = 16, train: bool = True,
                  controls: Path | None = None) -> dict:
    """Validation: the choice (:func:`select`), the seeds at it, and the paired intervals against every row of the
    controls' record (``evidence/<task>/controls.json``: the same validation sequences)."""
    from .controls_synthetic import LR_MODEL, comparisons, figures
    from .paths import RESULTS_DIR

    syn = Synthetic(task, out, n_valid=n_valid, train=train)
    cache: dict = {}

    def trials_of(ls, lm):
        if (ls, lm) not in cache:
            cache[ls, lm] = syn.trial(ls, lm)
        return cache[ls, lm]

    sel = select(trials_of, LR_SCORER, LR_MODEL, higher_is_better=True, stop_early=False)
    runs: dict[str, dict] = {}
    if sel["chosen"] is not None:
        ch = sel["chosen"]
        for s in seeds:
            r = cache[ch["lr_scorer"], ch["lr_model"]]["run"] if s == 0 else syn.run(ch["lr_scorer"],
                                                                                     ch["lr_model"], s)
            if r is not None:
                runs.setdefault(ROW, {})[str(s)] = r
    cpath = controls or RESULTS_DIR / "evidence" / task / "controls.json"
    ctl = json.loads(Path(cpath).read_text())
    if ctl["split"]["fit"] != syn.st.fit or ctl["split"]["select"] != syn.st.select:
        raise ValueError(f"{cpath} was scored on other validation sequences than this run's")
    both = {**({ROW: runs[ROW]} if ROW in runs else {}), **ctl["runs"]}
    rec = {"instrument": task, "row": ROW, "legend": LEGEND, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "settings": {**syn.settings, "budget": syn.st.budget, "trained_at": syn.st.budget,
                        "served_at": syn.st.budget, "length": syn.st.s["train_len"],
                        "train_length": syn.st.s["train_length"]},
           "split": {"fit": syn.st.fit, "select": syn.st.select, "choices_on": "the select part",
                     "of": "validation (not a test)"},
           "rule": "kvpop.training.search.choose (2 paired standard errors, higher accuracy better; a tie keeps "
                   "the incumbent)",
           "candidates": {"lr_scorer": list(LR_SCORER), "lr_model": list(LR_MODEL)},
           "selection": {"trials": _strip(sel["trials"]), "decisions": sel["decisions"], "chosen": sel["chosen"]},
           "validation": {"controls": str(cpath), "runs": runs, "figures": figures(both) if runs else [],
                          "comparisons": comparisons(task, syn.st.budget, both, ROW) if runs else []},
           "missing": syn.st.missing}
    return rec


def test_synthetic(task: str, out: Path, rec: dict, *, fresh: Path | None = None) -> dict:
    """Each seed of the row scored once (its own test log, ``OUT/test``) on the fresh split of
    ``evidence/<task>/fresh_test.json``, and the intervals against every row of that record (dense aside)."""
    from .controls_synthetic import comparisons, figures
    from .fresh_synthetic import DENSE, FRESH2_FIRST, SPLIT, Scorer, score_all
    from .paths import RESULTS_DIR

    if rec["selection"]["chosen"] is None or len(rec["validation"]["runs"].get(ROW, {})) < 3:
        raise ValueError(f"{task}: the row's choice and three seeds come first (run without --test)")
    fpath = fresh or RESULTS_DIR / "evidence" / task / "fresh_test.json"
    fr = json.loads(Path(fpath).read_text())
    n = int(fr["seeds_of_split"]["n"])
    if int(fr["seeds_of_split"]["first"]) != FRESH2_FIRST:
        raise ValueError(f"{fpath} is not the split test_seed({FRESH2_FIRST}..)")
    ctl = json.loads(Path(fr["controls"] if Path(fr["controls"]).exists()
                          else RESULTS_DIR / "evidence" / task / "controls.json").read_text())
    table = {ROW: {s: {k: r[k] for k in ("dir", "policy", "settings", "lr_model")}
                   for s, r in rec["validation"]["runs"][ROW].items()}}
    tl = score_all(Path(out) / "test", table, Scorer(task, ctl, Path(out) / "test", n), n=n)
    mine = {s: {**tl.entries[f"{ROW}|seed{s}"]["result"]["run"],
                "per_sequence": tl.entries[f"{ROW}|seed{s}"]["result"]["per_sequence"],
                "scored": tl.entries[f"{ROW}|seed{s}"]["date"]} for s in table[ROW]}
    both = {ROW: mine, **fr["runs"]}
    b = int(fr["settings"]["budget"])
    return {"split": SPLIT, "record": str(fpath), "test_sequences": fr["test_sequences"],
            "scorings": {k: 1 for k in tl.entries}, "runs": {ROW: mine}, "figures": figures(both),
            "comparisons": comparisons(task, b, both, ROW, against=[r for r in fr["runs"] if r != DENSE])}


# ---------------------------------------------------------------------------------------------------------------
# real text
# ---------------------------------------------------------------------------------------------------------------

def realtext_extra(lr_scorer: float) -> list[str]:
    """``kvpop train`` options of the row beside :func:`studies.controls_realtext.train_args`'s (which give the
    slots, B = 128, data, steps, the mean label and the model lr): the MLP scorer at ``lr_scorer``; every other
    option at ``kvpop train``'s default, which is the paper's (decay range, student label, uniform budgets)."""
    return ["--scorer", "mlp", "--lr-scorer", _g(lr_scorer)]


def check_paper_args(d: Path) -> None:
    """ValueError naming the option when a trained run's ``args.json`` departs from the paper's method."""
    from kvpop.training.auto import PAPER

    a = json.loads((Path(d) / "args.json").read_text())
    want = {**PAPER, "budget": 128, "priority_source": "scorer", "allocate": None, "head_budgets": None,
            "init_scorers": None, "no_train_model": False}
    bad = {k: (a.get(k), v) for k, v in want.items() if a.get(k) != v}
    if a.get("lm_weight") not in (None, 0, 0.0):
        bad["lm_weight"] = (a.get("lm_weight"), 0.0)
    if bad:
        raise ValueError(f"{d}: not the paper's method: {bad} (given, wanted)")


def run_realtext(out: Path, *, model: Path, data: Path, valid: Path, seeds=(0, 1, 2), train: bool = True,
                 controls: Path | None = None) -> dict:
    """Validation on real text: the choice, the seeds, and the intervals against every row of the controls'
    record (``evidence/realtext/controls.json``: the same 16 validation sequences, clustered by file)."""
    from .controls_realtext import BUDGET, LR_MODEL, LR_TAG, SELECT, Stage, clusters_of, comparisons, figures, pick
    from .paths import RESULTS_DIR

    st = Stage(out, model=model, data=data, valid=valid, auto=out, train=train)
    cache: dict = {}

    def run(ls, lm, seed):
        key = (ls, lm, seed)
        if key not in cache:
            r = st.control(f"{ROW}/ls{_g(ls)}", realtext_extra(ls), lm, seed)
            if r is not None:
                check_paper_args(Path(r["dir"]))
                r = {**r, "lr_scorer": ls}
            cache[key] = r
        return cache[key]

    def trials_of(ls, lm):
        r = run(ls, lm, 0)
        if r is None:
            return None
        v = pick(r["vs_original"][str(BUDGET)])
        return {"settings": {"lr_scorer": ls, "lr_model": lm}, "per_sequence": v, "score": sum(v) / len(v),
                "run": r}

    sel = select(trials_of, LR_SCORER, LR_MODEL, higher_is_better=False, stop_early=True)
    runs: dict[str, dict] = {}
    if sel["chosen"] is not None:
        ch = sel["chosen"]
        for s in seeds:
            r = run(ch["lr_scorer"], ch["lr_model"], s)
            if r is not None:
                runs.setdefault(ROW, {})[str(s)] = r
    cpath = controls or RESULTS_DIR / "evidence" / "realtext" / "controls.json"
    ctl = json.loads(Path(cpath).read_text())
    clusters = clusters_of(valid)
    if ctl["split"]["clusters"] != clusters:
        raise ValueError(f"{cpath} was scored on other validation sequences than {valid}'s first 16")
    both = {**({ROW: runs[ROW]} if ROW in runs else {}), **ctl["runs"]}
    return {"instrument": "realtext", "row": ROW, "legend": LEGEND,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "settings": {"budget": BUDGET, "trained_at": BUDGET, "served_at": [64, 128, 256], "steps": 250,
                         "data": str(data), "model": str(model)},
            "split": {"select": list(SELECT), "of": f"the first 16 sequences of {valid} (validation, not a test)",
                      "choices_on": "the select part at B=128, against the original dense model"},
            "rule": "kvpop.training.search.choose (2 paired standard errors, lower NLL increase better; a tie keeps "
                    "the incumbent); model lr 1e-3 only after 3e-4 was adopted, as for the controls",
            "candidates": {"lr_scorer": list(LR_SCORER), "lr_model": list(LR_MODEL)},
            "lr_tags": {_g(k): v for k, v in LR_TAG.items()},
            "selection": {"trials": _strip(sel["trials"]), "decisions": sel["decisions"], "chosen": sel["chosen"]},
            "validation": {"controls": str(cpath), "runs": runs, "figures": figures(both) if runs else [],
                           "comparisons": comparisons(both, ROW, clusters) if runs else []},
            "commands": st.commands, "missing": st.missing}


def test_realtext(out: Path, rec: dict, split_record: Path, *, n_boot: int = 10_000) -> dict:
    """Each seed scored once (its own test log, ``OUT/test_<split>``) on the split of ``split_record`` (a
    ``studies.fresh_realtext`` record: ``fresh2.json`` or ``fresh3.json``), and the intervals against each of its
    rows at every budget, against the original and against the same weights."""
    from .controls_realtext import EVAL_BUDGETS
    from .fresh_realtext import DENSE_FT, row_values, score_all
    from .paired import comparison
    from .paths import ROOT

    if rec["selection"]["chosen"] is None or len(rec["validation"]["runs"].get(ROW, {})) < 3:
        raise ValueError("realtext: the row's choice and three seeds come first (run without --test)")
    fr = json.loads(Path(split_record).read_text())
    data = ROOT / fr["split_file"]
    n = int(fr["n_sequences"])
    dirs = {ROW: {int(s): Path(r["dir"]) for s, r in rec["validation"]["runs"][ROW].items()}}
    o = Path(out) / f"test_{fr['split']}"
    scored = score_all(o, dirs, data=data, n=n)
    if [round(x, 6) for x in scored["original"]] != [round(x, 6) for x in fr["original_dense_nll"]["per_sequence"]]:
        raise ValueError(f"the original dense NLL on {data} is not {split_record}'s")
    mine = {str(s): r for s, r in scored["rows"][ROW].items()}
    comps = []
    for other, seeds in fr["runs"].items():
        base = next((f.get("base", other) for f in fr["figures"] if f["row"] == other), other)
        for b in EVAL_BUDGETS:
            for ref in ("original", "same weights"):
                if base == DENSE_FT and ref == "same weights":
                    continue
                va = [row_values(mine[s], ROW, b, ref) for s in sorted(mine, key=int)]
                vb = [row_values(seeds[s], base, b, ref) for s in sorted(seeds, key=int)]
                c = comparison(instrument="realtext", budget=b, a=ROW, b=other, values_a=va, values_b=vb,
                               lower_is_better=True, clusters=fr["clusters"], n_boot=n_boot)
                comps.append({**c, "seeds": {"a": len(va), "b": len(vb)}, "reference": ref, "split": fr["split"]})
    figs = []
    for b in EVAL_BUDGETS:
        for ref, key in (("original", "vs_original"), ("same weights", "vs_same_weights")):
            per = {s: sum(row_values(mine[s], ROW, b, ref)) / n for s in sorted(mine, key=int)}
            figs.append({"budget": b, "reference": ref, "per_seed": per, "mean": sum(per.values()) / len(per)})
    shift = sum(sum(r["dense_shift"]) / n for r in mine.values()) / len(mine)
    return {"split": fr["split"], "record": str(split_record), "scorings": {k: 1 for k in scored["log"].entries},
            "runs": {ROW: mine}, "figures": figs, "dense_shift_mean": shift, "comparisons": comps}


# ---------------------------------------------------------------------------------------------------------------

KEEP = ("instrument", "budget", "a", "b", "mean_diff", "ci95", "n_sequences", "n_clusters", "seeds", "method",
        "split", "reference", "verdict", "lower_is_better", "n_boot", "seed")
"""The comparison keys the ledger keeps."""


def ledger_rows(rec: dict) -> dict[str, dict]:
    """``{split: {"rows", "comparisons"}}`` for the ledger from a record with its tests: the row at the headline
    budget (real text: at each budget, against the original dense model) with its per-sequence values, scored once
    (``headline`` false), and its intervals on that split."""
    from .ledger import summarize

    out = {}
    trials = len(rec["selection"]["trials"])
    for t in rec.get("tests", []):
        runs = t["runs"][ROW]
        seeds = sorted(runs, key=int)
        once = max(t["scorings"].get(f"{ROW}|seed{x}", 0) for x in seeds)
        rows = []
        if rec["instrument"] == "realtext":
            from .controls_realtext import EVAL_BUDGETS, SEQ_LEN, SINKS, WINDOW
            from .fresh_realtext import row_values

            for b in EVAL_BUDGETS:
                per = [row_values(runs[x], ROW, b, "original") for x in seeds]
                vals = [sum(v) / len(v) for v in per]
                rows.append({"instrument": "realtext", "policy": ROW, "recipe": {
                    "runs": {x: runs[x]["dir"] for x in seeds}, "commands": {x: runs[x]["command"] for x in seeds},
                    "sinks": SINKS, "window": WINDOW, "trained_at": 128, "settings": rec["selection"]["chosen"]},
                    "steps": 250, "seeds": vals, **summarize(vals), "value": summarize(vals)["mean"],
                    "metric": "delta_nll", "trials": trials, "test_evaluations": once, "budget": b,
                    "budget_fraction": b / SEQ_LEN, "headline": False, "legend": LEGEND, "split": t["split"],
                    "per_sequence": per, "reference": "the original dense model", "not_causal": False,
                    "test_sequences": f"{len(per[0])} records of the split {t['split']}, scored from position 256"})
        else:
            st = rec["settings"]
            per = [list(runs[x]["per_sequence"]) for x in seeds]
            vals = [sum(v) / len(v) for v in per]
            fr = json.loads(Path(t["record"]).read_text()) if Path(t["record"]).exists() else None
            dense = None if fr is None else sum(fr["runs"]["dense"]["0"]["per_sequence"]) / len(
                fr["runs"]["dense"]["0"]["per_sequence"])
            rows.append({"instrument": rec["instrument"], "policy": ROW, "recipe": {
                "runs": {x: runs[x]["dir"] for x in seeds}, "settings": runs[seeds[0]]["settings"],
                "sinks": 4, "window": 32, "served_at": st["budget"], "trained_at": st["trained_at"]},
                "steps": int(st["steps"]), "seeds": vals, **summarize(vals), "value": summarize(vals)["mean"],
                "metric": "accuracy", "trials": trials, "test_evaluations": once, "budget": st["budget"],
                "length": st["length"], "budget_fraction": st["budget"] / st["length"], "headline": False,
                "dense": dense, "legend": LEGEND, "split": t["split"], "per_sequence": per, "not_causal": False,
                "test_sequences": f"{t['test_sequences']} at {st['length']} tokens"})
        comps = [{**{k: c[k] for k in KEEP if k in c}, "split": t["split"],
                  "seeds": c.get("seeds") or {"a": c["seeds_a"], "b": c["seeds_b"]}} for c in t["comparisons"]]
        out[t["split"]] = {"rows": rows, "comparisons": comps}
    return out


def markdown(rec: dict) -> str:
    """The record's tables: the trials and decisions, then each interval (validation, then each test split)."""
    out = [f"**{rec['instrument']}**: chosen {rec['selection']['chosen']}", "",
           "| trial (lr_scorer, lr_model) | validation score (select part) |", "|---|---|"]
    for t in rec["selection"]["trials"]:
        out.append(f"| {_g(t['settings']['lr_scorer'])}, {_g(t['settings']['lr_model'])} | {t['score']:.4f} |")
    out += ["", "| decision | incumbent | challenger | mean_diff | SE | adopted |", "|---|---|---|---|---|---|"]
    for d in rec["selection"]["decisions"]:
        se = "-" if d["se"] is None else f"{d['se']:.4f}"
        out.append(f"| {d['stage']} | {d['incumbent']} | {d['challenger']} | {d['mean_diff']:+.4f} | {se} | "
                   f"{'yes' if d['adopted'] else 'no'} |")
    parts = [("validation", rec["validation"]["comparisons"])]
    parts += [(t["split"], t["comparisons"]) for t in rec.get("tests", [])]
    for name, comps in parts:
        out += ["", f"{name}:", "", "| budget | reference | b | a - b | 95 % interval | seeds a / b | verdict |",
                "|---|---|---|---|---|---|---|"]
        for c in comps:
            seeds = c.get("seeds") or {"a": c["seeds_a"], "b": c["seeds_b"]}
            out.append(f"| {c['budget']} | {c.get('reference', '-')} | {c['b']} | {c['mean_diff']:+.4f} | "
                       f"[{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}] | {seeds['a']} / {seeds['b']} | {c['verdict']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .paths import DATA

    p = argparse.ArgumentParser(prog="python -m studies.paper_exact", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="instrument", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--task", required=True, choices=("kvtrace", "lookahead"))
    r = sub.add_parser("realtext")
    r.add_argument("--data", required=True, help="the real-text corpus's train split (the controls' --data)")
    r.add_argument("--valid", default=str(DATA / "realtext" / "validation.jsonl"))
    r.add_argument("--model", default=str(DATA / "tiny_qwen3_code"))
    r.add_argument("--splits", default="fresh2,fresh3", help="the fresh_realtext records --test scores beside")
    for q in (s, r):
        q.add_argument("--out", required=True, help="run directory (resumable)")
        q.add_argument("--seeds", default="0,1,2")
        q.add_argument("--test", action="store_true", help="then score the row once on the fresh test split")
        q.add_argument("--record-only", action="store_true", help="train and score nothing: the record of what "
                                                                  "exists")
        q.add_argument("--ledger-runs", default=None,
                       help="with --test: also add the row to DIR/<instrument>/evidence_rows.json (the shipped "
                            "archive's rows, or DIR's own when there), for python -m studies.evidence ledger --runs "
                            "DIR")
    a = parse(p, argv)
    try:
        import torch

        from kvpop.cli.trained import parse_ints

        from .paths import RESULTS_DIR, check_out_dir

        torch.set_num_threads(1)
        out = check_out_dir(a.out)
        seeds = tuple(parse_ints(a.seeds, "--seeds"))
        if 0 not in seeds:
            raise ValueError(f"--seeds must list seed 0 (the learning rates are chosen with it), got {a.seeds!r}")
        if a.instrument == "synthetic":
            rec = run_synthetic(a.task, out, seeds=seeds, train=not a.record_only)
            if a.test:
                rec["tests"] = [test_synthetic(a.task, out, rec)]
        else:
            rec = run_realtext(out, model=Path(a.model), data=Path(a.data), valid=Path(a.valid), seeds=seeds,
                               train=not a.record_only)
            if a.test:
                rec["tests"] = [test_realtext(out, rec, RESULTS_DIR / "evidence" / "realtext" / f"{sp}.json")
                                for sp in a.splits.split(",") if sp]
        write_json(out / "paper_exact.json", rec)
        (out / "paper_exact.md").write_text(markdown(rec))
        if a.ledger_runs:
            if not rec.get("tests"):
                raise ValueError("--ledger-runs needs --test (the ledger holds rows scored on a test split)")
            from .ledger import write_split_rows

            for split, new in ledger_rows(rec).items():
                write_split_rows(a.ledger_runs, rec["instrument"], split, new, merge=True)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"python -m studies.paper_exact: error: {e}", file=sys.stderr)
        return 2
    print(markdown(rec), end="")
    if rec["missing"]:
        print(f"missing: {rec['missing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
