"""The lookahead claim rerun with head-adaptive controls (issue 61, item 3): the same-structure controls of
:mod:`studies.controls_synthetic` trained and served with the KVpop row's head-adaptive budgets, then every (row,
seed) scored once on a fresh test split.

The ledger's best lookahead row, ``kvpop-mlp-joint[max,paper-decay,adaptive,teacher]``, serves per-head budgets
(``head_budgets="ablation"``: measured by ablation on ``valid_seed(0..7)`` before training, at its training budget
sinks + window + k = 48, shared anew from the same importance at the served B = 64,
:func:`kvpop.core.budgets.rebudget`), while :mod:`studies.controls_synthetic` trained and served every control with
uniform budgets.  Here, on the lookahead task at L_train = 512, B = 64, sinks 4, window 32::

    python -m studies.controls_adaptive --out /work/adaptive_ctl/run                      # resumable
    python -m studies.controls_adaptive --out /work/adaptive_ctl/run --record-only \\
        --record studies/results/evidence/lookahead/controls_adaptive.json --write-shipped

1. **The KVpop row** retrained with every seed exactly as :mod:`studies.controls_synthetic` retrains it
   (:meth:`studies.controls_synthetic.Stage.kvpop`: ``python -m studies.evidence synthetic``'s recipe; its trained
   files are not shipped).  Its seed-0 run measures the head budgets (``head_budgets.json``, the ablation above);
   the rows it **serves** at B = 64 (read off the served model's config) are :func:`served_head_budgets`; every
   seed's measurement must be the same (it reads the frozen base model only).
2. **The controls** (:data:`ADAPTIVE`): ``fixed-finetune[random]``, ``fixed-finetune[keynorm]`` (the sign
   ``controls.json`` chose on the untrained runs) and ``oracle[label]`` (not causal: an upper bound), each
   :func:`studies.controls_synthetic.control_config` (the KVpop row's steps, data, sinks, window, label and decay,
   trained at the headline budget, the scorer never updated), but with the KVpop row's served per-head budgets
   in training and serving (:func:`train_adaptive`: the retrofit with those rows given, as the CLI's
   ``--head-budgets`` gives a scorer run's file; ``--allocate`` is refused with a priority that is not learned,
   since it measures under the exact label).  The model learning rate: :data:`studies.controls_synthetic.LR_MODEL`
   in order, chosen by ``kvpop.training.search.prefer`` on the select part (``valid_seed(1000..1015)``) with
   seed 0, then seeds 1 and 2 (:meth:`Stage.choose_lr`).  ``fixed-finetune[window-attention]`` is not run:
   :data:`NOT_RUN` says why (the package serves that priority with uniform budgets only).
3. Every (row, seed), and the dense model once, scored per sequence (accuracy at the graded positions,
   teacher-forced, :func:`studies.controls_synthetic.sequence_accuracies`) on ``test_seed(FIRST + i)``,
   ``i < N_TEST``, through one :class:`studies.ledger.TestLog` (``OUT/test_log.jsonl``: at most once, ever).
   The range is disjoint from every earlier scoring of the synthetic tasks (:func:`earlier`).
4. The paired 95 % intervals (:func:`studies.paired.comparison`, every sequence its own cluster, over seeds) of
   the KVpop row minus each control, with :func:`studies.paired.seed_t_interval` and
   :func:`studies.paired.strength`; the record ``OUT/controls_adaptive.json`` and its tables (``.md``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .controls_synthetic import (
    LR_MODEL,
    ORACLE,
    Stage,
    comparisons,
    control_config,
    figures,
    lr_tag,
    mean,
    sequence_accuracies,
)
from .fresh_synthetic import FRESH2_FIRST, check_disjoint, earlier_ranges, missing
from .fresh_synthetic import N_TEST as FRESH2_N
from .ledger import TestLog, write_json
from .paths import parse

TASK = "lookahead"
FIRST = 40_000
N_TEST = 128
SPLIT = "test_fresh_adaptive"
"""The split's name: the synthetic tasks' third fresh test split (``test_seed(40000..40127)``; not the real-text
``test_fresh3``)."""
KEYNORM_ROW = "fixed-finetune[keynorm]"
ADAPTIVE = {"fixed-finetune[random]": "random", KEYNORM_ROW: None, ORACLE: "oracle-label"}
"""The controls run with head-adaptive budgets: row -> ``priority_source`` (the key norm's sign from
``controls.json``)."""
NOT_RUN = {"fixed-finetune[window-attention]":
           "kvpop serves priority_source='window-attention' with uniform budgets only (RetrofitConfig and the "
           "training CLI refuse head budgets with it, and WindowAttentionHooks call _uniform_only at serving: its "
           "running sums sit in the window's slots of the uniform cache); running it head-adaptively needs a "
           "change to kvpop.core.priority_sources, outside this study"}
NOT_CAUSAL = (ORACLE,)
DENSE = "dense"
WHY_FRESH = ("every earlier test scoring of the synthetic tasks drew test_seed(first + i) with first 0 (the demo's "
             "tables 0..5, the label study's 0..63, the shipped models' dense checks 0..31; counted as 0..9999), "
             "10000 (the ledger's 10000..10007, studies.auto_task_test on the same) or 20000 "
             "(studies.fresh_synthetic's test_fresh2, 20000..20127, which studies.paper_exact and "
             "studies.equal_bytes also scored); this split starts at 40000, above all of them; test seeds are "
             "disjoint from training and validation seeds by construction (kvpop.demo.task: test seeds from 1e9, "
             "validation from 1.5e9)")


def earlier() -> list[tuple[int, int]]:
    """Every earlier test range of the synthetic tasks: :func:`studies.fresh_synthetic.earlier_ranges` and its own
    ``test_fresh2``."""
    return [*earlier_ranges(), (FRESH2_FIRST, FRESH2_FIRST + FRESH2_N - 1)]


def control_sources(controls: dict) -> dict[str, str]:
    """:data:`ADAPTIVE` with the key norm's sign that ``controls.json`` chose (ValueError when it chose none)."""
    sign = controls.get("untrained", {}).get("keynorm_chosen")
    if sign not in ("keynorm+", "keynorm-"):
        raise ValueError(f"controls.json chose no key-norm sign (got {sign!r})")
    return {r: sign if r == KEYNORM_ROW else s for r, s in ADAPTIVE.items()}


def adaptive_kv(policy: str, cfg, rows):
    """The :class:`~kvpop.core.config.KVpopConfig` a control trains under: the retrofit's
    (:func:`kvpop.demo.retrofit.kv_config`) with the per-head budgets ``rows`` (their mean ``cfg.budget``)."""
    from kvpop.demo import retrofit as R

    return R.kv_config(policy, cfg).replace(head_budgets=tuple(tuple(int(b) for b in r) for r in rows))


def train_adaptive(base, policy: str, d: Path, cfg, rows, plan: dict, mod) -> Path:
    """Train (or reuse) the control ``cfg`` (uniform in itself, ``head_allocation`` None) into ``d`` with the per-head
    budgets ``rows`` given: :func:`kvpop.demo.retrofit.retrofit`'s run with the rows in the config (as
    ``kvpop train --head-budgets FILE`` gives them), ``done.json``'s settings stamped with them, and
    ``d/head_budgets.json`` holding them with ``plan``'s importance (where they were measured)."""
    from kvpop.core import budgets as B
    from kvpop.demo import retrofit as R

    if cfg.head_allocation is not None:
        raise ValueError("train_adaptive gives the rows itself: cfg.head_allocation must be None")
    kv = adaptive_kv(policy, cfg, rows)
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    B.write_head_budgets(d / B.HEAD_BUDGETS_FILE, kv.head_budgets, importance=plan.get("importance"),
                         min_k=plan.get("min_k", 0), granularity=plan.get("granularity", 1),
                         given_from=plan.get("from"), measured_on=plan.get("measured_on"))
    settings = {"policy": policy, **cfg.stamp(), "head_budgets": [list(r) for r in kv.head_budgets]}

    def attach(m) -> None:
        R.patch(m, kv)

    def save(m, out: Path) -> None:
        R.save_scorers(m, out / "scorers.safetensors")

    return R._run(base, d, settings, cfg, attach, save, True,
                  R.retrofit_seed(R.LABEL_VARIANTS.get(policy, policy), cfg.seed), resume=True, progress=False,
                  task_cfg=None, task=mod)


def served_rows(model) -> tuple[tuple[int, ...], ...] | None:
    """The per-head budgets a served (patched) model holds (None: uniform)."""
    from kvpop.core.patching import get_config

    return get_config(model).head_budgets


class AdaptiveStage(Stage):
    """:class:`studies.controls_synthetic.Stage` whose controls train and serve with the KVpop row's served per-head
    budgets (:meth:`head_budgets`)."""

    def __init__(self, task: str, out: Path, *, n_valid: int, train: bool = True):
        super().__init__(task, out, n_valid=n_valid, train=train)
        self.plan: dict | None = None

    def head_budgets(self) -> dict | None:
        """The KVpop row's per-head budgets: its seed-0 run's measurement and the rows it serves at the headline
        budget (None while seed 0 is not trained)."""
        if self.plan is not None:
            return self.plan
        d = self.out / "kvpop" / self.row_name / "seed0"
        if self.kvpop(0) is None:
            return None
        f = d / "head_budgets.json"
        raw = json.loads(f.read_text())
        model = self.S.policy_model(self.E, self.base, self.row["policy"], d, self.pm)
        rows = served_rows(model)
        if rows is None or sum(map(sum, rows)) != len(rows) * len(rows[0]) * self.budget:
            raise ValueError(f"the KVpop row serves {rows}, not per-head budgets of mean {self.budget}")
        self.plan = {"from": str(f), "trained_rows": raw["head_budgets"], "trained_budget": raw["budget"],
                     "rows": [list(r) for r in rows], "budget": self.budget, "importance": raw["importance"],
                     "min_k": raw.get("min_k", 0), "granularity": raw.get("granularity", 1),
                     "measured_on": raw.get("measured_on")}
        return self.plan

    def check_same_measurement(self, seeds) -> list[str]:
        """Each trained KVpop seed's ``head_budgets.json`` against seed 0's (the same rows and importance)."""
        p, diff = self.head_budgets(), []
        for s in seeds:
            f = self.out / "kvpop" / self.row_name / f"seed{s}" / "head_budgets.json"
            if f.exists():
                raw = json.loads(f.read_text())
                if (raw["head_budgets"], raw["importance"]) != (p["trained_rows"], p["importance"]):
                    diff.append(f"seed {s}")
        return diff

    def control(self, name: str, source: str, lr: float, seed: int) -> dict | None:
        plan = self.head_budgets()
        if plan is None:
            self.missing.append(f"{name}: the KVpop row's seed 0 (its head budgets) is not trained")
            return None
        d = self.out / "controls" / name / lr_tag(lr) / f"seed{seed}"
        cfg = control_config(self.s, self.row, source, self.budget, lr, seed)
        policy = self.row["policy"]
        if not (d / "done.json").exists():
            if not self.train:
                self.missing.append(f"{name} {lr_tag(lr)} seed {seed} (not trained)")
                return None
            t0 = time.time()
            train_adaptive(self.base, policy, d, cfg, plan["rows"], plan, self.mod)
            (d / "train_seconds.txt").write_text(f"{time.time() - t0:.1f}\n")
            print(f"[adaptive {self.task}] trained {name} {lr_tag(lr)} seed {seed} in {time.time() - t0:.0f} s",
                  flush=True)
        r = self.score(f"{name}/{lr_tag(lr)}/seed{seed}", lambda: self.served(policy, d), policy)
        if r is None:
            return None
        ts = d / "train_seconds.txt"
        return {**r, "lr_model": lr, "seed": seed, "dir": str(d), "policy": policy,
                "settings": json.loads((d / "done.json").read_text())["settings"],
                "train_seconds": float(ts.read_text()) if ts.exists() else None}

    def served(self, policy: str, d: Path):
        """The model serving the run in ``d``, refused unless it holds the KVpop row's served per-head budgets."""
        model = self.S.policy_model(self.E, self.base, policy, Path(d), self.pm)
        got, want = served_rows(model), self.head_budgets()["rows"]
        if got is None or [list(r) for r in got] != want:
            raise ValueError(f"{d} serves head budgets {got}, not the KVpop row's {want}")
        return model


def train_all(st: AdaptiveStage, controls: dict, seeds) -> dict:
    """Steps 1-2 of the module docstring: ``{"runs": {row: {seed: run}}, "lr_selection": {...}}`` (validation)."""
    runs: dict[str, dict] = {}
    kv = {}
    for s in seeds:
        r = st.kvpop(s)
        if r is not None:
            kv[str(s)] = {**r, "policy": st.row["policy"]}
    if kv:
        runs[st.row_name] = kv
    selection = {}
    for name, src in control_sources(controls).items():
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
    return {"runs": runs, "lr_selection": selection}


def test_table(runs: dict) -> dict:
    """``{row: {seed: run}}`` to score on the test split (each run's ``dir``, ``policy``, ``settings``,
    ``lr_model``), and the dense model once."""
    keep = ("dir", "policy", "settings", "lr_model")
    out = {row: {s: {k: r[k] for k in keep if k in r} for s, r in seeds.items()} for row, seeds in runs.items()}
    out[DENSE] = {"0": {"dir": None, "policy": "dense"}}
    return out


def score_test(st: AdaptiveStage, table: dict, *, n: int, first: int = FIRST) -> TestLog:
    """Every (row, seed) of ``table`` on ``test_seed(first + i)``, ``i < n``, each once (``OUT/test_log.jsonl``)."""
    check_disjoint(first, n, earlier())
    seeds = [st.mod.test_seed(first + i) for i in range(n)]
    examples = [st.mod.make_example(v, st.s["train_len"]) for v in seeds]
    tl = TestLog(st.out)
    for row, rs in table.items():
        for s, run in rs.items():
            def one(row=row, s=s, run=run) -> dict:
                t0 = time.time()
                p = run["policy"]
                model = st.base if p == DENSE else st.served(p, Path(run["dir"]))
                per = sequence_accuracies(st.E, model, examples, p, st.budget)
                print(f"[adaptive test {row} seed {s}] {mean(per):.4f} ({time.time() - t0:.1f} s)", flush=True)
                return {"per_sequence": per, "first": first, "n": n, "run": run}

            tl.once(f"{row}|seed{s}", one)
    return tl


def intervals(runs: dict, a: str, budget: int, *, n_boot: int = 10_000) -> list[dict]:
    """The paired intervals of ``a`` minus every other row but dense (:func:`studies.controls_synthetic.comparisons`),
    each with the seed-level t-interval and :func:`studies.paired.strength`."""
    from .paired import seed_t_interval, strength

    out = []
    for c in comparisons(TASK, budget, runs, a, against=[r for r in runs if r not in (a, DENSE)], n_boot=n_boot):
        sa = [mean(runs[a][s]["per_sequence"]) for s in sorted(runs[a], key=int)]
        sb = [mean(runs[c["b"]][s]["per_sequence"]) for s in sorted(runs[c["b"]], key=int)]
        out.append({**c, "split": SPLIT, "seed_t": seed_t_interval(sa, sb),
                    "strength": strength(c["ci95"], lower_is_better=False), "not_causal_b": c["b"] in NOT_CAUSAL})
    return out


def build_record(st: AdaptiveStage, controls: dict, trained: dict, tl: TestLog, table: dict, *, n: int,
                 first: int = FIRST, n_boot: int = 10_000) -> dict:
    """The record (refused unless every (row, seed) of ``table`` is logged on this split)."""
    if lost := missing(tl, table):
        raise ValueError(f"not scored yet: {', '.join(lost)}")
    test: dict[str, dict] = {}
    for row, ss in table.items():
        for s in ss:
            e = tl.entries[f"{row}|seed{s}"]
            if (e["result"]["first"], e["result"]["n"]) != (first, n):
                raise ValueError(f"{row}|seed{s} was scored on test_seed({e['result']['first']}..), not this split")
            test.setdefault(row, {})[s] = {**e["result"]["run"], "per_sequence": e["result"]["per_sequence"],
                                           "scored": e["date"], "seconds": e["seconds"]}
    plan = st.head_budgets()
    dates = sorted(e["date"] for e in tl.entries.values())
    validation = {row: {s: {k: r[k] for k in ("per_sequence", "eval_seconds", "train_seconds", "lr_model", "dir")
                            if k in r} for s, r in rs.items()} for row, rs in trained["runs"].items()}
    return {
        "instrument": TASK, "issue": "61 item 3", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "split": SPLIT, "test_sequences": f"test_seed({first}..{first + n - 1})",
        "seeds_of_split": {"first": first, "n": n, "earlier": earlier(), "why_fresh": WHY_FRESH},
        "settings": {"length": st.s["train_len"], "budget": st.budget, "sinks": st.s["sinks"],
                     "window": st.s["window"], "steps": st.row["settings"]["steps"],
                     "metric": "accuracy at the graded positions per sequence, higher is better",
                     "controls_trained_at": st.budget, "served_at": st.budget},
        "kvpop_row": {"name": st.row_name, "policy": st.row["policy"], "settings": st.row["settings"],
                      "legend": st.row["legend"], "trained_at": plan["trained_budget"], "served_at": st.budget},
        "head_budgets": {
            "how": "measured by the KVpop row's own seed-0 retrofit (head_allocation='ablation': ablation "
                   "importance under the exact label of the frozen base model on valid_seed(0..7), shared at its "
                   "training budget), then the rows that row serves at B = 64 (kvpop.core.budgets.rebudget from the "
                   "same importance), read off the served model; the controls train and serve with exactly those "
                   "rows (layers x KV heads)",
            "kvpop_trained_rows": plan["trained_rows"], "kvpop_trained_budget": plan["trained_budget"],
            "served_rows": plan["rows"], "served_budget": plan["budget"], "importance": plan["importance"],
            "measured_on": plan["measured_on"], "same_in_every_kvpop_seed": not st.check_same_measurement(
                [int(s) for s in trained["runs"].get(st.row_name, {})])},
        "keynorm_sign": {"chosen": controls["untrained"]["keynorm_chosen"],
                         "from": "controls.json (the untrained runs, uniform budgets, select part)"},
        "rule": controls["rule"], "lr_model_candidates": list(LR_MODEL), "lr_selection": trained["lr_selection"],
        "validation": {"of": "fit part valid_seed(0..15), then select part valid_seed(1000..1015) at B = 64; the "
                             "lr choice reads the select part only", "runs": validation},
        "not_run": NOT_RUN, "not_causal": list(NOT_CAUSAL),
        "scorings": {k: 1 for k in tl.entries}, "scored": [dates[0], dates[-1]] if dates else [],
        "runs": test, "figures": figures(test),
        "comparisons": intervals(test, st.row_name, st.budget, n_boot=n_boot),
        "missing": st.missing,
    }


def timings(out: Path) -> dict:
    """Seconds spent (one CPU thread): every training under ``out`` (the KVpop seeds and every control trial,
    ``train_seconds.txt``), every validation scoring (``scores/``) and the test scorings (the test log)."""
    train = {str(f.parent.relative_to(out)): float(f.read_text()) for f in sorted(out.glob("**/train_seconds.txt"))}
    valid = sum(json.loads(f.read_text()).get("eval_seconds", 0.0) for f in out.glob("scores/**/*.json"))
    tl = TestLog(out)
    return {"train": train, "train_total": round(sum(train.values()), 1), "validation_scoring_total": round(valid, 1),
            "test_scoring_total": round(sum(e["seconds"] for e in tl.entries.values()), 1)}


def markdown(rec: dict) -> str:
    """The record's tables (evidence.md): rows, lr decisions, intervals (generated, never typed)."""
    b, L = rec["settings"]["budget"], rec["settings"]["length"]
    out = [f"| row | lr (model) | seeds | accuracy at B={b}, L={L} (mean) | min .. max | per seed |",
           "|---|---|---|---|---|---|"]
    sel = rec["lr_selection"]
    for f in rec["figures"]:
        r = f["row"]
        lr = f"{sel[r]['chosen']:g}" if r in sel else f"{rec['kvpop_row']['settings']['lr_model']:g}" \
            if r == rec["kvpop_row"]["name"] else "-"
        name = f"{r} (not causal)" if r in rec["not_causal"] else r
        out.append(f"| {name} | {lr} | {len(f['seeds'])} | {f['mean']:.4f} | {f['min']:.4f} .. {f['max']:.4f} | "
                   + ", ".join(f"{v:.4f}" for v in f["per_seed"].values()) + " |")
    out += ["", "| lr decision (seed 0, select part) | incumbent | challenger | mean_diff | SE | adopted |",
            "|---|---|---|---|---|---|"]
    for s in sel.values():
        for d in s["decisions"]:
            se = "-" if d["se"] is None else f"{d['se']:.4f}"
            out.append(f"| {d['stage']} | {d['incumbent']} | {d['challenger']} | {d['mean_diff']:+.4f} | {se} | "
                       f"{'yes' if d['adopted'] else 'no'} |")
    out += ["", "| a | b | a - b | 95 % interval (paired, sequences) | seed-level t-interval | seeds a / b | "
                "verdict |", "|---|---|---|---|---|---|---|"]
    for c in rec["comparisons"]:
        t = c["seed_t"]
        ts = "-" if t is None else f"[{t['ci95'][0]:+.4f}, {t['ci95'][1]:+.4f}]"
        b_ = f"{c['b']} (not causal)" if c["b"] in rec["not_causal"] else c["b"]
        out.append(f"| {c['a']} | {b_} | {c['mean_diff']:+.4f} | [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}] | {ts} | "
                   f"{c['seeds_a']} / {c['seeds_b']} | {c['strength']} |")
    hb = rec["head_budgets"]
    out += ["", f"Per-head budgets (layers x KV heads): the KVpop row trained with {hb['kvpop_trained_rows']} "
                f"(mean {hb['kvpop_trained_budget']}) and serves {hb['served_rows']} (mean {hb['served_budget']}); "
                f"the controls train and serve with {hb['served_rows']}."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .paths import RESULTS_DIR

    p = argparse.ArgumentParser(prog="python -m studies.controls_adaptive", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory (resumable): the runs, the test log, the record")
    p.add_argument("--controls", default=None,
                   help="the uniform controls' record (default studies/results/evidence/lookahead/controls.json)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--n-valid", type=int, default=16, help="validation sequences of each part (fit, select)")
    p.add_argument("--n-test", type=int, default=N_TEST, help=f"test sequences (default {N_TEST})")
    p.add_argument("--record-only", action="store_true", help="train and score nothing: the record from OUT")
    p.add_argument("--record", default=None,
                   help="also write the record here (FILE.json) and its tables (FILE.md); the test log stays in OUT")
    a = parse(p, argv)
    try:
        from kvpop.cli.trained import parse_ints

        from .paths import check_out_dir

        out = check_out_dir(a.out)
        seeds = parse_ints(a.seeds, "--seeds")
        if not seeds or 0 not in seeds:
            raise ValueError(f"--seeds must list seed 0 (the learning rate is chosen with it), got {a.seeds!r}")
        if a.n_valid < 2 or a.n_test < 2:
            raise ValueError("--n-valid and --n-test must be >= 2 (one sequence has no standard error)")
        check_disjoint(FIRST, a.n_test, earlier())
        cpath = Path(a.controls) if a.controls else RESULTS_DIR / "evidence" / TASK / "controls.json"
        controls = json.loads(cpath.read_text())
        control_sources(controls)
        t0 = time.time()
        st = AdaptiveStage(TASK, out, n_valid=a.n_valid, train=not a.record_only)
        if controls["kvpop_row"]["name"] != st.row_name or controls["settings"]["budget"] != st.budget:
            raise ValueError(f"{cpath} is not this task's row / budget")
        trained = train_all(st, controls, tuple(seeds))
        table = test_table(trained["runs"])
        tl = TestLog(out) if a.record_only else score_test(st, table, n=a.n_test)
        rec = build_record(st, controls, trained, tl, table, n=a.n_test)
        run_cmd = (f"python -m studies.controls_adaptive --out {out} --seeds {a.seeds} --n-valid {a.n_valid} "
                   f"--n-test {a.n_test}")
        rec.update({"controls": str(cpath), "seconds_this_call": round(time.time() - t0, 1), "command": run_cmd,
                    "commands": [run_cmd, *([f"{run_cmd} --record-only --record {a.record} --write-shipped"]
                                            if a.record else [])],
                    "timings": timings(out)})
        for f in [out / "controls_adaptive.json"] + ([Path(a.record)] if a.record else []):
            write_json(f, rec)
            f.with_suffix(".md").write_text(markdown(rec))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"python -m studies.controls_adaptive: error: {e}", file=sys.stderr)
        return 2
    print(markdown(rec), end="")
    if rec["missing"]:
        print(f"missing: {rec['missing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
