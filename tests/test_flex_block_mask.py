"""``benchmarks/tools/flex_mask.py``: the FlexAttention block mask the sparse-attention benchmark builds from the
eviction schedule (instead of ``create_block_mask``'s pass over every pair, 184 s at S = 16K on the GPU).
Checked against the dense mask of the definition on odd schedules: every visible pair lies in a partial or full
block, every full block is visible throughout, and the empty blocks hold no visible pair."""
import pytest
import torch

from benchmarks.tools.flex_mask import block_classes, eviction_block_mask
from kvpop_kernels import eviction_schedule


def _dense(ev, sinks, window):
    S = ev.shape[-1]
    q = torch.arange(S)[:, None]
    kv = torch.arange(S)[None, :]
    e = ev.long()[:, :, None, :]
    return (kv <= q) & ((kv < sinks) | (kv > q - window) | (q < e))


@pytest.mark.parametrize("S,block,sinks,window,k,seed", [(256, 32, 4, 80, 30, 0), (384, 64, 1, 7, 100, 1),
                                                          (256, 16, 0, 1, 3, 2), (128, 32, 4, 256, 8, 3)])
def test_blocks_match_the_dense_mask(S, block, sinks, window, k, seed):
    g = torch.Generator().manual_seed(seed)
    ev = eviction_schedule(torch.randn(2, 3, S, generator=g), sinks=sinks, window=window, k=k)
    partial, full = block_classes(ev, sinks=sinks, window=window, block=block)
    n = S // block
    vis = _dense(ev, sinks, window).view(2, 3, n, block, n, block)
    anyv, allv = vis.any(5).any(3), vis.all(5).all(3)
    assert bool((anyv <= (partial | full)).all())  # nothing visible falls in an empty block
    assert bool((full <= allv).all())  # a full block is visible throughout
    assert not bool((partial & full).any())
    if window > 2 * block:  # windows spanning whole blocks: the classification finds them full
        assert bool(full.any())


def test_block_mask_lists_the_blocks():
    g = torch.Generator().manual_seed(4)
    ev = eviction_schedule(torch.randn(1, 2, 256, generator=g), sinks=4, window=40, k=30)

    def mask_mod(b, h, q, kv):
        return kv <= q

    bm = eviction_block_mask(ev, mask_mod, sinks=4, window=40, hq=4, block=32)
    partial, full = block_classes(ev, sinks=4, window=40, block=32)
    assert bm.kv_num_blocks.shape == (1, 4, 8)
    assert torch.equal(bm.kv_num_blocks[0, 2], partial[0, 1].sum(-1).int())  # query head 2 is KV head 1's
    assert torch.equal(bm.full_kv_num_blocks[0, 3], full[0, 1].sum(-1).int())
    row = bm.kv_indices[0, 0, 5, : int(bm.kv_num_blocks[0, 0, 5])]
    assert set(row.tolist()) == set(torch.nonzero(partial[0, 0, 5]).flatten().tolist())
    with pytest.raises(ValueError, match="multiple of block"):
        block_classes(ev[..., :250], sinks=4, window=40, block=32)
