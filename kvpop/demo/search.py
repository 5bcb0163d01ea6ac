"""The training settings of ``kvpop demo`` and their search on validation sequences (``kvpop demo --select``).

The settings of one demo run (:func:`settings`: each retrofit's from :data:`CHOSEN`, the shipped choice, read
from ``kvpop/data/demo_results/chosen.json``, or the command's overrides), the retrofit config and validation
of each (:func:`retrofit_config`, :func:`validator`), and :func:`select`: the demo's stages
(:func:`kvpop.demo.grid.select_plan` over :data:`kvpop.demo.grid.SELECT_GRID`) run by the one
search of the library, :class:`kvpop.training.search.Search` (``kvpop train --auto``'s too), each trial a
retrofit scored on the task's validation sequences, recorded in ``OUT/<task>/selection*.json``.  The command
``kvpop demo`` (``kvpop.cli.demo``) parses its arguments into :class:`DemoOptions` and calls these.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvpop.demo.grid import JOINT_OF, LABEL_KEYS, RETROFITS, SCORER_ONLY, SELECT_GRID
from kvpop.policies import LABEL_VARIANTS
from kvpop.training.search import trial_tag

TASKS = {"kvtrace": "kvpop.demo.task", "lookahead": "kvpop.demo.lookahead_task"}
"""Demo task name -> task module (``make_example``, ``test_seed``, ``valid_seed``, ``TRAIN_LEN``, ``SHIPPED_MODEL``)."""


@dataclass(frozen=True)
class DemoOptions:
    """The options of one ``kvpop demo`` command that the demo's library reads (``kvpop.cli.demo`` builds them
    from the command's arguments; a setting left ``None`` is the shipped choice, :data:`CHOSEN`, or the quick
    run's).  ``recorded``: the command's options as ``OUT/<task>/run.json`` records them."""

    model: str | None = None
    quick: bool = False
    steps: int | None = None
    train_len: int | None = None
    train_length: int | None = None
    train_budget: int | None = None
    sinks: int | None = None
    window: int | None = None
    n_sequences: int | None = None
    lr_scorer: float | None = None
    lr_model: float | None = None
    tau: float | None = None
    dms_steps: int | None = None
    dms_target_keep: float | None = None
    dms_lr: float | None = None
    select_stage: str = "all"
    resume: bool = False
    no_progress: bool = False
    no_plot: bool = False
    no_decode_check: bool = False
    recorded: Mapping = field(default_factory=dict)
def label_variant(joint: str, source: str) -> str:
    """The policy name of ``joint`` trained on the label of ``source`` (``"kvpop-mlp-joint-teacher-label"``)."""
    return f"{joint}-{source}-label"




def demo_retrofits(chosen: dict) -> tuple[str, ...]:
    """The retrofits a demo run trains, in order: :data:`RETROFITS`, then, for each joint retrofit, the
    label source its ``chosen`` settings do not use (a labelled second row of the table)."""
    from kvpop.evaluation.evaluate import LABEL_SOURCES

    return RETROFITS + tuple(label_variant(j, src) for j in JOINT_OF for src in LABEL_SOURCES
                             if src != chosen[j].get("target_source", "student"))

CHOSEN_FILE = Path(__file__).resolve().parent.parent / "data" / "demo_results" / "chosen.json"
CHOSEN: dict[str, dict[str, dict]] = {t: c for t, c in json.loads(CHOSEN_FILE.read_text()).items() if t in TASKS}
"""Training settings of each retrofit per task, chosen on validation sequences by ``kvpop demo --select``
(:data:`CHOSEN_FILE`, the records beside it: ``kvpop/data/demo_results/<task>/selection*.json``).  ``k``:
long-range slots of the training budget (``budget = sinks + window + k``); fixed-finetune trains at 12.5 % of
the training length."""
QUICK = {"steps": 3, "k": 4, "lr_scorer": 1e-2, "lr_model": 1e-4, "target_source": "student"}


def selection_file(stage: str) -> str:
    """The record ``kvpop demo --select --select-stage STAGE`` writes into ``OUT/<task>/``."""
    return "selection.json" if stage == "all" else f"selection-{stage}.json"


def task_module(name: str):
    import importlib

    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; allowed: {sorted(TASKS)} (or 'all')")
    return importlib.import_module(TASKS[name])


def task_of(task: str | None):
    """The task module of ``kvpop train --task NAME`` (``--task`` alone, or none: kvtrace)."""
    return task_module(task or "kvtrace")


def default_model(task: str | None) -> Path:
    """``kvpop train``'s model without ``--model``: the shipped model of its ``--task`` (kvtrace's without one)."""
    return Path(task_of(task).SHIPPED_MODEL)


def base_model_dir(args: DemoOptions, task: str) -> Path:
    mod = task_module(task)
    path = Path(args.model) if args.model else Path(mod.SHIPPED_MODEL)
    if not args.model and not (path / "config.json").exists():
        raise ValueError(f"the {task} task has no shipped model yet ({path}): pre-train one with "
                         f"`kvpop pretrain --task {task} --out RUN` (see {mod.__name__}) and pass --model RUN/model")
    return path


def settings(args: DemoOptions, task: str, *, lengths: list[int] | None = None,
             budgets: list[int] | None = None) -> dict:
    """The settings of one demo run of ``task``: ``args`` the command's options (``lengths`` and
    ``budgets`` parsed from them); ValueError naming a bad option."""
    mod = task_module(task)
    q = args.quick
    train_len = args.train_len or (128 if q else mod.TRAIN_LEN)
    sinks = (2 if q else 4) if args.sinks is None else args.sinks
    window = (4 if q else 32) if args.window is None else args.window
    for name in ("train_length", "train_budget"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.dms_steps is not None and args.dms_steps < 0:
        raise ValueError(f"--dms-steps must be >= 0 (0 leaves dms out), got {args.dms_steps}")
    if args.dms_target_keep is not None and not 0 < args.dms_target_keep <= 1:
        raise ValueError(f"--dms-target-keep must be in (0, 1], got {args.dms_target_keep}")
    for name in ("lr_scorer", "lr_model", "tau", "dms_lr"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v}")
    if args.train_budget is not None and args.train_budget < sinks + window + 1:
        raise ValueError(f"--train-budget {args.train_budget} is too small: it must be >= sinks + window + 1 = "
                         f"{sinks + window + 1}")
    retro = {}
    chosen = {p: dict(QUICK if q else CHOSEN[task][p]) for p in RETROFITS}
    for p in demo_retrofits(chosen):
        if p in chosen:
            c = dict(chosen[p])
        else:  # a joint retrofit on the other label source
            j, src = next((j, src) for j in JOINT_OF for src in ("student", "teacher") if p == label_variant(j, src))
            c = {**chosen[j], "target_source": src}
        if p == "fixed-finetune":
            for key in ("k", "lr_scorer", *LABEL_KEYS, "joint_init"):
                c.pop(key, None)
        if p in SCORER_ONLY or p == "fixed-finetune":
            c.pop("target_source", None)
            c.pop("joint_init", None)
        if p in SCORER_ONLY:
            c.pop("lr_model", None)
        if args.steps is not None:
            c["steps"] = args.steps
        if args.train_budget is not None and "k" in c:
            c["k"] = args.train_budget - sinks - window
        if args.lr_scorer is not None and "lr_scorer" in c:
            c["lr_scorer"] = args.lr_scorer
        if args.lr_model is not None and "lr_model" in c:
            c["lr_model"] = args.lr_model
        retro[p] = c
    return {
        "task": task,
        "train_len": train_len,
        "lengths": lengths or [train_len, 2 * train_len],
        "budgets": budgets or (None if q else task_budgets(mod, train_len)),
        "n_sequences": args.n_sequences if args.n_sequences is not None else (1 if q else 6),
        "sinks": sinks,
        "window": window,
        "train_length": (args.train_length if args.train_length is not None
                         else train_len if q else getattr(mod, "DEMO_TRAIN_LENGTH", train_len // 2)),
        "tau": 1.0 if args.tau is None else args.tau,
        "retrofits": retro,
        "dms_steps": (QUICK["steps"] if q else 100) if args.dms_steps is None else args.dms_steps,
        "dms_target_keep": 0.04 if args.dms_target_keep is None else args.dms_target_keep,
        "dms_lr": 0.05 if args.dms_lr is None else args.dms_lr,
        "dms_lr_model": 1e-4 if args.lr_model is None else args.lr_model,
        "decode_check": not args.no_decode_check,
    }


def task_budgets(mod, train_len: int) -> list[int]:
    """The task's evaluation budgets: its ``BUDGET_FRACTIONS`` of ``train_len`` (6.25/12.5/25 % unless the task
    module says otherwise)."""
    from kvpop.evaluation.evaluate import BUDGET_FRACTIONS, budgets_for

    return budgets_for(train_len, getattr(mod, "BUDGET_FRACTIONS", BUDGET_FRACTIONS))


def trial_dir(out: Path, policy: str, c: dict) -> Path:
    """Where ``kvpop demo --select`` trains ``policy`` with settings ``c`` (``OUT/<task>/<policy>/<tag>``,
    :func:`kvpop.training.search.trial_tag`)."""
    return out / policy / trial_tag(c)


def retrofit_config(s: dict, policy: str, c: dict, init: Path | None = None):
    """The :class:`~kvpop.demo.retrofit.RetrofitConfig` of ``policy`` with settings ``c``; ``init``: the scorer
    file a ``joint_init="scorer-only"`` retrofit starts from."""
    from kvpop.demo.retrofit import RetrofitConfig

    least = s["sinks"] + s["window"] + 1
    if policy == "fixed-finetune":
        budget = int(round(0.125 * s["train_length"]))
        if budget < least:
            raise ValueError(f"training budget {budget} (12.5% of --train-length {s['train_length']}) is below "
                             f"sinks + window + 1 = {least}: raise --train-length or lower --window")
    else:
        budget = s["sinks"] + s["window"] + int(c["k"])
        if budget < least:
            raise ValueError(f"training budget {budget} is too small: it must be >= sinks + window + 1 = {least}")
    return RetrofitConfig(steps=int(c["steps"]), length=s["train_length"], batch=1, budget=budget,
                          sinks=s["sinks"], window=s["window"], lr_scorer=float(c.get("lr_scorer", 1e-2)),
                          lr_model=float(c.get("lr_model", 1e-4)), tau=s["tau"],
                          train_model=policy not in SCORER_ONLY,
                          target_source=c.get("target_source", "student"), label=c.get("label", "mean"),
                          decay_span=c.get("decay_span"), eval_every=int(c.get("eval_every", 0)),
                          patience=int(c.get("patience", 0)),
                          init_scorers=str(init) if c.get("joint_init") == "scorer-only" and init else None,
                          head_allocation="ablation" if c.get("head_budgets") == "ablation" else None,
                          checkpoint_every=max(1, min(50, int(c["steps"]) // 4)))


def init_file(out: Path, policy: str, c: dict, trial_of: dict | None = None) -> Path | None:
    """The scorer file a joint retrofit with ``joint_init="scorer-only"`` starts from: its scorer-only
    retrofit's (``out/<scorer-only>/``; with ``trial_of``, the ``--select`` trial of those scorer-only
    settings)."""
    if c.get("joint_init") != "scorer-only":
        return None
    sc = JOINT_OF[LABEL_VARIANTS.get(policy, policy)]
    return (out / sc if trial_of is None else trial_dir(out, sc, trial_of)) / "scorers.safetensors"


SELECT_FIRST = 1_000
"""The select part of the demo's validation seeds: ``valid_seed(SELECT_FIRST + i)``, which only score trials; the
fit part, ``valid_seed(0..)``, serves what learns from validation (early stopping, the head-budget allocation's
``valid_seed(0..7)``, :data:`kvpop.demo.retrofit.ABLATION_SEQUENCES`, DMS's gate threshold)."""


def valid_config(E, s: dict, args: DemoOptions, part: str = "select"):
    """The validation sequences of ``part``: ``"select"`` (every choice of ``--select``: ``valid_seed(SELECT_FIRST
    + i)``, at least two, since one has no standard error) or ``"fit"`` (early stopping: ``valid_seed(0..)``); at
    L_train, the task's budgets, ``--n-sequences`` (default 6) each."""
    n = args.n_sequences or (1 if args.quick else 6)
    if part not in ("fit", "select"):
        raise ValueError(f"unknown validation part {part!r}")
    if n > SELECT_FIRST:
        raise ValueError(f"--n-sequences {n}: at most {SELECT_FIRST} (the select seeds start at "
                         f"valid_seed({SELECT_FIRST}))")
    v = eval_config(E, s, args, lengths=[s["train_len"]], n_sequences=max(2, n) if part == "select" else n,
                    split="valid", first_seed=SELECT_FIRST if part == "select" else 0)
    v.progress = False
    return v


def split_record(mod, E, s: dict, args: DemoOptions) -> dict:
    """The record's ``split``: the validation seeds of each part, disjoint."""
    from kvpop.demo.retrofit import ABLATION_SEQUENCES

    sel, fit = valid_config(E, s, args, "select"), valid_config(E, s, args, "fit")
    return {"of": "the task's validation seeds (valid_seed)",
            "fit": [mod.valid_seed(i) for i in range(max(fit.n_sequences, ABLATION_SEQUENCES))],
            "select": [mod.valid_seed(sel.first_seed + i) for i in range(sel.n_sequences)]}


def per_seed_errors(E, mod, model, policy: str, vcfg, fit=None) -> tuple[list[float], dict]:
    """``(per_sequence, accuracy by budget)``: each validation example's error rate of ``vcfg`` (1 - its accuracy
    at the graded positions, averaged over the budgets at L_train) under ``policy``, and the pooled accuracy at
    each budget; ``dms`` at the gate threshold calibrated on the ``fit`` config's sequences."""
    import torch

    L = vcfg.lengths[0]
    examples = [mod.make_example(mod.valid_seed(vcfg.first_seed + i), L) for i in range(vcfg.n_sequences)]
    per = [0.0] * len(examples)
    acc = {}
    for b in vcfg.budgets:
        thr = None
        if policy == "dms":
            f = fit or vcfg
            valid = torch.stack([mod.make_example(mod.valid_seed(f.first_seed + i), L)["input_ids"]
                                 for i in range(f.n_sequences)])
            thr = E.dms_calibrate(model, valid, b)
        right = graded = 0
        for i, ex in enumerate(examples):
            c, g = E.sequence_correct(model, ex, policy, b, threshold=thr)
            per[i] += (1.0 - c / g) / len(vcfg.budgets)
            right, graded = right + c, graded + g
        acc[str(b)] = right / graded
    return per, acc


def validator(E, mod, base, s: dict, args: DemoOptions, policy: str, d: Path, dense_done: dict):
    """``validate(model)`` of ``policy``'s retrofit in ``d``: the mean accuracy over the budgets at L_train on the
    fit part of validation (:func:`valid_config`) of the model in training, served as ``kvpop demo`` serves
    it (early stopping: the select part never sees it)."""
    from kvpop.core.checkpoint import save_scorers
    from kvpop.demo import retrofit as R

    vcfg = valid_config(E, s, args, "fit")
    pm = dict(sinks=vcfg.sinks, window=vcfg.window, budget=vcfg.budgets[0])

    def validate(model) -> float:
        import copy

        f = d / "train.pt" / "validate.safetensors"
        ft = None
        if policy != "fixed-finetune":
            save_scorers(model, f)
        if policy in E.JOINT or policy == "fixed-finetune":
            ft = copy.deepcopy(model)
            R._strip(ft)
        served = (E.policy_model(base, policy, finetuned=ft, **pm) if policy == "fixed-finetune"
                  else E.policy_model(base, policy, scorers=f, finetuned=ft, head_plan=head_plan(d), **pm))
        res = E.evaluate({"dense": base, policy: served}, vcfg, task=mod, done=dense_done)
        for row in res["rows"]:
            if row["policy"] == "dense":
                dense_done[f"dense|{row['budget']}|{row['length']}"] = row
        acc = [row["accuracy"] for row in res["rows"] if row["policy"] == policy]
        return sum(acc) / len(acc)

    return validate


def head_plan(d: Path) -> dict | None:
    """The head-adaptive budgets a retrofit in ``d`` was trained with (``head_budgets.json``), or ``None``."""
    from kvpop.core.budgets import HEAD_BUDGETS_FILE, read_head_budgets

    return read_head_budgets(d / HEAD_BUDGETS_FILE) if (d / HEAD_BUDGETS_FILE).exists() else None


def policy_model(E, base, policy: str, d: Path, pm: dict):
    """The model serving ``policy`` from its retrofit directory ``d``."""
    if policy == "fixed-finetune":
        return E.policy_model(base, policy, finetuned=E.load_base_model(d / "model"), **pm)
    ft = E.load_base_model(d / "model") if policy in E.JOINT else None
    return E.policy_model(base, policy, scorers=d / "scorers.safetensors", finetuned=ft, head_plan=head_plan(d),
                          **pm)


def eval_config(E, s: dict, args: DemoOptions, **kw):
    return E.EvalConfig(train_len=s["train_len"], lengths=kw.pop("lengths", s["lengths"]), budgets=s["budgets"],
                        n_sequences=kw.pop("n_sequences", s["n_sequences"]), sinks=s["sinks"], window=s["window"],
                        progress=not args.no_progress, **kw)


def select(args: DemoOptions, task: str, out: Path, s: dict) -> dict:
    """``kvpop demo --select --select-stage args.select_stage`` for ``task`` (settings ``s``, :func:`settings`)
    into ``out``: each retrofit's stages (:func:`kvpop.demo.grid.select_plan`) run by
    :class:`kvpop.training.search.Search`, each trial a retrofit (``out/<policy>/<tag>``) scored by its error rate
    on the validation sequences (:func:`valid_config`: 1 - the mean accuracy over the budgets at L_train);
    writes ``out/selection*.json`` (:func:`selection_file`) after every trial and returns it."""
    from dataclasses import replace

    from kvpop.demo import retrofit as R
    from kvpop.demo.grid import select_plan
    from kvpop.evaluation import evaluate as E
    from kvpop.training.search import Search, resolution

    mod = task_module(task)
    vcfg = valid_config(E, s, args)
    base = E.load_base_model(base_model_dir(args, task))
    pm = dict(sinks=vcfg.sinks, window=vcfg.window, budget=vcfg.budgets[0])
    full = {**SELECT_GRID, **getattr(mod, "DEMO_GRID", {})}
    grid = ({**{k: v[:1] for k, v in full.items()}, "steps": (QUICK["steps"],), "finetune_steps": (QUICK["steps"],),
             "label_steps": (QUICK["steps"],), "target_source": full["target_source"], "label": full["label"],
             "joint_init": full["joint_init"], "head_budgets": full["head_budgets"]} if args.quick else full)
    search = Search(out, selection_file(args.select_stage), prefix=f"[kvpop demo --select] {task}", header={
        "task": task, "grid": grid, "stage": args.select_stage,
        "criterion": "validation error rate: 1 - the accuracy at the graded positions, averaged over the budgets "
                     "at L_train, per select sequence; the trial's score their mean (lower is better)",
        "rule": "kvpop.training.search.prefer: a challenger replaces the incumbent only when its mean "
                "per-sequence improvement exceeds 2 paired standard errors",
        "split": split_record(mod, E, s, args),
        "validation": {"split": "valid",
                       "seeds": f"valid_seed({vcfg.first_seed}..{vcfg.first_seed + vcfg.n_sequences - 1})",
                       "length": s["train_len"], "budgets": vcfg.budgets, "sinks": vcfg.sinks, "window": vcfg.window,
                       "train_length": s["train_length"]}})
    search.record["resolution"] = resolution(vcfg.n_sequences)
    search.record["confirmation"] = {}
    chosen = search.record["chosen"] = {}
    dense_done: dict = {}  # the dense rows of the select seeds; early stopping's (fit seeds) apart
    dense_fit: dict = {}

    def runner(policy: str):
        def run(c: dict, d: Path) -> dict:
            sc = JOINT_OF.get(LABEL_VARIANTS.get(policy, policy))
            rc = retrofit_config(s, policy, c, init_file(out, policy, c, chosen.get(sc) or s["retrofits"].get(sc)))
            if "seed" in c:  # the confirmation's second seed
                rc = replace(rc, seed=int(c["seed"]))
            R.retrofit(base, policy, d, rc, resume=True, progress=not args.no_progress, task=mod,
                       validate=validator(E, mod, base, s, args, policy, d, dense_fit) if rc.eval_every else None)
            per, acc = per_seed_errors(E, mod, policy_model(E, base, policy, d, pm), policy, vcfg)
            res = E.evaluate({"dense": base}, vcfg, task=mod, done=dense_done)
            for row in res["rows"]:
                dense_done[f"dense|{row['budget']}|{row['length']}"] = row
            mean = sum(acc.values()) / len(acc)
            r = {"score": sum(per) / len(per), "per_sequence": per, "steps": rc.steps, "val_accuracy": acc,
                 "val_mean": mean, "val_dense": res["dense_accuracy"]}
            done = json.loads((d / "done.json").read_text())
            if "best_step" in done:  # early stopping: the state kept and the validations it was chosen by
                r["best_step"], r["validations"] = done["best_step"], done["validation"]
                r["steps"] = done["validation"][-1]["step"]  # the last step trained (validated after it)
            return r

        return run

    for p in RETROFITS:
        plan = select_plan(args.select_stage, p, grid, s["retrofits"], chosen)
        if plan:
            best = search.run_plan(plan, runner(p), subdir=p, extra={"policy": p})
            best, search.record["confirmation"][p] = search.confirm(best, runner(p), seed=("seed", 1), subdir=p,
                                                                   extra={"policy": p})
            chosen[p] = best["settings"]
        elif args.select_stage == "label" and p == "fixed-finetune":
            chosen[p] = dict(s["retrofits"][p])  # not searched by the label stage: kept as chosen before
    search.record["summary"] = search.summary()
    search.save()
    print(f"[kvpop demo --select] {task}: {resolution(vcfg.n_sequences)}", flush=True)
    conf = [p + (" ran" if c.get("ran") else f" not run ({c.get('why', '')})")
            for p, c in search.record["confirmation"].items()]
    print(f"[kvpop demo --select] {task}: stages run: {', '.join(dict.fromkeys(search.record['summary']['ran']))}; "
          f"confirmation (a second seed of the top two): {', '.join(conf)}", flush=True)
    print(f"[kvpop demo --select] {task}: chosen {json.dumps(chosen)}", flush=True)
    return search.record
