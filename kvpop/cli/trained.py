"""What ``kvpop eval`` evaluates: trained runs (``--run``, ``--scorers``, ``--finetuned``, ``--dms``) and the
sinks / window they were trained with.

A ``kvpop train --out DIR`` directory (or one of ``kvpop demo``'s ``OUT/<task>/<policy>``) holds, depending on
the method: ``scorers.safetensors`` (KVpop's scorers, with the ``KVpopConfig`` they were trained with),
``gates.safetensors`` (DMS's gates, with their ``DMSConfig``) and ``model/`` (the fine-tuned model; not
with ``--no-train-model``).  :func:`read_run` tells the policy from what is there:

====================================================  =====================
the directory holds                                   policy
====================================================  =====================
``gates.safetensors`` (+ ``model/``)                  ``dms``
``scorers.safetensors`` of an MLP / mLSTM scorer      ``kvpop-mlp`` / ``kvpop-mlstm``
the same + ``model/`` (the default ``kvpop train``)   ``kvpop-mlp-joint`` / ``kvpop-mlstm-joint``
scorers trained under ``mask_source="streaming"``     ``fixed-finetune`` (needs ``model/``)
+ ``model/``, or ``model/`` alone (name it)
====================================================  =====================

:func:`trained_window` takes sinks and window from the runs' saved configs: a scorer's features and a DMS
model's eviction delay depend on them, so evaluating at another window is refused, naming both values.
The budget may differ on purpose (one retrofit at several budgets); the table states both.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpop.policies import DEFAULT_SINKS, DEFAULT_WINDOW, JOINT, POLICIES, SCORER_OF, policy_of

SCORERS_FILE = "scorers.safetensors"
GATES_FILE = "gates.safetensors"
MODEL_DIR = "model"


@dataclass
class Trained:
    """One trained policy: its files and the config it was trained with (``None`` when unknown)."""

    policy: str
    source: str  # how the user named it, for messages
    scorers: Path | None = None
    gates: Path | None = None
    model: Path | None = None
    config: Any = None  # KVpopConfig or DMSConfig
    extra: dict = field(default_factory=dict)
    head_plan: dict | None = None  # the run's head_budgets.json (kvpop.core.budgets.read_head_budgets)
    name: str | None = None  # the user's name of the run (--run NAME=DIR): its row is POLICY[NAME]

    @property
    def key(self) -> str:
        """The run's table row: its policy, or ``POLICY[NAME]`` for a named run."""
        return self.policy if self.name is None else f"{self.policy}[{self.name}]"

    def summary(self) -> dict:
        """What ``results.json`` records of the training (``trained``)."""
        out: dict[str, Any] = {"source": self.source}
        c = self.config
        if c is not None:
            out.update(sinks=c.sinks, window=c.window)
            if self.gates is not None:
                out["target_keep"] = c.target_keep
            else:
                out["budget"] = c.budget
                if getattr(c, "priority_source", "scorer") != "scorer":  # a control served with its own priority
                    out["priority_source"] = c.priority_source
                if getattr(c, "head_budgets", None) is not None:
                    out["head_budgets"] = [list(r) for r in c.head_budgets]
                    if self.head_plan is not None and self.head_plan.get("rule"):
                        out["head_budgets_rule"] = self.head_plan["rule"]
        return out


def model_dir(d: Path) -> Path | None:
    m = d / MODEL_DIR
    return m if (m / "config.json").is_file() else None


def _json_object(path: Path) -> dict | None:
    """The JSON object in ``path``; None when it is absent, unreadable or not an object."""
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _demo_policy(d: Path) -> str | None:
    """The policy a ``kvpop demo`` retrofit directory says it is (its ``done.json``), else None."""
    settings = (_json_object(d / "done.json") or {}).get("settings")
    policy = settings.get("policy") if isinstance(settings, dict) else None
    return policy if isinstance(policy, str) else None


def model_was_trained(d: Path) -> bool | None:
    """Whether the run in ``d`` trained the model together with its scorers or gates (so that they serve only on
    that model, ``d/model/``): ``kvpop train``'s ``args.json`` (without ``--no-train-model``), or the policy of a
    ``kvpop demo`` retrofit's ``done.json``; None when ``d`` says neither."""
    args = _json_object(d / "args.json")
    if args is not None and isinstance(args.get("no_train_model"), bool):
        return not args["no_train_model"]
    policy = _demo_policy(d)
    if policy is not None:
        return policy in JOINT or policy in ("fixed-finetune", "dms")
    return None


def _missing_model(d: Path, source: str, what: str) -> ValueError:
    m = d / MODEL_DIR
    why = ("is missing" if not m.exists() else "is not a directory" if not m.is_dir() else "holds no config.json")
    return ValueError(f"{source}: the run trained the model together with its {what}, which serve only on that "
                      f"model, but {m} {why} (kvpop train writes it at the end of the run); restore it, or "
                      f"evaluate the whole run again after kvpop train --resume")


def dms_run(d: Path, source: str) -> Trained:
    """The ``dms`` policy of a run directory with ``gates.safetensors``; its ``model/`` is required unless the run
    says it trained the gates on the frozen base model (``--no-train-model``)."""
    from kvpop.baselines.dms import read_dms_config
    from kvpop.training.outputs import check_same_step

    config = read_dms_config(d / GATES_FILE)
    model = model_dir(d)
    if model is None and model_was_trained(d) is not False:
        raise _missing_model(d, source, "DMS gates")
    check_same_step(d, d / GATES_FILE, model, source)
    return Trained("dms", source, gates=d / GATES_FILE, model=model, config=config)


def _infer(d: Path, source: str) -> Trained:
    from kvpop.core.checkpoint import read_scorer_config
    from kvpop.training.outputs import check_same_step

    model = model_dir(d)
    if (d / GATES_FILE).is_file():
        return dms_run(d, f"--run {source}")
    if (d / SCORERS_FILE).is_file():
        cfg = read_scorer_config(d / SCORERS_FILE)
        if cfg.mask_source == "streaming":
            if model is None:
                raise ValueError(f"--run {source}: the run was trained under the fixed streaming mask "
                                 f"(fixed-finetune) but {d / MODEL_DIR} holds no model")
            return Trained("fixed-finetune", source, model=model, config=cfg)
        if model is None and model_was_trained(d):
            raise _missing_model(d, f"--run {source}", "scorers")
        check_same_step(d, d / SCORERS_FILE, model, f"--run {source}")
        name = next(p for p, s in SCORER_OF.items() if s == cfg.scorer and p.endswith("-joint") == (model is not None))
        return Trained(name, source, scorers=d / SCORERS_FILE, model=model, config=cfg, head_plan=_head_plan(d, cfg))
    if model is not None:
        policy = _demo_policy(d)  # kvpop demo's retrofit directories say which policy they are
        if policy == "fixed-finetune":
            return Trained("fixed-finetune", source, model=model)
        raise ValueError(f"--run {source}: {d} holds only a model ({d / MODEL_DIR}); name the policy it serves, "
                         f"e.g. --run fixed-finetune={d}")
    raise ValueError(f"--run {source}: {d} holds no trained run (expected {SCORERS_FILE}, {GATES_FILE} or "
                     f"{MODEL_DIR}/, what kvpop train --out writes)")


def _head_plan(d: Path, cfg: Any) -> dict | None:
    """The run's ``head_budgets.json`` (``kvpop train --head-budgets`` / ``--allocate``) when its scorers were
    trained with ``head_budgets``; its rows must be theirs."""
    from kvpop.core.budgets import HEAD_BUDGETS_FILE, read_head_budgets

    path = d / HEAD_BUDGETS_FILE
    if cfg.head_budgets is None or not path.is_file():
        return None
    plan = read_head_budgets(path)
    if plan["head_budgets"] != cfg.head_budgets:
        raise ValueError(f"{path} holds head_budgets {[list(r) for r in plan['head_budgets']]}, but the scorers in "
                         f"{d / SCORERS_FILE} were trained with {[list(r) for r in cfg.head_budgets]}: the file is "
                         f"not this run's")
    return plan


def check_head_budgets_at(trained: dict, budgets: list[int] | None) -> None:
    """``ValueError`` before any work when a run trained with ``head_budgets`` is to be evaluated at a budget
    other than its own without the importance to share the new total (its ``head_budgets.json``)."""
    for t in trained.values():
        c = t.config
        if getattr(c, "head_budgets", None) is None or t.scorers is None:
            continue
        other = sorted({int(b) for b in budgets or ()} - {c.budget})
        if other and (t.head_plan is None or t.head_plan.get("importance") is None):
            raise ValueError(
                f"{t.policy} ({t.source}) was trained with head_budgets (per-head budgets of mean {c.budget}, fixed at "
                f"retrofit time); budget(s) {other} need the importance they were allocated from to share another "
                f"total, and the run has no head_budgets.json with an \"importance\" table (kvpop train --allocate "
                f"writes one): evaluate it at --budgets {c.budget}")


def read_run(spec: str) -> Trained:
    """``[POLICY=]DIR`` -> the :class:`Trained` policy in ``DIR`` (module docstring); with ``POLICY`` the
    directory must be able to serve that policy (e.g. ``kvpop-mlp`` from a joint run uses its model).
    ``NAME=DIR`` (a name that is no policy, :data:`kvpop.policies.NAME_RULE`) or ``POLICY[NAME]=DIR`` names the
    run: its row is ``POLICY[NAME]``, so that two runs of one policy are compared in one table."""
    import re

    from kvpop.policies import NAME_RULE

    name, path = (spec.split("=", 1) if "=" in spec else (None, spec))
    if name is not None and name not in POLICIES and Path(spec).is_dir():
        name, path = None, spec  # a directory whose name holds '='
    label = None
    if name is not None and name not in POLICIES:
        m = re.fullmatch(rf"([\w.-]+)\[({NAME_RULE})\]", name)
        if m is not None and m.group(1) in POLICIES:
            name, label = m.group(1), m.group(2)
        elif re.fullmatch(NAME_RULE, name):
            import difflib

            near = difflib.get_close_matches(name, POLICIES, n=1, cutoff=0.8)
            if near:  # a misspelt policy, not a name
                raise ValueError(f"--run {spec}: unknown policy {name!r}; did you mean {near[0]}? (a name of the run "
                                 f"must not look like a policy)")
            name, label = None, name
        else:
            allowed = ", ".join(p for p in POLICIES if p != "dense")
            raise ValueError(f"--run {spec}: {name!r} is neither a policy ({allowed}) nor a name of the run (1 to 64 "
                             f"letters, digits and . _ + -, e.g. --run auto=DIR)")
    if name is not None and (name not in POLICIES or name == "dense"):
        raise ValueError(f"--run: unknown policy {name!r}; allowed: {[p for p in POLICIES if p != 'dense']} "
                         f"(or --run DIR alone: the policy is read from the run)")
    run = _read_run(spec, name, path)
    run.name = label
    return run


def _read_run(spec: str, name: str | None, path: str) -> Trained:
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"--run {spec}: {d} is not a directory (give a kvpop train --out directory)")
    if name == "fixed-finetune" and not (d / GATES_FILE).is_file() and not (d / SCORERS_FILE).is_file():
        model = model_dir(d)
        if model is None:
            raise ValueError(f"--run {spec}: fixed-finetune needs a fine-tuned model in {d / MODEL_DIR}")
        return Trained("fixed-finetune", spec, model=model)
    run = _infer(d, spec)
    if name is None or name == run.policy:
        return run
    same_scorer = name in SCORER_OF and run.policy in SCORER_OF and SCORER_OF[name] == SCORER_OF[run.policy]
    if same_scorer and not name.endswith("-joint"):
        run.policy = name  # the scorers served on the model they were trained with
        return run
    raise ValueError(f"--run {spec}: {d} holds a {run.policy} run"
                     + (" (no fine-tuned model in it)" if same_scorer else "") + f", not {name}")


def trained_window(runs: list[Trained], sinks: int | None, window: int | None, *,
                   default_sinks: int, default_window: int) -> tuple[int, int]:
    """The sinks and window to evaluate at: the runs' own (all runs must agree), the command line's when
    no run carries a config, else the defaults; a command line that contradicts a run raises ValueError
    naming both values."""
    known = [r for r in runs if r.config is not None]
    pairs = {(r.config.sinks, r.config.window) for r in known}
    if len(pairs) > 1:
        raise ValueError("the runs were trained with different sinks / window: "
                         + "; ".join(f"{r.policy} ({r.source}): sinks={r.config.sinks}, window={r.config.window}"
                                     for r in known)
                         + " -- evaluate them in separate kvpop eval commands")
    if not pairs:
        return (default_sinks if sinks is None else sinks), (default_window if window is None else window)
    s, w = pairs.pop()
    for flag, given, saved in (("--sinks", sinks, s), ("--window", window, w)):
        if given is not None and given != saved:
            who = ", ".join(f"{r.policy} ({r.source})" for r in known)
            raise ValueError(f"{flag} {given} differs from the {flag[2:]} {saved} that {who} "
                             f"{'was' if len(known) == 1 else 'were'} trained with; leave {flag} out to evaluate "
                             f"at {saved} (the budget may differ from training: give --budgets)")
    return s, w


def parse_ints(s: str | None, option: str | None = None) -> list[int] | None:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (None -> None); ValueError naming ``option`` (e.g. ``--seeds``) when given."""
    if s is None:
        return None
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError((f"{option}: " if option else "") + f"expected comma-separated integers, got {s!r}") from None


def policy_models(E, base, cfg_policies, wanted, trained: dict, *, sinks: int, window: int, budget: int,
                   load, budgets: list[int] | None = None) -> dict:
    """policy -> model for every policy of ``cfg_policies`` that has what it needs (``trained``: policy ->
    :class:`kvpop.cli.trained.Trained`); a policy named in ``wanted`` without it raises ValueError, as does a
    run with ``head_budgets`` that cannot be shared at one of ``budgets`` (:func:`check_head_budgets_at`)."""
    check_head_budgets_at({p: t for p, t in trained.items() if p in cfg_policies}, [budget, *(budgets or ())])
    models = {"dense": base}
    shared = None
    for p in cfg_policies:
        if p == "dense":
            continue
        t = trained.get(p)
        if p != policy_of(p):  # a named run's row (with_named: it is in trained)
            kind = policy_of(p)
            ft = load(t.model) if t.model is not None else None
            models[p] = E.policy_model(base, kind, scorers=t.gates if kind == "dms" else t.scorers,
                                       finetuned=ft if ft is not None or kind != "dms" else base, sinks=sinks,
                                       window=window, budget=budget, head_plan=t.head_plan)
            continue
        if p in ("dms", "dms-test-calibrated"):  # the second only when asked for (--policies)
            t = trained.get("dms")
            if t is None or (p != "dms" and p not in (wanted or ())):
                if t is None and wanted is not None and p in wanted:
                    raise ValueError(f"policy {p!r} needs a DMS run: --run DIR or --dms DIR (kvpop train --method dms)")
                continue
            models[p] = models.get("dms") or E.policy_model(base, "dms", scorers=t.gates, sinks=sinks, window=window,
                                                            finetuned=load(t.model) if t.model is not None else base)
            continue
        ft = load(t.model) if t is not None and t.model is not None else None
        if p in SCORER_OF and (t is None or t.scorers is None):
            if wanted is not None:
                if p not in JOINT:
                    raise ValueError(f"policy {p!r} needs its scorers: --run {p}=DIR or --scorers {p}=FILE")
                alone = [f"{o.source} gives {o.policy} (scorers without a model/)" for o in trained.values()
                         if o.policy not in JOINT and SCORER_OF.get(o.policy) == SCORER_OF[p]]
                raise ValueError(f"policy {p!r} needs scorers and the model trained with them: --run DIR of a kvpop "
                                 f"train run that holds {SCORERS_FILE} and {MODEL_DIR}/, or --scorers {p}=FILE "
                                 f"--finetuned {p}=DIR" + (f"; {'; '.join(alone)}" if alone else ""))
            continue
        if p == "fixed-finetune" and ft is None:
            if wanted is not None:
                raise ValueError("policy 'fixed-finetune' needs a fine-tuned model: --run fixed-finetune=DIR or "
                                 "--finetuned fixed-finetune=DIR")
            continue
        if p in ("streaming", "tova", "h2o") and ft is None:
            shared = shared or E.policy_model(base, "streaming", sinks=sinks, window=window, budget=budget)
            models[p] = shared
            continue
        models[p] = E.policy_model(base, p, scorers=t.scorers if t is not None else None, finetuned=ft, sinks=sinks,
                                   window=window, budget=budget, head_plan=t.head_plan if t is not None else None)
    left = [t for k, t in trained.items() if k not in models and not (k == "dms" and "dms-test-calibrated" in models)]
    if wanted is not None and left:  # a run given and then dropped without a word is refused
        raise ValueError(f"--policies {','.join(wanted)} leaves out the row of {', '.join(t.source for t in left)} "
                         f"({', '.join(t.key for t in left)}): add {'it' if len(left) == 1 else 'them'} to --policies, "
                         f"or leave the run out")
    return models


def with_named(policies, trained: dict, wanted) -> list[str]:
    """``policies`` and the rows of the named runs (``POLICY[NAME]``, :func:`read_run`) whose policy (or row) is
    wanted (``wanted`` None: every one)."""
    keys = {t.key for t in trained.values()}
    for w in wanted or ():
        if w != policy_of(w) and w not in keys:
            raise ValueError(f"--policies names the row {w!r}, but no run is named {w[len(policy_of(w)) + 1:-1]!r} "
                             f"(--run NAME=DIR names one); named rows: {sorted(k for k in keys if k != policy_of(k))}")
    named = [t.key for t in trained.values() if t.name is not None
             and (wanted is None or t.policy in wanted or t.key in wanted)]
    only_named = {t.policy for t in trained.values() if t.name is not None} - set(trained)
    return [*[p for p in policies if p not in named and p not in only_named], *named]


def run_settings(args: argparse.Namespace, trained: dict, wanted) -> tuple[int, int, dict]:
    """Sinks and window (the runs' own; a contradicting --sinks / --window raises) and ``results['trained']``.
    Every run given counts for sinks and window, also one whose row ``--policies`` leaves out (refused by
    :func:`policy_models`): the fixed rules are measured at the runs' own, as the help says."""
    runs = [t for t in trained.values() if wanted is None or t.policy in wanted or t.key in wanted]
    sinks, window = trained_window(list(trained.values()), args.sinks, args.window, default_sinks=DEFAULT_SINKS,
                                   default_window=DEFAULT_WINDOW)
    return sinks, window, {t.key: t.summary() for t in runs}


def run_base(d: Path) -> Path | None:
    """The base model directory the ``kvpop train`` run in ``d`` started from (its ``args.json``: ``--model``, or the
    shipped model of its ``--task`` without one); None when ``d`` does not say or started from ``--tiny``'s random
    weights."""
    from kvpop.demo.search import default_model

    saved = _json_object(d / "args.json")
    if saved is None or saved.get("tiny") is True:
        return None
    if isinstance(saved.get("model"), str):
        return Path(saved["model"])
    if "model" not in saved:
        return None
    task = saved.get("task") if saved.get("task") in (None, "kvtrace", "lookahead") else None
    return default_model(task)


def row_models(trained: dict, model_dir: Path, wanted) -> dict[str, str]:
    """Which model each row runs (``results['row_models']``): a run's own fine-tuned ``model/``, else ``model_dir``
    (``--model``, the dense row's); ``ValueError`` before any work when a run was trained from another base model
    than ``model_dir`` (different files, :func:`kvpop.training.data.model_fingerprint`): its row and the dense row
    would then be two different models, and "rel. to dense" would compare them."""
    from kvpop.training.data import model_fingerprint

    def prints(d: Path) -> dict | None:
        try:
            return model_fingerprint(d)
        except OSError:
            return None

    out = {"dense": str(model_dir)}
    mine = None
    for p, t in trained.items():
        if wanted is not None and p not in wanted:
            continue
        layer_file = t.gates if t.gates is not None else t.scorers
        run_dir = layer_file.parent if layer_file is not None else t.model.parent if t.model is not None else None
        base = run_base(run_dir) if run_dir is not None else None
        if base is not None and base.resolve() != model_dir.resolve():
            mine = mine if mine is not None else prints(model_dir)
            theirs = prints(base) if base.is_dir() else None
            if theirs is None or theirs != mine:
                why = "" if base.is_dir() else " (no longer there, so it cannot be compared)"
                raise ValueError(f"{t.policy} ({t.source}) was trained from the base model {base}{why}, and --model is "
                                 f"{model_dir}: its row would run a model trained from {base} while dense and the "
                                 f"fixed rules run {model_dir}, and the comparison with dense would compare two "
                                 f"different models; give --model {base} (the run's base), or evaluate the run in a "
                                 f"kvpop eval of its own")
        out[p] = str(t.model) if t.model is not None else str(model_dir)
    return out


def rows_ran(models: dict[str, str], policies) -> dict[str, str]:
    """:func:`row_models` for the rows that ran (``policies``; the fixed rules run the dense row's model)."""
    return {p: models.get(p, models["dense"]) for p in dict.fromkeys(policies)}


def models_line(models: dict[str, str]) -> str:
    """``row_models`` in words: which model each row ran."""
    by: dict[str, list[str]] = {}
    for p, m in models.items():
        by.setdefault(m, []).append(p)
    return "Models run: " + "; ".join(f"{', '.join(ps)}: {m}" for m, ps in by.items())

