"""DMS at a matched mean budget: its policy model, its gate threshold and its logits (the evaluation harness).

DMS has no budget: each KV head keeps the tokens its gates keep, so its cache grows with the sequence
and differs between heads.  Its memory knob is the hard-gate threshold (``evict = logit > threshold``,
one number for all layers and heads).  To compare it with the fixed-budget policies at budget ``B`` it is
run at the same **mean** budget: :func:`calibrate_threshold` finds the largest threshold at which the mean
over sequences, layers and KV heads of the entries held at the last position (sinks + window + the kept
long-range tokens) is at most ``B`` -- the peak memory of the fixed-budget policies (a fixed point of
sorting the gate logits of one forward and re-running, usually 2-3 forwards; tokens with equal logits
go together, so the mean can land a little under ``B``).  The harness (``kvpop.evaluation.evaluate``) sets it
on the *validation* sequences of each length and budget and keeps it fixed for the test sequences (policy
``dms``), as a user of DMS would; calibrating on each test sequence itself (``dms-test-calibrated``, a
look at the test data no other policy gets) is kept only as a labelled second row.  Which tokens are
evicted stays the gates' causal decision.  A sequence goes through a :class:`~kvpop.baselines.dms.DMSCache` in
one call (its prefill is the teacher-forced hard-gate forward), and the row records the entries actually
held: the mean, and the spread over heads (:func:`row_stats`).
"""
from __future__ import annotations

import copy
import os

import torch
from torch import nn

from kvpop.models import cache_kwarg_name

from .cache import DMSCache
from .checkpoint import GATES, load_dms, read_dms_config
from .gates import dms_layers
from .patching import get_dms_config, is_dms_patched, patch_dms, unpatch_dms

__all__ = ["dms_policy_model", "calibrate_threshold", "dms_logits", "row_stats", "entries_by_position", "mean_entries",
           "GATES", "RANGES"]

_LOG = "_kvpop_dms_eval_log"
RANGES = 4
"""Position ranges of :func:`row_stats`' ``dms_entries_by_range`` (quarters of the sequence)."""
_BRACKET = 64.0
_ITERS = 12


def dms_policy_model(model: nn.Module, gates: str | os.PathLike, *, sinks: int, window: int) -> nn.Module:
    """A DMS-patched copy of ``model`` (the DMS-trained weights) with the gates of ``gates``, in eval mode.

    ``sinks`` and ``window`` must be the ones the gates were trained with (the window is the eviction
    delay the model learned to live with); another value raises ``ValueError``."""
    cfg = read_dms_config(gates)
    if (cfg.sinks, cfg.window) != (sinks, window):
        raise ValueError(f"the DMS gates in {gates} were trained with sinks={cfg.sinks}, window={cfg.window}; "
                         f"evaluate with the same (got sinks={sinks}, window={window})")
    m = copy.deepcopy(model)
    unpatch_dms(m)
    load_dms(m, gates)
    return m.eval()


def _kept_logits(model: nn.Module, ids: torch.Tensor, threshold: float) -> tuple[torch.Tensor, int, int]:
    """One teacher-forced hard-gate forward of ``ids`` (``[n, S]``, one length) at ``threshold``: the gate
    logits of every token that has left the window by the last position, over all sequences, layers and
    heads (flat), the entries every head holds anyway (sinks + window) and the number of (sequence,
    layer, head) triples."""
    patch_dms(model, threshold=threshold)
    model(ids, use_cache=False)
    cfg = get_dms_config(model)
    S = ids.shape[1]
    layers = dms_layers(model)
    left = [la.last_logits[:, :, cfg.sinks:max(cfg.sinks, S - cfg.window)].reshape(-1) for la in layers]
    return torch.cat(left), min(S, cfg.sinks + cfg.window), ids.shape[0] * len(layers) * layers[0].num_kv_heads


@torch.no_grad()
def mean_entries(model: nn.Module, ids: torch.Tensor, threshold: float) -> float:
    """The mean over sequences, layers and KV heads of the entries DMS holds after ``ids`` (``[n, S]`` or ``[S]``)
    at gate ``threshold`` (one teacher-forced hard-gate forward)."""
    logits, fixed, heads = _kept_logits(model, ids if ids.dim() == 2 else ids[None], threshold)
    return fixed + int((logits <= threshold).sum()) / heads


def _threshold_for(logits: torch.Tensor, fixed: int, heads: int, budget: int) -> tuple[float, float]:
    """With these logits fixed: the largest threshold keeping (``logit <= threshold``) at most
    ``budget`` entries per head on average, and the mean entries it gives."""
    allowed = int(budget * heads) - fixed * heads  # long-range tokens all heads together may keep
    v = torch.sort(logits.float()).values
    n = v.numel()
    if allowed >= n:
        return _BRACKET, fixed + n / heads
    if allowed <= 0:
        return float(v[0]) - 1.0, float(fixed)
    lo, hi = float(v[allowed - 1]), float(v[allowed])
    thr = 0.5 * (lo + hi) if hi > lo else lo - 1e-6  # ties: keep fewer rather than more
    return thr, fixed + int((v <= thr).sum()) / heads


@torch.no_grad()
def calibrate_threshold(model: nn.Module, ids: torch.Tensor, budget: int) -> float:
    """The largest gate threshold at which the mean entries per head after ``ids`` are ``<= budget``.

    ``ids``: ``[S]``, ``[1, S]`` or a batch ``[n, S]`` of one length, whose mean over sequences, layers and KV
    heads is meant (the demo calibrates DMS on its validation sequences so, then fixes the threshold for the
    test sequences).  A fixed-point iteration from threshold 0 (the training's decision boundary, whatever
    threshold the model was left at: nothing carries over between calls): one teacher-forced forward gives
    every gate logit, sorting them gives the threshold that keeps exactly the allowed number of tokens,
    and the next forward (whose later layers see the new evictions) checks it; usually 2-3 forwards.  If
    it does not settle in 4, a bisection over ``[-64, 64]`` (12 halvings) finishes."""
    if ids.dim() == 1:
        ids = ids[None]
    thr = 0.0
    for _ in range(4):
        logits, fixed, heads = _kept_logits(model, ids, thr)
        kept = fixed + int((logits <= thr).sum()) / heads
        new, best = _threshold_for(logits, fixed, heads, budget)
        if best <= kept <= budget:  # nothing more fits under these logits
            return thr
        thr = new
    logits, fixed, heads = _kept_logits(model, ids, thr)
    if fixed + int((logits <= thr).sum()) / heads <= budget:
        return thr
    lo, hi = -_BRACKET, _BRACKET
    for _ in range(_ITERS):
        mid = 0.5 * (lo + hi)
        logits, fixed, heads = _kept_logits(model, ids, mid)
        if fixed + int((logits <= mid).sum()) / heads <= budget:
            lo = mid
        else:
            hi = mid
    return lo


@torch.no_grad()
def dms_logits(model: nn.Module, ids: torch.Tensor, budget: int | None = None, *,
               threshold: float | None = None) -> torch.Tensor:
    """Logits ``[1, L, V]`` of one sequence under DMS through a ``DMSCache``, at gate ``threshold`` (fixed, e.g.
    chosen on validation sequences), or, without one, at the threshold calibrated on this sequence to mean
    budget ``budget`` (module docstring); the entries held per head are logged for :func:`row_stats`."""
    if not is_dms_patched(model):
        raise ValueError("the dms policy needs a DMS-patched model (see dms_policy_model)")
    if ids.dim() == 1:
        ids = ids[None]
    if threshold is None and budget is None:
        raise ValueError("dms_logits needs the mean budget to calibrate at (budget=) or a fixed threshold=")
    thr = calibrate_threshold(model, ids, budget) if threshold is None else float(threshold)
    patch_dms(model, threshold=thr)
    cache = DMSCache(model)
    logits = model(ids, **{cache_kwarg_name(): cache}).logits
    ent = cache.head_entries().float()
    log = model.__dict__.setdefault(_LOG, [])
    by_pos = entries_by_position(cache)
    ranges = []
    for r in range(RANGES):  # each head's mean over the range's positions, then the spread over heads
        lo, hi = r * by_pos.shape[1] // RANGES, (r + 1) * by_pos.shape[1] // RANGES
        per_head = by_pos[:, lo:max(hi, lo + 1)].float().mean(1)
        ranges.append((float(per_head.mean()), float(per_head.min()), float(per_head.max())))
    log.append({"threshold": thr, "mean": float(ent.mean()), "min": float(ent.min()), "max": float(ent.max()),
                "std": float(ent.std()), "ranges": ranges})
    return logits


def entries_by_position(cache: DMSCache) -> torch.Tensor:
    """Entries each (layer, KV head) held after each position of the sequence a :class:`DMSCache` has seen:
    int64 ``[layers * Hkv, L]``, row ``layer * Hkv + h``.  After position ``p`` a head holds the sinks and
    window tokens seen, ``min(p + 1, s + w)``, plus the long-range tokens it kept that had left the window,
    ``s <= t < p + 1 - w`` (a token's gate decision does not change later, so these are the cache's kept
    tokens below that position).  Its last column is ``cache.head_entries()``."""
    rows = []
    for layer in cache.layers:
        s, w, n = layer.sinks, layer.window, layer.seen
        pos = torch.arange(n, dtype=torch.int64)
        kept = layer.long_positions()  # per head, in order
        longest = max((len(k) for k in kept), default=0)
        table = torch.full((len(kept), longest + 1), n + w + 1, dtype=torch.int64)  # padding past every bound
        for h, k in enumerate(kept):
            table[h, :len(k)] = torch.tensor(k, dtype=torch.int64)
        left = (pos + 1 - w).expand(len(kept), n).contiguous()
        rows.append((pos + 1).clamp(max=s + w) + torch.searchsorted(table, left))
    return torch.cat(rows)


def row_stats(model: nn.Module) -> dict:
    """Summary of the sequences evaluated since the last call (then forgotten): the entries DMS held per
    head at the last position, mean / min / max / std over heads (each averaged over sequences); per
    position range (``dms_entries_by_range``: the sequence cut in :data:`RANGES` equal ranges of
    positions) each head's mean entries over the range, mean / min / max over heads (DMS's budget is
    matched at the last position; it holds fewer entries earlier); and the mean calibrated threshold.
    ``{}`` for a model that logged nothing."""
    log = model.__dict__.pop(_LOG, None)
    if not log:
        return {}
    n = len(log)
    out = {f"dms_entries_{k}": round(sum(r[k] for r in log) / n, 2) for k in ("mean", "min", "max", "std")}
    out["dms_entries_by_range"] = [
        {"from": r / RANGES, "to": (r + 1) / RANGES,
         **{k: round(sum(x["ranges"][r][i] for x in log) / n, 2) for i, k in enumerate(("mean", "min", "max"))}}
        for r in range(RANGES)]
    out["dms_threshold"] = round(sum(r["threshold"] for r in log) / n, 3)
    return out
