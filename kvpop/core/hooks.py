"""``ScorerHooks``: the learned scorer's priorities for a ``KVpopCache`` while decoding."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layer import KVpopLayer

__all__ = ["ScorerHooks"]


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
            raise RuntimeError(f"kvpop: position {pos} is not among this call's tokens "
                               f"({self._pos0}..{self._pos0 + n - 1})")
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
