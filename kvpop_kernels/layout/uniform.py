"""The uniform layout: every KV head holds the same ``B`` slots (``k_cache, v_cache [N, Hkv, B, D]``,
``slot_pos [N, Hkv, B]``, ``slot_prio [N, Hkv, k]``)."""
from __future__ import annotations

import torch

from .._utils import check_int, check_tensor
from .base import (
    _INT32_MAX,
    HeadSpan,
    SlotLayout,
    _attend,
    _batch_lead,
    _check_common,
    _check_inputs,
    _check_new,
    _decide,
    _finish,
    _guard,
)
from .state import DecodeStep, SlotState, slot_of

__all__ = ["UniformLayout"]


class UniformLayout(SlotLayout):
    """Every KV head holds the same ``B`` slots (``budget``; None: whatever the tensors hold)."""

    def __init__(self, budget: int | None = None):
        if budget is not None:
            check_int("budget", budget, minimum=1)
        self.budget = budget

    def __repr__(self) -> str:
        return f"UniformLayout(budget={self.budget})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.budget == self.budget

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.budget))

    def _need_budget(self) -> int:
        if self.budget is None:
            raise ValueError("this UniformLayout knows no budget: give UniformLayout(budget=B)")
        return self.budget

    def state_shapes(self, n, hkv, sinks, window):
        B = self._need_budget()
        return (n, hkv, B), (n, hkv, B - sinks - window)

    def spans(self, hkv, sinks, window):
        B = self._need_budget()
        return [HeadSpan(0, B, 0, B - sinks - window)] * hkv

    def long_range_positions(self, slot_pos, row, hkv, sinks, window):
        return slot_pos[row, :, sinks + window:].tolist()

    def long_range_k(self, hkv, sinks, window):
        return self._need_budget() - sinks - window

    def head_groups(self, hkv, sinks, window):
        B = self._need_budget()
        yield None, HeadSpan(0, B, 0, B - sinks - window)

    def head_state(self, x, head, span, lr=False):
        return x.view(x.shape[0] * x.shape[1], *x.shape[2:])  # [N * Hkv, B or k, ...] (a view, or an error)

    def gather_slots(self, x, slot, offs):
        n, hkv = x.shape[:2]
        idx = slot.view(n, 1, 1, *([1] * (x.dim() - 3))).expand(n, hkv, 1, *x.shape[3:])
        return x.gather(2, idx).squeeze(2)

    def check(self, step: DecodeStep, state: SlotState, sinks: int, window: int, cache_dtypes=None) -> None:
        q, k_new, v_new, leaving_prio = step.q, step.k_new, step.v_new, step.leaving_prio
        k_cache, v_cache, slot_pos, slot_prio = state.k_cache, state.v_cache, state.slot_pos, state.slot_prio
        lead, e = _batch_lead(q)
        _check_inputs(step, state, e, 2)
        check_tensor("k_cache", k_cache, 3 + e, floating=cache_dtypes is None)
        check_tensor("v_cache", v_cache, 3 + e, floating=cache_dtypes is None)
        _check_common(step, state, sinks, window, e, cache_dtypes)
        s, w = sinks, window
        D = q.shape[-1]
        Hkv, B, Dk = k_cache.shape[e:]
        if tuple(v_cache.shape) != (*q.shape[:e], Hkv, B, D) or Dk != D or k_cache.shape[:e] != q.shape[:e]:
            raise ValueError(f"k_cache and v_cache must both be [{lead}Hkv, B, D] with D = q.shape[-1] = {D}, got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        _check_new(q, k_new, v_new, Hkv, e)
        if self.budget is not None and B != self.budget:
            raise ValueError(f"k_cache holds B = {B} slots per head but the layout is {self!r}")
        if B < s + w:
            raise ValueError(f"the budget B = k_cache.shape[-2] = {B} must be >= sinks + window = {s} + {w} = "
                             f"{s + w}")
        if tuple(slot_pos.shape) != (*q.shape[:e], Hkv, B):
            raise ValueError(f"slot_pos must be [{lead}Hkv, B] = {[*q.shape[:e], Hkv, B]}, got "
                             f"{tuple(slot_pos.shape)}")
        if tuple(slot_prio.shape) != (*q.shape[:e], Hkv, B - s - w):
            raise ValueError(f"slot_prio must be [{lead}Hkv, k] = {[*q.shape[:e], Hkv, B - s - w]} "
                             f"(k = B - sinks - window), got {tuple(slot_prio.shape)}")
        if tuple(leaving_prio.shape) != (*q.shape[:e], Hkv):
            raise ValueError(f"leaving_prio must be [{lead}Hkv] = {[*q.shape[:e], Hkv]}, got "
                             f"{tuple(leaving_prio.shape)}")

    def torch_write(self, step: DecodeStep, state: SlotState, *, sinks: int, window: int) -> torch.Tensor:
        """Vectorised over batch rows and heads.  No data-dependent Python branch: every row and head runs
        the same ops (kept or not is a ``torch.where``), so the step traces into one graph
        (``torch.compile(fullgraph=True)``)."""
        slot_pos, slot_prio = state.slot_pos, state.slot_prio
        N = step.q.shape[0]
        _, Hkv, B, _ = state.k_cache.shape
        s, w = sinks, window
        K = B - s - w
        dev = step.q.device
        pos, bad = _guard(step.pos)
        t_new = pos - w  # [N]
        slot_new = slot_of(pos, sinks=s, window=w)  # [N]
        ni = torch.arange(N, device=dev)[:, None]
        hi = torch.arange(Hkv, device=dev)[None, :]
        sn = slot_new[:, None].expand(N, Hkv)
        ok = ~bad[:, None]  # [N, 1]
        moved = state.moved(step)
        if K > 0:
            low_p = slot_prio.amin(dim=-1)  # lowest priority ...
            # ... then the oldest position; ``min`` returns the first index among equal values, which
            # matters only for empty slots (all at -1): the lowest slot index, as in the reference
            older = slot_pos[..., s + w:].masked_fill(slot_prio != low_p[..., None], _INT32_MAX)
            low_t, j = older.min(dim=-1)  # [N, Hkv]
            keep, lp = _decide(low_p, low_t, step.leaving_prio, t_new, s, ok)
            dst = s + w + j
            for c, _ in moved:
                kp = keep.view(*keep.shape, *([1] * (c.dim() - 3)))
                c[ni, hi, dst] = torch.where(kp, c[ni, hi, sn], c[ni, hi, dst])
            slot_pos[ni, hi, dst] = torch.where(keep, t_new[:, None].to(torch.int32), slot_pos[ni, hi, dst])
            slot_prio[ni, hi, j] = torch.where(keep, lp, slot_prio[ni, hi, j])
        for c, new in moved:
            okc = ok.view(N, 1, *([1] * (c.dim() - 3)))
            c[ni, hi, sn] = torch.where(okc, new, c[ni, hi, sn])
        slot_pos[ni, hi, sn] = torch.where(ok, pos[:, None].to(torch.int32), slot_pos[ni, hi, sn])
        return bad

    def attend(self, q, kc, vc, slot_pos, *, scale, bad, sinks, window):
        N, Hq, D = q.shape
        Hkv = kc.shape[1]
        out, lse = _attend(q.float().view(N, Hkv, Hq // Hkv, D), kc, vc, slot_pos >= 0, scale)
        return _finish(out, lse, bad, q)


