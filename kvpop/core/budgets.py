"""Head-adaptive budgets: how many long-range slots each (layer, KV head) gets, fixed at retrofit time.

``allocate`` shares the uniform total ``L * H * budget`` out in proportion to an importance score per
(layer, KV head); ``ablation_importance`` measures one such score (how much the model's next-token NLL
rises when one head loses its long-range slots); ``uniform`` is the method's own allocation.  The result
is ``KVpopConfig.head_budgets``.  The rule: docs/DESIGN.md section 7, "Head-adaptive budgets".
"""
from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import KVpopConfig, _int
from .layer import kvpop_layers
from .patching import patched

__all__ = ["allocate", "uniform", "ablation_importance"]


def uniform(L: int, H: int, budget: int) -> tuple[tuple[int, ...], ...]:
    """``head_budgets`` of ``L`` layers x ``H`` KV heads that all hold ``budget`` entries."""
    _int("L", L, 1)
    _int("H", H, 1)
    _int("budget", budget, 1)
    return ((budget,) * H,) * L


def _scores_array(scores: Any) -> np.ndarray:
    """``scores`` as a float64 ``[L, H]`` array (TypeError / ValueError naming what is wrong)."""
    if isinstance(scores, torch.Tensor):
        if scores.is_complex() or scores.dtype == torch.bool:
            raise TypeError(f"scores must be a real [L, H] tensor, got dtype {scores.dtype}")
        arr = scores.detach().to(device="cpu", dtype=torch.float64).numpy()
    else:
        try:
            arr = np.asarray(scores)
        except Exception as e:
            raise TypeError(f"scores must be an [L, H] tensor, array or nested sequence of numbers, got "
                            f"{type(scores).__name__}: {e}") from None
        if arr.dtype.kind not in "iuf":
            raise TypeError(f"scores must hold real numbers, got an array of dtype {arr.dtype} "
                            f"({type(scores).__name__})")
        arr = arr.astype(np.float64)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"scores must be [L, H] (one score per layer and KV head), got shape {tuple(arr.shape)}")
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        li, h = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"scores must be finite and >= 0, got {float(arr[li, h])!r} at layer {li}, head {h} "
                         f"({int(bad.sum())} such entries)")
    return arr


def _water_fill(s: list[Fraction], units: int, floor: int) -> list[Fraction]:
    """Exact shares ``x_i = max(floor, c * s_i)`` with ``sum x_i = units`` (``units >= len(s) * floor``);
    equal shares when every score is 0."""
    n = len(s)
    if sum(s) == 0:
        return [Fraction(units, n)] * n
    floored: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in floored]
        c = Fraction(units - floor * len(floored)) / sum(s[i] for i in free)
        low = {i for i in free if c * s[i] < floor}
        if not low:
            return [Fraction(floor) if i in floored else c * s[i] for i in range(n)]
        floored |= low


def _largest_remainder(x: list[Fraction], units: int) -> list[int]:
    """Integers ``floor(x_i)`` plus one unit each for the largest remainders until they sum to ``units``;
    equal remainders go to the lower index (layer-major order: layer, then head)."""
    base = [int(v.numerator // v.denominator) for v in x]
    rest = units - sum(base)
    order = sorted(range(len(x)), key=lambda i: (-(x[i] - base[i]), i))
    for i in order[:rest]:
        base[i] += 1
    return base


def allocate(scores: Any, *, total: int, sinks: int, window: int, min_k: int = 0,
             granularity: int = 1) -> tuple[tuple[int, ...], ...]:
    """``head_budgets`` with exactly ``total`` entries, long-range slots in proportion to ``scores``.

    Args:
        scores: non-negative importance per (layer, KV head), ``[L, H]`` (tensor, array or nested lists).
        total: the uniform total ``L * H * budget`` (a multiple of ``L * H``).
        sinks, window: ``s`` and ``w``, shared by every head; each budget is ``s + w + k[l][h]``.
        min_k: the fewest long-range slots a head gets (default 0: a head may keep sinks and window only).
        granularity: every ``k[l][h]`` is a multiple of it (default 1); ``min_k`` and the slots to share,
            ``total - L*H*(s + w)``, must be multiples too.

    Rule: the ``K = total - L*H*(s + w)`` slots, in units of ``granularity``, are shared as
    ``x[l][h] = max(min_k, c * scores[l][h])`` with ``c`` such that they sum to ``K`` (so heads above
    the floor get slots exactly in proportion to their score; all-zero scores share equally), computed
    in exact rational arithmetic; then each head gets ``floor(x)`` units and the units left over go to
    the largest remainders, equal remainders to the lower (layer, head) index.  Deterministic: the same
    scores give the same budgets on every machine.  Returns a tuple (per layer) of tuples (per KV head)
    of budgets, for ``KVpopConfig(budget=total // (L*H), head_budgets=...)``.
    """
    arr = _scores_array(scores)
    L, H = arr.shape
    n = L * H
    _int("total", total, 1)
    _int("sinks", sinks, 0)
    _int("window", window, 1)
    _int("min_k", min_k, 0)
    _int("granularity", granularity, 1)
    if total % n:
        raise ValueError(f"total must be the uniform total L * H * budget, a multiple of L * H = {L} * {H} = {n}; "
                         f"got {total} (budget {total / n:.4g})")
    K = total - n * (sinks + window)
    if K < n * min_k:
        raise ValueError(f"total={total} leaves {K} long-range slots for {n} heads after sinks + window = "
                         f"{sinks + window} each; min_k={min_k} needs {n * min_k} (a budget of at least "
                         f"{sinks + window + min_k} per head on average)")
    if min_k % granularity or K % granularity:
        raise ValueError(f"granularity={granularity} must divide min_k={min_k} and the slots to share, "
                         f"total - L*H*(sinks + window) = {K}")
    units = K // granularity
    shares = _water_fill([Fraction(float(v)) for v in arr.flat], units, min_k // granularity)
    ks = _largest_remainder(shares, units)
    return tuple(tuple(sinks + window + ks[li * H + h] * granularity for h in range(H)) for li in range(L))


# ------------------------------------------------------------------------------------------ importance
def _check_batches(batches: Iterable[Any]) -> list[torch.Tensor]:
    out = []
    for i, ids in enumerate(batches):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"batches[{i}] must be a tensor of token ids [B, S], got {type(ids).__name__}")
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() not in (1, 2) or ids.shape[-1] < 2 \
                or ids.numel() == 0:
            raise ValueError(f"batches[{i}] must be int64/int32 token ids [B, S] (or [S]) with S >= 2, got "
                             f"{ids.dtype} {tuple(ids.shape)}")
        out.append(ids if ids.dim() == 2 else ids[None])
    if not out:
        raise ValueError("batches is empty: give at least one batch of validation token ids [B, S]")
    return out


def _mean_nll(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Teacher-forced next-token NLL, the mean over every predicted token of every batch (float64 sums)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            ids = ids.to(device=device, dtype=torch.long)
            logits = model(ids).logits[:, :-1].float()
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                           reduction="sum").double())
            count += ids[:, 1:].numel()
    return total / count


def ablation_importance(model: nn.Module, batches: Iterable[torch.Tensor], *, config: KVpopConfig) -> torch.Tensor:
    """Importance of each (layer, KV head)'s long-range slots: float64 ``[L, H]``, ``>= 0``.

    Entry ``[l, h]`` is how much the model's mean next-token NLL (teacher-forced, over every predicted
    token of ``batches``) rises when head ``h`` of layer ``l`` alone keeps no long-range slot (``k = 0``:
    sinks and window only) while every other head keeps ``config.k``, over the same model with every
    head at ``config.k``; a fall counts as 0.  The model runs patched with ``config`` at its uniform
    budget (``config.head_budgets`` is not used) and its current scorers: a model patched with a
    structurally equal config keeps its trained scorers (its own config is restored after); an unpatched
    model is patched for the measurement (fresh scorers, so the mask is that of an untrained scorer, or of
    ``config.mask_source``) and unpatched after.  ``batches``: validation token ids, each ``[B, S]`` (no
    padding; ``S`` above ``config.budget``, or nothing is evicted and every entry is 0).  ``L * H + 1``
    forwards under ``torch.no_grad()`` in eval mode (the model's mode is restored); deterministic where the
    forward is.  Feed the result to :func:`allocate`.
    """
    if not isinstance(config, KVpopConfig):
        raise TypeError(f"config must be a kvpop.KVpopConfig, got {type(config).__name__}")
    ids = _check_batches(batches)
    base = config.replace(head_budgets=None) if config.head_budgets is not None else config
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with patched(model, base):
            layers = kvpop_layers(model)
            heads = {layer.num_kv_heads for layer in layers}
            if len(heads) != 1:
                raise ValueError(f"ablation_importance needs the same number of KV heads in every layer, got "
                                 f"{sorted(heads)}")
            H = heads.pop()
            baseline = _mean_nll(model, ids, device)
            out = torch.zeros(len(layers), H, dtype=torch.float64)
            for li, layer in enumerate(layers):
                for h in range(H):
                    layer.k_override = tuple(0 if j == h else base.k for j in range(H))
                    try:
                        out[li, h] = max(0.0, _mean_nll(model, ids, device) - baseline)
                    finally:
                        layer.k_override = None
    finally:
        model.train(was_training)
    return out
