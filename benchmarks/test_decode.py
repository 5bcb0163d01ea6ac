"""Decode benchmarks.

Groups ``decode-step-ctx*``: ONE layer's batch-1 decode step, ``kvpop_kernels.fixed_budget_decode``
over a fixed budget of ``B`` slots per KV head (``kvpop-B2048``, ``kvpop-B4096``) against dense
SDPA decoding over the whole cache (``sdpa``: the new key/value written into a preallocated cache,
then one query against all ``ctx + 1`` keys with ``enable_gqa``), at contexts 8K / 32K / 131K on
CUDA (Qwen3-8B: 32 query heads, 8 KV heads, head_dim 128, bf16), 1K / 8K on the CPU (4 / 2 heads,
head_dim 64, float32, budgets 256 / 512, the PyTorch path).  ``extra_info``: KV bytes read per step
over the time (``bytes_per_s``), the cache's size and, on CUDA, the peak allocated memory and a
CUDA-event timing (``do_bench_ms``).

(Whole-model generation belongs in this file under its own groups, ``decode-generate-*``.)

Run: ``pytest benchmarks/test_decode.py --benchmark-only`` (``--benchmark-disable`` in CI).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvpop_kernels._utils as kutils
from kvpop_kernels import fixed_budget_decode

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
    CONTEXTS = [1024, 8 * 1024]
    BUDGETS = [256, 512]

PROVIDERS = [f"kvpop-B{b}" for b in BUDGETS] + ["sdpa"]


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def _kvpop_state(ctx: int, B: int, gen: torch.Generator):
    """A consistent full cache at position ``ctx``: sinks, the last ``w`` tokens in the ring, ``k``
    distinct older tokens with random priorities in the long-range slots."""
    s, w = SINKS, WINDOW
    k = B - s - w
    kc = torch.randn(HKV, B, D, generator=gen).to(DEVICE, DTYPE)
    vc = torch.randn(HKV, B, D, generator=gen).to(DEVICE, DTYPE)
    slot_pos = torch.empty(HKV, B, dtype=torch.int32)
    slot_pos[:, :s] = torch.arange(s, dtype=torch.int32)
    ring_t = torch.arange(ctx - w, ctx)
    slot_pos[:, s + (ring_t - s) % w] = ring_t.to(torch.int32)
    for h in range(HKV):
        slot_pos[h, s + w:] = (torch.randperm(ctx - w - s, generator=gen)[:k] + s).to(torch.int32)
    slot_prio = torch.randn(HKV, k, generator=gen)
    return [kc, vc, slot_pos.to(DEVICE), slot_prio.to(DEVICE)]


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
        cap = ctx + 4096  # room for the timed steps
        kc = torch.randn(1, HKV, cap, D, generator=gen).to(DEVICE, DTYPE)
        vc = torch.randn(1, HKV, cap, D, generator=gen).to(DEVICE, DTYPE)
        q4 = q.view(1, HQ, 1, D)
        step = {"pos": ctx}

        def run():
            p = step["pos"] if step["pos"] < cap else cap - 1
            kc[0, :, p] = kn
            vc[0, :, p] = vn
            out = F.scaled_dot_product_attention(q4, kc[:, :, :p + 1], vc[:, :, :p + 1], enable_gqa=True)
            step["pos"] += 1
            _sync()
            return out

        kv_bytes = 2 * HKV * (ctx + 1) * D * elt
        cache_bytes = 2 * HKV * (ctx + 1) * D * elt
        budget = ctx + 1
    else:
        B = int(provider.split("-B")[1])
        state = _kvpop_state(ctx, B, gen)
        lp = torch.randn(HKV, generator=gen).to(DEVICE)
        step = {"pos": ctx}

        def run():
            out = fixed_budget_decode(q, kn, vn, *state, lp, pos=step["pos"], sinks=SINKS, window=WINDOW)
            step["pos"] += 1
            _sync()
            return out

        k = B - SINKS - WINDOW
        kv_bytes = 2 * HKV * B * D * elt + HKV * B * 4 + HKV * k * 4  # keys, values, positions, priorities
        cache_bytes = kv_bytes
        budget = B

    for _ in range(5):  # compile / autotune / allocator warm-up
        run()
    _sync()
    if CUDA:
        import triton.testing

        benchmark.extra_info["do_bench_ms"] = triton.testing.do_bench(run, warmup=25, rep=100)
    benchmark(run)

    mean_s = benchmark.stats.stats.mean if benchmark.stats is not None else float("nan")
    benchmark.extra_info.update({
        "provider": provider, "context": ctx, "budget": budget, "Hq": HQ, "Hkv": HKV, "head_dim": D,
        "dtype": str(DTYPE), "kv_bytes_read": kv_bytes, "bytes_per_s": kv_bytes / mean_s,
        "cache_bytes": cache_bytes,
    })
    if CUDA:
        benchmark.extra_info["peak_mem_bytes"] = torch.cuda.max_memory_allocated() - base_mem
        if "do_bench_ms" in benchmark.extra_info:
            benchmark.extra_info["bytes_per_s_do_bench"] = kv_bytes / (benchmark.extra_info["do_bench_ms"] * 1e-3)
