"""``eviction_schedule`` and ``eviction_decisions``: when each token loses its long-range slot.

Semantics: docs/DESIGN.md "Eviction semantics" (restated in ``reference.py``).  NaN priorities
rank as ``-inf`` (below every number, ties to the newer token as always).  ``k`` is one int for every
KV head or one per KV head (head-adaptive budgets, docs/DESIGN.md section 7): each head runs the rule
with its own ``k``; the kernels load it per program from an int32 ``[H]`` tensor on the device.

CPU path (O(S log k) per head): a min-heap of the kept long-range set, run over the
queries in order.  At query ``q`` the token ``t_new = q - w`` joins ``E(q)``; while fewer
than ``k`` are kept it takes a free slot, otherwise it replaces the lowest-ranked kept
token if it ranks above it (that token's ``evict_at`` is ``q``) or is itself evicted
at ``q``.  Since priorities are static this is exactly the top-k of ``E(q)`` at every
``q``, and the heap's minimum just before ``t_new`` competes is ``bnd[t_new]``.

GPU path (Triton): the schedule has a closed form that is parallel over tokens.  Let
``P_k(t)`` be the k-th smallest position among the tokens ``t' >= s`` that rank above
``t``.  ``t`` is kept at ``q`` iff fewer than ``k`` tokens of ``E(q)`` rank above it, so
``evict_at[t] = max(t, P_k(t)) + w`` (``NEVER`` if ``P_k(t)`` does not exist or the
result is past ``S - 1``).  One program takes a block of tokens ``t``, scans the key
blocks ``t'`` in position order counting higher-ranked tokens, and stops as soon as
every row of its block has reached ``k``: O(S^2) comparisons per head in the worst case,
which on a GPU costs a fraction of one attention layer at training lengths (see
``benchmarks/test_schedule.py``).  Decisions then follow from the schedule: the kept
set just before ``t`` competes is ``{t' in [s, t-1] : evict_at[t'] >= t + w}`` (exactly
``k`` tokens where a decision exists) and ``bnd[t]`` is its lowest-ranked member;
``y[t] = +1`` iff ``evict_at[t] > t + w``.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from ._utils import NEVER, check_int, check_tensor, empty, host_check, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None


INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

KSpec = int | Sequence[int] | torch.Tensor
"""What ``k`` may be: one int, or one per KV head (a sequence of ints or a 1-D integer tensor)."""


def _check(priority: object, sinks: object, window: object, k: object,
           check: object = None) -> tuple[int, int, int | torch.Tensor]:
    """Validate; return ``(sinks, window, k)`` clamped to equivalent values that keep ``t + window`` and
    every count inside int32 (``sinks, k <= S`` and ``window <= S`` change no schedule of ``S`` tokens).
    A per-head ``k`` comes back as an int32 ``[H]`` tensor on the priority's device (see :func:`head_k`)."""
    check_tensor("priority", priority, 3, floating=True)
    check_int("sinks", sinks, minimum=0)
    check_int("window", window, minimum=1)
    S = priority.shape[2]
    if S > NEVER - 1:
        raise ValueError(f"sequences of at most {NEVER - 1} tokens (int32 positions), got S = {S}")
    return min(sinks, S), min(window, max(S, 1)), head_k(k, priority.shape[1], S, priority.device, check=check)


def head_k(k: object, H: int, S: int, device: torch.device, *, check: object = None) -> int | torch.Tensor:
    """``k`` of a schedule call with ``H`` KV heads and ``S`` tokens, checked and clamped to ``[0, S]``.

    An int gives an int.  One per head (a sequence of ``H`` ints, a 1-D integer tensor or NumPy array of
    length ``H``) gives an int32 ``[H]`` tensor on ``device``.  Wrong type or dtype -> ``TypeError``; wrong
    length, a negative entry -> ``ValueError``.  A tensor's values are read on the host only where that
    costs no device synchronisation (``check=None``: a CPU tensor, or a CPU ``device``, in an eager call;
    ``check=True`` / ``False`` force it either way, as the decode ops' ``check``); unchecked, a negative
    entry counts as 0 (clamped on the device, never read back).
    """
    if isinstance(k, (bool, int)):
        return min(check_int("k", k, minimum=0), S)
    if isinstance(k, np.integer):
        return min(check_int("k", int(k), minimum=0), S)
    if isinstance(k, np.ndarray):
        if k.dtype.kind not in "iu":
            raise TypeError(f"k per head must hold integers, got a NumPy array of dtype {k.dtype}")
        k = torch.from_numpy(np.ascontiguousarray(k))
    if isinstance(k, torch.Tensor):
        if k.dtype not in INT_DTYPES:
            raise TypeError(f"k per head must be an integer tensor (int8/16/32/64, uint8), got dtype {k.dtype}")
        if k.dim() != 1 or k.shape[0] != H:
            raise ValueError(f"k per head must be 1-D with one entry per KV head, [H] = [{H}] "
                             f"(H = priority.shape[1]), got shape {tuple(k.shape)}")
        kt = k.detach()
        if host_check(check, kt.device if kt.device.type == "cpu" else device):
            bad = (kt.to(torch.int64) < 0).nonzero().flatten().tolist()
            if bad:
                raise ValueError(f"k per head must be >= 0, got {kt.tolist()} (negative at heads {bad})")
        return kt.to(device=device, dtype=torch.int64).clamp(0, S).to(torch.int32)
    if isinstance(k, (list, tuple)):
        if len(k) != H:
            raise ValueError(f"k per head needs one entry per KV head, {H} (H = priority.shape[1]), got "
                             f"{len(k)}: {list(k)[:16]}")
        vals = []
        for h, kh in enumerate(k):
            if isinstance(kh, bool) or not isinstance(kh, (int, np.integer)):
                raise TypeError(f"k per head must hold ints, got {type(kh).__name__} ({kh!r}) at head {h}")
            if kh < 0:
                raise ValueError(f"k per head must be >= 0, got {kh} at head {h} (k = {list(k)})")
            vals.append(min(int(kh), S))
        kt = torch.tensor(vals, dtype=torch.int32)
        if device.type == "cuda":  # pinned + non_blocking: no wait for the stream's earlier work
            return kt.pin_memory().to(device, non_blocking=True)
        return kt.to(device)
    raise TypeError(f"k must be an int, a sequence of H ints or a 1-D integer tensor [H], got "
                    f"{type(k).__name__} ({str(k)[:60]})")


def _nan_to_neg_inf(p: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(p), torch.full_like(p, float("-inf")), p)


# --------------------------------------------------------------------------------- CPU
def _cpu_schedule(priority: torch.Tensor, sinks: int, window: int, k: int | torch.Tensor,
                  decisions: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    p = _nan_to_neg_inf(priority.detach().to(torch.float64)).cpu().numpy()
    Bsz, H, S = p.shape
    ks = [k] * H if isinstance(k, int) else k.cpu().tolist()  # the k of each head
    ev = np.full((Bsz, H, S), NEVER, dtype=np.int32)
    y = np.zeros((Bsz, H, S), dtype=np.int8) if decisions else None
    bnd = np.full((Bsz, H, S), -1, dtype=np.int32) if decisions else None
    w, s = window, sinks
    heappush, heapreplace = heapq.heappush, heapq.heapreplace
    for b in range(Bsz):
        for h in range(H):
            k = ks[h]
            pr = p[b, h].tolist()
            evh = ev[b, h]
            heap: list[tuple[float, int]] = []  # (priority, position): the minimum ranks lowest
            for t in range(s, S - w):  # t joins E at q = t + w <= S - 1
                q = t + w
                key = (pr[t], t)
                if k == 0:
                    evh[t] = q
                    continue
                if len(heap) < k:
                    heappush(heap, key)
                    continue
                low = heap[0]
                if decisions:
                    bnd[b, h, t] = low[1]
                    y[b, h, t] = 1 if key > low else -1
                if key > low:
                    heapreplace(heap, key)
                    evh[low[1]] = q
                else:
                    evh[t] = q
    return ev, y, bnd


# ------------------------------------------------------------------------------ Triton
if triton is not None:
    NEVER_C = tl.constexpr(NEVER)

    @triton.jit
    def _ranks_above(p_t, t, p_u, u):
        # does token u rank above token t? (higher priority, ties to the newer token)
        return (p_u > p_t) | ((p_u == p_t) & (u > t))

    @triton.jit
    def _schedule_kernel(P, EV, K, S, H, sinks, window,
                         BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr):
        pid_t = tl.program_id(0)
        head = tl.program_id(1)  # batch row * H + KV head
        k = tl.load(K + head % H)  # this head's long-range slots
        P += head.to(tl.int64) * S
        EV += head.to(tl.int64) * S
        t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < S
        p_t = tl.load(P + t, mask=t_ok, other=0.0)
        count = tl.zeros([BLOCK_T], dtype=tl.int32)
        found = tl.full([BLOCK_T], -1, dtype=tl.int32)  # P_k(t), -1 while unknown
        need = t_ok & (t >= sinks) & (t + window <= S - 1) & (k > 0)
        # tokens with k == 0 are evicted as soon as they are eligible
        active = tl.sum(need.to(tl.int32), axis=0)
        u0 = sinks
        while (u0 < S) & (active > 0):
            u = u0 + tl.arange(0, BLOCK_U)
            u_ok = u < S
            p_u = tl.load(P + u, mask=u_ok, other=float("-inf"))
            above = (_ranks_above(p_t[:, None], t[:, None], p_u[None, :], u[None, :]) & u_ok[None, :]).to(tl.int32)
            blk = tl.sum(above, axis=1)
            cross = (count < k) & (count + blk >= k)
            # the prefix scan is only needed in the (rare) blocks where some row reaches k
            if tl.sum(cross.to(tl.int32), axis=0) > 0:
                c = tl.cumsum(above, axis=1) + count[:, None]
                hit = (above > 0) & (c == k)  # the k-th higher-ranked token in position order
                pos = tl.max(tl.where(hit, u[None, :], -1), axis=1)
                found = tl.where((found < 0) & (pos >= 0), pos, found)
            count += blk
            active = tl.sum((need & (found < 0)).to(tl.int32), axis=0)
            u0 += BLOCK_U
        ev = tl.maximum(t, found) + window
        ev = tl.where(found < 0, NEVER_C, ev)
        ev = tl.where(ev > S - 1, NEVER_C, ev)
        ev = tl.where((k == 0) & (t >= sinks) & (t + window <= S - 1), t + window, ev)
        ev = tl.where(t < sinks, NEVER_C, ev)
        tl.store(EV + t, ev, mask=t_ok)

    @triton.jit
    def _decisions_kernel(P, EV, Y, BND, K, S, H, sinks, window,
                          BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr):
        pid_t = tl.program_id(0)
        head = tl.program_id(1)  # batch row * H + KV head
        k = tl.load(K + head % H)
        P += head.to(tl.int64) * S
        EV += head.to(tl.int64) * S
        Y += head.to(tl.int64) * S
        BND += head.to(tl.int64) * S
        t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < S
        ev_t = tl.load(EV + t, mask=t_ok, other=0)
        decide = t_ok & (k > 0) & (t >= sinks) & (t + window <= S - 1) & (t - sinks >= k)
        # lowest-ranked member of {u in [s, t-1] : evict_at[u] >= t + w}
        best_p = tl.full([BLOCK_T], float("inf"), dtype=tl.float32)
        best_u = tl.full([BLOCK_T], NEVER_C, dtype=tl.int32)
        t_hi = tl.minimum(pid_t * BLOCK_T + BLOCK_T, S)
        u0 = sinks
        while u0 < t_hi:
            u = u0 + tl.arange(0, BLOCK_U)
            u_ok = u < S
            p_u = tl.load(P + u, mask=u_ok, other=float("inf"))
            ev_u = tl.load(EV + u, mask=u_ok, other=0)
            member = u_ok[None, :] & (u[None, :] < t[:, None]) & (ev_u[None, :] >= t[:, None] + window)
            # lowest rank = lowest priority, ties to the oldest position
            pm = tl.where(member, p_u[None, :], float("inf"))
            blk_p = tl.min(pm, axis=1)
            um = tl.where(member & (pm == blk_p[:, None]), u[None, :], NEVER_C)
            blk_u = tl.min(um, axis=1)
            better = (blk_p < best_p) | ((blk_p == best_p) & (blk_u < best_u))
            best_p = tl.where(better, blk_p, best_p)
            best_u = tl.where(better, blk_u, best_u)
            u0 += BLOCK_U
        y = tl.where(ev_t > t + window, 1, -1)
        y = tl.where(decide, y, 0).to(tl.int8)
        bnd = tl.where(decide, best_u, -1)
        tl.store(Y + t, y, mask=t_ok)
        tl.store(BND + t, bnd, mask=t_ok)



def _triton_prep(priority: torch.Tensor) -> torch.Tensor:
    return _nan_to_neg_inf(priority.detach().to(torch.float32)).contiguous()


_BLOCK_T, _BLOCK_U = 64, 64


def _k_tensor(k: int | torch.Tensor, H: int, device: torch.device) -> torch.Tensor:
    """The kernels' ``K``: int32 ``[H]`` on ``device`` (a fill for a uniform ``k``: no host copy)."""
    return torch.full((H,), k, dtype=torch.int32, device=device) if isinstance(k, int) else k


def _triton_schedule(p32: torch.Tensor, sinks: int, window: int, kt: torch.Tensor) -> torch.Tensor:
    Bsz, H, S = p32.shape
    ev = empty((Bsz, H, S), dtype=torch.int32, device=p32.device)
    if ev.numel() == 0:  # (an empty CUDA tensor has no pointer a kernel may take)
        return ev
    grid = (triton.cdiv(S, _BLOCK_T), Bsz * H)
    _schedule_kernel[grid](p32, ev, kt, S, H, sinks, window, BLOCK_T=_BLOCK_T, BLOCK_U=_BLOCK_U)
    return ev


# ------------------------------------------------------------------------------ public
def eviction_schedule(priority: torch.Tensor, *, sinks: int, window: int, k: KSpec,
                      check: bool | None = None) -> torch.Tensor:
    """``evict_at [B, Hkv, S]`` int32: the first query ``q >= t + w`` at which token ``t`` is not kept.

    Args:
        priority: float ``[B, Hkv, S]`` static priorities ``p = r - t log(gamma)`` (any float dtype;
            the GPU path compares in float32, the CPU path in float64).  NaN ranks as ``-inf``.
        sinks: ``s >= 0`` sink tokens (never evicted).
        window: ``w >= 1`` protected recent tokens (the query included).
        k: ``k >= 0`` long-range slots: one int for every KV head, or one per KV head (head-adaptive
            budgets): a sequence of ``Hkv`` ints or a 1-D integer tensor ``[Hkv]`` (on the device: the
            kernels read it there, no host synchronisation).  Head ``h`` of every batch row keeps its
            ``k[h]`` best tokens; ``k[h] >= S`` evicts nothing on that head.
        check: whether a tensor ``k`` is read back to refuse negative entries (see :func:`head_k`:
            ``None`` reads it only where that needs no device synchronisation; unchecked, a negative
            entry counts as 0).

    ``NEVER = 2**31 - 1`` marks sinks, tokens never evicted within the sequence and tokens still
    in the window at its end.  Which keys a query sees: :func:`visible_at`.
    """
    sinks, window, k = _check(priority, sinks, window, k, check)
    if use_triton(priority):
        return _triton_schedule(_triton_prep(priority), sinks, window,
                                _k_tensor(k, priority.shape[1], priority.device))
    ev, _, _ = _cpu_schedule(priority, sinks, window, k, decisions=False)
    return torch.from_numpy(ev).to(priority.device)


def eviction_decisions(priority: torch.Tensor, *, sinks: int, window: int, k: KSpec,
                       check: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher decisions ``(y int8, bnd int32)``, each ``[B, Hkv, S]``, indexed by the token decided.

    For ``s <= t <= S-1-w`` with at least ``k >= 1`` tokens in ``{s..t-1}``: ``bnd[t]`` is the
    k-th ranked token of ``{s..t-1}`` (the lowest-ranked kept token just before ``t`` competes)
    and ``y[t] = +1`` if ``t`` ranks above it, else ``-1``.  Elsewhere ``y = 0, bnd = -1``.
    Same arguments as :func:`eviction_schedule` (a per-head ``k``: each head with its own).
    """
    sinks, window, k = _check(priority, sinks, window, k, check)
    if use_triton(priority):
        p32 = _triton_prep(priority)
        Bsz, H, S = p32.shape
        kt = _k_tensor(k, H, p32.device)
        ev = _triton_schedule(p32, sinks, window, kt)
        y = empty((Bsz, H, S), dtype=torch.int8, device=p32.device)
        bnd = empty((Bsz, H, S), dtype=torch.int32, device=p32.device)
        if ev.numel() > 0:
            grid = (triton.cdiv(S, _BLOCK_T), Bsz * H)
            _decisions_kernel[grid](p32, ev, y, bnd, kt, S, H, sinks, window,
                                    BLOCK_T=_BLOCK_T, BLOCK_U=_BLOCK_U)
        return y, bnd
    _, y, bnd = _cpu_schedule(priority, sinks, window, k, decisions=True)
    return torch.from_numpy(y).to(priority.device), torch.from_numpy(bnd).to(priority.device)


def visible_at(evict_at: torch.Tensor, q: int, *, sinks: int, window: int) -> torch.Tensor:
    """Bool ``[..., S]``: which keys query ``q`` sees, from ``evict_at [..., S]`` (int, any leading dims).

    The mask rule of docs/DESIGN.md section 2 for one query: key ``t`` is visible iff
    ``t <= q and (t < s or t > q - w or q < evict_at[t])``.  ``O(S)`` per head (one row of the mask,
    never the ``[S, S]`` one)."""
    if not isinstance(evict_at, torch.Tensor):
        raise TypeError(f"evict_at must be a torch.Tensor, got {type(evict_at).__name__}")
    if evict_at.dtype not in (torch.int32, torch.int64) or evict_at.dim() < 1:
        raise ValueError(f"evict_at must be an int32/int64 tensor [..., S], got {evict_at.dtype} "
                         f"{tuple(evict_at.shape)}")
    S = evict_at.shape[-1]
    check_int("q", q, minimum=0)
    if q >= S:
        raise ValueError(f"q must be a query of the sequence, 0 <= q < S = {S}, got {q}")
    check_int("sinks", sinks, minimum=0)
    check_int("window", window, minimum=1)
    t = torch.arange(S, device=evict_at.device)
    protected = (t <= q) & ((t < sinks) | (t > q - window))
    return (t <= q) & (protected | (evict_at.to(torch.int64) > q))
