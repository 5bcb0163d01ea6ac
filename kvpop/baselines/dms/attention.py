"""The ``"kvpop_dms"`` attention function: the relaxed mask in training, hard gates otherwise, the
:class:`~kvpop.baselines.dms.cache.DMSCache` when the model is called with one."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kvpop_kernels
from kvpop.core.attention import autocast_inputs, register_attention

from .cache import DMSCache, cache_attention
from .gates import DMSLayer, dms_attention, gate_evict_at, gumbel_sigmoid, logistic_noise

__all__ = ["DMS_ATTN_NAME", "register", "dms_attention_forward"]

DMS_ATTN_NAME = "kvpop_dms"


def register() -> None:
    register_attention(DMS_ATTN_NAME, dms_attention_forward)


def dms_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"kvpop_dms"`` attention function: relaxed mask in training, hard gates otherwise, or the
    :class:`DMSCache` when the model is called with one.  Returns ``(out [B, S, Hq, D], None)``."""
    layer = getattr(module, "dms", None)
    if not isinstance(layer, DMSLayer):
        raise RuntimeError(f"attention implementation {DMS_ATTN_NAME!r} is set but {type(module).__name__} carries "
                           f"no DMSLayer: use kvpop.baselines.dms.patch_dms(model)")
    hidden, layer.hidden = layer.hidden, None
    cache, layer.active_cache = layer.active_cache, None
    # the mask is checked once per sequence: a DMSCache past its prefill only appends real tokens (and
    # the check reads the mask back to the host, which a decode step must not)
    decoding = (isinstance(cache, DMSCache) and module.layer_idx < len(cache.layers)
                and cache.layers[module.layer_idx].seen > 0)
    if attention_mask is not None and not decoding and (attention_mask.dim() != 2
                                                         or not bool(attention_mask.bool().all())):
        raise ValueError("DMS attention supports no padding or custom masks; pass equal-length rows or batch 1")
    if dropout:
        raise ValueError(f"DMS attention has no attention dropout; got dropout={dropout}")
    if hidden is None or hidden.shape[:2] != (query.shape[0], query.shape[2]):
        raise RuntimeError(f"DMS: the input of attention layer {layer.layer_idx} was not captured "
                           f"(got {None if hidden is None else tuple(hidden.shape)})")
    cfg = layer.config
    query, key, value = autocast_inputs(query, key, value)  # --bf16: q/k float32 beside a bf16 v, as in KVpop's
    logits = layer.logits(hidden)  # [B, Hkv, S_new]
    if isinstance(cache, DMSCache):
        out = cache_attention(cache, module, query, key, value, logits, scaling, kwargs.get("position_ids"))
        if out is not None:
            return out, None
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError("DMS attention got fewer queries than keys: decode with kvpop.baselines.dms.DMSCache")
    S = query.shape[2]
    t = torch.arange(S, device=query.device)
    old = t >= cfg.sinks
    layer.last_logits = logits.detach()
    if module.training and torch.is_grad_enabled():
        noise = logistic_noise(tuple(logits.shape), device=logits.device, generator=layer.generator)
        soft, _, hard = gumbel_sigmoid(logits, cfg.tau, noise)
        log_keep = torch.where(old, F.logsigmoid(-soft), torch.zeros((), device=query.device))
        layer.last_evict = hard * old
        out = dms_attention(query, key, value, log_keep, sinks=cfg.sinks, window=cfg.window, scale=scaling)
    else:
        evict = (logits > cfg.threshold) & old
        layer.last_evict = evict.float()
        ev = gate_evict_at(evict, sinks=cfg.sinks, window=cfg.window)
        out, _ = kvpop_kernels.sparse_attention(query, key, value, ev, sinks=cfg.sinks, window=cfg.window,
                                                scale=scaling)
    return out.transpose(1, 2).contiguous(), None

