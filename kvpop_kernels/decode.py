"""``fixed_budget_decode``: the fused decode step over a fixed budget of ``B`` slots per (batch row, KV head).

One Triton split-K launch per step (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; the shared
split-K plumbing is ``kvpop_kernels.splitk``), whose last split program of each (row, KV head), found by an
arrival counter, merges the splits and writes the cache; and a vectorised PyTorch path for CPU tensors.
Semantics: ``reference.fixed_budget_decode`` (slot layout, eviction rule, in-place updates) and docs/DESIGN.md
section 2; the split programs and the fused combine, why they are race-free, what the counter costs, what is
fused, precision and registers: docs/DESIGN.md section 9.
"""
from __future__ import annotations

import math

import torch

from ._utils import check_split_options, default_scale, empty, host_check, use_triton
from .layout import DecodeStep, SlotLayout, SlotState, as_layout, slot_of
from .layout.base import check_positions, check_state
from .splitk import LOG2E, plan_splits, upcast_operands

try:
    import triton
    import triton.language as tl

    from .splitk import online_softmax_tile, store_split
except Exception:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["fixed_budget_decode", "SlotState", "slot_of"]

_INT32_MAX = 2**31 - 1

# ------------------------------------------------------------------------------ Triton
if triton is not None:
    _INT32_MAX_C = tl.constexpr(_INT32_MAX)
    _LN2_C = tl.constexpr(math.log(2.0))

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
        (budgets, slot offsets, long-range offsets): ``(off, koff, B_h, bad)``; a head whose slots or
        long-range slots do not lie inside the tensors is ``bad`` (the device-side guard: it computes with
        an empty layout at offset 0, writes nothing and returns NaN)."""
        bud = tl.load(META + h64)
        off = tl.load(META + HKV + h64)
        koff = tl.load(META + 2 * HKV + h64)
        kh = bud - SINKS - WINDOW
        bad = (kh < 0) | (off < 0) | (off + bud > T_ALL) | (koff < 0) | (koff + kh > K_ALL)
        # offsets stay int64 (they scale strides); B_h as int32, the uniform kernel's loop type
        return tl.where(bad, 0, off), tl.where(bad, 0, koff), tl.where(bad, 0, bud).to(tl.int32), bad

    @triton.jit
    def _quantize_new(X, row64, D, d, d_ok, FP8: tl.constexpr):
        """Row ``row``'s new key or value ``X[row, :D]`` (the model's dtype) quantised in registers exactly as
        ``layout.quantize`` does it: one float32 scale ``max|x| / qmax`` and codes ``x / scale`` (IEEE divisions;
        int8: rounded half up, clipped to +-127; fp8 e4m3: rounded to nearest even in integer arithmetic, the same
        bits on every GPU and in the interpreter, at most 448).  ``(codes: int8, or fp8's bits as uint8, codes
        times scale in float32, scale)``; lanes outside ``d_ok`` read as 0."""
        x = tl.load(X + row64 * D + d, mask=d_ok, other=0.0).to(tl.float32)
        if FP8:
            sc = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0)
            r = tl.math.div_rn(x, tl.where(sc > 0, sc, 1.0))
            a = tl.abs(r)
            bits = a.to(tl.int32, bitcast=True)
            # normal (a >= 2**-6): float32's mantissa rounded to 3 bits, ties to even, the exponent rebiased 127 -> 7
            rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
            mag = tl.minimum(rb - (120 << 3), 0x7E)
            val = tl.minimum((rb << 20).to(tl.float32, bitcast=True), 448.0)
            # subnormal (a < 2**-6): a multiple of 2**-9, ties to even (8 of them is the smallest normal, code 8)
            y = a * 512.0
            f = tl.floor(y)
            h = y - f
            fi = f.to(tl.int32)
            m = fi + ((h > 0.5) | ((h == 0.5) & ((fi & 1) == 1))).to(tl.int32)
            sub = a < 0.015625
            mag = tl.where(sub, m, mag)
            val = tl.where(sub, m.to(tl.float32) * 0.001953125, val)
            neg = r.to(tl.int32, bitcast=True) < 0  # (the sign of -0.0 too, as torch's cast keeps it)
            codes = (mag | tl.where(neg, 0x80, 0)).to(tl.uint8)
            deq = tl.where(neg, -val, val) * sc
        else:
            sc = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0)
            r = tl.math.div_rn(x, tl.where(sc > 0, sc, 1.0))
            c = tl.minimum(tl.maximum(tl.floor(r + 0.5), -127.0), 127.0)
            codes = c.to(tl.int8)
            deq = c * sc
        return codes, deq, sc

    @triton.jit
    def _row_head(POS, META, KC, VC, SP, PR, n64, h64, s_kc_n, s_kc_h, s_kc_b, s_vc_n, s_vc_h, s_vc_b,
                  s_sp_n, s_sp_h, s_sp_b, s_pr_n, s_pr_h, s_pr_j, HKV, B, SINKS, WINDOW, T_ALL, K_ALL,
                  PACKED: tl.constexpr):
        """Row ``n``'s position (guarded), KV head ``h``'s budget ``B`` (its long-range slots are ``[s + w, B)``)
        and the bases of its keys, values, slot positions and priorities, in either layout: ``(pos, bad, B,
        kc, vc, spp, prp, sp_off)`` (``sp_off``: the offset of the slot positions' base, which the
        per-slot scales of a quantised layout share); ``bad`` for a refused position or (packed) a head
        outside the tensors."""
        pos, bad = _guarded_pos(POS, n64)
        if PACKED:  # head h's slots start at slot off (its long-range priorities at koff); B per head
            off, koff, B, head_bad = _packed_head(META, h64, HKV, SINKS, WINDOW, T_ALL, K_ALL)
            bad = bad | head_bad
        else:
            off = 0
            koff = 0
        sp_off = n64 * s_sp_n + h64 * s_sp_h + off * s_sp_b
        return (pos, bad, B, KC + n64 * s_kc_n + h64 * s_kc_h + off * s_kc_b,
                VC + n64 * s_vc_n + h64 * s_vc_h + off * s_vc_b, SP + sp_off,
                PR + n64 * s_pr_n + h64 * s_pr_h + koff * s_pr_j, sp_off)

    @triton.jit
    def _decode_step(Q, KN, VN, KC, VC, SP, PR, POS, LP, OUT, LSE, MID_O, MID_L, MID_C, CV, VLV, CP, CT, CJ, CNT,
                     META, KS, VS,
                     s_kc_n, s_kc_h, s_kc_b, s_kc_d, s_vc_n, s_vc_h, s_vc_b, s_vc_d,
                     s_sp_n, s_sp_h, s_sp_b, s_pr_n, s_pr_h, s_pr_j,
                     HKV, B, D, SINKS, WINDOW, CHUNK, NS, qk_scale, T_ALL, K_ALL,
                     G: tl.constexpr, G_PAD: tl.constexpr, G_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, UPCAST: tl.constexpr,
                     PACKED: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr, APART: tl.constexpr):
        """The whole step of one (batch row, KV head) and one split of its slots (docs/DESIGN.md section 9): the
        chunk's eviction candidate and partial attention into scratch, then a ticket; the last program of the
        row to arrive combines (:func:`_combine`)."""
        row = tl.program_id(0)  # (batch row, KV head) flattened: row = n * HKV + h
        split = tl.program_id(1)
        n64 = (row // HKV).to(tl.int64)
        h64 = (row % HKV).to(tl.int64)
        # this row's position, read on the device (no host value): the new token's slot and the
        # token leaving the window follow from it
        pos, pos_bad, B_h, kc, vc, spp, prp, sp_off = _row_head(
            POS, META, KC, VC, SP, PR, n64, h64, s_kc_n, s_kc_h, s_kc_b, s_vc_n, s_vc_h, s_vc_b, s_sp_n, s_sp_h,
            s_sp_b, s_pr_n, s_pr_h, s_pr_j, HKV, B, SINKS, WINDOW, T_ALL, K_ALL, PACKED)
        ksp = KS + sp_off  # a quantised layout's per-slot scales (QUANT only; never read otherwise)
        vsp = VS + sp_off
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
        crow = qh * (NS + 1)  # this query head's logits of the splits' candidates [0, NS) and the leaving token NS

        # -- 1. this chunk's eviction candidate: its lowest-ranked long-range slot (lowest priority, then the
        #    oldest position, then the lowest index; none: +inf / INT32_MAX / INT32_MAX).  Stage 2 takes the
        #    lowest of the head's candidates, which is the head's lowest-ranked slot: each program reads only
        #    the priorities of its own chunk, so no program's latency grows with the head's k_h.
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, B_h)
        best_p = float("inf")
        best_t = _INT32_MAX_C
        best_j = _INT32_MAX_C
        for c0 in range(tl.maximum(start, LR0), end, BLOCK_N):  # (names unique to this loop)
            cc = c0 + tl.arange(0, BLOCK_N)
            cc_ok = cc < end
            pr_blk = tl.load(prp + (cc - LR0) * s_pr_j, mask=cc_ok, other=float("inf"))
            t_blk = tl.load(spp + cc * s_sp_b, mask=cc_ok, other=_INT32_MAX_C)  # (not waiting for pr_blk)
            bmin = tl.min(pr_blk, axis=0)
            cand = cc_ok & (pr_blk == bmin)
            tmin = tl.min(tl.where(cand, t_blk, _INT32_MAX_C), axis=0)
            jmin = tl.min(tl.where(cand & (t_blk == tmin), cc - LR0, _INT32_MAX_C), axis=0)
            better = (bmin < best_p) | ((bmin == best_p) & (tmin < best_t))
            best_p = tl.where(better, bmin, best_p)
            best_t = tl.where(better, tmin, best_t)
            best_j = tl.where(better, jmin, best_j)
        tl.store(CP + row * NS + split, best_p)
        tl.store(CT + row * NS + split, best_t)
        tl.store(CJ + row * NS + split, best_j)
        # the candidate's logits (natural log) and value, for stage 2 to add unless it is evicted: -inf and
        # zeros for none or an empty slot
        has_c = best_j < _INT32_MAX_C
        c_slot = tl.where(has_c, best_j, -1 - LR0) + LR0  # -1: no candidate in this chunk
        c_live = has_c & (best_t >= 0)  # (best_t: the candidate's slot_pos, read by the scan)
        s_c = tl.full([G_PAD], float("-inf"), tl.float32)
        v_c = tl.zeros([BLOCK_D], tl.float32)
        if c_live:
            k_c = tl.load(kc + c_slot.to(tl.int64) * s_kc_b + d * s_kc_d, mask=d_ok, other=0.0).to(tl.float32)
            v_c = tl.load(vc + c_slot.to(tl.int64) * s_vc_b + d * s_vc_d, mask=d_ok, other=0.0).to(tl.float32)
            if QUANT:
                k_c = k_c * tl.load(ksp + c_slot * s_sp_b)
                v_c = v_c * tl.load(vsp + c_slot * s_sp_b)
            s_c = tl.sum(qf * k_c[None, :], axis=1) * qk_scale
        tl.store(MID_C + crow + split, s_c * _LN2_C, mask=g_ok)
        tl.store(CV + (row.to(tl.int64) * NS + split) * D + d, v_c, mask=d_ok)

        # -- 2. split 0: the leaving token t_new = pos - w, still in ring slot slot_new (its value now, its logits
        #    after the key loop; stage 2 adds it if the head keeps it), and the new token (not in the cache yet)
        first = split == 0
        kl = tl.zeros([BLOCK_D], tl.float32)
        if first:
            leaving = pos - WINDOW >= SINKS
            lv_ok = d < tl.where(leaving, D, 0)  # (a block bound, not `d_ok & scalar`: the interpreter
            #                                      broadcasts int1 scalars to int32)
            kl = tl.load(kc + slot_new * s_kc_b + d * s_kc_d, mask=lv_ok, other=0.0).to(tl.float32)
            vl = tl.load(vc + slot_new * s_vc_b + d * s_vc_d, mask=lv_ok, other=0.0).to(tl.float32)
            if QUANT:  # (a ring slot not written yet may hold anything: its scale is not read)
                kl = kl * tl.load(ksp + slot_new * s_sp_b, mask=leaving, other=0.0)
                vl = vl * tl.load(vsp + slot_new * s_sp_b, mask=leaving, other=0.0)
            tl.store(VLV + row.to(tl.int64) * D + d, vl, mask=d_ok)
        nd_ok = d < tl.where(first, D, 0)
        if QUANT:  # quantised in registers and attended as the cache will hold it: codes times scale
            kn = _quantize_new(KN, row.to(tl.int64), D, d, nd_ok, FP8)[1]
            vn = _quantize_new(VN, row.to(tl.int64), D, d, nd_ok, FP8)[1]
        else:
            kn = tl.load(KN + row.to(tl.int64) * D + d, mask=nd_ok, other=0.0).to(tl.float32)
            vn = tl.load(VN + row.to(tl.int64) * D + d, mask=nd_ok, other=0.0).to(tl.float32)
        m_i = tl.where(first, tl.sum(qf * kn[None, :], axis=1) * qk_scale, float("-inf"))
        l_i = tl.where(first, 1.0, 0.0) + tl.zeros([G_PAD], tl.float32)
        acc = l_i[:, None] * vn[None, :]

        # -- 3. this split's chunk of slots but the new token's (stale) and the candidate (base-2 online
        #    softmax, fp32 accumulation); the loads do not wait for the candidate (it is masked after them)
        for n0 in range(start, end, BLOCK_N):
            nn = n0 + tl.arange(0, BLOCK_N)
            n_in = (nn < end) & (nn != slot_new)
            sp = tl.load(spp + nn * s_sp_b, mask=n_in, other=-1)
            live = n_in & (sp >= 0)
            kv_mask = live[:, None] & d_ok[None, :]
            k = tl.load(kc + nn[:, None].to(tl.int64) * s_kc_b + d[None, :] * s_kc_d, mask=kv_mask, other=0.0)
            v = tl.load(vc + nn[:, None].to(tl.int64) * s_vc_b + d[None, :] * s_vc_d, mask=kv_mask, other=0.0)
            if QUANT:  # dequantised on load, in the queries' dtype (float32 when UPCAST)
                k_sc = tl.load(ksp + nn * s_sp_b, mask=live, other=0.0)
                v_sc = tl.load(vsp + nn * s_sp_b, mask=live, other=0.0)
                k = (k.to(tl.float32) * k_sc[:, None]).to(q.dtype)
                v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
            m_i, l_i, acc = online_softmax_tile(q, k, v, live & (nn != c_slot), qk_scale, m_i, l_i, acc, UPCAST)
        # the partial (-inf / 0 for an empty chunk; NaN for a refused row)
        store_split(MID_O, MID_L, qh * NS + split, m_i, l_i, acc, pos_bad, g_ok, d, d_ok, D)
        if first:  # the leaving token's logits, from its key loaded above (formed here, no float32 copy of the
            #        queries stays live across the key loop: no register spills, docs/DESIGN.md section 9)
            s_lv = tl.sum(q.to(tl.float32) * kl[None, :], axis=1) * qk_scale
            tl.store(MID_C + crow + NS, s_lv * _LN2_C, mask=g_ok)

        # -- 4. the combine, fused: a ticket from the row's counter after this program's scratch stores (the barrier:
        #    every thread's stores are issued before the release) and its cache reads; the last of the row's NS
        #    programs to arrive sees every other one's scratch (acquire; its loads bypass L1), resets the counter
        #    for the next call and combines.  No program waits for another.
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + row, 1, sem="acq_rel", scope="gpu")
        if ticket == NS - 1:
            tl.store(CNT + row, 0)
            if APART:
                _combine_apart(MID_O, MID_L, MID_C, CV, VLV, CP, CT, CJ, OUT, LSE, LP, KN, VN, KS, VS, kc, vc,
                               spp, prp, sp_off, s_kc_b, s_kc_d, s_vc_b, s_vc_d, s_sp_b, s_pr_j, row, pos, pos_bad, B_h,
                               D, NS, CHUNK, SINKS, WINDOW, G, G_P2, BLOCK_S, BLOCK_D, QUANT, FP8)
            else:
                _combine(MID_O, MID_L, MID_C, CV, VLV, CP, CT, CJ, OUT, LSE, LP, KN, VN, KS, VS, kc, vc, spp,
                         prp, sp_off, s_kc_b, s_kc_d, s_vc_b, s_vc_d, s_sp_b, s_pr_j, row, pos, pos_bad, B_h, D, NS,
                         CHUNK, SINKS, WINDOW, G, G_P2, BLOCK_S, BLOCK_D, QUANT, FP8)

    @triton.jit
    def _merge_group(MID_O, MID_L, MID_C, CV, row64, qh, g_ok, NS, ns_h, D, skip, d, d_ok, G_P2: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """The online LSE merges of the combine for the query heads ``qh [G_P2]`` of KV head ``row`` at once,
        ``BLOCK_S`` splits per step (a ``[G_P2, BLOCK_S, BLOCK_D]`` tile: the loads of all heads in flight
        together): ``(o, lse)`` of the splits' partials ``MID_O, MID_L`` and ``(o_c, lse_c)`` of the
        candidates' values ``CV`` (shared by the group) under each head's logits ``MID_C``, split ``skip`` left
        out (-1: none); ``o [G_P2, BLOCK_D]`` normalised, natural-log ``lse [G_P2]``, as ``splitk.merge_splits``
        per head (zeros and ``-inf`` when empty, NaN when a split is NaN).  Loads past L1 (``.cg``)."""
        m_p = tl.full([G_P2], float("-inf"), tl.float32)
        l_p = tl.zeros([G_P2], tl.float32)
        acc_p = tl.zeros([G_P2, BLOCK_D], tl.float32)
        m_c = tl.full([G_P2], float("-inf"), tl.float32)
        l_c = tl.zeros([G_P2], tl.float32)
        acc_c = tl.zeros([G_P2, BLOCK_D], tl.float32)
        for i0 in range(0, ns_h, BLOCK_S):
            i = i0 + tl.arange(0, BLOCK_S)
            i_ok = i < ns_h
            gi_ok = g_ok[:, None] & i_ok[None, :]
            lse_i = tl.load(MID_L + qh[:, None] * NS + i[None, :], mask=gi_ok, other=float("-inf"),
                            cache_modifier=".cg")
            o_i = tl.load(MID_O + (qh[:, None, None] * NS + i[None, :, None]) * D + d[None, None, :],
                          mask=gi_ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
            lc_i = tl.load(MID_C + qh[:, None] * (NS + 1) + i[None, :], mask=gi_ok, other=float("-inf"),
                           cache_modifier=".cg")
            v_i = tl.load(CV + (row64 * NS + i[:, None]) * D + d[None, :], mask=i_ok[:, None] & d_ok[None, :],
                          other=0.0, cache_modifier=".cg")
            lc_i = tl.where(i[None, :] == skip, float("-inf"), lc_i)
            # the partials
            m_new = tl.maximum(m_p, tl.max(lse_i, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_p - m_safe)
            beta = tl.exp(lse_i - m_safe[:, None])  # 0 for empty splits (lse = -inf), NaN for a refused one
            acc_p = acc_p * alpha[:, None] + tl.sum(o_i * beta[:, :, None], axis=1)
            l_p = l_p * alpha + tl.sum(beta, axis=1)
            m_p = m_new
            # the candidates
            m_new = tl.maximum(m_c, tl.max(lc_i, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_c - m_safe)
            beta = tl.exp(lc_i - m_safe[:, None])
            acc_c = acc_c * alpha[:, None] + tl.sum(v_i[None, :, :] * beta[:, :, None], axis=1)
            l_c = l_c * alpha + tl.sum(beta, axis=1)
            m_c = m_new
        lp_div = tl.where(l_p == 0, 1.0, l_p)  # (a NaN sum stays NaN: out and lse both NaN)
        lc_div = tl.where(l_c == 0, 1.0, l_c)
        return acc_p / lp_div[:, None], m_p + tl.log(lp_div), acc_c / lc_div[:, None], m_c + tl.log(lc_div)

    def _combine_fn(MID_O, MID_L, MID_C, CV, VLV, CP, CT, CJ, OUT, LSE, LP, KN, VN, KS, VS, kc, vc, spp, prp,
                 sp_off, s_kc_b, s_kc_d, s_vc_b, s_vc_d, s_sp_b, s_pr_j, row, pos, pos_bad, B, D, NS, CHUNK, SINKS,
                 WINDOW, G: tl.constexpr, G_P2: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                 QUANT: tl.constexpr,
                 FP8: tl.constexpr):
        """The combine of one (batch row, KV head) ``row`` (its position ``pos``, budget ``B`` and bases ``kc, vc,
        spp, prp, sp_off`` as the attention found them), run by the last of its programs to arrive (every other
        one has written its scratch and read the cache): the eviction decision from the chunks' candidates, the
        merge of each query head of the group, and the cache update.  Every scratch load bypasses L1 (``.cg``):
        the partials were written by other SMs."""
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        row64 = row.to(tl.int64)
        t_new = pos - WINDOW
        slot_new = tl.where(pos < SINKS, pos, SINKS + (tl.maximum(pos, SINKS) - SINKS) % WINDOW)
        LR0 = SINKS + WINDOW
        ns_h = tl.minimum(tl.maximum((B + CHUNK - 1) // CHUNK, 1), NS)  # the splits holding this head's slots

        # -- 1. the eviction decision: the lowest of the head's chunk candidates (the order of the chunk scan)
        best_p = float("inf")
        best_t = _INT32_MAX_C
        best_j = _INT32_MAX_C
        for i0 in range(0, ns_h, BLOCK_S):
            ci = i0 + tl.arange(0, BLOCK_S)
            ci_ok = ci < ns_h
            p_blk = tl.load(CP + row * NS + ci, mask=ci_ok, other=float("inf"), cache_modifier=".cg")
            t_blk = tl.load(CT + row * NS + ci, mask=ci_ok, other=_INT32_MAX_C, cache_modifier=".cg")
            j_blk = tl.load(CJ + row * NS + ci, mask=ci_ok, other=_INT32_MAX_C, cache_modifier=".cg")
            bmin = tl.min(p_blk, axis=0)
            cand = ci_ok & (p_blk == bmin)
            tmin = tl.min(tl.where(cand, t_blk, _INT32_MAX_C), axis=0)
            jmin = tl.min(tl.where(cand & (t_blk == tmin), j_blk, _INT32_MAX_C), axis=0)
            better = (bmin < best_p) | ((bmin == best_p) & (tmin < best_t))
            best_p = tl.where(better, bmin, best_p)
            best_t = tl.where(better, tmin, best_t)
            best_j = tl.where(better, jmin, best_j)
        lp = tl.load(LP + row)
        lp = tl.where(lp != lp, float("-inf"), lp)  # NaN ranks as -inf
        keep = (t_new >= SINKS) & (best_j < _INT32_MAX_C) & ((lp > best_p) | ((lp == best_p) & (t_new > best_t)))
        keep = keep & (pos_bad == 0)
        dst = tl.where(keep, best_j, 0) + LR0
        dst_c = dst.to(tl.int64)
        skip = tl.where(keep, dst // CHUNK, -1)  # the split whose candidate is evicted (-1: none)

        # -- 2. every query head of the group at once: LSE merge (natural log) of the splits' partials, of their
        #    candidates but the evicted one, and of the leaving token when kept
        g = tl.arange(0, G_P2)
        g_ok = g < G
        qh = row64 * G + g
        o, lse, o_c, lse_c = _merge_group(MID_O, MID_L, MID_C, CV, row64, qh, g_ok, NS, ns_h, D, skip, d, d_ok, G_P2,
                                          BLOCK_S, BLOCK_D)
        o_lv = tl.load(VLV + row64 * D + d, mask=d_ok, other=0.0, cache_modifier=".cg")
        lse_lv = tl.load(MID_C + qh * (NS + 1) + NS, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
        lse_lv = tl.where(keep, lse_lv, float("-inf"))  # (the leaving token's logits: split 0)
        m = tl.maximum(tl.maximum(lse, lse_c), lse_lv)  # (finite: split 0 holds the new token; a refused
        m = tl.where(m == float("-inf"), 0.0, m)         #  row's NaN partials stay NaN through w)
        w = tl.exp(lse - m)
        w_c = tl.exp(lse_c - m)
        w_lv = tl.exp(lse_lv - m)
        o = (o * w[:, None] + o_c * w_c[:, None] + o_lv[None, :] * w_lv[:, None]) / (w + w_c + w_lv)[:, None]
        tl.store(OUT + qh[:, None] * D + d[None, :], o.to(OUT.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        tl.store(LSE + qh, m + tl.log(w + w_c + w_lv), mask=g_ok)

        # -- 3. the cache update of this KV head: every other program of the row has read the cache already
        kd_ok = d < tl.where(keep, D, 0)  # d_ok & keep (the interpreter broadcasts int1 scalars badly)
        ring_k = tl.load(kc + slot_new * s_kc_b + d * s_kc_d, mask=kd_ok)
        ring_v = tl.load(vc + slot_new * s_vc_b + d * s_vc_d, mask=kd_ok)
        tl.debug_barrier()  # every thread has read ring slot r before anyone overwrites it
        tl.store(kc + dst_c * s_kc_b + d * s_kc_d, ring_k, mask=kd_ok)
        tl.store(vc + dst_c * s_vc_b + d * s_vc_d, ring_v, mask=kd_ok)
        if QUANT:  # the scales move with the codes (no requantisation)
            ksp = KS + sp_off
            vsp = VS + sp_off
            ring_ks = tl.load(ksp + slot_new * s_sp_b, mask=keep)
            ring_vs = tl.load(vsp + slot_new * s_sp_b, mask=keep)
            tl.debug_barrier()
            tl.store(ksp + dst_c * s_sp_b, ring_ks, mask=keep)
            tl.store(vsp + dst_c * s_sp_b, ring_vs, mask=keep)
        tl.store(spp + dst_c * s_sp_b, t_new, mask=keep)
        tl.store(prp + (dst_c - LR0) * s_pr_j, lp, mask=keep)
        nd_ok = d < tl.where(pos_bad, 0, D)  # a refused position writes nothing
        if QUANT:  # the new token's codes and scales, quantised again as the attention did (the same ops)
            kq, _, ksc = _quantize_new(KN, row64, D, d, nd_ok, FP8)
            vq, _, vsc = _quantize_new(VN, row64, D, d, nd_ok, FP8)
            tl.store(kc + slot_new * s_kc_b + d * s_kc_d, kq.to(kc.dtype.element_ty, bitcast=True), mask=nd_ok)
            tl.store(vc + slot_new * s_vc_b + d * s_vc_d, vq.to(vc.dtype.element_ty, bitcast=True), mask=nd_ok)
            tl.store(KS + sp_off + slot_new * s_sp_b, ksc, mask=pos_bad == 0)
            tl.store(VS + sp_off + slot_new * s_sp_b, vsc, mask=pos_bad == 0)
        else:
            kn = tl.load(KN + row64 * D + d, mask=nd_ok)
            vn = tl.load(VN + row64 * D + d, mask=nd_ok)
            tl.store(kc + slot_new * s_kc_b + d * s_kc_d, kn, mask=nd_ok)
            tl.store(vc + slot_new * s_vc_b + d * s_vc_d, vn, mask=nd_ok)
        tl.store(spp + slot_new * s_sp_b, pos, mask=pos_bad == 0)

    # the combine inlined into the step (sm_90 on: no spills), or as a function of its own (before sm_90, where the
    # inlined combine spills 20 bytes in the int8 packed G = 8, D = 64 build; ``python -m benchmarks.tools.registers``)
    _combine = triton.jit(_combine_fn)
    _combine_apart = triton.jit(_combine_fn, noinline=True)


def merge_block(num_splits: int, G: int, block_d: int) -> int:
    """Splits the combine merges per vector step: 16 (fewer when there are fewer), and fewer again where the
    ``[next_pow2(G), BLOCK_S, BLOCK_D]`` tile of the group's partials would pass 2048 elements (16 registers a
    thread at 4 warps; at 4096, 24 bytes spill on sm_90 for bf16, G = 4, D = 128, and at 8192 300)."""
    g2 = triton.next_power_of_2(G)
    return max(1, min(16, triton.next_power_of_2(num_splits), 2048 // (g2 * block_d)))


def arch_options(arch: int) -> tuple[int, bool]:
    """``(num_stages, APART)`` of the fused step on a GPU of compute capability ``arch`` (90 for sm_90): from
    Hopper on the key loop's loads run one tile ahead (two stages) and the combine is inlined; before it one stage
    and the combine a function of its own, which keep sm_80 clear of register spills (two stages spill 24 bytes
    at bf16, D = 128, an inlined combine 20 at int8 packed, G = 8, D = 64; ``python -m benchmarks.tools.registers``)."""
    return (2, False) if arch >= 90 else (1, True)


_ARCH: dict[int, int] = {}


def _device_arch(device: torch.device) -> int:
    """Compute capability of a CUDA device as one int (90 for 9.0), cached; 90 for the interpreter."""
    if device.type != "cuda":
        return 90
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ARCH:
        major, minor = torch.cuda.get_device_capability(idx)
        _ARCH[idx] = 10 * major + minor
    return _ARCH[idx]


_TICKETS: dict[tuple, torch.Tensor] = {}


def ticket_counters(device: torch.device, rows: int) -> torch.Tensor:
    """The fused step's per-(batch row, KV head) arrival counters: int32, zero between calls (the last program of
    a row resets its own), at least ``rows`` of them; one buffer per device and CUDA stream (launches on one
    stream are ordered, so two calls never share a counter at once), grown by a zero fill when too small."""
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    cnt = _TICKETS.get(key)
    if cnt is None or cnt.numel() < rows:
        cnt = torch.zeros(max(rows, 256, 2 * (0 if cnt is None else cnt.numel())), dtype=torch.int32, device=device)
        _TICKETS[key] = cnt
    return cnt


def _triton_decode(step: DecodeStep, state: SlotState, *, sinks, window, scale, num_splits, block_n,
                   packed=None, kv_dtype=None):
    """Batched form: ``q [N, Hq, D]``, caches ``[N, Hkv, B, D]``, ``pos [N]`` int on q's device; ``step`` the
    new token in the model's dtype (a quantised layout's is quantised in the kernel, as ``SlotLayout.encode``
    does it: no separate pass).

    A quantised layout (``kv_dtype`` ``"int8"`` or ``"fp8"``, ``state.k_scale`` set): caches hold codes;
    ``k_scale, v_scale`` float32 with ``slot_pos``'s shape and strides.

    ``packed = (meta, max_budget)``: the packed layout (caches ``[N, T, D]``, ``slot_pos [N, T]``,
    ``slot_prio [N, K]``), ``meta [3, Hkv]`` int64 on the device (budgets, slot offsets, long-range
    offsets) and a host bound on the largest budget, over which the splits are cut."""
    q, k_new, v_new, leaving_prio, pos = step.q, step.k_new, step.v_new, step.leaving_prio, step.pos
    k_cache, v_cache, slot_pos, slot_prio = state.k_cache, state.v_cache, state.slot_pos, state.slot_prio
    quant = None if state.k_scale is None else (state.k_scale, state.v_scale)
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
    upcast = upcast_operands(q.dtype)  # (q's dtype is the caches' but for a quantised layout's codes)
    if block_n is None:  # 32 on the GPU (no register spills at D <= 128, as SGLang's grouped decode)
        block_n = 32 if dev.type == "cuda" else 64
    # fp32 operands (ieee dot) and wide heads need 8 warps to stay clear of register spills (sm_90)
    num_warps = 4 if (not upcast or dev.type != "cuda") and D <= 128 else 8
    block_d = max(16, triton.next_power_of_2(D))
    g_pad = max(16, triton.next_power_of_2(G))
    rows = N * Hkv  # one (batch row, KV head) per program (times its splits)
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
    # a zero-size tensor has no usable pointer: hand a dummy when k == 0 (never read: no long-range slot)
    if K > 0:
        pr = slot_prio
    else:
        pr = torch.full((N, Hkv, 1) if packed is None else (N, 1), float("-inf"), dtype=torch.float32, device=dev)
    pr_strides = pr.stride() if packed is None else (pr.stride(0), 0, pr.stride(1))
    # a quantised layout's scales (dummy pointers, never read, otherwise)
    ks, vs = (pr, pr) if quant is None else quant

    # per query head: each split's partial and the logits of its eviction candidate and of the leaving token;
    # per (row, KV head) and split: the candidate's value, priority, position and long-range index
    mid_o = empty((N * Hq, ns, D), dtype=torch.float32, device=dev)
    mid_l = empty((N * Hq, ns), dtype=torch.float32, device=dev)
    mid_c = empty((N * Hq, ns + 1), dtype=torch.float32, device=dev)
    cand_v = empty((rows, ns, D), dtype=torch.float32, device=dev)
    leave_v = empty((rows, D), dtype=torch.float32, device=dev)
    cand_p = empty((rows, ns), dtype=torch.float32, device=dev)
    cand_tj = empty((2, rows, ns), dtype=torch.int32, device=dev)
    out = empty((N, Hq, D), dtype=q.dtype, device=dev)
    lse = empty((N, Hq), dtype=torch.float32, device=dev)
    strides = (*strides, *pr_strides)

    cnt = ticket_counters(dev, rows)
    stages, apart = arch_options(_device_arch(dev))
    try:
        _decode_step[(rows, ns)](
            q_c, kn, vn, k_cache, v_cache, slot_pos, pr, pos_c, lp, out, lse, mid_o, mid_l, mid_c, cand_v, leave_v,
            cand_p, cand_tj[0], cand_tj[1], cnt, meta, ks, vs, *strides,
            Hkv, B, D, s, w, chunk, ns, scale * LOG2E, t_all, k_all,
            G=G, G_PAD=g_pad, G_P2=triton.next_power_of_2(G), BLOCK_D=block_d, BLOCK_N=block_n,
            BLOCK_S=merge_block(ns, G, block_d),
            UPCAST=upcast, PACKED=packed is not None, QUANT=quant is not None, FP8=kv_dtype == "fp8", APART=apart,
            num_warps=num_warps,
            num_stages=stages,
        )
    except BaseException:  # a launch that did not finish may leave tickets taken: the next call starts from zero
        cnt.zero_()
        raise
    return out, lse


# ------------------------------------------------------------------------- PyTorch CPU
@torch.no_grad()
def _torch_step(lay: SlotLayout, *args, **kwargs):
    """The layout's vectorised PyTorch step (CPU tensors); see ``SlotLayout.torch_step``."""
    return lay.torch_step(*args, **kwargs)


# ------------------------------------------------------------------------------ public
def fixed_budget_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, state: SlotState,
                        leaving_prio: torch.Tensor, *, pos: int | torch.Tensor, sinks: int, window: int,
                        scale: float | None = None, layout: SlotLayout | None = None,
                        head_budgets: torch.Tensor | tuple[int, ...] | None = None, check: bool | None = None,
                        num_splits: int | None = None, block_n: int | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step over a fixed budget of ``B = s + w + k`` slots per (batch row, KV head), in place.

    Two forms: batch-1 (shapes below without the leading ``N``) or batched (every tensor with a
    leading batch dimension ``N``; rows are independent and may sit at different positions).

    Slot layout of each KV head (``B = state.k_cache.shape[-2]``, ``k = B - s - w >= 0``):

    * ``[0, s)`` sinks: token ``t < s`` in slot ``t``;
    * ``[s, s+w)`` the window ring: token ``t >= s`` in slot ``s + (t - s) % w``;
    * ``[s+w, B)`` the ``k`` long-range slots.

    Args:
        q: ``[N, Hq, D]`` the new token's queries (rotated), float16/bfloat16/float32.
        k_new, v_new: ``[N, Hkv, D]`` the new token's key (rotated) and value, q's dtype.
        state: a :class:`~kvpop_kernels.layout.SlotState`, updated in place: ``k_cache, v_cache [N, Hkv, B,
            D]`` q's dtype, any strides; ``slot_pos [N, Hkv, B]`` int32, each slot's token position, ``-1``
            when empty; ``slot_prio [N, Hkv, k]`` float32, static priority of each long-range slot's token,
            ``-inf`` when empty (never NaN); ``k_scale, v_scale`` a quantised layout's scales (None otherwise).
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

    Layouts (``kvpop_kernels.layout``, docs/DESIGN.md section 9): ``layout=None`` (and no ``head_budgets``) is
    the uniform layout above (``UniformLayout()``); ``layout=PackedLayout(budgets)``, or its shorthand
    ``head_budgets=budgets``, the packed layout of head-adaptive budgets: one budget ``B_h = s + w + k_h``
    (``k_h >= 0``) per KV head, a tuple of ints or a 1-D int32/int64 tensor ``[Hkv]`` on q's device, and the
    state is packed: ``k_cache, v_cache [N, T, D]`` with ``T = sum B_h``, head ``h`` in the slots ``[off_h,
    off_h + B_h)`` (``off_h`` the prefix sum of the budgets; inside a head the layout above), ``slot_pos [N,
    T]``, ``slot_prio [N, K]`` with ``K = sum k_h = T - Hkv (s + w)`` (head ``h`` at the prefix sum of the
    ``k``). Each head runs the step above on its own slots; a head with ``k_h = 0`` drops every leaving token. A
    tuple is checked on the host (and turned into index tensors once per budgets and device); a tensor is read
    back under the same rule as ``pos`` (``check``): unchecked, a head whose slots do not lie inside the tensors
    writes nothing and returns NaN. (The PyTorch path always reads a CPU tensor's budgets.) On Triton the splits
    are cut over the largest budget (over ``T - (Hkv - 1)(s + w)`` for an unchecked tensor, whose largest value
    the host does not know) in chunks sized, by default, as for the mean budget: a split past its head's ``B_h``
    writes an empty partial. Memory: the sum of the budgets.

    Returns ``(out [N, Hq, D] in q's dtype, lse float32 [N, Hq])`` (``[Hq, D]``, ``[Hq]`` in the
    batch-1 form), natural-log LSE.  Not differentiable.

    Backends: CUDA tensors (or CPU ones under ``TRITON_INTERPRET=1``) run one Triton launch over
    all (row, KV head) pairs at once that fuses the decision, the split-K attention, the merge and
    the cache update (a quantised layout's new token is quantised in it too; docs/DESIGN.md section 9
    for the race-free split of work); other CPU tensors run a vectorised PyTorch step.  Neither reads a
    value back to the host.  The scorer that produces ``leaving_prio`` is not fused.
    """
    if not isinstance(state, SlotState):
        raise TypeError(f"state must be a kvpop_kernels.layout.SlotState(k_cache, v_cache, slot_pos, slot_prio), "
                        f"got {type(state).__name__}")
    lay = as_layout(layout, head_budgets)
    step = DecodeStep(q, k_new, v_new, leaving_prio, pos)
    lay.check(step, state, sinks, window)
    lay.check_scales(state)
    check_state(*state.named())
    checked = host_check(check, q.device)
    if isinstance(pos, torch.Tensor) and checked:
        check_positions(pos)
    batched = step.batched
    if not batched:
        step = DecodeStep(*(x.unsqueeze(0) for x in step.tensors()), pos)
        state = state.map(lambda t: t.unsqueeze(0))
    if not isinstance(step.pos, torch.Tensor):
        step.pos = torch.full((q.shape[0] if batched else 1,), pos, dtype=torch.int64, device=q.device)
    out, lse = _step(lay, step, state, sinks=sinks, window=window, scale=default_scale(scale, q.shape[-1]),
                     checked=checked, num_splits=num_splits, block_n=block_n)
    return (out, lse) if batched else (out[0], lse[0])


def _step(lay: SlotLayout, step: DecodeStep, state: SlotState, *, sinks, window, scale, checked, num_splits,
          block_n):
    """The batched step on the backend of the tensors' device."""
    q = step.q
    triton_path = use_triton(*step.tensors(), *state.tensors()[:4])
    # budgets held as a tensor (packed): read back unless the step runs unchecked on Triton
    lay = lay.host_budgets(state.k_cache.shape[1], sinks, window, checked or not triton_path)
    if q.shape[0] == 0:  # no row: nothing to write (and no pointer a kernel may take)
        return q.new_empty(q.shape), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if triton_path:
        check_split_options(num_splits, block_n)
        return _triton_decode(step, state, sinks=sinks, window=window, scale=scale, kv_dtype=lay.kv_dtype,
                              num_splits=num_splits, block_n=block_n,
                              packed=lay.kernel_meta(state, sinks, window, q.device, checked))
    return _torch_step(lay, step, state, sinks=sinks, window=window, scale=scale)
