"""``kvpop.patch(model)`` / ``kvpop.unpatch(model)``: KVpop attention for transformers' Qwen3 models.

What ``patch`` does (transformers 5.17 .. 5.24)
    * registers, once per process, an attention function ``"kvpop"`` in transformers'
      ``AttentionInterface`` and a mask function of the same name in ``AttentionMaskInterface`` (it
      returns ``None``: the model builds no dense 4D mask; a padded 2D mask is passed through so the
      attention function can refuse it);
    * attaches to every ``Qwen3Attention`` a :class:`KVpopLayer` as the submodule ``kvpop`` (a scorer
      and the decay logits of its KV heads; so they appear in ``state_dict()`` and ``parameters()``
      under ``...self_attn.kvpop.``);
    * registers a forward hook on every ``Qwen3Attention.k_norm`` that hands the layer's pre-RoPE key
      to its ``KVpopLayer`` (the attention interface passes only the rotated key; see
      ``kvpop.scorers`` for why the scorers read pre-RoPE keys);
    * sets ``model.config._attn_implementation = "kvpop"`` and remembers the previous value.

``unpatch`` removes the submodules and the hooks and restores the previous attention implementation:
the model is then exactly the model before ``patch`` (same modules, same ``state_dict`` keys, same
logits).  ``patch`` is idempotent: patching a patched model with no config and no overrides (or with
an equal config) changes nothing.  Patching a patched model with a *different* config keeps the trained
scorers and swaps the config in when the scorer's structure is unchanged (``budget``, ``sinks``,
``mask_source``, ``tau`` ... may change; e.g. ``kvpop.patch(model, budget=4096)`` re-budgets a trained
model); a structural change (``scorer``, ``scorer_hidden``, ``mlstm_dim``, the gamma range, ``window``
for the mLSTM) raises ``ValueError``: call ``kvpop.unpatch`` first (which discards the scorers).

The patched forward (one call of the attention function per layer)
    ``r_hat = scorer(k_pre, v)`` on detached inputs; ``p = r_hat - t log(gamma_h)``;
    ``evict_at = eviction_schedule(p)`` (no grad); ``out, lse = sparse_attention(q, k, v, evict_at)``.
    ``mask_source`` picks the priorities of the mask: the scorer's (default), the oracle's (the exact
    dense target of this layer in this same pass: one extra no-grad dense attention for the LSE, then
    ``future_attention_target``; the loss then uses that dense target too) or a constant
    (StreamingLLM: sinks + a window of ``w + k``).
    In a *training* forward (the attention module in train mode, grad enabled, ``config.compute_loss``)
    the layer also computes its share of ``L_score`` (``kvpop.loss.score_loss_terms``) from the target
    ``r_tgt = future_attention_target(q, k, lse)`` with the sparse LSE of this pass (default) or the
    dense one (``target_lse="dense"``), and stores it on the ``KVpopLayer``; ``kvpop.score_loss(model)``
    collects it.  Otherwise (eval or no grad) the forward is sparse attention only.
    Each forward also leaves ``priority`` and ``evict_at`` ``[B, Hkv, S]`` (detached) on the layer as
    ``last_priority`` / ``last_evict_at``, for a cache's prefill.

Activation checkpointing: use the non-reentrant form
(``model.activation_checkpointing_enable({"use_reentrant": False})``, or
``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`` before 5.2x):
the reentrant form runs the first forward under ``no_grad``, so no layer would record ``L_score``.
With the non-reentrant form the recomputation in backward repeats the layer's loss work too (the
target pass and the decisions), the price of not keeping the layer's activations.

Limits: no padding (a 2D attention mask with zeros -> ValueError; use equal-length rows or batch 1),
no sliding-window layers, no attention dropout, no ``output_attentions`` (the weights returned are
``None``).

Decoding: every call first offers itself to
``kvpop.cache.cache_attention(module, query, key, value, scaling=..., hooks=ScorerHooks(...))``, which
takes it when a ``KVpopCache`` is pending for the layer (prefill and decode steps; the hooks give the
cache the learned priorities from the pre-RoPE keys, see :class:`ScorerHooks`).  A generic escape
hatch: when ``KVpopLayer.decode_fn`` is set (whoever sets it clears it) every call of that layer goes
to ``decode_fn(module, query, key, value, attention_mask, scaling=..., k_pre=[B, Hkv, S_new, D],
**kwargs)``; a prefill can reuse :func:`sequence_attention`.  Otherwise a call with fewer queries than
keys (decoding with a ``DynamicCache``) raises NotImplementedError.  Decoding always ranks by the
scorer (policy ``"kvpop"``): ``mask_source`` is a training option.

Note: ``kvpop.patch`` is this function, which shadows the module of the same name as an attribute of
``kvpop``; import module-level names with ``from kvpop.patch import sequence_attention, ScorerHooks``.

Scorers are created in float32 on the device of the attention weights; cast the model *before*
patching (``model.to(torch.bfloat16)`` after ``patch`` casts the scorers too, which works but loses
score precision).
"""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Callable, Iterator

import torch
from torch import nn

import kvpop_kernels
from kvpop_kernels import NEVER

from .cache import cache_attention
from .config import KVpopConfig
from .loss import score_loss_terms
from .scorers import build_scorer

__all__ = [
    "KVpopLayer",
    "patch",
    "unpatch",
    "is_patched",
    "get_config",
    "kvpop_layers",
    "disabled",
    "make_teacher",
    "sequence_attention",
    "kvpop_attention_forward",
    "kvpop_mask",
    "ATTN_NAME",
    "SUPPORTED_MODELS",
]

ATTN_NAME = "kvpop"
SUPPORTED_MODELS = ("Qwen3ForCausalLM", "Qwen3Model", "Qwen3ForSequenceClassification",
                    "Qwen3ForTokenClassification", "Qwen3ForQuestionAnswering")
_STATE_ATTR = "_kvpop_state"


# --------------------------------------------------------------------------- per-layer module
class KVpopLayer(nn.Module):
    """What ``patch`` attaches to one ``Qwen3Attention`` (as ``attn.kvpop``).

    Parameters: ``scorer`` (see ``kvpop.scorers``) and ``decay_logit [Hkv]`` with
    ``gamma_h = gamma_min + (gamma_max - gamma_min) * sigmoid(decay_logit_h)``, which keeps gamma in
    range whatever the optimiser does.  ``log_gamma()`` is computed as
    ``log1p(-((1-gamma_min)(1-sig) + (1-gamma_max) sig))`` so that ``1 - gamma ~ 1e-6`` keeps its
    digits in float32.

    Transient attributes (not parameters): ``k_pre`` (the pre-RoPE key of the current forward, set by
    the ``k_norm`` hook, consumed by the attention function), ``loss_terms`` (this layer's ``L_score``
    terms of the last training forward), ``last_priority`` / ``last_evict_at``, ``decode_fn``.
    """

    def __init__(self, config: KVpopConfig, num_kv_heads: int, head_dim: int, layer_idx: int) -> None:
        super().__init__()
        self.config = config
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

    def extra_repr(self) -> str:
        c = self.config
        return f"layer={self.layer_idx}, scorer={c.scorer}, sinks={c.sinks}, window={c.window}, budget={c.budget}"

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
        """Static priority ``p[b,h,t] = r[b,h,t] - t * log(gamma_h)`` of raw scores ``r [B, Hkv, S]``."""
        lg = self.log_gamma() if log_gamma is None else log_gamma
        t = torch.arange(r.shape[-1], device=r.device, dtype=torch.float32)
        return r.float() - t * lg[:, None]

    # forward hook on Qwen3Attention.k_norm: its output is the pre-RoPE key [B, S, Hkv, D]
    def _capture_k_pre(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.k_pre = output

    def forward(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - not a callable layer
        raise RuntimeError("KVpopLayer is driven by the 'kvpop' attention function; do not call it")


# --------------------------------------------------------------------------- registration
_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, kvpop_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, kvpop_mask)
    _REGISTERED = True


def kvpop_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """Mask function of the ``"kvpop"`` implementation: no 4D mask is ever built.

    Returns ``None`` (plain causal; the eviction mask is applied inside the kernels) unless the 2D
    padding mask has a zero, in which case it is passed on and the attention function refuses it.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2 and bool(attention_mask.bool().all()):
        return None
    return attention_mask


def kvpop_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"kvpop"`` attention function (transformers' attention interface).

    ``query [B, Hq, S, D]`` (after ``q_norm`` and RoPE), ``key, value [B, Hkv, S, D]`` (after
    ``k_norm``/RoPE) -> ``(attn_output [B, S, Hq, D], None)``.  See the module docstring.
    """
    layer: KVpopLayer | None = getattr(module, "kvpop", None)
    if not isinstance(layer, KVpopLayer):
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} is set but {type(module).__name__} "
            f"(layer {getattr(module, 'layer_idx', '?')}) carries no KVpopLayer: use kvpop.patch(model)"
        )
    if attention_mask is not None:
        if attention_mask.dim() != 2 or not bool(attention_mask.bool().all()):
            raise ValueError(
                f"kvpop attention supports no padding or custom masks (got an attention mask of shape "
                f"{tuple(attention_mask.shape)} with masked positions); pass equal-length rows or batch 1"
            )
    if dropout:
        raise ValueError(f"kvpop attention has no attention dropout; got dropout={dropout} "
                         f"(set config.attention_dropout = 0)")
    k_pre = layer.k_pre
    layer.k_pre = None
    if k_pre is not None:
        k_pre = k_pre.transpose(1, 2)  # [B, S_new, Hkv, D] -> [B, Hkv, S_new, D]
    if layer.decode_fn is not None:
        return layer.decode_fn(module, query, key, value, attention_mask, scaling=scaling, k_pre=k_pre, **kwargs)
    # a pending kvpop.KVpopCache takes the call (prefill or decode step)
    out = cache_attention(module, query, key, value, scaling=scaling,
                          hooks=ScorerHooks(layer, k_pre, kwargs.get("position_ids")))
    if out is not None:
        return out, None
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
    ``config.compute_loss``, policy ``"kvpop"``, ``S > budget``), ``layer.loss_terms``.
    """
    cfg = layer.config
    if cfg.policy in ("tova", "h2o"):
        raise NotImplementedError(
            f"policy={cfg.policy!r} is defined only while decoding through kvpop.KVpopCache; a full-sequence "
            f"forward supports policy='kvpop' or 'streaming'"
        )
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    if k_pre is None or k_pre.shape != value.shape:
        raise RuntimeError(
            f"kvpop: the pre-RoPE key of layer {layer.layer_idx} was not captured (expected the output of "
            f"k_norm, [B, Hkv, S, D] = {(B, Hkv, S, D)} after transposing; got "
            f"{None if k_pre is None else tuple(k_pre.shape)}); was the model patched by kvpop.patch?"
        )
    k_long = cfg.k
    streaming = streaming_policy(cfg)
    need_loss = training and cfg.compute_loss and cfg.policy == "kvpop" and S > cfg.budget
    log_gamma = layer.log_gamma()
    tpos = torch.arange(S, device=query.device, dtype=torch.float32)

    r_hat = None
    if need_loss or (cfg.mask_source == "scorer" and not streaming):
        with torch.set_grad_enabled(need_loss):
            r_hat = layer.scorer(k_pre.detach(), value.detach())

    def dense_lse() -> torch.Tensor:
        with torch.no_grad():
            never = torch.full((B, Hkv, S), NEVER, dtype=torch.int32, device=query.device)
            return kvpop_kernels.sparse_attention(query.detach(), key.detach(), value.detach(), never,
                                                  sinks=cfg.sinks, window=cfg.window, scale=scaling)[1]

    r_tgt = None
    with torch.no_grad():
        if streaming:
            prio = torch.zeros(B, Hkv, S, device=query.device, dtype=torch.float32)
        elif cfg.mask_source == "teacher":
            r_tgt = kvpop_kernels.future_attention_target(query.detach(), key.detach(), dense_lse(),
                                                          window=cfg.window, eps=cfg.eps, scale=scaling)
            prio = r_tgt - tpos * log_gamma.detach()[:, None]
        else:
            prio = r_hat.detach().float() - tpos * log_gamma.detach()[:, None]
        if S <= cfg.budget:  # at most s + w + k tokens: nothing can be evicted
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
                lse_t = dense_lse() if cfg.target_lse == "dense" else lse.detach()
                r_tgt = kvpop_kernels.future_attention_target(query.detach(), key.detach(), lse_t,
                                                              window=cfg.window, eps=cfg.eps, scale=scaling)
        layer.loss_terms = score_loss_terms(r_hat, r_tgt, log_gamma, sinks=cfg.sinks, window=cfg.window, k=k_long,
                                            tau=cfg.tau, tie_margin=cfg.tie_margin, balance=cfg.balance)
    layer.last_priority = prio.detach()
    layer.last_evict_at = evict_at
    return out, lse


class ScorerHooks:
    """The learned scorer's priorities for ``kvpop.KVpopCache`` (its ``PriorityHooks`` protocol).

    Built per attention call from the layer and the pre-RoPE keys of the call's new tokens
    (``k_pre [1, Hkv, S_new, D]``; the cache passes rotated keys, the scorer reads pre-RoPE ones);
    ``position_ids [1, S_new]`` map a position to its index among the new tokens.

    * ``prompt(module, cache_layer, key, value) -> [1, Hkv, S]``: ``r_hat - t log(gamma)`` of the whole
      prompt, exactly as in a full-sequence forward.  The mLSTM scorer also leaves in
      ``cache_layer.scorer_state`` the tuple ``(C, n, m, k_ring)``: its recurrent state after the prompt
      and a ring ``[1, Hkv, w, D]`` of the pre-RoPE keys of the last ``w`` tokens (token ``t`` at
      ``t % w``), which it needs to score a token when it leaves the window.
    * ``token(module, cache_layer, key_new, value_new, pos) -> [Hkv]`` (MLP scorer): the priority of the
      new token, known at entry.
    * ``leaving(module, cache_layer, key_new, value_new, pos) -> [Hkv]`` (mLSTM scorer): absorbs the
      new token into the state, then scores ``t = pos - w`` (value read from the cache's window slot,
      pre-RoPE key from the ring): the state has then absorbed exactly the tokens up to ``t + w``, as
      in training.
    """

    def __init__(self, layer: KVpopLayer, k_pre: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
        self.layer = layer
        self.k_pre = k_pre
        self.position_ids = position_ids if isinstance(position_ids, torch.Tensor) else None
        self._pos0: int | None = None
        recurrent = getattr(layer.scorer, "lookahead_uses_window", False)
        self.token = None if recurrent else self._token
        self.leaving = self._leaving if recurrent else None

    def _k_pre_at(self, pos: int) -> torch.Tensor:
        if self.k_pre is None:
            raise RuntimeError("kvpop: the pre-RoPE keys of this call were not captured")
        n = self.k_pre.shape[2]
        if self.position_ids is None:
            if n != 1:
                raise RuntimeError("kvpop: decoding several tokens per call needs position_ids")
            return self.k_pre[:, :, 0]
        if self._pos0 is None:  # read lazily: a training forward builds the hooks but never calls them
            self._pos0 = int(self.position_ids.reshape(-1)[0])
        i = pos - self._pos0
        if not 0 <= i < n:
            raise RuntimeError(f"kvpop: position {pos} is not among this call's tokens ({self._pos0}..{self._pos0 + n - 1})")
        return self.k_pre[:, :, i]

    def prompt(self, module: nn.Module, cache_layer: Any, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        with torch.no_grad():
            if getattr(layer.scorer, "lookahead_uses_window", False):
                r, (C, n, m) = layer.scorer(self.k_pre, value, return_state=True)
                S, w = value.shape[2], layer.config.window
                ring = torch.zeros(value.shape[0], value.shape[1], w, value.shape[3], dtype=self.k_pre.dtype,
                                   device=value.device)
                t = torch.arange(max(0, S - w), S, device=value.device)
                ring[:, :, t % w] = self.k_pre[:, :, t]
                cache_layer.scorer_state = (C, n, m, ring)
            else:
                r = layer.scorer(self.k_pre, value)
            return layer.priority(r)

    def _token(self, module: nn.Module, cache_layer: Any, key_new: torch.Tensor, value_new: torch.Tensor,
               pos: int) -> torch.Tensor:
        layer = self.layer
        with torch.no_grad():
            r = layer.scorer(self._k_pre_at(pos), value_new.unsqueeze(0))[0]  # [Hkv]
            return r - pos * layer.log_gamma()

    def _leaving(self, module: nn.Module, cache_layer: Any, key_new: torch.Tensor, value_new: torch.Tensor,
                 pos: int) -> torch.Tensor | None:
        layer = self.layer
        sc = layer.scorer
        w = layer.config.window
        with torch.no_grad():
            st = cache_layer.scorer_state
            if st is None:  # decoding from an empty cache (no prompt pass)
                C, n, m = sc.init_state(1, value_new.device)
                ring = torch.zeros(1, value_new.shape[0], w, value_new.shape[1], device=value_new.device)
            else:
                C, n, m, ring = st
            kp = self._k_pre_at(pos)
            C, n, m = sc.step((C, n, m), kp, value_new.unsqueeze(0))
            t = pos - w
            out = None
            if t >= 0:
                v_t = cache_layer.values[:, cache_layer.slot_of(t)].unsqueeze(0)
                r = sc.score_token((C, n, m), ring[:, :, t % w].to(kp.dtype), v_t)[0]
                out = r - t * layer.log_gamma()
            ring[:, :, pos % w] = kp.to(ring.dtype)
            cache_layer.scorer_state = (C, n, m, ring)
            return out


def streaming_policy(cfg: KVpopConfig) -> bool:
    """True when the mask is the constant-priority StreamingLLM pattern (no scorer involved)."""
    return cfg.mask_source == "streaming" or cfg.policy == "streaming"


# --------------------------------------------------------------------------- patch / unpatch
def _supported_classes() -> tuple[type, ...]:
    from transformers.models.qwen3 import modeling_qwen3 as mq

    return (mq.Qwen3PreTrainedModel,)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    return [m for m in model.modules() if isinstance(m, Qwen3Attention)]


def _check_model(model: Any) -> None:
    if not isinstance(model, _supported_classes()):
        raise TypeError(
            f"kvpop.patch supports transformers' Qwen3 models ({', '.join(SUPPORTED_MODELS)}, any "
            f"Qwen3PreTrainedModel); got {type(model).__name__}"
        )
    cfg = model.config
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError("kvpop does not support Qwen3 sliding-window layers (config.use_sliding_window=True); "
                         "set use_sliding_window=False")
    if not _attention_modules(model):
        raise TypeError(f"{type(model).__name__} has no Qwen3Attention module to patch")


def _patched_owner(model: nn.Module) -> nn.Module | None:
    """The module carrying the patch state: ``model`` itself or, for a wrapper (DDP, FSDP, a
    ``torch.compile`` module), the first submodule that does."""
    if getattr(model, _STATE_ATTR, None) is not None:
        return model
    if isinstance(model, nn.Module):
        for m in model.modules():
            if getattr(m, _STATE_ATTR, None) is not None:
                return m
    return None


def is_patched(model: nn.Module) -> bool:
    """True when ``model`` (or the model it wraps) carries kvpop's patch."""
    return _patched_owner(model) is not None


def get_config(model: nn.Module) -> KVpopConfig:
    """The ``KVpopConfig`` of a patched model (ValueError when it is not patched)."""
    owner = _patched_owner(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} is not patched: call kvpop.patch(model) first")
    return getattr(owner, _STATE_ATTR)["config"]


def kvpop_layers(model: nn.Module) -> list[KVpopLayer]:
    """The ``KVpopLayer`` of every patched attention module, in layer order."""
    layers = [m for m in model.modules() if isinstance(m, KVpopLayer)]
    return sorted(layers, key=lambda m: m.layer_idx)


def patch(model: nn.Module, config: KVpopConfig | None = None, **overrides: Any) -> nn.Module:
    """Patch a transformers Qwen3 model in place for KVpop and return it.

    Args:
        model: a ``Qwen3PreTrainedModel`` (``Qwen3ForCausalLM``, ``Qwen3Model`` ...); anything else
            raises ``TypeError``.
        config: a ``KVpopConfig`` (default ``KVpopConfig()``, or the model's current one if patched).
        **overrides: fields of ``KVpopConfig`` applied on top of ``config`` (validated:
            ``budget < sinks + window + 1`` -> ``ValueError``, unknown names -> ``TypeError``).

    Idempotent; re-patching a patched model with a different config: see the module docstring.
    """
    _check_model(model)
    if config is not None and not isinstance(config, KVpopConfig):
        raise TypeError(f"config must be a kvpop.KVpopConfig or None, got {type(config).__name__}")
    state = getattr(model, _STATE_ATTR, None)
    base = config if config is not None else (state["config"] if state is not None else KVpopConfig())
    new = base.replace(**overrides) if overrides else base
    _register()
    if state is not None:
        old = state["config"]
        if new == old:
            return model
        bad = old.structural_mismatch(new)
        if bad:
            raise ValueError(
                f"model is patched with a scorer of another structure (fields {bad} differ: "
                f"{ {n: getattr(old, n) for n in bad} } -> { {n: getattr(new, n) for n in bad} }); "
                f"call kvpop.unpatch(model) first (this discards the trained scorers)"
            )
        for layer in kvpop_layers(model):
            layer.config = new
        state["config"] = new
        model.kvpop_config = new
        return model

    attns = _attention_modules(model)
    mc = model.config
    for attn in attns:
        hkv = attn.k_proj.out_features // attn.head_dim
        layer = KVpopLayer(new, hkv, attn.head_dim, attn.layer_idx)
        layer.to(device=attn.k_proj.weight.device, dtype=torch.float32)
        attn.kvpop = layer
        attn.k_norm.register_forward_hook(layer._capture_k_pre)
    orig = mc._attn_implementation
    mc._attn_implementation = ATTN_NAME
    setattr(model, _STATE_ATTR, {"config": new, "orig_attn": orig})
    model.kvpop_config = new  # read by kvpop.KVpopCache(model)
    _install_default_cache(model)
    return model


def _cache_kwarg_name() -> str:
    """The name under which ``generate`` passes the cache: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (5.17 .. 5.23)."""
    from transformers.generation import utils as gen_utils

    names = getattr(gen_utils, "ALL_CACHE_NAMES", None)
    return "cache" if names and "cache" in names else "past_key_values"


def _install_default_cache(model: nn.Module) -> None:
    """Make plain ``model.generate(...)`` decode through a fresh ``KVpopCache``.

    Wraps the instance's ``_prepare_cache_for_generation``: when the caller passed no cache (under
    either keyword), asked for no ``cache_implementation`` and did not turn ``use_cache`` off, a
    ``KVpopCache(model)`` is put where ``generate`` looks for a user's cache.  ``unpatch`` removes it.
    """
    orig = getattr(model, "_prepare_cache_for_generation", None)
    if orig is None or "_prepare_cache_for_generation" in model.__dict__:
        return
    from .cache import KVpopCache

    def prepare(generation_config, model_kwargs, *args, **kwargs):
        given = any(model_kwargs.get(n) is not None for n in ("cache", "past_key_values"))
        if (not given and generation_config.use_cache is not False
                and generation_config.cache_implementation is None):
            model_kwargs[_cache_kwarg_name()] = KVpopCache(model)
        return orig(generation_config, model_kwargs, *args, **kwargs)

    model._prepare_cache_for_generation = prepare


def _remove_hooks(attn: nn.Module) -> None:
    hooks = attn.k_norm._forward_hooks
    for hid in [h for h, fn in hooks.items() if isinstance(getattr(fn, "__self__", None), KVpopLayer)]:
        del hooks[hid]
        for extra in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(attn.k_norm, extra, {}).pop(hid, None)


def unpatch(model: nn.Module) -> nn.Module:
    """Undo ``patch`` in place (scorers removed and lost, attention implementation restored); returns ``model``.

    A model that is not patched is returned unchanged.
    """
    owner = _patched_owner(model)
    if owner is None:
        return model
    state = getattr(owner, _STATE_ATTR)
    for attn in _attention_modules(owner):
        _remove_hooks(attn)
        if "kvpop" in attn._modules:
            del attn._modules["kvpop"]
    owner.config._attn_implementation = state["orig_attn"]
    delattr(owner, _STATE_ATTR)
    for attr in ("kvpop_config", "_prepare_cache_for_generation"):
        owner.__dict__.pop(attr, None)
    return model


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run a patched model densely with its current weights: its original attention implementation.

    The memory-cheap way to get dense logits of the *same* weights (e.g. to compare a patched model
    with itself, or as the teacher while the model itself is frozen).  When the model is fine-tuned,
    the teacher must be the frozen original: use :func:`make_teacher` before training.
    """
    owner = _patched_owner(model)
    if owner is None:
        yield model
        return
    state = getattr(owner, _STATE_ATTR)
    mc = owner.config
    prev = mc._attn_implementation
    mc._attn_implementation = state["orig_attn"]
    try:
        yield model
    finally:
        mc._attn_implementation = prev
        for layer in kvpop_layers(model):
            layer.k_pre = None


def make_teacher(model: nn.Module, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen dense copy of ``model``'s current weights: the distillation teacher.

    Call it **before** fine-tuning, so it holds the original weights.  The copy is unpatched, in eval
    mode and has ``requires_grad=False`` everywhere; ``device``/``dtype`` optionally move it.
    Costs one more copy of the weights (the price of a teacher that stays the original model).
    """
    teacher = copy.deepcopy(model)
    unpatch(teacher)
    if device is not None or dtype is not None:
        teacher.to(device=device, dtype=dtype)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher
