"""``paged_mlstm_decode``: one mLSTM decode step per request on states that live in the pages of a paged cache.

The vLLM plugin keeps each request's mLSTM scorer state in ``E`` pages of the layer's KV cache (docs/DESIGN.md
section 5, ``kvpop.vllm.recurrent``): ``pages [num_blocks, P]`` float32 (a view of the cache), row ``n``'s state the
floats ``[0, F)`` of its pages ``table[n, 0..E)`` read one after the other (float ``f`` at page ``table[n, f // P]``,
offset ``f % P``), laid out as ``C [H, d, d]``, ``n [H, d]``, ``m [H]``, the chunk's features ``kf, vf [H, L, d]``,
``ig, log f [H, L]`` (padding: zeros, ``ig = -inf``) and a ring of the last ``w`` pre-RoPE keys ``[H, w, D]``.

One step of row ``n`` (its token at ``pos[n]``, in place of the chunk's row ``j = pos % L``): the new token's
features ``kf, vf [d]``, ``ig, log f`` join the chunk; the read-out of the query ``q [d]`` (the leaving token's)
at row ``j`` is the chunkwise-parallel form's (``MLSTMScorer._chunk`` restricted to one row)::

    F_i = sum_{i' <= i} log f_{i'};   logD_i = F_j - F_i + ig_i (i <= j);   inter = F_j + m
    M = max(inter, max_i logD_i);  s_i = (q . kf_i) exp(logD_i - M);  a = exp(inter - M)
    h = (sum_i s_i vf_i + a C^T q) / max(|sum_i s_i + a q . n|, exp(-M))

and when the chunk completes (``j = L - 1``) the state carries on: ``m' = M``, ``w_i = exp(F_j - F_i + ig_i -
m')``, ``C' = exp(F_j + m - m') C + sum_i w_i kf_i vf_i^T``, ``n'`` likewise, the features emptied.  The new key
goes into ring slot ``pos % w``.  A row at ``pos == 0`` starts from the empty state (nothing read; its whole state
written: ``C = n = 0``, ``m = -inf``, empty features, a zero ring); a row at ``pos < 0`` (a padded row of a
CUDA-graph batch) is skipped: it reads and writes no page, and its read-out is 0.

Triton (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``): grid ``(N, H)``, program ``(n, h)`` walks row
``n``'s block table, loads head ``h``'s ``C``, ``n``, ``m`` and chunk features from the pages, computes ``h`` and
writes back, in the same pages, what changed: the new token's feature row and ring slot, and ``C, n, m`` and the
emptied features when its chunk completes.  No page is copied and nothing is read back to the host (the launch
depends on shapes only: CUDA-graph capturable).  Sums in float32 in the kernel's order (``tl.dot`` with
``input_precision="ieee"`` for ``C'``).  PyTorch path (other CPU tensors): the same arithmetic, vectorised over the
rows, reading each live row's state but the ring and writing it back whole (a fallback: not in place).
"""
from __future__ import annotations

import math

import torch

from ._utils import empty, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["paged_mlstm_decode", "state_offsets", "state_shapes"]


def state_shapes(H: int, d: int, L: int, w: int, D: int) -> list[tuple[int, ...]]:
    """The shapes of ``C, n, m, kf, vf, ig, log f, ring`` in a row's state, in their order: the one layout rule
    of the mLSTM's state in its pages (``kvpop.vllm.recurrent`` reads it from here)."""
    return [(H, d, d), (H, d), (H,), (H, L, d), (H, L, d), (H, L), (H, L), (H, w, D)]


def state_offsets(H: int, d: int, L: int, w: int, D: int) -> list[int]:
    """Where ``C, n, m, kf, vf, ig, log f, ring`` start among a row's state floats, and the end ``F``."""
    out = [0]
    for shape in state_shapes(H, d, L, w, D):
        out.append(out[-1] + math.prod(shape))
    return out


if triton is not None:
    @triton.jit
    def _at(TAB, row, f, P, mask):
        """Offsets into the pages of state floats ``f`` of the row whose block-table row starts at ``TAB + row``."""
        blk = tl.load(TAB + row + f // P, mask=mask, other=0).to(tl.int64)
        return blk * P + f % P

    @triton.jit
    def _mlstm_step(PAGES, TAB, POS, KF, VF, IG, LF, QF, KN, OUT, s_tn, P, H, d, L, w, Dh,
                    BLOCK_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HD: tl.constexpr, BLOCK_W: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        zero = n * 0  # int64: the sizes below in 64 bits (an int argument equal to 1 arrives as a constant)
        H64, d64, L64, w64 = zero + H, zero + d, zero + L, zero + w
        c = tl.arange(0, BLOCK_DIM).to(tl.int64)
        cm = c < d64
        nh = n * H64 + h
        pos = tl.load(POS + n).to(tl.int64)
        if pos < 0:  # a padded row: no page read or written
            tl.store(OUT + nh * d64 + c, tl.zeros([BLOCK_DIM], tl.float32), mask=cm)
        else:
            o_n = H64 * d64 * d64
            o_m = o_n + H64 * d64
            o_kb = o_m + H64
            o_vb = o_kb + H64 * L64 * d64
            o_ib = o_vb + H64 * L64 * d64
            o_lb = o_ib + H64 * L64
            o_ring = o_lb + H64 * L64
            row = n * s_tn
            j = pos % L64
            live = pos > 0  # at position 0 the state starts empty: nothing is read
            i = tl.arange(0, BLOCK_L).to(tl.int64)
            im = i < L64
            sel = i == j
            kf = tl.load(KF + nh * d64 + c, mask=cm, other=0.0)
            vf = tl.load(VF + nh * d64 + c, mask=cm, other=0.0)
            q = tl.load(QF + nh * d64 + c, mask=cm, other=0.0)
            lm = im & ((i * 0 + pos) > 0)  # (a vector mask and a scalar one: the interpreter refuses their "and")
            livec = (c * 0 + pos) > 0
            ib = tl.load(PAGES + _at(TAB, row, o_ib + h * L64 + i, P, lm), mask=lm, other=float("-inf"))
            lb = tl.load(PAGES + _at(TAB, row, o_lb + h * L64 + i, P, lm), mask=lm, other=0.0)
            ib = tl.where(sel, tl.load(IG + nh), ib)
            lb = tl.where(sel, tl.load(LF + nh), lb)
            f_kv = h * L64 * d64 + i[:, None] * d64 + c[None, :]
            m2 = lm[:, None] & cm[None, :]
            kb = tl.load(PAGES + _at(TAB, row, o_kb + f_kv, P, m2), mask=m2, other=0.0)
            vb = tl.load(PAGES + _at(TAB, row, o_vb + f_kv, P, m2), mask=m2, other=0.0)
            kb = tl.where(sel[:, None], kf[None, :], kb)
            vb = tl.where(sel[:, None], vf[None, :], vb)
            f_c = h * d64 * d64 + c[:, None] * d64 + c[None, :]
            mc = cm[:, None] & cm[None, :] & livec[:, None]
            cmat = tl.load(PAGES + _at(TAB, row, f_c, P, mc), mask=mc, other=0.0)
            nv = tl.load(PAGES + _at(TAB, row, o_n + h * d64 + c, P, cm & livec), mask=cm & livec, other=0.0)
            m = tl.load(PAGES + _at(TAB, row, o_m + h, P, live), mask=live, other=float("-inf"))
            # the read-out at row j
            fc = tl.cumsum(lb, axis=0)
            fj = tl.sum(tl.where(sel, fc, 0.0), axis=0)
            logd = tl.where(im & (i <= j), (fj - fc) + ib, float("-inf"))
            inter = fj + m
            ma = tl.maximum(inter, tl.max(logd, axis=0))
            s = tl.sum(kb * q[None, :], axis=1) * tl.exp(logd - ma)
            a = tl.exp(inter - ma)
            num = tl.sum(s[:, None] * vb, axis=0) + a * tl.sum(q[:, None] * cmat, axis=0)
            den = tl.sum(s, axis=0) + a * tl.sum(q * nv, axis=0)
            tl.store(OUT + nh * d64 + c, num / tl.maximum(tl.abs(den), tl.exp(-ma)), mask=cm)
            tl.debug_barrier()  # every load of the state is done before the first write into its pages
            done = j == L64 - 1
            if done | (pos == 0):  # the whole state: carried on (chunk complete) or started empty
                if done:
                    wj = tl.where(im, tl.exp((fj - fc) + ib - ma), 0.0)
                    carry = tl.exp((fj + m) - ma)
                    kw = kb * wj[:, None]
                    cmat = carry * cmat + tl.dot(tl.trans(kw), vb, input_precision="ieee")
                    nv = carry * nv + tl.sum(kw, axis=0)
                    m = ma
                    kb = tl.zeros_like(kb)
                    vb = tl.zeros_like(vb)
                    ib = tl.full([BLOCK_L], float("-inf"), tl.float32)
                    lb = tl.zeros_like(lb)
                mall = cm[:, None] & cm[None, :]
                tl.store(PAGES + _at(TAB, row, f_c, P, mall), cmat, mask=mall)
                tl.store(PAGES + _at(TAB, row, o_n + h * d64 + c, P, cm), nv, mask=cm)
                tl.store(PAGES + _at(TAB, row, o_m + h, P, pos >= 0), m)
                mkv = im[:, None] & cm[None, :]
                tl.store(PAGES + _at(TAB, row, o_kb + f_kv, P, mkv), kb, mask=mkv)
                tl.store(PAGES + _at(TAB, row, o_vb + f_kv, P, mkv), vb, mask=mkv)
                tl.store(PAGES + _at(TAB, row, o_ib + h * L64 + i, P, im), ib, mask=im)
                tl.store(PAGES + _at(TAB, row, o_lb + h * L64 + i, P, im), lb, mask=im)
            else:  # the new token's row of the chunk's features only
                f_j = h * L64 * d64 + j * d64 + c
                tl.store(PAGES + _at(TAB, row, o_kb + f_j, P, cm), kf, mask=cm)
                tl.store(PAGES + _at(TAB, row, o_vb + f_j, P, cm), vf, mask=cm)
                tl.store(PAGES + _at(TAB, row, o_ib + h * L64 + j, P, pos >= 0), tl.load(IG + nh))
                tl.store(PAGES + _at(TAB, row, o_lb + h * L64 + j, P, pos >= 0), tl.load(LF + nh))
            e = tl.arange(0, BLOCK_HD).to(tl.int64)
            em = e < Dh
            kn = tl.load(KN + nh * Dh + e, mask=em, other=0.0)
            ring = o_ring + h * w64 * Dh
            if pos == 0:  # an empty ring but the new key
                for r0 in range(0, w, BLOCK_W):
                    rr = r0 + tl.arange(0, BLOCK_W).to(tl.int64)
                    mr = (rr < w64)[:, None] & em[None, :]
                    val = tl.where((rr == 0)[:, None], kn[None, :], 0.0)
                    tl.store(PAGES + _at(TAB, row, ring + rr[:, None] * Dh + e[None, :], P, mr), val, mask=mr)
            else:
                f_r = ring + (pos % w64) * Dh + e
                tl.store(PAGES + _at(TAB, row, f_r, P, em), kn, mask=em)


def _check(pages, table, pos, kf, vf, ig, lf, q, k_new, window, chunk):
    if pages.dim() != 2 or pages.dtype != torch.float32 or not pages.is_contiguous():
        raise ValueError(f"pages must be a contiguous float32 [num_blocks, P], got {tuple(pages.shape)} "
                         f"{pages.dtype}, strides {pages.stride()}")
    if kf.dim() != 3 or vf.shape != kf.shape or q.shape != kf.shape:
        raise ValueError(f"kf, vf, q must be [N, H, d] of one shape; got {tuple(kf.shape)}, {tuple(vf.shape)}, "
                         f"{tuple(q.shape)}")
    N, H, d = kf.shape
    if ig.shape != (N, H) or lf.shape != (N, H) or pos.shape != (N,):
        raise ValueError(f"ig, log_f must be [N={N}, H={H}] and pos [N]; got {tuple(ig.shape)}, {tuple(lf.shape)}, "
                         f"{tuple(pos.shape)}")
    if k_new.dim() != 3 or k_new.shape[:2] != (N, H):
        raise ValueError(f"k_new must be [N={N}, H={H}, D], got {tuple(k_new.shape)}")
    for name, x in (("kf", kf), ("vf", vf), ("ig", ig), ("log_f", lf), ("q", q), ("k_new", k_new)):
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    for name, x in (("window", window), ("chunk", chunk)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    F = state_offsets(H, d, chunk, window, k_new.shape[2])[-1]
    E = -(-F // pages.shape[1])
    if table.dim() != 2 or table.shape[0] != N or table.shape[1] < E or table.dtype.is_floating_point:
        raise ValueError(f"table must be an integer [N={N}, >= {E}] block table (a state of {F} floats in pages of "
                         f"{pages.shape[1]}), got {tuple(table.shape)} {table.dtype}")


def _torch_step(pages, table, pos, kf, vf, ig, lf, q, k_new, window, chunk):
    """The PyTorch path: the kernel's arithmetic vectorised over ``[N, H]``, each live row's state but the ring
    read and written back whole."""
    N, H, d = kf.shape
    L, w, D = chunk, window, k_new.shape[2]
    o = state_offsets(H, d, L, w, D)
    P = pages.shape[1]
    out = torch.zeros(N, H, d, dtype=torch.float32, device=kf.device)
    rows = (pos >= 0).nonzero().flatten()
    if not rows.numel():
        return out
    f = torch.arange(o[7], device=pages.device)
    base = pages.view(-1)
    addr = table[rows].long()[:, f // P] * P + f % P
    st = base[addr]
    p = pos[rows].long()
    st[p == 0] = torch.cat([torch.zeros(o[2]), torch.full((H,), float("-inf")), torch.zeros(o[5] - o[3]),
                            torch.full((H * L,), float("-inf")), torch.zeros(H * L)]).to(st.device)
    n_ = len(rows)
    cm, nv, m = st[:, :o[1]].view(n_, H, d, d), st[:, o[1]:o[2]].view(n_, H, d), st[:, o[2]:o[3]].view(n_, H)
    kb, vb = st[:, o[3]:o[4]].view(n_, H, L, d), st[:, o[4]:o[5]].view(n_, H, L, d)
    ib, lb = st[:, o[5]:o[6]].view(n_, H, L), st[:, o[6]:o[7]].view(n_, H, L)
    j = p % L
    sel = torch.arange(L, device=st.device)[None, None] == j[:, None, None]
    kb.copy_(torch.where(sel[..., None], kf[rows][:, :, None], kb))
    vb.copy_(torch.where(sel[..., None], vf[rows][:, :, None], vb))
    ib.copy_(torch.where(sel, ig[rows][..., None], ib))
    lb.copy_(torch.where(sel, lf[rows][..., None], lb))
    fc = lb.cumsum(-1)
    fj = fc.gather(2, j[:, None, None].expand(n_, H, 1)).squeeze(2)
    causal = torch.arange(L, device=st.device)[None, None] <= j[:, None, None]
    logd = torch.where(causal, (fj[..., None] - fc) + ib, float("-inf"))
    inter = fj + m
    ma = torch.maximum(inter, logd.amax(-1))
    qq = q[rows]
    s = (kb * qq[:, :, None]).sum(-1) * torch.exp(logd - ma[..., None])
    a = torch.exp(inter - ma)
    num = (s[..., None] * vb).sum(2) + a[..., None] * (qq[..., None] * cm).sum(2)
    den = s.sum(-1) + a * (qq * nv).sum(-1)
    out[rows] = num / torch.maximum(den.abs(), torch.exp(-ma))[..., None]
    done = (j == L - 1)
    if bool(done.any()):
        wj = torch.exp((fj[..., None] - fc) + ib - ma[..., None])
        carry = torch.exp((fj + m) - ma)
        kw = kb * wj[..., None]
        dn = done[:, None]
        cm.copy_(torch.where(dn[..., None, None], carry[..., None, None] * cm + kw.transpose(2, 3) @ vb, cm))
        nv.copy_(torch.where(dn[..., None], carry[..., None] * nv + kw.sum(2), nv))
        m.copy_(torch.where(dn, ma, m))
        kb.masked_fill_(dn[..., None, None], 0.0), vb.masked_fill_(dn[..., None, None], 0.0)
        ib.masked_fill_(dn[..., None], float("-inf")), lb.masked_fill_(dn[..., None], 0.0)
    base[addr] = st
    hd = torch.arange(H, device=st.device)[:, None] * (w * D) + torch.arange(D, device=st.device)
    fr = o[7] + hd[None] + (p % w)[:, None, None] * D  # [n, H, D]
    fresh = p == 0
    if bool(fresh.any()):  # an empty ring
        fz = torch.arange(o[7], o[8], device=st.device)
        base[table[rows[fresh]].long()[:, fz // P] * P + fz % P] = 0.0
    blk = table[rows].long().gather(1, (fr // P).view(n_, -1)).view(n_, H, D)
    base[blk * P + fr % P] = k_new[rows]
    return out


@torch.no_grad()
def paged_mlstm_decode(pages: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, kf: torch.Tensor,
                       vf: torch.Tensor, ig: torch.Tensor, log_f: torch.Tensor, q: torch.Tensor, k_new: torch.Tensor,
                       *, window: int, chunk: int) -> torch.Tensor:
    """One mLSTM decode step of ``N`` rows whose states live in ``pages``; updates them in place and returns the
    read-outs ``h [N, H, d]`` float32 (0 for rows at ``pos < 0``).

    Args:
        pages: ``[num_blocks, P]`` contiguous float32 view of the cache.
        table: ``[N, >= E]`` integer block table, the state pages of row ``n`` its first ``E = ceil(F / P)``
            columns (``F`` the state's floats: :func:`state_offsets`).
        pos: ``[N]`` integer position of each row's new token; ``0`` starts the state empty, ``< 0`` skips the row.
        kf, vf: ``[N, H, d]`` the new token's key and value features; ``ig``, ``log_f``: ``[N, H]`` its input-gate
            pre-activation and log forget gate; ``q``: ``[N, H, d]`` the query read out at ``pos`` (the leaving
            token's); ``k_new``: ``[N, H, D]`` the new pre-RoPE key, stored in ring slot ``pos % window``.  All
            float32.
        window, chunk: the ring's length ``w`` and the chunk length ``L``.
    """
    _check(pages, table, pos, kf, vf, ig, log_f, q, k_new, window, chunk)
    if not use_triton(pages, table, pos, kf):
        return _torch_step(pages, table, pos, kf, vf, ig, log_f, q, k_new, window, chunk)
    N, H, d = kf.shape
    out = empty((N, H, d), dtype=torch.float32, device=kf.device)
    if N == 0:
        return out
    kf, vf, ig, log_f, q, k_new = (x.contiguous() for x in (kf, vf, ig, log_f, q, k_new))
    D = k_new.shape[2]
    _mlstm_step[(N, H)](
        pages, table, pos, kf, vf, ig, log_f, q, k_new, out, table.stride(0), pages.stride(0), H, d, chunk, window,
        D, BLOCK_DIM=max(16, triton.next_power_of_2(d)), BLOCK_L=max(16, triton.next_power_of_2(chunk)),
        BLOCK_HD=max(16, triton.next_power_of_2(D)), BLOCK_W=16, num_warps=8)
    return out
