"""Paired intervals: the difference of two rows scored on the same sequences, with a 95 % interval from a
seeded paired bootstrap over clusters of sequences and over seeds (docs/DESIGN.md section 12).

A row's value on sequence ``i`` under training seed ``s`` is ``a[s, i]`` (``b[s', i]`` for the other row: the
same sequences, its own seeds).  The point estimate is ``mean(a) - mean(b)``, each the mean over its seeds of
the mean over the sequences.  Each bootstrap replicate draws, with replacement, as many clusters as there are
(every sequence of a drawn cluster counts once per draw: on real text a cluster is a source file, whose
sequences are not independent) and, independently, as many seeds of each row as it has (``pair_seeds=True``
draws one set of seed indices for both rows, for rows whose seeds are paired by design); the replicate's
difference uses the same resampled sequences for both rows (the pairing).  The interval is the 2.5 and 97.5
percentiles of the replicates (numpy's linear quantile).  The draws come from ``numpy.random.default_rng(seed)``
in a fixed order (clusters, then ``a``'s seeds, then ``b``'s), so a call is reproducible.

A negative difference means ``a`` is lower: on real text (NLL increase) that is ``a`` better; on accuracy,
``a`` worse.  The interval excludes 0 or it does not; "better" is said only where it does.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PairedInterval", "paired_interval", "bootstrap_draws", "comparison", "verdict", "t_quantile",
           "seed_t_interval", "strength", "BORDERLINE"]


@dataclass(frozen=True)
class PairedInterval:
    """``mean_diff`` (a minus b) and its interval ``ci95 = (lo, hi)``, with what it was computed from."""

    mean_diff: float
    ci95: tuple[float, float]
    n_sequences: int
    n_clusters: int
    seeds_a: int
    seeds_b: int
    n_boot: int
    seed: int
    pair_seeds: bool

    @property
    def excludes_zero(self) -> bool:
        return self.ci95[0] > 0 or self.ci95[1] < 0

    def to_dict(self) -> dict[str, Any]:
        return {"mean_diff": self.mean_diff, "ci95": list(self.ci95), "n_sequences": self.n_sequences,
                "n_clusters": self.n_clusters, "seeds_a": self.seeds_a, "seeds_b": self.seeds_b,
                "n_boot": self.n_boot, "seed": self.seed, "pair_seeds": self.pair_seeds,
                "method": "paired percentile bootstrap over clusters of sequences and seeds"}


def _rows(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must be the per-sequence values [sequences] or [seeds, sequences] (at least one "
                         f"of each), got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} holds a value that is not finite (NaN or inf): a paired interval needs every "
                         f"sequence scored under every seed")
    return arr


def _cluster_index(clusters: Sequence[Any] | None, n: int) -> np.ndarray:
    if clusters is None:
        return np.arange(n)
    ids = list(clusters)
    if len(ids) != n:
        raise ValueError(f"clusters must give one id per sequence ({n}), got {len(ids)}")
    _, inv = np.unique(np.asarray([str(c) for c in ids]), return_inverse=True)
    return inv.reshape(-1)


def bootstrap_draws(n_clusters: int, seeds_a: int, seeds_b: int, *, n_boot: int, seed: int,
                    pair_seeds: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The replicates' draws, in the documented order: cluster indices ``[n_boot, n_clusters]``, ``a``'s seed
    indices ``[n_boot, seeds_a]`` and ``b``'s ``[n_boot, seeds_b]`` (the same array when ``pair_seeds``)."""
    rng = np.random.default_rng(seed)
    cl = rng.integers(0, n_clusters, size=(n_boot, n_clusters))
    sa = rng.integers(0, seeds_a, size=(n_boot, seeds_a))
    sb = sa if pair_seeds else rng.integers(0, seeds_b, size=(n_boot, seeds_b))
    return cl, sa, sb


def _counts(idx: np.ndarray, n: int) -> np.ndarray:
    """Draw indices ``[R, m]`` -> how often each of ``n`` items was drawn ``[R, n]``."""
    out = np.zeros((idx.shape[0], n), dtype=np.float64)
    np.add.at(out, (np.arange(idx.shape[0])[:, None], idx), 1.0)
    return out


def paired_interval(a: Any, b: Any, *, clusters: Sequence[Any] | None = None, n_boot: int = 10_000, seed: int = 0,
                    pair_seeds: bool = False, level: float = 0.95) -> PairedInterval:
    """``a - b`` over the same sequences and its ``level`` interval (module docstring).

    ``a``, ``b``: per-sequence values, ``[sequences]`` (one seed) or ``[seeds, sequences]``; the sequences in the
    same order in both.  ``clusters``: one id per sequence (e.g. the source file), None for every sequence its
    own cluster.  ``pair_seeds``: resample one set of seed indices for both rows (needs as many seeds each).
    """
    A, B = _rows(a, "a"), _rows(b, "b")
    if A.shape[1] != B.shape[1]:
        raise ValueError(f"a and b must hold the same sequences: a has {A.shape[1]}, b {B.shape[1]}")
    if pair_seeds and A.shape[0] != B.shape[0]:
        raise ValueError(f"pair_seeds needs as many seeds in both rows, got {A.shape[0]} and {B.shape[0]}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot must be an int >= 1, got {n_boot!r}")
    if not (isinstance(level, float) and 0.0 < level < 1.0):
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    n = A.shape[1]
    cid = _cluster_index(clusters, n)
    n_cl = int(cid.max()) + 1
    cl, sa, sb = bootstrap_draws(n_cl, A.shape[0], B.shape[0], n_boot=n_boot, seed=seed, pair_seeds=pair_seeds)
    w = _counts(cl, n_cl)[:, cid]  # [R, n]: how often each sequence counts in a replicate
    if pair_seeds:  # one seed draw for both rows: resample the per-seed differences themselves
        per_seq = _counts(sa, A.shape[0]) @ (A - B) / A.shape[0]
        point = float((A - B).mean())
    else:
        per_seq = _counts(sa, A.shape[0]) @ A / A.shape[0] - _counts(sb, B.shape[0]) @ B / B.shape[0]
        point = float(A.mean() - B.mean())
    reps = (per_seq * w).sum(1) / w.sum(1)
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(reps, [tail, 1.0 - tail])
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("the bootstrap produced a non-finite interval")
    return PairedInterval(mean_diff=point, ci95=(float(lo), float(hi)), n_sequences=n, n_clusters=n_cl,
                          seeds_a=A.shape[0], seeds_b=B.shape[0], n_boot=n_boot, seed=seed, pair_seeds=pair_seeds)


def verdict(result: PairedInterval | dict, *, lower_is_better: bool) -> str:
    """``"a better"`` / ``"b better"`` where the interval excludes 0, else ``"no difference shown"`` (the
    difference is ``a - b``; ``lower_is_better`` for an NLL increase, not for an accuracy)."""
    lo, hi = result.ci95 if isinstance(result, PairedInterval) else result["ci95"]
    if lo <= 0 <= hi:
        return "no difference shown"
    a_lower = hi < 0
    return "a better" if a_lower == lower_is_better else "b better"


def comparison(*, instrument: str, budget: int, a: str, b: str, values_a: Any, values_b: Any,
               lower_is_better: bool, clusters: Sequence[Any] | None = None, n_boot: int = 10_000,
               seed: int = 0) -> dict[str, Any]:
    """One entry of a ledger's ``comparisons``: ``instrument``, ``budget``, the rows ``a`` and ``b`` (names), and
    :func:`paired_interval`'s ``mean_diff`` / ``ci95`` (a minus b in the instrument's metric) with its settings
    and the :func:`verdict`."""
    r = paired_interval(values_a, values_b, clusters=clusters, n_boot=n_boot, seed=seed)
    return {"instrument": instrument, "budget": budget, "a": a, "b": b, **r.to_dict(),
            "lower_is_better": lower_is_better, "verdict": verdict(r, lower_is_better=lower_is_better)}


def _t_pdf(x: float, df: int) -> float:
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    return c * (1 + x * x / df) ** (-(df + 1) / 2)


def _t_cdf_above_half(x: float, df: int, steps: int = 4000) -> float:
    """P(T <= x) - 1/2 for x >= 0 (Simpson's rule on the density over [0, x])."""
    h = x / steps
    s = _t_pdf(0.0, df) + _t_pdf(x, df)
    s += sum((4 if k % 2 else 2) * _t_pdf(k * h, df) for k in range(1, steps))
    return s * h / 3


@functools.lru_cache(maxsize=64)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (``p`` in [0.5, 1)) of Student's t with ``df`` degrees of freedom (``df`` an int >= 1),
    by bisection on the integrated density: no statistics package needed."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an int >= 1, got {df!r}")
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p!r}")
    lo, hi = 0.0, 1.0
    while _t_cdf_above_half(hi, df) < p - 0.5:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf_above_half(mid, df) < p - 0.5 else (lo, mid)
    return (lo + hi) / 2


def seed_t_interval(a_seeds: Sequence[float], b_seeds: Sequence[float], *,
                    level: float = 0.95) -> dict[str, Any] | None:
    """The seed-level check beside a paired interval: the ``level`` t-interval of the per-seed mean differences.

    ``a_seeds`` / ``b_seeds``: each row's per-seed means over the same sequences.  The differences are
    ``a[s] - b[s]`` seed by seed when both rows have as many seeds (a row's seed ``s`` against the other's seed
    ``s``), ``a[s] - b[0]`` when ``b`` has one (a deterministic row), ``a[0] - b[s]`` when ``a`` has one.  Returns
    ``{"mean_diff", "ci95": [lo, hi], "n_seeds", "sd", "t", "method"}`` (``mean +- t * sd / sqrt(n)``, ``t`` the
    ``(1 + level) / 2`` quantile of Student's t with ``n - 1`` degrees of freedom), or None with fewer than two
    differences (no spread to read)."""
    a = [float(x) for x in a_seeds]
    b = [float(x) for x in b_seeds]
    if not a or not b or not all(math.isfinite(x) for x in a + b):
        raise ValueError(f"seed_t_interval needs finite per-seed means on both sides, got {a} and {b}")
    if not (isinstance(level, float) and 0.0 < level < 1.0):
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    if len(a) == len(b):
        d = [x - y for x, y in zip(a, b)]
    elif len(b) == 1:
        d = [x - b[0] for x in a]
    elif len(a) == 1:
        d = [a[0] - y for y in b]
    else:
        raise ValueError(f"seed_t_interval pairs seeds by index: {len(a)} and {len(b)} seeds do not pair")
    n = len(d)
    if n < 2:
        return None
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    t = t_quantile((1 + level) / 2, n - 1)
    half = t * sd / math.sqrt(n)
    return {"mean_diff": mean, "ci95": [mean - half, mean + half], "n_seeds": n, "sd": sd, "t": t,
            "method": f"t-interval over the {n} per-seed mean differences"}


BORDERLINE = 0.0005
"""An interval with a bound this close to 0 (or closer) is "borderline": another bootstrap draw may put it on the
other side."""


def strength(ci95: Sequence[float], *, lower_is_better: bool, margin: float = BORDERLINE) -> str:
    """What an interval of ``a - b`` shows, in words: ``"a better"`` / ``"b better"`` (:func:`verdict`), with
    ``" (borderline)"`` appended, or ``"no difference shown (borderline)"``, where a bound lies within ``margin`` of
    0."""
    lo, hi = (float(x) for x in ci95)
    v = verdict({"ci95": [lo, hi]}, lower_is_better=lower_is_better)
    return f"{v} (borderline)" if min(abs(lo), abs(hi)) <= margin else v
