"""The synthetic tasks' evidence (``python -m studies.evidence synthetic --task kvtrace|lookahead``): the
demo's retrofits with three seeds, the paper's exact recipe beside validation's choice, the fixed-mask
fine-tune control at the joint retrofits' steps (its learning rate chosen on validation), DMS tuned on
validation with at least as many trials as the best KVpop row's selection ran, every row scored once on
fresh test sequences.

Stages (``--stage all`` runs them in order; each is resumable):

1. ``select``: the control's learning rate and DMS's grid (:data:`DMS_GRID`, staged), each trial trained with
   seed 0 and scored per select sequence of the demo's validation (``valid_seed(1000 + i)``) by
   :func:`studies.evidence.choose`, the top two confirmed with seed 1; the KVpop
   recipes are the demo's validated choice (``kvpop.demo.search.CHOSEN``, its selection records counted as
   their trials) and the paper's recipe (no selection); writes ``selection.json``.
2. ``seeds``: every row's recipe with every seed (``RetrofitConfig.seed``: initialisation, data, noise).
3. ``test``: each (row, seed) on ``--n-sequences`` fresh test sequences (``test_seed(FRESH_FIRST + i)``, never
   scored before) at L_train and 2 L_train, once (:class:`~studies.evidence.TestLog`); then
   ``evidence_rows.json``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from kvpop.training.search import confirm_choice

from .ledger import TestLog, choose, summarize, write_json
from .paths import DATA

FRESH_FIRST = 10_000
"""First test seed index of the evidence's test sequences (the demo's tables used 0..5)."""
DMS_GRID = {"lr_gate": (0.02, 0.05, 0.1, 0.2), "lr_model": (1e-4, 3e-4, 1e-3), "steps": (100, 200, 400),
            "target_keep": (0.04, 0.02, 0.08, 0.15), "schedule_frac": (0.6, 0.3, 0.9)}
"""DMS's candidates, staged: every (lr_gate, lr_model) at the first steps / keep / schedule (12), then the best
with the other step counts (2), keep targets (3) and schedule fractions (2): 19 trials."""
CONTROL_LR = (1e-4, 1e-3)
HEADLINE_BUDGET = {"kvtrace": 128, "lookahead": 64}
SELECTION_FILES = ("selection.json", "selection-label.json", "selection-target_source.json")


def _demo(task: str, out: Path, n_valid: int):
    """The demo's settings (:func:`kvpop.demo.search.settings`) for ``task``."""
    from kvpop.cli import demo as D
    from kvpop.demo import search as S

    p = argparse.ArgumentParser()
    D.add_arguments(p)
    args = D.options(p.parse_args(["--out", str(out), "--task", task, "--no-progress", "--n-sequences",
                                   str(n_valid)]))
    return S, args, S.settings(args, task)


def _name(policy: str, c: dict) -> str:
    if policy == "fixed-finetune":
        return "fixed-finetune[streaming]"
    parts = [c.get("label", "mean"), "paper-decay" if c.get("decay_span") is None else f"decay{c['decay_span']:g}",
             "adaptive" if c.get("head_budgets") == "ablation" else "uniform"]
    if policy.endswith("joint"):
        parts.append(c.get("target_source", "student"))
        if c.get("joint_init") == "scorer-only":
            parts.append("warm")
    return f"{policy}[{','.join(parts)}]"


PAPER = {"label": "mean", "decay_span": None, "target_source": "student", "joint_init": "fresh"}
"""The paper's recipe: mean label, its decay range, uniform budgets, the student's sparse label, fresh scorers."""


def rows_of(task: str, s: dict) -> dict[str, dict]:
    """name -> ``{"policy", "settings", "legend"}`` of every KVpop row: validation's choice of the demo's joint
    MLP retrofit (its best row on both tasks) and the paper's recipe of it.  The scorer-only retrofits are not
    rows here: their early-stopped runs of up to 3,000 steps, three seeds each, do not fit this machine's CPU
    budget beside the rest (the demo's tables report them, one seed)."""
    out = {}
    for p in ("kvpop-mlp-joint",):
        c = dict(s["retrofits"][p])
        out[_name(p, c)] = {"policy": p, "settings": c, "legend": "validation's choice (kvpop demo --select)",
                            "chosen": True}
    paper = {k: v for k, v in s["retrofits"]["kvpop-mlp-joint"].items() if k != "head_budgets"}
    paper.update(PAPER)
    same = [n for n, r in out.items() if r["settings"] == paper]
    for n in same:  # validation chose the paper's recipe: the row keeps the paper's name
        out["kvpop-mlp-joint[paper]"] = out.pop(n)
        out["kvpop-mlp-joint[paper]"]["legend"] += ", which is the paper's recipe (mean label, its decay range, " \
                                                   "uniform budgets, student label)"
    if not same:
        out["kvpop-mlp-joint[paper]"] = {"policy": "kvpop-mlp-joint", "settings": paper, "chosen": False,
                                           "legend": "the paper's recipe: mean label, the paper's decay range, "
                                                     "uniform budgets, student label"}
    return out


def shipped_trials(task: str, policy: str) -> int:
    """The validation trials the demo's selection records ran for ``policy`` and the scorer-only retrofit whose
    settings it inherits (``kvpop/data/demo_results/<task>/selection*.json``)."""
    from kvpop.demo.grid import JOINT_OF

    d = DATA / "demo_results" / task
    feeds = {policy, JOINT_OF.get(policy, policy)}
    n = 0
    for f in SELECTION_FILES:
        if (d / f).exists():
            n += sum(1 for c in json.loads((d / f).read_text())["trials"] if c["policy"] in feeds)
    return n


def dms_config(s: dict, c: dict, seed: int):
    """The :class:`~kvpop.demo.retrofit.RetrofitConfig` of DMS with settings ``c`` (:data:`DMS_GRID`'s keys) in the
    demo's settings ``s``, seed ``seed``."""
    from kvpop.demo import retrofit as R

    return R.RetrofitConfig(steps=int(c["steps"]), length=s["train_length"], batch=1, sinks=s["sinks"],
                            window=s["window"], lr_scorer=float(c["lr_gate"]), lr_model=float(c["lr_model"]),
                            train_model=True, checkpoint_every=max(1, min(50, int(c["steps"]) // 4)), seed=seed)


def train_dms_row(base, d: Path, s: dict, c: dict, seed: int, mod) -> Path:
    """Train (or reuse) DMS with settings ``c`` and ``seed`` into ``d``, as the evidence's ``dms[tuned]`` rows."""
    from kvpop.demo import retrofit as R

    return R.retrofit_dms(base, d, dms_config(s, c, seed), target_keep=float(c["target_keep"]),
                          schedule_frac=float(c["schedule_frac"]), resume=True, progress=False, task=mod)


def _score(S, E, mod, model, policy: str, vcfg, fit) -> dict:
    """``{"score", "per_sequence"}``: ``policy``'s validation accuracy per select sequence (averaged over the
    budgets at L_train; DMS's gate threshold calibrated on the ``fit`` sequences) and their mean."""
    err, _ = S.per_seed_errors(E, mod, model, policy, vcfg, fit)
    acc = [1.0 - e for e in err]
    return {"score": sum(acc) / len(acc), "per_sequence": acc}


def run(a: argparse.Namespace) -> int:
    import torch

    from kvpop.demo import retrofit as R
    from kvpop.evaluation import evaluate as E

    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from kvpop.cli.trained import parse_ints

    seeds = parse_ints(a.seeds, "--seeds")
    if not seeds:
        raise ValueError(f"--seeds lists no seed: {a.seeds!r}")
    S, args, s = _demo(a.task, out, a.n_valid)
    mod = S.task_module(a.task)
    base = E.load_base_model(S.base_model_dir(args, a.task))
    vcfg, fit = S.valid_config(E, s, args), S.valid_config(E, s, args, "fit")
    pm = dict(sinks=s["sinks"], window=s["window"], budget=s["budgets"][0])
    stages = ("select", "seeds", "test") if a.stage == "all" else (a.stage,)
    sel_file = out / "selection.json"
    kv_rows = rows_of(a.task, s)
    control_steps = max(int(r["settings"]["steps"]) for r in kv_rows.values() if r["policy"].endswith("joint"))
    best_trials = max(shipped_trials(a.task, r["policy"]) for r in kv_rows.values() if r["chosen"])

    def train_dms(d: Path, c: dict, seed: int) -> None:
        train_dms_row(base, d, s, c, seed, mod)

    def dms_model(d: Path):
        return E.policy_model(base, "dms", scorers=d / "gates.safetensors", finetuned=E.load_base_model(d / "model"),
                              **pm)

    def train_kv(name: str, r: dict, seed: int) -> Path:
        d = out / name / f"seed{seed}"
        p, c = r["policy"], r["settings"]
        rc = replace(S.retrofit_config(s, p, c), seed=seed)
        R.retrofit(base, p, d, rc, resume=True, progress=False, task=mod,
                   validate=S.validator(E, mod, base, s, args, p, d, {}) if rc.eval_every else None)
        return d

    if "select" in stages:
        record = json.loads(sel_file.read_text()) if sel_file.exists() else {}
        if not record.get("final"):
            record = {"instrument": a.task, "criterion": "validation accuracy over the budgets at L_train per select "
                      f"sequence (valid_seed({vcfg.first_seed}..{vcfg.first_seed + vcfg.n_sequences - 1}), budgets "
                      f"{vcfg.budgets}), their mean; higher is better",
                      "rule": "kvpop.training.search.prefer (2 paired standard errors), confirmed with seed 1",
                      "split": S.split_record(mod, E, s, args), "decisions": [], "confirmation": {},
                      "kvpop": {n: {"settings": r["settings"], "trials": shipped_trials(a.task, r["policy"])
                                    if r["chosen"] else 0, "from": "kvpop/data/demo_results/"
                                    f"{a.task}/selection*.json" if r["chosen"] else "the paper's recipe"}
                                for n, r in kv_rows.items()},
                      "control": {"trials": []}, "dms": {"trials": []}, "best_kvpop_trials": best_trials}
            def control(c: dict, seed: int = 0) -> dict:
                d = out / "control_select" / f"lr{c['lr_model']:g}" / ("" if not seed else f"seed{seed}")
                rc = replace(S.retrofit_config(s, "fixed-finetune", c), seed=seed)
                R.retrofit(base, "fixed-finetune", d, rc, resume=True, progress=False, task=mod)
                t = {"settings": c, **_score(S, E, mod, S.policy_model(E, base, "fixed-finetune", d, pm),
                                             "fixed-finetune", vcfg, fit), "dir": str(d)}
                print(f"[evidence {a.task}] control {c} seed {seed}: validation {t['score']:.3f}", flush=True)
                return t

            ctrl = record["control"]["trials"]
            ctrl += [control({"steps": control_steps, "lr_model": lr}) for lr in CONTROL_LR]
            best = choose(ctrl, decisions=record["decisions"], stage="control lr_model")
            best, record["confirmation"]["control"] = confirm_choice(best, ctrl, lambda t: control(t["settings"], 1),
                                                                     seed=("seed", 1), higher_is_better=True)
            record["control"]["chosen"] = best
            write_json(sel_file, record)
            trials = record["dms"]["trials"]

            def trial(c: dict, seed: int = 0) -> dict:
                d = out / "dms_select" / "_".join(f"{k}{v:g}" for k, v in sorted(c.items()))
                d = d / f"seed{seed}" if seed else d
                train_dms(d, c, seed)
                t = {"settings": c, **_score(S, E, mod, dms_model(d), "dms", vcfg, fit), "dir": str(d)}
                if not seed:
                    trials.append(t)
                    write_json(sel_file, record)
                print(f"[evidence {a.task}] dms {c} seed {seed}: validation {t['score']:.3f}", flush=True)
                return t

            g = DMS_GRID
            first = {k: v[0] for k, v in g.items()}
            best = choose([trial({**first, "lr_gate": lg, "lr_model": lm}) for lg in g["lr_gate"]
                           for lm in g["lr_model"]], decisions=record["decisions"], stage="dms lr_gate x lr_model")
            for key in ("steps", "target_keep", "schedule_frac"):
                best = choose([best] + [trial({**best["settings"], key: v}) for v in g[key][1:]],
                              decisions=record["decisions"], stage=f"dms {key}")
            best, record["confirmation"]["dms"] = confirm_choice(best, trials, lambda t: trial(t["settings"], 1),
                                                                 seed=("seed", 1), higher_is_better=True)
            record["dms"]["chosen"] = best
            record["final"] = True
            if len(trials) < best_trials:
                raise ValueError(f"DMS ran {len(trials)} validation trials, fewer than the best KVpop row's "
                                 f"{best_trials}: widen DMS_GRID")
            write_json(sel_file, record)
    sel = json.loads(sel_file.read_text()) if sel_file.exists() else {}
    if ("seeds" in stages or "test" in stages) and not sel.get("final"):
        raise ValueError(f"{sel_file} is not final: run --stage select first")
    ctrl = {"policy": "fixed-finetune", "settings": sel["control"]["chosen"]["settings"], "chosen": True,
            "legend": f"the control: the model fine-tuned {control_steps} steps (the joint retrofits' most) under the "
                      "fixed StreamingLLM mask, its learning rate chosen on validation"} if sel else None
    all_rows = {**kv_rows, "fixed-finetune[streaming]": ctrl}
    if "seeds" in stages:
        for seed in seeds:
            for name, r in all_rows.items():
                print(f"[evidence {a.task}] {name} seed {seed}", flush=True)
                if r["policy"] == "fixed-finetune":
                    d = out / name / f"seed{seed}"
                    R.retrofit(base, "fixed-finetune", d, replace(S.retrofit_config(s, "fixed-finetune",
                                                                                     r["settings"]), seed=seed),
                               resume=True, progress=False, task=mod)
                else:
                    train_kv(name, r, seed)
            print(f"[evidence {a.task}] dms[tuned] seed {seed}", flush=True)
            train_dms(out / "dms[tuned]" / f"seed{seed}", sel["dms"]["chosen"]["settings"], seed)
    if "test" in stages:
        _test(a, out, seeds, E, S, mod, base, s, pm, all_rows, sel, dms_model)
    return 0


def _test(a, out: Path, seeds, E, S, mod, base, s: dict, pm: dict, all_rows: dict, sel: dict, dms_model) -> None:
    tl = TestLog(out)
    cfg = E.EvalConfig(train_len=s["train_len"], lengths=[s["train_len"], 2 * s["train_len"]], budgets=s["budgets"],
                       n_sequences=a.n_test, sinks=s["sinks"], window=s["window"], progress=False,
                       first_seed=FRESH_FIRST, split="test")

    def rows_for(models: dict) -> list[dict]:
        return E.evaluate({"dense": base, **models}, cfg, task=mod)["rows"]

    fixed = tl.once("fixed", lambda: rows_for({"streaming": E.policy_model(base, "streaming", **pm)}))
    per: dict[str, dict[int, list]] = {}
    for name, r in {**all_rows, "dms[tuned]": {"policy": "dms"}}.items():
        for seed in seeds:
            d = out / name / f"seed{seed}"
            model = dms_model(d) if r["policy"] == "dms" else None
            per.setdefault(name, {})[seed] = tl.once(f"{name}|seed{seed}", lambda d=d, r=r, model=model: rows_for(
                {r["policy"]: model if model is not None else S.policy_model(E, base, r["policy"], d, pm)}))
    out_rows = []
    hb = HEADLINE_BUDGET[a.task]
    for L in cfg.lengths:
        for b in cfg.budgets:
            def acc(rows, pol, b=b, L=L):
                return next(x["accuracy"] for x in rows if (x["policy"], x["budget"], x["length"]) == (pol, b, L))

            dense = next(x["accuracy"] for x in fixed if x["policy"] == "dense" and x["length"] == L)
            base_row = {"instrument": a.task, "budget": b, "length": L, "budget_fraction": b / s["train_len"],
                        "metric": "accuracy", "headline": b == hb, "dense": dense,
                        "test_sequences": f"test_seed({FRESH_FIRST}..{FRESH_FIRST + a.n_test - 1})"}
            for pol, recipe, legend in (("dense", {"rule": "full cache"}, "the unchanged model, full cache"),
                                        ("streaming", {"rule": "StreamingLLM"},
                                         "fixed rule (no training, deterministic: one evaluation)")):
                v = dense if pol == "dense" else acc(fixed, pol)
                out_rows.append({**base_row, "policy": pol, "recipe": recipe, "steps": None, "seeds": [v],
                                 **summarize([v]), "value": v, "trials": 0, "test_evaluations": tl.count("fixed"),
                                 "legend": legend})
            for name, r in {**all_rows, "dms[tuned]": {"policy": "dms"}}.items():
                vals = [acc(per[name][seed], r["policy"]) for seed in seeds]
                if r["policy"] == "dms":
                    c = sel["dms"]["chosen"]["settings"]
                    recipe, steps, trials = c, c["steps"], len(sel["dms"]["trials"])
                    legend = (f"DMS, gates and model together, gate lr / model lr / steps / keep / schedule chosen on "
                              f"validation ({trials} trials), gate threshold per budget chosen on validation")
                elif r["policy"] == "fixed-finetune":
                    recipe, steps = r["settings"], r["settings"]["steps"]
                    trials, legend = len(sel["control"]["trials"]), r["legend"]
                else:
                    recipe, steps = r["settings"], r["settings"]["steps"]
                    trials, legend = sel["kvpop"][name]["trials"], r["legend"]
                out_rows.append({**base_row, "policy": name, "recipe": recipe, "steps": steps, "seeds": vals,
                                 **summarize(vals), "value": summarize(vals)["mean"], "trials": trials,
                                 "test_evaluations": tl.count(*(f"{name}|seed{x}" for x in seeds)),
                                 "legend": legend})
    write_json(out / "evidence_rows.json", {"rows": out_rows, "seeds": seeds})
    print(json.dumps([(r["policy"], r["budget"], r["length"], round(r["mean"], 3)) for r in out_rows
                      if r["headline"]]), flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", required=True, choices=("kvtrace", "lookahead"))
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--stage", default="all", choices=("all", "select", "seeds", "test"))
    p.add_argument("--n-valid", type=int, default=6, help="validation sequences of every choice (the demo's 6)")
    p.add_argument("--n-test", type=int, default=8, help="fresh test sequences per length (default 8)")
