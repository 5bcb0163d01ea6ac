"""The interface every slot layout answers (:class:`SlotLayout`), the checks of a step's tensors and the
attention all layouts share."""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from .._utils import check_gqa, check_int, check_tensor
from ..splitk import CACHE_DTYPES
from .state import DecodeStep, SlotState

_INT32_MAX = 2**31 - 1


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

    A step's tensors travel as two objects: the state it updates in place (:class:`SlotState`) and the new
    token (:class:`DecodeStep`).  ``packed``: the kernels' ``PACKED`` flag (the slots of all heads of a row in
    one dimension, each head at its offset read from ``kernel_meta``); ``head_dims``: the rank of the state's
    head-and-slot part (2 for ``[Hkv, B]``, 1 for ``[T]``)."""

    packed = False
    head_dims = 2
    kv_dtype: str | None = None  # a quantised layout's storage ("int8", "fp8"); None: the model's dtype
    extra_state: tuple[str, ...] = ()  # the optional SlotState fields it keeps (a quantised layout's scales)

    @property
    def geometry(self) -> SlotLayout:
        """The layout that places the slots (itself; a quantised layout's base)."""
        return self

    # -- the state ------------------------------------------------------------------------------------------
    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the keys and values are stored in, for a model of ``dtype``."""
        return dtype

    def empty_state(self, n: int, hkv: int, sinks: int, window: int, *, k_dim: int, v_dim: int,
                    dtype: torch.dtype, device) -> SlotState:
        """An empty state of ``n`` rows of ``hkv`` KV heads for keys of ``k_dim`` and values of ``v_dim``
        elements in a model of ``dtype`` (every slot empty: position -1, priority -inf)."""
        slots, lr = self.state_shapes(n, hkv, sinks, window)
        store = self.cache_dtype(dtype)
        extra = {name: torch.zeros(slots, dtype=torch.float32, device=device) for name in self.extra_state}
        return SlotState(torch.zeros(*slots, k_dim, dtype=store, device=device),
                         torch.zeros(*slots, v_dim, dtype=store, device=device),
                         torch.full(slots, -1, dtype=torch.int32, device=device),
                         torch.full(lr, float("-inf"), dtype=torch.float32, device=device), **extra)

    def prompt_state(self, key: torch.Tensor, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The per-slot state of a prompt's keys and values ``[..., S, D]`` as the slots store it, by the name
        of the :class:`SlotState` field (``k_cache``, ``v_cache``; a quantised layout adds the scales), each
        ready to be indexed into the views :meth:`head_state` gives."""
        return [("k_cache", key), ("v_cache", value)]

    def read_slots(self, state: SlotState, which: str, slot: torch.Tensor,
                   offs: torch.Tensor | None) -> torch.Tensor:
        """The keys (``which="k"``) or values (``"v"``) ``[N, Hkv, D]`` at slot ``slot [N]`` of every head, in
        compute precision."""
        return self.gather_slots(getattr(state, f"{which}_cache"), slot, offs)

    def load(self, state: SlotState) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of every slot in float32 (no copy for float32 caches)."""
        return state.k_cache.float(), state.v_cache.float()

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

    def long_range_positions(self, slot_pos: torch.Tensor, row: int, hkv: int, sinks: int,
                             window: int) -> list[list[int]]:
        """Per KV head of batch row ``row``, the positions in its long-range slots (``-1`` when empty)."""
        return [slot_pos[row, sp.off + sinks + window:sp.off + sp.budget].tolist()
                for sp in self.spans(hkv, sinks, window)]

    # -- a step ---------------------------------------------------------------------------------------------
    def check(self, step: DecodeStep, state: SlotState, sinks: int, window: int) -> None:
        """Validate a step's tensors in either form (batch-1 or batched); no value is read from a device
        tensor.  ``ValueError``/``TypeError`` naming what was given and what is allowed."""
        raise NotImplementedError

    def check_scales(self, state: SlotState) -> None:
        """A layout that stores no scales takes none."""
        if state.k_scale is not None or state.v_scale is not None:
            raise ValueError(f"k_scale/v_scale are the scales of a quantised layout, but the layout is {self!r}: pass "
                             f"layout=QuantizedLayout(\"int8\" or \"fp8\", {self!r})")

    def encode(self, step: DecodeStep) -> DecodeStep:
        """The new token as the slots store it (itself; a quantised layout's codes and scales)."""
        return step

    def host_budgets(self, T: int, sinks: int, window: int, read: bool) -> SlotLayout:
        """This layout with its budgets known on the host (``read``: budgets held as a device tensor may be
        read back); itself when it has none to read."""
        return self

    def kernel_meta(self, state: SlotState, sinks: int, window: int, device, host: bool):
        """``None`` (uniform) or ``(meta [3, Hkv] int64 on device, a host bound on the largest budget)``:
        what the Triton kernels read of the layout (budgets, slot offsets, long-range offsets).  ``host``:
        whether budgets held as a device tensor may be read back."""
        return None

    def torch_step(self, step: DecodeStep, state: SlotState, *, sinks: int, window: int, scale: float):
        """The step in PyTorch (batched form, ``pos [N]``): :meth:`torch_write` of the encoded token, then
        :meth:`attend` over the slots in float32 (:meth:`load`).  Returns ``(out, lse)``.  Call it under
        ``torch.no_grad()`` (``fixed_budget_decode`` does)."""
        bad = self.torch_write(self.encode(step), state, sinks=sinks, window=window)
        kc, vc = self.load(state)
        return self.attend(step.q, kc, vc, state.slot_pos, scale=scale, bad=bad, sinks=sinks, window=window)

    def torch_write(self, step: DecodeStep, state: SlotState, *, sinks: int, window: int) -> torch.Tensor:
        """Steps 1 and 2 in place (the eviction decision, the new token's slot; everything of
        :meth:`SlotState.moved` moves with the keys); returns the rows the device-side guard refused,
        ``bad [N]`` bool."""
        raise NotImplementedError

    def attend(self, q, kc, vc, slot_pos, *, scale, bad, sinks, window):
        """Step 3: every query head over its KV head's valid slots, ``kc, vc`` float32 in the layout's shape:
        ``(out [N, Hq, D] in q's dtype, lse [N, Hq] float32)``, NaN in the rows ``bad``."""
        raise NotImplementedError

    # -- a prefill ------------------------------------------------------------------------------------------
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


def _check_common(step: DecodeStep, state: SlotState, sinks, window, e, cache_dtypes=None):
    """Dtypes of the step's inputs and the position argument (every layout; ranks checked before).
    ``cache_dtypes``: the dtypes the caches may hold (default: q's)."""
    q, k_new, v_new, pos = step.q, step.k_new, step.v_new, step.pos
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
    for name, x in (("k_cache", state.k_cache), ("v_cache", state.v_cache)):
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


def _check_inputs(step: DecodeStep, state: SlotState, e, head_dims):
    """Ranks and dtypes of the tensors every layout takes alike."""
    check_tensor("q", step.q, 2 + e)
    check_tensor("k_new", step.k_new, 2 + e)
    check_tensor("v_new", step.v_new, 2 + e)
    check_tensor("slot_pos", state.slot_pos, head_dims + e, dtypes=(torch.int32,))
    check_tensor("slot_prio", state.slot_prio, head_dims + e, dtypes=(torch.float32,))
    check_tensor("leaving_prio", step.leaving_prio, 1 + e, dtypes=(torch.float32,))


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


