"""Inputs to the ops that once gave silent wrong output: a clear error instead."""
import pytest
import torch
from test_decode_kernel import decode_flat

import kvpop_kernels as kk
from kvpop_kernels import NEVER, reference


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.float32, torch.bool])
def test_sparse_attention_wants_int32_or_int64_evict_at(dtype):
    q, k = torch.randn(1, 2, 9, 16), torch.randn(1, 1, 9, 16)
    ev = torch.full((1, 1, 9), NEVER, dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"evict_at must be int32 .* or int64, got {dtype}"):
        kk.sparse_attention(q, k, k, ev.to(dtype), sinks=1, window=2)
    want, _ = reference.sparse_attention(q, k, k, ev.to(torch.int32), sinks=1, window=2)
    for ok in (torch.int32, torch.int64):  # both give the dense result (NEVER: nothing evicted)
        torch.testing.assert_close(kk.sparse_attention(q, k, k, ev.to(ok), sinks=1, window=2)[0], want)


def _decode_args(Hkv=2, G=2, D=16, s=2, w=4, B=10):
    return dict(q=torch.randn(Hkv * G, D), k_new=torch.randn(Hkv, D), v_new=torch.randn(Hkv, D),
                k_cache=torch.zeros(Hkv, B, D), v_cache=torch.zeros(Hkv, B, D),
                slot_pos=torch.full((Hkv, B), -1, dtype=torch.int32),
                slot_prio=torch.full((Hkv, B - s - w), float("-inf")), leaving_prio=torch.zeros(Hkv))


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "slot_pos", "slot_prio"])
def test_decode_refuses_expanded_or_overlapping_state(name):
    a = _decode_args()
    x = a[name]
    bad = {"expanded": x[:1].expand_as(x),  # stride 0 over the heads
           "overlapping": x.flatten()[: x.shape[-1] + 1].as_strided(x.shape, (1,) * x.dim())}
    for kind, view in bad.items():
        with pytest.raises(ValueError, match=rf"{name} is updated in place.*\.contiguous\(\)"):
            decode_flat(**{**a, name: view}, pos=0, sinks=2, window=4)
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        decode_flat(**{**a, "v_cache": a["k_cache"]}, pos=0, sinks=2, window=4)
    # interleaved views of one buffer (keys and values side by side) are fine
    kv = torch.zeros(2, 10, 2, 16)
    out, lse = decode_flat(**{**a, "k_cache": kv[:, :, 0], "v_cache": kv[:, :, 1]}, pos=0, sinks=2,
                                      window=4)
    assert torch.isfinite(out).all() and torch.equal(kv[:, 0, 0], a["k_new"]) and torch.equal(kv[:, 0, 1], a["v_new"])
