"""Can a scorer tell the facts that will be read from the rest, given a clean label?  (lookahead task)

The demo trains KVpop's scorers on the method's own target, the attention a token receives from the
queries after it left the window.  When a retrofit fails on the lookahead task, two causes are
possible: the scorer cannot express the rule (a fact is needed iff the marker after it is ``KEEP``), or
the target does not single out the needed facts.  This probe separates them.

:func:`target_breakdown` measures the second: the mean log target of kept facts, dropped facts and
filler per layer and KV head of a dense model, and how many kept facts the target's own top-``k``
holds.  :func:`probe` measures the first: it trains a fresh scorer of each kind on the pre-RoPE keys and
values of one layer of the frozen dense model with a *clean* binary label (1 for a fact of a ``KEEP``
block, 0 for every other token) and reports, on validation sequences, how many kept facts its top-``k``
tokens of the record region hold (the fraction a cache with ``k`` long-range slots would keep).

::

    python -m studies.scorer_probe            # both scorers, layer 0, 300 steps (a few minutes)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpop.core.scorers import MLPScorer, MLSTMScorer
from kvpop.demo import lookahead_task as T

from .paths import parse

__all__ = ["layer_inputs", "target_breakdown", "probe", "main"]


def layer_inputs(model: nn.Module, input_ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys and values ``[B, Hkv, S, D]`` of one attention layer of a dense model (the key from the
    family's key tap, as ``kvpop.patch`` reads it; the value from ``v_proj``)."""
    from kvpop.models import adapter_for

    ad = adapter_for(model)
    attn = ad.attention_modules(model)[layer]
    hkv, d = ad.num_kv_heads(attn), ad.head_dim(attn)
    got: dict[str, torch.Tensor] = {}
    hooks = [ad.key_tap_module(attn).register_forward_hook(lambda m, a, o: got.__setitem__("k", o)),
             attn.v_proj.register_forward_hook(lambda m, a, o: got.__setitem__("v", o))]
    try:
        with torch.no_grad():
            model(input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    B, S = input_ids.shape
    k = ad.pre_rope_key(got["k"], d).transpose(1, 2).float()
    v = got["v"].reshape(B, S, hkv, d).transpose(1, 2).float()
    return k, v


def _label(ex: dict, S: int) -> torch.Tensor:
    y = torch.zeros(S)
    y[ex["fact_positions"][ex["record_keep"]]] = 1.0
    return y


def _kept_in_topk(score: torch.Tensor, ex: dict, k: int) -> float:
    """Share of the kept facts among the ``k`` best-scored tokens of the record region (positions 4 ..
    the last marker), i.e. what ``k`` long-range slots would keep if the score ranked them."""
    end = int(ex["marker_positions"][-1]) + 1
    top = score[4:end].topk(min(k, end - 4)).indices + 4
    kept = set(ex["fact_positions"][ex["record_keep"]].tolist())
    return len(kept & set(top.tolist())) / max(1, len(kept))


def target_breakdown(model: nn.Module, ex: dict, *, window: int = 32, k: int = 28) -> list[dict[str, Any]]:
    """Per layer and KV head of a dense model: the mean of the method's target ``r_tgt`` (exactly what
    ``target_source="teacher"`` trains on: ``kvpop.teacher_targets``, docs/DESIGN.md section 3) over the kept
    facts, the dropped facts and the filler of the record region, and the share of kept facts among the
    target's own ``k`` best tokens there."""
    from kvpop import KVpopConfig, teacher_targets

    ids = ex["input_ids"][None]
    with torch.no_grad(), teacher_targets(model, KVpopConfig(sinks=4, window=window, budget=4 + window + k)) as st:
        model(ids, use_cache=False)
    fp, keep = ex["fact_positions"], ex["record_keep"]
    end = int(ex["marker_positions"][-1]) + 1
    filler = (ex["input_ids"] >= T.DEFAULT.filler_base) & (torch.arange(ids.shape[1]) < end)
    out = []
    for li in sorted(st):
        for h, col in enumerate(st[li][0]):
            out.append({"layer": li, "kv_head": h, "kept_facts": round(float(col[fp[keep]].mean()), 3),
                        "dropped_facts": round(float(col[fp[~keep]].mean()), 3),
                        "filler": round(float(col[filler].mean()), 3),
                        f"kept_in_target_top{k}": round(_kept_in_topk(col, ex, k), 3)})
    return out


def probe(model: nn.Module, scorer: str, *, layer: int = 0, steps: int = 300, lr: float = 1e-2,
          length: int = T.TRAIN_LEN, window: int = 32, k: int = 28, n_valid: int = 8, seed: int = 0,
          features: str = "model") -> dict:
    """Train a fresh ``scorer`` (``"mlp"`` or ``"mlstm"``) with the clean label (binary cross-entropy, one
    training sequence a step) and return its validation figures.

    ``features``: ``"model"``, the pre-RoPE keys and values of ``layer`` of the frozen ``model``; or
    ``"random"``, a fixed random vector per token id as both key and value (what the rule needs and
    nothing else: no model in the way)."""
    if scorer not in ("mlp", "mlstm"):
        raise ValueError(f"scorer must be 'mlp' or 'mlstm', got {scorer!r}")
    if features not in ("model", "random"):
        raise ValueError(f"features must be 'model' or 'random', got {features!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    torch.manual_seed(seed)
    table = torch.randn(T.DEFAULT.vocab_size, d) if features == "random" else None

    def inputs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if table is None:
            return layer_inputs(model, ids, layer)
        x = table[ids][:, None].expand(-1, hkv, -1, -1)
        return x, x
    net = MLPScorer(hkv, d) if scorer == "mlp" else MLSTMScorer(hkv, d, window)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for i in range(steps):
        ex = T.make_example(T.train_seed(10_000 + i), length)
        kf, vf = inputs(ex["input_ids"][None])
        y = _label(ex, length).expand(1, hkv, -1)
        pos = float(y.sum()) or 1.0
        loss = F.binary_cross_entropy_with_logits(net(kf, vf), y, pos_weight=torch.tensor((y.numel() - pos) / pos))
        opt.zero_grad()
        loss.backward()
        opt.step()
    shares = []
    with torch.no_grad():
        for j in range(n_valid):
            ex = T.make_example(T.valid_seed(j), length)
            kf, vf = inputs(ex["input_ids"][None])
            r = net(kf, vf)[0].mean(0)  # the heads learn the same label: average them
            shares.append(_kept_in_topk(r, ex, k))
    return {"scorer": scorer, "features": features, "layer": layer, "steps": steps, "lr": lr, "k": k,
            "last_loss": float(loss.detach()),
            f"kept_in_top{k}": sum(shares) / len(shares), "n_valid": n_valid}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.scorer_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(T.SHIPPED_MODEL), help="dense model of the lookahead task")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--k", type=int, default=28, help="long-range slots (28: the 12.5 %% budget at L_train)")
    p.add_argument("--n-valid", type=int, default=8)
    p.add_argument("--features", choices=("model", "random"), default="model",
                   help="the layer's keys and values, or a random vector per token id")
    p.add_argument("--scorers", default="mlp,mlstm", help="comma-separated: mlp, mlstm; none: the target only")
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = parse(p, argv)
    if not (math.isfinite(args.lr) and args.lr > 0):
        print(f"--lr must be a finite number > 0, got {args.lr}", file=sys.stderr)
        return 2
    from kvpop.evaluation.evaluate import load_base_model

    model = load_base_model(args.model)
    ex = T.make_example(T.valid_seed(0), T.TRAIN_LEN)
    scorers = [] if args.scorers == "none" else [x.strip() for x in args.scorers.split(",") if x.strip()]
    bad = [x for x in scorers if x not in ("mlp", "mlstm")]
    if bad or (not scorers and args.scorers != "none"):
        print(f"--scorers takes mlp and/or mlstm, or none, got {args.scorers!r}", file=sys.stderr)
        return 2
    res = {"target_breakdown": target_breakdown(model, ex, k=args.k)}
    for s in scorers:
        res[s] = probe(model, s, layer=args.layer, steps=args.steps, lr=args.lr, k=args.k, n_valid=args.n_valid,
                       features=args.features)
        print(json.dumps(res[s]), flush=True)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python -m studies.scorer_probe " + " ".join(
            argv if argv is not None else sys.argv[1:]), **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
