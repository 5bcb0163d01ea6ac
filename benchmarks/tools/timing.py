"""Small timing helpers shared by the benchmark files."""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

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


def median_interval(xs: Sequence[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median of ``xs`` (``resamples`` draws with replacement, from
    ``random.Random(seed)``): a verdict on a ratio of paired rounds that one slow round cannot flip."""
    if len(xs) == 0 or resamples < 1:
        raise ValueError(f"median_interval needs at least one value and one resample, got {len(xs)} values and "
                         f"resamples={resamples}")
    g = random.Random(seed)
    meds = sorted(statistics.median(g.choices(list(xs), k=len(xs))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[max(int(0.975 * resamples) - 1, 0)]


def device_name() -> str:
    """The name the roofline's peak table is keyed by (``benchmarks/tools/roofline.py``): the GPU's, else ``"cpu"``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
