"""The ``"kvpop"`` attention function: sparse sink + window + top-k attention of a patched layer.

Registered once per process in transformers' ``AttentionInterface`` (and a mask function of the
same name in ``AttentionMaskInterface``), it is called by every supported family's attention
layer with rotated ``query [B, Hq, S, D]`` and ``key/value [B, Hkv, S, D]``.

A full-sequence call (training, evaluation, a cache's prefill) runs :func:`sequence_attention`:
``r_hat = scorer(k_pre, v)`` on detached inputs, ``p = r_hat - t log(gamma_h)``,
``evict_at = eviction_schedule(p)`` (no grad), ``out, lse = sparse_attention(q, k, v, evict_at)``;
in a training forward also the layer's ``L_score`` terms (``kvpop.core.loss.score_loss_terms``)
from the target ``future_attention_target(q, k, lse)``.  While a ``KVpopCache`` is passed to the
model, the call goes to the cache (:func:`kvpop.core.cache.cache_attention`): prefill, then the
fused fixed-budget decode step.  See ``docs/DESIGN.md``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import kvpop_kernels
from kvpop.models import adapter_for
from kvpop_kernels import NEVER

from .cache import KVpopCache, cache_attention
from .cache_policy import cache_policy, registered_policies
from .config import KVpopConfig
from .layer import ATTN_NAME, KVpopLayer, kvpop_layers
from .loss import score_loss_terms
from .priority import priority
from .priority_sources import LEARNED_FORM, dense_lse, oracle_scores, priority_hooks, source_scores

__all__ = ["ATTN_NAME", "TARGET_ATTN_NAME", "register", "kvpop_mask", "kvpop_attention_forward", "sequence_attention",
           "streaming_policy", "target_attention_forward", "teacher_targets", "set_teacher_targets"]

TARGET_ATTN_NAME = "kvpop_target"
_REGISTERED: set[str] = set()


def register_attention(name: str, fn: Any) -> None:
    """Register ``fn`` once per process as transformers' attention implementation ``name``, with the
    mask function :func:`kvpop_mask` (no 4D mask is built; the kernels apply the eviction mask)."""
    if name in _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, kvpop_mask)
    _REGISTERED.add(name)


def register() -> None:
    """The ``"kvpop"`` attention function and the teacher-target one (``"kvpop_target"``)."""
    register_attention(ATTN_NAME, kvpop_attention_forward)
    register_attention(TARGET_ATTN_NAME, target_attention_forward)


def kvpop_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """Mask function of the ``"kvpop"`` implementation: no 4D mask is ever built.

    Passes the 2D padding mask on untouched (or None): the eviction mask is applied inside the
    kernels, a ``KVpopCache`` reads the padding of a prompt itself, and a full-sequence forward
    refuses padding.  Nothing is read from the mask here (no host synchronisation per step).
    """
    return attention_mask


def kvpop_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"kvpop"`` attention function (transformers' attention interface).

    ``query [B, Hq, S, D]``, ``key, value [B, Hkv, S, D]`` (after the family's norms and RoPE) ->
    ``(attn_output [B, S, Hq, D], None)``.  See the module docstring.
    """
    layer: KVpopLayer | None = getattr(module, "kvpop", None)
    if not isinstance(layer, KVpopLayer):
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} is set but {type(module).__name__} "
            f"(layer {getattr(module, 'layer_idx', '?')}) carries no KVpopLayer: use kvpop.patch(model)"
        )
    if dropout:
        raise ValueError(f"kvpop attention has no attention dropout; got dropout={dropout} "
                         f"(set config.attention_dropout = 0)")
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions=True: kvpop attention never forms the attention matrix, so it has no weights to "
            "return (an empty tuple would be silently wrong). Leave output_attentions off; for the weights of the "
            "dense model run it under kvpop.disabled(model); the eviction schedule of the last forward is each "
            "layer's `.kvpop.last_evict_at`"
        )
    k_pre = layer.k_pre
    layer.k_pre = None
    if k_pre is not None:
        k_pre = k_pre.transpose(1, 2)  # [B, S_new, Hkv, D] -> [B, Hkv, S_new, D]
    if layer.decode_fn is not None:
        return layer.decode_fn(module, query, key, value, attention_mask, scaling=scaling, k_pre=k_pre, **kwargs)
    # a KVpopCache passed to this attention module takes the call (prefill or decode step)
    cache, layer.active_cache = layer.active_cache, None
    if isinstance(cache, KVpopCache):
        out = cache_attention(cache, module, query, key, value, scaling=scaling,
                              hooks=priority_hooks(layer, k_pre, query, scaling), attention_mask=attention_mask,
                              position_ids=kwargs.get("position_ids"))
        if out is not None:
            return out, None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or not bool(attention_mask.bool().all()):
            raise ValueError(
                f"kvpop attention supports no padding or custom masks in a full-sequence forward (got an "
                f"attention mask of shape {tuple(attention_mask.shape)} with masked positions); pass equal-length "
                f"rows, or decode left-padded prompts through kvpop.KVpopCache (model.generate does)"
            )
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            "kvpop attention got fewer queries than keys (decoding with a growing cache); decode with "
            "kvpop.KVpopCache instead of a DynamicCache"
        )
    out, _ = sequence_attention(layer, query, key, value, k_pre, scaling=scaling,
                                training=module.training and torch.is_grad_enabled())
    return out.transpose(1, 2).contiguous(), None


def sequence_attention(layer: KVpopLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_pre: torch.Tensor | None, *, scaling: float | None = None,
                       training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """KVpop attention over one whole sequence (training, evaluation, or a cache's prefill).

    ``query [B, Hq, S, D]``, ``key, value, k_pre [B, Hkv, S, D]`` (``k_pre``: the pre-RoPE key) ->
    ``(out [B, Hq, S, D], lse float32 [B, Hq, S])``.  Sets ``layer.last_priority`` (float32) and
    ``layer.last_evict_at`` (int32), each ``[B, Hkv, S]``, and, when ``training`` (and
    ``config.compute_loss``, policy ``"kvpop"``, ``S`` above the smallest budget of the layer's heads),
    ``layer.loss_terms``.  With ``head_budgets`` each KV head runs with its own ``k[l][h]``
    (``KVpopLayer.long_range_k``) in the schedule and in the loss's decisions.
    """
    cfg = layer.config
    if not cache_policy(cfg.policy).static:  # priced by what decoding attends to (TOVA, H2O)
        raise NotImplementedError(
            f"policy={cfg.policy!r} is defined only while decoding through kvpop.KVpopCache; a full-sequence "
            f"forward supports the policies {registered_policies(static=True)}"
        )
    query, key, value = autocast_inputs(query, key, value)
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    if k_pre is None or k_pre.shape != value.shape:
        raise RuntimeError(
            f"kvpop: the pre-RoPE key of layer {layer.layer_idx} was not captured (expected the output of "
            f"k_norm, [B, Hkv, S, D] = {(B, Hkv, S, D)} after transposing; got "
            f"{None if k_pre is None else tuple(k_pre.shape)}); was the model patched by kvpop.patch?"
        )
    k_long = layer.long_range_k()  # an int, or one per KV head (head_budgets)
    # the smallest budget of the layer's heads: a head evicts (and decides) once S exceeds its budget
    min_budget = cfg.sinks + cfg.window + (k_long if isinstance(k_long, int) else min(k_long))
    streaming = streaming_policy(cfg)
    # a priority that is not learned (docs/DESIGN.md section 12) trains nothing: no L_score
    learned = cfg.priority_source == "scorer"
    need_loss = training and cfg.compute_loss and cfg.policy == "kvpop" and learned and S > min_budget
    log_gamma = layer.log_gamma()
    tpos = torch.arange(S, device=query.device)

    r_hat = None
    if need_loss or (cfg.mask_source == "scorer" and not streaming and cfg.priority_source in LEARNED_FORM):
        with torch.set_grad_enabled(need_loss):
            r_hat = layer.scorer(k_pre.detach(), value.detach())

    r_tgt = None
    oracle = cfg.mask_source == "teacher" or cfg.priority_source == "oracle-label"
    if cfg.target_source == "teacher" and (need_loss or (oracle and not streaming)):
        r_tgt = layer.teacher_target
        if r_tgt is None or tuple(r_tgt.shape) != (B, Hkv, S):
            raise RuntimeError(
                f"kvpop: target_source='teacher' but layer {layer.layer_idx} holds no teacher target of shape "
                f"{(B, Hkv, S)} (got {None if r_tgt is None else tuple(r_tgt.shape)}): run the frozen teacher "
                f"under kvpop.teacher_targets(teacher, config) and hand the result to "
                f"kvpop.set_teacher_targets(model, targets) before the student's forward (kvpop.training.train does)"
            )
        r_tgt = r_tgt.to(device=query.device, dtype=torch.float32)
    with torch.no_grad():
        if streaming:
            prio = torch.zeros(B, Hkv, S, device=query.device, dtype=torch.float32)
        elif oracle:
            if r_tgt is None:
                r_tgt = oracle_scores(query, key, value, cfg, scaling)
            prio = priority(r_tgt, tpos, log_gamma.detach())
        elif r_hat is None:  # keynorm, window-attention
            prio = priority(source_scores(cfg, query, key, value, k_pre, scaling), tpos, log_gamma.detach())
        else:
            prio = priority(r_hat.detach(), tpos, log_gamma.detach())
        if S <= min_budget:  # at most s + w + k[h] tokens on every head: nothing can be evicted
            evict_at = torch.full((B, Hkv, S), NEVER, dtype=torch.int32, device=query.device)
        else:
            evict_at = kvpop_kernels.eviction_schedule(prio.contiguous(), sinks=cfg.sinks, window=cfg.window,
                                                       k=k_long)
    out, lse = kvpop_kernels.sparse_attention(query, key, value, evict_at, sinks=cfg.sinks, window=cfg.window,
                                              scale=scaling)
    layer.loss_terms = None
    if need_loss:
        with torch.no_grad():
            if r_tgt is None:
                lse_t = dense_lse(query, key, value, cfg, scaling) if cfg.target_lse == "dense" else lse.detach()
                r_tgt = kvpop_kernels.future_attention_target(query.detach(), key.detach(), lse_t,
                                                              scale=scaling, **cfg.target_kwargs())
        layer.loss_terms = score_loss_terms(r_hat, r_tgt, log_gamma, sinks=cfg.sinks, window=cfg.window, k=k_long,
                                            tau=cfg.tau, tie_margin=cfg.tie_margin, balance=cfg.balance)
    layer.last_priority = prio.detach()
    layer.last_evict_at = evict_at
    return out, lse


def autocast_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, the attention's inputs in autocast's dtype, as SDPA takes them.  The kernels are not
    autocast-aware and want one dtype, and under ``--bf16`` Qwen3's q/k norms (float32 weights) give float32
    queries and keys beside a bf16 ``v_proj`` (found by the first GPU run, 2026-12-04)."""
    dev = xs[0].device.type
    if not torch.is_autocast_enabled(dev):
        return xs
    dt = torch.get_autocast_dtype(dev)
    return tuple(x.to(dt) for x in xs)


def streaming_policy(cfg: KVpopConfig) -> bool:
    """True when the mask is the constant-priority StreamingLLM pattern (no scorer involved)."""
    return cfg.mask_source == "streaming" or cfg.policy == "streaming"


# ----------------------------------------------------------------------------- the teacher's exact target
def target_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention function ``"kvpop_target"`` of a frozen teacher under :func:`teacher_targets`.

    Dense causal attention (``sparse_attention`` with nothing evicted: ``(out, lse)``), and, from the
    same queries, keys and dense LSE, the layer's exact target ``future_attention_target(q, k, lse)``
    ``[B, Hkv, S]`` float32, stored by ``layer_idx`` in the dict that :func:`teacher_targets` yields.
    No gradient; nothing but the target outlives the call.
    """
    spec = getattr(module, "kvpop_target_spec", None)
    if spec is None:
        raise RuntimeError(f"attention implementation {TARGET_ATTN_NAME!r} is set but "
                           f"{type(module).__name__} is not under kvpop.teacher_targets(...)")
    cfg, store = spec
    if attention_mask is not None and (attention_mask.dim() != 2 or not bool(attention_mask.bool().all())):
        raise ValueError(f"kvpop teacher targets support no padding or custom masks (got an attention mask of "
                         f"shape {tuple(attention_mask.shape)} with masked positions)")
    if dropout:
        raise ValueError(f"kvpop teacher targets need attention dropout 0, got {dropout}")
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError("kvpop teacher targets need a full-sequence forward (no cache)")
    query, key, value = autocast_inputs(query, key, value)
    B, Hkv, S = key.shape[0], key.shape[1], key.shape[2]
    with torch.no_grad():
        never = torch.full((B, Hkv, S), NEVER, dtype=torch.int32, device=query.device)
        out, lse = kvpop_kernels.sparse_attention(query, key, value, never, sinks=cfg.sinks, window=cfg.window,
                                                  scale=scaling)
        store[int(module.layer_idx)] = kvpop_kernels.future_attention_target(query, key, lse, scale=scaling,
                                                                             **cfg.target_kwargs())
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def teacher_targets(teacher: nn.Module, config: KVpopConfig) -> Iterator[dict[int, torch.Tensor]]:
    """While active, ``teacher``'s forwards also compute every layer's exact KVpop target.

    ``teacher``: the frozen, unpatched original model (``kvpop.make_teacher``; any supported family,
    possibly FSDP2-sharded).  Its attention runs densely through :func:`target_attention_forward`
    (same outputs as its own attention, to rounding), which keeps only ``r_tgt [B, Hkv, S]`` float32
    per layer: the target of docs/DESIGN.md section 3 with the teacher's queries, keys and dense LSE
    (``config``'s ``window``, ``eps``, ``label`` and ``label_power``).  Yields the dict
    ``{layer_idx: r_tgt}`` that the forward fills; hand it to :func:`set_teacher_targets` for a student patched with
    ``target_source="teacher"``.  Run the teacher under ``torch.no_grad()``.
    """
    if not isinstance(config, KVpopConfig):
        raise TypeError(f"config must be a kvpop.KVpopConfig, got {type(config).__name__}")
    register()
    inner = getattr(teacher, "module", teacher)
    mods = adapter_for(inner).attention_modules(inner)  # TypeError for an unsupported family
    if any(isinstance(getattr(m, "kvpop", None), KVpopLayer) for m in mods):
        raise ValueError("teacher_targets needs the unpatched teacher (kvpop.make_teacher(model)); got a patched model")
    store: dict[int, torch.Tensor] = {}
    for m in mods:
        m.kvpop_target_spec = (config, store)
    mc = inner.config
    prev = mc._attn_implementation
    mc._attn_implementation = TARGET_ATTN_NAME
    try:
        yield store
    finally:
        mc._attn_implementation = prev
        for m in mods:
            del m.kvpop_target_spec


def set_teacher_targets(model: nn.Module, targets: dict[int, torch.Tensor] | None) -> None:
    """Give each ``KVpopLayer`` of a patched ``model`` its teacher target (``None`` clears them all).

    ``targets``: the dict filled under :func:`teacher_targets` (``{layer_idx: [B, Hkv, S]}``); a layer
    without an entry raises ``KeyError``.  The targets stay until replaced or cleared (a recomputing
    backward under activation checkpointing reads them again).
    """

    for layer in kvpop_layers(model):
        if targets is None:
            layer.teacher_target = None
            continue
        if layer.layer_idx not in targets:
            raise KeyError(f"no teacher target for layer {layer.layer_idx} (have layers {sorted(targets)}): was "
                           f"the teacher run under kvpop.teacher_targets on the same input?")
        layer.teacher_target = targets[layer.layer_idx]
