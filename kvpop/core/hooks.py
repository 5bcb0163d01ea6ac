"""``ScorerHooks``: the learned scorer's priorities for a ``KVpopCache`` while decoding."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layer import KVpopLayer
from .priority import priority

__all__ = ["ScorerHooks"]


class ScorerHooks:
    """The learned scorer's priorities for ``kvpop.KVpopCache`` (its ``PriorityHooks`` protocol).

    Built per attention call from the layer and the pre-RoPE keys of the call's new tokens
    (``k_pre [N, Hkv, S_new, D]``; the cache passes rotated keys, the scorer reads pre-RoPE ones).
    The decode-time hooks take the rows' positions ``pos [N]`` as a device tensor and the token's
    column ``i`` in the call: nothing here reads a value back to the host.

    * ``prompt(module, cache_layer, key, value) -> [N, Hkv, S]``: ``r_hat - t log(gamma)`` of the whole
      prompt, exactly as in a full-sequence forward.  The mLSTM scorer also leaves in
      ``cache_layer.scorer_state`` its decoding state (``MLSTMScorer.decode_state``: the state at the
      start of the chunk the next token falls in and that chunk's features so far) followed by a ring
      ``[N, Hkv, w, D]`` of the pre-RoPE keys of the last ``w`` tokens (token ``t`` at ``t % w``),
      which it needs to score a token when it leaves the window.
    * ``token(module, cache_layer, key_new, value_new, pos, i) -> [N, Hkv]`` (MLP scorer): the priority
      of the new token, known at entry.
    * ``leaving(module, cache_layer, key_new, value_new, pos, i) -> [N, Hkv]`` (mLSTM scorer): absorbs
      the new token into the state, then scores ``t = pos - w`` (value read from the cache's window
      slot, pre-RoPE key from the ring) by ``MLSTMScorer.decode_leaving``: the read-out has then seen
      exactly the tokens up to ``t + w``, through the training's own chunk function, so the priority
      has the bits of a full-sequence forward.  The state is updated in place (its storage never changes).

    Every priority comes from ``kvpop.core.priority.priority`` (docs/DESIGN.md 2.4 and 7).
    * ``rows(idx, start)``: the hooks of rows ``idx`` and columns ``start:`` (a padded prompt's group).
    """

    def __init__(self, layer: KVpopLayer, k_pre: torch.Tensor | None) -> None:
        self.layer = layer
        self.k_pre = k_pre
        recurrent = getattr(layer.scorer, "lookahead_uses_window", False)
        self.token = None if recurrent else self._token
        self.leaving = self._leaving if recurrent else None

    def rows(self, idx: torch.Tensor, start: int) -> ScorerHooks:
        return ScorerHooks(self.layer, None if self.k_pre is None else self.k_pre[idx, :, start:])

    def _k_pre_at(self, i: int) -> torch.Tensor:
        if self.k_pre is None:
            raise RuntimeError("kvpop: the pre-RoPE keys of this call were not captured")
        return self.k_pre[:, :, i]

    def prompt(self, module: nn.Module, cache_layer: Any, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        with torch.no_grad():
            if getattr(layer.scorer, "lookahead_uses_window", False):
                r, state = layer.scorer(self.k_pre, value, return_state=True)
                S, w = value.shape[2], layer.config.window
                ring = torch.zeros(value.shape[0], value.shape[1], w, value.shape[3], dtype=self.k_pre.dtype,
                                   device=value.device)
                t = torch.arange(max(0, S - w), S, device=value.device)
                ring[:, :, t % w] = self.k_pre[:, :, t]
                cache_layer.scorer_state = (*state, ring)
            else:
                r = layer.scorer(self.k_pre, value)
            return priority(r, torch.arange(r.shape[-1], device=r.device), layer.log_gamma())

    def _token(self, module: nn.Module, cache_layer: Any, key_new: torch.Tensor, value_new: torch.Tensor,
               pos: torch.Tensor, i: int) -> torch.Tensor:
        layer = self.layer
        with torch.no_grad():
            r = layer.scorer(self._k_pre_at(i), value_new)  # [N, Hkv]
            return priority(r, pos, layer.log_gamma())

    def _leaving(self, module: nn.Module, cache_layer: Any, key_new: torch.Tensor, value_new: torch.Tensor,
                 pos: torch.Tensor, i: int) -> torch.Tensor:
        layer = self.layer
        sc = layer.scorer
        w = layer.config.window
        N, hkv, D = value_new.shape
        with torch.no_grad():
            kp = self._k_pre_at(i)
            if cache_layer.scorer_state is None:  # decoding from an empty cache (no prompt pass)
                ring = torch.zeros(N, hkv, w, D, dtype=kp.dtype, device=value_new.device)
                cache_layer.scorer_state = (*sc.decode_state(N, value_new.device), ring)
            *state, ring = cache_layer.scorer_state
            t = (pos - w).clamp_min(0)  # rows with pos < w: a score nobody reads (the step ignores it)
            v_t = cache_layer.window_values(t)
            k_t = ring.gather(2, (t % w)[:, None, None, None].expand(N, hkv, 1, D)).squeeze(2)
            r = sc.decode_leaving(tuple(state), kp, value_new, pos, k_t.to(kp.dtype), v_t)
            ring.scatter_(2, (pos % w)[:, None, None, None].expand(N, hkv, 1, D), kp.to(ring.dtype).unsqueeze(2))
            return priority(r, t, layer.log_gamma())
