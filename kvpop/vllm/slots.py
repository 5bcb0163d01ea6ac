"""The fixed-budget cache of many requests inside a paged KV cache (no vLLM import here).

:func:`decode_step` writes one new token for each of ``N`` requests at once; :func:`extend` runs a prompt
or a later chunk of one request.  The slot layout, why the occupied slots stay ``[0, min(n, B))``, the
side tables and what each operation guarantees: docs/DESIGN.md section 5, "How the vLLM plugin holds
the cache".
"""
from __future__ import annotations

import torch

from kvpop_kernels import eviction_schedule, sparse_attention

__all__ = ["slot_index", "decode_step", "extend", "gather_slots"]

_I32MAX = 2**31 - 1


def slot_index(block_table: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical ``(block, offset)`` of logical ``slots`` (``[N, ...]`` long) of the rows of ``block_table [N, nb]``."""
    n = slots.shape[0]
    blk = block_table.long().gather(1, (slots // block_size).reshape(n, -1)).reshape(slots.shape)
    return blk, slots % block_size


def gather_slots(K: torch.Tensor, V: torch.Tensor, slot_pos: torch.Tensor, slot_prio: torch.Tensor,
                 block_row: torch.Tensor, n_slots: int, block_size: int):
    """Contents of slots ``[0, n_slots)`` of one request: ``K, V [Hkv, n, D]``, ``pos [Hkv, n]``, ``prio [Hkv, n]``."""
    hkv = K.shape[1]
    slots = torch.arange(n_slots, device=K.device)
    blk = block_row.long()[slots // block_size]
    off = slots % block_size
    h = torch.arange(hkv, device=K.device)[:, None]
    return K[blk[None], h, off[None]], V[blk[None], h, off[None]], slot_pos[blk[None], h, off[None]], \
        slot_prio[blk[None], h, off[None]]


@torch.no_grad()
def decode_step(K: torch.Tensor, V: torch.Tensor, slot_pos: torch.Tensor, slot_prio: torch.Tensor,
                block_table: torch.Tensor, pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                p_new: torch.Tensor, *, sinks: int, window: int, budget: int,
                valid: torch.Tensor | None = None) -> None:
    """The eviction step and cache write of one new token for each of ``N`` requests (in place).

    Args:
        K, V: logical views ``[num_blocks, Hkv, bs, D]`` of the paged cache.
        slot_pos, slot_prio: side tables ``[num_blocks, Hkv, bs]`` int32 / float32.
        block_table: ``[N, >= ceil(B / bs)]`` the requests' block-table rows.
        pos: ``[N]`` integer, the new token's position (= tokens the request has seen before it).
        k_new, v_new: ``[N, Hkv, D]`` the new token's key (rotated) and value.
        p_new: ``[N, Hkv]`` float32, the new token's static priority.
        valid: optional ``[N]`` bool; rows marked False (padding of a CUDA-graph batch, whose block-table
            rows may be stale) write into block 0, vLLM's null block, which no request ever owns.

    Per request and head (``kvpop_kernels.reference.fixed_budget_decode``, steps 1-2): when the
    token ``t = pos - w`` leaves the window (``t >= s``) it replaces the long-range slot of lowest
    priority (ties to the oldest position, then the lowest slot index; an empty slot ranks below every
    token) if it ranks above it, else it is dropped; then the new token takes its sink or ring slot.
    Attention is the caller's (a paged kernel over ``min(pos + 1, B)`` slots).  Every write is a
    fixed-shape scatter: a head that keeps nothing rewrites the slot with its own content.
    """
    s, w, B = sinks, window, budget
    k_lr = B - s - w
    bs = K.shape[2]
    N, hkv = p_new.shape
    dev = K.device
    pos = pos.long().clamp(min=0)
    if valid is not None:
        block_table = torch.where(valid[:, None], block_table, torch.zeros_like(block_table))
    heads = torch.arange(hkv, device=dev)[None, :]  # [1, Hkv]
    new_slot = torch.where(pos < s, pos, s + (pos - s).clamp(min=0) % w)  # also the leaving token's slot
    nblk, noff = slot_index(block_table, new_slot, bs)  # [N]
    if k_lr > 0:
        t_leave = pos - w
        lr = s + w + torch.arange(k_lr, device=dev)  # [k]
        lr_blk, lr_off = slot_index(block_table, lr.expand(N, k_lr), bs)  # [N, k]
        lp = slot_prio[lr_blk[:, None, :], heads[..., None], lr_off[:, None, :]]  # [N, Hkv, k]
        lt = slot_pos[lr_blk[:, None, :], heads[..., None], lr_off[:, None, :]].long()
        filled = (lr[None, :] < pos[:, None]).unsqueeze(1)  # slot j holds a token iff j < min(pos, B)
        lp = torch.where(filled, lp, torch.full_like(lp, float("-inf")))
        lt = torch.where(filled, lt, torch.full_like(lt, -1))
        low_p = lp.amin(dim=-1)  # [N, Hkv]
        older = torch.where(lp == low_p[..., None], lt, torch.full_like(lt, _I32MAX))
        low_t, j = older.min(dim=-1)  # first index among equal values: the lowest slot
        ring_p = slot_prio[nblk[:, None], heads, noff[:, None]].nan_to_num(nan=float("-inf"))  # [N, Hkv]
        keep = (t_leave >= s)[:, None] & ((ring_p > low_p) | ((ring_p == low_p) & (low_t < t_leave[:, None])))
        dst_blk = lr_blk.gather(1, j)  # [N, Hkv]
        dst_off = lr_off.gather(1, j)
        src = (nblk[:, None].expand(N, hkv), heads.expand(N, hkv), noff[:, None].expand(N, hkv))
        dst = (dst_blk, heads.expand(N, hkv), dst_off)
        k4 = keep[..., None]
        K[dst] = torch.where(k4, K[src], K[dst])
        V[dst] = torch.where(k4, V[src], V[dst])
        slot_pos[dst] = torch.where(keep, t_leave[:, None].to(slot_pos.dtype), slot_pos[dst])
        slot_prio[dst] = torch.where(keep, ring_p, slot_prio[dst])
    at = (nblk[:, None].expand(N, hkv), heads.expand(N, hkv), noff[:, None].expand(N, hkv))
    K[at] = k_new.to(K.dtype)
    V[at] = v_new.to(V.dtype)
    slot_pos[at] = pos[:, None].expand(N, hkv).to(slot_pos.dtype)
    slot_prio[at] = p_new.float()


@torch.no_grad()
def extend(K: torch.Tensor, V: torch.Tensor, slot_pos: torch.Tensor, slot_prio: torch.Tensor,
           block_row: torch.Tensor, ctx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           p: torch.Tensor, *, sinks: int, window: int, budget: int, scale: float) -> torch.Tensor:
    """Attention of ``L`` new tokens of one request after ``ctx`` cached ones, then their cache write.

    Args:
        K, V, slot_pos, slot_prio: as in :func:`decode_step`.
        block_row: ``[>= ceil(B / bs)]`` the request's block-table row.
        ctx: tokens the request has seen before this chunk (``0`` for a prompt).
        q: ``[L, Hq, D]``; k, v: ``[L, Hkv, D]`` (rotated keys); p: ``[L, Hkv]`` float32 priorities.

    Returns the attention output ``[L, Hq, D]``: the same as ``L`` successive decode steps (and, from
    ``ctx = 0``, as one ``sparse_attention`` forward over the whole sequence with the same priorities).

    The virtual sequence: the ``n = min(ctx, B)`` cached tokens of each head ordered by position
    (sinks, long-range, window), then the chunk.  A token evicted before ``ctx`` never comes back (the
    ``k`` tokens that outranked it are still eligible), so the kept set at every chunk query is the
    top-``k`` of the cached long-range tokens and the tokens that left the window since; and a token's
    virtual index differs from its position by one constant for every window and chunk token, so
    windows and eligibility are the same.  Ties go to the newer token in both orders.
    """
    s, w, B = sinks, window, budget
    k_lr = B - s - w
    bs = K.shape[2]
    L, hkv, d = k.shape
    dev = K.device
    n = min(ctx, B)
    if n:
        ck, cv, cpos, cprio = gather_slots(K, V, slot_pos, slot_prio, block_row, n, bs)
        order = cpos.long().argsort(dim=1)  # per head: sinks, long-range, window
        ck, cv = ck.gather(1, order[..., None].expand(-1, -1, d)), cv.gather(1, order[..., None].expand(-1, -1, d))
        cpos, cprio = cpos.long().gather(1, order), cprio.gather(1, order)
    else:
        ck = cv = k.new_zeros(hkv, 0, d)
        cpos = torch.zeros(hkv, 0, dtype=torch.long, device=dev)
        cprio = torch.zeros(hkv, 0, dtype=torch.float32, device=dev)
    chunk_pos = torch.arange(ctx, ctx + L, device=dev)
    vk = torch.cat([ck.to(k.dtype), k.transpose(0, 1)], dim=1)  # [Hkv, Sv, D]
    vv = torch.cat([cv.to(v.dtype), v.transpose(0, 1)], dim=1)
    vpos = torch.cat([cpos, chunk_pos[None].expand(hkv, L)], dim=1)
    vprio = torch.cat([cprio, p.float().transpose(0, 1)], dim=1).contiguous()
    Sv = n + L
    evict_at = eviction_schedule(vprio[None], sinks=s, window=w, k=k_lr)
    vq = torch.cat([q.new_zeros(n, q.shape[1], q.shape[2]), q], dim=0).transpose(0, 1)[None]  # [1, Hq, Sv, D]
    out, _ = sparse_attention(vq, vk[None].to(q.dtype), vv[None].to(q.dtype), evict_at, sinks=s, window=w,
                              scale=scale)
    # what the schedule keeps at the chunk's last token, per head, as virtual indices into the sequence
    last = Sv - 1
    ev = evict_at[0].long()
    idx = torch.arange(Sv, device=dev)
    sink_v = idx[: min(s, Sv)]
    win_v = idx[max(s, Sv - w):]
    kept_lr = (idx[None] >= s) & (idx[None] <= last - w) & (ev > last)  # [Hkv, Sv]
    n_lr = int(kept_lr[0].sum())  # min(k, |E|), the same for every head
    lr_v = kept_lr.long().argsort(dim=1, descending=True, stable=True)[:, :n_lr]  # in virtual (position) order
    heads = torch.arange(hkv, device=dev)[:, None]
    for vi, slots in ((sink_v[None].expand(hkv, -1), sink_v[None].expand(hkv, -1)),
                      (win_v[None].expand(hkv, -1), None),
                      (lr_v, s + w + torch.arange(n_lr, device=dev)[None].expand(hkv, -1))):
        if vi.shape[1] == 0:
            continue
        tpos = vpos.gather(1, vi)  # real positions [Hkv, m]
        if slots is None:  # ring slots by real position
            slots = s + (tpos - s) % w
        blk = block_row.long()[slots // bs]
        off = slots % bs
        K[blk, heads, off] = vk.gather(1, vi[..., None].expand(-1, -1, d)).to(K.dtype)
        V[blk, heads, off] = vv.gather(1, vi[..., None].expand(-1, -1, d)).to(V.dtype)
        slot_pos[blk, heads, off] = tpos.to(slot_pos.dtype)
        slot_prio[blk, heads, off] = vprio.gather(1, vi)
    return out[0, :, n:].transpose(0, 1)
