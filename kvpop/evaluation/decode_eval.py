"""The reads measured by real decoding: the sequence fed to the cache one token at a time, as ``generate`` does.

:func:`kvpop.evaluation.evaluate.evaluate` reads the learned policies' accuracy from one teacher-forced call per
sequence: the cache's prefill, which runs ``sparse_attention`` with the policy's eviction schedule.  That
prefill equals prefill + token-by-token decoding by design; this module checks the claim on the demo's own
test sequences.  :func:`decode_predictions` prefills only the first ``prompt`` tokens (default: the sinks,
before any eviction) and then decodes every later token in its own call (``model(ids[:, t:t+1],
past_key_values=cache)``: one ``fixed_budget_decode`` step per layer, the scorer's per-token path, the
cache's slot replacement), all sequences of a length as one batch (DMS: one at a time, its cache holds one
sequence); the greedy prediction of each position is what greedy generation from the same prefix would
emit.  :func:`decode_check` grades both ways on the same sequences and counts the graded positions whose
predictions differ.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvpop.core.budgets import rebudget
from kvpop.core.cache import KVpopCache
from kvpop.core.patching import get_config, is_patched
from kvpop.models import cache_kwarg_name

__all__ = ["decode_predictions", "decode_check", "DECODE_POLICIES"]

DECODE_POLICIES = ("kvpop-mlp", "kvpop-mlstm", "kvpop-mlp-joint", "kvpop-mlstm-joint", "dms")
"""The learned eviction policies the demo checks by decoding (the cost of decoding every test sequence token
by token keeps it to these: fixed-finetune evicts by the fixed pattern, and the joint retrofits' other-label
rows share their code path)."""


def _check_prompt(prompt: int, length: int) -> None:
    if isinstance(prompt, bool) or not isinstance(prompt, int) or not 1 <= prompt <= length:
        raise ValueError(f"prompt must be an int in [1, {length}] (the sequence length), got {prompt!r}")


@torch.no_grad()
def _decode_kvpop(model: nn.Module, ids: torch.Tensor, cache_policy: str, prompt: int) -> torch.Tensor:
    cache = KVpopCache(model, policy=cache_policy)
    kw = {cache_kwarg_name(): cache}
    n, L = ids.shape
    pred = torch.empty(n, L, dtype=torch.long, device=ids.device)
    pred[:, :prompt] = model(ids[:, :prompt], use_cache=True, **kw).logits.argmax(-1)
    for t in range(prompt, L):  # generation: one call per token (no host read inside)
        pred[:, t] = model(ids[:, t:t + 1], use_cache=True, **kw).logits[:, -1].argmax(-1)
    return pred


@torch.no_grad()
def _decode_dms(model: nn.Module, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    from kvpop.baselines import dms as D

    rows = []
    for row in ids:  # DMSCache holds one sequence
        cache = D.DMSCache(model)
        kw = {cache_kwarg_name(): cache}
        r = row[None]
        pred = torch.empty(r.shape[1], dtype=torch.long, device=ids.device)
        pred[:prompt] = model(r[:, :prompt], use_cache=True, **kw).logits[0].argmax(-1)
        for t in range(prompt, r.shape[1]):
            pred[t] = model(r[:, t:t + 1], use_cache=True, **kw).logits[0, -1].argmax(-1)
        rows.append(pred)
    return torch.stack(rows)


@torch.no_grad()
def decode_predictions(model: nn.Module, ids: torch.Tensor, policy: str, budget: int | None = None, *,
                       prompt: int | None = None, threshold: float | None = None) -> torch.Tensor:
    """Greedy predictions ``[n, L]`` of ``ids`` (``[n, L]`` or ``[L]``, one length) decoded token by token.

    ``model`` is :func:`kvpop.evaluation.evaluate.policy_model`'s model for ``policy`` (a kvpop-patched model
    for the fixed-budget policies, re-budgeted to ``budget`` when given; a DMS-patched one for ``dms``,
    decoded at gate ``threshold``, default its configured one).  ``prompt``: tokens prefilled in one call
    before decoding (default: the sinks, so that every eviction decision is taken by a decode step).
    Position ``t`` holds the prediction of token ``t + 1``."""
    from .evaluate import CACHE_POLICY, POLICIES

    if policy not in POLICIES or policy == "dense":
        raise ValueError(f"decode_predictions decodes a non-dense policy of {list(POLICIES)}, got {policy!r}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids must be [n, L] (or [L]) token ids, got shape {tuple(ids.shape)}")
    ids = ids.to(next(model.parameters()).device)
    if policy in ("dms", "dms-test-calibrated"):
        from kvpop.baselines import dms as D

        if not D.is_dms_patched(model):
            raise ValueError("the dms policy needs a DMS-patched model (see kvpop.evaluation.evaluate.policy_model)")
        if threshold is not None:
            D.patch_dms(model, threshold=float(threshold))
        p = max(1, D.get_dms_config(model).sinks) if prompt is None else prompt
        _check_prompt(p, ids.shape[1])
        return _decode_dms(model, ids, p)
    if not is_patched(model):
        raise ValueError(f"policy {policy!r} needs a kvpop-patched model (see kvpop.evaluation.evaluate.policy_model)")
    if budget is not None and get_config(model).budget != budget:
        rebudget(model, int(budget))
    p = max(1, get_config(model).sinks) if prompt is None else prompt
    _check_prompt(p, ids.shape[1])
    return _decode_kvpop(model, ids, CACHE_POLICY[policy], p)


def decode_check(model: nn.Module, examples: Sequence[dict], policy: str, budget: int, *,
                 prompt: int | None = None, threshold: float | None = None) -> dict:
    """The graded reads of ``examples`` (one length) under ``policy`` at ``budget``, twice: from the one-call
    prefill (:func:`kvpop.evaluation.evaluate.sequence_predictions`; DMS at the fixed gate ``threshold``) and from
    token-by-token decoding (:func:`decode_predictions`).  Returns ``prefill_correct``, ``decode_correct``,
    ``graded``, both accuracies and ``differ`` (graded positions whose two predictions differ)."""
    from .evaluate import sequence_predictions

    if not examples:
        raise ValueError("decode_check needs at least one example")
    ids = torch.stack([ex["input_ids"].reshape(-1) for ex in examples])
    if policy in ("dms", "dms-test-calibrated") and threshold is None:
        raise ValueError("decoding DMS needs its fixed gate threshold (threshold=), e.g. the one chosen on validation")
    dec = decode_predictions(model, ids, policy, budget, prompt=prompt, threshold=threshold)
    pc = dc = graded = differ = 0
    for i, ex in enumerate(examples):
        pos = ex["answer_positions"].reshape(-1).to(dec.device)
        ans = ex["answers"].reshape(-1).to(dec.device)
        pre = sequence_predictions(model, ex, policy, budget, threshold=threshold)
        d = dec[i, pos]
        pc += int((pre == ans).sum())
        dc += int((d == ans).sum())
        differ += int((pre != d).sum())
        graded += int(ans.numel())
    return {"policy": policy, "budget": int(budget), "length": int(ids.shape[1]), "n_sequences": len(examples),
            "graded": graded, "prefill_correct": pc, "decode_correct": dc, "prefill_accuracy": pc / graded,
            "decode_accuracy": dc / graded, "differ": differ,
            **({"dms_threshold": float(threshold)} if threshold is not None else {})}
