"""Small timing helpers shared by the benchmark files."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_time(fn: Callable[[], object], *, reps: int = 5, warmup: int = 1) -> float:
    """Best wall time of ``fn`` in seconds over ``reps`` runs (CUDA synchronised)."""
    for _ in range(warmup):
        fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def timed(fn: Callable[[], object]) -> Callable[[], object]:
    """Wrap ``fn`` so that a pytest-benchmark round includes the CUDA synchronisation."""

    def run():
        out = fn()
        sync()
        return out

    return run
