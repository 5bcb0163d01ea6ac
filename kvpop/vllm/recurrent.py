"""The mLSTM scorer's state per request inside the paged cache, and its priorities (no vLLM import here).

A request served with the mLSTM scorer holds, per layer, ``state_blocks`` pages of its layer's KV cache in
front of its slots (block-table columns ``[0, E)``; its slots start at column ``E``), read as float32:

* ``C [Hkv, d, d]``, ``n [Hkv, d]``, ``m [Hkv]``: the mLSTM state at the start of the 128-token chunk that the
  request's next token falls in;
* ``kf, vf [Hkv, L, d]``, ``ig, log f [Hkv, L]``: that chunk's features so far (padding: zeros, ``ig = -inf``);
* ``ring [Hkv, w, D]``: the pre-RoPE keys of the last ``w`` tokens (token ``t`` at ``t % w``), float32.

That is :meth:`kvpop.core.scorers.MLSTMScorer.decode_state` plus ``ScorerHooks``' ring, the transformers
cache's own state.  :func:`extend_priorities` (a prompt, or a later chunk, of one request) and
:func:`decode_priorities` (one token per request, fixed shapes, no host read) give the priority of every
token when it leaves the window, from its read-out at ``t + w`` through the training's chunk function
(``MLSTMScorer._chunk``) on the 128-token chunk that ``t + w`` falls in, so it has the bits of
``ScorerHooks.prompt`` and ``ScorerHooks.leaving`` in transformers whatever vLLM's chunk boundaries are.  The
backends decode with the state left in its pages: :func:`decode_priorities_in_pages` (CPU, PyTorch, the bits of
:func:`decode_priorities`; writes in place) and :func:`decode_priorities_kernel` (GPU, the Triton kernel
``kvpop_kernels.mlstm_decode``; reads and writes in place, padded rows skipped).
docs/DESIGN.md section 5, "How the vLLM plugin holds the cache".
"""
from __future__ import annotations

import math

import torch

from kvpop.core.priority import priority
from kvpop.core.scorers import MLSTMScorer, scorer_features
from kvpop_kernels.mlstm_decode import state_shapes

__all__ = ["state_floats", "state_blocks", "unpack", "reset", "extend_priorities", "decode_priorities",
           "decode_priorities_in_pages", "decode_priorities_kernel"]


def _shapes(sc: MLSTMScorer) -> list[tuple[int, ...]]:
    return state_shapes(sc.num_kv_heads, sc.dim, sc.chunk, sc.window, sc.head_dim)


_FILL = (0.0, 0.0, float("-inf"), 0.0, 0.0, float("-inf"), 0.0, 0.0)
"""An empty state: ``C = n = 0``, ``m = -inf``, no features (``ig = -inf``), an empty ring."""


def state_floats(sc: MLSTMScorer) -> int:
    """Float32 values of one request's state in one layer (``MLSTMScorer.state_floats``: the parts above)."""
    return sc.state_floats()


def state_blocks(sc: MLSTMScorer, page_bytes: int) -> int:
    """Pages of ``page_bytes`` (one block of one layer's KV cache) that hold one request's state."""
    if page_bytes <= 0 or page_bytes % 4:
        raise ValueError(f"a KV-cache page of {page_bytes} bytes cannot hold float32 state")
    return -(-4 * state_floats(sc) // page_bytes)


def offsets(sc: MLSTMScorer) -> list[int]:
    """Where each part of the state starts among its floats: ``C, n, m, kf, vf, ig, log f, ring`` and the end."""
    out = [0]
    for s in _shapes(sc):
        out.append(out[-1] + math.prod(s))
    return out


def unpack(sc: MLSTMScorer, flat: torch.Tensor, parts: int = 8) -> list[torch.Tensor]:
    """Views ``(C, n, m, kf, vf, ig, log f, ring)``, each ``[N, ...]``, of the states ``flat [N, >= F]`` float32
    (rows may be longer than :func:`state_floats`: whole pages); the first ``parts`` of them only (then ``flat``
    needs only their floats)."""
    out, a = [], 0
    N = flat.shape[0]
    for s in _shapes(sc)[:parts]:
        b = a + math.prod(s)
        out.append(flat[:, a:b].view(N, *s))
        a = b
    return out


def reset(sc: MLSTMScorer, flat: torch.Tensor, fresh: torch.Tensor | None = None) -> None:
    """Empty the states ``flat [N, >= F]`` in place (the rows where ``fresh [N]`` is True; all by default),
    without a host read."""
    _fill(unpack(sc, flat), fresh)


def _fill(views: list[torch.Tensor], fresh: torch.Tensor | None) -> None:
    for view, fill in zip(views, _FILL):
        if fresh is None:
            view.fill_(fill)
        else:
            sel = fresh.view(-1, *([1] * (view.dim() - 1)))
            view.copy_(torch.where(sel, torch.full_like(view, fill), view))


@torch.no_grad()
def decode_priorities(sc: MLSTMScorer, log_gamma: torch.Tensor, flat: torch.Tensor, pos: torch.Tensor,
                      k_new: torch.Tensor, v_new: torch.Tensor, v_leave: torch.Tensor) -> torch.Tensor:
    """One decode step of ``N`` requests: absorb the token at ``pos [N]`` (pre-RoPE key ``k_new`` and value
    ``v_new``, ``[N, Hkv, D]``) into the states ``flat [N, >= F]`` (in place; a row at ``pos == 0`` starts
    empty), then the priority ``[N, Hkv]`` of the token ``t = pos - w`` leaving the window (its value
    ``v_leave [N, Hkv, D]``, read from its window slot; its key from the ring).  ``ScorerHooks.leaving``'s
    computation; fixed shapes, no host read.  Rows with ``pos < w`` get a priority nobody reads."""
    w = sc.window
    N, H, D = k_new.shape
    pos = pos.long()
    reset(sc, flat, pos == 0)
    *state, ring = unpack(sc, flat)
    t = (pos - w).clamp_min(0)
    k_t = ring.gather(2, (t % w)[:, None, None, None].expand(N, H, 1, D)).squeeze(2)
    r = sc.decode_leaving(tuple(state), k_new, v_new, pos, k_t.to(k_new.dtype), v_leave)
    ring.scatter_(2, (pos % w)[:, None, None, None].expand(N, H, 1, D), k_new.float().unsqueeze(2))
    return priority(r, t, log_gamma)


def _addresses(pages: torch.Tensor, blocks: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Indices into ``pages.view(-1)`` (``pages [num_blocks, P]``) of the state floats ``f`` (``[M]``, the same for
    every row, or ``[N, M]``) of the rows whose state pages are ``blocks [N, E]``: ``[N, M]``."""
    P = pages.shape[1]
    f = f.long()
    blk = blocks.long()[:, f // P] if f.dim() == 1 else blocks.long().gather(1, f // P)
    return blk * P + f % P


def _ring_addresses(sc: MLSTMScorer, pages: torch.Tensor, blocks: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Indices ``[N, Hkv, D]`` into ``pages.view(-1)`` of ring slot ``slot [N]`` (every head) of each row."""
    H, w, D = sc.num_kv_heads, sc.window, sc.head_dim
    hd = torch.arange(H, device=pages.device)[:, None] * (w * D) + torch.arange(D, device=pages.device)
    f = offsets(sc)[7] + hd[None] + (slot.long() % w)[:, None, None] * D
    return _addresses(pages, blocks, f.view(slot.shape[0], -1)).view(-1, H, D)


def _check_pages(sc: MLSTMScorer, pages: torch.Tensor, blocks: torch.Tensor, k_new: torch.Tensor) -> None:
    if pages.dim() != 2 or pages.dtype != torch.float32 or not pages.is_contiguous():
        raise ValueError(f"pages must be a contiguous float32 [num_blocks, page floats] view of the KV cache; got "
                         f"{tuple(pages.shape)} {pages.dtype}, strides {pages.stride()}")
    E = -(-state_floats(sc) // pages.shape[1])
    if blocks.dim() != 2 or blocks.shape != (k_new.shape[0], E):
        raise ValueError(f"blocks must be [N={k_new.shape[0]}, E={E}] (the state pages of each row), got "
                         f"{tuple(blocks.shape)}")


@torch.no_grad()
def decode_priorities_in_pages(sc: MLSTMScorer, log_gamma: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor,
                               pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                               v_leave: torch.Tensor) -> torch.Tensor:
    """:func:`decode_priorities` on states that stay in their pages (``pages [num_blocks, P]`` float32, row ``i``'s
    state in pages ``blocks [N, E]``), the CPU backend's decode: the same bits, without copying the state out and
    back.  PyTorch cannot view floats spread over arbitrary pages as one tensor, so what the step computes with is
    read once: the pages holding ``C, n, m`` and the chunk's features (the state but the ring: 11 of 27 pages at
    Qwen3-8B's shapes; whole pages, the cheapest read of them on a CPU) and of the ring only the leaving token's
    key (``D`` floats per head).  The writes go in place into ``pages`` (``index_put_``), only what changed: the
    new token's row of the chunk's features and its ring slot, and, for the rows whose chunk completes at this
    step (or that start at position 0), ``C, n, m`` and the emptied features (their pages written back whole).
    Host reads (which rows complete): eager CPU use; the GPU backend takes :func:`decode_priorities_kernel`."""
    _check_pages(sc, pages, blocks, k_new)
    w, L, d = sc.window, sc.chunk, sc.dim
    N, H, D = k_new.shape
    o = offsets(sc)
    flat_pages, dev, pos, P = pages.view(-1), pages.device, pos.long(), pages.shape[1]
    head_pages = blocks[:, : -(-o[7] // P)].long()
    buf = pages[head_pages].view(N, -1)  # the one read of the state: its pages but the ring's own
    head = buf[:, : o[7]]
    fresh = pos == 0
    t = (pos - w).clamp_min(0)
    k_t = flat_pages[_ring_addresses(sc, pages, blocks, t)]
    if bool(fresh.any()):  # start empty (a new request, or a preempted one recomputed)
        _fill(unpack(sc, head, 7), fresh)
        k_t = torch.where(fresh[:, None, None], torch.zeros_like(k_t), k_t)
        flat_pages[_addresses(pages, blocks[fresh], torch.arange(o[7], o[8], device=dev))] = 0.0
        buf[fresh, o[7]:] = 0.0  # the ring's start in the last page read (written back below)
    r = sc.decode_leaving(tuple(unpack(sc, head, 7)), k_new, v_new, pos, k_t.to(k_new.dtype), v_leave)
    whole = (pos % L == L - 1) | fresh
    part = (~whole).nonzero().flatten()
    if part.numel():  # the new token's row j of kf, vf [Hkv, L, d] and ig, log f [Hkv, L]
        j = (pos[part] % L)[:, None, None]
        hs = torch.arange(H, device=dev)[None, :, None]
        kv = hs * (L * d) + j * d + torch.arange(d, device=dev)
        g = hs * L + j
        f = torch.cat([o[3] + kv, o[4] + kv, o[5] + g, o[6] + g], dim=2).view(part.numel(), -1)
        flat_pages[_addresses(pages, blocks[part], f)] = head[part].gather(1, f)
    if bool(whole.any()):  # before the ring slot: the last of these pages may hold the ring's start
        pages[head_pages[whole].reshape(-1)] = buf[whole].reshape(-1, P)  # rows x pages, one page a row
    flat_pages[_ring_addresses(sc, pages, blocks, pos)] = k_new.float()
    return priority(r, t, log_gamma)


@torch.no_grad()
def decode_priorities_kernel(sc: MLSTMScorer, log_gamma: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor,
                             pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, v_leave: torch.Tensor,
                             valid: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_priorities_in_pages` through ``kvpop_kernels.mlstm_decode.paged_mlstm_decode``, the GPU
    backend's decode: fixed shapes, no host read (CUDA-graph capturable).  The features of the new token and of
    the leaving one (its key read from its ring slot in the page) and the output MLP run here; the kernel walks the
    block table and reads and writes the state in its pages (in place).  Rows not ``valid`` (padded rows of a
    graph batch) are skipped by the kernel: they write nowhere; their priorities are garbage nobody reads.  The
    read-out's float32 sums run in the kernel's order: priorities within ~1e-5 of :func:`decode_priorities`'s,
    not its bits."""
    from kvpop_kernels.mlstm_decode import paged_mlstm_decode

    _check_pages(sc, pages, blocks, k_new)
    w = sc.window
    pos = pos.long()
    t = (pos - w).clamp_min(0)
    k_t = pages.view(-1)[_ring_addresses(sc, pages, blocks, t)]
    k_t = torch.where((pos == 0)[:, None, None], torch.zeros_like(k_t), k_t)
    x_t = scorer_features(k_t.to(k_new.dtype), v_leave)
    _, kf, vf, ig, lf = sc._proj(scorer_features(k_new, v_new))
    h_t = paged_mlstm_decode(pages, blocks, pos if valid is None else torch.where(valid, pos, -1), kf, vf, ig, lf,
                             sc._proj(x_t)[0], k_new.float(), window=w, chunk=sc.chunk)
    return priority(sc.out(torch.cat([x_t, h_t], dim=-1)), t, log_gamma)


@torch.no_grad()
def extend_priorities(sc: MLSTMScorer, log_gamma: torch.Tensor, flat: torch.Tensor, ctx: int, k_pre: torch.Tensor,
                      v: torch.Tensor, v_window: torch.Tensor) -> torch.Tensor:
    """A prompt (``ctx = 0``: the state starts empty) or a later chunk of one request: ``k_pre, v [n, Hkv, D]``
    the chunk's pre-RoPE keys and values at positions ``[ctx, ctx + n)``, ``v_window [Hkv, min(w, ctx), D]``
    the values of the tokens ``[ctx - min(w, ctx), ctx)`` (those in the window).  Updates the state
    ``flat [1, >= F]`` in place to the chunk's end and returns the priorities ``[Hkv, m]`` of the tokens
    ``t in [max(0, ctx - w), ctx + n - w)``: those whose read-out ``t + w`` lies in this chunk, which leave the
    window within it (host-side sizes: runs eagerly)."""
    w, L = sc.window, sc.chunk
    n, H, D = k_pre.shape
    dev = k_pre.device
    if ctx == 0:
        reset(sc, flat)
    C, nn, m, kb, vb, ib, lb, ring = unpack(sc, flat)
    nw = min(w, ctx)
    x_new = scorer_features(k_pre.transpose(0, 1)[None], v.transpose(0, 1)[None])  # [1, H, n, 2D]
    _, kf, vf, ig, lf = sc._proj(x_new)
    tw = torch.arange(ctx - nw, ctx, device=dev)
    x_win = scorer_features(ring[:, :, tw % w], v_window[None].float())  # [1, H, nw, 2D]
    # the tokens whose read-outs fall in this chunk: t = a - w for a in [ctx, ctx + n), t >= 0
    lo = max(0, ctx - w)
    x_t = torch.cat([x_win, x_new], dim=2)[:, :, : max(0, ctx + n - w - lo)]  # lo = ctx - nw
    m_t = x_t.shape[2]
    q_t = sc._proj(x_t)[0] if m_t else x_t.new_zeros(1, H, 0, sc.dim)
    a0 = lo + w  # the first read-out position with a token to score
    c0 = (ctx // L) * L
    h_out = []
    for cs in range(c0, ctx + n, L):
        ce = cs + L
        # the buffer holds [c0, ctx) and padding (emptied when its chunk completes)
        ks, vs, is_, ls = kb.clone(), vb.clone(), ib.clone(), lb.clone()
        f0, f1 = max(cs, ctx), min(ce, ctx + n)  # this chunk's rows of the new tokens
        ks[:, :, f0 - cs: f1 - cs] = kf[:, :, f0 - ctx: f1 - ctx]
        vs[:, :, f0 - cs: f1 - cs] = vf[:, :, f0 - ctx: f1 - ctx]
        is_[:, :, f0 - cs: f1 - cs] = ig[:, :, f0 - ctx: f1 - ctx]
        ls[:, :, f0 - cs: f1 - cs] = lf[:, :, f0 - ctx: f1 - ctx]
        q = torch.zeros_like(ks)
        r0 = max(f0, a0)  # read-outs wanted in this chunk: [r0, f1)
        if r0 < f1:
            q[:, :, r0 - cs: f1 - cs] = q_t[:, :, r0 - a0: f1 - a0]
        h, (C2, n2, m2) = sc._chunk(q, ks, vs, is_, ls, C, nn, m)
        if r0 < f1:
            h_out.append(h[:, :, r0 - cs: f1 - cs])
        if ce <= ctx + n:  # a completed chunk carries the state on, as training does
            C.copy_(C2), nn.copy_(n2), m.copy_(m2)
            kb.zero_(), vb.zero_(), ib.fill_(float("-inf")), lb.zero_()
        else:
            kb.copy_(ks), vb.copy_(vs), ib.copy_(is_), lb.copy_(ls)
    t_new = torch.arange(max(ctx, ctx + n - w), ctx + n, device=dev)
    ring[:, :, t_new % w] = k_pre[t_new - ctx].transpose(0, 1)[None].float()
    if not m_t:
        return torch.zeros(H, 0, device=dev)
    r = sc.out(torch.cat([x_t, torch.cat(h_out, dim=2)], dim=-1))  # [1, H, m_t]
    return priority(r, torch.arange(lo, lo + m_t, device=dev), log_gamma)[0]
