"""What a ``kvpop eval --problems`` run writes at the end (:func:`finish_problems`): ``results.json``,
``table.md`` (:func:`format_problems_table`), ``generations.jsonl`` (one line per sample, :func:`generations`)
and ``accuracy_vs_budget.png`` (:func:`plot_problems`)."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from kvpop.core.files import write_json

from .resume import RESULTS_LOG, load_log

__all__ = ["generations", "format_problems_table", "plot_problems", "finish_problems"]


def generations(results_rows: Mapping[str, dict]) -> list[dict]:
    """``generations.jsonl``'s lines from the per-problem rows (one per sample)."""
    out = []
    for row in results_rows.values():
        for s, smp in enumerate(row["samples"]):
            out.append({"policy": row["policy"], "budget": row["budget"], "id": row["id"], "sample": s, **smp})
    return out


def format_problems_table(results: dict) -> str:
    """A markdown table: one row per policy and budget (maj@N and pass@N only with N > 1 samples)."""
    n = results["settings"]["samples"]
    many = [f"maj@{n}", f"pass@{n}"] if n > 1 else []
    head = ["policy", "budget", "pass@1", "rel. to dense", *many, "mean gen. length", "peak cache / seq."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        rel = r["relative_pass@1"]
        b = r["peak_cache_bytes_per_sequence"]
        size = f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"
        lines.append("| " + " | ".join([r["policy"], "-" if r["budget"] is None else str(r["budget"]),
                                        f"{r['pass@1']:.3f}", "-" if rel is None else f"{rel:.0%}",
                                        *(f"{r[k]:.3f}" for k in many), f"{r['mean_length']:.1f}",
                                        size]) + " |")
    return "\n".join(lines)


def plot_problems(results: dict, path: str | os.PathLike) -> None:
    """pass@1 vs budget, one line per policy, dense as a dashed line (PNG, matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    pols = list(dict.fromkeys(r["policy"] for r in results["rows"]))
    for p in pols:
        pts = sorted((r["budget"], r["pass@1"]) for r in results["rows"]
                     if r["policy"] == p and r["budget"] is not None)
        if p == "dense":
            d = next(r["pass@1"] for r in results["rows"] if r["policy"] == "dense")
            ax.axhline(d, color="black", linestyle="--", linewidth=1, label="dense")
        elif pts:
            ax.plot([b for b, _ in pts], [a for _, a in pts], marker="o", label=p)
    bs = sorted({r["budget"] for r in results["rows"] if r["budget"] is not None})
    if bs:
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs)
        ax.set_xticklabels([str(b) for b in bs])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("cache budget B (entries per KV head)")
    ax.set_ylabel("pass@1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def finish_problems(results: dict, out: Path | None, plot: bool) -> str:
    """Write ``results.json``, ``table.md``, ``generations.jsonl`` and the plot into ``out``; returns the table."""
    table = format_problems_table(results)
    if out is not None:
        write_json(out / "results.json", results)
        (out / "table.md").write_text(table + "\n")
        log = load_log(out / RESULTS_LOG)
        tmp = out / "generations.jsonl.tmp"
        with tmp.open("w") as f:
            for g in generations(log):
                f.write(json.dumps(g) + "\n")
        os.replace(tmp, out / "generations.jsonl")
        if plot:
            plot_problems(results, out / "accuracy_vs_budget.png")
    return table
