"""``packed_slot_decode``: one decode query per request over the head-adaptive slots of a paged cache.

The attention of the vLLM plugin's packed layout (``kvpop.vllm.slots.PackedSlots``, docs/DESIGN.md section 5):
KV head ``h`` of a request holds ``B_h`` slots; slot ``j`` has the packed index ``u = offsets[h] + j`` and lives
at page ``table[n, u // (rows * bs)]``, row ``(u // bs) % rows``, offset ``u % bs`` of the cache.  Request ``n``
attends, per KV head, over its ``min(pos[n] + 1, B_h)`` occupied slots ``[0, min(pos + 1, B_h))``.

The slots are read through any strides (``k [num_blocks, rows, bs, D]`` views of vLLM's page), either as the
model's floats or as 8-bit codes (``int8``, or float8 e4m3fn) with one float32 scale per slot (``k_scale
[num_blocks, rows, bs]``, e.g. the per-token-head page's scale bytes), **dequantised on load** inside the
kernel: a key or value is ``code * scale``, as ``kvpop_kernels.layout.dequantize`` reads it.

Triton (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``): grid ``(N, Hkv)``; program ``(n, h)`` reads
``pos[n]`` on the device and walks its own head's occupied slots in tiles of ``BLOCK_N`` (a head costs its own
budget, not the largest), the group's ``G`` query heads as one ``[G_PAD, D]`` tile, online softmax in float32
(``tl.dot`` with ``input_precision="ieee"``).  No value goes back to the host: the launch depends on shapes only
(CUDA-graph capturable).  PyTorch path (other CPU tensors): the same arithmetic, vectorised (``_torch_decode``).
Reads only.
"""
from __future__ import annotations

import torch

from ._utils import use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["packed_slot_decode"]

_CODES = (torch.int8, torch.uint8) + ((torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ())

if triton is not None:
    @triton.jit
    def _slot_decode(Q, K, V, KS, VS, TAB, POS, BUD, OFF, OUT,
                     s_qn, s_qh, s_kb, s_kr, s_ko, s_kd, s_vb, s_vr, s_vo, s_vd,
                     s_ksb, s_ksr, s_kso, s_vsb, s_vsr, s_vso, s_tn, s_on, s_oh,
                     rows, bs, b_max, qk_scale,
                     G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_N: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, BLOCK_D)
        gm = g < G
        dm = d < D
        q = tl.load(Q + n * s_qn + (h * G + g)[:, None].to(tl.int64) * s_qh + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        pos = tl.load(POS + n).to(tl.int64)
        budget = tl.load(BUD + h).to(tl.int64)
        base = tl.load(OFF + h).to(tl.int64)
        n_slots = tl.minimum(pos + 1, budget)
        per_page = rows * bs
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
        for j0 in range(0, b_max, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N).to(tl.int64)
            jm = j < n_slots
            u = base + j
            page = u // per_page
            r = (u // bs) % rows
            o = u % bs
            blk = tl.load(TAB + n * s_tn + page, mask=jm, other=0).to(tl.int64)
            m2 = jm[:, None] & dm[None, :]
            kc = tl.load(K + blk[:, None] * s_kb + r[:, None] * s_kr + o[:, None] * s_ko + d[None, :] * s_kd,
                         mask=m2, other=0)
            vc = tl.load(V + blk[:, None] * s_vb + r[:, None] * s_vr + o[:, None] * s_vo + d[None, :] * s_vd,
                         mask=m2, other=0)
            if FP8:  # bytes of float8 e4m3fn
                kc = kc.to(tl.float8e4nv, bitcast=True)
                vc = vc.to(tl.float8e4nv, bitcast=True)
            k = kc.to(tl.float32)
            v = vc.to(tl.float32)
            if QUANT:  # dequantise on load: code * the slot's scale
                ks = tl.load(KS + blk * s_ksb + r * s_ksr + o * s_kso, mask=jm, other=0.0)
                vs = tl.load(VS + blk * s_vsb + r * s_vsr + o * s_vso, mask=jm, other=0.0)
                k = k * ks[:, None]
                v = v * vs[:, None]
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [G_PAD, BLOCK_N]
            s = tl.where(jm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(OUT + n * s_on + (h * G + g)[:, None].to(tl.int64) * s_oh + d[None, :], out,
                 mask=gm[:, None] & dm[None, :])


def _check(q, k, v, k_scale, v_scale, table, pos, budgets, offsets, rows, block_size):
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"packed_slot_decode wants q [N, Hq, D] and k, v [num_blocks, rows, bs, D] of one shape; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    N, hq, D = q.shape
    hkv = budgets.numel()
    if k.shape[1:] != (rows, block_size, D):
        raise ValueError(f"k's page must be [rows={rows}, bs={block_size}, D={D}], got {tuple(k.shape[1:])}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads (budgets)")
    if offsets.shape != budgets.shape or table.dim() != 2 or table.shape[0] != N or pos.shape != (N,):
        raise ValueError(f"budgets/offsets [Hkv], table [N, W], pos [N] with N={N}; got budgets "
                         f"{tuple(budgets.shape)}, offsets {tuple(offsets.shape)}, table {tuple(table.shape)}, pos "
                         f"{tuple(pos.shape)}")
    quant = k.dtype in _CODES
    if quant != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"8-bit codes ({list(_CODES)}) need k_scale and v_scale [num_blocks, rows, bs] float32, "
                         f"float slots none; got k {k.dtype}, k_scale {None if k_scale is None else k_scale.dtype}")
    if quant and (k_scale.shape != k.shape[:3] or v_scale.shape != k.shape[:3]
                  or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32):
        raise ValueError(f"k_scale / v_scale must be float32 {tuple(k.shape[:3])}, got {tuple(k_scale.shape)} "
                         f"{k_scale.dtype} / {tuple(v_scale.shape)} {v_scale.dtype}")
    if not q.is_floating_point():
        raise TypeError(f"q must be floating point, got {q.dtype}")
    return quant


def _torch_decode(q, k, v, k_scale, v_scale, table, pos, budgets, offsets, rows, bs, scale):
    N, hq, D = q.shape
    hkv = budgets.numel()
    b = budgets.long()
    j = torch.arange(int(b.max()), device=q.device)
    u = offsets.long()[:, None] + torch.minimum(j[None], b[:, None] - 1)  # [Hkv, Bmax]
    blk = table.long().gather(1, (u // (rows * bs)).reshape(1, -1).expand(N, -1)).view(N, hkv, -1)
    r, o = ((u // bs) % rows)[None].expand(N, -1, -1), (u % bs)[None].expand(N, -1, -1)

    def load(x, s):
        c = x[blk, r, o]
        c = c.view(torch.float8_e4m3fn) if c.dtype == torch.uint8 else c
        x = c.float() if s is None else c.float() * s[blk, r, o][..., None]
        return x.nan_to_num_(0.0, 0.0, 0.0)  # a stale slot past min(pos + 1, B_h) may hold any bytes: never attended

    kk, vv = load(k, k_scale), load(v, v_scale)
    n = torch.minimum(pos.long()[:, None] + 1, b[None])
    seen = j[None, None] < n[..., None]
    logits = torch.einsum("nhgd,nhjd->nhgj", q.float().view(N, hkv, hq // hkv, D), kk) * scale
    logits = logits.masked_fill(~seen[:, :, None], float("-inf"))
    return torch.einsum("nhgj,nhjd->nhgd", torch.softmax(logits, dim=-1), vv).reshape(N, hq, D)


@torch.no_grad()
def packed_slot_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, pos: torch.Tensor,
                       budgets: torch.Tensor, offsets: torch.Tensor, *, rows: int, block_size: int, scale: float,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                       max_budget: int | None = None, block_n: int = 32) -> torch.Tensor:
    """Attention ``[N, Hq, D]`` (float32) of ``q [N, Hq, D]`` over each KV head's ``min(pos + 1, B_h)`` slots.

    Args:
        q: one query per request and query head (``Hq`` a multiple of ``Hkv``; head ``h`` serves queries
            ``[h G, (h + 1) G)``).
        k, v: ``[num_blocks, rows, block_size, D]`` views of the cache (any strides): floats, or 8-bit codes
            (``torch.int8``; ``torch.uint8`` holding float8 e4m3fn bytes; ``torch.float8_e4m3fn``).
        table: ``[N, W]`` integer block table; ``pos``: ``[N]`` the position of each request's new token (the
            slots ``[0, min(pos + 1, B_h))`` are occupied; ``pos >= 0``).
        budgets, offsets: ``[Hkv]`` integer tensors, ``B_h`` and the packed index of each head's slot 0.
        rows, block_size: the page's rows and slots per row.
        k_scale, v_scale: ``[num_blocks, rows, block_size]`` float32 scales, required with 8-bit codes.
        max_budget: ``max(budgets)`` (read from ``budgets`` when not given: a host read on a GPU).
    """
    quant = _check(q, k, v, k_scale, v_scale, table, pos, budgets, offsets, rows, block_size)
    if not use_triton(q, k, v, table, pos):
        return _torch_decode(q, k, v, k_scale, v_scale, table, pos, budgets, offsets, rows, block_size, scale)
    N, hq, D = q.shape
    hkv = budgets.numel()
    G = hq // hkv
    out = torch.empty(N, hq, D, dtype=torch.float32, device=q.device)
    if N == 0:
        return out
    fp8 = k.dtype in (torch.uint8,) + ((torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ())
    kx, vx = (k.view(torch.uint8), v.view(torch.uint8)) if fp8 else (k, v)
    ks = k_scale if quant else out
    vs = v_scale if quant else out
    sks = k_scale.stride() if quant else (0, 0, 0)
    svs = v_scale.stride() if quant else (0, 0, 0)
    b_max = int(budgets.max()) if max_budget is None else int(max_budget)
    q = q.contiguous()
    _slot_decode[(N, hkv)](
        q, kx, vx, ks, vs, table, pos, budgets, offsets, out,
        q.stride(0), q.stride(1), *kx.stride(), *vx.stride(), *sks, *svs, table.stride(0), out.stride(0),
        out.stride(1), rows, block_size, b_max, float(scale),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_N=block_n, QUANT=quant, FP8=fp8)
    return out
