"""The demo's grid and its plans, as data: the retrofits of a demo run (:data:`RETROFITS`), the candidates of
``kvpop demo --select`` (:data:`SELECT_GRID`; a task module's ``DEMO_GRID`` replaces some entries) and the stages
of each retrofit's search (:func:`select_plan`), run by the one search of the library
(:class:`kvpop.training.search.Search`) in :func:`kvpop.demo.search.select`."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpop.training.search import Stage

__all__ = ["select_plan", "SELECT_GRID", "SELECT_STAGES", "LABEL_KEYS", "SCORER_ONLY", "JOINT_OF", "RETROFITS"]

SCORER_ONLY = ("kvpop-mlp", "kvpop-mlstm")
JOINT_OF = {"kvpop-mlp-joint": "kvpop-mlp", "kvpop-mlstm-joint": "kvpop-mlstm"}
RETROFITS = (*SCORER_ONLY, *JOINT_OF, "fixed-finetune")
"""The retrofits of every demo run, in the order they are searched and trained (a joint one after its scorer's)."""

SELECT_GRID = {"k": (4, 16, 64), "lr_scorer": (1e-2,), "steps": (100,), "joint_lr_model": (1e-4,),
               "target_source": ("student", "teacher"), "finetune_lr_model": (1e-4, 1e-3), "finetune_steps": (30,),
               "label": ("mean", "max"), "decay_span": (None, 8.0), "label_lr_scorer": (1e-2,),
               "label_steps": (200,), "eval_every": (0,), "patience": (0,), "joint_init": ("fresh", "scorer-only"),
               "head_budgets": ("uniform", "ablation")}
"""The candidates of ``kvpop demo --select`` (:func:`select_plan`); a task module's ``DEMO_GRID`` replaces some
of these entries for its task.  A grid of one value fixes that setting (the CPU budget of a 2-core machine:
each candidate is a retrofit plus a validation run).  ``k``: the training budget's long-range slots; ``label``
and ``decay_span``: the label the scorers learn (``KVpopConfig.label``) and the decay's range (``None`` the
paper's, a number of nats the range tied to the training length); ``eval_every`` / ``patience``: validation
during the retrofit, the best state kept (0: none); ``joint_init``: a joint retrofit's scorers ``"fresh"`` or the
scorer-only retrofit's; ``head_budgets``: ``"ablation"`` head-adaptive budgets fixed before training."""
SELECT_STAGES = ("all", "label", "target_source")
"""``kvpop demo --select --select-stage``: every setting, the label family alone, the label source alone."""
LABEL_KEYS = ("label", "decay_span", "eval_every", "patience", "head_budgets")
"""Settings a joint retrofit takes from its scorer-only retrofit's choice (besides ``lr_scorer`` and ``k``)."""


def select_plan(which: str, policy: str, grid: Mapping[str, Sequence], current: Mapping[str, dict],
                chosen: Mapping[str, dict]) -> list[Stage]:
    """The stages of ``kvpop demo --select --select-stage which`` for the demo's retrofit ``policy``.

    ``grid``: :data:`SELECT_GRID` with the task's entries; ``current``: each retrofit's settings before this
    search (the shipped choice; the stages ``label`` and ``target_source`` keep the rest of them);
    ``chosen``: the choices made so far in this search (a joint retrofit's plan starts from its scorer's).
    ``which``:

    * ``all``: scorer-only: every (k, lr_scorer) at the first steps, then every steps, every (label,
      decay_span) and every head budget; joint: every joint_lr_model from the scorer's choice with the student's
      label, then every target_source and every joint_init; fixed-finetune: every (lr_model, steps);
    * ``label``: scorer-only: every (label, decay_span, lr_scorer) at label_steps with the task's validation
      during training, then every head budget; joint: its scorer's label settings, every joint_init;
      fixed-finetune: not searched (``[]``);
    * ``target_source``: the joint retrofits' every label source (``[]`` for the others).
    """
    if which not in SELECT_STAGES:
        raise ValueError(f"unknown select stage {which!r}; allowed: {list(SELECT_STAGES)}")
    if policy not in RETROFITS:
        raise ValueError(f"unknown demo retrofit {policy!r}; allowed: {list(RETROFITS)}")
    g = grid
    heads = [{"head_budgets": hb} for hb in g["head_budgets"] if hb != "uniform"]
    if which == "target_source":
        if policy not in JOINT_OF:
            return []
        c = {k: v for k, v in current[policy].items() if k != "target_source"}
        return [Stage("target_source", [{"target_source": s} for s in g["target_source"]], start=c)]
    if which == "label":
        if policy in SCORER_ONLY:
            c = {k: v for k, v in current[policy].items() if k not in ("label", "decay_span", "lr_scorer")}
            c.update(eval_every=g["eval_every"][0], patience=g["patience"][0], steps=g["label_steps"][0])
            return [Stage("label x decay_span x lr_scorer",
                          [{"label": lab, "decay_span": span, "lr_scorer": lr} for lab in g["label"]
                           for span in g["decay_span"] for lr in g["label_lr_scorer"]], start=c),
                    Stage("head_budgets", heads)]
        if policy in JOINT_OF:
            sc = chosen[JOINT_OF[policy]]
            c = {**{k: v for k, v in current[policy].items() if k != "head_budgets"},
                 **{k: sc[k] for k in (*LABEL_KEYS, "lr_scorer") if k in sc},
                 "eval_every": 0, "patience": 0}  # the joint retrofits' own steps, no early stopping
            return [Stage("joint_init", [{"joint_init": ji} for ji in g["joint_init"]], start=c)]
        return []
    if policy in SCORER_ONLY:
        fixed = {"eval_every": g["eval_every"][0], "patience": g["patience"][0], "label": g["label"][0],
                 "decay_span": g["decay_span"][0], "steps": g["steps"][0]}
        return [Stage("k x lr_scorer", [{"k": k, "lr_scorer": lr} for k in g["k"] for lr in g["lr_scorer"]],
                      start=fixed),
                Stage("steps", [{"steps": st} for st in g["steps"][1:]]),
                Stage("label x decay_span", [{"label": lab, "decay_span": span} for lab in g["label"]
                                             for span in g["decay_span"]]),
                Stage("head_budgets", heads)]
    if policy in JOINT_OF:
        return [Stage("lr_model", [{"lr_model": lm} for lm in g["joint_lr_model"]],
                      start={**chosen[JOINT_OF[policy]], "target_source": "student",
                             "joint_init": g["joint_init"][0]}),
                Stage("target_source", [{"target_source": s} for s in g["target_source"]]),
                Stage("joint_init", [{"joint_init": ji} for ji in g["joint_init"][1:]])]
    return [Stage("lr_model x steps", [{"steps": st, "lr_model": lm} for lm in g["finetune_lr_model"]
                                       for st in g["finetune_steps"]], start={})]
