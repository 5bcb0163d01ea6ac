"""DMS (dynamic memory sparsification, Łańcucki et al., 2025): the learned baseline KVpop is measured against.

DMS gives every token and KV head a binary keep-or-evict gate, learned with no target for which tokens
to keep: the gates are trained through a continuous relaxation, only by the distillation loss of the
model and an auxiliary loss that pulls the mean eviction rate to a target compression ratio.  An
evicted token is not deleted at once but when it leaves a window of the ``w`` most recent tokens
(*delayed eviction*), so every head keeps its own, growing number of tokens.  This module holds the
whole method on the model side (docs/DESIGN.md, "DMS"):

* **Gates.**  ``DMSLayer.gate``: per attention layer a linear head from the attention layer's input
  (the normalised hidden state) to one logit per KV head, ``logit[b, h, t] = W_h . x_t + b_h`` (the
  DMS code's "separate alpha" variant).  ``W = 0``, ``b = -gate_offset`` at the start, so every token is
  kept and the patched model starts exactly as the original.  A gate only acts on tokens ``t >= s``:
  the sinks are never evicted, as under every other policy of the harness.
* **Relaxation** (training, :func:`gumbel_sigmoid`): ``alpha = sigmoid((logit + n) / tau)`` with
  logistic noise ``n`` (the difference of two Gumbel samples), the probability of eviction; the hard
  decision ``alpha > 1/2`` with a straight-through gradient feeds the auxiliary loss.
* **Delayed mask** (training, :func:`dms_attention`): key ``t`` is fully visible to the queries of its
  window (``t > q - w``, as everywhere in kvpop), and beyond it its attention logit gets
  ``log(1 - alpha_t)`` (``-inf`` for a hard eviction).  A dense masked attention in PyTorch: the
  relaxed mask is an additive bias on every old key, which the sparse-attention kernel's mask
  (visible or not) cannot express.
* **Hard gates** (evaluation, teacher-forced or a cache's prefill): ``evict = logit > threshold``.  A
  token evicted at ``t`` is visible up to query ``t + w - 1``, i.e. ``evict_at[t] = t + w`` and
  ``NEVER`` for kept tokens (:func:`gate_evict_at`): exactly the sparse-attention kernel's mask, so
  it runs ``kvpop_kernels.sparse_attention``.
* **Auxiliary loss** (:func:`dms_loss`): ``mean_b relu(target_evict - evict_frac_b)`` over the hard
  (straight-through) decisions of all layers, heads and tokens ``t >= s`` of sequence ``b``, with
  ``target_evict = 1 - 1/CR(step)`` and ``CR`` rising linearly from 1 to ``1 / target_keep`` over
  ``schedule_steps`` (:func:`dms_target`).
* **Ragged cache** (:class:`DMSCache`): per layer and KV head the sinks, a ring of the window, and the
  long-range tokens it kept (``kept_len[h]`` of them) in pages of a pool the layer's heads share;
  memory is what each head keeps (plus a partial page per head and a bounded spare pool), not a
  padded maximum; a decode step reads nothing back to the host.

``patch_dms`` / ``unpatch_dms`` attach and remove it (the same model families as ``kvpop.patch``; a
model carries KVpop or DMS, not both).  ``kvpop train --method dms`` trains it (kvpop.training.train).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

import kvpop_kernels
from kvpop.models import adapter_for, cache_kwarg_name
from kvpop_kernels import NEVER

from .attention import register_attention
from .cache import cache_settings
from .patching import is_patched, state_owner

__all__ = ["DMSConfig", "DMSLayer", "DMSCache", "DMSCacheLayer", "gumbel_sigmoid", "logistic_noise",
           "set_dms_generator", "dms_attention", "gate_evict_at", "dms_target", "patch_dms", "unpatch_dms",
           "is_dms_patched", "get_dms_config", "dms_layers", "dms_loss", "set_dms_step", "make_dms_teacher", "save_dms",
           "load_dms", "read_dms_config", "DMS_ATTN_NAME", "head_entries"]

DMS_ATTN_NAME = "kvpop_dms"
FORMAT = "kvpop-dms-gates/1"
_STATE_ATTR = "_kvpop_dms_state"


def _check_int(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")


def _check_float(name: str, v: Any, lo: float | None = None, hi: float | None = None, *, open_lo: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (open_lo and v == lo)):
        raise ValueError(f"{name} must be {'>' if open_lo else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")


@dataclass(frozen=True)
class DMSConfig:
    """Settings of DMS (module docstring).

    sinks, window: ``s`` first tokens never evicted; ``w``: the eviction delay (a token marked for
        eviction stays visible while it is among the ``w`` most recent tokens), the same window as KVpop's.
    tau: temperature of the Gumbel-sigmoid relaxation in training (default 0.1, the DMS code's).
    gate_offset: the gates' initial bias is ``-gate_offset`` (default 5: eviction probability ~0.7 %).
    threshold: hard decision ``evict = logit > threshold`` at evaluation and decoding (default 0, i.e.
        ``alpha > 1/2``); shifting it trades memory for accuracy without retraining.
    target_keep: the keep fraction the auxiliary loss drives the gates to at the end of the schedule
        (compression ratio ``1 / target_keep``; default 0.125).
    schedule_steps: steps over which the target compression ratio rises linearly from 1 (default 100).
    aux_weight: weight of the auxiliary loss (default 1).
    """

    sinks: int = 4
    window: int = 256
    tau: float = 0.1
    gate_offset: float = 5.0
    threshold: float = 0.0
    target_keep: float = 0.125
    schedule_steps: int = 100
    aux_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_int("sinks", self.sinks, 0)
        _check_int("window", self.window, 1)
        _check_int("schedule_steps", self.schedule_steps, 1)
        _check_float("tau", self.tau, 0.0, open_lo=True)
        _check_float("gate_offset", self.gate_offset)
        _check_float("threshold", self.threshold)
        _check_float("target_keep", self.target_keep, 0.0, 1.0, open_lo=True)
        _check_float("aux_weight", self.aux_weight, 0.0)

    def replace(self, **overrides: Any) -> DMSConfig:
        names = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(overrides) - names)
        if bad:
            raise TypeError(f"unknown DMSConfig field(s) {bad}; valid fields: {sorted(names)}")
        return dataclasses.replace(self, **overrides)

    def to_json(self) -> str:
        return json.dumps({"method": "dms", **dataclasses.asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> DMSConfig:
        d = json.loads(s)
        d.pop("method", None)
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"unknown DMSConfig field(s) {bad}")
        return cls(**d)


def dms_target(config: DMSConfig, step: int) -> float:
    """Target eviction fraction at optimiser step ``step``: ``1 - 1/CR`` with ``CR`` linear from 1 to
    ``1 / target_keep`` over ``schedule_steps`` (constant after)."""
    progress = min(max(step, 0) / config.schedule_steps, 1.0)
    cr = 1.0 + (1.0 / config.target_keep - 1.0) * progress
    return 1.0 - 1.0 / cr


# ----------------------------------------------------------------------------------- the math
def logistic_noise(shape: tuple[int, ...], *, device: torch.device | str | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Logistic noise ``log(u) - log(1 - u)`` (the difference of two standard Gumbel samples), float32."""
    u = torch.rand(shape, device=device, generator=generator, dtype=torch.float32)
    u = u.clamp(1e-6, 1.0 - 1e-6)
    return torch.log(u) - torch.log1p(-u)


def gumbel_sigmoid(logits: torch.Tensor, tau: float, noise: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The relaxed eviction gate of one forward.

    ``logits [..]`` (float) -> ``(soft, alpha, hard)``: ``soft = (logits + noise) / tau`` (noise: logistic,
    drawn here when None; pass zeros for the noise-free relaxation), ``alpha = sigmoid(soft)`` the
    eviction probability, ``hard`` the decision ``alpha > 1/2`` as 0/1 with the straight-through
    gradient of ``alpha``.  ``log(1 - alpha) = logsigmoid(-soft)`` is the attention bias of the mask.
    """
    if noise is None:
        noise = logistic_noise(tuple(logits.shape), device=logits.device)
    soft = (logits.float() + noise) / tau
    alpha = torch.sigmoid(soft)
    hard = (alpha > 0.5).to(alpha.dtype) - alpha.detach() + alpha
    return soft, alpha, hard


def gate_evict_at(evict: torch.Tensor, *, sinks: int, window: int, offset: int = 0) -> torch.Tensor:
    """Hard gates ``evict`` (bool ``[B, Hkv, S]``, position ``offset + i``) -> int32 ``evict_at``:
    ``t + w`` where a token ``t >= s`` is evicted, ``NEVER`` elsewhere (docs/DESIGN.md mask rule)."""
    S = evict.shape[-1]
    t = torch.arange(offset, offset + S, device=evict.device, dtype=torch.int64)
    ev = torch.where(evict & (t >= sinks), t + window, torch.full_like(t, NEVER))
    return ev.clamp(max=NEVER).to(torch.int32)


def dms_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_keep: torch.Tensor, *, sinks: int,
                  window: int, scale: float | None = None, chunk: int = 512) -> torch.Tensor:
    """Attention under DMS's relaxed delayed-eviction mask (dense, PyTorch, differentiable everywhere).

    ``q [B, Hq, S, D]``, ``k, v [B, Hkv, S, D]``, ``log_keep [B, Hkv, S]`` (``log(1 - alpha_t)``, ``<= 0``;
    ``-inf`` evicts hard) -> ``out [B, Hq, S, D]`` in q's dtype.  Logit of query ``q`` for key ``t``:
    ``scale q.k_t`` plus ``log_keep[t]`` when ``t >= s`` and ``t <= q - w`` (out of the window); ``-inf``
    for ``t > q``.  Queries go in chunks of ``chunk`` (memory ``chunk x S`` per head).
    """
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv or k.shape != v.shape or log_keep.shape != (B, Hkv, S):
        raise ValueError(f"need q [B, Hq, S, D], k/v [B, Hkv, S, D] with Hkv | Hq, log_keep [B, Hkv, S]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(log_keep.shape)}")
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    kf, vf = k.float(), v.float()
    bias = log_keep.float().unsqueeze(2)  # [B, Hkv, 1, S]
    t = torch.arange(S, device=q.device)
    outs = []
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        qc = q[:, :, c0:c1].float().reshape(B, Hkv, G, c1 - c0, D)
        logits = torch.einsum("bhgcd,bhtd->bhgct", qc, kf) * scale
        qpos = torch.arange(c0, c1, device=q.device).view(-1, 1)
        old = (t.view(1, -1) <= qpos - window) & (t.view(1, -1) >= sinks)  # [C, S]
        logits = logits + torch.where(old, bias.unsqueeze(2), torch.zeros((), device=q.device))
        logits = logits.masked_fill(t.view(1, -1) > qpos, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        outs.append(torch.einsum("bhgct,bhtd->bhgcd", p, vf).reshape(B, Hq, c1 - c0, D))
    return torch.cat(outs, dim=2).to(q.dtype)


# ----------------------------------------------------------------------------------- the layer
class DMSLayer(nn.Module):
    """What :func:`patch_dms` attaches to one attention module (as ``attn.dms``): the gate head.

    ``gate``: ``nn.Linear(hidden_size, Hkv)`` in float32 (zero weight, bias ``-gate_offset``).  Transient:
    ``hidden`` (the attention module's input of the current call, set by a forward pre-hook),
    ``active_cache``, ``last_evict`` (the decisions ``[B, Hkv, S]`` of the last full-sequence forward:
    straight-through hard gates in training, 0/1 otherwise; sinks 0), ``last_logits``.
    """

    def __init__(self, config: DMSConfig, hidden_size: int, num_kv_heads: int, head_dim: int, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.gate = nn.Linear(hidden_size, num_kv_heads)
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.bias.fill_(-config.gate_offset)
        self.hidden: torch.Tensor | None = None
        self.active_cache: Any = None
        self.generator: torch.Generator | None = None  # the training's noise stream (set_dms_generator)
        self.last_evict: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None

    def extra_repr(self) -> str:
        c = self.config
        return f"layer={self.layer_idx}, sinks={c.sinks}, window={c.window}, threshold={c.threshold}"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gate logits ``[B, Hkv, S]`` (float32) of the attention input ``hidden [B, S, hidden_size]``."""
        w = self.gate.weight
        return F.linear(hidden.to(w.dtype), w, self.gate.bias).transpose(1, 2).float()

    def capture(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the attention module: its input (the gates' input) and its cache."""
        h = kwargs.get("hidden_states")
        self.hidden = h if h is not None else (args[0] if args else None)
        cache = kwargs.get("cache")
        self.active_cache = cache if cache is not None else kwargs.get("past_key_values")

    def forward(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - not a callable layer
        raise RuntimeError("DMSLayer is driven by the 'kvpop_dms' attention function; do not call it")


def dms_layers(model: nn.Module) -> list[DMSLayer]:
    return sorted((m for m in model.modules() if isinstance(m, DMSLayer)), key=lambda m: m.layer_idx)


# ----------------------------------------------------------------------------------- attention function
def _register() -> None:
    register_attention(DMS_ATTN_NAME, dms_attention_forward)


def dms_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"kvpop_dms"`` attention function: relaxed mask in training, hard gates otherwise, or the
    :class:`DMSCache` when the model is called with one.  Returns ``(out [B, S, Hq, D], None)``."""
    layer = getattr(module, "dms", None)
    if not isinstance(layer, DMSLayer):
        raise RuntimeError(f"attention implementation {DMS_ATTN_NAME!r} is set but {type(module).__name__} carries "
                           f"no DMSLayer: use kvpop.core.dms.patch_dms(model)")
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
    logits = layer.logits(hidden)  # [B, Hkv, S_new]
    if isinstance(cache, DMSCache):
        out = _cache_attention(cache, module, query, key, value, logits, scaling)
        if out is not None:
            return out, None
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError("DMS attention got fewer queries than keys: decode with kvpop.core.dms.DMSCache")
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


# ----------------------------------------------------------------------------------- patching
def is_dms_patched(model: nn.Module) -> bool:
    return _owner(model) is not None


def _owner(model: nn.Module) -> nn.Module | None:
    return state_owner(model, _STATE_ATTR)


def get_dms_config(model: nn.Module) -> DMSConfig:
    owner = _owner(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} is not DMS-patched: call kvpop.core.dms.patch_dms(model) first")
    return getattr(owner, _STATE_ATTR)["config"]


def patch_dms(model: nn.Module, config: DMSConfig | None = None, **overrides: Any) -> nn.Module:
    """Attach DMS gates to every attention layer of ``model`` (in place; idempotent) and return it.

    A DMS-patched model takes a new config (e.g. ``patch_dms(model, threshold=1.5)``) without losing its
    gates.  A KVpop-patched model raises ``ValueError`` (``kvpop.unpatch`` it first).
    """
    adapter = adapter_for(model)
    adapter.check_config(model.config.get_text_config())
    if is_patched(model):
        raise ValueError("the model is patched with KVpop; a model carries one method: kvpop.unpatch(model) first")
    if config is not None and not isinstance(config, DMSConfig):
        raise TypeError(f"config must be a DMSConfig or None, got {type(config).__name__}")
    state = getattr(model, _STATE_ATTR, None)
    base = config if config is not None else (state["config"] if state is not None else DMSConfig())
    new = base.replace(**overrides) if overrides else base
    _register()
    if state is not None:
        for layer in dms_layers(model):
            layer.config = new
        state["config"] = new
        model.dms_config = new
        return model
    handles = []
    hidden_size = model.config.get_text_config().hidden_size
    for attn in adapter.attention_modules(model):
        layer = DMSLayer(new, hidden_size, adapter.num_kv_heads(attn), adapter.head_dim(attn), attn.layer_idx)
        layer.to(device=adapter.weight_device(attn), dtype=torch.float32)
        attn.dms = layer
        handles.append(attn.register_forward_pre_hook(layer.capture, with_kwargs=True))
    orig = model.config._attn_implementation
    model.config._attn_implementation = DMS_ATTN_NAME
    setattr(model, _STATE_ATTR, {"config": new, "orig_attn": orig, "handles": handles, "step": 0})
    model.dms_config = new
    if "_prepare_cache_for_generation" not in model.__dict__ and hasattr(model, "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = _DefaultDMSCache(model)
    return model


class _DefaultDMSCache:
    """``model.generate(...)`` of a DMS-patched model decodes through a fresh :class:`DMSCache` when the
    caller passed no cache (the same rule as ``kvpop.patch``'s default ``KVpopCache``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        given = any(model_kwargs.get(n) is not None for n in ("cache", "past_key_values"))
        if not given and generation_config.use_cache is not False and generation_config.cache_implementation is None:
            model_kwargs[cache_kwarg_name()] = DMSCache(model)
        return type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)


def unpatch_dms(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_dms` in place (gates removed and lost); a model that is not DMS-patched is returned."""
    owner = _owner(model)
    if owner is None:
        return model
    state = getattr(owner, _STATE_ATTR)
    for h in state["handles"]:
        h.remove()
    for attn in owner.modules():
        if isinstance(attn._modules.get("dms"), DMSLayer):
            del attn._modules["dms"]
    owner.config._attn_implementation = state["orig_attn"]
    delattr(owner, _STATE_ATTR)
    for attr in ("dms_config", "_prepare_cache_for_generation"):
        owner.__dict__.pop(attr, None)
    return model


def make_dms_teacher(model: nn.Module, *, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen dense copy of a (DMS-patched) model's current weights: the distillation teacher."""
    import copy

    teacher = copy.deepcopy(model)
    unpatch_dms(teacher)
    if device is not None or dtype is not None:
        teacher.to(device=device, dtype=dtype)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


# ----------------------------------------------------------------------------------- training loss
def set_dms_generator(model: nn.Module, generator: torch.Generator | None) -> None:
    """Draw the relaxation's logistic noise of every DMS layer from ``generator`` (``None``: the global
    stream).  ``kvpop.training.train`` gives a training run its own generator, seeded by its seed, so that
    the run draws the same noise whatever ran before it in the process."""
    if not is_dms_patched(model):
        raise ValueError("set_dms_generator needs a DMS-patched model")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    for layer in dms_layers(model):
        layer.generator = generator


def set_dms_step(model: nn.Module, step: int) -> None:
    """Tell the model the optimiser step being taken (1-based; the auxiliary loss's target follows
    :func:`dms_target`, reached at ``step = schedule_steps``)."""
    owner = _owner(model)
    if owner is None:
        raise ValueError("set_dms_step needs a DMS-patched model")
    getattr(owner, _STATE_ATTR)["step"] = int(step)


def dms_loss(model: nn.Module, *, reset: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted auxiliary loss of the last training forward and its statistics.

    ``aux_weight * mean_b relu(target_evict - evict_frac_b)`` with ``evict_frac_b`` the mean hard
    (straight-through) decision over the layers, KV heads and tokens ``t >= s`` of sequence ``b``.
    Statistics: ``keep_frac`` (1 - the mean decision), ``target_keep`` (1 - target), ``aux``.  Returns
    ``(0, ...)`` without grad when no layer recorded decisions (an eval forward).
    """
    owner = _owner(model)
    if owner is None:
        raise ValueError("dms_loss needs a DMS-patched model")
    state = getattr(owner, _STATE_ATTR)
    cfg = state["config"]
    target = dms_target(cfg, state["step"])
    fracs = []
    for layer in dms_layers(owner):
        ev = layer.last_evict
        if ev is None:
            continue
        n_old = max(ev.shape[-1] - cfg.sinks, 1)
        fracs.append(ev.sum(dim=(1, 2)) / (n_old * ev.shape[1]))  # [B]
        if reset:
            layer.last_evict = None
    if not fracs:
        return torch.zeros(()), {"keep_frac": float("nan"), "target_keep": 1.0 - target, "aux": 0.0}
    frac = torch.stack(fracs).mean(0)  # [B]
    aux = torch.relu(target - frac).mean()
    return cfg.aux_weight * aux, {"keep_frac": 1.0 - float(frac.detach().mean()), "target_keep": 1.0 - target,
                                  "aux": float(aux.detach())}


# ----------------------------------------------------------------------------------- checkpoints
def save_dms(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the gates of a DMS-patched model (safetensors, the config in the metadata, atomically)."""
    from safetensors.torch import save_file

    cfg = get_dms_config(model)
    layers = dms_layers(model)
    tensors = {f"layers.{la.layer_idx}.{n}": t.detach().to("cpu", torch.float32).contiguous()
               for la in layers for n, t in la.state_dict().items()}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "dms_config": cfg.to_json(),
                                           "num_layers": str(len(layers))})
    os.replace(tmp, path)


def read_dms_config(path: str | os.PathLike) -> DMSConfig:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a DMS gate file (metadata format={meta.get('format')!r}, expected {FORMAT!r})")
    return DMSConfig.from_json(meta["dms_config"])


def load_dms(model: nn.Module, path: str | os.PathLike, **overrides: Any) -> nn.Module:
    """Load gates saved by :func:`save_dms` (patching the model with the file's config and ``overrides``)."""
    from safetensors.torch import load_file

    cfg = read_dms_config(path).replace(**overrides)
    patch_dms(model, cfg)
    saved = load_file(str(path))
    expected = {f"layers.{la.layer_idx}.{n}": t for la in dms_layers(model) for n, t in la.state_dict().items()}
    if set(saved) != set(expected):
        missing, extra = sorted(set(expected) - set(saved))[:6], sorted(set(saved) - set(expected))[:6]
        raise ValueError(f"DMS gate file {path} does not fit the model: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for key, t in expected.items():
            if saved[key].shape != t.shape:
                raise ValueError(f"DMS gate file {path}: {key} has shape {tuple(saved[key].shape)}, the model needs "
                                 f"{tuple(t.shape)}")
            t.copy_(saved[key].to(t.device, t.dtype))
    return model


# ----------------------------------------------------------------------------------- the ragged cache
class DMSCacheLayer(CacheLayerMixin):
    """One layer of :class:`DMSCache` (batch 1): per KV head a fixed part and a paged long-range store.

    Fixed part: ``s`` sink slots and a ring of ``w`` window slots per head (token ``t`` in slot
    ``s + (t - s) % w``; ``fixed_k/fixed_v [Hkv, s + w, D]``) and the gate decision of each ring token
    (``ring_evict [Hkv, w]``).  Long-range store: the tokens a head kept when they left the window, in
    order, in pages of ``page`` tokens from a pool the layer's heads share (``pool_k/pool_v [n_pages,
    page, D]``, ``pool_pos [n_pages, page]``); head ``h``'s ``i``-th kept token sits at
    ``pool[table[h, i // page], i % page]`` and ``kept_len[h]`` counts them (all on the device).  Page 0
    is a scratch page no head owns (the writes of heads that keep nothing land there) and the table's
    last column a write-off column.  Nothing is ever removed (a DMS decision is final).

    A decode step reads nothing back to the host: the host keeps upper bounds of the pages in use and
    of the longest head since it last read them (at most one new page per head every ``page`` steps),
    and reads them again only when the bounds could pass the capacity, then grows the pool and table
    by ``growth`` (or to room for ``lookahead`` more pages per head, whichever is more).  Memory is the
    pages the heads fill (at most ``page - 1`` spare slots each) plus that spare pool, never a padded
    maximum over heads.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, *, sinks: int, window: int, threshold: float, page: int = 16, growth: float = 1.25,
                 lookahead: int = 4):
        super().__init__()
        _check_int("page", page, 1)
        _check_int("lookahead", lookahead, 1)
        _check_float("growth", growth, 1.0)
        self.sinks, self.window, self.threshold = sinks, window, threshold
        self.page, self.growth, self.lookahead = page, growth, lookahead
        self.seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, hkv, _, d = key_states.shape
        dev, dt = key_states.device, key_states.dtype
        self.device, self.dtype = dev, dt
        n = self.sinks + self.window
        self.fixed_k = torch.zeros(hkv, n, d, dtype=dt, device=dev)
        self.fixed_v = torch.zeros(hkv, n, value_states.shape[-1], dtype=dt, device=dev)
        self.ring_evict = torch.zeros(hkv, self.window, dtype=torch.bool, device=dev)
        self.pool_k = torch.zeros(1, self.page, d, dtype=dt, device=dev)
        self.pool_v = torch.zeros(1, self.page, value_states.shape[-1], dtype=dt, device=dev)
        self.pool_pos = torch.full((1, self.page), -1, dtype=torch.int32, device=dev)
        self.table = torch.zeros(hkv, 1, dtype=torch.int64, device=dev)  # no page column yet + write-off
        self.kept_len = torch.zeros(hkv, dtype=torch.int64, device=dev)
        self.next_free = torch.ones((), dtype=torch.int64, device=dev)
        self._read_pages, self._read_longest, self._steps = 1, 0, 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if key_states.shape[0] != 1:
            raise NotImplementedError(f"DMSCache decodes one sequence at a time (batch 1); got batch "
                                      f"{key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.seen = 0
        self.pending = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("DMSCache does not support beam search (batch size 1 only)")

    def slot_of(self, pos: int) -> int:
        return pos if pos < self.sinks else self.sinks + (pos - self.sinks) % self.window

    # -- capacity (host) -------------------------------------------------------------------------------
    def _bounds(self, steps: int) -> tuple[int, int]:
        """Upper bounds of (pages in use, longest head) after ``steps`` more one-token appends."""
        k = self._steps + steps
        return self._read_pages + self.kept_len.shape[0] * -(-k // self.page), self._read_longest + k

    def _read_back(self) -> None:
        self._read_pages, self._read_longest = (int(x) for x in torch.stack([self.next_free,
                                                                              self.kept_len.max()]).tolist())
        self._steps = 0

    def _grow(self, pages: int, longest: int) -> None:
        """Pool of at least ``pages`` pages and a table of at least ``ceil(longest / page)`` columns."""
        cap = self.pool_k.shape[0]
        if pages > cap:
            new = max(pages, math.ceil(cap * self.growth))
            for name in ("pool_k", "pool_v", "pool_pos"):
                old = getattr(self, name)
                buf = old.new_full((new, *old.shape[1:]), -1 if name == "pool_pos" else 0)
                buf[:cap] = old
                setattr(self, name, buf)
        cols, width = -(-longest // self.page), self.table.shape[1] - 1
        if cols > width:
            new = max(cols, math.ceil(width * self.growth))
            buf = torch.zeros(self.table.shape[0], new + 1, dtype=torch.int64, device=self.table.device)
            buf[:, :width] = self.table[:, :width]
            self.table = buf

    def _reserve_steps(self, steps: int) -> None:
        """Room for ``steps`` more one-token appends per head; reads back only when the bounds pass."""
        pages, longest = self._bounds(steps)
        if pages <= self.pool_k.shape[0] and -(-longest // self.page) <= self.table.shape[1] - 1:
            return
        self._read_back()
        self._grow(*self._bounds(max(steps, self.lookahead * self.page)))

    # -- the long-range store (device) -----------------------------------------------------------------
    def _write(self, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append, per head ``h``, the tokens ``i`` with ``keep[h, i]`` (``keep [Hkv, m]``, ``k/v [Hkv, m, D]``,
        ``pos [m]``), in order; the capacity must have been reserved."""
        P = self.page
        H, m = keep.shape
        W = self.table.shape[1] - 1
        idx = torch.where(keep, self.kept_len[:, None] + keep.long().cumsum(1) - 1, 0)  # [H, m]
        newp = keep & (idx % P == 0)
        ids = self.next_free + newp.flatten().long().cumsum(0).view(H, m) - 1
        self.table.scatter_(1, torch.where(newp, idx // P, W), torch.where(newp, ids, 0))
        page = torch.where(keep, self.table.gather(1, (idx // P).clamp(max=W)), 0).flatten()
        off = torch.where(keep, idx % P, 0).flatten()
        self.pool_k.index_put_((page, off), k.reshape(H * m, -1).to(self.pool_k.dtype))
        self.pool_v.index_put_((page, off), v.reshape(H * m, -1).to(self.pool_v.dtype))
        self.pool_pos.index_put_((page, off), pos.to(torch.int32).expand(H, m).reshape(-1))
        self.kept_len += keep.sum(1)
        self.next_free += newp.sum()

    def extend(self, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append many tokens at once (a prefill): reads the per-head counts back once and reserves exactly."""
        lens = self.kept_len.tolist()
        adds = keep.sum(1).tolist()
        P = self.page
        new_pages = sum(-(-(n + a) // P) - -(-n // P) for n, a in zip(lens, adds))
        self._read_back()
        self._grow(self._read_pages + new_pages, max(n + a for n, a in zip(lens, adds)))
        self._write(keep, k, v, pos)
        self._read_back()

    def long_positions(self) -> list[list[int]]:
        """Positions of the long-range tokens each head holds, in order (reads the device)."""
        out = []
        for h, n in enumerate(self.kept_len.tolist()):
            i = torch.arange(n, device=self.table.device)
            out.append(self.pool_pos[self.table[h, i // self.page], i % self.page].tolist())
        return out

    def head_entries(self) -> list[int]:
        """Entries each KV head holds now: sinks and window tokens seen, plus its kept long-range tokens."""
        fixed = min(self.seen, self.sinks + self.window)
        return [fixed + n for n in self.kept_len.tolist()] if self.is_initialized else []

    def nbytes(self) -> int:
        """Bytes allocated by this layer: the fixed slots, the page pool and its tables."""
        if not self.is_initialized:
            return 0
        ts = [self.fixed_k, self.fixed_v, self.ring_evict, self.pool_k, self.pool_v, self.pool_pos, self.table,
              self.kept_len]
        return sum(t.numel() * t.element_size() for t in ts)

    def kept_bytes(self) -> int:
        """Bytes of the keys and values the heads hold (without unused capacity)."""
        if not self.is_initialized:
            return 0
        fk, fv = self.fixed_k, self.fixed_v
        per = fk.shape[-1] * fk.element_size() + fv.shape[-1] * fv.element_size()
        return per * sum(self.head_entries())

    def attend(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per query head ``q [Hq, D]`` over what each KV head holds -> ``[Hq, D]`` (q's dtype):
        ``kvpop_kernels.ragged_paged_decode`` (each head costs its own length on the Triton path), over
        the table's columns up to the host's bound of the longest head."""
        n_fixed = min(self.seen, self.sinks + self.window)
        pages, longest = self._bounds(0)
        pages = min(pages, self.pool_k.shape[0])  # the spare pool is never referenced
        cols = min(-(-longest // self.page), self.table.shape[1] - 1)
        out, _ = kvpop_kernels.ragged_paged_decode(q, self.fixed_k, self.fixed_v, n_fixed, self.pool_k[:pages],
                                                   self.pool_v[:pages], self.table[:, :cols], self.kept_len,
                                                   scale=scale, check=False)  # no host read per step
        return out


class DMSCache(Cache):
    """Per-KV-head ragged cache for batch-1 decoding with a DMS-patched model (:func:`patch_dms`).

    Each head keeps the sinks, the window and the long-range tokens its gates kept, so heads hold
    different numbers of tokens (:meth:`head_entries`); the long-range tokens live in pages of ``page``
    tokens (:class:`DMSCacheLayer`), so memory (:meth:`nbytes`) is what the heads hold plus at most
    ``page - 1`` slots per head and a spare pool of at most ``growth - 1`` of the pages in use or
    ``lookahead`` pages per head, never a padded maximum over heads.  Prefill (the first call, several
    tokens) is the teacher-forced hard-gate forward (``sparse_attention`` with :func:`gate_evict_at`);
    every later token is one decode step over all heads at once, which reads nothing back to the host.
    ``threshold`` overrides the model's ``DMSConfig.threshold``.
    """

    def __init__(self, model: Any = None, *, config: DMSConfig | None = None, num_layers: int | None = None,
                 threshold: float | None = None, page: int = 16, lookahead: int = 4):
        config, num_layers = cache_settings("DMSCache", model, config, num_layers, attr="dms_config",
                                            how="a DMS-patched model (patch_dms(model)) or config=DMSConfig(...)")
        self.dms_config = config
        thr = config.threshold if threshold is None else float(threshold)
        super().__init__(layers=[DMSCacheLayer(sinks=config.sinks, window=config.window, threshold=thr, page=page,
                                               lookahead=lookahead) for _ in range(num_layers)])

    def head_entries(self) -> torch.Tensor:
        """Entries held per layer and KV head, int64 ``[num_layers, Hkv]``."""
        return torch.tensor([la.head_entries() for la in self.layers], dtype=torch.int64)

    def nbytes(self) -> int:
        return sum(la.nbytes() for la in self.layers)

    def kept_bytes(self) -> int:
        return sum(la.kept_bytes() for la in self.layers)


def head_entries(cache: DMSCache) -> torch.Tensor:
    return cache.head_entries()


def _cache_attention(cache: DMSCache, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, logits: torch.Tensor, scaling: float | None) -> torch.Tensor | None:
    if module.layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[module.layer_idx]
    pending, layer.pending = layer.pending, None
    if pending is None or pending[0] is not key:
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    S = query.shape[2]
    pos = torch.arange(layer.seen, layer.seen + S, device=key.device)
    evict = (logits[0] > layer.threshold) & (pos >= layer.sinks)  # [Hkv, S]
    if layer.seen == 0 and S > 1:
        return _prefill(layer, query, key, value, evict, scale)
    outs = [_decode(layer, query[0, :, i], key[0, :, i], value[0, :, i], evict[:, i], scale) for i in range(S)]
    return torch.stack(outs, dim=0).unsqueeze(0)  # [1, S, Hq, D]


def _prefill(layer: DMSCacheLayer, query, key, value, evict, scale) -> torch.Tensor:
    s, w = layer.sinks, layer.window
    S = key.shape[2]
    ev = gate_evict_at(evict[None], sinks=s, window=w)
    out, _ = kvpop_kernels.sparse_attention(query, key, value, ev, sinks=s, window=w, scale=scale)
    kk, vv = key[0], value[0]
    n_sink = min(s, S)
    layer.fixed_k[:, :n_sink] = kk[:, :n_sink]
    layer.fixed_v[:, :n_sink] = vv[:, :n_sink]
    win = torch.arange(max(s, S - w), S, device=kk.device)
    if win.numel():
        slots = s + (win - s) % w
        layer.fixed_k[:, slots] = kk[:, win]
        layer.fixed_v[:, slots] = vv[:, win]
        layer.ring_evict[:, slots - s] = evict[:, win]
    left = torch.arange(s, max(s, S - w), device=kk.device)  # tokens that have left the window
    if left.numel():
        layer.extend(~evict[:, left], kk[:, left], vv[:, left], left)
    layer.seen = S
    return out.transpose(1, 2)


def _decode(layer: DMSCacheLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, evict: torch.Tensor,
            scale: float) -> torch.Tensor:
    """One token at position ``layer.seen``: ``q [Hq, D]``, ``k/v [Hkv, D]``, ``evict [Hkv]`` -> ``[Hq, D]``.
    No value is read back to the host (but for a rare capacity check, :class:`DMSCacheLayer`)."""
    s, w = layer.sinks, layer.window
    p = layer.seen
    slot = layer.slot_of(p)
    if p >= s + w:  # token p - w leaves the window now: the heads that kept it store it
        layer._reserve_steps(1)
        pos = torch.full((1,), p - w, dtype=torch.int64, device=k.device)
        layer._write(~layer.ring_evict[:, slot - s, None], layer.fixed_k[:, slot:slot + 1],
                     layer.fixed_v[:, slot:slot + 1], pos)
        layer._steps += 1
    layer.fixed_k[:, slot] = k
    layer.fixed_v[:, slot] = v
    if p >= s:
        layer.ring_evict[:, slot - s] = evict
    layer.seen = p + 1
    return layer.attend(q, scale)
