"""The real-text instrument: the oracle's NLL on byte-level code (``python -m studies.realtext``).

The corpus is :mod:`studies.realtext_corpus` (installed packages' source and documentation, split by
file, shipped validation and test splits in ``kvpop/data/realtext``); the model is
``kvpop/data/tiny_qwen3_code`` (``kvpop pretrain --data``, its ``TRAINING.md``).  The learned policies and
the fixed rules are measured by ``kvpop eval --data`` (:mod:`kvpop.evaluation.trace_eval`); this module adds the
*oracle*: the teacher's exact label (``mask_source="teacher"``, ``target_source="teacher"``: the frozen
dense model's own attention, pooled by ``label``) used directly as the eviction priority at a fixed decay
``gamma``, no scorer.  It is scored exactly as ``kvpop eval --data`` scores a policy: teacher-forced
next-token NLL at every position ``>= max(budgets)`` (the same positions for every budget), minus the
dense model's on the same positions (:func:`oracle_rows`).

::

    python -m studies.realtext oracle --data kvpop/data/realtext/validation.jsonl --budgets 64,128,256 \\
        --labels mean,max,power:4 --gammas 0.9999,0.999,0.995,0.99 --out oracle_valid.json

``--labels`` takes ``mean``, ``max`` and ``power:A`` (the power mean with exponent ``A``).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvpop.core.attention import set_teacher_targets, teacher_targets
from kvpop.core.patching import patch

from .label_study import oracle_config
from .paths import DATA, parse
from .realtext_corpus import SHIPPED_DIR

__all__ = ["SHIPPED_MODEL", "SHIPPED_DIR", "parse_labels", "oracle_logits", "oracle_rows", "table",
           "head_adaptive_rows", "main"]

SHIPPED_MODEL = DATA / "tiny_qwen3_code"
"""The byte-level Qwen3 pre-trained on the corpus's train split."""


def parse_labels(spec: str) -> list[tuple[str, float]]:
    """``"mean,max,power:4"`` -> ``[("mean", 1.0), ("max", 1.0), ("power", 4.0)]``."""
    out = []
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        name, _, power = part.partition(":")
        if name not in ("mean", "max", "power"):
            raise ValueError(f"unknown label {name!r} in --labels {spec!r}; allowed: mean, max, power:A")
        if name == "power":
            try:
                a = float(power)
            except ValueError:
                raise ValueError(f"--labels: power needs its exponent, power:A with A > 0 (got {part!r})") from None
            if not a > 0:
                raise ValueError(f"--labels: the power mean's exponent must be > 0, got {part!r}")
        elif power:
            raise ValueError(f"--labels: {name} takes no exponent (got {part!r})")
        else:
            a = 1.0
        out.append((name, a))
    if not out:
        raise ValueError(f"--labels lists no label (got {spec!r})")
    return out


@torch.no_grad()
def oracle_logits(base: nn.Module, oracle: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[1, L, V]`` of the patched ``oracle`` on one sequence, its priorities the teacher's labels
    computed from ``base`` (the unpatched dense model) on the same sequence."""
    from kvpop.core.layer import kvpop_layers

    cfg = kvpop_layers(oracle)[0].config
    ids = ids.reshape(1, -1)
    with teacher_targets(base, cfg) as store:
        base(ids, use_cache=False)
    set_teacher_targets(oracle, dict(store))
    try:
        return oracle(ids, use_cache=False).logits
    finally:
        set_teacher_targets(oracle, None)


@torch.no_grad()
def oracle_rows(base: nn.Module, traces: Sequence[torch.Tensor], *, budgets: Sequence[int],
                labels: Sequence[tuple[str, float]], gammas: Sequence[float], sinks: int = 4,
                window: int = 32, progress: bool = True) -> list[dict[str, Any]]:
    """One row per (label, gamma, budget): NLL, dense NLL, their difference and top-1 agreement with dense at
    every position ``>= max(budgets)`` of ``traces`` (as :func:`kvpop.evaluation.trace_eval.evaluate_traces`)."""
    from kvpop.evaluation.trace_eval import sequence_scores

    budgets = sorted({int(b) for b in budgets})
    least = sinks + window + 1
    if budgets[0] < least:
        raise ValueError(f"budget {budgets[0]} is below sinks + window + 1 = {least}")
    start = budgets[-1]
    traces = [t.reshape(-1).long() for t in traces if t.numel() - 1 > start]
    if not traces:
        raise ValueError(f"no trace is longer than the largest budget + 1 ({start + 1})")
    dense = [sequence_scores(base(t[None], use_cache=False).logits, t, start) for t in traces]
    rows = []
    for label, power in labels:
        for gamma in gammas:
            for b in budgets:
                t0 = time.time()
                m = patch(copy.deepcopy(base), oracle_config(label, power, gamma, budget=b, sinks=sinks,
                                                             window=window)).eval()
                nll = dnll = 0.0
                agree = n = 0
                for t, (d_nll, d_arg) in zip(traces, dense):
                    p_nll, p_arg = sequence_scores(oracle_logits(base, m, t), t, start)
                    nll += float(p_nll.sum())
                    dnll += float(d_nll.sum())
                    agree += int((p_arg == d_arg).sum())
                    n += int(p_nll.numel())
                row = {"policy": "oracle", "label": label, "power": power, "gamma": gamma, "budget": b,
                       "scored_from": start, "positions": n, "n_sequences": len(traces), "nll": nll / n,
                       "dense_nll": dnll / n, "delta_nll": (nll - dnll) / n, "top1_agreement": agree / n,
                       "wall_s": round(time.time() - t0, 1)}
                rows.append(row)
                if progress:
                    print(json.dumps(row), flush=True)
    return rows


def head_adaptive_rows(base: nn.Module, scorers: str, traces: Sequence[torch.Tensor], valid: Sequence[torch.Tensor], *,
                       budgets: Sequence[int], label: str, power: float, gamma: float, sinks: int = 4,
                       window: int = 32, progress: bool = True) -> list[dict[str, Any]]:
    """Head-adaptive fixed budgets (``KVpopConfig.head_budgets``, :mod:`kvpop.core.budgets`) on real text.

    For each budget ``B``: the importance of each (layer, KV head)'s long-range slots is measured on the
    ``valid`` sequences with the trained ``scorers`` (:func:`kvpop.core.budgets.ablation_importance`) and
    the same total ``L * H * B`` is shared by :func:`kvpop.core.budgets.allocate`; then, on ``traces``, the
    scorers and the oracle (``label``/``power`` at ``gamma``) run with uniform and with those budgets.  Every
    row goes through the teacher-forced full-sequence forward of the patched model (the schedule of a
    ``KVpopCache`` prefill; the cache does not take per-head budgets), scored as :func:`oracle_rows`."""
    from kvpop.core.budgets import ablation_importance, allocate
    from kvpop.core.checkpoint import load_scorers, read_scorer_config
    from kvpop.core.layer import kvpop_layers
    from kvpop.evaluation.trace_eval import sequence_scores

    budgets = sorted({int(b) for b in budgets})
    start = budgets[-1]
    traces = [t.reshape(-1).long() for t in traces if t.numel() - 1 > start]
    scfg = read_scorer_config(scorers)
    dense = [sequence_scores(base(t[None], use_cache=False).logits, t, start) for t in traces]
    vbatch = [torch.stack([v.reshape(-1).long() for v in valid])]
    rows = []
    for b in budgets:
        t0 = time.time()
        learned = load_scorers(patch(copy.deepcopy(base), scfg, sinks=sinks, window=window, budget=b), scorers).eval()
        layers = kvpop_layers(learned)
        imp = ablation_importance(learned, vbatch, config=layers[0].config)
        hb = allocate(imp, total=len(layers) * layers[0].num_kv_heads * b, sinks=sinks, window=window)
        imp_s = round(time.time() - t0, 1)
        variants = []
        for name, head_budgets in (("uniform", None), ("head-adaptive", hb)):
            m = patch(copy.deepcopy(learned), budget=b, head_budgets=head_budgets).eval()
            variants.append((f"{'kvpop-mlp' if scfg.scorer == 'mlp' else 'kvpop-mlstm'} ({name}, full forward)",
                             m, False, head_budgets))
            ocfg = oracle_config(label, power, gamma, budget=b, sinks=sinks, window=window)
            if head_budgets is not None:
                ocfg = ocfg.replace(head_budgets=head_budgets)
            variants.append((f"oracle ({label}, gamma {gamma:g}; {name})", patch(copy.deepcopy(base), ocfg).eval(),
                             True, head_budgets))
        for name, m, is_oracle, head_budgets in variants:
            t1 = time.time()
            nll = dnll = 0.0
            agree = n = 0
            for t, (d_nll, d_arg) in zip(traces, dense):
                logits = oracle_logits(base, m, t) if is_oracle else m(t[None], use_cache=False).logits
                p_nll, p_arg = sequence_scores(logits, t, start)
                nll += float(p_nll.sum())
                dnll += float(d_nll.sum())
                agree += int((p_arg == d_arg).sum())
                n += int(p_nll.numel())
            row = {"policy": name, "budget": b, "scored_from": start, "positions": n, "n_sequences": len(traces),
                   "nll": nll / n, "dense_nll": dnll / n, "delta_nll": (nll - dnll) / n, "top1_agreement": agree / n,
                   "head_budgets": head_budgets, "importance": imp.tolist() if head_budgets is not None else None,
                   "importance_s": imp_s, "wall_s": round(time.time() - t1, 1)}
            rows.append(row)
            if progress:
                print(json.dumps({k: v for k, v in row.items() if k != "importance"}), flush=True)
    return rows


LEARNED = ("kvpop-mlp", "kvpop-mlstm", "kvpop-mlp-joint", "kvpop-mlstm-joint")


def table(evals: Sequence[dict], oracle: dict | None = None, *, goal_budget: int = 128) -> tuple[str, dict]:
    """Markdown of ``kvpop eval --data`` results (``results.json`` objects; rows of the same positions) and the
    oracle's rows: NLL increase over dense / top-1 agreement per policy and budget, then the goals at
    ``goal_budget`` (the best learned KVpop row <= 0.75x streaming's increase and below H2O's; each joint
    retrofit <= its scorer-only one).  Returns the markdown and the goals."""
    rows = [r for e in evals for r in e["rows"]]
    starts = {e["scored_from"] for e in evals} | ({oracle["rows"][0]["scored_from"]} if oracle else set())
    if len(starts) != 1:
        raise ValueError(f"the results score different positions (from {sorted(starts)}); give runs of the same "
                         f"budgets")
    dense = {round(r["dense_nll"], 6) for r in rows} | ({round(r["dense_nll"], 6) for r in oracle["rows"]}
                                                       if oracle else set())
    if len(dense) != 1:
        raise ValueError(f"the results have different dense NLLs {sorted(dense)}: not the same traces")
    cell: dict[tuple[str, int], dict] = {}
    for r in rows:
        cell.setdefault((r["policy"], r["budget"]), r)
    names = list(dict.fromkeys(r["policy"] for r in rows))
    for r in (oracle or {}).get("rows", []):
        name = f"oracle ({r['label']}" + (f" a={r['power']:g}" if r["label"] == "power" else "") + \
            f", gamma {r['gamma']:g})"
        cell[(name, r["budget"])] = r
        if name not in names:
            names.append(name)
    budgets = sorted({b for _, b in cell})
    lines = [f"NLL increase over dense (nats/token) / top-1 agreement with dense, at positions >= {starts.pop()} "
             f"(dense NLL {dense.pop():.4f} nats/token on the same positions)", "",
             "| policy | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(
            f"{cell[(n, b)]['delta_nll']:+.4f} / {cell[(n, b)]['top1_agreement']:.3f}" if (n, b) in cell else "-"
            for b in budgets) + " |")
    d = {p: cell[(p, goal_budget)]["delta_nll"] for p in names if (p, goal_budget) in cell}
    goals: dict[str, Any] = {"budget": goal_budget}
    learned = {p: d[p] for p in LEARNED if p in d}
    if learned and "streaming" in d:
        best = min(learned, key=learned.get)
        goals["best_learned"] = best
        goals["best_vs_streaming"] = {"best": learned[best], "limit": 0.75 * d["streaming"],
                                      "met": learned[best] <= 0.75 * d["streaming"]}
        if "h2o" in d:
            goals["best_vs_h2o"] = {"best": learned[best], "h2o": d["h2o"], "met": learned[best] < d["h2o"]}
    for s in ("kvpop-mlp", "kvpop-mlstm"):
        if s in d and f"{s}-joint" in d:
            goals[f"{s}-joint_vs_scorer_only"] = {"joint": d[f"{s}-joint"], "scorer_only": d[s],
                                                  "met": d[f"{s}-joint"] <= d[s]}
    return "\n".join(lines), goals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.realtext", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("oracle", help="the oracle's NLL increase over dense for each label, decay and budget")
    o.add_argument("--model", default=str(SHIPPED_MODEL))
    o.add_argument("--data", required=True, help="JSONL of token ids (e.g. kvpop/data/realtext/validation.jsonl)")
    o.add_argument("--budgets", default="64,128,256")
    o.add_argument("--labels", default="mean,max,power:4")
    o.add_argument("--gammas", default="0.999")
    o.add_argument("--sinks", type=int, default=4)
    o.add_argument("--window", type=int, default=32)
    o.add_argument("--n-sequences", type=int, default=None, help="the first N records (default all)")
    o.add_argument("--threads", type=int, default=1)
    o.add_argument("--out", required=True, help="JSON file for the rows")
    h = sub.add_parser("head-adaptive", help="head-adaptive budgets from a scorer run's ablation importance on "
                       "validation, beside uniform, for the scorers and the oracle")
    h.add_argument("--model", default=str(SHIPPED_MODEL))
    h.add_argument("--scorers", required=True, help="a scorer file (kvpop train --out DIR: DIR/scorers.safetensors)")
    h.add_argument("--valid", required=True, help="validation JSONL (the importance)")
    h.add_argument("--n-valid", type=int, default=8)
    h.add_argument("--data", required=True, help="test JSONL")
    h.add_argument("--n-sequences", type=int, default=None)
    h.add_argument("--budgets", default="64,128,256")
    h.add_argument("--label", default="mean")
    h.add_argument("--gamma", type=float, default=0.999)
    h.add_argument("--sinks", type=int, default=4)
    h.add_argument("--window", type=int, default=32)
    h.add_argument("--out", required=True)
    t = sub.add_parser("table", help="one table of kvpop eval --data results and the oracle's rows, with the goals")
    t.add_argument("--eval", action="append", required=True, help="a kvpop eval --data results.json (repeatable)")
    t.add_argument("--oracle", default=None, help="the oracle's JSON (python -m studies.realtext oracle)")
    t.add_argument("--goal-budget", type=int, default=128)
    a = parse(p, argv)
    if a.cmd == "head-adaptive":
        from kvpop.evaluation.trace_eval import load_model
        from kvpop.training import data as data_io

        t0 = time.time()
        torch.set_num_threads(1)
        [(label, power)] = parse_labels(a.label)
        base = load_model(a.model)
        for q in base.parameters():
            q.requires_grad_(False)
        test = [torch.tensor(r) for r in data_io.read_jsonl(a.data, vocab_size=base.config.vocab_size)][:a.n_sequences]
        valid = [torch.tensor(r) for r in data_io.read_jsonl(a.valid, vocab_size=base.config.vocab_size)][:a.n_valid]
        with torch.no_grad():
            rows = head_adaptive_rows(base, a.scorers, test, valid, budgets=[int(x) for x in a.budgets.split(",")],
                                      label=label, power=power, gamma=a.gamma, sinks=a.sinks, window=a.window)
        res = {"command": "python -m studies.realtext " + " ".join(sys.argv[1:] if argv is None else argv),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": round(time.time() - t0, 1),
               "rows": rows}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    if a.cmd == "table":
        try:
            md, goals = table([json.loads(Path(x).read_text()) for x in a.eval],
                              json.loads(Path(a.oracle).read_text()) if a.oracle else None, goal_budget=a.goal_budget)
        except (ValueError, OSError, KeyError) as e:
            print(f"realtext table: error: {e}", file=sys.stderr)
            return 2
        print(md + "\n\n" + json.dumps(goals, indent=1))
        return 0
    from kvpop.evaluation.trace_eval import load_model
    from kvpop.training import data as data_io

    t0 = time.time()
    try:
        labels = parse_labels(a.labels)
        gammas = [float(x) for x in a.gammas.split(",") if x.strip()]
        budgets = [int(x) for x in a.budgets.split(",") if x.strip()]
        torch.set_num_threads(max(1, a.threads))
        base = load_model(a.model)
        records = data_io.read_jsonl(a.data, vocab_size=base.config.vocab_size)
        traces = [torch.tensor(r, dtype=torch.int64) for r in records][:a.n_sequences]
        rows = oracle_rows(base, traces, budgets=budgets, labels=labels, gammas=gammas, sinks=a.sinks,
                           window=a.window)
    except (ValueError, FileNotFoundError) as e:
        print(f"realtext oracle: error: {e}", file=sys.stderr)
        return 2
    res = {"command": "python -m studies.realtext " + " ".join(sys.argv[1:] if argv is None else argv),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": a.model, "data": a.data,
           "sinks": a.sinks, "window": a.window, "wall_s": round(time.time() - t0, 1), "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    best = min(rows, key=lambda r: (r["budget"], r["delta_nll"]) if not math.isnan(r["delta_nll"]) else (0, 1e9))
    print(json.dumps({"wrote": a.out, "wall_s": res["wall_s"], "best_at_smallest_budget": best}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
