"""``KVpopLayer``: the parameters kvpop adds to one attention layer (a scorer and the per-head decay).

``kvpop.patch`` attaches one to every attention module of a supported family as the submodule
``kvpop`` (so the scorers appear in ``state_dict()`` under ``...self_attn.kvpop.``).  The semantics
of the priorities it computes are in ``docs/DESIGN.md`` ("Eviction semantics").
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import KVpopConfig
from .priority import priority
from .scorers import build_scorer

__all__ = ["KVpopLayer", "kvpop_layers", "ATTN_NAME"]

ATTN_NAME = "kvpop"
"""The attention implementation a kvpop-patched model runs (``config._attn_implementation``): the mode
switch that ``kvpop.disabled`` flips, read by the default cache and by a cache's check of its model."""


class KVpopLayer(nn.Module):
    """What ``patch`` attaches to one attention module (as ``attn.kvpop``).

    Parameters: ``scorer`` (see ``kvpop.scorers``) and ``decay_logit [Hkv]`` with
    ``gamma_h = gamma_min + (gamma_max - gamma_min) * sigmoid(decay_logit_h)``, which keeps gamma in
    range whatever the optimiser does.  ``log_gamma()`` is computed as
    ``log1p(-((1-gamma_min)(1-sig) + (1-gamma_max) sig))`` so that ``1 - gamma ~ 1e-6`` keeps its
    digits in float32.

    Transient attributes (not parameters): ``k_pre`` (the pre-RoPE key of the current forward, set by
    the family's key hook, see ``kvpop.models``, consumed by the attention function), ``loss_terms``
    (this layer's ``L_score`` terms of the last training forward), ``last_priority`` /
    ``last_evict_at``, ``decode_fn``, ``active_cache`` (the cache the attention module was called
    with, set by a forward pre-hook), ``teacher_target`` (``r_tgt [B, Hkv, S]`` from the frozen
    teacher when ``target_source="teacher"``, see ``kvpop.core.attention.set_teacher_targets``),
    ``k_override`` (``None``, or a per-head ``k`` that full-sequence forwards use instead of the
    config's: set only while ``kvpop.core.budgets.ablation_importance`` measures a head).
    """

    def __init__(self, config: KVpopConfig, num_kv_heads: int, head_dim: int, layer_idx: int,
                 model_type: str = "qwen3") -> None:
        super().__init__()
        self.config = config
        self.model_type = model_type
        self.layer_idx = layer_idx
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scorer = build_scorer(config, num_kv_heads, head_dim)
        frac = (config.gamma_init - config.gamma_min) / (config.gamma_max - config.gamma_min)
        self.decay_logit = nn.Parameter(torch.full((num_kv_heads,), math.log(frac / (1.0 - frac))))
        self.k_pre: torch.Tensor | None = None
        self.loss_terms: dict[str, torch.Tensor] | None = None
        self.last_priority: torch.Tensor | None = None
        self.last_evict_at: torch.Tensor | None = None
        self.decode_fn: Callable | None = None
        self.active_cache: Any = None
        self.teacher_target: torch.Tensor | None = None
        self.k_override: tuple[int, ...] | None = None

    def long_range_k(self) -> int | tuple[int, ...]:
        """This layer's long-range slots in a full-sequence forward: ``config.layer_k`` (the int ``k``, or
        ``k[l][h]`` per KV head with ``head_budgets``), or ``k_override`` while one is set."""
        if self.k_override is not None:
            return self.k_override
        return self.config.layer_k(self.layer_idx, self.num_kv_heads)

    def extra_repr(self) -> str:
        c = self.config
        budget = c.budget if c.head_budgets is None else c.layer_budgets(self.layer_idx, self.num_kv_heads)
        return f"layer={self.layer_idx}, scorer={c.scorer}, sinks={c.sinks}, window={c.window}, budget={budget}"

    def log_gamma(self) -> torch.Tensor:
        """``log(gamma_h)`` ``[Hkv]`` float32, differentiable in ``decay_logit``."""
        c = self.config
        sig = torch.sigmoid(self.decay_logit.float())
        one_minus = (1.0 - c.gamma_min) * (1.0 - sig) + (1.0 - c.gamma_max) * sig
        return torch.log1p(-one_minus)

    def gamma(self) -> torch.Tensor:
        """``gamma_h`` ``[Hkv]`` float32 (for logging; use ``log_gamma`` in computations)."""
        c = self.config
        return c.gamma_min + (c.gamma_max - c.gamma_min) * torch.sigmoid(self.decay_logit.float())

    def priority(self, r: torch.Tensor, log_gamma: torch.Tensor | None = None) -> torch.Tensor:
        """Static priority ``p[b,h,t] = r[b,h,t] - t * log(gamma_h)`` of raw scores ``r [B, Hkv, S]`` at
        positions ``0 .. S-1`` (:func:`kvpop.core.priority.priority`, the one copy of the formula)."""
        lg = self.log_gamma() if log_gamma is None else log_gamma
        return priority(r, torch.arange(r.shape[-1], device=r.device), lg)

    def capture_key(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        """Forward hook on the family's key tap: keep this forward's pre-RoPE key ``[B, S, Hkv, D]``.

        (A bound method, not a closure, so that ``copy.deepcopy`` and pickling of a patched model
        rebind it to the copy.)"""
        from kvpop.models import ADAPTERS

        self.k_pre = ADAPTERS[self.model_type].pre_rope_key(output, self.head_dim)

    def capture_cache(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the attention module: remember the cache it is called with (``cache=``
        in transformers >= 5.24, ``past_key_values=`` before), for the attention function."""
        cache = kwargs.get("cache")
        cache = self.active_cache = cache if cache is not None else kwargs.get("past_key_values")
        claim = getattr(cache, "claim", None)
        if claim is not None:  # a kvpop / DMS cache checks at its first call that this model serves it
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            active = getattr(getattr(module, "config", None), "_attn_implementation", None) == ATTN_NAME
            claim(self.layer_idx, "kvpop", self.config, active,
                  hidden.shape[1] if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None)

    def forward(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - not a callable layer
        raise RuntimeError("KVpopLayer is driven by the 'kvpop' attention function; do not call it")


def kvpop_layers(model: nn.Module) -> list[KVpopLayer]:
    """The ``KVpopLayer`` of every patched attention module, in layer order."""
    layers = [m for m in model.modules() if isinstance(m, KVpopLayer)]
    return sorted(layers, key=lambda m: m.layer_idx)
