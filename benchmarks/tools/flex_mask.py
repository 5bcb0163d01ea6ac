"""FlexAttention's ``BlockMask`` of kvpop's training mask, built straight from the eviction schedule.

``create_block_mask`` finds the blocks by evaluating (or compiling) the mask function over every ``(q, kv)`` pair:
at S = 16K on the first GPU run (2026-12-04) that took 184 s of the GPU check's 308 s benchmark stage.  The
mask's blocks follow from per-block extrema of ``evict_at`` instead, in ``O((S / block)^2)`` work: query ``q``
sees key ``kv <= q`` when ``kv < sinks``, ``kv > q - window`` or ``q < evict_at[kv]`` (docs/DESIGN.md section 2).
A block is *full* when one of the three holds for every pair in it, *empty* when none can hold for any pair (or
it lies above the diagonal), and *partial* otherwise; partial blocks run the mask function, so a block classed
partial that is in fact full or empty costs time, never correctness."""
from __future__ import annotations

import torch


def block_classes(ev: torch.Tensor, *, sinks: int, window: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``, each bool ``[B, Hkv, n, n]`` (query block, key block), ``n = S / block``, from
    ``ev [B, Hkv, S]`` (``eviction_schedule``'s ``evict_at``; ``S`` a multiple of ``block``)."""
    if ev.dim() != 3:
        raise ValueError(f"ev must be [B, Hkv, S], got shape {tuple(ev.shape)}")
    B, H, S = ev.shape
    if S % block:
        raise ValueError(f"S={S} must be a multiple of block={block}")
    n = S // block
    e = ev.long().view(B, H, n, block)
    e_min, e_max = e.amin(-1)[:, :, None, :], e.amax(-1)[:, :, None, :]  # per key block, broadcast over queries
    idx = torch.arange(n, device=ev.device)
    i, j = idx[:, None], idx[None, :]
    q_lo, q_hi, kv_lo, kv_hi = i * block, i * block + block - 1, j * block, j * block + block - 1
    below = j < i
    full = below & ((kv_hi < sinks) | (kv_lo > q_hi - window) | (e_min > q_hi))
    empty = (j > i) | (below & (kv_lo >= sinks) & (kv_hi <= q_lo - window) & (e_max <= q_lo))
    return ~full & ~empty, full  # both [B, Hkv, n, n]: e_min and e_max carry the batch and head


def eviction_block_mask(ev: torch.Tensor, mask_mod, *, sinks: int, window: int, hq: int, block: int = 128):
    """The ``BlockMask`` of ``mask_mod`` (kvpop's mask over ``ev``) for ``hq`` query heads (GQA: each KV head's
    blocks repeated over its group), from :func:`block_classes`."""
    from torch.nn.attention.flex_attention import BlockMask

    B, H, S = ev.shape
    if hq % H:
        raise ValueError(f"hq={hq} must be a multiple of the {H} KV heads")
    partial, full = (x.repeat_interleave(hq // H, dim=1) for x in block_classes(ev, sinks=sinks, window=window,
                                                                              block=block))

    def listed(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.sort(m.to(torch.int8), dim=-1, descending=True, stable=True).indices  # the marked first
        return m.sum(-1).to(torch.int32), order.to(torch.int32)

    (kn, ki), (fn, fi) = listed(partial), listed(full)
    return BlockMask.from_kv_blocks(kn.contiguous(), ki.contiguous(), fn.contiguous(), fi.contiguous(),
                                    BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(S, S))
