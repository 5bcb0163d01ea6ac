"""Does a ``kvpop demo`` run reproduce the shipped results?  The rule of docs/DESIGN.md section 14.

The demo's figures fall in two kinds.  Rows that train nothing (dense, StreamingLLM, TOVA, H2O) are the same on
every CPU: their sums round differently on another CPU's kernels, but no trained state amplifies that into another
kept token.  Rows that train anything (the model, a scorer, DMS's gates) can amplify the last bits of their sums over
100-200 steps into other weights and so other kept tokens: on another CPU (or another kernel set of the same CPU:
ATen's ``ATEN_CPU_CAPABILITY``, MKL's ``MKL_CBWR``) they move.  That includes ``kvpop-mlp``, an MLP scorer trained
against the frozen model: it moved on lookahead by up to 0.059 under ``avx512`` with ``MKL_CBWR=COMPATIBLE``
(2026-12-05), since its labels come from the frozen model's attention, whose matrix products that MKL path orders
differently.  For those rows the shipped ``bands.json`` holds the
largest move of any of them measured across kernel sets, per task; a cell reproduces when it is within its row's
band of the shipped cell (exact rows: band 0).

:func:`compare` applies the rule; ``kvpop demo`` prints its verdict after each task it ran with the shipped
settings, and ``python -m kvpop.demo.reproduce OUT`` compares a finished run.  :func:`measure_bands` makes
``bands.json`` from runs of the demo under several kernel sets (how: the file's ``command``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SHIPPED", "BANDS", "EXACT_POLICIES", "Verdict", "compare", "measure_bands", "measured_moves",
           "load_bands", "main"]

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "demo_results"
"""The shipped results, one directory per task."""
BANDS = SHIPPED / "bands.json"
EXACT_POLICIES = ("dense", "streaming", "tova", "h2o")
"""Rows the rule holds to the shipped cell exactly on any CPU: those that train nothing."""


def _cells(results: Mapping[str, Any]) -> dict[tuple[str, int, int], float]:
    return {(r["policy"], int(r["length"]), int(r["budget"])): float(r["accuracy"]) for r in results["rows"]}


@dataclass
class Verdict:
    """One task's comparison: ``equal`` / ``within`` / ``outside`` cells, each ``(policy, length, budget, got,
    shipped, band)``; ``missing`` / ``extra``: cells only the shipped run / only this run has."""

    task: str
    equal: list = field(default_factory=list)
    within: list = field(default_factory=list)
    outside: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    extra: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.outside or self.missing or self.extra)

    def line(self) -> str:
        n = len(self.equal) + len(self.within) + len(self.outside)
        s = (f"{self.task}: against the shipped results, {len(self.equal)} of {n} cells equal, {len(self.within)} "
             f"within their row's band (rows that train the model, an mLSTM or DMS move with the CPU's kernels: "
             f"docs/DESIGN.md section 14), {len(self.outside)} outside")
        if self.outside:
            worst = max(self.outside, key=lambda c: abs(c[3] - c[4]) - c[5])
            s += (f" (largest: {worst[0]} L={worst[1]} B={worst[2]}: {worst[3]:.3f}, shipped {worst[4]:.3f}, "
                  f"band {worst[5]:.3f})")
        if self.missing or self.extra:
            s += f"; {len(self.missing)} shipped cells not run, {len(self.extra)} cells the shipped run lacks"
        return s


def load_bands(path: str | Path | None = None) -> dict[str, dict[str, float]]:
    """``{task: {policy: band}}`` from ``bands.json`` (default: the shipped one)."""
    return json.loads(Path(path if path is not None else BANDS).read_text())["bands"]


def compare(results: Mapping[str, Any], shipped: Mapping[str, Any], bands: Mapping[str, float], *,
            task: str | None = None) -> Verdict:
    """Every cell of ``results`` against ``shipped`` under the rule: ``EXACT_POLICIES`` exactly, any other
    policy within ``bands[policy]`` (a policy without a band must be exact).  A cell is compared at the 4
    decimals ``results.json`` is read at (accuracies are ratios of counts)."""
    v = Verdict(task or str(results.get("task", "?")))
    got, ref = _cells(results), _cells(shipped)
    for key in sorted(ref.keys() - got.keys()):
        v.missing.append(key)
    for key in sorted(got.keys() - ref.keys()):
        v.extra.append(key)
    for key in sorted(got.keys() & ref.keys()):
        policy = key[0]
        band = 0.0 if policy in EXACT_POLICIES else float(bands.get(policy, 0.0))
        a, b = got[key], ref[key]
        diff = abs(a - b)
        cell = (*key, a, b, band)
        if math.isclose(a, b, rel_tol=0.0, abs_tol=5e-5):
            v.equal.append(cell)
        elif diff <= band + 5e-5:
            v.within.append(cell)
        else:
            v.outside.append(cell)
    return v


def measured_moves(runs: Sequence[Mapping[str, Any]], shipped: Mapping[str, Any]) -> dict[str, float]:
    """Per policy outside ``EXACT_POLICIES``, the largest ``|accuracy - shipped|`` over the cells of ``runs`` (the
    same demo under other kernel sets); 0 for a policy no run moved."""
    ref = _cells(shipped)
    out = {key[0]: 0.0 for key in ref if key[0] not in EXACT_POLICIES}
    for res in runs:
        for key, a in _cells(res).items():
            if key[0] in out and key in ref:
                out[key[0]] = max(out[key[0]], abs(a - ref[key]))
    return dict(sorted(out.items()))


def measure_bands(runs: Sequence[Mapping[str, Any]], shipped: Mapping[str, Any]) -> dict[str, float]:
    """One task's bands: every policy outside ``EXACT_POLICIES`` gets the task's largest move of any such policy
    (:func:`measured_moves`), rounded up to 3 decimals.  One band for all the rows that train: which of them a
    kernel set moves is chance (a row still under one set moved under another in every set measured), so a row
    seen still is not promised to stay."""
    moves = measured_moves(runs, shipped)
    band = math.ceil(round(max(moves.values(), default=0.0) * 1000, 6)) / 1000  # 0.052 stays 0.052
    return {p: band for p in moves}


def exact_moves(runs: Sequence[Mapping[str, Any]], shipped: Mapping[str, Any]) -> list[tuple]:
    """Cells of ``EXACT_POLICIES`` that a run moved (the rule says none can)."""
    ref = _cells(shipped)
    return [(*key, a, ref[key]) for res in runs for key, a in _cells(res).items()
            if key[0] in EXACT_POLICIES and key in ref and not math.isclose(a, ref[key], abs_tol=5e-5)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvpop.demo.reproduce OUT [--shipped DIR]``: each task of a finished demo in ``OUT`` against the
    shipped results; exit 0 when every cell reproduces, 1 when one does not."""
    ap = argparse.ArgumentParser(prog="python -m kvpop.demo.reproduce", description=main.__doc__)
    ap.add_argument("out", type=Path, help="a finished `kvpop demo --out OUT` directory")
    ap.add_argument("--shipped", type=Path, default=SHIPPED, help="the results to compare with (default: shipped)")
    args = ap.parse_args(argv)
    if not (args.shipped / "bands.json").is_file():
        ap.error(f"--shipped {args.shipped} holds no bands.json (the bands of the rows that move with the CPU's "
                 f"kernels): give a directory of shipped demo results")
    bands = load_bands(args.shipped / "bands.json")
    tasks = [d.name for d in sorted(args.out.iterdir()) if (d / "results.json").is_file()] if args.out.is_dir() else []
    if not tasks:
        ap.error(f"{args.out} holds no finished task (no <task>/results.json): give the --out of a finished "
                 f"kvpop demo run")
    ok = True
    for task in tasks:
        if not (args.shipped / task / "results.json").is_file():
            print(f"{task}: no shipped results to compare with", file=sys.stderr)
            continue
        v = compare(json.loads((args.out / task / "results.json").read_text()),
                    json.loads((args.shipped / task / "results.json").read_text()), bands.get(task, {}), task=task)
        print(v.line())
        for c in v.outside:
            print(f"  outside: {c[0]} L={c[1]} B={c[2]}: {c[3]:.4f}, shipped {c[4]:.4f}, band {c[5]:.3f}")
        ok = ok and v.ok
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
