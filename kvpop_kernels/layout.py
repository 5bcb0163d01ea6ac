"""Slot layouts of the fixed-budget decode state: where each KV head's ``B_h = s + w + k_h`` slots lie.

One object per layout, taken by ``fixed_budget_decode(layout=...)`` and held by each layer of
``kvpop.KVpopCache``:

* :class:`UniformLayout` -- every KV head holds the same ``B`` slots: ``k_cache, v_cache [N, Hkv, B, D]``,
  ``slot_pos [N, Hkv, B]``, ``slot_prio [N, Hkv, k]``;
* :class:`PackedLayout` -- head-adaptive budgets, one ``B_h`` per KV head, packed back to back:
  ``k_cache, v_cache [N, T, D]`` (``T = sum B_h``), ``slot_pos [N, T]``, ``slot_prio [N, K]``
  (``K = sum k_h``).

Inside one head both hold sinks ``[0, s)``, the window ring ``[s, s + w)`` and the long-range slots
``[s + w, B_h)``.  A layout answers what differs between them: the state's shapes
(:meth:`SlotLayout.state_shapes`), each head's place (:meth:`SlotLayout.spans`), the check of a step's
tensors (:meth:`SlotLayout.check`), what the Triton kernels read of it (:meth:`SlotLayout.kernel_meta`),
the vectorised PyTorch step (:meth:`SlotLayout.torch_step`) and the views a prefill fills
(:meth:`SlotLayout.head_groups`).  The eviction rule, the kernels and the launcher are shared
(``kvpop_kernels.decode``); a further layout is a further class here.  Semantics: docs/DESIGN.md sections
5 and 9.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from ._utils import check_gqa, check_int, check_tensor
from .splitk import CACHE_DTYPES

__all__ = ["SlotLayout", "UniformLayout", "PackedLayout", "QuantizedLayout", "HeadSpan", "KV_DTYPES", "as_layout",
           "check_kv_dtype", "dequantize", "quantize", "slot_of"]

_INT32_MAX = 2**31 - 1


def slot_of(pos, *, sinks: int, window: int):
    """Slot of the token at ``pos`` while it is a sink or in the window: ``pos`` for a sink,
    ``s + (pos - s) % w`` in the ring otherwise (inside its head's slots, in either layout).
    ``pos`` is a Python int or an integer tensor (elementwise, no host synchronisation)."""
    if isinstance(pos, torch.Tensor):
        return torch.where(pos < sinks, pos, sinks + (pos.clamp_min(sinks) - sinks) % window)
    return pos if pos < sinks else sinks + (pos - sinks) % window


class HeadSpan(NamedTuple):
    """One KV head's place in the state: its first slot ``off``, its budget ``budget``, its first
    long-range priority ``koff`` and its long-range slots ``k`` (``off = koff = 0`` per head in the uniform
    layout, whose heads are a dimension of their own)."""

    off: int
    budget: int
    koff: int
    k: int


class SlotLayout:
    """What every layout answers (the base of :class:`UniformLayout` and :class:`PackedLayout`).

    ``packed``: the kernels' ``PACKED`` flag (the slots of all heads of a row in one dimension, each head
    at its offset read from ``kernel_meta``); ``head_dims``: the rank of the state's head-and-slot part
    (2 for ``[Hkv, B]``, 1 for ``[T]``)."""

    packed = False
    head_dims = 2
    kv_dtype: str | None = None  # a quantised layout's storage ("int8", "fp8"); None: the model's dtype
    extra_state: tuple[str, ...] = ()  # further per-slot state a cache keeps (a quantised layout's scales)

    @property
    def geometry(self) -> SlotLayout:
        """The layout that places the slots (itself; a quantised layout's base)."""
        return self

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the keys and values are stored in, for a model of ``dtype``."""
        return dtype

    def prompt_state(self, key: torch.Tensor, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The per-slot state of a prompt's keys and values ``[..., S, D]`` as a cache stores it, by the name
        of the cache's tensor (``keys``, ``values``; a quantised layout adds the scales), each ready to be
        indexed into the views :meth:`head_state` gives."""
        return [("keys", key), ("values", value)]

    def read_slots(self, x: torch.Tensor, scale: torch.Tensor | None, slot: torch.Tensor,
                   offs: torch.Tensor | None) -> torch.Tensor:
        """The keys or values ``[N, Hkv, D]`` at slot ``slot [N]`` of every head, in compute precision
        (``scale``: a quantised layout's scales of ``x``)."""
        return self.gather_slots(x, slot, offs)

    def check_scales(self, k_scale, v_scale, slot_pos) -> None:
        """A layout that stores no scales takes none."""
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are the scales of a quantised layout, but the layout is {self!r}: pass "
                             f"layout=QuantizedLayout(\"int8\" or \"fp8\", {self!r})")

    def kernel_new(self, k_new, v_new, k_scale, v_scale):
        """``(k_new, v_new, quant)``: the new token as the Triton kernels store it, and ``None`` or what they
        read of a quantised layout (``(k_scale, v_scale, k_new_scale, v_new_scale)``)."""
        return k_new, v_new, None

    def state_shapes(self, n: int, hkv: int, sinks: int, window: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(slots, long_range)``: the shapes of ``slot_pos`` (keys and values add ``D``) and ``slot_prio``
        of ``n`` rows of ``hkv`` KV heads."""
        raise NotImplementedError

    def spans(self, hkv: int, sinks: int, window: int) -> list[HeadSpan]:
        """Each KV head's :class:`HeadSpan`."""
        raise NotImplementedError

    def long_range_k(self, hkv: int, sinks: int, window: int) -> int | list[int]:
        """The long-range slots per KV head as ``kvpop_kernels.eviction_schedule(k=...)`` takes them: one int
        for every head, or one per head."""
        return [sp.k for sp in self.spans(hkv, sinks, window)]

    def check(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks,
              window) -> None:
        """Validate a step's tensors in either form (batch-1 or batched); no value is read from a device
        tensor.  ``ValueError``/``TypeError`` naming what was given and what is allowed."""
        raise NotImplementedError

    def host_budgets(self, T: int, sinks: int, window: int, read: bool) -> SlotLayout:
        """This layout with its budgets known on the host (``read``: budgets held as a device tensor may be
        read back); itself when it has none to read."""
        return self

    def kernel_meta(self, k_cache, slot_prio, sinks: int, window: int, device, host: bool):
        """``None`` (uniform) or ``(meta [3, Hkv] int64 on device, a host bound on the largest budget)``:
        what the Triton kernels read of the layout (budgets, slot offsets, long-range offsets).  ``host``:
        whether budgets held as a device tensor may be read back."""
        return None

    def torch_step(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, *, sinks,
                   window, scale, k_scale=None, v_scale=None):
        """The step in PyTorch (batched form, ``pos [N]``): :meth:`torch_write`, then :meth:`attend` over the
        slots in float32 (no copy for float32 caches).  Returns ``(out, lse)``.  Call it under
        ``torch.no_grad()`` (``fixed_budget_decode`` does)."""
        bad = self.torch_write(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos,
                               sinks=sinks, window=window)
        return self.attend(q, k_cache.float(), v_cache.float(), slot_pos, scale=scale, bad=bad, sinks=sinks,
                           window=window)

    def torch_write(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, *, sinks,
                    window, slots=()):
        """Steps 1 and 2 in place (the eviction decision, the new token's slot); returns the rows the
        device-side guard refused, ``bad [N]`` bool.  ``slots``: further per-slot tensors (batch first, the
        slot dimensions of ``slot_pos``, then any) moved with the keys, as ``(cache, new)`` pairs."""
        raise NotImplementedError

    def attend(self, q, kc, vc, slot_pos, *, scale, bad, sinks, window):
        """Step 3: every query head over its KV head's valid slots, ``kc, vc`` float32 in the layout's shape:
        ``(out [N, Hq, D] in q's dtype, lse [N, Hq] float32)``, NaN in the rows ``bad``."""
        raise NotImplementedError

    def head_groups(self, hkv: int, sinks: int, window: int) -> Iterator[tuple[slice | int | None, HeadSpan]]:
        """The groups of heads a prefill fills at once: ``(head, span)`` with ``head`` None for all heads
        (uniform: the rows and heads flattened into one axis) or one head's index."""
        raise NotImplementedError

    def head_state(self, x: torch.Tensor, head, span: HeadSpan, lr: bool = False) -> torch.Tensor:
        """The part of a state tensor ``x`` (batch first) of one prefill group (a view): its slots, or with
        ``lr`` its long-range priorities, flattened to ``[R, slots, ...]``."""
        raise NotImplementedError

    def gather_slots(self, x: torch.Tensor, slot: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        """``x``'s entries ``[N, Hkv, ...]`` at slot ``slot [N]`` of every head (``offs``: each head's first
        slot on the device, packed layout only)."""
        raise NotImplementedError

    def long_range_positions(self, slot_pos: torch.Tensor, row: int, hkv: int, sinks: int,
                             window: int) -> list[list[int]]:
        """Per KV head of batch row ``row``, the positions in its long-range slots (``-1`` when empty)."""
        return [slot_pos[row, sp.off + sinks + window:sp.off + sp.budget].tolist()
                for sp in self.spans(hkv, sinks, window)]


# ------------------------------------------------------------------------------ checks both layouts share
def check_positions(pos: torch.Tensor) -> None:
    """The host check of a ``pos`` tensor (``check=True``): every position in ``[0, 2**31 - 2]``."""
    p = pos.detach().to("cpu", torch.int64)
    bad = ((p < 0) | (p > _INT32_MAX - 1)).nonzero().flatten()
    if bad.numel():
        rows = bad[:8].tolist()
        raise ValueError(f"pos must lie in [0, 2**31 - 2] (int32 slot positions), got {p[bad[:8]].tolist()} in "
                         f"rows {rows}{' ...' if bad.numel() > 8 else ''}")


def _overlaps_itself(x: torch.Tensor) -> bool:
    """True unless the elements of ``x`` provably lie at distinct addresses (its dims, ordered by stride,
    nest: each stride at least the extent of the dims below it)."""
    dims = sorted((st, n) for st, n in zip(x.stride(), x.shape) if n > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            return True
        extent = st * n
    return False


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` start at one address (e.g. the same tensor passed twice).  Interleaved views
    of one buffer (keys and values side by side) start apart and are fine."""
    return a.numel() > 0 and b.numel() > 0 and a.data_ptr() == b.data_ptr()


def check_state(*state: tuple[str, torch.Tensor]) -> None:
    """The tensors updated in place (``(name, tensor)`` pairs): no grad, no element shared with another or
    with itself."""
    for name, x in state:
        if x.requires_grad:
            raise ValueError(f"{name} is updated in place and must not require grad (decode under torch.no_grad())")
        if _overlaps_itself(x):
            raise ValueError(f"{name} is updated in place, so no two of its elements may share memory; got strides "
                             f"{tuple(x.stride())} for shape {tuple(x.shape)} (an expand()ed or overlapping view): "
                             f"pass {name}.contiguous() (or .clone()) and keep that tensor")
    if torch.compiler.is_compiling():  # addresses are not traceable; checked in every eager call
        return
    for i, (na, a) in enumerate(state):
        for nb, b in state[i + 1:]:
            if _share_memory(a, b):
                raise ValueError(f"{na} and {nb} share memory; each of them is updated in place: give each its "
                                 f"own tensor")


def _check_common(q, k_new, v_new, k_cache, v_cache, pos, sinks, window, e, cache_dtypes=None):
    """Dtypes of the step's inputs and the position argument (every layout; ranks checked before).
    ``cache_dtypes``: the dtypes the caches may hold (default: q's)."""
    N = q.shape[0] if e else 1
    if isinstance(pos, torch.Tensor):
        if pos.dtype not in (torch.int32, torch.int64) or tuple(pos.shape) != (N,):
            raise ValueError(f"pos as a tensor must be int32/int64 of shape [N] = [{N}], got {pos.dtype} "
                             f"{tuple(pos.shape)}")
        if pos.device != q.device:
            raise ValueError(f"pos must be on q's device {q.device}, got {pos.device}")
    else:
        check_int("pos", pos, minimum=0)
        if pos > _INT32_MAX - 1:
            raise ValueError(f"pos must fit in int32 slot positions (< {_INT32_MAX}), got {pos}")
    check_int("sinks", sinks, minimum=0)
    check_int("window", window, minimum=1)
    if q.dtype not in CACHE_DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype} (cast one of them)")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache_dtypes is None and x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype} (cast one of them)")
        if cache_dtypes is not None and x.dtype not in cache_dtypes:
            raise ValueError(f"{name} must have dtype in {[str(d) for d in cache_dtypes]}, got {x.dtype}")


def _check_new(q, k_new, v_new, Hkv, e, note=""):
    """GQA and the new token's shapes ``[N?, Hkv, D]`` (every layout)."""
    lead, D = ("N, " if e else ""), q.shape[-1]
    check_gqa(q.shape[e], Hkv)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if tuple(x.shape) != (*q.shape[:e], Hkv, D):
            raise ValueError(f"{name} must be [{lead}Hkv, D] = {[*q.shape[:e], Hkv, D]}{note}, got {tuple(x.shape)}")


def _check_inputs(q, k_new, v_new, leaving_prio, slot_pos, slot_prio, e, head_dims):
    """Ranks and dtypes of the tensors every layout takes alike."""
    check_tensor("q", q, 2 + e)
    check_tensor("k_new", k_new, 2 + e)
    check_tensor("v_new", v_new, 2 + e)
    check_tensor("slot_pos", slot_pos, head_dims + e, dtypes=(torch.int32,))
    check_tensor("slot_prio", slot_prio, head_dims + e, dtypes=(torch.float32,))
    check_tensor("leaving_prio", leaving_prio, 1 + e, dtypes=(torch.float32,))


def _batch_lead(q) -> tuple[str, int]:
    batched = isinstance(q, torch.Tensor) and q.dim() == 3
    return ("N, " if batched else ""), (1 if batched else 0)


# ------------------------------------------------------------------------------ the attention both share
def _attend(qg, kc, vc, valid, scale):
    """Attention of the grouped queries ``qg [N, H, G, D]`` (float32) over ``kc, vc [N, H, B, D]`` (float32)
    where ``valid [N, H, B]``: ``(out [N, H, G, D], lse [N, H, G])``, natural log."""
    scores = torch.matmul(qg, kc.transpose(-1, -2))  # [N, H, G, B], unscaled
    scores = scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
    vc = vc.masked_fill(~valid[..., None], 0.0)
    m = scores.amax(dim=-1, keepdim=True)  # finite: the new token is always visible
    probs = scores.sub_(m).mul_(scale).exp_()  # scale > 0, so max(scale * x) = scale * max(x)
    l = probs.sum(dim=-1, keepdim=True)
    return torch.matmul(probs, vc).div_(l), m.mul_(scale).add_(l.log_()).squeeze(-1)


def _guard(pos):
    """The device-side guard (no host read): a row whose position lies outside ``[0, 2**31 - 2]`` computes
    with position 0, writes nothing and returns NaN, as the Triton kernels do.  ``(pos, bad [N])``."""
    pos = pos.to(torch.int64)
    bad = (pos < 0) | (pos > _INT32_MAX - 1)
    return pos.masked_fill(bad, 0), bad


def _finish(out, lse, bad, q):
    out = out.masked_fill_(bad[:, None, None, None], float("nan"))
    lse = lse.masked_fill_(bad[:, None, None], float("nan"))
    N, Hq, D = q.shape
    return out.reshape(N, Hq, D).to(q.dtype), lse.reshape(N, Hq)


def _decide(low_p, low_t, leaving_prio, t_new, s, ok):
    """Whether each (row, head)'s leaving token ``t_new`` replaces its lowest-ranked long-range slot
    ``(low_p, low_t)``, and its priority with NaN ranked as ``-inf``."""
    lp = leaving_prio.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    tn = t_new[:, None]
    return (tn >= s) & ((lp > low_p) | ((lp == low_p) & (low_t < tn))) & ok, lp


# ------------------------------------------------------------------------------ uniform
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

    def check(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks, window,
              cache_dtypes=None):
        lead, e = _batch_lead(q)
        _check_inputs(q, k_new, v_new, leaving_prio, slot_pos, slot_prio, e, 2)
        check_tensor("k_cache", k_cache, 3 + e, floating=cache_dtypes is None)
        check_tensor("v_cache", v_cache, 3 + e, floating=cache_dtypes is None)
        _check_common(q, k_new, v_new, k_cache, v_cache, pos, sinks, window, e, cache_dtypes)
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

    def torch_write(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, *, sinks,
                    window, slots=()):
        """Vectorised over batch rows and heads.  No data-dependent Python branch: every row and head runs
        the same ops (kept or not is a ``torch.where``), so the step traces into one graph
        (``torch.compile(fullgraph=True)``).  ``slots``: further per-slot tensors ``[N, Hkv, B, ...]`` moved
        with the keys, as ``(cache, new)`` pairs (a quantised layout's scales)."""
        N = q.shape[0]
        _, Hkv, B, _ = k_cache.shape
        s, w = sinks, window
        K = B - s - w
        dev = q.device
        pos, bad = _guard(pos)
        t_new = pos - w  # [N]
        slot_new = slot_of(pos, sinks=s, window=w)  # [N]
        ni = torch.arange(N, device=dev)[:, None]
        hi = torch.arange(Hkv, device=dev)[None, :]
        sn = slot_new[:, None].expand(N, Hkv)
        ok = ~bad[:, None]  # [N, 1]
        moved = [(k_cache, k_new), (v_cache, v_new), *slots]
        if K > 0:
            low_p = slot_prio.amin(dim=-1)  # lowest priority ...
            # ... then the oldest position; ``min`` returns the first index among equal values, which
            # matters only for empty slots (all at -1): the lowest slot index, as in the reference
            older = slot_pos[..., s + w:].masked_fill(slot_prio != low_p[..., None], _INT32_MAX)
            low_t, j = older.min(dim=-1)  # [N, Hkv]
            keep, lp = _decide(low_p, low_t, leaving_prio, t_new, s, ok)
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


# ------------------------------------------------------------------------------ packed
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

    def check(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks, window,
              cache_dtypes=None):
        lead, e = _batch_lead(q)
        _check_inputs(q, k_new, v_new, leaving_prio, slot_pos, slot_prio, e, 1)
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(x, torch.Tensor) and x.dim() != 2 + e:
                raise ValueError(f"with head_budgets {name} is the packed [{lead}T, D] (T = sum of the budgets), "
                                 f"got shape {tuple(x.shape)}")
            check_tensor(name, x, 2 + e, floating=cache_dtypes is None)
        _check_common(q, k_new, v_new, k_cache, v_cache, pos, sinks, window, e, cache_dtypes)
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

    def kernel_meta(self, k_cache, slot_prio, sinks, window, device, host):
        """Chunks are cut over the largest budget (over ``T - (Hkv - 1)(s + w)`` for an unchecked tensor,
        whose largest value the host does not know)."""
        T = k_cache.shape[1]
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

    def torch_write(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, *, sinks,
                    window, slots=()):
        """``k_cache [N, T, D]``, ``slot_pos [N, T]``, ``slot_prio [N, K]``, vectorised over rows, heads and
        slots: the decision on a padded gather of the long-range slots ``[N, Hl, kmax]`` (every head at
        once), the cache writes once for all heads.  No data-dependent branch."""
        lay = self.plan(sinks, window, q.device)
        N = q.shape[0]
        s, w = sinks, window
        dev = q.device
        pos, bad = _guard(pos)
        t_new = pos - w
        sn = lay.off[None, :] + slot_of(pos, sinks=s, window=w)[:, None]  # [N, Hkv] the new token's slot
        ni = torch.arange(N, device=dev)[:, None]
        ok = ~bad[:, None]
        moved = [(k_cache, k_new), (v_cache, v_new), *slots]
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


# ------------------------------------------------------------------------------ quantised slots
KV_DTYPES = ("int8", "fp8")
"""The storage a :class:`QuantizedLayout` offers: ``"int8"`` (symmetric, ``|code| <= 127``) and ``"fp8"``
(``torch.float8_e4m3fn``, ``|code| <= 448``; where torch has it)."""


def check_kv_dtype(kv_dtype) -> tuple[torch.dtype, float] | None:
    """``(storage dtype, largest code)`` of ``kv_dtype`` (None: the model's dtype, no quantisation);
    ``ValueError`` for anything but None and :data:`KV_DTYPES`."""
    if kv_dtype is None:
        return None
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be None (the model's dtype) or one of {list(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == "int8":
        return torch.int8, 127.0
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:  # pragma: no cover - depends on the torch build
        raise ValueError(f"kv_dtype='fp8' needs torch.float8_e4m3fn, which this torch {torch.__version__} lacks; "
                         f"use kv_dtype='int8'")
    return fp8, float(torch.finfo(fp8).max)


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of ``x [..., D]``, one float32 scale per vector: ``scale = max|x| / qmax`` and
    ``codes = x / scale`` (``int8``: rounded half up and clipped to ``[-127, 127]``; ``fp8``: torch's cast,
    round to nearest even), a zero vector with scale 0.  ``dequantize(codes, scale)`` gives it back to
    within half a code step."""
    dtype, qmax = check_kv_dtype(kv_dtype)
    xf = x.float()
    sc = xf.abs().amax(dim=-1) / qmax
    r = xf / torch.where(sc > 0, sc, torch.ones_like(sc))[..., None]
    if dtype == torch.int8:
        return torch.floor(r + 0.5).clamp_(-qmax, qmax).to(torch.int8), sc
    return r.to(dtype), sc


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes [..., D]`` times ``scale [...]``, float32."""
    return codes.float() * scale[..., None]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as its bytes (CPU indexing and ``where`` on float8 are not there in every torch;
    moves of codes are copies of bits)."""
    return x.view(torch.uint8) if x.is_floating_point() and x.element_size() == 1 else x


class QuantizedLayout(SlotLayout):
    """Keys and values of every slot in 8 bits (``kv_dtype``: ``"int8"`` or ``"fp8"``), with one float32 scale
    per slot and KV head for the keys (``k_scale``) and one for the values (``v_scale``), in the slots of
    ``base`` (a :class:`UniformLayout` or :class:`PackedLayout`; default uniform).  The scales have
    ``slot_pos``'s shape and strides; the priorities stay float32.

    A step quantises the new token (:func:`quantize`) and writes its codes and scales into the slot it takes;
    the token leaving the window moves with its codes and scales (no requantisation); the attention
    dequantises every slot on load.  So a quantised step is the base step on the dequantised state
    (``reference.quantized_fixed_budget_decode``)."""

    extra_state = ("k_scale", "v_scale")

    def __init__(self, kv_dtype: str, base: SlotLayout | None = None):
        self.dtype, self.qmax = check_kv_dtype(kv_dtype)
        base = UniformLayout() if base is None else base
        if not isinstance(base, (UniformLayout, PackedLayout)):
            raise TypeError(f"QuantizedLayout's base must be a UniformLayout or PackedLayout, got {base!r}")
        self.kv_dtype, self.base = kv_dtype, base
        self.packed, self.head_dims = base.packed, base.head_dims

    def __repr__(self) -> str:
        return f"QuantizedLayout({self.kv_dtype!r}, {self.base!r})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and (other.kv_dtype, other.base) == (self.kv_dtype, self.base)

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.kv_dtype, self.base))

    @property
    def geometry(self) -> SlotLayout:
        return self.base

    # the slots' places are the base layout's
    def state_shapes(self, n, hkv, sinks, window):
        return self.base.state_shapes(n, hkv, sinks, window)

    def spans(self, hkv, sinks, window):
        return self.base.spans(hkv, sinks, window)

    def long_range_k(self, hkv, sinks, window):
        return self.base.long_range_k(hkv, sinks, window)

    def long_range_positions(self, slot_pos, row, hkv, sinks, window):
        return self.base.long_range_positions(slot_pos, row, hkv, sinks, window)

    def head_groups(self, hkv, sinks, window):
        return self.base.head_groups(hkv, sinks, window)

    def head_state(self, x, head, span, lr=False):
        return self.base.head_state(_bits(x), head, span, lr)

    def gather_slots(self, x, slot, offs):
        return self.base.gather_slots(_bits(x), slot, offs).view(x.dtype)

    def kernel_meta(self, k_cache, slot_prio, sinks, window, device, host):
        return self.base.kernel_meta(k_cache, slot_prio, sinks, window, device, host)

    def host_budgets(self, T, sinks, window, read):
        base = self.base.host_budgets(T, sinks, window, read)
        return self if base is self.base else QuantizedLayout(self.kv_dtype, base)

    # what quantisation changes
    def cache_dtype(self, dtype):
        return self.dtype

    def prompt_state(self, key, value):
        kq, ks = quantize(key, self.kv_dtype)
        vq, vs = quantize(value, self.kv_dtype)
        return [("keys", _bits(kq)), ("k_scale", ks), ("values", _bits(vq)), ("v_scale", vs)]

    def read_slots(self, x, scale, slot, offs):
        return dequantize(self.gather_slots(x, slot, offs), self.base.gather_slots(scale, slot, offs))

    def check(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks, window):
        self.base.check(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks, window,
                        cache_dtypes=(self.dtype,))

    def check_scales(self, k_scale, v_scale, slot_pos) -> None:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{self!r} keeps one scale per slot: pass {name}= a float32 tensor of slot_pos's shape "
                                f"{tuple(slot_pos.shape)}, got {type(x).__name__}")
            if x.dtype != torch.float32 or x.shape != slot_pos.shape or x.stride() != slot_pos.stride():
                raise ValueError(f"{name} must be float32 with slot_pos's shape {tuple(slot_pos.shape)} and strides "
                                 f"{tuple(slot_pos.stride())}, got {x.dtype} {tuple(x.shape)} strides "
                                 f"{tuple(x.stride())}")
            if x.device != slot_pos.device:
                raise ValueError(f"{name} must be on slot_pos's device {slot_pos.device}, got {x.device}")

    def kernel_new(self, k_new, v_new, k_scale, v_scale):
        kq, ks = quantize(k_new, self.kv_dtype)
        vq, vs = quantize(v_new, self.kv_dtype)
        return kq, vq, (k_scale, v_scale, ks, vs)

    def torch_step(self, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, *, sinks,
                   window, scale, k_scale=None, v_scale=None):
        kq, vq, (_, _, ks, vs) = self.kernel_new(k_new, v_new, k_scale, v_scale)
        bad = self.base.torch_write(q, _bits(kq), _bits(vq), _bits(k_cache), _bits(v_cache), slot_pos, slot_prio,
                                    leaving_prio, pos, sinks=sinks, window=window,
                                    slots=((k_scale, ks), (v_scale, vs)))
        return self.base.attend(q, dequantize(k_cache, k_scale), dequantize(v_cache, v_scale), slot_pos,
                                scale=scale, bad=bad, sinks=sinks, window=window)


def as_layout(layout: SlotLayout | None, head_budgets=None) -> SlotLayout:
    """The layout of a ``fixed_budget_decode`` call: ``layout`` as given, or ``PackedLayout(head_budgets)``
    for the shorthand ``head_budgets=``, or the uniform layout of the tensors."""
    if layout is not None:
        if head_budgets is not None:
            raise ValueError("give layout= or head_budgets=, not both (head_budgets=B is "
                             "layout=PackedLayout(B))")
        if not isinstance(layout, SlotLayout):
            raise TypeError(f"layout must be a kvpop_kernels.layout.SlotLayout (UniformLayout(), "
                            f"PackedLayout(budgets), ...), got {type(layout).__name__}")
        return layout
    if head_budgets is not None:
        return PackedLayout(head_budgets)
    return UniformLayout()
