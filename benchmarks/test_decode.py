"""Decode benchmarks.

Groups ``decode-step-ctx*``: ONE layer's batch-1 decode step, ``kvpop_kernels.fixed_budget_decode``
over a fixed budget of ``B`` slots per KV head (``kvpop-B2048``, ``kvpop-B4096``) against dense
SDPA decoding over the whole cache (``sdpa``: the new key/value written into a preallocated cache,
then one query against all ``ctx + 1`` keys with ``enable_gqa``), at contexts 8K / 32K / 131K on
CUDA (Qwen3-8B: 32 query heads, 8 KV heads, head_dim 128, bf16), 1K / 8K / 32K on the CPU (4 / 2 heads,
head_dim 64, float32, budgets 256 / 512, the PyTorch path).  ``extra_info``: KV bytes read per step
over the time (``bytes_per_s``), the cache's size and, on CUDA, the peak allocated memory and a
CUDA-event timing (``do_bench_ms``).

Groups ``decode-generate-*``: whole-model batch-1 generation of a Qwen3-8B-shaped model with random
weights and fewer layers (hidden 4096, 32 / 8 heads, head_dim 128, 2 layers, bf16) on CUDA, a tiny
Qwen3 on the CPU: a prompt of ``ctx`` tokens is prefilled, then ``GEN_TOKENS`` tokens are decoded
greedily, dense (``DynamicCache``, SDPA) against ``kvpop.patch`` + ``KVpopCache`` (budget 2048).
``extra_info``: decode tokens/s and the peak allocated memory of the whole run (CUDA), which stays
flat for kvpop while dense grows with the context.

Group ``decode-generate-memory`` (CUDA): the same generation at the shortest and the longest context,
kvpop and dense side by side; the peak memory of the decode phase alone (after the prefill) above what
was allocated before ``generate``.  The target (flat memory): kvpop's growth from the shortest to the
longest context <= 5% of dense's growth.

Group ``decode-step-head-adaptive``: head-adaptive budgets (``head_budgets=``, the packed layout; one KV head
about 4x the budget of the others) against uniform budgets of the same total, one layer's batch-1 step at
a 32K context, timed side by side in one run (Qwen3-8B shapes and a mean budget of 2048 on CUDA, the CPU
shapes above and a mean of 512 on the CPU).  Targets: ``ratio_adaptive_over_uniform <= 1.3`` and
``bytes_adaptive_over_uniform == 1`` (the cache holds the sum of the budgets).

Run: ``pytest benchmarks/test_decode.py --benchmark-only`` (``--benchmark-disable`` in CI).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import kvpop_kernels._utils as kutils
from kvpop_kernels import SlotState, fixed_budget_decode

from .tools import roofline as rl
from .tools.timing import best_time, device_name

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

if CUDA:
    HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
    SINKS, WINDOW = 4, 256
    CONTEXTS = [8 * 1024, 32 * 1024, 131072]
    BUDGETS = [2048, 4096]
else:
    HQ, HKV, D, DTYPE = 4, 2, 64, torch.float32
    SINKS, WINDOW = 4, 64
    CONTEXTS = [1024, 8 * 1024, 32 * 1024]
    BUDGETS = [256, 512]

PROVIDERS = [f"kvpop-B{b}" for b in BUDGETS] + ["sdpa"]


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def _elt() -> int:
    return torch.empty((), dtype=DTYPE).element_size()


def kvpop_cost(budget: int | tuple[int, ...], code_elt: int | None = None, scales: bool = False,
               elt: int | None = None) -> tuple[int, int]:
    """Bytes and FLOPs of one batch-1 ``fixed_budget_decode`` step at these shapes (``tools/roofline.py``): uniform
    or per-head budgets; ``code_elt``/``scales`` for quantised slots, ``elt`` for another float dtype."""
    k = budget - SINKS - WINDOW if isinstance(budget, int) else [b - SINKS - WINDOW for b in budget]
    return rl.decode_step_cost(batch=1, hq=HQ, hkv=HKV, d=D, slots=budget, k_lr=k, elt=elt or _elt(),
                               code_elt=code_elt, scales=scales)


def sdpa_cost(ctx: int) -> tuple[int, int]:
    """Bytes and FLOPs of one dense batch-1 decode step over ``ctx + 1`` keys."""
    return rl.dense_decode_cost(batch=1, hq=HQ, hkv=HKV, d=D, keys=ctx + 1, elt=_elt())


def _kvpop_state(ctx: int, B: int, gen: torch.Generator, heads: int = HKV):
    """A consistent full cache at position ``ctx``: sinks, the last ``w`` tokens in the ring, ``k``
    distinct older tokens with random priorities in the long-range slots."""
    s, w = SINKS, WINDOW
    k = B - s - w
    kc = torch.randn(heads, B, D, generator=gen).to(DEVICE, DTYPE)
    vc = torch.randn(heads, B, D, generator=gen).to(DEVICE, DTYPE)
    slot_pos = torch.empty(heads, B, dtype=torch.int32)
    slot_pos[:, :s] = torch.arange(s, dtype=torch.int32)
    ring_t = torch.arange(ctx - w, ctx)
    slot_pos[:, s + (ring_t - s) % w] = ring_t.to(torch.int32)
    for h in range(heads):
        slot_pos[h, s + w:] = (torch.randperm(ctx - w - s, generator=gen)[:k] + s).to(torch.int32)
    slot_prio = torch.randn(heads, k, generator=gen)
    return [kc, vc, slot_pos.to(DEVICE), slot_prio.to(DEVICE)]


def _packed_state(ctx: int, budgets: tuple[int, ...], gen: torch.Generator):
    """The packed layout of ``fixed_budget_decode(head_budgets=budgets)``: each head's full cache, back to back."""
    heads = [_kvpop_state(ctx, b, gen, heads=1) for b in budgets]
    return [torch.cat([h[i][0] for h in heads], dim=0).contiguous() for i in range(4)]


def skewed_budgets(mean: int, heads: int) -> tuple[int, ...]:
    """One head (the middle one) about 4x the budget of each other head, the total ``heads x mean``."""
    small = mean * heads // (heads + 3)
    out = [small] * heads
    out[heads // 2] = mean * heads - small * (heads - 1)
    return tuple(out)


def _make_sdpa(ctx: int, q, kn, vn, gen):
    """Dense decoding: write the new key/value into a preallocated cache, attend over ``ctx + 1`` keys."""
    cap = ctx + 8192  # room for the timed steps
    kc = torch.randn(1, HKV, cap, D, generator=gen).to(DEVICE, DTYPE)
    vc = torch.randn(1, HKV, cap, D, generator=gen).to(DEVICE, DTYPE)
    q4 = q.view(1, HQ, 1, D)

    def step_at(p: int):
        kc[0, :, p] = kn
        vc[0, :, p] = vn
        return F.scaled_dot_product_attention(q4, kc[:, :, :p + 1], vc[:, :, :p + 1], enable_gqa=True)

    return step_at, cap


def _make_kvpop(ctx: int, B: int, q, kn, vn, gen):
    state = _kvpop_state(ctx, B, gen)
    lp = torch.randn(HKV, generator=gen).to(DEVICE)

    def step_at(p: int):
        return fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=p, sinks=SINKS, window=WINDOW)

    return step_at, None


def _stepper(step_at, ctx: int, cap: int | None):
    """An eager step that advances the position at every call (as decoding does)."""
    cur = {"pos": ctx}

    def step():
        p = cur["pos"] if cap is None else min(cur["pos"], cap - 1)
        cur["pos"] += 1
        return step_at(p)

    return step


def _cuda_timings(step_at, step, ctx: int) -> dict:
    """CUDA-event timings: eager (launch overhead included) and a CUDA-graph replay (device time)."""
    import triton.testing

    info = {"eager_ms": triton.testing.do_bench(step, warmup=25, rep=200)}
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step_at(ctx + 4096)  # warm on the capture stream
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            step_at(ctx + 4097)  # one position baked in: fine for timing
        info["graph_ms"] = triton.testing.do_bench(g.replay, warmup=25, rep=200)
    except Exception as e:  # pragma: no cover - depends on the driver
        info["graph_error"] = repr(e)[:200]
    return info


@pytest.mark.benchmark(group="decode-step")
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("ctx", CONTEXTS, ids=_ctx_label)
def test_decode_step(benchmark, monkeypatch, provider, ctx):
    benchmark.group = f"decode-step-ctx{_ctx_label(ctx)}"
    if not CUDA:  # the CPU benchmark measures the PyTorch path, never the interpreter
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    gen = torch.Generator().manual_seed(0)
    elt = torch.empty((), dtype=DTYPE).element_size()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated() if CUDA else 0

    q = torch.randn(HQ, D, generator=gen).to(DEVICE, DTYPE)
    kn = torch.randn(HKV, D, generator=gen).to(DEVICE, DTYPE)
    vn = torch.randn(HKV, D, generator=gen).to(DEVICE, DTYPE)
    if provider == "sdpa":
        step_at, cap = _make_sdpa(ctx, q, kn, vn, gen)
        budget = ctx + 1
        kv_bytes = 2 * HKV * budget * D * elt
    else:
        budget = int(provider.split("-B")[1])
        step_at, cap = _make_kvpop(ctx, budget, q, kn, vn, gen)
        k = budget - SINKS - WINDOW
        kv_bytes = 2 * HKV * budget * D * elt + HKV * budget * 4 + HKV * k * 4  # k, v, positions, priorities
    step = _stepper(step_at, ctx, cap)

    def run():
        out = step()
        _sync()
        return out

    for _ in range(5):  # compile / allocator warm-up
        run()
    _sync()
    info = {"provider": provider, "context": ctx, "budget": budget, "Hq": HQ, "Hkv": HKV, "head_dim": D,
            "dtype": str(DTYPE), "kv_bytes_read": kv_bytes, "cache_bytes": kv_bytes}
    if CUDA:
        info.update(_cuda_timings(step_at, step, ctx))
        for key in ("eager_ms", "graph_ms"):
            if key in info:
                info[f"bytes_per_s_{key[:-3]}"] = kv_bytes / (info[key] * 1e-3)
    benchmark(run)
    if benchmark.stats is not None:
        info["bytes_per_s"] = kv_bytes / benchmark.stats.stats.mean
    if CUDA:
        info["peak_mem_bytes"] = torch.cuda.max_memory_allocated() - base_mem
    seconds = (info.get("graph_ms") or info.get("eager_ms") or 0) * 1e-3 if CUDA else None
    if not seconds and benchmark.stats is not None:
        seconds = benchmark.stats.stats.mean
    if seconds:
        rl.record(info, provider, *(sdpa_cost(ctx) if provider == "sdpa" else kvpop_cost(budget)), seconds,
                  device_name(), main=True)
    benchmark.extra_info.update(info)


@pytest.mark.benchmark(group="decode-step-speedup")
@pytest.mark.parametrize("budget", BUDGETS)
def test_decode_step_speedup(benchmark, monkeypatch, budget):
    """kvpop's step against dense SDPA at the longest context, timed side by side (target on
    the GPU: ``speedup >= 20`` at 131K, from CUDA-graph replays where they work).  ``extra_info``: both
    times and their ratio (eager and, on CUDA, CUDA-graph replays); on the CPU also kvpop's step time
    at the shortest context beside the longest (target: ``ratio_longest_over_first_ctx <= 1.3``)."""
    if not CUDA:
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    ctx = CONTEXTS[-1]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(HQ, D, generator=gen).to(DEVICE, DTYPE)
    kn = torch.randn(HKV, D, generator=gen).to(DEVICE, DTYPE)
    vn = torch.randn(HKV, D, generator=gen).to(DEVICE, DTYPE)
    kv_at, _ = _make_kvpop(ctx, budget, q, kn, vn, gen)
    sd_at, cap = _make_sdpa(ctx, q, kn, vn, gen)
    kv_step, sd_step = _stepper(kv_at, ctx, None), _stepper(sd_at, ctx, cap)
    for _ in range(5):
        kv_step(), sd_step()
    _sync()
    info = {"context": ctx, "budget": budget}
    if CUDA:
        kv, sd = _cuda_timings(kv_at, kv_step, ctx), _cuda_timings(sd_at, sd_step, ctx)
        for key in ("eager_ms", "graph_ms"):
            if key in kv and key in sd:
                info[f"kvpop_{key}"], info[f"sdpa_{key}"] = kv[key], sd[key]
        info["speedup_eager"] = sd["eager_ms"] / kv["eager_ms"]
        if "graph_ms" in kv and "graph_ms" in sd:
            info["speedup_graph"] = sd["graph_ms"] / kv["graph_ms"]
        # the target's figure: device time (CUDA-graph replays, as a captured decode loop runs), else eager
        info["speedup_source"] = "graph" if "speedup_graph" in info else "eager"
        info["speedup"] = info.get("speedup_graph", info["speedup_eager"])
        src = info["speedup_source"] + "_ms"
        t_kv, t_sd = kv[src] * 1e-3, sd[src] * 1e-3
    else:
        t_sd = best_time(sd_step, reps=30, warmup=0)
        # the step's cost must not grow with the context (target: time(32K) <= 1.3 x time(1K)).  Two
        # caches of each context, timed in alternating rounds, best of all: a slow spell of the shared
        # machine falls on both contexts, and a cache that happens to sit badly in memory (one process
        # measured 1.35x, the next 1.0x, at equal work) does not decide the ratio
        steps = {c: [_stepper(_make_kvpop(c, budget, q, kn, vn, gen)[0], c, None) for _ in range(2)]
                 for c in (CONTEXTS[0], ctx)}
        steps[ctx][0] = kv_step
        best = {c: float("inf") for c in steps}
        for _ in range(5):
            for c, fns in steps.items():
                for fn in fns:
                    best[c] = min(best[c], best_time(fn, reps=6, warmup=1))
        t_kv, t_kv1 = best[ctx], best[CONTEXTS[0]]
        info.update(kvpop_s=t_kv, sdpa_s=t_sd, speedup=t_sd / t_kv, kvpop_s_first_ctx=t_kv1,
                    ratio_longest_over_first_ctx=t_kv / t_kv1)
    rl.record(info, "kvpop", *kvpop_cost(budget), t_kv, device_name(), main=True)
    rl.record(info, "sdpa", *sdpa_cost(ctx), t_sd, device_name())
    benchmark.extra_info.update(info)
    benchmark.pedantic(kv_step, rounds=1, iterations=1, warmup_rounds=0)


HA_CTX, HA_BUDGET = 32 * 1024, (2048 if CUDA else 512)


@pytest.mark.benchmark(group="decode-step-head-adaptive")
def test_decode_step_head_adaptive(benchmark, monkeypatch):
    """Head-adaptive budgets against uniform ones of the same total, timed side by side: one KV head holds
    about 4x the slots of the others (``skewed_budgets``).  ``extra_info``: both step times (CUDA: CUDA-graph
    replays where they work, else eager), ``ratio_adaptive_over_uniform`` (target <= 1.3) and the two caches'
    bytes, ``bytes_adaptive_over_uniform`` (target 1: the packed layout holds the sum of the budgets)."""
    if not CUDA:
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    gen = torch.Generator().manual_seed(2)
    budgets = skewed_budgets(HA_BUDGET, HKV)
    q = torch.randn(HQ, D, generator=gen).to(DEVICE, DTYPE)
    kn = torch.randn(HKV, D, generator=gen).to(DEVICE, DTYPE)
    vn = torch.randn(HKV, D, generator=gen).to(DEVICE, DTYPE)
    lp = torch.randn(HKV, generator=gen).to(DEVICE)
    uni, ada = _kvpop_state(HA_CTX, HA_BUDGET, gen), _packed_state(HA_CTX, budgets, gen)

    def uni_at(p):
        return fixed_budget_decode(q, kn, vn, SlotState(*uni), lp, pos=p, sinks=SINKS, window=WINDOW)

    def ada_at(p):
        return fixed_budget_decode(q, kn, vn, SlotState(*ada), lp, pos=p, sinks=SINKS, window=WINDOW,
                                   head_budgets=budgets)

    uni_step, ada_step = _stepper(uni_at, HA_CTX, None), _stepper(ada_at, HA_CTX, None)
    for _ in range(5):
        uni_step(), ada_step()
    _sync()
    nbytes = {name: sum(t.numel() * t.element_size() for t in st) for name, st in (("uniform", uni), ("adaptive", ada))}
    info = {"context": HA_CTX, "budget_mean": HA_BUDGET, "head_budgets": list(budgets), "Hq": HQ, "Hkv": HKV,
            "head_dim": D, "dtype": str(DTYPE), "uniform_bytes": nbytes["uniform"],
            "adaptive_bytes": nbytes["adaptive"], "bytes_adaptive_over_uniform": nbytes["adaptive"] / nbytes["uniform"]}
    if CUDA:
        u, a = _cuda_timings(uni_at, uni_step, HA_CTX), _cuda_timings(ada_at, ada_step, HA_CTX)
        key = "graph_ms" if "graph_ms" in u and "graph_ms" in a else "eager_ms"
        info.update(uniform_eager_ms=u["eager_ms"], adaptive_eager_ms=a["eager_ms"], ratio_source=key[:-3],
                    ratio_adaptive_over_uniform_eager=a["eager_ms"] / u["eager_ms"],
                    ratio_adaptive_over_uniform=a[key] / u[key])
        if key == "graph_ms":
            info.update(uniform_graph_ms=u["graph_ms"], adaptive_graph_ms=a["graph_ms"])
        t_uni, t_ada = u[key] * 1e-3, a[key] * 1e-3
    else:  # alternating rounds, best of all (as the context-scaling target above), on one intra-op thread:
        # on a shared machine whose cores are all busy, a step that waits for a descheduled worker thread
        # took 50-100 ms (both layouts; which one is hit first decides the ratio), a step on one thread ~0.3 ms
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            best = {"uniform": float("inf"), "adaptive": float("inf")}
            for _ in range(7):
                for name, fn in (("uniform", uni_step), ("adaptive", ada_step)):
                    best[name] = min(best[name], best_time(fn, reps=10, warmup=1))
        finally:
            torch.set_num_threads(threads)
        info.update(uniform_s=best["uniform"], adaptive_s=best["adaptive"], intra_op_threads=1,
                    ratio_adaptive_over_uniform=best["adaptive"] / best["uniform"])
        t_uni, t_ada = best["uniform"], best["adaptive"]
    rl.record(info, "adaptive", *kvpop_cost(budgets), t_ada, device_name(), main=True)
    rl.record(info, "uniform", *kvpop_cost(HA_BUDGET), t_uni, device_name())
    benchmark.extra_info.update(info)
    benchmark.pedantic(ada_step, rounds=1, iterations=1, warmup_rounds=0)


# ----------------------------------------------------------------------------- whole-model generation
if CUDA:
    GEN_CFG = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=151936)
    GEN_CONTEXTS, GEN_BUDGET, GEN_WINDOW, GEN_TOKENS = [8 * 1024, 32 * 1024, 131072], 2048, 256, 32
else:
    GEN_CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=256)
    GEN_CONTEXTS, GEN_BUDGET, GEN_WINDOW, GEN_TOKENS = [256, 1024], 128, 32, 16


def _gen_model(kvpop_patched: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvpop

    torch.manual_seed(0)
    cfg = Qwen3Config(max_position_embeddings=max(GEN_CONTEXTS) + 2 * GEN_TOKENS, **GEN_CFG)
    cfg._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg).to(DTYPE).eval()
    if kvpop_patched:
        kvpop.patch(model, sinks=SINKS, window=GEN_WINDOW, budget=GEN_BUDGET)
    return model


@pytest.mark.parametrize("provider", ["kvpop", "dense"])
@pytest.mark.parametrize("ctx", GEN_CONTEXTS, ids=_ctx_label)
def test_decode_generate(benchmark, monkeypatch, provider, ctx):
    if not CUDA:
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    benchmark.group = f"decode-generate-ctx{_ctx_label(ctx)}"
    model = _gen_model(provider == "kvpop")
    prompt = torch.randint(0, GEN_CFG["vocab_size"], (1, ctx), device=DEVICE)

    def run():
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False)
        _sync()
        return out

    run()  # warm-up: compiles and autotunes every kernel
    with torch.no_grad():  # the prefill alone (kvpop: a forward through a fresh KVpopCache, as generate does)
        t_prefill = best_time(lambda: model(prompt, use_cache=True), reps=1, warmup=0)
    t0 = time.perf_counter()
    out = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    total = time.perf_counter() - t0  # one round (also with --benchmark-disable, where stats are None)
    assert out.shape == (1, ctx + GEN_TOKENS)
    info = dict(ctx=ctx, new_tokens=GEN_TOKENS, total_s=total, prefill_s=t_prefill,
                decode_tokens_per_s=GEN_TOKENS / max(total - t_prefill, 1e-9))
    # the roofline of one decode step: the weights and every layer's cache read (kvpop: its slots, positions and
    # priorities; dense: the keys and values of the context)
    shape, elt = rl.ModelShape.of(model.config), torch.empty((), dtype=DTYPE).element_size()
    hkv, d, k = shape.kv_heads, shape.head_dim, GEN_BUDGET - SINKS - GEN_WINDOW
    keys = GEN_BUDGET if provider == "kvpop" else ctx + GEN_TOKENS // 2
    per_layer = (hkv * GEN_BUDGET * (2 * d * elt + 4) + hkv * k * 4 if provider == "kvpop"
                 else 2 * hkv * keys * d * elt)
    rl.record(info, provider, *rl.model_decode_cost(shape, batch=1, keys_per_head=keys,
                                                    cache_bytes=shape.layers * per_layer, elt=elt),
              max(total - t_prefill, 1e-9) / GEN_TOKENS, device_name(), main=True)
    if CUDA:
        info.update(peak_mem_bytes=torch.cuda.max_memory_allocated())
    benchmark.extra_info.update(info)


def _decode_peak_bytes(model, ctx: int, new_tokens: int) -> int:
    """Peak memory of the decode phase of one greedy ``generate`` above the memory allocated before it.

    A stopping criterion that never stops resets CUDA's peak counter on its first call, when the prefill
    and the first token are done, so the peak read after ``generate`` is the decode phase's."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class ResetPeakAfterPrefill(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            if self.calls == 0:
                torch.cuda.reset_peak_memory_stats()
            self.calls += 1
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    crit = ResetPeakAfterPrefill()
    prompt = torch.randint(0, GEN_CFG["vocab_size"], (1, ctx), device=DEVICE)
    _sync()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       stopping_criteria=StoppingCriteriaList([crit]))
    _sync()
    if crit.calls != new_tokens:
        raise RuntimeError(f"the stopping criterion ran {crit.calls} times for {new_tokens} new tokens")
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.benchmark(group="decode-generate-memory")
def test_decode_generate_memory(benchmark):
    """Flat memory, measured side by side: decode-phase peak memory at the shortest and the longest
    context, kvpop and dense.  ``kvpop_growth_over_dense_growth``: (kvpop's peak at the longest - at the
    shortest) / (dense's peak at the longest - at the shortest), target <= 0.05."""
    short, long_, new = GEN_CONTEXTS[0], GEN_CONTEXTS[-1], 16
    info = {"contexts": [short, long_], "new_tokens": new, "budget": GEN_BUDGET}
    for provider in ("kvpop", "dense"):
        model = _gen_model(provider == "kvpop")
        _decode_peak_bytes(model, short, 2)  # compile and autotune outside the measurement
        peaks = {c: _decode_peak_bytes(model, c, new) for c in (short, long_)}
        info[f"{provider}_decode_peak_gb_shortest"] = peaks[short] / 2**30
        info[f"{provider}_decode_peak_gb_longest"] = peaks[long_] / 2**30
        info[f"{provider}_growth_gb"] = (peaks[long_] - peaks[short]) / 2**30
        del model
        torch.cuda.empty_cache()
    info["kvpop_growth_over_dense_growth"] = info["kvpop_growth_gb"] / max(info["dense_growth_gb"], 1e-9)
    benchmark.extra_info.update(info)
    model = _gen_model(True)
    benchmark.pedantic(lambda: _decode_peak_bytes(model, short, 2), rounds=1, iterations=1, warmup_rounds=0)
