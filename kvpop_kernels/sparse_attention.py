"""``sparse_attention``: sink + window + top-k masked attention, forward and backward.

Triton kernels (a list of live keys per query block for the forward and dq; key tiles sorted by the
query at which they are evicted for dk/dv) and a chunked PyTorch path for CPU tensors.  The mask is
docs/DESIGN.md section 2 (``reference.visible_mask``); how the kernels visit only the live keys, their
measured work, precision and tuning: docs/DESIGN.md section 9.
"""
from __future__ import annotations

import torch

from ._utils import NEVER, check_gqa, check_int, check_tensor, default_scale, empty, interpreting, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["sparse_attention"]

_LOG2E = 1.4426950408889634
_DKDV_CHUNK = 1024
_CPU_CHUNK_ELEMS = 1 << 24  # logits per CPU chunk (64 MiB in float32)


# ------------------------------------------------------------------------------ guards
def _check(q: object, k: object, v: object, evict_at: object, sinks: object, window: object,
           scale: object) -> tuple[int, int, int, int, int, int, float]:
    check_tensor("q", q, 4, floating=True)
    check_tensor("k", k, 4, floating=True)
    check_tensor("v", v, 4, floating=True)
    check_tensor("evict_at", evict_at, 3, floating=None)
    if evict_at.dtype not in (torch.int32, torch.int64):
        # a narrower integer cannot hold NEVER = 2**31 - 1 (a cast wraps it into "evicted at once")
        raise ValueError(f"evict_at must be int32 (from eviction_schedule) or int64, got {evict_at.dtype}")
    check_int("sinks", sinks, minimum=0)
    check_int("window", window, minimum=1)
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    if k.shape[0] != Bsz or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"k must be [B={Bsz}, Hkv, S={S}, D={D}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    G = check_gqa(Hq, Hkv)
    if tuple(evict_at.shape) != (Bsz, Hkv, S):
        raise ValueError(f"evict_at must be [B, Hkv, S] = {(Bsz, Hkv, S)}, got {tuple(evict_at.shape)}")
    if D < 1:
        raise ValueError(f"head_dim must be >= 1, got {D}")
    sc = default_scale(scale, D)
    return Bsz, Hq, Hkv, G, S, D, sc


# --------------------------------------------------------------------------------- CPU
def _cpu_chunks(S: int, Bsz: int, Hq: int, chunk: int | None) -> list[tuple[int, int]]:
    if Bsz * Hq * S == 0:
        return []
    if chunk is None:
        # C * (live keys <= S) logits per head: at most _CPU_CHUNK_ELEMS in all, at most 256 queries
        chunk = max(16, min(256, _CPU_CHUNK_ELEMS // max(1, Bsz * Hq * S)))
    return [(c0, min(S, c0 + chunk)) for c0 in range(0, S, chunk)]


def _cpu_plan(ev64: torch.Tensor, c0: int, c1: int, sinks: int, window: int):
    """Keys any query of ``[c0, c1)`` can see, per (b, KV head): sinks, the band ``(c0-w, c1)``, the set
    kept at ``c0``; as ascending indices ``idx [B,Hkv,L]`` padded with invisible ones (``valid`` False)."""
    t = torch.arange(c1, device=ev64.device)
    live = (t < sinks) | (t > c0 - window) | (ev64[..., :c1] > c0)
    L = int(live.sum(-1).max())
    idx = torch.argsort((~live).to(torch.int8), dim=-1, stable=True)[..., :L]
    return idx, torch.gather(live, 2, idx), torch.gather(ev64, 2, idx)


def _cpu_probs(qc, k, v, idx, valid, ev_t, c0, sinks, window, scale, lse=None):
    """Gathered K/V ``[B,Hkv,L,D]`` (float32) and the masked probabilities ``[B,Hkv,G,C,L]`` with their LSE."""
    Bsz, Hkv, L = idx.shape
    D = k.shape[-1]
    C = qc.shape[-2]
    gidx = idx.unsqueeze(-1).expand(Bsz, Hkv, L, D)
    kk = torch.gather(k, 2, gidx).float()
    vv = torch.gather(v, 2, gidx).float()
    logits = torch.einsum("bhgcd,bhld->bhgcl", qc * scale, kk)
    tq = torch.arange(c0, c0 + C, device=qc.device).view(C, 1)
    tk = idx.view(Bsz, Hkv, 1, 1, L)
    vis = (valid.view(Bsz, Hkv, 1, 1, L) & (tk <= tq)
           & ((tk < sinks) | (tk > tq - window) | (tq < ev_t.view(Bsz, Hkv, 1, 1, L))))
    logits.masked_fill_(~vis, float("-inf"))
    if lse is None:  # one exp: p = exp(x - max) / sum, lse = max + log(sum); every row sees its query
        mx = logits.amax(dim=-1, keepdim=True)
        p = torch.exp_(logits.sub_(mx))
        total = p.sum(dim=-1, keepdim=True)
        p.div_(total)
        return gidx, kk, vv, p, (mx + torch.log(total)).squeeze(-1)
    return gidx, kk, vv, torch.exp_(logits.sub_(lse.unsqueeze(-1))), lse


def _cpu_forward(q, k, v, ev, sinks, window, scale, chunk=None):
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    ev64 = ev.to(torch.int64)
    out = empty((Bsz, Hq, S, D), dtype=q.dtype, device=q.device)
    lse = empty((Bsz, Hq, S), dtype=torch.float32, device=q.device)
    for c0, c1 in _cpu_chunks(S, Bsz, Hq, chunk):
        idx, valid, ev_t = _cpu_plan(ev64, c0, c1, sinks, window)
        qc = q[:, :, c0:c1].float().reshape(Bsz, Hkv, G, c1 - c0, D)
        _, _, vv, p, l = _cpu_probs(qc, k, v, idx, valid, ev_t, c0, sinks, window, scale)
        out[:, :, c0:c1] = torch.einsum("bhgcl,bhld->bhgcd", p, vv).reshape(Bsz, Hq, c1 - c0, D)
        lse[:, :, c0:c1] = l.reshape(Bsz, Hq, c1 - c0)
    return out, lse


def _cpu_backward(q, k, v, ev, out, lse, do, dlse, sinks, window, scale, chunk=None):
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    ev64 = ev.to(torch.int64)
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for c0, c1 in _cpu_chunks(S, Bsz, Hq, chunk):
        C = c1 - c0
        idx, valid, ev_t = _cpu_plan(ev64, c0, c1, sinks, window)
        qc = q[:, :, c0:c1].float().reshape(Bsz, Hkv, G, C, D)
        lc = lse[:, :, c0:c1].reshape(Bsz, Hkv, G, C)
        gidx, kk, vv, p, _ = _cpu_probs(qc, k, v, idx, valid, ev_t, c0, sinks, window, scale, lse=lc)
        doc = do[:, :, c0:c1].float().reshape(Bsz, Hkv, G, C, D)
        delta = (doc * out[:, :, c0:c1].float().reshape(Bsz, Hkv, G, C, D)).sum(-1)
        if dlse is not None:
            delta = delta - dlse[:, :, c0:c1].float().reshape(Bsz, Hkv, G, C)
        dv.scatter_add_(2, gidx, torch.einsum("bhgcl,bhgcd->bhld", p, doc))
        ds = torch.einsum("bhgcd,bhld->bhgcl", doc, vv).sub_(delta.unsqueeze(-1)).mul_(p)  # dS / scale
        dq[:, :, c0:c1] = torch.einsum("bhgcl,bhld->bhgcd", ds, kk * scale).reshape(Bsz, Hq, C, D)
        dk.scatter_add_(2, gidx, torch.einsum("bhgcl,bhgcd->bhld", ds, qc * scale))
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _CpuSparseAttention(torch.autograd.Function):
    """PyTorch path: chunks of queries over their gathered live keys, backward recomputes per chunk."""

    @staticmethod
    def forward(ctx, q, k, v, ev, sinks, window, scale, chunk):
        out, lse = _cpu_forward(q, k, v, ev, sinks, window, scale, chunk)
        ctx.save_for_backward(q, k, v, ev, out, lse)
        ctx.cfg = (sinks, window, scale, chunk)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, ev, out, lse = ctx.saved_tensors
        sinks, window, scale, chunk = ctx.cfg
        if do is None:
            do = torch.zeros_like(out)
        dq, dk, dv = _cpu_backward(q, k, v, ev, out, lse, do, dlse, sinks, window, scale, chunk)
        return dq, dk, dv, None, None, None, None, None


def _torch_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ev: torch.Tensor, sinks: int,
                            window: int, scale: float, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch path (see the module docstring); ``ev`` int32 ``[B, Hkv, S]``."""
    return _CpuSparseAttention.apply(q, k, v, ev, sinks, window, scale, chunk)


# ------------------------------------------------------------------------------ Triton
if triton is not None:

    @triton.jit
    def _key_end(t, ev, ok, sinks, window):
        # The rule "t <= q and (t < s or t > q - w or q < evict_at[t])" is "t <= q < e_t" with
        # e_t = max(t + w, evict_at[t]) for t >= s and e_t = +inf for sinks; -1 (never) where not ok.
        e = tl.where(t < sinks, 2147483647, tl.maximum(t + window, ev))
        return tl.where(ok, e, -1)

    @triton.jit
    def _d_mask(offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
        # a constant-true mask when D fills BLOCK_D, so that row loads stay vectorised (and pipelined)
        if D == BLOCK_D:
            return tl.full([BLOCK_D], 1, tl.int1)
        else:
            return offs_d < D

    @triton.jit
    def _list_kernel(EV, LIST, CNT, S, sinks, window, n_qb, width,
                     BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, WRITE: tl.constexpr):
        # keys t < lo = max(q0-w+1, 0) that a query of [q0, q0+BLOCK_M) may see: t < s or ev[t] > q0
        pid_m = tl.program_id(0)
        bkv = tl.program_id(1)
        q0 = pid_m * BLOCK_M
        lo = tl.maximum(q0 - window + 1, 0)
        EV += bkv.to(tl.int64) * S
        lst = LIST + (bkv.to(tl.int64) * n_qb + pid_m) * width
        count = tl.full([], 0, tl.int32)
        t_end = lo
        if WRITE:  # a full list (every key before lo) is not written: the kernels read [0, lo) directly
            t_end = tl.where(tl.load(CNT + bkv * n_qb + pid_m) == lo, 0, lo)
        for t0 in range(0, t_end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            ok = t < lo
            ev = tl.load(EV + t, mask=ok, other=0)
            live = ok & ((t < sinks) | (ev > q0))
            if WRITE:
                pos = count + tl.cumsum(live.to(tl.int32), axis=0) - 1
                tl.store(lst + pos, t, mask=live)
            count += tl.sum(live.to(tl.int32), axis=0)
        if not WRITE:
            tl.store(CNT + bkv * n_qb + pid_m, count)

    @triton.jit
    def _load_tile_scores(q, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd, stride_vs, stride_vd,
                          sinks, window, qk_scale,
                          LOWP: tl.constexpr, DOT_PREC: tl.constexpr, IS_LIST: tl.constexpr):
        """Keys/values of the key tile ``t``, the scaled (base-2) scores of ``q`` against it and the
        visibility of each (query row, key) pair: the part the forward and dq tiles share."""
        kv_mask = n_ok[:, None] & d_ok[None, :]
        t64 = t.to(tl.int64)  # row offsets in int64: index x stride passes 2**31 on long sequences
        k = tl.load(K + t64[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V + t64[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if not LOWP:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        e = _key_end(t, tl.load(EV + t, mask=n_ok, other=0), n_ok, sinks, window)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if IS_LIST:  # list keys t < lo: causal holds and the window does not, for every row
            vis = offs_m[:, None] < e[None, :]
        else:
            vis = (t[None, :] <= offs_m[:, None]) & (offs_m[:, None] < e[None, :])
        return k, v, s, vis

    @triton.jit
    def _fwd_tile(q, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd, stride_vs, stride_vd,
                  m_i, l_i, acc, sinks, window, qk_scale,
                  LOWP: tl.constexpr, DOT_PREC: tl.constexpr, IS_LIST: tl.constexpr):
        k, v, s, vis = _load_tile_scores(q, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd,
                                         stride_vs, stride_vd, sinks, window, qk_scale, LOWP, DOT_PREC, IS_LIST)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    def _configs(tile: str) -> list:
        """Autotuned: the tile that does not shape the plan (the key step of the forward/dq, the query
        step of dk/dv), warps and stages.  At D = 128, bf16, 4 warps spill and 8 do not (sm_90 build)."""
        if interpreting():
            return [triton.Config({tile: 32}, num_warps=4, num_stages=1)]
        return [triton.Config({tile: size}, num_warps=w, num_stages=st)
                for size in (32, 64) for w, st in ((8, 2), (8, 3), (4, 3))]

    @triton.autotune(configs=_configs("BLOCK_N"), key=["BLOCK_M", "BLOCK_Q", "D", "LOWP"])
    @triton.jit
    def _fwd_kernel(Q, K, V, EV, LIST, CNT, O, LSE,
                    stride_qb, stride_qh, stride_qs, stride_qd,
                    stride_kb, stride_kh, stride_ks, stride_kd,
                    stride_vb, stride_vh, stride_vs, stride_vd,
                    stride_ob, stride_oh, stride_os, stride_od,
                    S, Hq, Hkv, G, D: tl.constexpr, sinks, window, n_qb, width, qk_scale,
                    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, LOWP: tl.constexpr, DOT_PREC: tl.constexpr):
        # rows: BLOCK_M // BLOCK_Q query heads of one KV group x BLOCK_Q queries (one K/V load for all)
        pid_h = tl.program_id(0)
        pid_m = n_qb - 1 - tl.program_id(1)  # the longest rows first
        n_hg = Hq // (BLOCK_M // BLOCK_Q)
        b = pid_h // n_hg
        hq0 = (pid_h % n_hg) * (BLOCK_M // BLOCK_Q)
        hkv = hq0 // G
        bkv = b * Hkv + hkv
        q0 = pid_m * BLOCK_Q
        r = tl.arange(0, BLOCK_M)
        hq = hq0 + r // BLOCK_Q  # [BLOCK_M] query head of each row
        offs_m = q0 + r % BLOCK_Q  # [BLOCK_M] query position of each row
        m64 = offs_m.to(tl.int64)  # row offsets in int64: index x stride passes 2**31 on long sequences
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < S
        d_ok = _d_mask(offs_d, D, BLOCK_D)
        Q += b.to(tl.int64) * stride_qb + hq[:, None].to(tl.int64) * stride_qh
        K += b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
        EV += bkv.to(tl.int64) * S
        q = tl.load(Q + m64[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if not LOWP:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # 1) the keys before the band: sinks and the long-range keys kept at q0
        lo = tl.maximum(q0 - window + 1, 0)
        hi = tl.minimum(q0 + BLOCK_Q, S)
        cnt = tl.load(CNT + bkv * n_qb + pid_m)
        if cnt == lo:  # all of [0, lo) may be visible (nothing evicted yet, dense): contiguous loads
            for t0 in range(0, lo, BLOCK_N):
                t = t0 + tl.arange(0, BLOCK_N)
                n_ok = t < lo
                m_i, l_i, acc = _fwd_tile(q, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd,
                                          stride_vs, stride_vd, m_i, l_i, acc, sinks, window, qk_scale,
                                          LOWP, DOT_PREC, True)
        else:  # the gathered list
            lst = LIST + (bkv.to(tl.int64) * n_qb + pid_m) * width
            for j0 in range(0, cnt, BLOCK_N):
                offs_j = j0 + tl.arange(0, BLOCK_N)
                n_ok = offs_j < cnt
                t = tl.load(lst + offs_j, mask=n_ok, other=0)
                m_i, l_i, acc = _fwd_tile(q, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd,
                                          stride_vs, stride_vd, m_i, l_i, acc, sinks, window, qk_scale,
                                          LOWP, DOT_PREC, True)
        # 2) the contiguous band [lo, hi): window and diagonal
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            n_ok = t < hi
            m_i, l_i, acc = _fwd_tile(q, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd,
                                      stride_vs, stride_vd, m_i, l_i, acc, sinks, window, qk_scale,
                                      LOWP, DOT_PREC, False)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        O += b.to(tl.int64) * stride_ob + hq[:, None].to(tl.int64) * stride_oh
        tl.store(O + m64[:, None] * stride_os + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])
        lse = (m_i + tl.log2(l_safe)) / 1.4426950408889634
        tl.store(LSE + (b * Hq + hq).to(tl.int64) * S + offs_m, lse, mask=m_ok)

    @triton.jit
    def _dq_tile(q, do, lse2, delta, dq, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd,
                 stride_vs, stride_vd, sinks, window, qk_scale, LOWP: tl.constexpr, DOT_PREC: tl.constexpr,
                 IS_LIST: tl.constexpr):
        k, v, s, vis = _load_tile_scores(q, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd,
                                         stride_vs, stride_vd, sinks, window, qk_scale, LOWP, DOT_PREC, IS_LIST)
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
        return dq

    @triton.autotune(configs=_configs("BLOCK_N"), key=["BLOCK_M", "BLOCK_Q", "D", "LOWP", "HAS_DLSE"])
    @triton.jit
    def _dq_kernel(Q, K, V, EV, LIST, CNT, O, DO, LSE, DLSE, DELTA, DQ,
                   stride_qb, stride_qh, stride_qs, stride_qd,
                   stride_kb, stride_kh, stride_ks, stride_kd,
                   stride_vb, stride_vh, stride_vs, stride_vd,
                   stride_ob, stride_oh, stride_os, stride_od,
                   stride_dob, stride_doh, stride_dos, stride_dod,
                   stride_dqb, stride_dqh, stride_dqs, stride_dqd,
                   S, Hq, Hkv, G, D: tl.constexpr, sinks, window, n_qb, width, qk_scale, scale,
                   BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, LOWP: tl.constexpr, DOT_PREC: tl.constexpr, HAS_DLSE: tl.constexpr):
        pid_h = tl.program_id(0)
        pid_m = n_qb - 1 - tl.program_id(1)
        n_hg = Hq // (BLOCK_M // BLOCK_Q)
        b = pid_h // n_hg
        hq0 = (pid_h % n_hg) * (BLOCK_M // BLOCK_Q)
        hkv = hq0 // G
        bkv = b * Hkv + hkv
        q0 = pid_m * BLOCK_Q
        r = tl.arange(0, BLOCK_M)
        hq = hq0 + r // BLOCK_Q
        offs_m = q0 + r % BLOCK_Q
        m64 = offs_m.to(tl.int64)  # row offsets in int64: index x stride passes 2**31 on long sequences
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < S
        d_ok = _d_mask(offs_d, D, BLOCK_D)
        md = m_ok[:, None] & d_ok[None, :]
        Q += b.to(tl.int64) * stride_qb + hq[:, None].to(tl.int64) * stride_qh
        O += b.to(tl.int64) * stride_ob + hq[:, None].to(tl.int64) * stride_oh
        DO += b.to(tl.int64) * stride_dob + hq[:, None].to(tl.int64) * stride_doh
        K += b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
        EV += bkv.to(tl.int64) * S
        row = (b * Hq + hq).to(tl.int64) * S  # [BLOCK_M]
        q = tl.load(Q + m64[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=md, other=0.0)
        do = tl.load(DO + m64[:, None] * stride_dos + offs_d[None, :] * stride_dod, mask=md, other=0.0)
        o = tl.load(O + m64[:, None] * stride_os + offs_d[None, :] * stride_od, mask=md, other=0.0)
        # delta = rowsum(dO * O) - dLSE (the lse output's gradient enters as -dLSE)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        if HAS_DLSE:
            delta -= tl.load(DLSE + row + offs_m, mask=m_ok, other=0.0)
        tl.store(DELTA + row + offs_m, delta, mask=m_ok)
        if not LOWP:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2 = tl.load(LSE + row + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo = tl.maximum(q0 - window + 1, 0)
        hi = tl.minimum(q0 + BLOCK_Q, S)
        cnt = tl.load(CNT + bkv * n_qb + pid_m)
        if cnt == lo:  # the whole prefix, contiguous (see the forward)
            for t0 in range(0, lo, BLOCK_N):
                t = t0 + tl.arange(0, BLOCK_N)
                n_ok = t < lo
                dq = _dq_tile(q, do, lse2, delta, dq, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks,
                              stride_kd, stride_vs, stride_vd, sinks, window, qk_scale, LOWP, DOT_PREC, True)
        else:
            lst = LIST + (bkv.to(tl.int64) * n_qb + pid_m) * width
            for j0 in range(0, cnt, BLOCK_N):
                offs_j = j0 + tl.arange(0, BLOCK_N)
                n_ok = offs_j < cnt
                t = tl.load(lst + offs_j, mask=n_ok, other=0)
                dq = _dq_tile(q, do, lse2, delta, dq, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks,
                              stride_kd, stride_vs, stride_vd, sinks, window, qk_scale, LOWP, DOT_PREC, True)
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            n_ok = t < hi
            dq = _dq_tile(q, do, lse2, delta, dq, K, V, EV, t, n_ok, offs_m, offs_d, d_ok, stride_ks, stride_kd,
                          stride_vs, stride_vd, sinks, window, qk_scale, LOWP, DOT_PREC, False)
        dq = dq * scale
        DQ += b.to(tl.int64) * stride_dqb + hq[:, None].to(tl.int64) * stride_dqh
        tl.store(DQ + m64[:, None] * stride_dqs + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
                 mask=md)

    @triton.autotune(configs=_configs("BLOCK_M"), key=["BLOCK_N", "D", "LOWP"])
    @triton.jit
    def _dkdv_kernel(Q, K, V, EV, PERM, QLO, QHI, ORDER, DO, LSE, DELTA, DK, DV,
                     stride_qb, stride_qh, stride_qs, stride_qd,
                     stride_kb, stride_kh, stride_ks, stride_kd,
                     stride_vb, stride_vh, stride_vs, stride_vd,
                     stride_dob, stride_doh, stride_dos, stride_dod,
                     stride_dkb, stride_dkh, stride_dks, stride_dkd,
                     stride_dvb, stride_dvh, stride_dvs, stride_dvd,
                     S, S_pad, Hq, Hkv, G, D: tl.constexpr, sinks, window, n_tiles, qk_scale, scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     LOWP: tl.constexpr, DOT_PREC: tl.constexpr):
        job = tl.load(ORDER + tl.program_id(0))  # (bkv, tile) pairs, the longest first
        bkv = job // n_tiles
        tile = job % n_tiles
        b = bkv // Hkv
        hkv = bkv % Hkv
        t = tl.load(PERM + bkv.to(tl.int64) * S_pad + tile * BLOCK_N + tl.arange(0, BLOCK_N))
        t64 = t.to(tl.int64)  # row offsets in int64: index x stride passes 2**31 on long sequences
        n_ok = t < S
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = _d_mask(offs_d, D, BLOCK_D)
        nd = n_ok[:, None] & d_ok[None, :]
        K += b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
        k = tl.load(K + t64[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=nd, other=0.0)
        v = tl.load(V + t64[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=nd, other=0.0)
        if not LOWP:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        e = _key_end(t, tl.load(EV + bkv.to(tl.int64) * S + t, mask=n_ok, other=0), n_ok, sinks, window)
        e = tl.minimum(e, S)  # rows past the sequence see nothing
        qlo = tl.load(QLO + bkv * n_tiles + tile)
        qhi = tl.load(QHI + bkv * n_tiles + tile)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for g in range(0, G):
            hq = hkv * G + g
            bh = b * Hq + hq
            Qh = Q + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh
            DOh = DO + b.to(tl.int64) * stride_dob + hq.to(tl.int64) * stride_doh
            row = bh.to(tl.int64) * S
            for m0 in range(qlo, qhi, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                m64 = offs_m.to(tl.int64)
                m_ok = offs_m < S
                md = m_ok[:, None] & d_ok[None, :]
                q = tl.load(Qh + m64[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=md, other=0.0)
                do = tl.load(DOh + m64[:, None] * stride_dos + offs_d[None, :] * stride_dod, mask=md, other=0.0)
                if not LOWP:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                lse2 = tl.load(LSE + row + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
                delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
                sT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
                visT = (t[:, None] <= offs_m[None, :]) & (offs_m[None, :] < e[:, None])
                pT = tl.where(visT, tl.exp2(sT - lse2[None, :]), 0.0)
                dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PREC)
                dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
                dsT = pT * (dpT - delta[None, :])
                dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PREC)
        dk = dk * scale
        DK += b.to(tl.int64) * stride_dkb + hkv.to(tl.int64) * stride_dkh
        DV += b.to(tl.int64) * stride_dvb + hkv.to(tl.int64) * stride_dvh
        tl.store(DK + t64[:, None] * stride_dks + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=nd)
        tl.store(DV + t64[:, None] * stride_dvs + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=nd)


def _blocks(D: int, lowp: bool) -> tuple[int, int, int]:
    """(BLOCK_D, rows of a forward/dq program, keys of a dk/dv tile): the tiles that shape the plan.

    GPU tiles for 16-bit inputs up to D = 128 (the Qwen3 case) are FlashAttention's; float32 tiles are
    half as tall, since they take twice the shared memory per element."""
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if interpreting():
        return BLOCK_D, 32, 32
    if lowp and BLOCK_D <= 128:
        return BLOCK_D, 128, 64
    if lowp or BLOCK_D <= 128:
        return BLOCK_D, 64, 32
    return BLOCK_D, 32, 32


def _dot_precision(lowp: bool) -> str:
    # float32 inputs: three TF32 products (about float32 accuracy, on tensor cores); "ieee" compiles
    # for minutes at these tile sizes and overflows shared memory
    return "tf32" if lowp else "tf32x3"


def _query_lists(ev: torch.Tensor, sinks: int, window: int, BLOCK_M: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per (b*Hkv, query block): the gathered key list (int32, ascending) and its length."""
    BKV, S = ev.shape[0] * ev.shape[1], ev.shape[2]
    n_qb = triton.cdiv(S, BLOCK_M)
    cnt = torch.empty((BKV, n_qb), dtype=torch.int32, device=ev.device)
    dummy = torch.empty(1, dtype=torch.int32, device=ev.device)
    BLOCK_T = 256 if interpreting() else 1024
    grid = (n_qb, BKV)
    _list_kernel[grid](ev, dummy, cnt, S, sinks, window, n_qb, 0, BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T, WRITE=False)
    lo = (torch.arange(n_qb, device=ev.device) * BLOCK_M - window + 1).clamp(min=0)
    # full lists (cnt == lo: nothing before the band evicted, e.g. B >= S) are read as [0, lo) directly
    width = max(1, int(torch.where(cnt == lo, 0, cnt).max()))  # one host sync
    lst = torch.empty((BKV, n_qb, width), dtype=torch.int32, device=ev.device)
    _list_kernel[grid](ev, lst, cnt, S, sinks, window, n_qb, width, BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T, WRITE=True)
    return lst, cnt, width


def _key_tiles(ev: torch.Tensor, sinks: int, window: int,
               BLOCK_N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Keys sorted by the end of their query interval inside chunks; per tile its query range."""
    Bsz, Hkv, S = ev.shape
    BKV = Bsz * Hkv
    dev = ev.device
    chunk = min(_DKDV_CHUNK, triton.cdiv(S, BLOCK_N) * BLOCK_N)
    n_chunks = triton.cdiv(S, chunk)
    S_pad = n_chunks * chunk
    t = torch.arange(S_pad, device=dev, dtype=torch.int64)
    e = torch.full((BKV, S_pad), S + 1, dtype=torch.int64, device=dev)  # padding sorts last
    e_real = torch.maximum(t[:S] + window, ev.reshape(BKV, S).to(torch.int64)).clamp(max=S)
    e_real = torch.where(t[:S] < sinks, torch.full_like(e_real, S), e_real)
    e[:, :S] = e_real
    order = torch.argsort(e.view(BKV, n_chunks, chunk), dim=-1, stable=True)
    perm = (order + (torch.arange(n_chunks, device=dev) * chunk).view(1, n_chunks, 1)).view(BKV, S_pad)
    e_sorted = torch.gather(e, 1, perm)
    valid = perm < S
    n_tiles = S_pad // BLOCK_N
    qlo = torch.where(valid, perm, torch.full_like(perm, S)).view(BKV, n_tiles, BLOCK_N).amin(-1)
    qhi = torch.where(valid, e_sorted, torch.zeros_like(e_sorted)).view(BKV, n_tiles, BLOCK_N).amax(-1)
    qhi = torch.maximum(qhi, qlo)
    work = (qhi - qlo).view(-1)
    jobs = torch.argsort(work, descending=True, stable=True).to(torch.int32)
    return (perm.to(torch.int32).contiguous(), qlo.to(torch.int32).contiguous(), qhi.to(torch.int32).contiguous(),
            jobs.contiguous(), n_tiles, S_pad)


def _pack(G: int, BM: int) -> int:
    """Query heads of one KV group per program (a power of 2 dividing G, at most 4, >= 8 queries each)."""
    P = 1
    while P < 4 and G % (2 * P) == 0 and BM // (2 * P) >= (8 if interpreting() else 32):
        P *= 2
    return P


def _lowp(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _triton_forward(q, k, v, ev, sinks, window, scale):
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    lowp = _lowp(q)
    BLOCK_D, BM, _ = _blocks(D, lowp)
    P = _pack(Hq // Hkv, BM)
    BQ = BM // P
    lst, cnt, width = _query_lists(ev, sinks, window, BQ)
    n_qb = triton.cdiv(S, BQ)
    o = empty((Bsz, Hq, S, D), dtype=q.dtype, device=q.device)
    lse = empty((Bsz, Hq, S), dtype=torch.float32, device=q.device)
    grid = (Bsz * Hq // P, n_qb)
    _fwd_kernel[grid](q, k, v, ev, lst, cnt, o, lse,
                      *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                      S, Hq, Hkv, Hq // Hkv, D, sinks, window, n_qb, width, scale * _LOG2E,
                      BLOCK_M=BM, BLOCK_Q=BQ, BLOCK_D=BLOCK_D, LOWP=lowp, DOT_PREC=_dot_precision(lowp))
    return o, lse, lst, cnt, width


def _triton_backward(q, k, v, ev, o, lse, do, dlse, lst, cnt, width, sinks, window, scale):
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    lowp = _lowp(q)
    prec = _dot_precision(lowp)
    BLOCK_D, BM, BN2 = _blocks(D, lowp)
    P = _pack(G, BM)
    BQ = BM // P
    n_qb = triton.cdiv(S, BQ)
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty((Bsz, Hq, S), dtype=torch.float32, device=q.device)
    has_dlse = dlse is not None
    dlse_arg = dlse.float().contiguous() if has_dlse else delta
    _dq_kernel[(Bsz * Hq // P, n_qb)](q, k, v, ev, lst, cnt, o, do, lse, dlse_arg, delta, dq,
                                 *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(),
                                 S, Hq, Hkv, G, D, sinks, window, n_qb, width, scale * _LOG2E, scale,
                                 BLOCK_M=BM, BLOCK_Q=BQ, BLOCK_D=BLOCK_D, LOWP=lowp,
                                 DOT_PREC=prec, HAS_DLSE=has_dlse)
    perm, qlo, qhi, jobs, n_tiles, S_pad = _key_tiles(ev, sinks, window, BN2)
    _dkdv_kernel[(jobs.numel(),)](q, k, v, ev, perm, qlo, qhi, jobs, do, lse, delta, dk, dv,
                                  *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
                                  S, S_pad, Hq, Hkv, G, D, sinks, window, n_tiles, scale * _LOG2E, scale,
                                  BLOCK_N=BN2, BLOCK_D=BLOCK_D, LOWP=lowp, DOT_PREC=prec)
    return dq, dk, dv


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ev, sinks, window, scale):
        o, lse, lst, cnt, width = _triton_forward(q, k, v, ev, sinks, window, scale)
        ctx.save_for_backward(q, k, v, ev, o, lse, lst, cnt)
        ctx.cfg = (width, sinks, window, scale)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, ev, o, lse, lst, cnt = ctx.saved_tensors
        width, sinks, window, scale = ctx.cfg
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = _triton_backward(q, k, v, ev, o, lse, do, dlse, lst, cnt, width, sinks, window, scale)
        return dq, dk, dv, None, None, None, None


# ------------------------------------------------------------------------------ public
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, evict_at: torch.Tensor, *,
                     sinks: int, window: int, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sink + window + top-k masked softmax attention, differentiable in ``q``, ``k``, ``v``.

    Args:
        q: ``[B, Hq, S, D]`` float16/bfloat16/float32 queries (any strides).
        k, v: ``[B, Hkv, S, D]`` keys and values in q's dtype; query head ``h*G + g`` reads KV head ``h``
            (``G = Hq // Hkv``).
        evict_at: integer ``[B, Hkv, S]`` from :func:`kvpop_kernels.eviction_schedule`
            (``NEVER = 2**31 - 1`` for never).
        sinks: ``s >= 0``; window: ``w >= 1``.
        scale: softmax scale, ``D ** -0.5`` by default.

    Key ``t`` is visible to query ``q`` iff ``t <= q and (t < s or t > q - w or q < evict_at[t])``
    (``reference.visible_mask``).  Every query sees itself, so no row is empty.

    Returns:
        ``(out, lse)``: ``out [B, Hq, S, D]`` in q's dtype and the natural-log normaliser
        ``lse [B, Hq, S]`` float32 (also differentiable).  CUDA tensors run Triton kernels, CPU
        tensors the interpreter under ``TRITON_INTERPRET=1`` and a chunked PyTorch path otherwise.
    """
    Bsz, Hq, Hkv, G, S, D, sc = _check(q, k, v, evict_at, sinks, window, scale)
    triton_path = use_triton(q, k, v, evict_at)
    # equivalent, int32-safe parameters: evict_at outside [-1, NEVER] and w > S change nothing
    window = min(window, S + 1)
    sinks = min(sinks, S)
    ev = evict_at.to(torch.int64).clamp(-1, NEVER).to(torch.int32).contiguous()
    if q.numel() == 0:  # S = 0 or B = 0: empty outputs, and empty gradients for q, k and v
        return _torch_sparse_attention(q, k, v, ev, sinks, window, sc)
    if triton_path:
        if D > 256:
            raise ValueError(f"head_dim must be <= 256 on the Triton path, got {D}")
        return _SparseAttention.apply(q, k, v, ev, sinks, window, sc)
    return _torch_sparse_attention(q, k, v, ev, sinks, window, sc)
