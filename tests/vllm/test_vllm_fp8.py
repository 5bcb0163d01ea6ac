"""kvpop served by vLLM with ``kv_cache_dtype="fp8"`` against transformers + ``KVpopCache(kv_dtype="fp8")``.

The engines of tests/vllm/test_vllm_engine.py (its helpers and scorer file; the shipped tiny Qwen3, float32,
``B = 64``, sinks 4, window 32, blocks of 32 slots) with vLLM's fp8 cache: kvpop stores in it the codes of
``KVpopCache(kv_dtype="fp8")`` with their per-slot scales beside it (:mod:`kvpop.vllm.quantized`).  Uniform
budgets: compiled, chunks of 96 tokens (the 7- and 60-token prompts are prefilled in the first step, the
300-token one in four chunks); head-adaptive: eager, whole prompts.  Oracle: greedy tokens equal,
log-probabilities within ``FP8_TOL`` for a prompt prefilled in one step (docs/vllm.md states it: the same
codes; what differs is the order of float32 sums, and a code that the two paths' keys, equal to about 1e-7,
put on either side of an fp8 rounding boundary), within ``FP8_CHUNKED_TOL`` for a chunked one (a later chunk
sees the kept tokens of the earlier ones dequantised, ``KVpopCache``'s whole prompt in full precision).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints.llm")

import test_vllm_engine as base  # noqa: E402  (this directory is on the test path)
import torch  # noqa: E402

import kvpop  # noqa: E402

_cpu_engine_env = base._cpu_engine_env  # the engine module's fixtures, by name in this module
scorer_file = base.scorer_file

FP8_TOL = 1e-4
FP8_CHUNKED_TOL = 2e-3
CHUNK = 96
LENGTHS, NEW = (7, 60, 300), 120
HEAD_BUDGETS = ((40, 88), (56, 72))  # 2 layers x 2 KV heads, mean 64 (the uniform total), each >= sinks + window


def reference_quantized(scorers: str, ids: list[int], n: int, kv_dtype: str = "fp8") -> tuple[list[int], list[float]]:
    """Greedy tokens and log-probabilities of transformers + ``KVpopCache(kv_dtype=kv_dtype)``."""
    base.reference(scorers, "kvpop", ids[:1], 1)  # loads the model with the scorers
    m = base._REF_MODELS[base.MODEL, scorers]
    with torch.no_grad():
        cache = kvpop.KVpopCache(m, policy="kvpop", kv_dtype=kv_dtype)
        out = m.generate(torch.tensor([ids]), **kvpop.cache_kwargs(cache),
                         max_new_tokens=n, do_sample=False, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    gen = out.sequences[0, len(ids):].tolist()
    return gen, [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, gen)]


def run_engine(scorers: str, kv_cache_dtype: str, uniform: bool):
    """Three requests (prompts of ``LENGTHS``, ``NEW`` tokens each) in an engine with ``kv_cache_dtype``: uniform
    budgets compiled in chunks of ``CHUNK``, head-adaptive eager with whole prompts.  ``(cache config, prompts,
    results)``."""
    llm = base.engine(scorers, "kvpop", kv_cache_dtype=kv_cache_dtype, enforce_eager=not uniform,
                      max_num_batched_tokens=CHUNK if uniform else 1024)
    try:
        cfg = llm.llm_engine.vllm_config.cache_config
        prompts = [base.prompt(n, seed=20 + i) for i, n in enumerate(LENGTHS)]
        got = base.generate(llm, prompts, NEW)
    finally:
        base._close(llm)
    return cfg, prompts, got


def _equal(got, want, what, tol) -> float:
    (toks, lps), (rtoks, rlps) = got, want
    first = next((i for i, (a, b) in enumerate(zip(toks, rtoks)) if a != b), None)
    assert toks == rtoks, f"{what}: first differing token at {first} of {len(rtoks)}"
    worst = max(abs(a - b) for a, b in zip(lps, rlps))
    assert worst <= tol, f"{what}: log-probabilities differ by up to {worst:.3g}"
    return worst


@pytest.fixture(scope="module")
def head_budget_scorers(tmp_path_factory):
    """A scorer file with head-adaptive budgets (seeded MLP scorers of the shipped model)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(1)
    m = Qwen3ForCausalLM.from_pretrained(base.MODEL, dtype=torch.float32)
    kvpop.patch(m, sinks=base.SINKS, window=base.WINDOW, budget=base.BUDGET, scorer="mlp", head_budgets=HEAD_BUDGETS)
    path = tmp_path_factory.mktemp("hb_fp8") / "scorers.safetensors"
    kvpop.save_scorers(m, path)
    return str(path)


@pytest.mark.parametrize("layout", ["uniform", "head-adaptive"])
def test_fp8_engine_equals_transformers_fp8(layout, scorer_file, head_budget_scorers):
    """Prompts of 7, 60 and 300 tokens, 120 new tokens each, three requests at once in vLLM's fp8 cache: greedy
    tokens equal transformers + KVpopCache(kv_dtype="fp8")'s, log-probabilities within FP8_TOL (FP8_CHUNKED_TOL for
    the chunked prompt); the pool holds 4x the blocks of the float32 cache in the same VLLM_CPU_KVCACHE_SPACE."""
    uniform = layout == "uniform"
    scorers = scorer_file if uniform else head_budget_scorers
    cfg, prompts, got = run_engine(scorers, "fp8", uniform)
    blocks = cfg.num_gpu_blocks
    # float32 pages of 2 layers x 2 KV heads x 32 slots x (32 + 32) elements: 1 GiB holds 32,768 of them
    assert cfg.cache_dtype == "fp8" and blocks == 4 * 32768, blocks
    tol = [FP8_CHUNKED_TOL if uniform and sum(LENGTHS[:i + 1]) > CHUNK else FP8_TOL for i in range(len(LENGTHS))]
    worst = [_equal(g, reference_quantized(scorers, p, NEW), f"fp8 {layout}, prompt of {len(p)}", t) for p, g, t in
             zip(prompts, got, tol)]
    print(f"fp8 {layout}: {blocks} blocks of {base.BLOCK}; worst log-probability difference per prompt {worst}")


def test_engine_refuses_other_cache_dtype_by_name(scorer_file, monkeypatch):
    """An fp8 format kvpop does not write (e5m2) stops the engine at the model's construction, naming the value
    and the ones taken."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model is built in this process: its error here
    with pytest.raises(ValueError, match=r"kv_cache_dtype in \['auto', 'fp8', 'fp8_e4m3', 'int8_per_token_head', "
                                         r"'fp8_per_token_head'\].*got 'fp8_e5m2'"):
        base.engine(scorer_file, "kvpop", kv_cache_dtype="fp8_e5m2", enforce_eager=True)
