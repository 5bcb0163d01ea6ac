"""``fixed_budget_decode``: the fused decode step over a fixed budget of ``B`` slots per (batch row, KV head).

A Triton split-K kernel pair (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; the shared
split-K plumbing is ``kvpop_kernels.splitk``) and a vectorised PyTorch path for CPU tensors.  Semantics:
``reference.fixed_budget_decode`` (slot layout, eviction rule, in-place updates) and docs/DESIGN.md
section 2; the two stages, why they are race-free, what is fused, precision and registers: docs/DESIGN.md
section 9.
"""
from __future__ import annotations

from typing import NamedTuple

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

__all__ = ["fixed_budget_decode", "slot_of"]


def slot_of(pos, *, sinks: int, window: int):
    """Slot of the token at ``pos`` while it is a sink or in the window: ``pos`` for a sink,
    ``s + (pos - s) % w`` in the ring otherwise (the layout of ``reference.fixed_budget_decode``).
    ``pos`` is a Python int or an integer tensor (elementwise, no host synchronisation)."""
    if isinstance(pos, torch.Tensor):
        return torch.where(pos < sinks, pos, sinks + (pos.clamp_min(sinks) - sinks) % window)
    return pos if pos < sinks else sinks + (pos - sinks) % window

_INT32_MAX = 2**31 - 1

# ------------------------------------------------------------------------------ Triton
if triton is not None:
    _INT32_MAX_C = tl.constexpr(_INT32_MAX)

    @triton.jit
    def _guarded_pos(POS, n64):
        """Row ``n``'s position read on the device, and whether it lies outside ``[0, 2**31 - 2]`` (the
        device-side guard: such a row computes with position 0, writes nothing and returns NaN)."""
        p = tl.load(POS + n64).to(tl.int64)
        bad = (p < 0) | (p >= _INT32_MAX_C)
        return tl.where(bad, 0, p).to(tl.int32), bad

    @triton.jit
    def _packed_head(META, h64, HKV, SINKS, WINDOW, T_ALL, K_ALL):
        """KV head ``h``'s place in the packed layout, read on the device from ``META [3, HKV]`` int64
        (budgets, slot offsets, long-range offsets): ``(off, koff, B_h, k_h, bad)``; a head whose slots or
        long-range slots do not lie inside the tensors is ``bad`` (the device-side guard: it computes with
        an empty layout at offset 0, writes nothing and returns NaN)."""
        bud = tl.load(META + h64)
        off = tl.load(META + HKV + h64)
        koff = tl.load(META + 2 * HKV + h64)
        kh = bud - SINKS - WINDOW
        bad = (kh < 0) | (off < 0) | (off + bud > T_ALL) | (koff < 0) | (koff + kh > K_ALL)
        # offsets stay int64 (they scale strides); B_h and k_h as int32, the uniform kernel's loop types
        return (tl.where(bad, 0, off), tl.where(bad, 0, koff), tl.where(bad, 0, bud).to(tl.int32),
                tl.where(bad, 0, kh).to(tl.int32), bad)

    @triton.jit
    def _row_head(POS, META, KC, VC, SP, PR, n64, h64, s_kc_n, s_kc_h, s_kc_b, s_vc_n, s_vc_h, s_vc_b,
                  s_sp_n, s_sp_h, s_sp_b, s_pr_n, s_pr_h, s_pr_j, HKV, B, K_LR, SINKS, WINDOW, T_ALL, K_ALL,
                  PACKED: tl.constexpr):
        """Row ``n``'s position (guarded), KV head ``h``'s budget ``B``, long-range slots ``K_LR`` and the
        bases of its keys, values, slot positions and priorities, in either layout: ``(pos, bad, B, K_LR,
        kc, vc, spp, prp)``; ``bad`` for a refused position or (packed) a head outside the tensors."""
        pos, bad = _guarded_pos(POS, n64)
        if PACKED:  # head h's slots start at slot off (its long-range priorities at koff); B, k per head
            off, koff, B, K_LR, head_bad = _packed_head(META, h64, HKV, SINKS, WINDOW, T_ALL, K_ALL)
            bad = bad | head_bad
        else:
            off = 0
            koff = 0
        return (pos, bad, B, K_LR, KC + n64 * s_kc_n + h64 * s_kc_h + off * s_kc_b,
                VC + n64 * s_vc_n + h64 * s_vc_h + off * s_vc_b, SP + n64 * s_sp_n + h64 * s_sp_h + off * s_sp_b,
                PR + n64 * s_pr_n + h64 * s_pr_h + koff * s_pr_j)

    @triton.jit
    def _decode_stage1(Q, KN, VN, KC, VC, SP, PR, LP, POS, MID_O, MID_L, DST, META,
                       s_kc_n, s_kc_h, s_kc_b, s_kc_d, s_vc_n, s_vc_h, s_vc_b, s_vc_d,
                       s_sp_n, s_sp_h, s_sp_b, s_pr_n, s_pr_h, s_pr_j,
                       HKV, B, D, K_LR, SINKS, WINDOW, CHUNK, NS, qk_scale, T_ALL, K_ALL,
                       G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                       PACKED: tl.constexpr):
        row = tl.program_id(0)  # (batch row, KV head) flattened: row = n * HKV + h
        split = tl.program_id(1)
        n64 = (row // HKV).to(tl.int64)
        h64 = (row % HKV).to(tl.int64)
        # this row's position, read on the device (no host value): the new token's slot and the
        # token leaving the window follow from it
        pos, pos_bad, B, K_LR, kc, vc, spp, prp = _row_head(
            POS, META, KC, VC, SP, PR, n64, h64, s_kc_n, s_kc_h, s_kc_b, s_vc_n, s_vc_h, s_vc_b, s_sp_n, s_sp_h,
            s_sp_b, s_pr_n, s_pr_h, s_pr_j, HKV, B, K_LR, SINKS, WINDOW, T_ALL, K_ALL, PACKED)
        t_new = pos - WINDOW
        slot_new = tl.where(pos < SINKS, pos, SINKS + (tl.maximum(pos, SINKS) - SINKS) % WINDOW)
        LR0 = SINKS + WINDOW
        g = tl.arange(0, G_PAD)
        g_ok = g < G
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        qh = row.to(tl.int64) * G + g  # query heads of this KV head (HF repeat_kv order), batch-flat
        q = tl.load(Q + qh[:, None] * D + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        qf = q.to(tl.float32)
        if UPCAST:
            q = qf

        # -- 1. eviction decision: lowest-ranked long-range slot (same result in every program whose chunk
        #    holds slots of this head; a program past the head's B slots writes an empty partial only)
        start = split * CHUNK
        k_scan = tl.where(start < B, K_LR, 0)
        best_p = float("inf")
        best_t = _INT32_MAX_C
        best_j = -1
        for j0 in range(0, k_scan, BLOCK_K):  # (names unique to this loop: no accidental loop carries)
            jj = j0 + tl.arange(0, BLOCK_K)
            jj_ok = jj < K_LR
            pr_blk = tl.load(prp + jj * s_pr_j, mask=jj_ok, other=float("inf"))
            bmin = tl.min(pr_blk, axis=0)
            cand = jj_ok & (pr_blk == bmin)
            t_blk = tl.load(spp + (LR0 + jj) * s_sp_b, mask=cand, other=_INT32_MAX_C)
            tmin = tl.min(t_blk, axis=0)
            jmin = tl.min(tl.where(cand & (t_blk == tmin), jj, _INT32_MAX_C), axis=0)
            better = (bmin < best_p) | ((bmin == best_p) & (tmin < best_t))
            best_p = tl.where(better, bmin, best_p)
            best_t = tl.where(better, tmin, best_t)
            best_j = tl.where(better, jmin, best_j)
        lp = tl.load(LP + row)
        lp = tl.where(lp != lp, float("-inf"), lp)  # NaN ranks as -inf
        keep = (t_new >= SINKS) & (best_j >= 0) & ((lp > best_p) | ((lp == best_p) & (t_new > best_t)))
        keep = keep & (pos_bad == 0)
        dst = tl.where(keep, LR0 + best_j, -1)
        tl.store(DST + row, dst, mask=split == 0)

        # -- 3. the keys not in the cache yet (split 0 only): the new token and the kept leaving one
        first = split == 0
        kn = tl.load(KN + row.to(tl.int64) * D + d, mask=d_ok, other=0.0).to(tl.float32)
        vn = tl.load(VN + row.to(tl.int64) * D + d, mask=d_ok, other=0.0).to(tl.float32)
        # (a block bound instead of `d_ok & scalar`: the interpreter broadcasts int1 scalars to int32)
        lv_ok = d < tl.where(keep & first, D, 0)
        kl = tl.load(kc + slot_new * s_kc_b + d * s_kc_d, mask=lv_ok, other=0.0).to(tl.float32)
        vl = tl.load(vc + slot_new * s_vc_b + d * s_vc_d, mask=lv_ok, other=0.0).to(tl.float32)
        s_new = tl.sum(qf * kn[None, :], axis=1) * qk_scale
        s_lv = tl.sum(qf * kl[None, :], axis=1) * qk_scale
        s_new = tl.where(first, s_new, float("-inf"))
        s_lv = tl.where(first & keep, s_lv, float("-inf"))
        m_i = tl.maximum(s_new, s_lv)
        m0 = tl.where(m_i == float("-inf"), 0.0, m_i)
        p_new = tl.exp2(s_new - m0)
        p_lv = tl.exp2(s_lv - m0)
        l_i = p_new + p_lv
        acc = p_new[:, None] * vn[None, :] + p_lv[:, None] * vl[None, :]

        # -- 2. this split's chunk of slots (base-2 online softmax, fp32 accumulation)
        end = tl.minimum(start + CHUNK, B)
        for n0 in range(start, end, BLOCK_N):
            nn = n0 + tl.arange(0, BLOCK_N)
            n_ok = (nn < end) & (nn != slot_new) & (nn != dst)
            sp = tl.load(spp + nn * s_sp_b, mask=n_ok, other=-1)
            valid = n_ok & (sp >= 0)
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(kc + nn[:, None].to(tl.int64) * s_kc_b + d[None, :] * s_kc_d, mask=kv_mask, other=0.0)
            v = tl.load(vc + nn[:, None].to(tl.int64) * s_vc_b + d[None, :] * s_vc_d, mask=kv_mask, other=0.0)
            m_i, l_i, acc = online_softmax_tile(q, k, v, valid, qk_scale, m_i, l_i, acc, UPCAST)

        # -- 4. partial output and natural-log LSE of this split (-inf / 0 for an empty chunk; NaN for a
        #    row whose position the guard refused)
        store_split(MID_O, MID_L, qh * NS + split, m_i, l_i, acc, pos_bad, g_ok, d, d_ok, D)

    @triton.jit
    def _decode_stage2(MID_O, MID_L, OUT, LSE, DST, LP, KN, VN, KC, VC, SP, PR, POS, META,
                       s_kc_n, s_kc_h, s_kc_b, s_kc_d, s_vc_n, s_vc_h, s_vc_b, s_vc_d,
                       s_sp_n, s_sp_h, s_sp_b, s_pr_n, s_pr_h, s_pr_j,
                       HKV, D, NS, SINKS, WINDOW, T_ALL, K_ALL,
                       G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PACKED: tl.constexpr):
        qh = tl.program_id(0)  # one program per query head of every batch row (batch-flat)
        row = qh // G  # its (batch row, KV head), flattened
        n64 = (row // HKV).to(tl.int64)
        h64 = (row % HKV).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D

        # -- LSE merge of the splits (natural log)
        o, lse = merge_splits(MID_O, MID_L, qh.to(tl.int64) * NS, NS, D, d, d_ok, BLOCK_S, BLOCK_D)
        tl.store(OUT + qh.to(tl.int64) * D + d, o.to(OUT.dtype.element_ty), mask=d_ok)
        tl.store(LSE + qh, lse)

        # -- the cache update of KV head h, by its first query head's program only: no other
        #    program of this launch touches these slots, and stage 1 (which read them) is done
        if qh % G == 0:
            pos, pos_bad, _b, _k, kc, vc, spp, prp = _row_head(
                POS, META, KC, VC, SP, PR, n64, h64, s_kc_n, s_kc_h, s_kc_b, s_vc_n, s_vc_h, s_vc_b, s_sp_n,
                s_sp_h, s_sp_b, s_pr_n, s_pr_h, s_pr_j, HKV, 0, 0, SINKS, WINDOW, T_ALL, K_ALL, PACKED)
            t_new = pos - WINDOW
            slot_new = tl.where(pos < SINKS, pos, SINKS + (tl.maximum(pos, SINKS) - SINKS) % WINDOW)
            LR0 = SINKS + WINDOW
            dst = tl.load(DST + row)
            kept = dst >= 0
            dst_c = tl.where(kept, dst, 0).to(tl.int64)
            kd_ok = d < tl.where(kept, D, 0)  # d_ok & kept (the interpreter broadcasts int1 scalars badly)
            ring_k = tl.load(kc + slot_new * s_kc_b + d * s_kc_d, mask=kd_ok)
            ring_v = tl.load(vc + slot_new * s_vc_b + d * s_vc_d, mask=kd_ok)
            tl.debug_barrier()  # every thread has read ring slot r before anyone overwrites it
            tl.store(kc + dst_c * s_kc_b + d * s_kc_d, ring_k, mask=kd_ok)
            tl.store(vc + dst_c * s_vc_b + d * s_vc_d, ring_v, mask=kd_ok)
            lp = tl.load(LP + row)
            lp = tl.where(lp != lp, float("-inf"), lp)
            tl.store(spp + dst_c * s_sp_b, t_new, mask=kept)
            tl.store(prp + (dst_c - LR0) * s_pr_j, lp, mask=kept)
            nd_ok = d < tl.where(pos_bad, 0, D)  # a refused position writes nothing
            kn = tl.load(KN + row.to(tl.int64) * D + d, mask=nd_ok)
            vn = tl.load(VN + row.to(tl.int64) * D + d, mask=nd_ok)
            tl.store(kc + slot_new * s_kc_b + d * s_kc_d, kn, mask=nd_ok)
            tl.store(vc + slot_new * s_vc_b + d * s_vc_d, vn, mask=nd_ok)
            tl.store(spp + slot_new * s_sp_b, pos, mask=pos_bad == 0)


def _triton_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, *, sinks,
                   window, scale, num_splits, block_n, packed=None):
    """Batched form: ``q [N, Hq, D]``, caches ``[N, Hkv, B, D]``, ``pos [N]`` int on q's device.

    ``packed = (meta, max_budget)``: the packed layout (caches ``[N, T, D]``, ``slot_pos [N, T]``,
    ``slot_prio [N, K]``), ``meta [3, Hkv]`` int64 on the device (budgets, slot offsets, long-range
    offsets) and a host bound on the largest budget, over which the splits are cut."""
    N, Hq, D = q.shape
    Hkv = k_new.shape[1]
    G = Hq // Hkv
    s, w = sinks, window
    dev = q.device
    if packed is None:
        B = k_cache.shape[2]
        K = B - s - w
        n_keys, t_all, k_all = B, 0, 0
        meta = pos  # a dummy pointer (never read: PACKED is off)
        strides = (*k_cache.stride(), *v_cache.stride(), *slot_pos.stride())
    else:
        meta, n_keys = packed
        t_all, k_all = k_cache.shape[1], slot_prio.shape[1]
        B, K = n_keys, k_all  # (unused by the kernels' packed path but for the dummy below)
        st_k, st_v, st_p = k_cache.stride(), v_cache.stride(), slot_pos.stride()
        strides = (st_k[0], 0, st_k[1], st_k[2], st_v[0], 0, st_v[1], st_v[2], st_p[0], 0, st_p[1])
    upcast = upcast_operands(k_cache.dtype)
    if block_n is None:  # 32 on the GPU (no register spills at D <= 128, as SGLang's grouped decode)
        block_n = 32 if dev.type == "cuda" else 64
    # fp32 operands (ieee dot) and wide heads need 8 warps to stay clear of register spills (sm_90)
    num_warps = 4 if (not upcast or dev.type != "cuda") and D <= 128 else 8
    block_d = max(16, triton.next_power_of_2(D))
    g_pad = max(16, triton.next_power_of_2(G))
    block_k = 1024 if dev.type == "cuda" else 256
    rows = N * Hkv  # one (batch row, KV head) per program of stage 1 (times its splits)
    if packed is None or num_splits is not None:
        ns, chunk = plan_splits(n_keys, rows, block_n, num_splits, dev)
    else:  # chunks sized as for the mean budget (the work of all heads fills the GPU about twice),
        # as many of them as the largest head needs: the smaller heads' trailing programs write empty partials
        _, chunk = plan_splits(-(-t_all // Hkv), rows, block_n, None, dev)
        ns = -(-max(n_keys, 1) // chunk)

    q_c = q.contiguous()
    kn = k_new.contiguous()
    vn = v_new.contiguous()
    lp = leaving_prio.contiguous()
    pos_c = pos.contiguous()
    # a zero-size tensor has no usable pointer: hand a dummy when k == 0 (never read: K_LR = 0)
    if K > 0:
        pr = slot_prio
    else:
        pr = torch.full((N, Hkv, 1) if packed is None else (N, 1), float("-inf"), dtype=torch.float32, device=dev)
    pr_strides = pr.stride() if packed is None else (pr.stride(0), 0, pr.stride(1))

    mid_o = empty((N * Hq, ns, D), dtype=torch.float32, device=dev)
    mid_l = empty((N * Hq, ns), dtype=torch.float32, device=dev)
    dst = empty((rows,), dtype=torch.int32, device=dev)
    out = empty((N, Hq, D), dtype=q.dtype, device=dev)
    lse = empty((N, Hq), dtype=torch.float32, device=dev)
    strides = (*strides, *pr_strides)

    _decode_stage1[(rows, ns)](
        q_c, kn, vn, k_cache, v_cache, slot_pos, pr, lp, pos_c, mid_o, mid_l, dst, meta, *strides,
        Hkv, B, D, K, s, w, chunk, ns, scale * LOG2E, t_all, k_all,
        G=G, G_PAD=g_pad, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
        PACKED=packed is not None, num_warps=num_warps, num_stages=2,
    )
    _decode_stage2[(N * Hq,)](
        mid_o, mid_l, out, lse, dst, lp, kn, vn, k_cache, v_cache, slot_pos, pr, pos_c, meta, *strides,
        Hkv, D, ns, s, w, t_all, k_all,
        G=G, BLOCK_S=min(32, triton.next_power_of_2(ns)), BLOCK_D=block_d, PACKED=packed is not None,
        num_warps=4,
    )
    return out, lse


# ------------------------------------------------------------------------- PyTorch CPU
@torch.no_grad()
def _torch_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, *, sinks,
                  window, scale):
    """The same step in plain PyTorch, vectorised over batch rows and heads (used for CPU tensors).

    No data-dependent Python branch: every row and head runs the same ops (kept or not is a
    ``torch.where``), so the step traces into one graph (``torch.compile(fullgraph=True)``)."""
    N, Hq, D = q.shape
    _, Hkv, B, _ = k_cache.shape
    G = Hq // Hkv
    s, w = sinks, window
    K = B - s - w
    dev = q.device
    pos = pos.to(torch.int64)
    # the device-side guard (no host read): a row whose position lies outside [0, 2**31 - 2] computes
    # with position 0, writes nothing and returns NaN, as the Triton kernels do
    bad = (pos < 0) | (pos > _INT32_MAX - 1)  # [N]
    pos = pos.masked_fill(bad, 0)
    t_new = pos - w  # [N]
    slot_new = slot_of(pos, sinks=s, window=w)  # [N]
    ni = torch.arange(N, device=dev)[:, None]
    hi = torch.arange(Hkv, device=dev)[None, :]
    sn = slot_new[:, None].expand(N, Hkv)
    ok = ~bad[:, None]  # [N, 1]
    if K > 0:
        low_p = slot_prio.amin(dim=-1)  # lowest priority ...
        # ... then the oldest position; ``min`` returns the first index among equal values, which
        # matters only for empty slots (all at -1): the lowest slot index, as in the reference
        older = slot_pos[..., s + w:].masked_fill(slot_prio != low_p[..., None], _INT32_MAX)
        low_t, j = older.min(dim=-1)  # [N, Hkv]
        lp = leaving_prio.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        tn = t_new[:, None]
        keep = (tn >= s) & ((lp > low_p) | ((lp == low_p) & (low_t < tn))) & ok
        dst = s + w + j
        k_cache[ni, hi, dst] = torch.where(keep[..., None], k_cache[ni, hi, sn], k_cache[ni, hi, dst])
        v_cache[ni, hi, dst] = torch.where(keep[..., None], v_cache[ni, hi, sn], v_cache[ni, hi, dst])
        slot_pos[ni, hi, dst] = torch.where(keep, tn.to(torch.int32), slot_pos[ni, hi, dst])
        slot_prio[ni, hi, j] = torch.where(keep, lp, slot_prio[ni, hi, j])
    k_cache[ni, hi, sn] = torch.where(ok[..., None], k_new, k_cache[ni, hi, sn])
    v_cache[ni, hi, sn] = torch.where(ok[..., None], v_new, v_cache[ni, hi, sn])
    slot_pos[ni, hi, sn] = torch.where(ok, pos[:, None].to(torch.int32), slot_pos[ni, hi, sn])

    kc = k_cache.float()  # no copy for float32 caches
    vc = v_cache.float()
    valid = slot_pos >= 0  # empty slots: whatever they hold is ignored
    scores = torch.matmul(q.float().view(N, Hkv, G, D), kc.transpose(-1, -2))  # [N, Hkv, G, B], unscaled
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    vc = vc.masked_fill(~valid[..., None], 0.0)
    m = scores.amax(dim=-1, keepdim=True)  # finite: the new token is always visible
    probs = scores.sub_(m).mul_(scale).exp_()  # scale > 0, so max(scale * x) = scale * max(x)
    l = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, vc).div_(l)
    lse = m.mul_(scale).add_(l.log_()).squeeze(-1)  # [N, Hkv, G]
    out = out.masked_fill_(bad[:, None, None, None], float("nan"))
    lse = lse.masked_fill_(bad[:, None, None], float("nan"))
    return out.reshape(N, Hq, D).to(q.dtype), lse.reshape(N, Hq)


def _cat(xs: list[torch.Tensor], dim: int) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=dim)


@torch.no_grad()
def _torch_decode_packed(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, *,
                         lay: _Layout, sinks, window, scale):
    """The packed layout's step in PyTorch (CPU tensors): ``k_cache [N, T, D]``, ``slot_pos [N, T]``,
    ``slot_prio [N, K]``.  Vectorised over rows, heads and slots: the decision on a padded gather of the
    long-range slots ``[N, Hl, kmax]`` (every head at once), the cache writes once for all heads; the
    attention runs the uniform step's ops on each run of consecutive heads of equal budget (a uniform
    block, a view): one run for equal budgets, a static loop over the runs otherwise.  No
    data-dependent branch."""
    N, Hq, D = q.shape
    Hkv = k_new.shape[1]
    G = Hq // Hkv
    s, w = sinks, window
    dev = q.device
    pos = pos.to(torch.int64)
    bad = (pos < 0) | (pos > _INT32_MAX - 1)  # [N]: the device-side guard, as in the uniform step
    pos = pos.masked_fill(bad, 0)
    t_new = pos - w
    sn = lay.off[None, :] + slot_of(pos, sinks=s, window=w)[:, None]  # [N, Hkv] the new token's slot
    ni = torch.arange(N, device=dev)[:, None]
    ok = ~bad[:, None]
    if lay.n_lr_heads:  # the heads with long-range slots (a k_h = 0 head drops every leaving token)
        hl = lay.lr_heads
        pr = slot_prio[:, lay.pad_lr].masked_fill_(lay.pad, float("inf"))  # [N, Hl, kmax]
        low_p = pr.amin(dim=-1)
        # ties to the oldest position, then the lowest index (padding never wins: real positions < INT32_MAX)
        older = slot_pos[:, lay.pad_slot].masked_fill_((pr != low_p[..., None]) | lay.pad, _INT32_MAX)
        low_t, jl = older.min(dim=-1)  # [N, Hl]
        lp = leaving_prio if hl is None else leaving_prio[:, hl]
        lp = lp.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        tn = t_new[:, None]
        keep = (tn >= s) & ((lp > low_p) | ((lp == low_p) & (low_t < tn))) & ok
        j, dst = lay.koff_lr + jl, lay.lr0 + jl
        snl = sn if hl is None else sn[:, hl]
        k_cache[ni, dst] = torch.where(keep[..., None], k_cache[ni, snl], k_cache[ni, dst])
        v_cache[ni, dst] = torch.where(keep[..., None], v_cache[ni, snl], v_cache[ni, dst])
        slot_pos[ni, dst] = torch.where(keep, tn.to(torch.int32), slot_pos[ni, dst])
        slot_prio[ni, j] = torch.where(keep, lp, slot_prio[ni, j])
    k_cache[ni, sn] = torch.where(ok[..., None], k_new, k_cache[ni, sn])
    v_cache[ni, sn] = torch.where(ok[..., None], v_new, v_cache[ni, sn])
    slot_pos[ni, sn] = torch.where(ok, pos[:, None].to(torch.int32), slot_pos[ni, sn])

    qg = q.float().view(N, Hkv, G, D)
    outs, lses = [], []
    for run in lay.runs:  # the uniform step's attention on each run's block
        r, span = run.h1 - run.h0, slice(run.off, run.off + (run.h1 - run.h0) * run.b)
        kc = k_cache[:, span].unflatten(1, (r, run.b)).float()  # [N, r, b, D] (no copy for float32)
        vc = v_cache[:, span].unflatten(1, (r, run.b)).float()
        valid = slot_pos[:, span].unflatten(1, (r, run.b)) >= 0  # empty slots: whatever they hold is ignored
        scores = torch.matmul(qg[:, run.h0:run.h1], kc.transpose(-1, -2))  # [N, r, G, b], unscaled
        scores = scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
        vc = vc.masked_fill(~valid[..., None], 0.0)
        m = scores.amax(dim=-1, keepdim=True)  # finite: the new token is always visible
        probs = scores.sub_(m).mul_(scale).exp_()
        l = probs.sum(dim=-1, keepdim=True)
        outs.append(torch.matmul(probs, vc).div_(l))
        lses.append(m.mul_(scale).add_(l.log_()).squeeze(-1))  # [N, r, G]
    out, lse = _cat(outs, 1), _cat(lses, 1)
    out = out.masked_fill_(bad[:, None, None, None], float("nan"))
    lse = lse.masked_fill_(bad[:, None, None], float("nan"))
    return out.reshape(N, Hq, D).to(q.dtype), lse.reshape(N, Hq)


# ------------------------------------------------------------------------------ public
def _check(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks, window):
    """Validate either form (batch-1 ``q [Hq, D]`` or batched ``q [N, Hq, D]``); no value is read
    from a device tensor (``pos`` as a tensor is checked for shape and dtype only)."""
    batched = isinstance(q, torch.Tensor) and q.dim() == 3
    lead = "N, " if batched else ""
    e = 1 if batched else 0
    check_tensor("q", q, 2 + e)
    check_tensor("k_new", k_new, 2 + e)
    check_tensor("v_new", v_new, 2 + e)
    check_tensor("k_cache", k_cache, 3 + e)
    check_tensor("v_cache", v_cache, 3 + e)
    check_tensor("slot_pos", slot_pos, 2 + e, dtypes=(torch.int32,))
    check_tensor("slot_prio", slot_prio, 2 + e, dtypes=(torch.float32,))
    check_tensor("leaving_prio", leaving_prio, 1 + e, dtypes=(torch.float32,))
    _check_common(q, k_new, v_new, k_cache, v_cache, pos, sinks, window, e)
    s, w = sinks, window
    D = q.shape[-1]
    Hkv, B, Dk = k_cache.shape[e:]
    if tuple(v_cache.shape) != (*q.shape[:e], Hkv, B, D) or Dk != D or k_cache.shape[:e] != q.shape[:e]:
        raise ValueError(f"k_cache and v_cache must both be [{lead}Hkv, B, D] with D = q.shape[-1] = {D}, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _check_new(q, k_new, v_new, Hkv, e)
    if B < s + w:
        raise ValueError(f"the budget B = k_cache.shape[-2] = {B} must be >= sinks + window = {s} + {w} = {s + w}")
    if tuple(slot_pos.shape) != (*q.shape[:e], Hkv, B):
        raise ValueError(f"slot_pos must be [{lead}Hkv, B] = {[*q.shape[:e], Hkv, B]}, got {tuple(slot_pos.shape)}")
    if tuple(slot_prio.shape) != (*q.shape[:e], Hkv, B - s - w):
        raise ValueError(f"slot_prio must be [{lead}Hkv, k] = {[*q.shape[:e], Hkv, B - s - w]} "
                         f"(k = B - sinks - window), got {tuple(slot_prio.shape)}")
    if tuple(leaving_prio.shape) != (*q.shape[:e], Hkv):
        raise ValueError(f"leaving_prio must be [{lead}Hkv] = {[*q.shape[:e], Hkv]}, got {tuple(leaving_prio.shape)}")
    _check_state(k_cache, v_cache, slot_pos, slot_prio)


def _check_state(k_cache, v_cache, slot_pos, slot_prio) -> None:
    """The tensors updated in place: no grad, no element shared with another or with itself."""
    state = (("k_cache", k_cache), ("v_cache", v_cache), ("slot_pos", slot_pos), ("slot_prio", slot_prio))
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


def _check_common(q, k_new, v_new, k_cache, v_cache, pos, sinks, window, e):
    """Dtypes of the step's inputs and the position argument (both layouts; ranks checked before)."""
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
    for name, x in (("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype} (cast one of them)")


def _check_new(q, k_new, v_new, Hkv, e, note=""):
    """GQA and the new token's shapes ``[N?, Hkv, D]`` (both layouts)."""
    lead, D = ("N, " if e else ""), q.shape[-1]
    check_gqa(q.shape[e], Hkv)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if tuple(x.shape) != (*q.shape[:e], Hkv, D):
            raise ValueError(f"{name} must be [{lead}Hkv, D] = {[*q.shape[:e], Hkv, D]}{note}, got {tuple(x.shape)}")


def _check_packed(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks, window,
                  head_budgets) -> int:
    """Validate the packed layout's shapes (no value read from a device tensor); returns ``Hkv``."""
    batched = isinstance(q, torch.Tensor) and q.dim() == 3
    lead = "N, " if batched else ""
    e = 1 if batched else 0
    check_tensor("q", q, 2 + e)
    check_tensor("k_new", k_new, 2 + e)
    check_tensor("v_new", v_new, 2 + e)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(x, torch.Tensor) and x.dim() != 2 + e:
            raise ValueError(f"with head_budgets {name} is the packed [{lead}T, D] (T = sum of the budgets), got "
                             f"shape {tuple(x.shape)}")
        check_tensor(name, x, 2 + e)
    check_tensor("slot_pos", slot_pos, 1 + e, dtypes=(torch.int32,))
    check_tensor("slot_prio", slot_prio, 1 + e, dtypes=(torch.float32,))
    check_tensor("leaving_prio", leaving_prio, 1 + e, dtypes=(torch.float32,))
    _check_common(q, k_new, v_new, k_cache, v_cache, pos, sinks, window, e)
    s, w = sinks, window
    if isinstance(head_budgets, torch.Tensor):
        if head_budgets.dim() != 1 or head_budgets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"head_budgets as a tensor must be 1-D int32/int64 (one budget per KV head), got "
                             f"{head_budgets.dtype} {tuple(head_budgets.shape)}")
        if head_budgets.device != q.device:
            raise ValueError(f"head_budgets must be on q's device {q.device}, got {head_budgets.device}")
        Hkv = head_budgets.shape[0]
    elif isinstance(head_budgets, (tuple, list)):
        for h, b in enumerate(head_budgets):
            if isinstance(b, bool) or not isinstance(b, int):
                raise TypeError(f"head_budgets[{h}] must be an int, got {type(b).__name__} ({b!r})")
        Hkv = len(head_budgets)
    else:
        raise TypeError(f"head_budgets must be None, a tuple of ints or a 1-D int tensor (one budget per KV head), "
                        f"got {type(head_budgets).__name__}")
    if Hkv < 1:
        raise ValueError("head_budgets must hold one budget per KV head, got none")
    D = q.shape[-1]
    _check_new(q, k_new, v_new, Hkv, e, " (Hkv = len(head_budgets))")
    T = k_cache.shape[e]
    if tuple(k_cache.shape) != (*q.shape[:e], T, D) or tuple(v_cache.shape) != (*q.shape[:e], T, D):
        raise ValueError(f"k_cache and v_cache must both be [{lead}T, D] with D = q.shape[-1] = {D}, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if isinstance(head_budgets, (tuple, list)):  # a tensor's values are checked once read back
        _check_budget_values(tuple(head_budgets), T, s, w)
    if T < Hkv * (s + w):
        raise ValueError(f"k_cache holds T = {T} slots, fewer than Hkv x (sinks + window) = {Hkv} x {s + w}")
    K = T - Hkv * (s + w)
    if tuple(slot_pos.shape) != (*q.shape[:e], T):
        raise ValueError(f"slot_pos must be [{lead}T] = {[*q.shape[:e], T]}, got {tuple(slot_pos.shape)}")
    if tuple(slot_prio.shape) != (*q.shape[:e], K):
        raise ValueError(f"slot_prio must be [{lead}K] = {[*q.shape[:e], K]} (K = sum of k_h = T - Hkv x (sinks + "
                         f"window)), got {tuple(slot_prio.shape)}")
    if tuple(leaving_prio.shape) != (*q.shape[:e], Hkv):
        raise ValueError(f"leaving_prio must be [{lead}Hkv] = {[*q.shape[:e], Hkv]}, got {tuple(leaving_prio.shape)}")
    _check_state(k_cache, v_cache, slot_pos, slot_prio)
    return Hkv


def _check_budget_values(budgets: tuple[int, ...], T: int, sinks: int, window: int) -> None:
    """The host check of a ``head_budgets`` tensor (its values read back)."""
    bad = [h for h, b in enumerate(budgets) if b < sinks + window]
    if bad:
        raise ValueError(f"head_budgets[{bad[0]}] = {budgets[bad[0]]} must be >= sinks + window = "
                         f"{sinks + window} (k_h >= 0)")
    if sum(budgets) != T:
        raise ValueError(f"k_cache holds T = {T} slots but head_budgets sum to {sum(budgets)}: the packed "
                         f"layout holds every head's budget back to back (T = sum of the budgets)")


class _Run(NamedTuple):
    """Consecutive heads ``[h0, h1)`` of one budget ``b``: in the packed layout their slots
    ``[off, off + (h1 - h0) b)`` are a uniform ``[h1 - h0, b]`` block (a view)."""

    h0: int
    h1: int
    off: int
    b: int


class _Layout(NamedTuple):
    """What the launchers need of one packed layout (host-known budgets), built once per budgets and device."""

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


_LAYOUTS: dict[tuple, _Layout] = {}


def _layout(budgets: tuple[int, ...], sinks: int, window: int, device: torch.device) -> _Layout:
    key = (budgets, sinks, window, str(device))
    lay = _LAYOUTS.get(key)
    if lay is None:
        if len(_LAYOUTS) > 64:
            _LAYOUTS.clear()
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
        lay = _Layout(budgets, t([list(budgets), offs[:-1], koffs[:-1]]), t(offs[:-1]), tuple(runs),
                      None if hl == len(budgets) else t(heads), hl,
                      t([[koffs[h] + min(j, ks[h] - 1) for j in range(kmax)] for h in heads]).view(hl, kmax),
                      t([[offs[h] + sw + min(j, ks[h] - 1) for j in range(kmax)] for h in heads]).view(hl, kmax),
                      t([[j >= ks[h] for j in range(kmax)] for h in heads], torch.bool).view(hl, kmax),
                      t([koffs[h] for h in heads]), t([offs[h] + sw for h in heads]))
        _LAYOUTS[key] = lay
    return lay


def _check_positions(pos: torch.Tensor) -> None:
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


def _batch_form(batched, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos):
    """The step's tensors with a leading batch dimension, and ``pos`` as an int64 ``[N]`` tensor."""
    if not batched:
        q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio = (
            x.unsqueeze(0) for x in (q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio))
    if not isinstance(pos, torch.Tensor):
        pos = torch.full((q.shape[0],), pos, dtype=torch.int64, device=q.device)
    return q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos


def fixed_budget_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_pos: torch.Tensor,
                        slot_prio: torch.Tensor, leaving_prio: torch.Tensor, *, pos: int | torch.Tensor,
                        sinks: int, window: int, scale: float | None = None,
                        num_splits: int | None = None, block_n: int | None = None,
                        check: bool | None = None,
                        head_budgets: torch.Tensor | tuple[int, ...] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step over a fixed budget of ``B = s + w + k`` slots per (batch row, KV head), in place.

    Two forms: batch-1 (shapes below without the leading ``N``) or batched (every tensor with a
    leading batch dimension ``N``; rows are independent and may sit at different positions).

    Slot layout of each KV head (``B = k_cache.shape[-2]``, ``k = B - s - w >= 0``):

    * ``[0, s)`` sinks: token ``t < s`` in slot ``t``;
    * ``[s, s+w)`` the window ring: token ``t >= s`` in slot ``s + (t - s) % w``;
    * ``[s+w, B)`` the ``k`` long-range slots.

    Args:
        q: ``[N, Hq, D]`` the new token's queries (rotated), float16/bfloat16/float32.
        k_new, v_new: ``[N, Hkv, D]`` the new token's key (rotated) and value, q's dtype.
        k_cache, v_cache: ``[N, Hkv, B, D]`` q's dtype, any strides; updated in place.
        slot_pos: ``[N, Hkv, B]`` int32, each slot's token position, ``-1`` when empty; updated in place.
        slot_prio: ``[N, Hkv, k]`` float32, static priority of each long-range slot's token, ``-inf``
            when empty (never NaN); updated in place.
        leaving_prio: ``[N, Hkv]`` float32, the priority ``p = r - t log(gamma)`` of the token
            ``t_new = pos - w`` that leaves the window at this step (ignored when ``pos - w < s``);
            NaN ranks as ``-inf``.
        pos: the position of the new token = the number of tokens its row has seen before it (``0``
            for the first token): a Python int (every row at the same position), or an int32/int64
            tensor ``[N]`` on q's device, read by the kernels on the device (no host
            synchronisation, so a step can be captured in a CUDA graph or traced by
            ``torch.compile``).  Positions must lie in ``[0, 2**31 - 2]`` (see ``check``).  The caller
            keeps it.
        sinks, window: ``s >= 0``, ``w >= 1`` with ``s + w <= B``.
        scale: softmax scale, default ``D ** -0.5``.
        num_splits: Triton only: number of split-K programs per (row, KV head) (default: about two
            programs per SM on CUDA over all rows).  block_n: Triton only: slots per tile, a power
            of two >= 16 (default 32 on CUDA, 64 in the interpreter).
        check: read a ``pos`` tensor back to the host and raise ``ValueError`` for a position outside
            ``[0, 2**31 - 2]`` (a host synchronisation).  Default ``None``: on for CPU tensors in an eager
            call, off for CUDA tensors and under ``torch.compile``, so the decode hot path reads nothing
            back (``KVpopCache`` passes ``False``: it makes the positions itself).  Unchecked, every
            backend guards on the device: a row at such a position writes nothing to the cache and
            returns NaN (``out`` and ``lse``); no index ever leaves its tensor.

    The step, per row and KV head (docs/DESIGN.md: "the token leaving the window replaces the
    long-range slot of lowest priority if it ranks above it, else it is dropped"):

    1. if ``t_new = pos - w >= s`` and ``k > 0``: find the lowest-ranked long-range slot (lowest
       priority, ties to the oldest position, then to the lowest slot index; an empty slot has
       ``(-inf, -1)`` and so ranks below every token); if ``t_new`` ranks above it (higher
       priority, or an equal one: ``t_new`` is newer), ``t_new``'s key/value (still in its ring
       slot) replace that slot's and ``slot_pos``/``slot_prio`` follow; else ``t_new`` is dropped;
    2. ``k_new, v_new, pos`` go into the new token's slot (sink slot ``pos``, or the ring slot
       that ``t_new`` just left);
    3. every query head of the group attends over the slots with ``slot_pos >= 0`` (the new token
       included; whatever an empty slot holds is ignored).

    Head-adaptive budgets (``head_budgets``, docs/DESIGN.md section 9, "packed layout"): ``None`` is the
    uniform layout above.  Else one budget ``B_h = s + w + k_h`` (``k_h >= 0``) per KV head, a tuple of
    ints or a 1-D int32/int64 tensor ``[Hkv]`` on q's device, and the state is packed: ``k_cache,
    v_cache [N, T, D]`` with ``T = sum B_h``, head ``h`` in the slots ``[off_h, off_h + B_h)`` (``off_h``
    the prefix sum of the budgets; inside a head the layout above), ``slot_pos [N, T]``, ``slot_prio
    [N, K]`` with ``K = sum k_h = T - Hkv (s + w)`` (head ``h`` at the prefix sum of the ``k``).  Each head
    runs the step above on its own slots; a head with ``k_h = 0`` drops every leaving token.  A tuple is
    checked on the host (and turned into index tensors once per budgets and device); a tensor is read
    back under the same rule as ``pos`` (``check``): unchecked, a head whose slots do not lie inside the
    tensors writes nothing and returns NaN.  (The PyTorch path always reads a CPU tensor's budgets.)  On
    Triton the splits are cut over the largest budget (over ``T - (Hkv - 1)(s + w)`` for an unchecked
    tensor, whose largest value the host does not know) in chunks sized, by default, as for the mean
    budget: a split past its head's ``B_h`` writes an empty partial.  Memory: the sum of the budgets.

    Returns ``(out [N, Hq, D] in q's dtype, lse float32 [N, Hq])`` (``[Hq, D]``, ``[Hq]`` in the
    batch-1 form), natural-log LSE.  Not differentiable.

    Backends: CUDA tensors (or CPU ones under ``TRITON_INTERPRET=1``) run two Triton launches over
    all (row, KV head) pairs at once that fuse the decision, the split-K attention, the merge and
    the cache update (see the module docstring for the race-free split of work); other CPU tensors
    run a vectorised PyTorch step.  Neither reads a value back to the host.  The scorer that
    produces ``leaving_prio`` is not fused.
    """
    if head_budgets is not None:
        return _packed_step(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos=pos,
                            sinks=sinks, window=window, scale=scale, num_splits=num_splits, block_n=block_n,
                            check=check, head_budgets=head_budgets)
    _check(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks, window)
    scale = default_scale(scale, q.shape[-1])
    if isinstance(pos, torch.Tensor) and host_check(check, q.device):
        _check_positions(pos)
    batched = q.dim() == 3
    q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos = _batch_form(
        batched, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos)
    if q.shape[0] == 0:  # no row: nothing to write (and no pointer a kernel may take)
        out, lse = q.new_empty(q.shape), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    elif use_triton(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio):
        check_split_options(num_splits, block_n)
        out, lse = _triton_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos,
                                  sinks=sinks, window=window, scale=scale, num_splits=num_splits,
                                  block_n=block_n)
    else:
        out, lse = _torch_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos,
                                 sinks=sinks, window=window, scale=scale)
    return (out, lse) if batched else (out[0], lse[0])


def _packed_step(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, *, pos, sinks, window,
                 scale, num_splits, block_n, check, head_budgets):
    """``fixed_budget_decode`` with ``head_budgets``: the packed layout (see its docstring)."""
    Hkv = _check_packed(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos, sinks,
                        window, head_budgets)
    scale = default_scale(scale, q.shape[-1])
    checked = host_check(check, q.device)
    if isinstance(pos, torch.Tensor) and checked:
        _check_positions(pos)
    batched = q.dim() == 3
    q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos = _batch_form(
        batched, q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos)
    T = k_cache.shape[1]
    triton_path = use_triton(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio)
    budgets = head_budgets
    if isinstance(head_budgets, torch.Tensor):
        if checked or not triton_path:  # a host read (never by default on CUDA)
            budgets = tuple(int(b) for b in head_budgets.tolist())
            _check_budget_values(budgets, T, sinks, window)
    else:
        budgets = tuple(head_budgets)
    if q.shape[0] == 0:
        out, lse = q.new_empty(q.shape), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    elif triton_path:
        check_split_options(num_splits, block_n)
        if isinstance(budgets, tuple):
            packed = (_layout(budgets, sinks, window, q.device).meta, max(budgets))
        else:  # an unchecked device tensor: offsets by a cumsum on the device, a host bound on the largest
            bud = budgets.to(torch.int64)
            off = bud.cumsum(0) - bud
            koff = off - torch.arange(Hkv, device=q.device) * (sinks + window)
            packed = (torch.stack([bud, off, koff]), T - (Hkv - 1) * (sinks + window))
        out, lse = _triton_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos,
                                  sinks=sinks, window=window, scale=scale, num_splits=num_splits,
                                  block_n=block_n, packed=packed)
    else:
        out, lse = _torch_decode_packed(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio,
                                        pos, lay=_layout(budgets, sinks, window, q.device), sinks=sinks,
                                        window=window, scale=scale)
    return (out, lse) if batched else (out[0], lse[0])
