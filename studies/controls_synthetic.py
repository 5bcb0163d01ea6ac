"""The synthetic instruments' same-structure controls (issue 43 item 1, kvtrace and lookahead): the sinks, window,
long-range slots, eviction rule and fine-tune of the best KVpop row, with a priority that is not learned
(``KVpopConfig.priority_source``, docs/DESIGN.md section 12), on validation sequences only.

::

    python -m studies.controls_synthetic --task kvtrace --out runs/evsyn/kvtrace      # resumable
    python -m studies.controls_synthetic --task lookahead --out runs/evsyn/lookahead
    python -m studies.controls_synthetic --task kvtrace --out runs/evsyn/kvtrace --markdown   # the tables

What it does, in order (every training and every scoring is kept under ``--out`` and never redone):

1. **Untrained controls** (``untrained[<source>]``): the base weights, the priority's scorers at the seeded start a
   retrofit would begin from (:func:`kvpop.demo.retrofit.initial_scorers`), for each source of
   :data:`UNTRAINED`; the key-norm sign chosen on them (keynorm+ the incumbent) by
   :func:`kvpop.training.search.prefer` on the select part at the headline budget.
2. **Fine-tuned controls** (:data:`CONTROLS`): the model fine-tuned with the KVpop row's steps and training data
   (the same ``seed``'s training sequences) under the control's mask, trained and served at the headline budget
   (12.5 % of the demo's training length, where ``fixed-finetune[streaming]`` has always been trained), uniform
   budgets, the scorer (where there is one) never updated.  The model learning rate of each: :data:`LR_MODEL` in
   order (1e-4 the incumbent), chosen on the select part by ``prefer`` with seed 0, then seeds 1 and 2.
3. **The best KVpop row** (the chosen row of :func:`studies.evidence_synthetic.rows_of`: the demo's validated
   joint-MLP retrofit) retrained with every seed exactly as ``python -m studies.evidence synthetic`` trains it
   (its trained files are not shipped), served at the headline budget.
   Beside it, ``dms[tuned]`` with every seed as the ledger trains it (the settings of
   ``evidence/<task>/selection.json``, :func:`studies.evidence_synthetic.train_dms_row`), its gate threshold
   calibrated on ``valid_seed(2000..2000+n-1)`` (:data:`CALIBRATE_FIRST`: not among the scored sequences).
4. Every (row, seed) scored per sequence (accuracy at the graded positions, L_train, headline budget) on the
   validation sequences: the fit part ``valid_seed(0..n-1)`` and the select part ``valid_seed(1000..1000+n-1)``
   (:data:`kvpop.demo.search.SELECT_FIRST`); the choices above read the select part only; the record reports
   all ``2n``.  No test sequence is scored.
5. The paired intervals (:func:`studies.paired.comparison`, every sequence its own cluster, over each row's
   seeds) of the KVpop row against every other row, and of ``oracle[label]`` against ``fixed-finetune[streaming]``.

The record: ``OUT/controls.json`` (copied to ``studies/results/evidence/<task>/controls.json``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from .ledger import write_json
from .paths import parse

UNTRAINED = ("random", "keynorm+", "keynorm-", "window-attention", "oracle-label")
KEYNORM = ("keynorm+", "keynorm-")
"""The key-norm sign: keynorm+ the incumbent (a tie keeps it), keynorm- the challenger."""
CONTROLS = {
    "fixed-finetune[streaming]": "streaming",
    "fixed-finetune[random]": "random",
    "fixed-finetune[keynorm]": None,  # the sign chosen on the untrained runs (KEYNORM)
    "fixed-finetune[window-attention]": "window-attention",
    "oracle[label]": "oracle-label",
}
"""The fine-tuned controls: row -> ``priority_source`` (``"streaming"``: the ``fixed-finetune`` retrofit)."""
LR_MODEL = (1e-4, 1e-3)
"""The controls' model learning rates, in order (the incumbent first): the two the synthetic evidence's
``fixed-finetune`` selection tried (``studies.evidence_synthetic.CONTROL_LR``)."""
ORACLE, STREAMING_CONTROL = "oracle[label]", "fixed-finetune[streaming]"
DMS_ROW = "dms[tuned]"
CALIBRATE_FIRST = 2_000
"""DMS's gate threshold is calibrated on ``valid_seed(CALIBRATE_FIRST..)`` (as many as each part holds): validation
sequences that are not among the reported ones."""


def dms_settings(task: str) -> dict:
    """The ledger's ``dms[tuned]`` settings of ``task``: the choice in ``evidence/<task>/selection.json``."""
    from .paths import RESULTS_DIR

    sel = json.loads((RESULTS_DIR / "evidence" / task / "selection.json").read_text())
    if not sel.get("final") or "chosen" not in sel.get("dms", {}):
        raise ValueError(f"evidence/{task}/selection.json holds no final DMS choice")
    return dict(sel["dms"]["chosen"]["settings"])


def kvpop_row(task: str, s: dict) -> tuple[str, dict]:
    """``(name, row)`` of the best KVpop row: the chosen row of :func:`studies.evidence_synthetic.rows_of`."""
    from .evidence_synthetic import rows_of

    rows = rows_of(task, s)
    name = next(n for n, r in rows.items() if r["chosen"])
    return name, rows[name]


def headline_budget(task: str, s: dict) -> int:
    """The headline budget of ``task`` (the ledger's), which must be ``fixed-finetune``'s training budget (12.5 % of
    the demo's training length): the controls are trained and served there."""
    from kvpop.demo import search as S

    from .evidence_synthetic import HEADLINE_BUDGET

    b = HEADLINE_BUDGET[task]
    ff = S.retrofit_config(s, "fixed-finetune", {"steps": 1, "lr_model": 1e-4}).budget
    if ff != b:
        raise ValueError(f"{task}: the headline budget {b} is not fixed-finetune's training budget {ff}")
    return b


def control_config(s: dict, row: dict, source: str, budget: int, lr: float, seed: int):
    """The :class:`~kvpop.demo.retrofit.RetrofitConfig` of a control with ``source`` (``"streaming"``: the
    ``fixed-finetune`` retrofit): the KVpop row's steps, length, sinks, window, label and decay range, trained at
    ``budget`` with uniform budgets, model lr ``lr``, ``seed`` (its training sequences and initialisation), the
    student's label (what ``oracle-label`` serves at evaluation: the served model's own)."""
    from kvpop.demo import search as S

    if source == "streaming":
        return replace(S.retrofit_config(s, "fixed-finetune", {"steps": row["settings"]["steps"], "lr_model": lr}),
                       seed=seed)
    c = {k: v for k, v in row["settings"].items() if k not in ("head_budgets", "joint_init")}
    return replace(S.retrofit_config(s, row["policy"], c), budget=budget, lr_model=lr, seed=seed,
                   priority_source=source, target_source="student", head_allocation=None)


def lr_tag(lr: float) -> str:
    return f"lr{lr:g}"


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def lr_choice(trials: list[dict], *, stage: str) -> tuple[dict, list[dict]]:
    """:func:`kvpop.training.search.choose` over ``trials`` (in :data:`LR_MODEL` order, each with
    ``per_sequence``: accuracies on the select part, higher is better): the chosen trial and the decisions."""
    from kvpop.training.search import choose

    decisions: list[dict] = []
    best = choose(trials, higher_is_better=True, decisions=decisions, stage=stage)
    return best, decisions


def comparisons(task: str, budget: int, runs: dict, a: str, *, against=None, n_boot: int = 10_000) -> list[dict]:
    """The paired intervals (accuracy, higher is better) of row ``a`` against every other row of ``runs`` (or those
    of ``against``): ``runs[row][seed]["per_sequence"]``, the same sequences in every row."""
    from .paired import comparison

    out = []
    for other in runs:
        if other == a or (against is not None and other not in against):
            continue
        va = [runs[a][s]["per_sequence"] for s in sorted(runs[a], key=int)]
        vb = [runs[other][s]["per_sequence"] for s in sorted(runs[other], key=int)]
        out.append(comparison(instrument=task, budget=budget, a=a, b=other, values_a=va, values_b=vb,
                              lower_is_better=False, n_boot=n_boot))
    return out


def figures(runs: dict) -> list[dict]:
    """One row per row of ``runs``: each seed's mean accuracy over the sequences, their mean, min and max."""
    out = []
    for name, seeds in runs.items():
        per = {s: mean(r["per_sequence"]) for s, r in sorted(seeds.items(), key=lambda x: int(x[0]))}
        out.append({"row": name, "seeds": list(per), "per_seed": per, "mean": mean(per.values()),
                    "min": min(per.values()), "max": max(per.values())})
    return out


def sequence_accuracies(E, model, examples, policy: str, budget: int, *, threshold=None) -> list[float]:
    """Each example's accuracy at its graded positions under ``policy`` at ``budget`` (dense: the full cache),
    teacher-forced (:func:`kvpop.evaluation.evaluate.sequence_correct`; ``threshold``: DMS's gate threshold)."""
    per = []
    for ex in examples:
        c, g = E.sequence_correct(model, ex, policy, None if policy == "dense" else budget, threshold=threshold)
        per.append(c / g)
    return per


def dms_model(E, base, d: Path, pm: dict):
    """The model serving ``dms[tuned]`` from its run directory ``d`` (its gates and fine-tuned weights)."""
    return E.policy_model(base, "dms", scorers=d / "gates.safetensors", finetuned=E.load_base_model(d / "model"),
                          **pm)


class Stage:
    """The runs of one task under ``out`` (module docstring): ``untrained/<source>``, ``controls/<row>/lr<lr>/
    seed<s>``, ``kvpop/<row>/seed<s>``, the scores ``scores/<tag>.json`` (each written once)."""

    def __init__(self, task: str, out: Path, *, n_valid: int, train: bool = True):
        import torch

        from kvpop.demo import search as S
        from kvpop.evaluation import evaluate as E

        from .evidence_synthetic import _demo

        torch.set_num_threads(1)
        self.task, self.out, self.train = task, Path(out), train
        self.S, self.E = S, E
        _, self.args, self.s = _demo(task, self.out, n_valid)
        self.mod = S.task_module(task)
        self.base = E.load_base_model(S.base_model_dir(self.args, task))
        self.budget = headline_budget(task, self.s)
        self.row_name, self.row = kvpop_row(task, self.s)
        self.pm = dict(sinks=self.s["sinks"], window=self.s["window"], budget=self.budget)
        L = self.s["train_len"]
        self.fit = [self.mod.valid_seed(i) for i in range(n_valid)]
        self.select = [self.mod.valid_seed(S.SELECT_FIRST + i) for i in range(n_valid)]
        self.examples = [self.mod.make_example(v, L) for v in self.fit + self.select]
        self.n_valid = n_valid
        self.missing: list[str] = []
        self.timings: dict[str, float] = {}

    # scoring -------------------------------------------------------------------------------------------------
    def score(self, tag: str, make_model, policy: str) -> dict | None:
        """``scores/<tag>.json``: each validation sequence's accuracy (fit part, then select part) at the headline
        budget under ``policy`` (``dms``: at the gate threshold calibrated on the :data:`CALIBRATE_FIRST`
        sequences); scored once."""
        f = self.out / "scores" / f"{tag}.json"
        if f.exists():
            return json.loads(f.read_text())
        if not self.train:
            self.missing.append(f"score {tag}")
            return None
        t0 = time.time()
        model = make_model()
        thr = None
        if policy == "dms":
            import torch

            L = self.s["train_len"]
            cal = torch.stack([self.mod.make_example(self.mod.valid_seed(CALIBRATE_FIRST + i), L)["input_ids"]
                               for i in range(self.n_valid)])
            thr = self.E.dms_calibrate(model, cal, self.budget)
        per = sequence_accuracies(self.E, model, self.examples, policy, self.budget, threshold=thr)
        r = {"per_sequence": per, "budget": self.budget, "policy": policy,
             "eval_seconds": round(time.time() - t0, 1), **({"threshold": float(thr)} if thr is not None else {})}
        write_json(f, r)
        print(f"[controls {self.task}] {tag}: {mean(per):.4f} ({r['eval_seconds']} s)", flush=True)
        return r

    def select_part(self, r: dict) -> list[float]:
        return r["per_sequence"][self.n_valid:]

    # 1. untrained --------------------------------------------------------------------------------------------
    def untrained(self) -> dict:
        from kvpop.demo import retrofit as R
        from kvpop.training.search import prefer

        rows = {}
        rows["dense"] = self.score("dense", lambda: self.base, "dense")
        rows["streaming"] = self.score("streaming", lambda: self.E.policy_model(self.base, "streaming", **self.pm),
                                       "streaming")
        for src in UNTRAINED:
            f = self.out / "untrained" / src / "scorers.safetensors"
            if not f.exists() and self.train:
                R.initial_scorers(self.base, self.row["policy"], f,
                                  control_config(self.s, self.row, src, self.budget, LR_MODEL[0], 0))
            rows[f"untrained[{src}]"] = self.score(
                f"untrained[{src}]", lambda f=f: self.E.policy_model(self.base, "kvpop-mlp", scorers=f, **self.pm),
                "kvpop-mlp")
        sign = None
        if all(rows.get(f"untrained[{s}]") for s in KEYNORM):
            sign = prefer(*({"settings": s, "per_sequence": self.select_part(rows[f"untrained[{s}]"])}
                            for s in KEYNORM), higher_is_better=True,
                          stage=f"keynorm sign (untrained, B={self.budget}, select part)")
        return {"rows": rows, "keynorm_sign": sign,
                "keynorm_chosen": None if sign is None else KEYNORM[1] if sign["adopted"] else KEYNORM[0]}

    # 2. the fine-tuned controls ------------------------------------------------------------------------------
    def control(self, name: str, source: str, lr: float, seed: int) -> dict | None:
        from kvpop.demo import retrofit as R

        d = self.out / "controls" / name / lr_tag(lr) / f"seed{seed}"
        cfg = control_config(self.s, self.row, source, self.budget, lr, seed)
        policy = "fixed-finetune" if source == "streaming" else self.row["policy"]
        if not (d / "done.json").exists():
            if not self.train:
                self.missing.append(f"{name} {lr_tag(lr)} seed {seed} (not trained)")
                return None
            t0 = time.time()
            R.retrofit(self.base, policy, d, cfg, resume=True, progress=False, task=self.mod)
            (d / "train_seconds.txt").write_text(f"{time.time() - t0:.1f}\n")
            print(f"[controls {self.task}] trained {name} {lr_tag(lr)} seed {seed} in {time.time() - t0:.0f} s",
                  flush=True)
        r = self.score(f"{name}/{lr_tag(lr)}/seed{seed}",
                       lambda: self.S.policy_model(self.E, self.base, policy, d, self.pm), policy)
        if r is None:
            return None
        ts = d / "train_seconds.txt"
        return {**r, "lr_model": lr, "seed": seed, "dir": str(d), "settings": json.loads(
            (d / "done.json").read_text())["settings"], "train_seconds": float(ts.read_text()) if ts.exists() else None}

    def choose_lr(self, name: str, source: str) -> dict:
        trials = []
        for lr in LR_MODEL:
            r = self.control(name, source, lr, 0)
            if r is None:
                break
            trials.append({"settings": {"lr_model": lr}, "per_sequence": self.select_part(r),
                           "score": mean(self.select_part(r)), "run": r})
        if len(trials) < len(LR_MODEL):
            return {"trials": [{k: v for k, v in t.items() if k != "run"} for t in trials], "decisions": [],
                    "chosen": None, "runs": {}}
        best, decisions = lr_choice(trials, stage=f"{name} lr_model (seed 0, B={self.budget}, select part)")
        return {"trials": [{k: v for k, v in t.items() if k != "run"} for t in trials], "decisions": decisions,
                "chosen": best["settings"]["lr_model"], "runs": {t["settings"]["lr_model"]: t["run"] for t in trials}}

    # 3. the KVpop row ----------------------------------------------------------------------------------------
    def kvpop(self, seed: int) -> dict | None:
        from kvpop.demo import retrofit as R

        d = self.out / "kvpop" / self.row_name / f"seed{seed}"
        p = self.row["policy"]
        if not (d / "done.json").exists():
            if not self.train:
                self.missing.append(f"{self.row_name} seed {seed} (not trained)")
                return None
            t0 = time.time()
            R.retrofit(self.base, p, d, replace(self.S.retrofit_config(self.s, p, self.row["settings"]), seed=seed),
                       resume=True, progress=False, task=self.mod)
            (d / "train_seconds.txt").write_text(f"{time.time() - t0:.1f}\n")
            print(f"[controls {self.task}] trained {self.row_name} seed {seed} in {time.time() - t0:.0f} s",
                  flush=True)
        r = self.score(f"kvpop/{self.row_name}/seed{seed}", lambda: self.S.policy_model(self.E, self.base, p, d,
                                                                                         self.pm), p)
        if r is None:
            return None
        ts = d / "train_seconds.txt"
        return {**r, "seed": seed, "dir": str(d), "settings": json.loads((d / "done.json").read_text())["settings"],
                "train_seconds": float(ts.read_text()) if ts.exists() else None}


    # 4. DMS, as the ledger trains it ---------------------------------------------------------------------------
    def dms(self, seed: int) -> dict | None:
        from .evidence_synthetic import train_dms_row

        c = dms_settings(self.task)
        d = self.out / "dms" / f"seed{seed}"
        if not (d / "done.json").exists():
            if not self.train:
                self.missing.append(f"{DMS_ROW} seed {seed} (not trained)")
                return None
            t0 = time.time()
            train_dms_row(self.base, d, self.s, c, seed, self.mod)
            (d / "train_seconds.txt").write_text(f"{time.time() - t0:.1f}\n")
            print(f"[controls {self.task}] trained {DMS_ROW} seed {seed} in {time.time() - t0:.0f} s", flush=True)
        r = self.score(f"dms/seed{seed}", lambda: dms_model(self.E, self.base, d, self.pm), "dms")
        if r is None:
            return None
        ts = d / "train_seconds.txt"
        return {**r, "seed": seed, "dir": str(d), "settings": c,
                "train_seconds": float(ts.read_text()) if ts.exists() else None}


def run_stage(task: str, out: Path, *, seeds=(0, 1, 2), n_valid: int = 16, train: bool = True) -> dict:
    """Every step of the module docstring (``train`` false: none run, the record of what exists, the rest named in
    ``missing``); writes ``out/controls.json`` and returns it."""
    t_start = time.time()
    st = Stage(task, out, n_valid=n_valid, train=train)
    runs: dict[str, dict] = {}
    un = st.untrained()
    kv = {str(s): r for s in seeds if (r := st.kvpop(s)) is not None}
    if kv:
        runs[st.row_name] = kv
    sources = dict(CONTROLS)
    if un["keynorm_chosen"] is None:
        sources.pop("fixed-finetune[keynorm]")
        st.missing.append("fixed-finetune[keynorm] (its sign is not chosen yet)")
    else:
        sources["fixed-finetune[keynorm]"] = un["keynorm_chosen"]
    selection = {}
    for name, src in sources.items():
        sel = st.choose_lr(name, src)
        selection[name] = {k: v for k, v in sel.items() if k != "runs"}
        if sel["chosen"] is None:
            continue
        rs = {}
        for s in seeds:
            r = sel["runs"][sel["chosen"]] if s == 0 else st.control(name, src, sel["chosen"], s)
            if r is not None:
                rs[str(s)] = r
        runs[name] = rs
    dms = {str(s): r for s in seeds if (r := st.dms(s)) is not None}
    if dms:
        runs[DMS_ROW] = dms
    for name, r in un["rows"].items():
        if r is not None and name != "dense":
            runs[name] = {"0": r}
    dense = un["rows"].get("dense")
    record = {
        "instrument": task, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "split": {"of": "the task's validation seeds (valid_seed): not a test; the demo's selection chose the KVpop "
                        "row's settings on valid_seed(1000..1005), and the lookahead row's head budgets were measured "
                        "on valid_seed(0..7)",
                  "fit": st.fit, "select": st.select, "reported_on": "all: the fit part, then the select part",
                  "choices_on": "the select part",
                  "dms_threshold_on": [st.mod.valid_seed(CALIBRATE_FIRST + i) for i in range(n_valid)]},
        "settings": {"length": st.s["train_len"], "train_length": st.s["train_length"], "sinks": st.s["sinks"],
                     "window": st.s["window"], "budget": st.budget, "trained_at": st.budget, "served_at": st.budget,
                     "steps": st.row["settings"]["steps"],
                     "metric": "accuracy at the graded positions per sequence, higher is better"},
        "kvpop_row": {"name": st.row_name, "policy": st.row["policy"], "settings": st.row["settings"],
                      "legend": st.row["legend"], "served_at": st.budget,
                      "trained_at": st.s["sinks"] + st.s["window"] + int(st.row["settings"]["k"])},
        "rule": "kvpop.training.search.prefer (2 paired standard errors on the select part at the headline budget, "
                "higher accuracy better; a tie keeps the incumbent: keynorm+ for the sign, lr 1e-4 for the model lr)",
        "untrained": {"keynorm_sign": un["keynorm_sign"], "keynorm_chosen": un["keynorm_chosen"]},
        "lr_selection": selection,
        "dense": dense,
        "runs": runs,
        "figures": figures(runs),
        "comparisons": comparisons(task, st.budget, runs, st.row_name) if runs.get(st.row_name) else [],
        "oracle_against_control": comparisons(task, st.budget, runs, ORACLE, against=(STREAMING_CONTROL,))
        if runs.get(ORACLE) and runs.get(STREAMING_CONTROL) else [],
        "command": f"python -m studies.controls_synthetic --task {task} --out {out} --seeds "
                   f"{','.join(map(str, seeds))} --n-valid {n_valid}",
        "missing": st.missing, "seconds_this_call": round(time.time() - t_start, 1),
    }
    write_json(Path(out) / "controls.json", record)
    return record


def markdown(record: dict) -> str:
    """The record's tables for evidence.md: each row's accuracy (mean over seeds, and each seed's), the decisions
    and the paired intervals (generated from ``controls.json``, never typed)."""
    sel = record["lr_selection"]
    b = record["settings"]["budget"]
    out = [f"| row | lr (model) | seeds | accuracy at B={b} (mean) | per seed |", "|---|---|---|---|---|"]
    if record.get("dense"):
        out.append(f"| dense | - | - | {mean(record['dense']['per_sequence']):.4f} | - |")
    for f in record["figures"]:
        r = f["row"]
        lr = f"{sel[r]['chosen']:g}" if r in sel and sel[r]["chosen"] else \
            f"{record['kvpop_row']['settings'].get('lr_model', 0):g}" if r == record["kvpop_row"]["name"] else "-"
        out.append(f"| {r} | {lr} | {len(f['seeds'])} | {f['mean']:.4f} | "
                   + ", ".join(f"{v:.4f}" for v in f["per_seed"].values()) + " |")
    out += ["", "| decision | incumbent | challenger | mean_diff | SE | adopted |", "|---|---|---|---|---|---|"]
    decisions = [record["untrained"]["keynorm_sign"]] if record["untrained"].get("keynorm_sign") else []
    for s in sel.values():
        decisions += s["decisions"]
    for d in decisions:
        se = "-" if d["se"] is None else f"{d['se']:.4f}"
        out.append(f"| {d['stage']} | {d['incumbent']} | {d['challenger']} | {d['mean_diff']:+.4f} | {se} | "
                   f"{'yes' if d['adopted'] else 'no'} |")
    out += ["", "| a | b | mean_diff (a - b) | 95 % interval | seeds a / b | verdict |", "|---|---|---|---|---|---|"]
    for c in [*record["comparisons"], *record.get("oracle_against_control", [])]:
        out.append(f"| {c['a']} | {c['b']} | {c['mean_diff']:+.4f} | [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}] | "
                   f"{c['seeds_a']} / {c['seeds_b']} | {c['verdict']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.controls_synthetic", description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, choices=("kvtrace", "lookahead"))
    p.add_argument("--out", required=True, help="run directory (resumable)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--n-valid", type=int, default=16, help="validation sequences of each part (fit, select)")
    p.add_argument("--record-only", action="store_true", help="train and score nothing: the record of what exists")
    p.add_argument("--markdown", action="store_true", help="print the tables of OUT/controls.json and stop")
    a = parse(p, argv)
    try:
        if a.markdown:
            print(markdown(json.loads((Path(a.out) / "controls.json").read_text())), end="")
            return 0
        from kvpop.cli.trained import parse_ints

        from .paths import check_out_dir

        check_out_dir(a.out)
        seeds = parse_ints(a.seeds, "--seeds")
        if not seeds or 0 not in seeds:
            raise ValueError(f"--seeds must list seed 0 (the learning rate is chosen with it), got {a.seeds!r}")
        if a.n_valid < 2:
            raise ValueError(f"--n-valid must be >= 2 (one sequence has no standard error), got {a.n_valid}")
        rec = run_stage(a.task, Path(a.out), seeds=tuple(seeds), n_valid=a.n_valid, train=not a.record_only)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"python -m studies.controls_synthetic: error: {e}", file=sys.stderr)
        return 2
    print(markdown(rec), end="")
    if rec["missing"]:
        print(f"missing: {rec['missing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
