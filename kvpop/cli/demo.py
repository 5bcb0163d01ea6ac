"""``kvpop demo``: retrofit the shipped tiny Qwen3 models and measure accuracy vs cache budget.

::

    kvpop demo --out demo-out                    # the kvtrace task
    kvpop demo --task lookahead --out demo-out   # the lookahead task
    kvpop demo --task all --out demo-out         # both

For each task: the retrofits (``OUT/<task>/<policy>``), every policy at the task's budgets, at L_train and
2x L_train, on test sequences through ``kvpop.KVpopCache``; then ``results.json`` (only what the seeds and
settings determine: a re-run on the same machine and thread count writes the same bytes), ``table.md``,
``accuracy_vs_budget.png``, ``dms.md`` (DMS's memory at its validation-chosen threshold), ``decode.md`` (the
learned policies' reads by token-by-token decoding beside the prefill's) and ``run.json`` (wall times, date,
arguments).  The training settings are :data:`CHOSEN`, picked on validation sequences by ``--select`` over
:data:`GRID` (``--select-stage label``: the label family, the decay range, head-adaptive budgets and the
joint retrofits' start, with early stopping on validation), the joint retrofits' label source included
(each run also trains them on the other source, the ``-<source>-label`` rows); a run in the ``--out`` of a
``--select`` reuses the trial of each chosen setting.  ``--resume`` reuses
finished retrofits (``<policy>/done.json``) and measured rows (``rows.jsonl``) and continues an unfinished
retrofit from its checkpoint; ``--quick`` is a seconds-long smoke run (meaningless figures).  What the demo
does in detail and what it measured: ``kvpop/data/demo_results/README.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from .eval import _ints, add_common, check_common, check_out, finish

TASKS = {"kvtrace": "kvpop.demo.task", "lookahead": "kvpop.demo.lookahead_task"}
"""Demo task name -> task module (``make_example``, ``test_seed``, ``valid_seed``, ``TRAIN_LEN``, ``SHIPPED_MODEL``)."""
SCORER_ONLY = ("kvpop-mlp", "kvpop-mlstm")
JOINT_OF = {"kvpop-mlp-joint": "kvpop-mlp", "kvpop-mlstm-joint": "kvpop-mlstm"}
RETROFITS = (*SCORER_ONLY, *JOINT_OF, "fixed-finetune")
"""The retrofits of every demo run; each joint one also trains on the label source it did not choose
(:func:`label_variant`, :func:`demo_retrofits`)."""


def label_variant(joint: str, source: str) -> str:
    """The policy name of ``joint`` trained on the label of ``source`` (``"kvpop-mlp-joint-teacher-label"``)."""
    return f"{joint}-{source}-label"


LABEL_VARIANTS_OF = {f"{j}-{src}-label": j for j in JOINT_OF for src in ("student", "teacher")}
"""A joint retrofit's label-source variant -> the joint retrofit (:func:`label_variant`)."""


def demo_retrofits(chosen: dict) -> tuple[str, ...]:
    """The retrofits a demo run trains, in order: :data:`RETROFITS`, then, for each joint retrofit, the
    label source its ``chosen`` settings do not use (a labelled second row of the table)."""
    from kvpop.demo.evaluate import LABEL_SOURCES

    return RETROFITS + tuple(label_variant(j, src) for j in JOINT_OF for src in LABEL_SOURCES
                             if src != chosen[j].get("target_source", "student"))

GRID = {"k": (4, 16, 64), "lr_scorer": (1e-2,), "steps": (100,), "joint_lr_model": (1e-4,),
        "target_source": ("student", "teacher"), "finetune_lr_model": (1e-4, 1e-3), "finetune_steps": (30,),
        "label": ("mean", "max"), "decay_span": (None, 8.0), "label_lr_scorer": (1e-2,), "label_steps": (200,),
        "eval_every": (0,), "patience": (0,), "joint_init": ("fresh", "scorer-only"),
        "head_budgets": ("uniform", "ablation")}
"""The candidates of ``--select``.  Scorer-only: every (k, lr_scorer) at the first number of steps, then the
best of those at every number of steps, then the best of those with every (label, decay_span) (the label the
scorers learn, ``KVpopConfig.label``, and the decay's range: ``None`` the seed's, a number of nats the range
tied to the training length, ``decay_range_for_context``).  Joint: the scorer-only choice of the same scorer
with every ``joint_lr_model`` (student label), then the best of those with every ``target_source`` (the
label's source) and every ``joint_init`` (``"fresh"`` scorers or the scorer-only retrofit's as the start).
fixed-finetune: every (finetune_lr_model, finetune_steps).  ``--select-stage label`` searches only the label
family: every (label, decay_span, label_lr_scorer) for each scorer-only retrofit at ``label_steps`` steps (the
other settings as CHOSEN), the best of those with every ``head_budgets`` (``"ablation"``: head-adaptive budgets
fixed before training, ``RetrofitConfig.head_allocation``), then each joint retrofit with its scorer's choice
and every ``joint_init``.
``eval_every`` / ``patience`` (one value each): validation during every kvpop retrofit, the best state kept
(``kvpop.demo.retrofit``; 0: none).  A grid of one value fixes that setting (the CPU budget of a 2-core
machine: each candidate is a retrofit plus a validation run).  A task module's ``DEMO_GRID`` replaces some of
these entries for its task."""
LABEL_KEYS = ("label", "decay_span", "eval_every", "patience", "head_budgets")
"""Settings a joint retrofit takes from its scorer-only retrofit's choice (besides ``lr_scorer`` and ``k``)."""

CHOSEN = {
    "kvtrace": {  # kvpop demo --select --select-stage label, 2026-12-01, over --select's 2026-11-30 choice
        "kvpop-mlp": {"steps": 200, "k": 4, "eval_every": 50, "patience": 0, "label": "mean", "decay_span": None,
                      "lr_scorer": 1e-2},
        "kvpop-mlstm": {"steps": 200, "k": 4, "eval_every": 50, "patience": 0, "label": "mean", "decay_span": None,
                        "lr_scorer": 1e-2},
        "kvpop-mlp-joint": {"steps": 100, "k": 4, "lr_scorer": 1e-2, "lr_model": 1e-4, "target_source": "student",
                            "label": "mean", "decay_span": None, "eval_every": 0, "patience": 0, "joint_init": "fresh"},
        "kvpop-mlstm-joint": {"steps": 200, "k": 4, "lr_scorer": 1e-2, "lr_model": 1e-4, "target_source": "student",
                              "label": "mean", "decay_span": None, "eval_every": 0, "patience": 0,
                              "joint_init": "fresh"},
        "fixed-finetune": {"steps": 30, "lr_model": 1e-4},
    },
    "lookahead": {  # kvpop demo --select --select-stage label --task lookahead, 2026-12-01, over 2026-11-30's
        "kvpop-mlp": {"steps": 3000, "k": 12, "eval_every": 250, "patience": 3, "label": "max", "decay_span": None,
                      "lr_scorer": 3e-3, "head_budgets": "ablation"},
        "kvpop-mlstm": {"steps": 3000, "k": 12, "eval_every": 250, "patience": 3, "label": "mean",
                        "decay_span": None, "lr_scorer": 3e-3},
        "kvpop-mlp-joint": {"steps": 200, "k": 12, "lr_scorer": 3e-3, "lr_model": 1e-4, "target_source": "teacher",
                            "label": "max", "decay_span": None, "eval_every": 0, "patience": 0, "joint_init": "fresh",
                            "head_budgets": "ablation"},  # the label source: --select-stage target_source after
        "kvpop-mlstm-joint": {"steps": 100, "k": 12, "lr_scorer": 3e-3, "lr_model": 1e-4, "target_source": "student",
                              "label": "mean", "decay_span": None, "eval_every": 0, "patience": 0,
                              "joint_init": "scorer-only"},
        "fixed-finetune": {"steps": 30, "lr_model": 1e-4},
    },
}
"""Training settings of each retrofit, chosen on validation sequences by ``kvpop demo --select`` (see
``kvpop/data/demo_results/<task>/selection.json``).  ``k``: long-range slots of the training budget
(``budget = sinks + window + k``); fixed-finetune trains at 12.5 % of the training length."""
QUICK = {"steps": 3, "k": 4, "lr_scorer": 1e-2, "lr_model": 1e-4, "target_source": "student"}


def selection_file(stage: str) -> str:
    """The record ``kvpop demo --select --select-stage STAGE`` writes into ``OUT/<task>/``."""
    return "selection.json" if stage == "all" else f"selection-{stage}.json"


def task_module(name: str):
    import importlib

    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; allowed: {sorted(TASKS)} (or 'all')")
    return importlib.import_module(TASKS[name])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (one subdirectory per task)")
    p.add_argument("--task", default="kvtrace", choices=[*TASKS, "all"],
                   help="which task's model to retrofit and evaluate (default: kvtrace; lookahead needs --model "
                        "until a pre-trained model is shipped; all: one after the other)")
    p.add_argument("--select", action="store_true",
                   help="choose the training settings on validation sequences (the grid GRID) instead of "
                        "running the demo; writes OUT/<task>/selection.json")
    p.add_argument("--select-stage", default="all", choices=("all", "target_source", "label"),
                   help="with --select: all (every setting), target_source (only the joint retrofits' label source, "
                        "student vs teacher, the other settings as CHOSEN) or label (the label family: label, decay "
                        "and scorer lr of the scorer-only retrofits, then the joint retrofits' start; the other "
                        "settings as CHOSEN)")
    p.add_argument("--resume", action="store_true",
                   help="reuse finished parts in --out (retrofits, measured rows) and continue unfinished ones")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: L_train 128, sinks 2, window 4, 2-3 training steps, 1 sequence")
    add_common(p)
    p.add_argument("--steps", type=int, default=None, help="training steps of every retrofit (default: CHOSEN)")
    p.add_argument("--train-length", type=int, default=None,
                   help="length of the training sequences (default L_train/2)")
    p.add_argument("--train-budget", type=int, default=None,
                   help="budget of the scorer training of every kvpop retrofit (default: sinks + window + k, "
                        "k from CHOSEN; fixed-finetune always trains at 12.5%% of --train-length)")
    p.add_argument("--lr-scorer", type=float, default=None, help="scorer learning rate (default: CHOSEN)")
    p.add_argument("--lr-model", type=float, default=None,
                   help="model learning rate of the joint retrofits and fixed-finetune (default: CHOSEN)")
    p.add_argument("--no-decode-check", action="store_true",
                   help="skip measuring the learned policies' reads by token-by-token decoding (default: at the middle "
                        "budget and L_train, beside the prefill's)")
    p.add_argument("--tau", type=float, default=None, help="temperature of the score loss (default 1.0)")
    p.add_argument("--dms-steps", type=int, default=None,
                   help="training steps of the DMS baseline (gates + model; default 100; 0 leaves dms out)")
    p.add_argument("--dms-target-keep", type=float, default=None,
                   help="keep fraction DMS is trained to (default 0.04, about the long-range share of the smallest "
                        "budget at L_train; chosen over 0.1 on validation sequences; evaluated at each budget's mean)")
    p.add_argument("--dms-lr", type=float, default=None, help="learning rate of the DMS gates (default 0.05)")


def _base_model_dir(args: argparse.Namespace, task: str) -> Path:
    mod = task_module(task)
    path = Path(args.model) if args.model else Path(mod.SHIPPED_MODEL)
    if not args.model and not (path / "config.json").exists():
        raise ValueError(f"the {task} task has no shipped model yet ({path}): pre-train one with "
                         f"`kvpop pretrain --task {task} --out RUN` (see {mod.__name__}) and pass --model RUN/model")
    return path


def _settings(args: argparse.Namespace, task: str) -> dict:
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
        "lengths": _ints(args.lengths) or [train_len, 2 * train_len],
        "budgets": _ints(args.budgets) or (None if q else _task_budgets(mod, train_len)),
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


def _task_budgets(mod, train_len: int) -> list[int]:
    """The task's evaluation budgets: its ``BUDGET_FRACTIONS`` of ``train_len`` (6.25/12.5/25 % unless the task
    module says otherwise)."""
    from kvpop.demo.evaluate import BUDGET_FRACTIONS, budgets_for

    return budgets_for(train_len, getattr(mod, "BUDGET_FRACTIONS", BUDGET_FRACTIONS))


def _trial_dir(out: Path, policy: str, c: dict) -> Path:
    """Where ``kvpop demo --select`` trains ``policy`` with settings ``c`` (``OUT/<task>/<policy>/<tag>``)."""
    def fmt(v):
        return "none" if v is None else v if isinstance(v, str) else f"{v:g}"

    return out / policy / "_".join(f"{k}{fmt(v)}" for k, v in sorted(c.items()))


def _retrofit_config(E, s: dict, policy: str, c: dict, init: Path | None = None):
    """The :class:`~kvpop.demo.retrofit.RetrofitConfig` of ``policy`` with settings ``c``; ``init``: the scorer
    file a ``joint_init="scorer-only"`` retrofit starts from."""
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
    return E.RetrofitConfig(steps=int(c["steps"]), length=s["train_length"], batch=1, budget=budget,
                            sinks=s["sinks"], window=s["window"], lr_scorer=float(c.get("lr_scorer", 1e-2)),
                            lr_model=float(c.get("lr_model", 1e-4)), tau=s["tau"],
                            train_model=policy not in SCORER_ONLY,
                            target_source=c.get("target_source", "student"), label=c.get("label", "mean"),
                            decay_span=c.get("decay_span"), eval_every=int(c.get("eval_every", 0)),
                            patience=int(c.get("patience", 0)),
                            init_scorers=str(init) if c.get("joint_init") == "scorer-only" and init else None,
                            head_allocation="ablation" if c.get("head_budgets") == "ablation" else None,
                            checkpoint_every=max(1, min(50, int(c["steps"]) // 4)))


def _init_file(out: Path, policy: str, c: dict, trial_of: dict | None = None) -> Path | None:
    """The scorer file a joint retrofit with ``joint_init="scorer-only"`` starts from: its scorer-only
    retrofit's (``out/<scorer-only>/``; with ``trial_of``, the ``--select`` trial of those scorer-only
    settings)."""
    if c.get("joint_init") != "scorer-only":
        return None
    sc = JOINT_OF[LABEL_VARIANTS_OF.get(policy, policy)]
    return (out / sc if trial_of is None else _trial_dir(out, sc, trial_of)) / "scorers.safetensors"


def _valid_config(E, s: dict, args: argparse.Namespace):
    """The validation sequences every choice is made on (``--select``, early stopping): ``valid_seed``, L_train,
    the task's budgets, ``--n-sequences`` (default 6)."""
    v = _eval_config(E, s, args, lengths=[s["train_len"]], n_sequences=args.n_sequences or (1 if args.quick else 6),
                     split="valid")
    v.progress = False
    return v


def _validator(E, mod, base, s: dict, args: argparse.Namespace, policy: str, d: Path, dense_done: dict):
    """``validate(model)`` of ``policy``'s retrofit in ``d``: the mean validation accuracy over the budgets at
    L_train (:func:`_valid_config`) of the model in training, served as ``kvpop demo`` serves it."""
    from kvpop.core.checkpoint import save_scorers
    from kvpop.demo import retrofit as R

    vcfg = _valid_config(E, s, args)
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
                  else E.policy_model(base, policy, scorers=f, finetuned=ft, head_plan=_head_plan(d), **pm))
        res = E.evaluate({"dense": base, policy: served}, vcfg, task=mod, done=dense_done)
        for row in res["rows"]:
            if row["policy"] == "dense":
                dense_done[f"dense|{row['budget']}|{row['length']}"] = row
        acc = [row["accuracy"] for row in res["rows"] if row["policy"] == policy]
        return sum(acc) / len(acc)

    return validate


def _head_plan(d: Path) -> dict | None:
    """The head-adaptive budgets a retrofit in ``d`` was trained with (``head_budgets.json``), or ``None``."""
    from kvpop.core.budgets import HEAD_BUDGETS_FILE, read_head_budgets

    return read_head_budgets(d / HEAD_BUDGETS_FILE) if (d / HEAD_BUDGETS_FILE).exists() else None


def _policy_model(E, base, policy: str, d: Path, pm: dict):
    """The model serving ``policy`` from its retrofit directory ``d``."""
    if policy == "fixed-finetune":
        return E.policy_model(base, policy, finetuned=E.load_base_model(d / "model"), **pm)
    ft = E.load_base_model(d / "model") if policy in E.JOINT else None
    return E.policy_model(base, policy, scorers=d / "scorers.safetensors", finetuned=ft, head_plan=_head_plan(d),
                          **pm)


def _eval_config(E, s: dict, args: argparse.Namespace, **kw):
    return E.EvalConfig(train_len=s["train_len"], lengths=kw.pop("lengths", s["lengths"]), budgets=s["budgets"],
                        n_sequences=kw.pop("n_sequences", s["n_sequences"]), sinks=s["sinks"], window=s["window"],
                        progress=not args.no_progress, **kw)


def _policy_stamp(stamp: dict, policy: str) -> dict:
    """The settings a measured row of ``policy`` depends on (``--resume`` reuses a row when they are unchanged)."""
    own = {k: v for k, v in stamp.items() if k not in ("retrofits", "decode_check") and not k.startswith("dms_")}
    if policy in stamp.get("retrofits", {}):
        own["retrofit"] = stamp["retrofits"][policy]
    if policy in ("dms", "dms-test-calibrated"):
        own["dms"] = {k: v for k, v in stamp.items() if k.startswith("dms_")}
    return own


def _read_rows(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[f"{r['policy']}|{r['budget']}|{r['length']}"] = r
    return done


def _append_row(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _run_task(args: argparse.Namespace, task: str, out: Path) -> dict:
    """Retrofit, evaluate and write the results of one task into ``out``; returns results.json's dict."""
    import torch

    from kvpop.demo import evaluate as E
    from kvpop.demo import retrofit as R

    t_start = time.time()
    mod = task_module(task)
    s = _settings(args, task)
    cfg = _eval_config(E, s, args)
    rcs = {p: None if c.get("joint_init") == "scorer-only" else _retrofit_config(E, s, p, c)
           for p, c in s["retrofits"].items()}  # a warm start's config once its scorer file exists
    base = E.load_base_model(_base_model_dir(args, task))
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    settings_file = out / "demo_settings.json"
    stamp = {**s, "model": str(Path(args.model).resolve()) if args.model else "shipped"}
    old = json.loads(settings_file.read_text()) if args.resume and settings_file.exists() else None
    kept = {key: r for key, r in _read_rows(rows_file).items()
            if old is not None and _policy_stamp(old, r["policy"]) == _policy_stamp(stamp, r["policy"])}
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in kept.values()))
    settings_file.write_text(json.dumps(stamp, indent=1))
    progress = not args.no_progress

    timings = {}
    dense_done: dict = {}
    for p, c in s["retrofits"].items():
        t0 = time.time()
        rc = rcs[p] = rcs[p] or _retrofit_config(E, s, p, c, _init_file(out, p, c))
        adopted = _adopt_trial(out, p, c)
        print(f"[kvpop demo] {task}: retrofit {p}: {rc.steps} steps at length {rc.length}, budget {rc.budget}"
              f"{', model and scorers' if rc.train_model and p != 'fixed-finetune' else ''}"
              f"{', label ' + rc.label if p != 'fixed-finetune' else ''}"
              f"{', validated every ' + str(rc.eval_every) if rc.eval_every else ''}"
              f"{', from the --select trial' if adopted else ''}", flush=True)
        R.retrofit(base, p, out / p, rc, resume=args.resume or adopted, progress=progress, task=mod,
                   validate=_validator(E, mod, base, s, args, p, out / p, dense_done) if rc.eval_every else None)
        timings[f"retrofit_{p}_s"] = round(time.time() - t0, 1)

    if s["dms_steps"] > 0:  # the learned baseline: gates and model together (kvpop.demo.retrofit)

        t0 = time.time()
        rc = E.RetrofitConfig(steps=s["dms_steps"], length=s["train_length"], batch=1, sinks=s["sinks"],
                              window=s["window"], lr_scorer=s["dms_lr"], lr_model=s["dms_lr_model"], train_model=True,
                              checkpoint_every=max(1, min(50, s["dms_steps"] // 4)))
        print(f"[kvpop demo] {task}: retrofit dms: {rc.steps} steps at length {rc.length}, target keep "
              f"{s['dms_target_keep']}", flush=True)
        R.retrofit_dms(base, out / "dms", rc, target_keep=s["dms_target_keep"], resume=args.resume, progress=progress,
                     task=mod)
        timings["retrofit_dms_s"] = round(time.time() - t0, 1)

    pm = dict(sinks=cfg.sinks, window=cfg.window, budget=cfg.budgets[0])
    shared = E.policy_model(base, "streaming", **pm)
    models = {"dense": base, "streaming": shared, "tova": shared, "h2o": shared}
    for p in rcs:
        models[p] = _policy_model(E, base, p, out / p, pm)
    if s["dms_steps"] > 0:
        models["dms"] = E.policy_model(base, "dms", scorers=out / "dms" / "gates.safetensors",
                                       finetuned=E.load_base_model(out / "dms" / "model"), **pm)
        models["dms-test-calibrated"] = models["dms"]  # the same model, its threshold set on each test sequence

    print(f"[kvpop demo] {task}: evaluating {len(cfg.policies)} policies, budgets {cfg.budgets}, lengths "
          f"{cfg.lengths}, {cfg.n_sequences} test sequences each", flush=True)
    t0 = time.time()
    results = E.evaluate(models, cfg, done=kept, on_row=lambda r: _append_row(rows_file, r),
                         task=mod)
    timings["eval_s"] = round(time.time() - t0, 1)
    if s["decode_check"]:
        t0 = time.time()
        results["decode"] = _decode_rows(E, mod, models, s, cfg, out, old, stamp, results["rows"])
        timings["decode_s"] = round(time.time() - t0, 1)
    timings["total_s"] = round(time.time() - t_start, 1)
    # results.json holds only what the seeds and settings determine (a re-run on the same machine and thread
    # count writes the same bytes); the run's wall times and command line go to run.json beside it
    results["demo"] = {"task": task, "settings": stamp, "threads": torch.get_num_threads(),
                       "retrofit": {p: json.loads((out / p / "done.json").read_text())
                                    for p in (*rcs, *(("dms",) if s["dms_steps"] > 0 else ()))}}
    print(f"[kvpop demo] {task}:")
    finish(results, out, not args.no_plot)
    for name, fmt in (("decode", format_decode_table), ("dms", format_dms_table)):
        table = fmt(results.get("decode") or [] if name == "decode" else results["rows"])
        if table:
            print(table)
            (out / f"{name}.md").write_text(table + "\n")
    E.write_results({"task": task, "timings": timings, "threads": torch.get_num_threads(),
                     "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t_start)),
                     "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}}, out / "run.json")
    return results


def _adopt_trial(out: Path, policy: str, c: dict) -> bool:
    """Copy a finished ``--select`` trial of ``policy`` with exactly the settings ``c`` (same ``--out``) into
    ``out/<policy>`` unless that holds the same finished retrofit (a finished one with other settings is
    replaced); :func:`kvpop.demo.retrofit.retrofit` then checks its settings and reuses it, or trains anew
    when they differ.  Returns whether ``out/<policy>`` now holds the trial."""
    import shutil

    src, dst = _trial_dir(out, policy, c), out / policy
    if not (src / "done.json").exists():
        return False
    if (dst / "done.json").exists() and (json.loads((dst / "done.json").read_text())["settings"]
                                         == json.loads((src / "done.json").read_text())["settings"]):
        return True  # adopted before
    parts = ("scorers.safetensors", "model", "head_budgets.json")
    for name in ("done.json", *parts):  # nothing of another retrofit stays beside the adopted one
        if (dst / name).is_dir():
            shutil.rmtree(dst / name)
        elif (dst / name).exists():
            (dst / name).unlink()
    dst.mkdir(parents=True, exist_ok=True)
    for name in parts:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)
        elif (src / name).exists():
            shutil.copy2(src / name, dst / name)
    shutil.copy2(src / "done.json", dst / "done.json")
    return True


def _decode_rows(E, mod, models: dict, s: dict, cfg, out: Path, old: dict | None, stamp: dict,
                 measured: list[dict]) -> list[dict]:
    """The reads of every learned policy of ``models`` by token-by-token decoding beside the prefill's
    (:func:`kvpop.demo.decode_eval.decode_check`) at the middle budget and L_train, on the test sequences (DMS
    at the threshold its row of ``measured`` was chosen on validation); rows kept in ``out/decode.jsonl`` for
    ``--resume``."""
    from kvpop.demo.decode_eval import DECODE_POLICIES, decode_check

    f = out / "decode.jsonl"
    done = {r["policy"]: r for r in (json.loads(x) for x in (f.read_text().splitlines() if f.exists() else []) if x)
            if old is not None and _policy_stamp(old, r["policy"]) == _policy_stamp(stamp, r["policy"])}
    f.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    L, b = s["train_len"], cfg.budgets[len(cfg.budgets) // 2]
    exs = [mod.make_example(mod.test_seed(i), L, mod.DEFAULT) for i in range(cfg.n_sequences)]
    rows = []
    for p in [p for p in E.POLICIES if p in models and p in DECODE_POLICIES]:
        if p not in done:
            print(f"[kvpop demo] {s['task']}: decoding {p} token by token at B={b}, L={L}", flush=True)
            thr = next((r["dms_threshold"] for r in measured if r["policy"] == p and r["budget"] == b
                        and r["length"] == L), None) if p == "dms" else None
            done[p] = decode_check(models[p], exs, p, b, threshold=thr)
            _append_row(f, done[p])
        rows.append(done[p])
    return rows


def format_dms_table(rows: list[dict]) -> str:
    """Markdown: DMS's memory at each budget and length (``""`` without dms rows): the threshold chosen on
    validation, the validation sequences' mean entries per layer and KV head, and the test sequences' mean
    and per-head spread (min / max over heads, averaged over the sequences), beside KVpop's uniform ``B``."""
    rows = [r for r in rows if r["policy"] in ("dms", "dms-test-calibrated") and "dms_entries_mean" in r]
    if not rows:
        return ""
    lines = ["| policy | L | B (KVpop: every head) | threshold | validation mean entries | test mean entries | "
             "test min / max over heads | accuracy |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["policy"] != "dms", r["length"], r["budget"])):
        val = f"{r['dms_valid_entries_mean']:.1f}" if "dms_valid_entries_mean" in r else "- (set on each test sequence)"
        lines.append(f"| {r['policy']} | {r['length']} | {r['budget']} | {r['dms_threshold']:.3f} | {val} | "
                     f"{r['dms_entries_mean']:.1f} | {r['dms_entries_min']:.1f} / {r['dms_entries_max']:.1f} | "
                     f"{r['accuracy']:.3f} |")
    return "\n".join(lines)


def format_decode_table(rows: list[dict]) -> str:
    """Markdown: each policy's reads from the one-call prefill and from token-by-token decoding."""
    if not rows:
        return ""
    lines = ["| policy | B | L | prefill accuracy | decode accuracy | reads that differ |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['budget']} | {r['length']} | {r['prefill_accuracy']:.3f} | "
                     f"{r['decode_accuracy']:.3f} | {r['differ']} of {r['graded']} |")
    return "\n".join(lines)


def _select(args: argparse.Namespace, task: str, out: Path) -> dict:
    """Train every candidate of :data:`GRID` for ``task`` and choose on validation sequences; writes
    ``out/selection.json`` (after every candidate) and returns it."""
    from kvpop.demo import evaluate as E
    from kvpop.demo import retrofit as R

    mod = task_module(task)
    s = _settings(args, task)
    vcfg = _valid_config(E, s, args)
    base = E.load_base_model(_base_model_dir(args, task))
    pm = dict(sinks=vcfg.sinks, window=vcfg.window, budget=vcfg.budgets[0])
    out.mkdir(parents=True, exist_ok=True)
    full = {**GRID, **getattr(mod, "DEMO_GRID", {})}
    grid = ({**{k: v[:1] for k, v in full.items()}, "steps": (QUICK["steps"],), "finetune_steps": (QUICK["steps"],),
             "label_steps": (QUICK["steps"],), "target_source": full["target_source"], "label": full["label"],
             "joint_init": full["joint_init"], "head_budgets": full["head_budgets"]} if args.quick else full)
    record = {"task": task, "grid": grid, "criterion": "mean validation accuracy over the budgets at L_train",
              "validation": {"split": "valid", "seeds": f"valid_seed(0..{vcfg.n_sequences - 1})",
                             "length": s["train_len"], "budgets": vcfg.budgets, "sinks": vcfg.sinks,
                             "window": vcfg.window, "train_length": s["train_length"]},
              "candidates": [], "chosen": {}}
    dense_done: dict = {}

    def save() -> None:
        E.write_results(record, out / selection_file(args.select_stage))

    def trial(policy: str, stage: str, c: dict) -> dict:
        d = _trial_dir(out, policy, c)
        sc = JOINT_OF.get(LABEL_VARIANTS_OF.get(policy, policy))
        rc = _retrofit_config(E, s, policy, c,
                              _init_file(out, policy, c, chosen.get(sc) or s["retrofits"].get(sc)))
        R.retrofit(base, policy, d, rc, resume=True, progress=not args.no_progress, task=mod,
                   validate=_validator(E, mod, base, s, args, policy, d, dense_done) if rc.eval_every else None)
        vf = d / "validation.json"
        if vf.exists() and json.loads(vf.read_text()).get("settings") == c:
            r = json.loads(vf.read_text())
        else:
            res = E.evaluate({"dense": base, policy: _policy_model(E, base, policy, d, pm)}, vcfg, task=mod,
                             done=dense_done)
            for row in res["rows"]:
                if row["policy"] == "dense":
                    dense_done[f"dense|{row['budget']}|{row['length']}"] = row
            acc = {str(row["budget"]): row["accuracy"] for row in res["rows"] if row["policy"] == policy}
            r = {"policy": policy, "stage": stage, "settings": c, "val_accuracy": acc,
                 "val_mean": sum(acc.values()) / len(acc), "val_dense": res["dense_accuracy"]}
            done = json.loads((d / "done.json").read_text())
            if "best_step" in done:  # early stopping: the state kept and the validations it was chosen by
                r["best_step"], r["validations"] = done["best_step"], done["validation"]
            vf.write_text(json.dumps(r, indent=1))
        record["candidates"].append(r)
        save()
        print(f"[kvpop demo --select] {task} {policy} {c}: validation accuracy "
              f"{ {b: round(a, 3) for b, a in r['val_accuracy'].items()} } mean {r['val_mean']:.3f}", flush=True)
        return r

    def best(rs: list[dict]) -> dict:
        return max(rs, key=lambda r: r["val_mean"])  # the first of equals: the earlier (cheaper) candidate

    chosen = record["chosen"]
    if args.select_stage == "label":  # the label family; the other settings as chosen before (CHOSEN)
        fixed = {"eval_every": grid["eval_every"][0], "patience": grid["patience"][0]}
        for p in SCORER_ONLY:
            c = {k: v for k, v in s["retrofits"][p].items() if k not in ("label", "decay_span", "lr_scorer")}
            chosen[p] = best([trial(p, "label x decay_span x lr_scorer",
                                    {**c, **fixed, "steps": grid["label_steps"][0], "label": lab,
                                     "decay_span": span, "lr_scorer": lr})
                              for lab in grid["label"] for span in grid["decay_span"]
                              for lr in grid["label_lr_scorer"]])
            chosen[p] = best([chosen[p]] + [trial(p, "head_budgets", {**chosen[p]["settings"], "head_budgets": hb})
                                            for hb in grid["head_budgets"] if hb != "uniform"])["settings"]
        for p, sc in JOINT_OF.items():
            c = {**{k: v for k, v in s["retrofits"][p].items() if k != "head_budgets"},
                 **{k: chosen[sc][k] for k in (*LABEL_KEYS, "lr_scorer") if k in chosen[sc]},
                 "eval_every": 0, "patience": 0}  # the joint retrofits' own steps, no early stopping
            chosen[p] = best([trial(p, "joint_init", {**c, "joint_init": ji})
                              for ji in grid["joint_init"]])["settings"]
        chosen["fixed-finetune"] = dict(s["retrofits"]["fixed-finetune"])
        save()
        print(f"[kvpop demo --select] {task}: chosen {json.dumps(chosen)}", flush=True)
        return record
    if args.select_stage == "target_source":  # the other settings as chosen before (CHOSEN, or --quick's)
        for p in JOINT_OF:
            c = {k: v for k, v in s["retrofits"][p].items() if k != "target_source"}
            chosen[p] = best([trial(p, "target_source", {**c, "target_source": src})
                              for src in grid["target_source"]])["settings"]
        save()
        print(f"[kvpop demo --select] {task}: chosen {json.dumps(chosen)}", flush=True)
        return record
    fixed = {"eval_every": grid["eval_every"][0], "patience": grid["patience"][0], "label": grid["label"][0],
             "decay_span": grid["decay_span"][0]}
    for p in SCORER_ONLY:
        first = best([trial(p, "k x lr_scorer", {**fixed, "steps": grid["steps"][0], "k": k, "lr_scorer": lr})
                      for k in grid["k"] for lr in grid["lr_scorer"]])
        first = best([first] + [trial(p, "steps", {**first["settings"], "steps": st}) for st in grid["steps"][1:]])
        first = best([first] + [trial(p, "label x decay_span", {**first["settings"], "label": lab, "decay_span": span})
                                for lab in grid["label"] for span in grid["decay_span"]
                                if (lab, span) != (fixed["label"], fixed["decay_span"])])
        chosen[p] = best([first] + [trial(p, "head_budgets", {**first["settings"], "head_budgets": hb})
                                    for hb in grid["head_budgets"] if hb != "uniform"])["settings"]
    for p, sc in JOINT_OF.items():
        first = best([trial(p, "lr_model", {**chosen[sc], "lr_model": lm, "target_source": "student",
                                            "joint_init": grid["joint_init"][0]})
                      for lm in grid["joint_lr_model"]])
        first = best([first] + [trial(p, "target_source", {**first["settings"], "target_source": src})
                                for src in grid["target_source"] if src != "student"])
        chosen[p] = best([first] + [trial(p, "joint_init", {**first["settings"], "joint_init": ji})
                                    for ji in grid["joint_init"][1:]])["settings"]
    chosen["fixed-finetune"] = best([trial("fixed-finetune", "lr_model x steps", {"steps": st, "lr_model": lm})
                                     for lm in grid["finetune_lr_model"] for st in grid["finetune_steps"]])["settings"]
    save()
    print(f"[kvpop demo --select] {task}: chosen {json.dumps(chosen)}", flush=True)
    return record


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: a retrofit in flight checkpointed its last step
        print(f"\nkvpop demo: interrupted; finished parts are kept in {args.out}: run the same command with "
              f"--resume to continue", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)


def _run(args: argparse.Namespace) -> int:
    import torch

    t_start = time.time()
    out = Path(args.out)
    tasks = list(TASKS) if args.task == "all" else [args.task]
    from kvpop.training.runstate import RunLock

    lock = RunLock(out, "kvpop demo")  # one demo per --out: two would overwrite each other's parts
    try:
        check_common(args)
        check_out(args.out)
        lock.acquire()
        torch.set_num_threads(args.threads)
        if args.model is not None and len(tasks) > 1:
            raise ValueError("--model belongs to one task: give --task kvtrace or --task lookahead with it")
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        for task in tasks:  # check every setting before training anything
            from kvpop.demo import evaluate as E

            _base_model_dir(args, task)
            s = _settings(args, task)
            _eval_config(E, s, args)
            for p, c in s["retrofits"].items():
                _retrofit_config(E, s, p, c)
        for task in tasks:
            (_select if args.select else _run_task)(args, task, out / task)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvpop demo: error: {e}", file=sys.stderr)
        return 2
    finally:
        lock.release()
    print(f"[kvpop demo] done in {time.time() - t_start:.0f} s", flush=True)
    return 0
