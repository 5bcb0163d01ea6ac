"""The GPU backend's decode path, driven on the CPU (no GPU in this project's sessions so far).

``KVpopTritonImpl.kvpop_forward`` on a pure-decode batch, with vLLM's Triton kernel replaced by a
recorder: the cache after the step equals ``slots.decode_step`` on the real rows alone (a padded row
of a CUDA-graph batch, seq_len 0 with a stale block-table row pointing at a live request's block,
writes into the null block only), and the kernel is handed ``seq_lens`` clamped to ``B``.
"""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # a submodule: this directory would pass for "vllm"

import torch  # noqa: E402

from kvpop.vllm import slots  # noqa: E402
from kvpop.vllm.backends import KVpopTritonImpl  # noqa: E402


@dataclasses.dataclass
class _Meta:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


class _Layer:
    kvpop_sinks, kvpop_window, kvpop_budget = 2, 4, 12
    kvpop_layout = None  # uniform budgets (kvpop.vllm.model sets a PackedSlots for head-adaptive ones)


def _impl(calls):
    impl = object.__new__(KVpopTritonImpl)
    impl.kv_cache_dtype, impl.sliding_window, impl.alibi_slopes = "auto", (-1, -1), None
    impl.head_size, impl.scale = 8, 8 ** -0.5

    def forward(layer, query, key, value, kv_cache, meta, output):
        calls.append(meta)
        output.fill_(1.0)
        return output

    impl.forward = forward
    return impl


def test_pure_decode_batch_with_a_padded_row():
    torch.manual_seed(0)
    nb, hkv, bs, D, hq = 10, 2, 4, 8, 4
    layer = _Layer()
    kv = torch.randn(nb, hkv, bs, 2 * D)
    calls = []
    impl = _impl(calls)
    bt = torch.tensor([[3, 7, 5, 0], [1, 2, 9, 0], [8, 4, 6, 0], [2, 9, 1, 0]], dtype=torch.int32)  # row 3: padding
    ref_kv = kv.clone()
    ref_tables = None
    for step, seq in enumerate(([5, 1, 20, 0], [6, 2, 21, 0], [7, 3, 22, 0])):
        seq_lens = torch.tensor(seq, dtype=torch.int32)
        q, k, v = torch.randn(4, hq, D), torch.randn(4, hkv, D), torch.randn(4, hkv, D)
        prio = torch.randn(4, hkv)
        meta = _Meta(torch.arange(5, dtype=torch.int32), seq_lens, bt, 1, 22)
        out = torch.zeros(4, hq, D)
        impl.kvpop_forward(layer, q, k, v, prio, kv, meta, out)
        # the same step on the three real rows only
        K, V = ref_kv[..., :D], ref_kv[..., D:]
        if ref_tables is None:
            ref_tables = (torch.full((nb, hkv, bs), -1, dtype=torch.int32), torch.full((nb, hkv, bs), float("-inf")))
        slots.decode_step(K, V, *ref_tables, bt[:3], seq_lens[:3].long() - 1, k[:3], v[:3], prio[:3],
                          sinks=2, window=4, budget=12)
        live = torch.tensor([b for b in range(nb) if b != 0])  # block 0 is vLLM's null block
        torch.testing.assert_close(kv[live], ref_kv[live], rtol=0, atol=0)
        sp, pr = impl._kvpop_tables
        assert torch.equal(sp[live], ref_tables[0][live]) and torch.equal(pr[live], ref_tables[1][live])
        assert calls[-1].seq_lens.tolist() == [min(n, 12) for n in seq]
        assert bool((out == 1).all())
    assert len(calls) == 3
