"""DMS's gates and their maths: the relaxation, the hard-gate schedule, the relaxed masked attention
and :class:`DMSLayer`, the gate head :func:`kvpop.baselines.dms.patch_dms` attaches to each attention module."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpop_kernels import NEVER

from .config import DMSConfig

__all__ = ["logistic_noise", "gumbel_sigmoid", "gate_evict_at", "dms_attention", "DMSLayer", "dms_layers"]


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
        cache = self.active_cache = cache if cache is not None else kwargs.get("past_key_values")
        claim = getattr(cache, "claim", None)
        if claim is not None:  # a DMS / kvpop cache checks at its first call that this model serves it
            active = getattr(getattr(module, "config", None), "_attn_implementation", None) == "kvpop_dms"
            h = self.hidden
            claim(self.layer_idx, "dms", self.config, active,
                  h.shape[1] if isinstance(h, torch.Tensor) and h.dim() == 3 else None)

    def forward(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - not a callable layer
        raise RuntimeError("DMSLayer is driven by the 'kvpop_dms' attention function; do not call it")


def dms_layers(model: nn.Module) -> list[DMSLayer]:
    return sorted((m for m in model.modules() if isinstance(m, DMSLayer)), key=lambda m: m.layer_idx)

