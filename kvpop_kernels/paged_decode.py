"""``ragged_paged_decode``: one decode query per query head over per-KV-head ragged, paged stores.

The attention of DMS's cache (``kvpop.baselines.dms.DMSCacheLayer``), where every KV head holds its own
number of tokens.  KV head ``h`` attends over

* the first ``n_fixed`` slots of ``fixed_k[h] / fixed_v[h]`` (sinks and window: the same count for
  every head), then
* its ``lengths[h]`` long-range tokens, token ``i`` at ``pool[table[h, i // P], i % P]`` (pages of
  ``P`` tokens from a pool that the heads share; ``table`` is the per-head page table).

Semantics: ``reference.ragged_paged_decode``.  Reads only (the cache's appends are the caller's).

Triton (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``): stage 1, grid ``(Hkv,
num_splits)``, program ``(h, i)`` reads ``lengths[h]`` on the device and takes the ``i``-th of
``num_splits`` equal chunks (whole ``block_n`` tiles) of *its own head's* ``n_fixed + lengths[h]``
keys, so a head costs its own length, never the longest head's (a padded layout pays the longest
for every head).  Each tile loads its keys through the page table (one masked load from the fixed
part, one from the pool) and runs the group's ``G`` queries as one ``[G_PAD, D]`` ``tl.dot`` tile,
base-2 online softmax in float32 (``splitk.online_softmax_tile``, shared with
``fixed_budget_decode``'s stage 1); it writes a normalised partial output and its LSE.  Stage 2,
grid ``(Hq,)``: the LSE merge of the splits (``splitk.merge_splits``).  No value goes back to the host, so
the launch depends on no data (``num_splits`` is planned from the table's width, a shape).

PyTorch path (other CPU tensors): vectorised over heads, no gather of keys or values (``_torch_paged``).
"""
from __future__ import annotations

import warnings

import torch

from ._utils import (
    check_gqa,
    check_int,
    check_split_options,
    check_tensor,
    default_scale,
    empty,
    host_check,
    use_triton,
)
from .splitk import CACHE_DTYPES, LOG2E, plan_splits, upcast_operands

try:
    import triton
    import triton.language as tl

    from .splitk import merge_splits, online_softmax_tile, store_split
except Exception:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["ragged_paged_decode"]

_INDEX_DTYPES = (torch.int32, torch.int64)

if triton is not None:
    @triton.jit
    def _paged_stage1(Q, FK, FV, PK, PV, TAB, LEN, MID_O, MID_L,
                      s_fk_h, s_fk_n, s_fk_d, s_fv_h, s_fv_n, s_fv_d,
                      s_pk_p, s_pk_n, s_pk_d, s_pv_p, s_pv_n, s_pv_d, s_tab_h, s_tab_w,
                      N_FIXED, D, PAGE, NPAGES, W, NS, qk_scale,
                      G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                      UPCAST: tl.constexpr):
        h = tl.program_id(0)
        split = tl.program_id(1)
        h64 = h.to(tl.int64)
        # this head's own number of keys; the device-side guard: a length outside [0, W * PAGE] or a
        # page outside the pool is never followed (the head reads nothing there and returns NaN)
        n_lr = tl.load(LEN + h).to(tl.int64)
        len_bad = (n_lr < 0) | (n_lr > W * PAGE)
        total = N_FIXED + tl.where(len_bad, 0, n_lr).to(tl.int32)
        bad = len_bad.to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(total, NS), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, total)
        g = tl.arange(0, G_PAD)
        g_ok = g < G
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        qh = h64 * G + g  # query heads of this KV head (HF repeat_kv order)
        q = tl.load(Q + qh[:, None] * D + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        fk = FK + h64 * s_fk_h
        fv = FV + h64 * s_fv_h
        tab = TAB + h64 * s_tab_h
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            ok = j < end
            fixed = ok & (j < N_FIXED)
            paged = ok & (j >= N_FIXED)
            i = tl.maximum(j - N_FIXED, 0)
            page = tl.load(tab + (i // PAGE).to(tl.int64) * s_tab_w, mask=paged, other=0).to(tl.int64)
            page_bad = paged & ((page < 0) | (page >= NPAGES))
            bad = tl.maximum(bad, tl.max(page_bad.to(tl.int32), axis=0))
            page = tl.where(page_bad, 0, page)
            off = (i % PAGE).to(tl.int64)
            jf = j.to(tl.int64)
            fmask = fixed[:, None] & d_ok[None, :]
            pmask = (paged & (page_bad == 0))[:, None] & d_ok[None, :]
            k = (tl.load(fk + jf[:, None] * s_fk_n + d[None, :] * s_fk_d, mask=fmask, other=0.0)
                 + tl.load(PK + page[:, None] * s_pk_p + off[:, None] * s_pk_n + d[None, :] * s_pk_d, mask=pmask,
                           other=0.0))
            v = (tl.load(fv + jf[:, None] * s_fv_n + d[None, :] * s_fv_d, mask=fmask, other=0.0)
                 + tl.load(PV + page[:, None] * s_pv_p + off[:, None] * s_pv_n + d[None, :] * s_pv_d, mask=pmask,
                           other=0.0))
            m_i, l_i, acc = online_softmax_tile(q, k, v, ok, qk_scale, m_i, l_i, acc, UPCAST)
        store_split(MID_O, MID_L, qh * NS + split, m_i, l_i, acc, bad > 0, g_ok, d, d_ok, D)

    @triton.jit
    def _paged_stage2(MID_O, MID_L, OUT, LSE, D, NS, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        qh = tl.program_id(0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        r = qh.to(tl.int64) * NS
        o, lse = merge_splits(MID_O, MID_L, r, r, NS, D, d, d_ok, BLOCK_S, BLOCK_D, -1)
        tl.store(OUT + qh.to(tl.int64) * D + d, o.to(OUT.dtype.element_ty), mask=d_ok)
        tl.store(LSE + qh, lse)


def _triton_paged(q, fixed_k, fixed_v, n_fixed, pool_k, pool_v, table, lengths, *, scale, num_splits, block_n):
    Hq, D = q.shape
    Hkv = fixed_k.shape[0]
    P = pool_k.shape[1]
    dev = q.device
    upcast = upcast_operands(q.dtype)
    if block_n is None:
        block_n = 32 if dev.type == "cuda" else 64
    num_warps = 4 if (not upcast or dev.type != "cuda") and D <= 128 else 8
    block_d = max(16, triton.next_power_of_2(D))
    Np, W = pool_k.shape[0], table.shape[1]  # the real sizes, for the guard (before any dummy below)
    ns, _ = plan_splits(n_fixed + W * P, Hkv, block_n, num_splits, dev)
    q_c = q.contiguous()
    lens = lengths.contiguous()
    # a zero-size tensor has no usable pointer: a one-page dummy pool / table (never read: lengths 0)
    if pool_k.shape[0] == 0 or table.shape[1] == 0:
        pool_k = pool_v = torch.zeros(1, max(P, 1), D, dtype=q.dtype, device=dev)
        table = torch.zeros(Hkv, 1, dtype=torch.int64, device=dev)
    if fixed_k.shape[1] == 0:
        fixed_k = fixed_v = torch.zeros(Hkv, 1, D, dtype=q.dtype, device=dev)
    mid_o = empty((Hq, ns, D), dtype=torch.float32, device=dev)
    mid_l = empty((Hq, ns), dtype=torch.float32, device=dev)
    out = empty((Hq, D), dtype=q.dtype, device=dev)
    lse = empty((Hq,), dtype=torch.float32, device=dev)
    _paged_stage1[(Hkv, ns)](
        q_c, fixed_k, fixed_v, pool_k, pool_v, table, lens, mid_o, mid_l,
        *fixed_k.stride(), *fixed_v.stride(), *pool_k.stride(), *pool_v.stride(), *table.stride(),
        n_fixed, D, P, Np, W, ns, scale * LOG2E,
        G=Hq // Hkv, G_PAD=max(16, triton.next_power_of_2(Hq // Hkv)), BLOCK_D=block_d, BLOCK_N=block_n,
        UPCAST=upcast, num_warps=num_warps, num_stages=2,
    )
    _paged_stage2[(Hq,)](mid_o, mid_l, out, lse, D, ns, BLOCK_S=min(32, triton.next_power_of_2(ns)),
                         BLOCK_D=block_d, num_warps=4)
    return out, lse


@torch.no_grad()
def _torch_paged(q, fixed_k, fixed_v, n_fixed, pool_k, pool_v, table, lengths, *, scale):
    """The CPU path, vectorised over heads and with no gather of keys or values: every query scores
    every pool row in one matmul (a pool holds what all heads keep, so this costs ``Hkv`` times the
    ideal, but reads the pool once, contiguously), each head then takes its own rows' scores by index,
    and its probabilities go back to pool rows for one matmul with the values, in which the rows no
    valid entry refers to get probability 0: they must hold finite values (masking the pool instead
    cost a pool-sized copy per step, more than the rest of the step)."""
    Hq, D = q.shape
    Hkv = fixed_k.shape[0]
    G = Hq // Hkv
    Np, P, _ = pool_k.shape
    W = table.shape[1]
    dev = q.device
    # the device-side guard (no host read), as in the Triton kernel: a head whose length lies outside
    # [0, W * P], or whose table lists a page outside the pool among its used entries, reads nothing
    # there and returns NaN
    lens = lengths.long()
    bad = (lens < 0) | (lens > W * P)  # [Hkv]
    lens = lens.masked_fill(bad, 0)
    tab = table.long()
    used = torch.arange(W, device=dev) < ((lens + P - 1) // P)[:, None]  # [Hkv, W]
    bad = bad | (used & ((tab < 0) | (tab >= Np))).any(-1)
    nan_rows = bad[:, None].expand(Hkv, G).reshape(Hq)
    qf = q.float()
    s_fix = (qf.view(Hkv, G, D) @ fixed_k[:, :n_fixed].float().transpose(1, 2)) * scale  # [Hkv, G, n_fixed]
    if not (W and Np):
        lse = torch.logsumexp(s_fix, dim=-1)
        p_fix = torch.exp(s_fix - lse.nan_to_num(neginf=0.0)[..., None])
        out = (p_fix @ fixed_v[:, :n_fixed].float()).reshape(Hq, D)
        return _refuse(out, lse.reshape(Hq), nan_rows, q.dtype)
    rows = (tab.clamp(0, Np - 1)[:, :, None] * P + torch.arange(P, device=dev)).reshape(Hkv, W * P)
    ok = torch.arange(W * P, device=dev) < lens[:, None]  # [Hkv, W * P]
    pk, pv = pool_k.reshape(Np * P, D).float(), pool_v.reshape(Np * P, D).float()
    s_all = (qf @ pk.T).view(Hkv, G, Np * P) * scale
    s_pool = s_all.gather(2, rows[:, None, :].expand(Hkv, G, W * P)).masked_fill_(~ok[:, None], float("-inf"))
    lse = torch.logaddexp(torch.logsumexp(s_fix, dim=-1), torch.logsumexp(s_pool, dim=-1))  # [Hkv, G]
    m = lse.nan_to_num(neginf=0.0)[..., None]
    p_pool = torch.zeros(Hkv, G, Np * P, device=q.device).scatter_add_(2, rows[:, None, :].expand(Hkv, G, W * P),
                                                                       torch.exp(s_pool - m))
    out = torch.exp(s_fix - m) @ fixed_v[:, :n_fixed].float() + p_pool @ pv
    return _refuse(out.reshape(Hq, D), lse.reshape(Hq), nan_rows, q.dtype)


def _refuse(out: torch.Tensor, lse: torch.Tensor, nan_rows: torch.Tensor, dtype: torch.dtype):
    """NaN in the rows of the heads the guard refused; ``out`` cast to ``dtype``."""
    return (out.masked_fill(nan_rows[:, None], float("nan")).to(dtype),
            lse.masked_fill(nan_rows, float("nan")))


def _check(q, fixed_k, fixed_v, n_fixed, pool_k, pool_v, table, lengths):
    check_tensor("q", q, 2)
    check_tensor("fixed_k", fixed_k, 3)
    check_tensor("fixed_v", fixed_v, 3)
    check_tensor("pool_k", pool_k, 3)
    check_tensor("pool_v", pool_v, 3)
    check_tensor("table", table, 2, dtypes=_INDEX_DTYPES)
    check_tensor("lengths", lengths, 1, dtypes=_INDEX_DTYPES)
    if q.dtype not in CACHE_DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    for name, x in (("fixed_k", fixed_k), ("fixed_v", fixed_v), ("pool_k", pool_k), ("pool_v", pool_v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype} (cast one of them)")
    Hq, D = q.shape
    Hkv, F, _ = fixed_k.shape
    check_gqa(Hq, Hkv)
    if tuple(fixed_k.shape) != (Hkv, F, D) or tuple(fixed_v.shape) != (Hkv, F, D):
        raise ValueError(f"fixed_k and fixed_v must both be [Hkv, F, D] with D = q.shape[-1] = {D}, got "
                         f"{tuple(fixed_k.shape)} and {tuple(fixed_v.shape)}")
    check_int("n_fixed", n_fixed, minimum=0)
    if n_fixed > F:
        raise ValueError(f"n_fixed must be <= fixed_k.shape[1] = {F}, got {n_fixed}")
    Np, P, Dp = pool_k.shape
    if P < 1 or Dp != D or tuple(pool_v.shape) != (Np, P, D):
        raise ValueError(f"pool_k and pool_v must both be [pages, P >= 1, D] with D = {D}, got "
                         f"{tuple(pool_k.shape)} and {tuple(pool_v.shape)}")
    if table.shape[0] != Hkv or tuple(lengths.shape) != (Hkv,):
        raise ValueError(f"table must be [Hkv, W] and lengths [Hkv] with Hkv = {Hkv}, got {tuple(table.shape)} and "
                         f"{tuple(lengths.shape)}")


def _check_indices(table: torch.Tensor, lengths: torch.Tensor, Np: int, P: int) -> None:
    """The host check (``check=True``): ``0 <= lengths[h] <= W * P`` and the used entries
    ``table[h, :ceil(lengths[h] / P)]`` are pages of the pool."""
    W = table.shape[1]
    lens = lengths.detach().to("cpu", torch.int64)
    bad = ((lens < 0) | (lens > W * P)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"lengths must lie in [0, W * P] = [0, {W * P}] (W = table.shape[1] = {W}, P = {P}), got "
                         f"{lens[bad[:8]].tolist()} for heads {bad[:8].tolist()}")
    tab = table.detach().to("cpu", torch.int64)
    used = torch.arange(W) < ((lens + P - 1) // P)[:, None]
    wrong = (used & ((tab < 0) | (tab >= Np))).nonzero()
    if wrong.numel():
        h, c = wrong[0].tolist()
        raise ValueError(f"table[{h}, {c}] = {int(tab[h, c])} names a page outside the pool's {Np} pages "
                         f"(used table entries outside the pool: {wrong.shape[0]})")


def ragged_paged_decode(q: torch.Tensor, fixed_k: torch.Tensor, fixed_v: torch.Tensor, n_fixed: int,
                        pool_k: torch.Tensor, pool_v: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, *,
                        scale: float | None = None, num_splits: int | None = None, block_n: int | None = None,
                        check: bool | None = None, validate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per query head over what each KV head holds, ragged over heads and paged.

    Args:
        q: ``[Hq, D]`` float16/bfloat16/float32 (rotated), ``Hq`` a multiple of ``Hkv``; query head
            ``g`` belongs to KV head ``g // (Hq // Hkv)``.
        fixed_k, fixed_v: ``[Hkv, F, D]`` q's dtype; the first ``n_fixed`` slots of every head are keys.
        n_fixed: ``0 <= n_fixed <= F``.
        pool_k, pool_v: ``[pages, P, D]`` q's dtype: the shared page pool.  Pages no head refers to are
            never read on the Triton path; the PyTorch path multiplies their values by 0, so there they
            must be finite (a zero-initialised pool is).
        table: ``[Hkv, W]`` int32/int64 page table (any strides); entries ``table[h, :ceil(lengths[h] / P)]``
            must be pages of the pool, the rest are never read.
        lengths: ``[Hkv]`` int32/int64, ``0 <= lengths[h] <= W * P``: the long-range tokens of each head.
        scale: softmax scale, default ``D ** -0.5``.
        num_splits, block_n: Triton only: split-K programs per head (default: about two programs per SM
            over all heads, planned from the table's width) and keys per tile (a power of two >= 16).
        check: read ``table`` and ``lengths`` back to the host and raise ``ValueError`` where they break
            the rules above (a host synchronisation).  Default ``None``: on for CPU tensors in an eager
            call, off for CUDA tensors and under ``torch.compile``, so a decode step reads nothing back
            (``DMSCache`` passes ``False``: it makes the table and lengths itself).  Unchecked, every
            backend guards on the device: a head whose length lies outside ``[0, W * P]`` or whose used
            table entries name a page outside the pool reads nothing there and returns NaN (its query
            heads' ``out`` and ``lse``); no index ever leaves its tensor.
        validate: the old name of ``check`` (deprecated).

    Returns ``(out [Hq, D] in q's dtype, lse float32 [Hq])``, natural-log LSE (``-inf`` and zeros for a
    head with no key).  Not differentiable.
    """
    _check(q, fixed_k, fixed_v, n_fixed, pool_k, pool_v, table, lengths)
    scale = default_scale(scale, q.shape[-1])
    if validate is not None:
        warnings.warn("ragged_paged_decode(validate=...) is deprecated: use check=...", DeprecationWarning,
                      stacklevel=2)
        check = validate if check is None else check
    if host_check(check, q.device):
        _check_indices(table, lengths, pool_k.shape[0], pool_k.shape[1])
    if use_triton(q, fixed_k, fixed_v, pool_k, pool_v, table, lengths):
        check_split_options(num_splits, block_n)
        return _triton_paged(q, fixed_k, fixed_v, n_fixed, pool_k, pool_v, table, lengths, scale=scale,
                             num_splits=num_splits, block_n=block_n)
    return _torch_paged(q, fixed_k, fixed_v, n_fixed, pool_k, pool_v, table, lengths, scale=scale)
