"""``eviction_schedule`` and ``eviction_decisions``: when each token loses its long-range slot.

Semantics: docs/DESIGN.md "Eviction semantics" (restated in ``reference.py``).  NaN priorities
rank as ``-inf`` (below every number, ties to the newer token as always).  ``k`` is one int for every
KV head or one per KV head (head-adaptive budgets, docs/DESIGN.md section 7): each head runs the rule
with its own ``k``; the kernels load it per program from an int32 ``[H]`` tensor on the device.

Both ops are order statistics of one ranking, ``O(S log S)`` work per head, parallel over tokens.

* The invariant: priorities are static (the age penalty ``q log(gamma)`` shifts every kept token
  alike), so the order of two tokens never changes.  ``t`` is kept at ``q >= t + w`` iff fewer than
  ``k`` tokens of ``E(q) = {s .. q-w}`` rank above it, and that count only grows with ``q``.  Hence
  ``evict_at[t] = max(t, P_k(t)) + w`` with ``P_k(t)`` the k-th smallest position among the tokens
  ``u >= s`` that rank above ``t`` (the k-th of them, in position order, to join ``E``); ``NEVER``
  if there are fewer than ``k`` or the result is past ``S - 1``; ``t + w`` for ``k = 0``.
* Decisions: ``bnd[t]`` is the k-th ranked token of ``{s .. t-1}``, the k-th smallest *rank* among
  the positions ``< t``; ``y[t] = +1`` iff ``t`` ranks above it.
* Sort the tokens once by rank (best first; ties to the newer token, NaN and the sinks as ``-inf``,
  so the sinks rank below every other token and never count): ``perm[i]`` is the position of the
  ``i``-th ranked token and ``rank = perm^-1``.  Then ``P_k(t)`` is the k-th smallest value of the
  prefix ``perm[0 : rank[t]]`` and ``bnd[t] = perm[v]`` with ``v`` the k-th smallest value of the
  prefix ``rank[0 : t]``: the same query, "k-th smallest of a prefix of a permutation", on ``perm``
  and on ``rank``.
* A wavelet tree of the permutation answers it in ``L = ceil(log2 S)`` steps per token.  Level
  ``l`` lists the entries grouped by value block of ``2^(L-l)`` (its nodes), in index order within a
  node, and keeps ``Z_l``, the running count of entries whose value lies in the lower half of their
  node.  A query walks from the root with its prefix length ``j`` inside the node that starts at
  ``a``: ``c0 = Z_l[a + j] - Z_l[a]`` of them are in the lower half (``Z_l[a] = a / 2``: every node
  before ``a`` is full), and it descends there if ``k <= c0``, else into the upper half with
  ``k - c0``; the leaf reached is the answer (one load per level).
* Building the levels: on a GPU one segmented ``torch.sort`` of the ``L * S`` keys
  ``(node, index, half)`` per head (a radix sort: fixed passes over the keys) and a running count
  (Triton); on the CPU path the classic top-down build, a stable partition per level (``O(S)`` each).
  Launches per call on a GPU: priority clean-up, the rank sort, the keys, the level sort, the counts,
  the walk (6, whatever ``S``); memory ``O(L * S)`` int32 per head.
"""
from __future__ import annotations

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


def _levels(S: int) -> int:
    """``L``: the wavelet tree's levels for values ``0 .. S-1`` (at least one)."""
    return max(1, (S - 1).bit_length())


# --------------------------------------------------------------------------------- CPU
def _clean(p: torch.Tensor, sinks: int) -> torch.Tensor:
    """The ranking's priorities ``[R, S]``: NaN and the sinks as ``-inf`` (the sinks then rank below every
    other token: ties go to the newer), ``-0.0`` as ``+0.0`` (they are equal, so they tie)."""
    t = torch.arange(p.shape[-1], device=p.device)
    p = torch.where(torch.isnan(p) | (t < sinks), torch.full_like(p, float("-inf")), p)
    return torch.where(p == 0, torch.zeros_like(p), p)


def _torch_order(p: torch.Tensor, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, rank)`` int64 ``[R, S]``: ``perm[i]`` the position of the ``i``-th ranked token (best first,
    ties to the newer), ``rank`` its inverse.  A stable descending sort of the reversed sequence puts
    the newer of two equal priorities first."""
    S = p.shape[-1]
    perm = (S - 1) - torch.sort(_clean(p, sinks).flip(-1), dim=-1, descending=True, stable=True).indices
    pos = torch.arange(S, device=p.device).expand_as(perm).contiguous()
    return perm, torch.empty_like(perm).scatter_(-1, perm, pos)


def _torch_tree(a: torch.Tensor) -> list[torch.Tensor]:
    """``Z``: one int64 ``[R, S + 1]`` per level (``L`` of them) of the wavelet tree of each row of the
    permutation ``a [R, S]``.

    Top-down: level 0 is ``a`` itself; each level counts (exclusive running sum, ``Z_l``) the entries
    in the lower half of their node and stably partitions every node into its halves for the next
    level.  ``O(S)`` per level."""
    R, S = a.shape
    L = _levels(S)
    g = torch.arange(S, device=a.device).expand(R, S)
    cur, Z = a, []
    for lev in range(L):
        half = 1 << (L - 1 - lev)
        bit = (cur >> (L - 1 - lev)) & 1
        z = torch.nn.functional.pad(torch.cumsum(1 - bit, dim=-1), (1, 0))
        Z.append(z)
        if lev == L - 1:
            break
        start = (cur >> (L - lev)) << (L - lev)  # the node's first index (values are 0 .. S-1, all present)
        low = z[:, :S] - (start >> 1)  # lower-half entries before g in its node (Z_l[start] = start / 2)
        dest = torch.where(bit == 0, start + low, g + half - low)
        cur = torch.empty_like(cur).scatter_(-1, dest, cur)
    return Z


def _torch_kth(Z: list[torch.Tensor], m: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The ``k``-th smallest (``1 <= k <= m``) of the first ``m`` entries of each row, all ``[R, S]``
    queries at once: ``L`` steps down the tree ``Z`` (see the module's docstring)."""
    L = len(Z)
    a = torch.zeros_like(m)
    for lev, z in enumerate(Z):
        c0 = z.gather(-1, a + m) - (a >> 1)  # lower-half entries of the prefix (Z_l[a] = a / 2)
        high = k > c0
        m = torch.where(high, m - c0, c0)
        k -= c0 * high
        a += high * (1 << (L - 1 - lev))
    return a


def _torch_rows(p: torch.Tensor, kr: torch.Tensor, sinks: int, window: int,
                decisions: bool) -> tuple[torch.Tensor, ...]:
    """``evict_at`` or ``(y, bnd)`` (int64) of the rows ``p [R, S]`` (float64), ``kr [R, 1]`` each row's k."""
    R, S = p.shape
    perm, rank = _torch_order(p, sinks)
    kr = kr.expand(R, S)
    t = torch.arange(S, device=p.device).expand(R, S)
    elig = (t >= sinks) & (t + window <= S - 1)
    if not decisions:
        ask = elig & (kr >= 1) & (rank >= kr)  # at least k tokens rank above t
        pk = _torch_kth(_torch_tree(perm), torch.where(ask, rank, S), torch.where(ask, kr, 1))
        ev = torch.maximum(t, pk) + window
        ev = torch.where(ask & (ev <= S - 1), ev, NEVER)
        return (torch.where(elig & (kr == 0), t + window, ev),)
    ask = elig & (kr >= 1) & (t - sinks >= kr)  # a full long-range set before t
    v = _torch_kth(_torch_tree(rank), torch.where(ask, t, S), torch.where(ask, kr, 1))
    bnd = perm.gather(-1, v.clamp(max=S - 1))
    return torch.where(ask, torch.where(rank < v, 1, -1), 0), torch.where(ask, bnd, -1)


_CPU_CHUNK = 1 << 16  # tokens per batch of rows on the CPU path (its arrays stay in the cache)


def _torch_schedule(priority: torch.Tensor, sinks: int, window: int, k: int | torch.Tensor,
                    decisions: bool) -> tuple[torch.Tensor, ...]:
    """The CPU path: ``evict_at`` or ``(y, bnd)``, ranking in float64, a few rows at a time."""
    Bsz, H, S = priority.shape
    R = Bsz * H
    p = priority.detach().to(torch.float64).reshape(R, S)
    kt = (torch.full((H,), k) if isinstance(k, int) else k.cpu()).to(torch.int64)
    kr = kt.repeat(Bsz).view(R, 1).to(p.device)
    # rows per pass: enough for the cache (_CPU_CHUNK tokens) and at least one per intra-op thread, since a sort
    # along the last dimension is parallel over rows only (one 64K row per pass sorted on one thread of two)
    step = max(1, _CPU_CHUNK // S, torch.get_num_threads())
    parts = [_torch_rows(p[r:r + step], kr[r:r + step], sinks, window, decisions) for r in range(0, R, step)]
    outs = [torch.cat(col) for col in zip(*parts)]
    dtypes = (torch.int8, torch.int32) if decisions else (torch.int32,)
    return tuple(o.to(dt).view(Bsz, H, S) for o, dt in zip(outs, dtypes))


# ------------------------------------------------------------------------------ Triton
if triton is not None:
    NEVER_C = tl.constexpr(NEVER)

    @triton.jit
    def _prep_kernel(P, PF, S, sinks, BLOCK: tl.constexpr):
        # PF[row, S-1-x] = the ranking's priority of token x (float32; NaN and sinks -inf, -0 -> +0)
        row = tl.program_id(1)
        x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = x < S
        p = tl.load(P + row.to(tl.int64) * S + x, mask=ok, other=0.0).to(tl.float32)
        p = tl.where((p != p) | (x < sinks), float("-inf"), p)
        p = tl.where(p == 0.0, 0.0, p)
        tl.store(PF + row.to(tl.int64) * S + (S - 1 - x), p, mask=ok)

    @triton.jit
    def _order_kernel(J, PERM, RANK, KEYS, S, L, OF_PERM: tl.constexpr, BLOCK: tl.constexpr):
        # from the sort of the reversed priorities: perm, rank, and the L level keys of the wavelet tree
        # of perm (OF_PERM) or of rank: (node << L | index) << 1 | half, at the index's slot
        row = tl.program_id(1)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < S
        base = row.to(tl.int64) * S
        x = (S - 1 - tl.load(J + base + i, mask=ok, other=0)).to(tl.int32)  # position of the i-th ranked
        tl.store(PERM + base + i, x, mask=ok)
        tl.store(RANK + base + x, i, mask=ok)
        if OF_PERM:
            idx = i.to(tl.int64)
            val = x.to(tl.int64)
        else:
            idx = x.to(tl.int64)
            val = i.to(tl.int64)
        kp = KEYS + row.to(tl.int64) * L * S + idx  # level 0's slot; a level further on is S further
        for lev in range(L):
            key = ((((val >> (L - lev)) << L) | idx) << 1) | ((val >> (L - 1 - lev)) & 1)
            tl.store(kp, key.to(KEYS.dtype.element_ty), mask=ok)
            kp += S

    @triton.jit
    def _counts_kernel(SK, Z, S, BLOCK: tl.constexpr):
        # Z[seg, 0..S]: exclusive running count of lower-half entries of one sorted level (one program each)
        seg = tl.program_id(0).to(tl.int64)
        SK += seg * S
        Z += seg * (S + 1)
        tl.store(Z, 0)
        carry = 0
        for c in range(0, S, BLOCK):
            g = c + tl.arange(0, BLOCK)
            ok = g < S
            low = 1 - (tl.load(SK + g, mask=ok, other=1) & 1).to(tl.int32)
            tl.store(Z + 1 + g, tl.cumsum(low, axis=0) + carry, mask=ok)
            carry += tl.sum(low, axis=0)

    @triton.jit
    def _kth(Z, m, k, ask, S, L):
        # k-th smallest of the first m entries (1 <= k <= m where ask): L steps down the tree Z [L, S + 1]
        a = tl.zeros_like(m)
        for lev in range(L):
            # lower-half entries of the prefix; every node before a is full, so Z_l[a] = a / 2
            c0 = tl.load(Z + a + m, mask=ask, other=0) - (a >> 1)
            Z += S + 1  # the next level (pointer arithmetic: 64-bit)
            low = k <= c0
            k = tl.where(low, k, k - c0)
            m = tl.where(low, c0, m - c0)
            a = tl.where(low, a, a + (1 << (L - 1 - lev)))
        return a

    @triton.jit
    def _schedule_walk_kernel(RANK, Z, EV, K, S, H, L, sinks, window, BLOCK: tl.constexpr):
        row = tl.program_id(1)  # batch row * H + KV head
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        k = tl.zeros_like(t) + tl.load(K + row % H)  # (a vector: the interpreter's masks must be one)
        ok = t < S
        base = row.to(tl.int64) * S
        m = tl.load(RANK + base + t, mask=ok, other=0)  # the tokens ranked above t
        elig = ok & (t >= sinks) & (t + window <= S - 1)
        ask = elig & (k > 0) & (m >= k)
        pk = _kth(Z + row.to(tl.int64) * L * (S + 1), m, k, ask, S, L)
        ev = tl.maximum(t, pk) + window
        ev = tl.where(ask & (ev <= S - 1), ev, NEVER_C)
        ev = tl.where(elig & (k <= 0), t + window, ev)
        tl.store(EV + base + t, ev, mask=ok)

    @triton.jit
    def _decisions_walk_kernel(RANK, PERM, Z, Y, BND, K, S, H, L, sinks, window, BLOCK: tl.constexpr):
        row = tl.program_id(1)
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        k = tl.zeros_like(t) + tl.load(K + row % H)
        ok = t < S
        base = row.to(tl.int64) * S
        ask = ok & (k > 0) & (t >= sinks) & (t + window <= S - 1) & (t - sinks >= k)
        v = _kth(Z + row.to(tl.int64) * L * (S + 1), t, k, ask, S, L)
        r_t = tl.load(RANK + base + t, mask=ok, other=0)
        bnd = tl.load(PERM + base + v, mask=ask, other=-1)
        y = tl.where(ask, tl.where(r_t < v, 1, -1), 0).to(tl.int8)
        tl.store(Y + base + t, y, mask=ok)
        tl.store(BND + base + t, tl.where(ask, bnd, -1), mask=ok)


_BLOCK = 256  # tokens per program of the element-wise kernels and the walks
_SCAN_BLOCK = 1024  # entries per step of the running counts


def _k_tensor(k: int | torch.Tensor, H: int, device: torch.device) -> torch.Tensor:
    """The kernels' ``K``: int32 ``[H]`` on ``device`` (a fill for a uniform ``k``: no host copy)."""
    return torch.full((H,), k, dtype=torch.int32, device=device) if isinstance(k, int) else k


def gpu_traffic(B: int, H: int, S: int, *, priority_bytes: int = 4, decisions: bool = False) -> int:
    """Bytes one call of the GPU path reads and writes (``eviction_schedule``, or ``eviction_decisions``
    with ``decisions=True``) for priorities ``[B, H, S]`` of ``priority_bytes`` each: every kernel's loads
    and stores with all tokens asking, plus each ``torch.sort``'s input and output (its int64 indices
    included; not the radix sort's internal passes).  About ``B H S (48 + 32 L)`` with ``L = ceil(log2 S)``
    (int32 level keys up to ``S = 2^15``): the figure a roofline of the schedule divides by its time."""
    R, L = B * H, _levels(S)
    kb = 4 if 2 * L <= 31 else 8  # the level keys' bytes
    n, nl = R * S, R * L * S
    prep = n * priority_bytes + n * 4
    rank_sort = n * 4 + n * (4 + 8)
    order = n * 8 + n * 8 + nl * kb
    level_sort = nl * kb + nl * (kb + 8)
    counts = R * L * 4 + nl * (kb + 4)
    walk = R * -(-S // _BLOCK) * 4 + n * 4 + nl * 4 + (n * (4 + 1 + 4) if decisions else n * 4)
    return prep + rank_sort + order + level_sort + counts + walk


def _triton_tree(priority: torch.Tensor, sinks: int, of_perm: bool):
    """``(perm, rank, Z)`` int32 of the Triton path: ``perm``/``rank`` ``[R, S]`` and the wavelet tree of
    ``perm`` (``of_perm``) or of ``rank``, ``Z [R, L, S + 1]``.  Four launches and two sorts."""
    Bsz, H, S = priority.shape
    R, L, dev = Bsz * H, _levels(S), priority.device
    grid = (triton.cdiv(S, _BLOCK), R)
    pf = torch.empty((R, S), dtype=torch.float32, device=dev)
    _prep_kernel[grid](priority.detach().contiguous(), pf, S, sinks, BLOCK=_BLOCK)
    order = torch.sort(pf, dim=-1, descending=True, stable=True).indices
    perm = torch.empty((R, S), dtype=torch.int32, device=dev)
    rank = torch.empty((R, S), dtype=torch.int32, device=dev)
    keys = torch.empty((R, L, S), dtype=torch.int32 if 2 * L <= 31 else torch.int64, device=dev)
    _order_kernel[grid](order, perm, rank, keys, S, L, OF_PERM=of_perm, BLOCK=_BLOCK)
    keys = torch.sort(keys, dim=-1).values
    Z = torch.empty((R, L, S + 1), dtype=torch.int32, device=dev)
    _counts_kernel[(R * L,)](keys, Z, S, BLOCK=_SCAN_BLOCK)
    return perm, rank, Z


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
    Bsz, H, S = priority.shape
    if priority.numel() == 0:  # (an empty CUDA tensor has no pointer a kernel may take)
        return empty((Bsz, H, S), dtype=torch.int32, device=priority.device)
    if use_triton(priority):
        _, rank, Z = _triton_tree(priority, sinks, of_perm=True)
        ev = empty((Bsz, H, S), dtype=torch.int32, device=priority.device)
        _schedule_walk_kernel[(triton.cdiv(S, _BLOCK), Bsz * H)](
            rank, Z, ev, _k_tensor(k, H, priority.device), S, H, Z.shape[1], sinks, window, BLOCK=_BLOCK)
        return ev
    return _torch_schedule(priority, sinks, window, k, decisions=False)[0]


def eviction_decisions(priority: torch.Tensor, *, sinks: int, window: int, k: KSpec,
                       check: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher decisions ``(y int8, bnd int32)``, each ``[B, Hkv, S]``, indexed by the token decided.

    For ``s <= t <= S-1-w`` with at least ``k >= 1`` tokens in ``{s..t-1}``: ``bnd[t]`` is the
    k-th ranked token of ``{s..t-1}`` (the lowest-ranked kept token just before ``t`` competes)
    and ``y[t] = +1`` if ``t`` ranks above it, else ``-1``.  Elsewhere ``y = 0, bnd = -1``.
    Same arguments as :func:`eviction_schedule` (a per-head ``k``: each head with its own).
    """
    sinks, window, k = _check(priority, sinks, window, k, check)
    Bsz, H, S = priority.shape
    if priority.numel() == 0:
        return (empty((Bsz, H, S), dtype=torch.int8, device=priority.device),
                empty((Bsz, H, S), dtype=torch.int32, device=priority.device))
    if use_triton(priority):
        perm, rank, Z = _triton_tree(priority, sinks, of_perm=False)
        y = empty((Bsz, H, S), dtype=torch.int8, device=priority.device)
        bnd = empty((Bsz, H, S), dtype=torch.int32, device=priority.device)
        _decisions_walk_kernel[(triton.cdiv(S, _BLOCK), Bsz * H)](
            rank, perm, Z, y, bnd, _k_tensor(k, H, priority.device), S, H, Z.shape[1], sinks, window,
            BLOCK=_BLOCK)
        return y, bnd
    return _torch_schedule(priority, sinks, window, k, decisions=True)


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
