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
from kvpop_kernels import reference  # noqa: E402


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
    kvpop_recurrent = ()  # the MLP scorer (the mLSTM: its KVpopLayer, whose state pages lead each table row)


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


def _decode_step(impl, layer, kv, bt, seq, hq, D):
    """One pure-decode forward of 4 rows (row 3 padding when its seq_len is 0): ``(seq_lens, q, k, v, prio, out)``."""
    hkv = kv.shape[1]
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    q, k, v = torch.randn(4, hq, D), torch.randn(4, hkv, D), torch.randn(4, hkv, D)
    prio = torch.randn(4, hkv)
    meta = _Meta(torch.arange(5, dtype=torch.int32), seq_lens, bt, 1, max(seq))
    out = torch.zeros(4, hq, D)
    impl.kvpop_forward(layer, q, k, v, prio, kv, meta, out)
    return seq_lens, q, k, v, prio, out


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
        seq_lens, q, k, v, prio, out = _decode_step(impl, layer, kv, bt, seq, hq, D)
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


def test_pure_decode_batch_mlstm_state_pages():
    """The mLSTM scorer's pure-decode path: each request's state pages lead its block-table row (their count from
    ``recurrent.state_blocks``); the step equals ``recurrent.decode_priorities`` + ``slots.decode_step`` on the real
    rows alone, over the rows' slot blocks, with the leaving token's value read from its window slot, the state
    updated in its pages by ``kvpop_kernels.mlstm_decode`` (Triton's interpreter here: the state and the priorities
    within float32 rounding of the gathered PyTorch step's, the slots' keys and values exact); a padded row writes
    its slots into the null block only and its state nowhere (the kernel skips it); the kernel is handed the slot
    columns of the block table."""
    from kvpop import KVpopConfig, KVpopLayer
    from kvpop.vllm import recurrent

    torch.manual_seed(1)
    hkv, bs, D, hq = 2, 4, 8, 4
    layer = _Layer()
    layer.num_kv_heads = hkv
    sc = KVpopLayer(KVpopConfig(sinks=2, window=4, budget=12, scorer="mlstm", mlstm_dim=4, scorer_hidden=8), hkv, D, 0)
    layer.kvpop_recurrent = (sc,)
    E = recurrent.state_blocks(sc.scorer, hkv * bs * 2 * D * 4)
    nb = 3 * (E + 3) + 2
    perm = torch.randperm(nb - 1)[: 3 * (E + 3)] + 1  # block 0 is vLLM's null block
    bt = torch.cat([perm.view(3, E + 3), perm[:E + 3].view(1, E + 3)]).int()  # row 3: padding, a live row's blocks
    kv = torch.randn(nb, hkv, bs, 2 * D)
    kv.view(nb, -1)[perm[:E]] = 0.0  # request 0 starts from an empty state (the others from garbage, reset at 0)
    calls = []
    impl = _impl(calls)
    ref_kv = kv.clone()
    ref_tables = (torch.full((nb, hkv, bs), -1, dtype=torch.int32), torch.full((nb, hkv, bs), float("-inf")))
    for seq in ([1, 1, 1, 0], *([n, n, n, 0] for n in range(2, 16))):
        seq_lens = torch.tensor(seq, dtype=torch.int32)
        q, k, v, k_pre = torch.randn(4, hq, D), torch.randn(4, hkv, D), torch.randn(4, hkv, D), torch.randn(4, hkv, D)
        meta = _Meta(torch.arange(5, dtype=torch.int32), seq_lens, bt, 1, 16)
        out = torch.zeros(4, hq, D)
        impl.kvpop_forward(layer, q, k, v, None, kv, meta, out, k_pre=k_pre)
        # the same on the three real rows
        K, V = ref_kv[..., :D], ref_kv[..., D:]
        pos = seq_lens[:3].long() - 1
        pages = ref_kv.view(nb, -1)
        st = bt[:3, :E].long().reshape(-1)
        flat = pages[st].view(3, -1)
        t = (pos - 4).clamp(min=0)
        slot = torch.where(t < 2, t, 2 + (t - 2).clamp(min=0) % 4)
        v_leave = V[bt[:3, E:].long().gather(1, (slot // bs)[:, None]), torch.arange(hkv)[None], (slot % bs)[:, None]]
        p_leave = recurrent.decode_priorities(sc.scorer, sc.log_gamma(), flat, pos, k_pre[:3], v[:3], v_leave)
        pages[st] = flat.view(3 * E, -1)
        slots.decode_step(K, V, *ref_tables, bt[:3, E:], pos, k[:3], v[:3], torch.zeros(3, hkv), sinks=2, window=4,
                          budget=12, p_leave=p_leave)
        state_blocks = bt[:3, :E].long().reshape(-1)
        torch.testing.assert_close(kv[state_blocks], ref_kv[state_blocks], rtol=2e-5, atol=2e-5)
        others = torch.tensor([b for b in range(1, nb) if b not in state_blocks.tolist()])
        torch.testing.assert_close(kv[others], ref_kv[others], rtol=0, atol=0)
        sp, pr = impl._kvpop_tables
        live = torch.arange(1, nb)
        assert torch.equal(sp[live], ref_tables[0][live])
        torch.testing.assert_close(pr[live], ref_tables[1][live], rtol=1e-4, atol=1e-4)
        assert torch.equal(calls[-1].block_table, bt[:, E:])
    assert len(calls) == 15


def test_spec_counts_the_mlstm_state_pages():
    """The KV-cache spec of an mLSTM layer: its state pages come with the first token and first in the request's
    block-table row, so vLLM's memory per request and the row's width both count them."""
    import types

    from kvpop.vllm.spec import FixedBudgetSpec

    spec = FixedBudgetSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, budget=64,
                           state_blocks=11)
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=256),
                                parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
    assert spec.max_num_blocks_per_req(cfg, 256) == 11 + 8
    assert spec.max_memory_usage_bytes(cfg) == (11 + 2) * spec.page_size_bytes
    mlp = FixedBudgetSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, budget=64)
    assert mlp.max_num_blocks_per_req(cfg, 256) == 8 and mlp.max_memory_usage_bytes(cfg) == 2 * mlp.page_size_bytes


def _engine_config(hf: dict, *, tp: int = 1, cache_dtype: str = "auto"):
    import types

    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=hf, max_model_len=2048),
        cache_config=types.SimpleNamespace(cache_dtype=cache_dtype, enable_prefix_caching=False, block_size=32),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        speculative_config=None)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_mlstm_under_tensor_parallelism_is_refused_by_name(scorer, tmp_path):
    """``check_engine`` (run where the engine's config is built) refuses the mLSTM scorer with tensor_parallel_size > 1
    naming the setting and its value; the MLP scorer passes this check, and so does the mLSTM on one device."""
    from transformers import Qwen3ForCausalLM

    import kvpop
    from kvpop.demo import task
    from kvpop.vllm import hf_overrides
    from kvpop.vllm.model import check_engine

    m = Qwen3ForCausalLM.from_pretrained(str(task.SHIPPED_MODEL), dtype=torch.float32)
    kvpop.patch(m, sinks=4, window=32, budget=64, scorer=scorer)
    path = tmp_path / "scorers.safetensors"
    kvpop.save_scorers(m, path)
    hf = hf_overrides(str(path))
    assert check_engine(_engine_config(hf)).config.scorer == scorer
    if scorer == "mlp":
        assert check_engine(_engine_config(hf, tp=2)).config.scorer == "mlp"
        return
    with pytest.raises(ValueError, match=r"mLSTM scorer with tensor_parallel_size=1 only.*got tensor_parallel_size=2"):
        check_engine(_engine_config(hf, tp=2))


@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("budgets,align", [(None, 1), ((8, 16), 1), ((7, 13), 4)],
                         ids=["uniform", "head-adaptive", "head-adaptive-rows"])
def test_pure_decode_batch_per_token_head(cache_dtype, budgets, align):
    """The GPU backend's per-token-head path on a pure-decode batch with a padded row (seq_len 0, its block-table row
    naming a live request's blocks): the page after each step equals ``quantized.decode_step`` on the real rows
    alone outside the null block; under uniform budgets vLLM's kernel is handed ``seq_lens`` clamped to ``B`` and its
    own scale views (``_k_scale_cache``, what it dequantises with on load) read kvpop's scales; under head-adaptive
    budgets (packed slot to slot, or with heads starting rows as ``kvpop_pack="rows"`` lays them) the output
    (``kvpop_kernels.packed_slot_decode``, here its PyTorch path) is ``quantized.decode_attention``'s within 1e-5."""
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    from kvpop.vllm import quantized

    torch.manual_seed(2)
    nb, hkv, bs, D, hq = 10, 2, 4, 8, 4
    layer = _Layer()
    if budgets is not None:
        layer.kvpop_layout = slots.PackedSlots(budgets, hkv, align=align)  # align 4: heads start rows of bs = 4
    dtype = torch.int8 if cache_dtype.startswith("int8") else torch.uint8
    kv = torch.randint(0, 256, (nb, hkv, bs, 2 * (D + 4)), dtype=torch.uint8).view(dtype)
    calls = []
    impl = _impl(calls)
    impl.kv_cache_dtype, impl._kv_quant_mode = cache_dtype, get_kv_quant_mode(cache_dtype)
    impl.fp8_dtype, impl._k_scale_cache, impl._v_scale_cache = torch.float8_e4m3fn, None, None
    bt = torch.tensor([[3, 7, 5, 0], [1, 2, 9, 0], [8, 4, 6, 0], [2, 9, 1, 0]], dtype=torch.int32)  # row 3: padding
    ref = kv.clone()
    ref_tables = (torch.full((nb, hkv, bs), -1, dtype=torch.int32), torch.full((nb, hkv, bs), float("-inf")))
    live = torch.arange(1, nb)  # block 0 is vLLM's null block
    layout = layer.kvpop_layout or slots.UniformSlots(12, hkv)
    for step, seq in enumerate([n, n, n, 0] for n in range(1, 14)):
        seq_lens, q, k, v, prio, out = _decode_step(impl, layer, kv, bt, seq, hq, D)
        K, V, ks, vs = quantized.page_views(ref, D)
        if step == 0 and budgets is None:  # vLLM's scale views start at 1 (its _ensure_scale_caches)
            ks.fill_(1.0), vs.fill_(1.0)
        pos = seq_lens[:3].long() - 1
        quantized.decode_step(K, V, ks, vs, *ref_tables, bt[:3], pos, k[:3], v[:3], prio[:3], sinks=2, window=4,
                              layout=layout)
        assert torch.equal(kv[live].view(torch.uint8), ref[live].view(torch.uint8)), f"step {step}"
        if budgets is None:
            assert calls[-1].seq_lens.tolist() == [min(n, 12) for n in seq]
            ksc = impl._k_scale_cache  # [nb, bs, Hkv]: vLLM's view, read by its kernel
            assert torch.equal(ksc.transpose(1, 2)[live], quantized.page_views(kv, D)[2][live])
        else:
            want = quantized.decode_attention(K, V, ks, vs, bt[:3], pos, q[:3], layout=layout, scale=8 ** -0.5)
            torch.testing.assert_close(out[:3], want, rtol=1e-5, atol=1e-5)
    assert len(calls) == (13 if budgets is None else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_packed_rows_attention_equals_kvpops(dtype):
    """The CPU backend's packed decode attention when every head starts a row (``KVpopCPUImpl._rows_attention``:
    vLLM's C++ kernel over the cache viewed as blocks of one row) equals ``slots.decode_attention`` (kvpop's PyTorch
    attention over the same slots, the keys read in the layout the ISA stores them) and the dense reference
    (``reference.ragged_paged_decode`` over each head's row sequence) for requests below, at and past their heads'
    budgets, within float32 / bfloat16 rounding; stale bytes everywhere else in the cache."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvpop.vllm.backends import KVpopCPUImpl, _cpu_block_layout, _logical

    torch.manual_seed(4)
    hkv, bs, D, hq, n = 2, 32, 32, 4, 5
    budgets = ((36, 70), (33, 5))  # two layers; each head from a row's first slot
    rows = 2 * hkv
    layouts, base = [], 0
    for b in budgets:
        layouts.append(slots.PackedSlots(b, rows, base, align=bs))
        base += layouts[-1].span
    pages = -(-base // (rows * bs))
    nb = n * pages + 1
    kv = torch.randn(nb, rows, bs, 2 * D).to(dtype)  # the CPU backend's cache: per block and row, keys then values
    isa = _get_attn_isa(dtype, bs, D)
    tk, tv = _cpu_block_layout(isa, dtype, bs, D)
    region_k, region_v = kv.view(nb, rows, 2 * bs, D).chunk(2, dim=2)
    K, V = _logical(region_k, tk), _logical(region_v, tv)
    impl = object.__new__(KVpopCPUImpl)
    impl.kv_cache_dtype, impl.scale = "auto", D ** -0.5
    bt = (torch.randperm(nb - 1)[: n * pages] + 1).view(n, pages).int()
    pos = torch.tensor([0, 3, 34, 69, 500])
    for lay in layouts:
        layer = _Layer()
        layer.kvpop_layout, layer.isa, layer._k_scale_float, layer._v_scale_float = lay, isa, 1.0, 1.0
        q = torch.randn(n, hq, D).to(dtype)
        got = impl._rows_attention(layer, kv, bt, pos, q)
        want = slots.decode_attention(K, V, bt, pos, q, layout=lay, scale=D ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        # and against the dense reference directly: each (request, KV head) its own sequence of rows
        table, lens = slots.row_sequences(bt, pos, layout=lay, bs=bs)
        pool_k, pool_v = K.reshape(-1, bs, D), V.reshape(-1, bs, D)
        for i in range(n):
            heads = slice(i * hkv, (i + 1) * hkv)
            ref, _ = reference.ragged_paged_decode(q[i], K.new_zeros(hkv, 0, D), V.new_zeros(hkv, 0, D), 0, pool_k,
                                                   pool_v, table[heads], lens[heads], scale=D ** -0.5)
            torch.testing.assert_close(got[i].float(), ref.float(), rtol=tol, atol=tol)


def test_packed_align_defaults_and_the_block_fits_max_model_len():
    """``packed_align``: rows (the block size) on this CPU with an unquantised cache, slots (1) with an 8-bit one,
    ``kvpop_pack`` over the default; the start-up check counts the packed block's pages as laid out, names
    the ``max_model_len`` that fits them, and refuses layers skipped from the cache's quantisation."""
    from types import SimpleNamespace

    from kvpop.core.config import KVpopConfig
    from kvpop.vllm.model import _check_packed, packed_align, packed_rows_slots
    from kvpop.vllm.settings import Settings

    assert packed_align(32, "auto") == 32 and packed_align(32, None) == 32
    assert packed_align(32, "int8_per_token_head") == 1 and packed_align(32, "fp8") == 1
    assert packed_align(32, "auto", "slots") == 1 and packed_align(16, "fp8", "rows") == 16
    config = KVpopConfig(sinks=4, window=32, budget=128, head_budgets=((36, 220), (100, 156)))
    assert packed_rows_slots(config, 1) == (4, 512) and packed_rows_slots(config, 32) == (4, 576)

    def engine_config(n, dtype="auto", skip=None):
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                               cache_config=SimpleNamespace(block_size=32, cache_dtype=dtype,
                                                            kv_cache_dtype_skip_layers=skip),
                               model_config=SimpleNamespace(max_model_len=n))

    for pack, n_ok in ((None, 160), ("slots", 128)):  # 5 pages of 4 rows x 32 slots, or 4
        settings = Settings(config=config, policy="kvpop", scorers=None, pack=pack)
        _check_packed(engine_config(n_ok), settings)
        with pytest.raises(ValueError, match=rf"packed block of {n_ok // 32} blocks.*pass max_model_len >= {n_ok}"):
            _check_packed(engine_config(n_ok - 32), settings)
    plain = Settings(config=config, policy="kvpop", scorers=None)
    _check_packed(engine_config(128, "int8_per_token_head"), plain)
    # a layer left unquantised would read the shared packed block in another dtype: refused by name
    with pytest.raises(ValueError, match=r"one KV cache dtype for every layer.*kv_cache_dtype_skip_layers=\['3'\]"):
        _check_packed(engine_config(128, "int8_per_token_head", ["3"]), plain)
    _check_packed(engine_config(160, "auto", ["3"]), plain)  # nothing quantised: nothing skipped


def test_packing_summary_names_both_packings():
    """The start-up line on the packed block: its slots and blocks a request, and the other packing's."""
    from kvpop.core.config import KVpopConfig
    from kvpop.vllm.model import packing_summary

    config = KVpopConfig(sinks=4, window=32, budget=128, head_budgets=((36, 220), (100, 156)))
    assert packing_summary(config, 32, 32) == (
        "kvpop: head-adaptive budgets packed with each head from a row (kvpop_pack='rows'): 576 slots, 5 blocks of "
        "32 a request; kvpop_pack='slots' takes 512 slots, 4 blocks")
    assert packing_summary(config, 1, 32) == (
        "kvpop: head-adaptive budgets packed slot to slot: 512 slots, 4 blocks of 32 a request (the uniform cache's "
        "bytes)")
    assert packing_summary(config, 128, 128).endswith("768 slots, 2 blocks of 128 a request; kvpop_pack='slots' "
                                                      "takes 512 slots, 1 block")
