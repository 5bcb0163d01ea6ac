"""Priorities that are not learned: the same-structure controls of docs/DESIGN.md section 12.

``KVpopConfig.priority_source`` says where a token's score ``r`` comes from; every source then goes through
the same :func:`kvpop.core.priority.priority` (``p = r - t log(gamma_h)``, the layer's decay, untrained for
these sources: ``gamma_init``), the same schedule and the same cache:

* ``"scorer"`` (the learned scorer) and ``"random"`` (the same scorer at its seeded init, never trained):
  :class:`kvpop.core.hooks.ScorerHooks`;
* ``"keynorm+"`` / ``"keynorm-"``: ``r[h,t] = +/- ||k_pre[h,t]||_2`` (the pre-RoPE key), :func:`keynorm_scores`;
* ``"window-attention"``: ``r[h,t] = log(eps + sum_{u=t}^{t+w-1} mean_g a_u^g(t))``, the attention token ``t``
  received from the ``w`` queries whose window holds it, each normalised over the keys every query sees
  whatever the eviction (its sinks and its window), so that the training forward can compute it in one
  pass and the cache accumulates it while the token sits in the window (:func:`window_attention_sums`);
* ``"oracle-label"``: the exact label (the future-attention target over the dense normaliser): not causal,
  a full-sequence forward or a cache's prefill only; a decode step refuses it.

Training and decoding compute the sums in float64 and cast the score to float32, so the cache's priorities
match the full-sequence forward's (tests/core/test_priority_sources.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import kvpop_kernels
from kvpop_kernels import NEVER

from .hooks import ScorerHooks
from .layer import KVpopLayer
from .priority import priority

__all__ = ["LEARNED_FORM", "dense_lse", "keynorm_scores", "window_attention_sums", "oracle_scores", "source_scores",
           "priority_hooks", "KeyNormHooks", "WindowAttentionHooks", "OracleHooks"]

LEARNED_FORM = ("scorer", "random")
"""Sources whose score is the scorer's output (the learned one, or the frozen one at its seeded init)."""


def keynorm_scores(k_pre: torch.Tensor, sign: float) -> torch.Tensor:
    """``sign * ||k_pre||_2`` over the last axis, float32 (summed in float64: the bits do not depend on how
    many tokens are scored together)."""
    return (torch.linalg.vector_norm(k_pre.detach().double(), dim=-1) * sign).float()


def window_attention_sums(q: torch.Tensor, k: torch.Tensor, *, sinks: int, window: int,
                          scale: float | None = None, block: int = 128) -> torch.Tensor:
    """``[B, Hkv, S]`` float64: for each key ``t`` the sum over the queries ``u = t .. min(t + w - 1, S - 1)``
    (those whose window ``u-w+1 .. u`` holds ``t``) of ``mean_g softmax_u(scale q_u . k)[t]``, each query's
    softmax over its sinks and its window only.  ``q [B, Hq, S, D]`` and ``k [B, Hkv, S, D]`` rotated, as
    the attention sees them.  Queries in blocks of ``block`` (memory ``O(block (block + w + s))`` per head)."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    qd = q.detach().double().view(B, Hkv, G, S, D)
    kd = k.detach().double()
    out = torch.zeros(B, Hkv, S, dtype=torch.float64, device=q.device)
    for a in range(0, S, block):
        b = min(S, a + block)
        lo = max(0, a - window + 1)
        cols = torch.cat([torch.arange(min(sinks, lo), device=q.device), torch.arange(lo, b, device=q.device)])
        u = torch.arange(a, b, device=q.device)
        vis = (cols[None] <= u[:, None]) & ((cols[None] < sinks) | (cols[None] > u[:, None] - window))
        logits = torch.einsum("nhgud,nhcd->nhguc", qd[:, :, :, a:b], kd[:, :, cols]) * scale
        p = torch.softmax(logits.masked_fill(~vis, float("-inf")), dim=-1).mean(2)  # [B, Hkv, u, c]
        out.index_add_(2, cols, p.sum(2))
    return out


def _log_eps(sums: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.log(sums + eps).float()


def dense_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Any, scale: float | None) -> torch.Tensor:
    """The dense attention's LSE ``[B, Hq, S]`` of these queries, keys and values (nothing evicted; no grad): the
    normaliser of the exact label."""
    B, Hkv, S = k.shape[:3]
    with torch.no_grad():
        never = torch.full((B, Hkv, S), NEVER, dtype=torch.int32, device=q.device)
        return kvpop_kernels.sparse_attention(q.detach(), k.detach(), v.detach(), never, sinks=cfg.sinks,
                                              window=cfg.window, scale=scale)[1]


def oracle_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Any, scale: float | None) -> torch.Tensor:
    """The exact label ``[B, Hkv, S]`` of these queries and keys over their dense normaliser (``cfg``'s label)."""
    with torch.no_grad():
        return kvpop_kernels.future_attention_target(q.detach(), k.detach(), dense_lse(q, k, v, cfg, scale),
                                                     scale=scale, **cfg.target_kwargs())


def source_scores(cfg: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pre: torch.Tensor,
                  scale: float | None) -> torch.Tensor:
    """The score ``r [B, Hkv, S]`` (float32) of a source computed from the call's own tensors in a full-sequence
    forward (no grad): the key norm or the window's attention (the oracle: :func:`oracle_scores`)."""
    src = cfg.priority_source
    with torch.no_grad():
        if src in ("keynorm+", "keynorm-"):
            return keynorm_scores(k_pre, 1.0 if src == "keynorm+" else -1.0)
        if src == "window-attention":
            return _log_eps(window_attention_sums(query, key, sinks=cfg.sinks, window=cfg.window, scale=scale),
                            cfg.eps)
    raise ValueError(f"source_scores: priority_source {src!r} is not the key norm or the window's attention")


def priority_hooks(layer: KVpopLayer, k_pre: torch.Tensor | None, query: torch.Tensor, scaling: float | None) -> Any:
    """The ``PriorityHooks`` of ``layer``'s priority source for one attention call of a ``KVpopCache``."""
    src = layer.config.priority_source
    if src in LEARNED_FORM:
        return ScorerHooks(layer, k_pre)
    if src in ("keynorm+", "keynorm-"):
        return KeyNormHooks(layer, k_pre)
    if src == "window-attention":
        return WindowAttentionHooks(layer, query, scaling)
    return OracleHooks(layer, query, scaling)


class KeyNormHooks:
    """``keynorm+`` / ``keynorm-``: the priority of a token is known at entry, from its pre-RoPE key."""

    leaving = None

    def __init__(self, layer: KVpopLayer, k_pre: torch.Tensor | None) -> None:
        if k_pre is None:
            raise RuntimeError("kvpop: the pre-RoPE keys of this call were not captured")
        self.layer, self.k_pre = layer, k_pre
        self.sign = 1.0 if layer.config.priority_source == "keynorm+" else -1.0

    def rows(self, idx: torch.Tensor, start: int) -> KeyNormHooks:
        return KeyNormHooks(self.layer, self.k_pre[idx, :, start:])

    def prompt(self, module: nn.Module, cache_layer: Any, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        r = keynorm_scores(self.k_pre, self.sign)
        return priority(r, torch.arange(r.shape[-1], device=r.device), self.layer.log_gamma().detach())

    def token(self, module: nn.Module, cache_layer: Any, key_new: torch.Tensor, value_new: torch.Tensor,
              pos: torch.Tensor, i: int) -> torch.Tensor:
        r = keynorm_scores(self.k_pre[:, :, i], self.sign)  # [N, Hkv]
        return priority(r, pos, self.layer.log_gamma().detach())


def _uniform_only(cache_layer: Any, what: str) -> None:
    if cache_layer.head_budgets is not None or cache_layer.kv_dtype is not None:
        raise ValueError(f"priority_source={what!r} is served with uniform budgets and full-precision slots "
                         f"(it reads the window's keys): pass a config without head_budgets and kv_dtype=None")


class _QueryHooks:
    """Hooks that read the call's rotated queries (and its scale)."""

    token = None

    def __init__(self, layer: KVpopLayer, query: torch.Tensor, scaling: float | None) -> None:
        self.layer, self.query, self.scaling = layer, query, scaling

    def rows(self, idx: torch.Tensor, start: int) -> _QueryHooks:
        return type(self)(self.layer, self.query[idx, :, start:], self.scaling)


class WindowAttentionHooks(_QueryHooks):
    """``window-attention``: each token's attention sum grows while it sits in the window and is its score
    when it leaves.  The state ``cache_layer.scorer_state`` is ``[N, Hkv, w]`` float64, one sum per ring slot
    (token ``t`` at ``(t - s) % w``, as the window's slots)."""

    def prompt(self, module: nn.Module, cache_layer: Any, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        cfg = self.layer.config
        _uniform_only(cache_layer, cfg.priority_source)
        s, w = cfg.sinks, cfg.window
        sums = window_attention_sums(self.query, key, sinks=s, window=w, scale=self.scaling)
        N, hkv, S = sums.shape
        acc = torch.zeros(N, hkv, w, dtype=torch.float64, device=key.device)
        t = torch.arange(max(s, S - w), S, device=key.device)  # still in the window: partial sums
        acc[:, :, (t - s) % w] = sums[:, :, t]
        cache_layer.scorer_state = acc
        r = _log_eps(sums, cfg.eps)
        return priority(r, torch.arange(S, device=r.device), self.layer.log_gamma().detach())

    def leaving(self, module: nn.Module, cache_layer: Any, key_new: torch.Tensor, value_new: torch.Tensor,
                pos: torch.Tensor, i: int) -> torch.Tensor:
        cfg = self.layer.config
        _uniform_only(cache_layer, cfg.priority_source)
        s, w = cfg.sinks, cfg.window
        N, hkv, D = key_new.shape
        if cache_layer.scorer_state is None:  # decoding from an empty cache
            cache_layer.scorer_state = torch.zeros(N, hkv, w, dtype=torch.float64, device=key_new.device)
        acc = cache_layer.scorer_state
        j = ((pos.clamp_min(s) - s) % w)[:, None, None].expand(N, hkv, 1)  # ring slot of pos - w and of pos
        t = (pos - w).clamp_min(0)
        r = _log_eps(acc.gather(2, j).squeeze(2), cfg.eps)
        # this query's attention over its sinks and window (the cache's slots before this step writes,
        # less the leaving token, plus the new one)
        q = self.query[:, :, i].double().view(N, hkv, -1, D)
        scale = D ** -0.5 if self.scaling is None else float(self.scaling)
        sp = cache_layer.slot_pos[:, :, :s + w].long()
        vis = (sp >= 0) & ((sp < s) | (sp > (pos - w)[:, None, None]))
        logits = torch.einsum("nhgd,nhcd->nhgc", q, cache_layer.keys[:, :, :s + w].double()) * scale
        logits = logits.masked_fill(~vis[:, :, None], float("-inf"))
        new = torch.einsum("nhgd,nhd->nhg", q, key_new.double())[..., None] * scale
        p = torch.softmax(torch.cat([logits, new], -1), dim=-1).mean(2)  # [N, Hkv, s + w + 1]
        acc.add_(p[:, :, s:s + w])
        fresh = torch.where((pos >= s)[:, None, None], p[:, :, -1:], acc.gather(2, j))
        acc.scatter_(2, j, fresh)
        return priority(r, t, self.layer.log_gamma().detach())


class OracleHooks(_QueryHooks):
    """``oracle-label``: the exact label of a prompt (the whole teacher-forced sequence); it needs the queries
    after each token, so a decode step is refused."""

    def prompt(self, module: nn.Module, cache_layer: Any, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        r = oracle_scores(self.query, key, value, self.layer.config, self.scaling)
        return priority(r, torch.arange(r.shape[-1], device=r.device), self.layer.log_gamma().detach())

    def leaving(self, *args: Any) -> torch.Tensor:
        raise ValueError("priority_source='oracle-label' is the exact label, which needs the attention of the queries "
                         "after each token: it is defined for a full-sequence forward or a cache's prefill of a "
                         "whole sequence (teacher-forced evaluation), not for decoding token by token; it is an "
                         "upper bound, not a causal policy")
