"""Accuracy of eviction policies at fixed cache budgets on the demo's tasks (``kvpop.demo.task``, ``lookahead_task``).

Every non-dense number is measured **through the code a user runs**: each test sequence (batch 1)
goes through a ``kvpop.patch``-ed model with a fresh :class:`kvpop.KVpopCache` in one call
``model(input_ids, past_key_values=cache)``, and the task's accuracy is read from the logits at the
graded positions (greedy argmax, :func:`kvpop.demo.task.accuracy`).

* Static policies (``streaming``, ``fixed-finetune``, ``kvpop-mlp``, ``kvpop-mlstm``): the cache's
  prefill is the teacher-forced ``sparse_attention`` forward with the policy's priorities, which
  ``tests/core/test_cache.py`` shows equal to prefill + token-by-token decoding.
* Attention-scored policies (``tova``, ``h2o``): the cache decodes the whole sequence token by token
  (``fixed_budget_decode`` per token and layer), as it would during generation.
* ``dense``: the unpatched model's plain forward.

Policies (named in :mod:`kvpop.policies`):

===================  ===============================================  ==================
policy               model                                            cache policy
===================  ===============================================  ==================
``dense``            base model, unpatched                            (none: full cache)
``streaming``        base model                                       ``"streaming"``
``tova``             base model                                       ``"tova"``
``h2o``              base model                                       ``"h2o"``
``fixed-finetune``   model fine-tuned with ``mask_source="streaming"``  ``"streaming"``
``kvpop-mlp``        base (or fine-tuned) model + trained MLP scorers ``"kvpop"``
``kvpop-mlstm``      base (or fine-tuned) model + trained mLSTM scorers ``"kvpop"``
``dms``              DMS-trained model + its gates                    ``DMSCache`` (ragged)
===================  ===============================================  ==================

``dms`` (the learned baseline, ``kvpop.baselines.dms.budget``) has no budget of its own: it runs at the same *mean*
budget per head, its gate threshold chosen on validation sequences (``task.valid_seed``) so that their
mean entries held per layer and KV head at the last position is at most ``B``, then fixed for the test
sequences (``dms-test-calibrated``: set on each test sequence instead, a labelled second row); its rows
also record the threshold and the entries held (mean and spread over heads, ``dms_entries_*``).

Budgets default to 6.25 %, 12.5 % and 25 % of the training length (128/256/512 at 2048) with
``sinks=4`` and ``window=32``: the package default window of 256 does not fit a 128-entry budget
(``budget >= sinks + window + 1``), and a small window leaves most of the budget to the long-range
slots, where the policies differ.  All policies share the same sinks and window, so they hold the
same ``B`` entries per layer and KV head.

The retrofits that make the learned rows are :mod:`kvpop.demo.retrofit`'s.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvpop.baselines.dms.budget import calibrate_threshold as dms_calibrate
from kvpop.baselines.dms.budget import dms_logits, dms_policy_model
from kvpop.baselines.dms.budget import mean_entries as dms_mean_entries
from kvpop.baselines.dms.budget import row_stats as dms_row_stats
from kvpop.core.budgets import rebudget, set_importance
from kvpop.core.cache import KVpopCache
from kvpop.core.checkpoint import load_scorers, read_scorer_config
from kvpop.core.files import atomic_write, write_json
from kvpop.core.patching import get_config, is_patched, patch, unpatch
from kvpop.models import cache_kwarg_name
from kvpop.policies import (
    CACHE_POLICY,
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
    DMS_POLICIES,
    JOINT,
    LABEL_SOURCES,
    LABEL_VARIANTS,
    NAME_RULE,
    POLICIES,
    SCORER_OF,
    policy_of,
    row_order,
)

__all__ = [
    "POLICIES",
    "LABEL_SOURCES",
    "LABEL_VARIANTS",
    "CACHE_POLICY",
    "BUDGET_FRACTIONS",
    "DEFAULT_SINKS",
    "DEFAULT_WINDOW",
    "SHIPPED_MODEL",
    "EvalConfig",
    "budgets_for",
    "load_base_model",
    "policy_model",
    "policy_logits",
    "sequence_predictions",
    "sequence_correct",
    "batch_correct",
    "BATCHED",
    "cost_kind",
    "evaluate",
    "results_dict",
    "format_table",
    "write_results",
    "write_outputs",
    "trained_label",
    "plot_results",
    "save_figure",
]

BATCHED = ("tova", "h2o")
"""Policies :func:`evaluate` runs on all sequences of a length at once (token-by-token decoding, whose cost
per token hardly grows with the batch on a CPU); the others run one sequence at a time."""
BUDGET_FRACTIONS = (0.0625, 0.125, 0.25)
SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "data" / "tiny_qwen3"
"""The shipped tiny model (the kvtrace task's, ``kvpop.demo.task.SHIPPED_MODEL``): :func:`load_base_model`'s
default."""


def _check_policies(policies: Iterable[str]) -> list[str]:
    """The policies (or named runs' rows, ``POLICY[NAME]``, :func:`kvpop.policies.policy_of`) once each, in order;
    ValueError for an unknown one."""
    import re

    out = []
    for p in policies:
        named = p != policy_of(p) and re.fullmatch(NAME_RULE, p[len(policy_of(p)) + 1:-1]) is not None
        if policy_of(p) not in POLICIES or (p != policy_of(p) and not named):
            raise ValueError(f"unknown policy {p!r}; allowed: {list(POLICIES)}")
        if p not in out:
            out.append(p)
    return out


def cost_kind(policy: str) -> str:
    """What a policy's sequence costs per token, for the ETA (:class:`kvpop.progress.CostETA`): ``decode`` for the
    attention-scored policies (:data:`BATCHED`: token by token, tens of small ops per token and layer), ``forward``
    for the rest (one pass over the sequence)."""
    return "decode" if policy_of(policy) in BATCHED else "forward"


def budgets_for(train_len: int, fractions: Sequence[float] = BUDGET_FRACTIONS) -> list[int]:
    """Budgets ``round(f * train_len)`` for each fraction ``f`` (e.g. 128, 256, 512 at 2048)."""
    return [int(round(f * train_len)) for f in fractions]


@dataclass
class EvalConfig:
    """What :func:`evaluate` measures.

    Attributes:
        train_len: the model's training length ``L_train`` (budgets default to fractions of it).
        lengths: test sequence lengths (default ``L_train`` and ``2 L_train``).
        budgets: cache budgets ``B`` (entries per layer and KV head); default
            :data:`BUDGET_FRACTIONS` of ``train_len``.
        n_sequences: sequences per length (``test_seed(first_seed + i)``, or ``valid_seed`` with
            ``split="valid"``, of the task module given to :func:`evaluate`).
        sinks, window: shared by every policy (``budget >= sinks + window + 1``).
        policies: which policies to run (default all that have a model).
        progress: show a tqdm bar.
        split: ``"test"`` (the table) or ``"valid"`` (choosing training settings).
    """

    train_len: int = 2048
    lengths: Sequence[int] | None = None
    budgets: Sequence[int] | None = None
    n_sequences: int = 4
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    policies: Sequence[str] = POLICIES
    progress: bool = True
    first_seed: int = 0
    split: str = "test"

    def __post_init__(self) -> None:
        if self.split not in ("test", "valid"):
            raise ValueError(f"split must be 'test' or 'valid', got {self.split!r}")
        for name in ("train_len", "n_sequences"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.lengths is None:
            self.lengths = [self.train_len, 2 * self.train_len]
        if self.budgets is None:
            self.budgets = budgets_for(self.train_len)
        self.lengths = [int(x) for x in self.lengths]
        self.budgets = [int(x) for x in self.budgets]
        for L in self.lengths:
            if L < 64:
                raise ValueError(f"test lengths must be >= 64 (the task's minimum), got {L}")
        if not self.lengths or not self.budgets:
            raise ValueError("lengths and budgets must not be empty")
        least = self.sinks + self.window + 1
        small = [b for b in self.budgets if b < least]
        if small:
            raise ValueError(f"budget(s) {small} too small: every budget must be >= sinks + window + 1 = "
                             f"{self.sinks} + {self.window} + 1 = {least}; raise the budget or lower "
                             f"--window/--sinks")
        self.policies = _check_policies(self.policies)


def load_base_model(path: str | os.PathLike | None = None) -> nn.Module:
    """A causal LM of a family kvpop supports from a local directory (default: the shipped ``tiny_qwen3``),
    fp32, eval mode; its ``config.json`` is checked before any weight is allocated
    (:func:`kvpop.models.check_model_dir`)."""
    from kvpop.models import load_model_dir

    return load_model_dir(Path(path) if path is not None else SHIPPED_MODEL, dtype=torch.float32).eval()


def policy_model(base: nn.Module, policy: str, *, scorers: str | os.PathLike | None = None,
                 finetuned: nn.Module | None = None, sinks: int = DEFAULT_SINKS, window: int = DEFAULT_WINDOW,
                 budget: int = 256, head_plan: dict | None = None) -> nn.Module:
    """The model that serves ``policy`` (a patched copy; ``dense`` -> ``base`` itself, unpatched).

    ``scorers``: a scorer file (``kvpop.save_scorers``) for ``kvpop-mlp``/``kvpop-mlstm``;
    ``finetuned``: a fine-tuned model to use instead of ``base`` (``fixed-finetune`` needs one).
    Scorers trained with ``head_budgets`` keep them at their own budget; at another ``budget`` they are
    shared anew from ``head_plan`` (``kvpop.core.budgets.read_head_budgets``'s dict with an ``importance``,
    e.g. the run's ``head_budgets.json``; :func:`kvpop.core.budgets.rebudget`), else ``ValueError``.
    """
    if policy not in POLICIES:  # a policy, not a named run's row
        raise ValueError(f"unknown policy {policy!r}; allowed: {list(POLICIES)}")
    if policy == "dense":
        return base
    if policy in DMS_POLICIES:
        if scorers is None or finetuned is None:
            raise ValueError(f"policy {policy!r} needs its gate file (scorers=) and its DMS-trained model "
                             f"(finetuned=)")
        return dms_policy_model(finetuned, scorers, sinks=sinks, window=window)
    if policy == "fixed-finetune" and finetuned is None:
        raise ValueError("policy 'fixed-finetune' needs the model fine-tuned with mask_source='streaming'")
    model = copy.deepcopy(finetuned if finetuned is not None else base)
    if is_patched(model):
        unpatch(model)
    if policy in SCORER_OF:
        if scorers is None:
            raise ValueError(f"policy {policy!r} needs trained scorers (a scorer file)")
        cfg = read_scorer_config(scorers)
        if cfg.scorer != SCORER_OF[policy]:
            raise ValueError(f"policy {policy!r} needs a {SCORER_OF[policy]!r} scorer, but {scorers} holds a "
                             f"{cfg.scorer!r} scorer")
        if cfg.scorer == "mlstm" and cfg.window != window:
            raise ValueError(f"the mLSTM scorers in {scorers} were trained with window={cfg.window}; "
                             f"evaluate with the same window (got window={window})")
        if cfg.head_budgets is None:
            patch(model, cfg, sinks=sinks, window=window, budget=budget)
            load_scorers(model, scorers)
        else:  # the rows fixed at retrofit time; another budget shares the importance they came from
            patch(model, cfg, sinks=sinks, window=window)
            load_scorers(model, scorers)
            if head_plan is not None and head_plan.get("importance") is not None:
                set_importance(model, head_plan["importance"], min_k=head_plan.get("min_k", 0),
                               granularity=head_plan.get("granularity", 1))
            rebudget(model, budget)
    else:
        patch(model, sinks=sinks, window=window, budget=budget, scorer="mlp")  # scorer unused
    return model.eval()


@torch.no_grad()
def policy_logits(model: nn.Module, input_ids: torch.Tensor, policy: str, budget: int | None = None, *,
                  threshold: float | None = None) -> torch.Tensor:
    """Logits ``[1, L, V]`` of one sequence (``input_ids`` ``[L]`` or ``[1, L]``) under ``policy``, teacher-forced.

    Batch 1, one call ``model(input_ids, past_key_values=KVpopCache(model, policy=...))`` (``dense``: the
    unpatched model's plain forward): the static policies prefill through the patched model's
    ``sparse_attention`` forward with the policy's eviction schedule, ``tova``/``h2o`` decode token by token.
    ``dense``, ``tova`` and ``h2o`` (:data:`BATCHED`) also take a batch ``[n, L]`` of sequences of one length
    (the batched cache decodes them together, each row evicting on its own; ``[n, L, V]`` logits).
    ``model`` is :func:`policy_model`'s model for ``policy``; ``budget`` re-budgets it with
    ``kvpop.core.budgets.rebudget(model, budget)`` first (``kvpop.patch(model, budget=...)``, or new head
    budgets from the importance of the old ones).  ``dms``/``dms-test-calibrated``: at gate ``threshold`` when
    given, else at the threshold calibrated on this sequence to mean budget ``budget``.
    """
    ids = input_ids
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or (ids.shape[0] != 1 and policy not in ("dense", *BATCHED)):
        raise ValueError(f"one sequence at a time (batch 1; dense, {', '.join(BATCHED)}: a batch of equal "
                         f"lengths), got input_ids of shape {tuple(input_ids.shape)} for policy {policy!r}")
    if threshold is not None and policy not in DMS_POLICIES:
        raise ValueError(f"threshold= is DMS's gate threshold; policy {policy!r} takes none")
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    if policy == "dense":
        if is_patched(model):
            raise ValueError("the dense policy runs the unpatched model")
        return model(ids, use_cache=False).logits
    if policy in DMS_POLICIES:
        if budget is None and threshold is None:
            raise ValueError(f"policy {policy!r} needs the mean budget it runs at (budget=) or a fixed threshold=")
        return dms_logits(model, ids, None if budget is None else int(budget), threshold=threshold)
    if policy not in CACHE_POLICY:
        raise ValueError(f"unknown policy {policy!r}; allowed: {list(POLICIES)}")
    if not is_patched(model):
        raise ValueError(f"policy {policy!r} needs a kvpop-patched model (see policy_model)")
    if budget is not None and get_config(model).budget != budget:
        rebudget(model, int(budget))  # head_budgets: shared anew from their importance (policy_model)
    cache = KVpopCache(model, policy=CACHE_POLICY[policy])
    return model(ids, **{cache_kwarg_name(): cache}).logits


@torch.no_grad()
def sequence_predictions(model: nn.Module, example: dict, policy: str, budget: int | None = None, *,
                         threshold: float | None = None) -> torch.Tensor:
    """Greedy predictions (int64 ``[n]``) at the graded positions of one example under ``policy``
    (logits from :func:`policy_logits`)."""
    logits = policy_logits(model, example["input_ids"], policy, budget, threshold=threshold)
    pos = example["answer_positions"].reshape(-1).to(logits.device)
    return logits[0, pos].argmax(-1)


def sequence_correct(model: nn.Module, example: dict, policy: str, budget: int | None = None, *,
                     threshold: float | None = None) -> tuple[int, int]:
    """``(correct, graded)`` of one example under ``policy`` (see :func:`sequence_predictions`)."""
    pred = sequence_predictions(model, example, policy, budget, threshold=threshold)
    ans = example["answers"].reshape(-1).to(pred.device)
    return int((pred == ans).sum()), int(ans.numel())


@torch.no_grad()
def batch_correct(model: nn.Module, examples: Sequence[dict], policy: str, budget: int | None = None
                  ) -> tuple[int, int]:
    """``(correct, graded)`` summed over ``examples`` (all of one length) decoded as one batch under
    ``policy`` (one of :data:`BATCHED`); the same counts as :func:`sequence_correct` one by one."""
    if not examples:
        return 0, 0
    ids = torch.stack([ex["input_ids"].reshape(-1) for ex in examples])
    logits = policy_logits(model, ids, policy, budget)
    correct = graded = 0
    for i, ex in enumerate(examples):
        pos = ex["answer_positions"].reshape(-1).to(logits.device)
        ans = ex["answers"].reshape(-1).to(logits.device)
        correct += int((logits[i, pos].argmax(-1) == ans).sum())
        graded += int(ans.numel())
    return correct, graded


def _row_key(policy: str, budget: int, length: int) -> str:
    return f"{policy}|{budget}|{length}"


def evaluate(models: Mapping[str, nn.Module], config: EvalConfig | None = None, *,
             task_cfg: Any = None, done: Mapping[str, dict] | None = None,
             on_row: Any = None, task: Any) -> dict:
    """Accuracy of every policy in ``models`` at every (budget, length) of ``config``.

    Args:
        models: policy name -> model from :func:`policy_model` (``"dense"`` -> the unpatched base).
            Policies of ``config.policies`` missing here are skipped; ``dense`` is required.
        config: :class:`EvalConfig`.
        done: rows already measured (key ``"policy|budget|length"`` -> row), reused as they are.
        on_row: called with each new row as soon as it is measured (e.g. to save progress).
        task: the task module measured on (``make_example``, ``test_seed``, ``valid_seed``, ``DEFAULT``,
            ``describe``: :mod:`kvpop.demo.task` or ``kvpop.demo.lookahead_task``); ``task_cfg`` defaults to its
            ``DEFAULT``.

    ``dms`` runs at one gate threshold per (budget, length), chosen on ``n_sequences`` *validation* sequences
    of that length (``task.valid_seed``): the largest at which their mean entries per layer and KV head at
    the last position is at most the budget (:func:`kvpop.baselines.dms.budget.calibrate_threshold` over the batch); the
    test sequences then run at it, and the row records it (``dms_threshold``) with the validation mean
    (``dms_valid_entries_mean``) and the test entries (mean, min and max over heads).
    ``dms-test-calibrated`` calibrates on each test sequence instead.

    Speed: run it with ``torch.set_num_threads(1)`` on a CPU.  The tiny model's ops are far too small
    for intra-op threads, and TOVA/H2O decode token by token (tens of small ops per token and layer):
    measured on a busy 2-core machine, one 2048-token TOVA sequence took 2.0 s with 1 thread and
    6-29 s with 2 threads (the threads wait for each other at every op).

    Returns:
        :func:`results_dict`'s dict (``rows`` with ``accuracy``, ``relative_accuracy``, ``correct``,
        ``graded``, ``n_sequences``; the policies scored sequence by sequence, every one but ``BATCHED``'s,
        also ``per_sequence_accuracy``, each sequence's own, for :func:`studies.paired.paired_interval`).
    """
    cfg = config or EvalConfig()
    task_cfg = task_cfg if task_cfg is not None else task.DEFAULT
    seed_of = task.valid_seed if cfg.split == "valid" else task.test_seed
    if "dense" not in models:
        raise ValueError("evaluate needs the dense model (models['dense']) for the relative accuracy")
    policies = [p for p in cfg.policies if p in models]
    _check_policies(models)
    done = dict(done or {})
    jobs = []
    for L in cfg.lengths:
        for p in policies:
            for b in ([L] if p == "dense" else cfg.budgets):
                if _row_key(p, b, L) not in done:
                    jobs.append((p, b, L))
    bar = eta = None
    if cfg.progress and jobs:
        from kvpop.progress import CostETA, progress

        bar = progress(len(jobs) * cfg.n_sequences, desc="kvpop eval", eta=False)
        eta = CostETA([(cost_kind(p), L * cfg.n_sequences) for p, _, L in jobs])  # tokens, by kind
        eta.start()
    rows = dict(done)
    examples: dict[int, list[dict]] = {}
    try:
        for p, b, L in jobs:
            extra: dict = {}
            thr = None
            if policy_of(p) == "dms":  # its memory knob, set on validation sequences and fixed for the test ones
                valid = torch.stack([task.make_example(task.valid_seed(cfg.first_seed + i), L, task_cfg)["input_ids"]
                                     for i in range(cfg.n_sequences)])
                thr = dms_calibrate(models[p], valid, b)
                extra = {"dms_threshold": thr, "dms_threshold_from": "validation",
                         "dms_valid_entries_mean": round(dms_mean_entries(models[p], valid, thr), 2)}
            if L not in examples:
                examples[L] = [task.make_example(seed_of(cfg.first_seed + i), L, task_cfg)
                               for i in range(cfg.n_sequences)]
            if bar is not None:
                bar.set_postfix_str(f"{p} B={b} L={L}, {eta.text()}")
            correct = graded = 0
            per_seq = None  # each sequence's own accuracy, for paired intervals (the per-sequence path)
            if policy_of(p) in BATCHED:
                correct, graded = batch_correct(models[p], examples[L], policy_of(p), b)
                if bar is not None:
                    eta.done(cost_kind(p), L * len(examples[L]))
                    bar.set_postfix_str(f"{p} B={b} L={L}, {eta.text()}")
                    bar.update(len(examples[L]))
            else:
                per_seq = []
                for ex in examples[L]:
                    c, g = sequence_correct(models[p], ex, policy_of(p), None if p == "dense" else b, threshold=thr)
                    correct, graded = correct + c, graded + g
                    per_seq.append(c / g if g else None)
                    if bar is not None:
                        eta.done(cost_kind(p), L)
                        bar.set_postfix_str(f"{p} B={b} L={L}, {eta.text()}")
                        bar.update(1)
            row = {"policy": p, "budget": int(b), "length": int(L), "accuracy": correct / graded,
                   "correct": correct, "graded": graded, "n_sequences": cfg.n_sequences,
                   **dms_row_stats(models[p]), **extra}
            if per_seq is not None:
                row["per_sequence_accuracy"] = per_seq
            rows[_row_key(p, b, L)] = row
            if on_row is not None:
                on_row(row)
    finally:
        if bar is not None:
            bar.close()
    return results_dict(list(rows.values()), cfg, task_cfg, task=task)


def results_dict(rows: list[dict], cfg: EvalConfig, task_cfg: Any = None,
                 extra: Mapping[str, Any] | None = None, *, task: Any) -> dict:
    """The ``results.json`` object: ``task``, ``train_len``, ``dense_accuracy`` (at ``train_len``, or at
    the first length when ``train_len`` is not among them), ``rows`` (sorted; each with
    ``relative_accuracy`` = accuracy / dense accuracy at the same length), plus settings."""
    task_cfg = task_cfg if task_cfg is not None else task.DEFAULT
    dense = {r["length"]: r["accuracy"] for r in rows if r["policy"] == "dense"}
    out_rows = []
    for r in sorted(rows, key=lambda r: (r["length"], row_order(r["policy"]), r["budget"])):
        r = dict(r)
        d = dense.get(r["length"])
        r["relative_accuracy"] = (r["accuracy"] / d) if d else None
        out_rows.append(r)
    ref_len = cfg.train_len if cfg.train_len in dense else (cfg.lengths[0] if cfg.lengths else None)
    res = {
        "task": task.describe(task_cfg),
        "split": cfg.split,
        "train_len": int(cfg.train_len),
        "dense_accuracy": float(dense.get(ref_len, float("nan"))),
        "dense_accuracy_by_length": {str(k): v for k, v in sorted(dense.items())},
        "budgets": list(cfg.budgets),
        "lengths": list(cfg.lengths),
        "sinks": cfg.sinks,
        "window": cfg.window,
        "n_sequences": cfg.n_sequences,
        "task_config": task_cfg.to_dict(),
        "rows": out_rows,
    }
    if extra:
        res.update(extra)
    return res


def format_table(results: dict) -> str:
    """A markdown table: one row per policy, one column per (length, budget); cells ``acc (rel %)``."""
    rows = results["rows"]
    lengths = sorted({r["length"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["policy"] != "dense"})
    cell = {(r["policy"], r["budget"], r["length"]): r for r in rows}
    train_len = results.get("train_len")
    with_trained = bool(results.get("trained"))
    head = ["policy"] + (["trained at"] if with_trained else [])
    if not budgets:  # dense alone: one column per length, the full cache
        budgets = [None]
    for L in lengths:
        for b in budgets:
            frac = f" ({100 * b / train_len:g}%)" if train_len and b else ""
            head.append(f"L={L} B={b}{frac}" if b else f"L={L} (full cache)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    pols = sorted({r["policy"] for r in rows}, key=row_order)
    for p in pols:
        line = [p] + ([trained_label(results, p)] if with_trained else [])
        for L in lengths:
            for b in budgets:
                r = cell.get((p, L if p == "dense" else b, L))
                if r is None:
                    line.append("-")
                elif p == "dense":
                    line.append(f"{r['accuracy']:.3f}")
                else:
                    rel = r.get("relative_accuracy")
                    line.append(f"{r['accuracy']:.3f} ({rel:.0%})" if rel is not None else f"{r['accuracy']:.3f}")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def trained_label(results: dict, policy: str) -> str:
    """What ``results['trained'][policy]`` (``kvpop eval``'s record of the runs) says the policy was trained
    at: ``B=96`` for a fixed-budget retrofit (``B=96 adaptive`` with head-adaptive budgets of mean 96),
    ``keep 0.125`` for DMS, ``-`` when unknown or untrained."""
    t = (results.get("trained") or {}).get(policy) or {}
    if "budget" in t:
        src = f" priority {t['priority_source']}" if t.get("priority_source") else ""  # a non-learned control
        return f"B={t['budget']}" + (" adaptive" if t.get("head_budgets") else "") + src
    if "target_keep" in t:
        return f"keep {t['target_keep']:g}"
    return "-"


def write_results(results: dict, path: str | os.PathLike) -> None:
    """Write ``results`` as JSON (atomically: :func:`kvpop.core.files.write_json`)."""
    write_json(path, results)


def write_outputs(results: dict, out: Path | None, plot: bool) -> None:
    """Print the table of ``results`` and, with ``out``, write ``results.json``, ``table.md`` and (``plot``)
    ``accuracy_vs_budget.png`` there (``kvpop eval``'s and ``kvpop demo``'s outputs)."""
    table = format_table(results)
    print(table)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_results(results, out / "results.json")
        (out / "table.md").write_text(table + "\n")
        if plot:
            plot_results(results, out / "accuracy_vs_budget.png")
        print(f"wrote {out / 'results.json'}" + (f" and {out / 'accuracy_vs_budget.png'}" if plot else ""))


def plot_results(results: dict, path: str | os.PathLike) -> None:
    """Accuracy vs budget PNG: one panel per length, one line per policy, dense as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    lengths = sorted({r["length"] for r in rows})
    policies = sorted({r["policy"] for r in rows}, key=row_order)
    colours = policy_colours(policies)
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.0 * len(lengths) + 3.4, 4.6), squeeze=False)
    train_len = results.get("train_len") or 1
    for ax, L in zip(axes[0], lengths):
        for p in policies:
            pts = sorted((r["budget"], r["accuracy"]) for r in rows if r["policy"] == p and r["length"] == L)
            if not pts:
                continue
            if p == "dense":
                ax.axhline(pts[0][1], color="black", linestyle="--", linewidth=1, label="dense")
                continue
            k = policy_of(p)
            style = ("--" if k in JOINT else "-" if k.startswith("kvpop") else ":" if k in ("tova", "h2o")
                     else "-.")
            ax.plot([b for b, _ in pts], [a for _, a in pts], style, marker="s" if k in JOINT else "o", label=p,
                    color=colours[p])
        bs = sorted({r["budget"] for r in rows if r["policy"] != "dense"})
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs)
        ax.set_xticklabels([f"{b}\n{100 * b / train_len:g}%" for b in bs])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("cache budget B (entries per KV head; % of L_train)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"length {L}" + (" (L_train)" if L == results.get("train_len") else
                                      f" ({L / train_len:g}x L_train)"))
        ax.grid(alpha=0.3)
    seen: dict[str, Any] = {}  # every policy of any panel, once, in the table's order
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    # outside the axes, right of the panels, one policy a line: every label visible however many there are
    fig.legend(list(seen.values()), list(seen), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9,
               frameon=False)
    fig.tight_layout()
    save_figure(fig, path, bbox_inches="tight")


def policy_colours(policies: list[str]) -> dict[str, Any]:
    """A colour per policy, no two alike (``tab10`` then ``Dark2``/``Set1``: 26 distinct colours; past that the
    line styles and markers still tell policies apart); dense is drawn black."""
    import matplotlib

    palette = [*matplotlib.colormaps["tab10"].colors, *matplotlib.colormaps["Dark2"].colors,
               *matplotlib.colormaps["Set1"].colors]
    others = [p for p in policies if p != "dense"]
    return {**{p: palette[i % len(palette)] for i, p in enumerate(others)}, "dense": "black"}


def save_figure(fig: Any, path: str | os.PathLike, *, dpi: int = 110, bbox_inches: str | None = None) -> None:
    """Save the matplotlib figure ``fig`` to ``path`` whole or not at all (:func:`kvpop.core.files.atomic_write`;
    the format from the suffix, PNG without one) and close it.  ``bbox_inches="tight"``: the saved image grows
    to hold what lies outside the axes (a legend beside the panels)."""
    import matplotlib.pyplot as plt

    fmt = Path(path).suffix[1:] or "png"
    try:
        atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format=fmt, bbox_inches=bbox_inches))
    finally:
        plt.close(fig)
