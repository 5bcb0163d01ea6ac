"""The scorer's loss ``L_score`` from the label's keep/drop decisions (:func:`score_loss_terms` per layer,
:func:`score_loss`).  The label is the target ``r_tgt`` of ``KVpopConfig.target_source``: by default the
student's own (the model being trained), the frozen teacher's with ``target_source="teacher"``.

The loss and its weights (near-tie discount, keep/drop balance): docs/DESIGN.md section 3.  The
distillation KL lives in ``kvpop.core.distill`` and is re-exported here.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import kvpop_kernels

from .distill import (
    TeacherTopK,
    distill_loss,
    fused_distill_loss,
    fused_output_head,
    fused_teacher_topk,
    teacher_topk,
)
from .layer import kvpop_layers
from .priority import priority
from .scorers import float32_scoring

__all__ = ["score_loss_terms", "score_loss", "score_stats", "distill_loss", "teacher_topk", "TeacherTopK",
           "fused_distill_loss", "fused_teacher_topk", "fused_output_head"]


@float32_scoring
def score_loss_terms(r_hat: torch.Tensor, r_tgt: torch.Tensor, log_gamma: torch.Tensor, *, sinks: int,
                     window: int, k: int | Sequence[int] | torch.Tensor, tau: float = 1.0, tie_margin: float = 0.5,
                     balance: bool = True) -> dict[str, torch.Tensor]:
    """One layer's ``L_score`` terms.

    Args:
        r_hat: scorer output ``[B, Hkv, S]`` (float, with grad).
        r_tgt: target ``[B, Hkv, S]`` float32 (``future_attention_target``; no grad).
        log_gamma: ``log(gamma_h)`` ``[Hkv]`` float32 (with grad).
        sinks, window, k: the cache shape; ``k`` an int or one per KV head (head-adaptive budgets: each
            head's decisions with its own ``k[h]``, as ``kvpop_kernels.eviction_decisions`` takes it);
            tau, tie_margin, balance: see the module docstring.

    Returns a dict of 0-d tensors: ``loss_sum`` (``sum omega * softplus``, differentiable),
    ``n`` (decisions), ``n_keep`` (``y = +1``), ``n_correct`` (decisions where ``sign(delta) == y``)
    and ``weight_sum`` (``sum omega``).
    """
    if r_hat.shape != r_tgt.shape or r_hat.dim() != 3 or log_gamma.shape != (r_hat.shape[1],):
        raise ValueError(f"need r_hat, r_tgt [B, Hkv, S] and log_gamma [Hkv]; got {tuple(r_hat.shape)}, "
                         f"{tuple(r_tgt.shape)}, {tuple(log_gamma.shape)}")
    S = r_hat.shape[-1]
    dev = r_hat.device
    t = torch.arange(S, device=dev)
    lg_d = log_gamma.detach().float()
    with torch.no_grad():
        p_tgt = priority(r_tgt, t, lg_d)
        y, bnd = kvpop_kernels.eviction_decisions(p_tgt.contiguous(), sinks=sinks, window=window, k=k)
        dec = y != 0
        yf = y.float()
        bnd_c = bnd.long().clamp(min=0)
        n = dec.sum()
        n_keep = (y > 0).sum()
        if tie_margin > 0:
            margin = (p_tgt - p_tgt.gather(-1, bnd_c)).abs()
            tie = -torch.expm1(-margin / tie_margin)
        else:
            tie = torch.ones_like(p_tgt)
        if balance:
            n_drop = n - n_keep
            nf = n.float()
            w_keep = torch.where(n_keep > 0, nf / (2 * n_keep.clamp(min=1).float()), nf.new_ones(()))
            w_drop = torch.where(n_drop > 0, nf / (2 * n_drop.clamp(min=1).float()), nf.new_ones(()))
            if bool(n_keep == 0) or bool(n_drop == 0):
                w_keep = w_drop = nf.new_ones(())
            bal = torch.where(y > 0, w_keep, w_drop)
        else:
            bal = torch.ones_like(p_tgt)
        omega = torch.where(dec, tie * bal, torch.zeros_like(p_tgt))
    r = r_hat.float()
    delta = (r - r.gather(-1, bnd_c)) + (bnd_c - t).float() * log_gamma.float()[:, None]
    per = F.softplus(-yf * delta / tau)
    loss_sum = (omega * per).sum()
    with torch.no_grad():
        n_correct = (dec & (torch.sign(delta) == yf)).sum()
    return {"loss_sum": loss_sum, "n": n, "n_keep": n_keep, "n_correct": n_correct, "weight_sum": omega.sum()}


def _layers(model: torch.nn.Module):
    return kvpop_layers(model)


def score_loss(model: torch.nn.Module, *, reset: bool = True) -> torch.Tensor:
    """``L_score`` of the last training forward of a patched model: pooled mean over every layer's decisions.

    Returns a 0-d float32 tensor (``0`` without grad when no layer made a decision, e.g. ``S <= budget``
    or an eval/no-grad forward).  ``reset=True`` drops the stored terms (and their graphs) afterwards,
    so call it once per forward, after the forward and before the next one.
    """
    total, n = None, 0
    for layer in _layers(model):
        terms = layer.loss_terms
        if terms is None:
            continue
        total = terms["loss_sum"] if total is None else total + terms["loss_sum"]
        n += int(terms["n"])
        if reset:
            layer.loss_terms = None
    if total is None or n == 0:
        return torch.zeros((), dtype=torch.float32)
    return total / n


def score_stats(model: torch.nn.Module) -> dict[str, Any]:
    """Diagnostics of the last training forward (call before ``score_loss(reset=True)``).

    ``decisions``, ``keep_frac`` (share of the label's keeps), ``accuracy`` (the scorer's ranking agrees
    with the label's decision), ``gamma_min``/``gamma_max`` over all KV heads of all layers.
    """
    n = keep = corr = 0
    gam = []
    for layer in _layers(model):
        gam.append(layer.gamma().detach())
        if layer.loss_terms is None:
            continue
        n += int(layer.loss_terms["n"])
        keep += int(layer.loss_terms["n_keep"])
        corr += int(layer.loss_terms["n_correct"])
    g = torch.cat(gam) if gam else torch.zeros(1)
    return {"decisions": n, "keep_frac": keep / n if n else float("nan"),
            "accuracy": corr / n if n else float("nan"),
            "gamma_min": float(g.min()), "gamma_max": float(g.max())}
