"""The vLLM plugin's PyTorch decode (the CPU backend's, no vLLM needed): one layer's eviction step and attention for
``N`` requests, head-adaptive (packed) budgets against uniform ones of the same total, side by side.

Group ``vllm-slots-step``.  The tiny model's shapes the engine benchmark serves (2 KV heads of 32, 4 query heads,
blocks of 32 slots, sinks 4, window 32): uniform ``B = 128`` against the packed layout of
``benchmarks/test_vllm_capacity.HEAD_BUDGETS`` (layer 0's ``(36, 220)`` and layer 1's ``(100, 156)``, one packed
block of 4 rows), float32 slots and int8 codes with their scales in a per-token-head page
(``kvpop.vllm.quantized.page_views``, vLLM's layout).  ``N = 8`` requests past the budget (every step evicts),
``STEPS`` steps a round; rounds alternate (uniform, packed layer 0, packed layer 1, ...), best of ``ROUNDS``; one
torch thread.  ``extra_info``: microseconds per step of each, ``ratio_packed_over_uniform`` (the packed layers'
mean over the uniform one's: what the head-adaptive layout costs kvpop's own decode), the load average at every
round.  The engine-level figure (tokens per second in vLLM) is ``test_vllm_equal_bytes.py``'s; there the uniform
float32 attention is vLLM's C++ kernel, not this code.

Run: ``pytest benchmarks/test_vllm_slots_step.py --benchmark-only``; CI runs it once at smoke sizes.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from kvpop.vllm import quantized, slots

N, D, BS, HQ, S, W = 8, 32, 32, 4, 4, 32
STEPS, ROUNDS = 200, 5
LAYOUTS = {"uniform": (slots.UniformSlots(128, 2), 2), "packed-l0": (slots.PackedSlots((36, 220), 4, 0), 4),
           "packed-l1": (slots.PackedSlots((100, 156), 4, 256), 4)}


def _case(layout, rows: int, kind: str):
    """One layer's cache (random contents: every slot finite), a block table of 4 blocks a request, and the step."""
    nb = 4 * N + 1
    g = torch.Generator().manual_seed(0)
    sp = torch.randint(0, 100, (nb, rows, BS), dtype=torch.int32, generator=g)
    pr = torch.randn(nb, rows, BS, generator=g)
    bt = torch.arange(1, nb).view(N, 4).int()
    pos = torch.full((N,), 300)
    q = torch.randn(N, HQ, D, generator=g)
    k, v, p = torch.randn(N, 2, D, generator=g), torch.randn(N, 2, D, generator=g), torch.randn(N, 2, generator=g)
    if kind == "float32":
        K, V = torch.randn(nb, rows, BS, D, generator=g), torch.randn(nb, rows, BS, D, generator=g)

        def step():
            slots.decode_step(K, V, sp, pr, bt, pos, k, v, p, sinks=S, window=W, layout=layout)
            return slots.decode_attention(K, V, bt, pos, q, layout=layout, scale=D ** -0.5)
    else:
        page = torch.zeros(nb, rows, BS, 2 * (D + 4), dtype=torch.int8)
        K, V, ks, vs = quantized.page_views(page, D)
        K.copy_(torch.randint(-127, 128, K.shape, dtype=torch.int8, generator=g))
        V.copy_(torch.randint(-127, 128, V.shape, dtype=torch.int8, generator=g))
        ks.copy_(torch.rand(ks.shape, generator=g) * 0.01)
        vs.copy_(torch.rand(vs.shape, generator=g) * 0.01)

        def step():
            quantized.decode_step(K, V, ks, vs, sp, pr, bt, pos, k, v, p, sinks=S, window=W, layout=layout)
            return quantized.decode_attention(K, V, ks, vs, bt, pos, q, layout=layout, scale=D ** -0.5)

    def one():
        pos.add_(1)
        return step()
    return one


@pytest.mark.benchmark(group="vllm-slots-step")
@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_packed_against_uniform_step(benchmark, kind, request):
    smoke = request.config.getoption("benchmark_disable", False)
    steps, rounds = (2, 1) if smoke else (STEPS, ROUNDS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases = {name: _case(lay, rows, kind) for name, (lay, rows) in LAYOUTS.items()}
        best = {name: float("inf") for name in cases}
        loads = []

        def run():
            for _ in range(rounds):
                for name, one in cases.items():
                    loads.append(os.getloadavg()[0])
                    for _ in range(min(steps, 10)):  # warm the layout's constant index tensors
                        one()
                    t = time.perf_counter()
                    for _ in range(steps):
                        out = one()
                    best[name] = min(best[name], (time.perf_counter() - t) / steps)
                    assert torch.isfinite(out).all()

        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        torch.set_num_threads(threads)
    us = {name: 1e6 * t for name, t in best.items()}
    benchmark.extra_info.update(
        us_per_step=us, ratio_packed_over_uniform=(us["packed-l0"] + us["packed-l1"]) / 2 / us["uniform"],
        requests=N, steps=steps, rounds=rounds, load_avg_1min=loads, threads=1)
