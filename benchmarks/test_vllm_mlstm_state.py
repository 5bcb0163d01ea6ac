"""The vLLM plugin's mLSTM decode step: the state gathered out of its pages and scattered back (the path before
issue 46) against the state read and written in its pages (``kvpop.vllm.recurrent.decode_priorities_in_pages``,
the CPU backend's), side by side.

Group ``vllm-mlstm-state``.  One layer at Qwen3-8B's shapes: 8 KV heads of 128, window 256, the scorer's ``d = 64``
and 128-token chunks, pages of a bf16 cache with blocks of 16 (16,384 floats: 27 state pages a request); ``N``
requests at positions ``1000 + r`` decode ``STEPS`` tokens (one chunk end each), the leaving token's value given.
Rounds alternate (gathered, in place, gathered, ...), best of ``ROUNDS`` each; each path on its own copy of the
pages, which must end equal (same work, same bits).  ``work="state-io"`` times the same two paths with the mLSTM's
arithmetic (``MLSTMScorer.decode_leaving``) replaced by a stub that returns zeros: the state's reads and writes
alone.  ``extra_info``: ms per step of each path, the ratio, the load average at every round, torch's threads.
(The GPU backend's in-place step is a Triton kernel, ``kvpop_kernels.mlstm_decode``: not timed here, no GPU.)

Run: ``pytest benchmarks/test_vllm_mlstm_state.py --benchmark-only``.  With ``--benchmark-disable`` (CI) the same
code runs once at smoke sizes (2 steps, one round).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from kvpop.core.scorers import MLSTMScorer
from kvpop.vllm import recurrent as R

H, D, WINDOW, DIM = 8, 128, 256, 64
PAGE_FLOATS = 2 * 16 * H * D * 2 // 4  # a bf16 page of 16 slots, read as float32
STEPS, ROUNDS = 128, 3


def _gathered(sc, lg, pages, blocks, pos, k, v, vl):
    """The plugin's decode before issue 46: every state page copied out, updated, copied back."""
    N, E = blocks.shape
    idx = blocks.long().reshape(-1)
    flat = pages[idx].view(N, -1)
    p = R.decode_priorities(sc, lg, flat, pos, k, v, vl)
    pages[idx] = flat.view(N * E, -1)
    return p


def _in_place(sc, lg, pages, blocks, pos, k, v, vl):
    return R.decode_priorities_in_pages(sc, lg, pages, blocks, pos, k, v, vl)


@pytest.mark.benchmark(group="vllm-mlstm-state")
@pytest.mark.parametrize("work", ["step", "state-io"])
@pytest.mark.parametrize("N", [1, 4])
def test_mlstm_state_gathered_against_in_place(benchmark, N, work, monkeypatch):
    smoke = getattr(benchmark, "disabled", False)
    steps, rounds = (2, 1) if smoke else (STEPS, ROUNDS)
    torch.manual_seed(0)
    sc = MLSTMScorer(H, D, WINDOW, dim=DIM)
    lg = torch.linspace(-0.01, -0.001, H)
    if work == "state-io":
        monkeypatch.setattr(sc, "decode_leaving", lambda state, k, *a: torch.zeros(k.shape[:2]))
    E = R.state_blocks(sc, 4 * PAGE_FLOATS)
    nb = N * E + 1
    start = torch.randn(nb, PAGE_FLOATS)
    blocks = (torch.randperm(nb - 1)[: N * E] + 1).view(N, E).int()
    for r in range(N):  # a sane state: what the prompt path leaves (C, n, m of 1000 tokens, the chunk's features)
        flat = start[blocks[r].long()].view(1, -1)
        R.extend_priorities(sc, lg, flat, 0, torch.randn(1000 + r, H, D), torch.randn(1000 + r, H, D),
                            torch.zeros(H, 0, D))
        start[blocks[r].long()] = flat.view(E, -1)
    g = torch.Generator().manual_seed(1)
    tokens = [tuple(torch.randn(N, H, D, generator=g) for _ in range(3)) for _ in range(steps)]
    paths = {"gathered": _gathered, "in_place": _in_place}
    best = {name: float("inf") for name in paths}
    loads, finals = [], {}

    def rounds_():
        for _ in range(rounds):
            for name, fn in paths.items():
                pages = start.clone()
                loads.append(os.getloadavg()[0])
                t0 = time.perf_counter()
                for s, (k, v, vl) in enumerate(tokens):
                    fn(sc, lg, pages, blocks, torch.arange(N) + 1000 + s, k, v, vl)
                best[name] = min(best[name], (time.perf_counter() - t0) / steps)
                finals[name] = pages

    benchmark.pedantic(rounds_, rounds=1, iterations=1)
    assert torch.equal(finals["gathered"], finals["in_place"])
    benchmark.extra_info.update(
        gathered_ms_per_step=1e3 * best["gathered"], in_place_ms_per_step=1e3 * best["in_place"],
        in_place_over_gathered=best["in_place"] / best["gathered"], state_pages=E, requests=N, steps=steps,
        rounds=rounds, load_avg_1min=loads, torch_threads=torch.get_num_threads(), work=work)
