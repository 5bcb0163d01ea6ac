"""The packed layout of head-adaptive budgets: one budget ``B_h = s + w + k_h`` per KV head, the heads' slots
back to back (``k_cache, v_cache [N, T, D]`` with ``T = sum B_h``, ``slot_pos [N, T]``, ``slot_prio [N, K]``
with ``K = sum k_h``)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._utils import check_tensor
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

__all__ = ["PackedLayout"]


class _Run(NamedTuple):
    """Consecutive heads ``[h0, h1)`` of one budget ``b``: in the packed layout their slots
    ``[off, off + (h1 - h0) b)`` are a uniform ``[h1 - h0, b]`` block (a view)."""

    h0: int
    h1: int
    off: int
    b: int


class _Plan(NamedTuple):
    """What the steps need of one packed layout (host-known budgets), built once per budgets and device."""

    budgets: tuple[int, ...]
    meta: torch.Tensor  # [3, Hkv] int64: budgets, slot offsets, long-range offsets (the kernels' view)
    off: torch.Tensor  # [Hkv] int64: slot offset of each head
    runs: tuple[_Run, ...]  # the heads cut into runs of equal budgets (the PyTorch path's attention blocks)
    lr_heads: torch.Tensor | None  # [Hl] int64: the heads with k_h > 0 (None: every head)
    n_lr_heads: int  # Hl
    pad_lr: torch.Tensor  # [Hl, kmax] int64: long-range index of each head's j-th slot (padding: its last)
    pad_slot: torch.Tensor  # [Hl, kmax] int64: the slot of the same
    pad: torch.Tensor  # [Hl, kmax] bool: padding (j >= k_h)
    koff_lr: torch.Tensor  # [Hl] int64: long-range offset of each of those heads
    lr0: torch.Tensor  # [Hl] int64: their first long-range slot (off_h + s + w)


_PLANS: dict[tuple, _Plan] = {}


def _plan(budgets: tuple[int, ...], sinks: int, window: int, device: torch.device) -> _Plan:
    key = (budgets, sinks, window, str(device))
    lay = _PLANS.get(key)
    if lay is None:
        if len(_PLANS) > 64:
            _PLANS.clear()
        sw = sinks + window
        offs, koffs = [0], [0]
        for b in budgets:
            offs.append(offs[-1] + b)
            koffs.append(koffs[-1] + b - sw)

        def t(x, dtype=torch.int64):
            return torch.tensor(x, dtype=dtype).to(device)

        runs, h0 = [], 0
        for h in range(1, len(budgets) + 1):
            if h == len(budgets) or budgets[h] != budgets[h0]:
                runs.append(_Run(h0, h, offs[h0], budgets[h0]))
                h0 = h
        ks = [b - sw for b in budgets]
        heads = [h for h, k in enumerate(ks) if k > 0]
        kmax, hl = max(ks), len(heads)
        lay = _Plan(budgets, t([list(budgets), offs[:-1], koffs[:-1]]), t(offs[:-1]), tuple(runs),
                    None if hl == len(budgets) else t(heads), hl,
                    t([[koffs[h] + min(j, ks[h] - 1) for j in range(kmax)] for h in heads]).view(hl, kmax),
                    t([[offs[h] + sw + min(j, ks[h] - 1) for j in range(kmax)] for h in heads]).view(hl, kmax),
                    t([[j >= ks[h] for j in range(kmax)] for h in heads], torch.bool).view(hl, kmax),
                    t([koffs[h] for h in heads]), t([offs[h] + sw for h in heads]))
        _PLANS[key] = lay
    return lay


def _cat(xs: list[torch.Tensor], dim: int) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=dim)


def _check_budget_values(budgets: tuple[int, ...], T: int, sinks: int, window: int) -> None:
    """The host check of packed budgets against the tensors' ``T`` slots."""
    bad = [h for h, b in enumerate(budgets) if b < sinks + window]
    if bad:
        raise ValueError(f"head_budgets[{bad[0]}] = {budgets[bad[0]]} must be >= sinks + window = "
                         f"{sinks + window} (k_h >= 0)")
    if sum(budgets) != T:
        raise ValueError(f"k_cache holds T = {T} slots but head_budgets sum to {sum(budgets)}: the packed "
                         f"layout holds every head's budget back to back (T = sum of the budgets)")


class PackedLayout(SlotLayout):
    """Head-adaptive budgets ``B_h = s + w + k_h`` (``k_h >= 0``), one per KV head, packed back to back.

    ``budgets``: a tuple (or list) of ints, checked on the host, or a 1-D int32/int64 tensor ``[Hkv]`` on
    the step's device (read back under the ``check`` rule of ``fixed_budget_decode``; unchecked, a head
    whose slots do not lie inside the tensors writes nothing and returns NaN)."""

    packed = True
    head_dims = 1

    def __init__(self, budgets):
        if isinstance(budgets, torch.Tensor):
            if budgets.dim() != 1 or budgets.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"head_budgets as a tensor must be 1-D int32/int64 (one budget per KV head), got "
                                 f"{budgets.dtype} {tuple(budgets.shape)}")
        elif isinstance(budgets, (tuple, list)):
            for h, b in enumerate(budgets):
                if isinstance(b, bool) or not isinstance(b, int):
                    raise TypeError(f"head_budgets[{h}] must be an int, got {type(b).__name__} ({b!r})")
            budgets = tuple(budgets)
        else:
            raise TypeError(f"head_budgets must be None, a tuple of ints or a 1-D int tensor (one budget per KV "
                            f"head), got {type(budgets).__name__}")
        if len(budgets) < 1:
            raise ValueError("head_budgets must hold one budget per KV head, got none")
        self.budgets = budgets

    def __repr__(self) -> str:
        return f"PackedLayout({self.budgets!r})"

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return False
        a, b = self.budgets, other.budgets
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return a is b
        return a == b

    def __hash__(self) -> int:
        b = self.budgets
        return hash((type(self).__name__, id(b) if isinstance(b, torch.Tensor) else b))

    def _host(self) -> tuple[int, ...]:
        b = self.budgets
        return tuple(int(x) for x in b.tolist()) if isinstance(b, torch.Tensor) else b

    def _need_heads(self, hkv: int) -> tuple[int, ...]:
        b = self._host()
        if len(b) != hkv:
            raise ValueError(f"this layout's head_budgets hold {len(b)} KV heads per layer but the layer has {hkv}: "
                             f"allocate budgets for this model")
        return b

    def state_shapes(self, n, hkv, sinks, window):
        T = sum(self._need_heads(hkv))
        return (n, T), (n, T - hkv * (sinks + window))

    def spans(self, hkv, sinks, window):
        sw, out, off, koff = sinks + window, [], 0, 0
        for b in self._need_heads(hkv):
            out.append(HeadSpan(off, b, koff, b - sw))
            off, koff = off + b, koff + b - sw
        return out

    def head_groups(self, hkv, sinks, window):
        yield from enumerate(self.spans(hkv, sinks, window))

    def head_state(self, x, head, span, lr=False):
        if lr:
            return x[:, span.koff:span.koff + span.k]
        return x[:, span.off:span.off + span.budget]

    def gather_slots(self, x, slot, offs):
        idx = offs[None, :] + slot[:, None]  # [N, Hkv]
        return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))

    def check(self, step: DecodeStep, state: SlotState, sinks: int, window: int, cache_dtypes=None) -> None:
        q, k_new, v_new, leaving_prio = step.q, step.k_new, step.v_new, step.leaving_prio
        k_cache, v_cache, slot_pos, slot_prio = state.k_cache, state.v_cache, state.slot_pos, state.slot_prio
        lead, e = _batch_lead(q)
        _check_inputs(step, state, e, 1)
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(x, torch.Tensor) and x.dim() != 2 + e:
                raise ValueError(f"with head_budgets {name} is the packed [{lead}T, D] (T = sum of the budgets), "
                                 f"got shape {tuple(x.shape)}")
            check_tensor(name, x, 2 + e, floating=cache_dtypes is None)
        _check_common(step, state, sinks, window, e, cache_dtypes)
        s, w = sinks, window
        hb = self.budgets
        if isinstance(hb, torch.Tensor) and hb.device != q.device:
            raise ValueError(f"head_budgets must be on q's device {q.device}, got {hb.device}")
        Hkv = len(hb)
        D = q.shape[-1]
        _check_new(q, k_new, v_new, Hkv, e, " (Hkv = len(head_budgets))")
        T = k_cache.shape[e]
        if tuple(k_cache.shape) != (*q.shape[:e], T, D) or tuple(v_cache.shape) != (*q.shape[:e], T, D):
            raise ValueError(f"k_cache and v_cache must both be [{lead}T, D] with D = q.shape[-1] = {D}, got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        if not isinstance(hb, torch.Tensor):  # a tensor's values are checked once read back
            _check_budget_values(hb, T, s, w)
        if T < Hkv * (s + w):
            raise ValueError(f"k_cache holds T = {T} slots, fewer than Hkv x (sinks + window) = {Hkv} x {s + w}")
        K = T - Hkv * (s + w)
        if tuple(slot_pos.shape) != (*q.shape[:e], T):
            raise ValueError(f"slot_pos must be [{lead}T] = {[*q.shape[:e], T]}, got {tuple(slot_pos.shape)}")
        if tuple(slot_prio.shape) != (*q.shape[:e], K):
            raise ValueError(f"slot_prio must be [{lead}K] = {[*q.shape[:e], K]} (K = sum of k_h = T - Hkv x "
                             f"(sinks + window)), got {tuple(slot_prio.shape)}")
        if tuple(leaving_prio.shape) != (*q.shape[:e], Hkv):
            raise ValueError(f"leaving_prio must be [{lead}Hkv] = {[*q.shape[:e], Hkv]}, got "
                             f"{tuple(leaving_prio.shape)}")

    def host_budgets(self, T: int, sinks: int, window: int, read: bool) -> PackedLayout:
        """This layout with its budgets on the host (a tensor's read back and checked against ``T`` when
        ``read``; else returned as it is)."""
        if isinstance(self.budgets, torch.Tensor) and read:
            budgets = self._host()
            _check_budget_values(budgets, T, sinks, window)
            return PackedLayout(budgets)
        return self

    def kernel_meta(self, state, sinks, window, device, host):
        """Chunks are cut over the largest budget (over ``T - (Hkv - 1)(s + w)`` for an unchecked tensor,
        whose largest value the host does not know)."""
        T = state.k_cache.shape[1]
        budgets = self.budgets
        if not isinstance(budgets, torch.Tensor):
            return _plan(budgets, sinks, window, device).meta, max(budgets)
        # an unchecked device tensor: offsets by a cumsum on the device, a host bound on the largest
        Hkv = budgets.shape[0]
        bud = budgets.to(torch.int64)
        off = bud.cumsum(0) - bud
        koff = off - torch.arange(Hkv, device=device) * (sinks + window)
        return torch.stack([bud, off, koff]), T - (Hkv - 1) * (sinks + window)

    def plan(self, sinks, window, device) -> _Plan:
        return _plan(self._host(), sinks, window, device)

    def torch_write(self, step: DecodeStep, state: SlotState, *, sinks: int, window: int) -> torch.Tensor:
        """``k_cache [N, T, D]``, ``slot_pos [N, T]``, ``slot_prio [N, K]``, vectorised over rows, heads and
        slots: the decision on a padded gather of the long-range slots ``[N, Hl, kmax]`` (every head at
        once), the cache writes once for all heads.  No data-dependent branch."""
        slot_pos, slot_prio, leaving_prio = state.slot_pos, state.slot_prio, step.leaving_prio
        dev = step.q.device
        lay = self.plan(sinks, window, dev)
        N = step.q.shape[0]
        s, w = sinks, window
        pos, bad = _guard(step.pos)
        t_new = pos - w
        sn = lay.off[None, :] + slot_of(pos, sinks=s, window=w)[:, None]  # [N, Hkv] the new token's slot
        ni = torch.arange(N, device=dev)[:, None]
        ok = ~bad[:, None]
        moved = state.moved(step)
        if lay.n_lr_heads:  # the heads with long-range slots (a k_h = 0 head drops every leaving token)
            hl = lay.lr_heads
            pr = slot_prio[:, lay.pad_lr].masked_fill_(lay.pad, float("inf"))  # [N, Hl, kmax]
            low_p = pr.amin(dim=-1)
            # ties to the oldest position, then the lowest index (padding never wins: real positions < INT32_MAX)
            older = slot_pos[:, lay.pad_slot].masked_fill_((pr != low_p[..., None]) | lay.pad, _INT32_MAX)
            low_t, jl = older.min(dim=-1)  # [N, Hl]
            keep, lp = _decide(low_p, low_t, leaving_prio if hl is None else leaving_prio[:, hl], t_new, s, ok)
            j, dst = lay.koff_lr + jl, lay.lr0 + jl
            snl = sn if hl is None else sn[:, hl]
            for c, _ in moved:
                kp = keep.view(*keep.shape, *([1] * (c.dim() - 2)))
                c[ni, dst] = torch.where(kp, c[ni, snl], c[ni, dst])
            slot_pos[ni, dst] = torch.where(keep, t_new[:, None].to(torch.int32), slot_pos[ni, dst])
            slot_prio[ni, j] = torch.where(keep, lp, slot_prio[ni, j])
        for c, new in moved:
            okc = ok.view(N, 1, *([1] * (c.dim() - 2)))
            c[ni, sn] = torch.where(okc, new, c[ni, sn])
        slot_pos[ni, sn] = torch.where(ok, pos[:, None].to(torch.int32), slot_pos[ni, sn])
        return bad

    def attend(self, q, kc, vc, slot_pos, *, scale, bad, sinks, window):
        """The uniform attention on each run of consecutive heads of equal budget (a uniform block, a view):
        one run for equal budgets, a static loop over the runs otherwise.  ``kc, vc [N, T, D]`` float32."""
        lay = self.plan(sinks, window, q.device)
        N, Hq, D = q.shape
        Hkv = len(lay.budgets)
        qg = q.float().view(N, Hkv, Hq // Hkv, D)
        outs, lses = [], []
        for run in lay.runs:
            r, span = run.h1 - run.h0, slice(run.off, run.off + (run.h1 - run.h0) * run.b)
            o, lse = _attend(qg[:, run.h0:run.h1], kc[:, span].unflatten(1, (r, run.b)),
                             vc[:, span].unflatten(1, (r, run.b)), slot_pos[:, span].unflatten(1, (r, run.b)) >= 0,
                             scale)
            outs.append(o)
            lses.append(lse)
        return _finish(_cat(outs, 1), _cat(lses, 1), bad, q)


