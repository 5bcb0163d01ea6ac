"""kvpop served by vLLM with ``kv_cache_dtype="int8_per_token_head"`` / ``"fp8_per_token_head"`` against transformers
+ ``KVpopCache(kv_dtype="int8" | "fp8")``.

The engines of tests/vllm/test_vllm_engine.py (the shipped tiny Qwen3, float32, ``B = 64``, sinks 4, window 32,
blocks of 32 slots) with vLLM's per-token-head caches: kvpop writes the codes and scales of ``KVpopCache``'s
quantiser into vLLM's in-page layout (``[K | K scale | V | V scale]`` per slot and row, the page vLLM sizes and
counts, :mod:`kvpop.vllm.quantized`).  Uniform budgets compiled, chunks of 96 tokens (the 7- and 60-token prompts
prefilled in the first step, the 300-token one in four chunks); head-adaptive eager, whole prompts.  Oracle: greedy
tokens equal, log-probabilities within ``TOL`` (1e-4) for a prompt prefilled in one step, within ``CHUNKED_TOL`` for
the chunked one (a later chunk sees the kept tokens of the earlier ones dequantised, ``KVpopCache``'s whole prompt in
full precision; the worst differences measured are printed).  And vLLM's accounting: a page of ``2 * (32 + 4)``
bytes per slot and row, so 1 GiB holds 32768 * 256 / 72 blocks of the float32 cache's 32768.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints.llm")

import test_vllm_engine as base  # noqa: E402  (this directory is on the test path)
import test_vllm_fp8 as fp8  # noqa: E402

_cpu_engine_env = base._cpu_engine_env  # the engine module's fixtures, by name in this module
scorer_file = base.scorer_file
head_budget_scorers = fp8.head_budget_scorers

TOL = 1e-4
CHUNKED_TOL = {"int8": 2e-3, "fp8": 2e-3}
CHUNK, LENGTHS, NEW = fp8.CHUNK, fp8.LENGTHS, fp8.NEW


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["uniform", "head-adaptive"])
def test_per_token_head_engine_equals_transformers(kv_dtype, layout, scorer_file, head_budget_scorers):
    """Prompts of 7, 60 and 300 tokens, 120 new tokens each, three requests at once: greedy tokens equal
    transformers + KVpopCache(kv_dtype=...)'s, log-probabilities within TOL (CHUNKED_TOL for the chunked prompt);
    vLLM's pool counts the in-page scales (blocks of 72 bytes per slot and row)."""
    uniform = layout == "uniform"
    scorers = scorer_file if uniform else head_budget_scorers
    cache_dtype = f"{kv_dtype}_per_token_head"
    cfg, prompts, got = fp8.run_engine(scorers, cache_dtype, uniform)
    blocks = cfg.num_gpu_blocks
    # pages of 2 layers x 2 rows x 32 slots x 2 * (32 + 4) bytes; 1 GiB held 32,768 float32 pages of 256 bytes/slot
    assert cfg.cache_dtype == cache_dtype and blocks == 32768 * 256 // 72, blocks
    tol = [CHUNKED_TOL[kv_dtype] if uniform and sum(LENGTHS[:i + 1]) > CHUNK else TOL for i in range(len(LENGTHS))]
    worst = [fp8._equal(g, fp8.reference_quantized(scorers, p, NEW, kv_dtype), f"{cache_dtype} {layout}, prompt of "
                        f"{len(p)}", t) for p, g, t in zip(prompts, got, tol)]
    print(f"{cache_dtype} {layout}: {blocks} blocks of {base.BLOCK}; worst log-probability difference per prompt "
          f"{worst}")
