"""Teacher-forced quality of eviction policies on a user's own model and traces (``kvpop eval --data``).

For each trace (token ids, batch 1) and each (policy, budget ``B``), the model runs teacher-forced
over the whole trace through the code a user runs (:func:`kvpop.evaluation.evaluate.policy_logits`): the static
policies (``streaming``, ``fixed-finetune``, ``kvpop-*``) through the patched model's sparse-attention
prefill with the policy's eviction schedule, ``tova``/``h2o`` through a ``KVpopCache`` that decodes
token by token, ``dense`` through the unpatched model.  Every policy at every budget is scored over the
same positions: ``p >= max(budgets)`` (there every budget's cache holds ``p + 1 > B`` tokens, so
eviction has happened under each), so the columns of the table compare and the dense reference is one
number; at each such position the logits predict ``input_ids[p + 1]``.  (Scoring each budget from its own
``B`` would make the dense reference, and the positions, change from column to column.)  Per (policy,
budget):

* ``nll``: mean next-token negative log-likelihood (nats) over those positions of all traces;
* ``dense_nll`` and ``delta_nll = nll - dense_nll``: the dense model on the same positions;
* ``top1_agreement``: fraction of those positions where the policy's greedy prediction equals the
  dense model's.
* ``per_sequence``: each trace's own ``delta_nll`` over its positions, in the order of the traces (``None`` for a
  trace too short to score): what a paired selection (:func:`kvpop.training.search.prefer`) and a paired
  interval (:func:`studies.paired.paired_interval`) compare.

Results: :func:`trace_results` (``results.json``), :func:`format_trace_table`,
:func:`plot_trace_results`.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvpop.baselines.dms.budget import RANGES
from kvpop.baselines.dms.budget import row_stats as dms_row_stats
from kvpop.policies import policy_of, row_order

from .evaluate import (
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
    DMS_POLICIES,
    POLICIES,
    _check_policies,
    cost_kind,
    policy_logits,
    save_figure,
    trained_label,
)

__all__ = ["TraceEvalConfig", "load_model", "sequence_scores", "evaluate_traces", "trace_results",
           "format_trace_table", "plot_trace_results"]

FRACTIONS = (0.0625, 0.125, 0.25)


@dataclass
class TraceEvalConfig:
    """What :func:`evaluate_traces` measures.

    Attributes:
        budgets: cache budgets (entries per layer and KV head); default 6.25 %, 12.5 % and 25 % of
            the longest trace.
        sinks, window: shared by every policy (``budget >= sinks + window + 1``).
        policies: policies to run (``dense`` is always measured, as the reference).
        progress: show a tqdm bar.
        dms_thresholds: DMS's gate threshold per budget, fixed for every trace (chosen on validation
            traces, :func:`dms_thresholds_on`); ``None`` (default): calibrated on each evaluated trace itself
            (the rows say which, ``dms_threshold_from``).
        trained_budgets: the budgets the evaluated runs were trained at: without ``budgets``, a default below
            ``sinks + window + 1`` (short traces) is left out and these (those that fit) measured instead.
        note: what :meth:`resolve` changed of the defaults (None: nothing), for the command to say.
    """

    budgets: Sequence[int] | None = None
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    policies: Sequence[str] = POLICIES
    progress: bool = True
    dms_thresholds: Mapping[int, float] | None = None
    trained_budgets: Sequence[int] = ()
    note: str | None = None

    def resolve(self, lengths: Sequence[int]) -> None:
        """Fill in the default budgets for traces of ``lengths`` tokens and check them."""
        if not lengths:
            raise ValueError("no traces to evaluate")
        longest = max(lengths)
        budgets = (list(self.budgets) if self.budgets is not None
                   else [int(round(f * longest)) for f in FRACTIONS])
        least = self.sinks + self.window + 1
        if self.budgets is None and any(b < least for b in budgets):  # short traces: the defaults that fit
            fit = [b for b in (*budgets, *self.trained_budgets) if least <= b < longest - 1]
            if fit:
                self.note = (f"6.25/12.5/25% of the longest trace ({longest} tokens) give budgets {budgets}, some "
                             f"below sinks + window + 1 = {least}; measured at {sorted(set(fit))} (those that fit and "
                             f"the runs' trained budgets); give --budgets to choose")
                budgets = fit
        small = [b for b in budgets if b < least]
        if small:
            how = "" if self.budgets is not None else (f" (the defaults are 6.25/12.5/25% of the longest trace, "
                                                       f"{longest} tokens)")
            raise ValueError(f"budget(s) {small}{how} below sinks + window + 1 = {self.sinks} + {self.window} + 1 "
                             f"= {least}: give --budgets, or lower --window/--sinks")
        useless = [b for b in budgets if b >= longest - 1]
        if useless:
            raise ValueError(f"budget(s) {useless} leave no position past the budget in traces of at most "
                             f"{longest} tokens; give smaller --budgets")
        self.budgets = sorted({int(b) for b in budgets})
        self.policies = _check_policies(self.policies)


def dms_thresholds_on(model: nn.Module, traces: Sequence[torch.Tensor], budgets: Sequence[int]) -> dict[int, float]:
    """DMS's gate threshold per budget chosen on ``traces`` (validation data, never the evaluated traces): the
    largest threshold at which the mean entries per layer and KV head after the traces, over all of them, stay
    within the budget (``kvpop.baselines.dms.budget.calibrate_threshold``; traces of one length as one batch,
    else the median of the per-trace thresholds)."""
    from kvpop.baselines.dms.budget import calibrate_threshold

    traces = [t.reshape(-1).long() for t in traces]
    if not traces:
        raise ValueError("no validation traces to choose DMS's threshold on")
    out = {}
    for b in budgets:
        if len({int(t.numel()) for t in traces}) == 1:
            out[int(b)] = float(calibrate_threshold(model, torch.stack(traces), int(b)))
        else:
            out[int(b)] = float(torch.tensor([calibrate_threshold(model, t, int(b)) for t in traces]).median())
    return out


def load_model(path: str | os.PathLike) -> nn.Module:
    """A causal LM saved with ``save_pretrained`` in a local directory (any family transformers knows;
    ``kvpop.patch`` says which it supports), in float32 and eval mode."""
    from kvpop.models import load_model_dir

    return load_model_dir(path, dtype=torch.float32).eval()  # config.json checked before any allocation


def sequence_scores(logits: torch.Tensor, input_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position NLL (float64 ``[n]``) and greedy prediction (int64 ``[n]``) at positions
    ``start .. L - 2`` of one sequence (``logits [1, L, V]`` or ``[L, V]``, ``input_ids [L]``)."""
    lg = logits.reshape(-1, logits.shape[-1])[start:-1].float()
    tgt = input_ids.reshape(-1)[start + 1:].to(lg.device)
    nll = -torch.log_softmax(lg, dim=-1).gather(1, tgt[:, None])[:, 0]
    return nll.double().cpu(), lg.argmax(-1).cpu()


def evaluate_traces(models: Mapping[str, nn.Module], traces: Sequence[torch.Tensor],
                    config: TraceEvalConfig | None = None, *, on_row: Any = None) -> list[dict]:
    """NLL, its increase over dense and top-1 agreement with dense of every policy in ``models`` at
    every budget of ``config`` on ``traces`` (int64 ``[L_i]`` each).

    ``models``: policy name -> model from :func:`kvpop.evaluation.evaluate.policy_model` (``"dense"`` -> the
    unpatched base, required).  ``on_row`` is called with each row as soon as it is measured.
    Returns the rows (one per (policy, budget); see the module docstring).
    """
    cfg = config or TraceEvalConfig()
    if "dense" not in models:
        raise ValueError("evaluate_traces needs the dense model (models['dense']) as the reference")
    _check_policies(models)
    traces = [t.reshape(-1).long() for t in traces]
    cfg.resolve([int(t.numel()) for t in traces])
    policies = [p for p in cfg.policies if p in models and p != "dense"]
    start = max(cfg.budgets)  # every policy and budget over the same positions (module docstring)
    bar = eta = None
    if cfg.progress:
        from kvpop.progress import CostETA, progress

        bar = progress(len(traces) * (1 + len(policies) * len(cfg.budgets)), desc="kvpop eval --data", eta=False)
        size = sum(int(t.numel()) for t in traces)
        eta = CostETA([("forward", size)] + [(cost_kind(p), size) for p in policies for _ in cfg.budgets])
        eta.start()
    dense = []  # per trace: (nll [L-1], argmax [L-1]) from position 0
    rows = []
    try:
        for t in traces:
            if bar is not None:
                bar.set_postfix_str("dense")
            dense.append(sequence_scores(policy_logits(models["dense"], t, "dense"), t, 0))
            if bar is not None:
                eta.done("forward", int(t.numel()))
                bar.set_postfix_str(f"dense, {eta.text()}")
                bar.update(1)
        for p in policies:
            for b in cfg.budgets:
                if bar is not None:
                    bar.set_postfix_str(f"{p} B={b}")
                nll = dnll = 0.0
                agree = n = n_seq = 0
                per_seq: list[float | None] = []  # each trace's own delta NLL, for paired comparisons
                for t, (d_nll, d_arg) in zip(traces, dense):
                    if t.numel() - 1 <= start:  # no position past the largest budget
                        per_seq.append(None)
                        if bar is not None:
                            eta.done(cost_kind(p), 0)
                            eta.left[cost_kind(p)] -= int(t.numel())  # skipped: not run
                            bar.update(1)
                        continue
                    thr = (None if policy_of(p) not in DMS_POLICIES or cfg.dms_thresholds is None
                           else cfg.dms_thresholds[b])
                    p_nll, p_arg = sequence_scores(policy_logits(models[p], t, policy_of(p), b, threshold=thr), t,
                                                   start)
                    nll += float(p_nll.sum())
                    dnll += float(d_nll[start:].sum())
                    agree += int((p_arg == d_arg[start:]).sum())
                    n += int(p_nll.numel())
                    n_seq += 1
                    per_seq.append((float(p_nll.sum()) - float(d_nll[start:].sum())) / p_nll.numel())
                    if bar is not None:
                        eta.done(cost_kind(p), int(t.numel()))
                        bar.set_postfix_str(f"{p} B={b}, {eta.text()}")
                        bar.update(1)
                row = {"policy": p, "budget": int(b), "scored_from": start, "positions": n, "n_sequences": n_seq,
                       "nll": nll / n if n else math.nan, "dense_nll": dnll / n if n else math.nan,
                       "delta_nll": (nll - dnll) / n if n else math.nan,
                       "top1_agreement": agree / n if n else math.nan, "per_sequence": per_seq,
                       **dms_row_stats(models[p])}
                if policy_of(p) in DMS_POLICIES:
                    row["dms_threshold_from"] = ("validation traces" if cfg.dms_thresholds is not None
                                                 else "each evaluated trace")
                rows.append(row)
                if on_row is not None:
                    on_row(row)
        if not policies:  # dense alone: its NLL over the positions every budget's row would score
            for b in cfg.budgets:
                scored = [d_nll[start:] for t, (d_nll, _) in zip(traces, dense) if t.numel() - 1 > start]
                n = sum(int(x.numel()) for x in scored)
                dn = sum(float(x.sum()) for x in scored) / n if n else math.nan
                row = {"policy": "dense", "budget": int(b), "scored_from": start, "positions": n,
                       "n_sequences": len(scored), "nll": dn, "dense_nll": dn, "delta_nll": 0.0 if n else math.nan,
                       "top1_agreement": 1.0 if n else math.nan}
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    finally:
        if bar is not None:
            bar.close()
    return rows


def trace_results(rows: list[dict], cfg: TraceEvalConfig, *, lengths: Sequence[int],
                  extra: Mapping[str, Any] | None = None) -> dict:
    """The ``results.json`` object of ``kvpop eval --data``."""
    res = {"kind": "traces",
           "metric": "teacher-forced next-token NLL (nats) at positions >= the largest budget, the same for all",
           "scored_from": max(cfg.budgets), "budgets": list(cfg.budgets), "sinks": cfg.sinks, "window": cfg.window,
           "n_traces": len(lengths), "trace_lengths": {"min": min(lengths), "max": max(lengths),
                                                       "total": int(sum(lengths))},
           "rows": sorted(rows, key=lambda r: (row_order(r["policy"]), r["budget"]))}
    if extra:
        res.update(extra)
    return res


def format_trace_table(results: dict) -> str:
    """Markdown: a caption (the positions scored, the same for every column), one row per policy with per
    budget the NLL increase over dense and top-1 agreement (and, when ``results['trained']`` says, the
    budget each policy was trained at); then, when DMS ran, the entries its heads held."""
    rows = results["rows"]
    budgets = sorted({r["budget"] for r in rows})
    cell = {(r["policy"], r["budget"]): r for r in rows}
    start = results.get("scored_from", max(budgets) if budgets else 0)
    with_trained = bool(results.get("trained"))
    caption = (f"Next-token NLL increase over dense (nats/token) / top-1 agreement with dense, at every position "
               f">= {start} (the largest budget; the same positions in every column) of "
               f"{results.get('n_traces', '?')} traces; sinks {results.get('sinks')}, window {results.get('window')}.")
    head = ["policy"] + (["trained at"] if with_trained else []) + [f"B={b}" for b in budgets]
    lines = [caption, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dn = [cell.get((rows[0]["policy"], b), {}).get("dense_nll", math.nan) for b in budgets] if rows else []
    lines.append("| dense (NLL) | " + ("- | " if with_trained else "") + " | ".join(f"{x:.4f}" for x in dn) + " |")
    for p in sorted({r["policy"] for r in rows} - {"dense"}, key=row_order):
        line = [p] + ([trained_label(results, p)] if with_trained else [])
        for b in budgets:
            r = cell.get((p, b))
            line.append("-" if r is None else f"{r['delta_nll']:+.4f} / {r['top1_agreement']:.3f}")
        lines.append("| " + " | ".join(line) + " |")
    dms = [cell[("dms", b)] for b in budgets if ("dms", b) in cell and "dms_entries_mean" in cell[("dms", b)]]
    if dms:
        src = dms[0].get("dms_threshold_from", "each evaluated trace")
        match = ("where the validation traces' mean was matched to B" if src == "validation traces"
                 else "where each trace's mean is matched to B")
        lines += ["", f"DMS entries held per layer and KV head, mean [min, max] over heads (averaged over traces), "
                      f"gate threshold calibrated on {src}: at the last position ({match}), and each head's mean "
                      f"over each quarter of the positions.", ""]
        rng = [f"positions {100 * k // RANGES}-{100 * (k + 1) // RANGES}%" for k in range(RANGES)]
        lines += ["| budget | last position | " + " | ".join(rng) + " |", "|" + "---|" * (2 + RANGES)]
        for r in dms:
            by = r.get("dms_entries_by_range", [])
            lines.append(f"| B={r['budget']} | {r['dms_entries_mean']:.1f} [{r['dms_entries_min']:.0f}, "
                         f"{r['dms_entries_max']:.0f}] | "
                         + " | ".join(f"{x['mean']:.1f} [{x['min']:.0f}, {x['max']:.0f}]" for x in by) + " |")
    return "\n".join(lines)


def plot_trace_results(results: dict, path: str | os.PathLike) -> None:
    """PNG with two panels vs budget: NLL increase over dense, and top-1 agreement with dense."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for p in sorted({r["policy"] for r in rows}, key=row_order):
        pts = sorted((r["budget"], r["delta_nll"], r["top1_agreement"]) for r in rows if r["policy"] == p)
        if not pts:
            continue
        style = "-" if p.startswith("kvpop") else ":" if policy_of(p) in ("tova", "h2o") else "-."
        axes[0].plot([b for b, _, _ in pts], [d for _, d, _ in pts], style, marker="o", label=p)
        axes[1].plot([b for b, _, _ in pts], [a for _, _, a in pts], style, marker="o", label=p)
    bs = sorted({r["budget"] for r in rows})
    for ax, what in zip(axes, ("NLL increase over dense (nats/token)", "top-1 agreement with dense")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs)
        ax.set_xticklabels([str(b) for b in bs])
        ax.set_xlabel("cache budget B (entries per KV head)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].axhline(0.0, color="black", linestyle="--", linewidth=1)
    axes[1].set_ylim(0, 1.05)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(1, len(labels)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_figure(fig, path)
