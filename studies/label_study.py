"""Label and decay study on a demo task: the oracle for each label, then learned scorers next to it.

``--task lookahead`` (default; ``kvpop.demo.lookahead_task``) or ``--task kvtrace`` (``kvpop.demo.task``).

The *oracle* is the teacher's exact label (``kvpop.teacher_targets``: the frozen dense model's queries,
keys and dense LSE, docs/DESIGN.md section 3) used directly as the priority of the eviction mask, no
scorer (``mask_source="teacher"``, ``target_source="teacher"``), at a fixed decay ``gamma``.  Its
accuracy is the ceiling of a scorer trained on that label at that decay: the gap between the two is the
scorer's.  Every forward is the teacher-forced full-sequence forward of a patched model (the same
schedule as a ``KVpopCache`` prefill, tests/core/test_cache.py), on a batch of sequences.

Stages (settings chosen on validation sequences, the test sequences used once):

1. ``oracle``: the accuracy of the oracle for each label (``mean``, ``max``, ``power`` at several
   exponents) and each decay on the validation sequences.
2. ``scorers``: MLP and mLSTM scorers (scorer-only: the model frozen) trained on the label and decay of
   the best oracle cell (ties: the earlier cell of the grid), the decay learned from there within
   ``decay_range_for_context`` (``--span-nats`` over the training length); validation accuracy every
   ``--eval-every`` steps, the best state kept (early stopping with ``--patience`` evaluations).
3. ``test``: the chosen oracle cell, the paper's label at the same decay, and each scorer's best state
   on the test sequences, once.  With ``--head-adaptive ablation`` also head-adaptive budgets
   (docs/DESIGN.md section 7): for the oracle of the mean and of the max label at the chosen decay and
   for each scorer, the importance of every (layer, KV head) by ``kvpop.core.budgets.ablation_importance``
   on the *validation* sequences under that policy's own mask (the oracle's exact label, or the scorer),
   ``allocate`` at the same total (``--min-k``), and the test accuracy with those ``head_budgets`` beside
   the uniform one; the importance and the budgets are saved in the output (``head_adaptive``).

::

    python -m studies.label_study --out label_study.json      # the full study (see docs/RESULTS.md)
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvpop.core.attention import set_teacher_targets, teacher_targets
from kvpop.core.budgets import ablation_importance, allocate, rebudget
from kvpop.core.checkpoint import load_scorers, read_scorer_config, save_scorers
from kvpop.core.config import KVpopConfig, decay_range_for_context
from kvpop.core.layer import kvpop_layers
from kvpop.core.loss import score_loss
from kvpop.core.patching import patch
from kvpop.demo import lookahead_task, task

from .paths import parse

TASKS = {"lookahead": lookahead_task, "kvtrace": task}
T = lookahead_task  # the task of the functions below; main() rebinds it from --task

__all__ = ["LABEL_GRID", "GAMMA_GRID", "fixed_decay", "oracle_config", "accuracy", "oracle_grid",
           "train_scorer", "head_adaptive", "main"]

LABEL_GRID = (("mean", 1.0), ("max", 1.0), ("power", 2.0), ("power", 4.0), ("power", 8.0))
GAMMA_GRID = (0.999999, 0.9999, 0.999, 0.995, 0.99)
SINKS, WINDOW = 4, 32


def fixed_decay(gamma: float) -> dict[str, float]:
    """A decay range around ``gamma`` with ``gamma_init = gamma`` (the oracle's decay is not trained)."""
    if not 0.0 < gamma < 1.0:
        raise ValueError(f"gamma must lie in (0, 1), got {gamma!r}")
    return {"gamma_min": 1.0 - 2.0 * (1.0 - gamma), "gamma_max": 1.0 - 0.5 * (1.0 - gamma), "gamma_init": gamma}


def oracle_config(label: str, power: float, gamma: float, budget: int, *, sinks: int = SINKS,
                  window: int = WINDOW) -> KVpopConfig:
    """The oracle's config: the teacher's exact label of ``label``/``power`` as the priority at the fixed decay
    ``gamma`` (:func:`fixed_decay`), no scorer; ``sinks`` and ``window`` default to this study's."""
    return KVpopConfig(sinks=sinks, window=window, budget=budget, mask_source="teacher", target_source="teacher",
                       label=label, label_power=power, compute_loss=False, **fixed_decay(gamma))


def _teacher_targets(base: nn.Module, cfg: KVpopConfig, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    with torch.no_grad(), teacher_targets(base, cfg) as store:
        base(ids, use_cache=False)
    return dict(store)


@torch.no_grad()
def accuracy(base: nn.Module, model: nn.Module, batch: dict, *, chunk: int = 16) -> float:
    """Accuracy at the graded positions of ``batch`` (``lookahead_task.make_batch``) under the patched ``model``
    (teacher-forced full-sequence forward; its config's ``target_source="teacher"`` gets the teacher's labels
    from ``base``), in chunks of ``chunk`` sequences."""
    cfg = kvpop_layers(model)[0].config
    model.eval()
    correct = graded = 0
    ids_all = batch["input_ids"]
    for i in range(0, ids_all.shape[0], chunk):
        ids = ids_all[i:i + chunk]
        if cfg.target_source == "teacher":
            set_teacher_targets(model, _teacher_targets(base, cfg, ids))
        logits = model(ids, use_cache=False).logits
        set_teacher_targets(model, None)
        pos = batch["answer_positions"][i:i + chunk]
        ans = batch["answers"][i:i + chunk]
        pred = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)
        correct += int((pred == ans).sum())
        graded += int(ans.numel())
    return correct / max(1, graded)


def oracle_grid(base: nn.Module, batch: dict, budget: int, labels=LABEL_GRID, gammas=GAMMA_GRID) -> list[dict]:
    """The oracle's accuracy on ``batch`` for every (label, decay) of the grid."""
    rows = []
    for label, power in labels:
        for gamma in gammas:
            t0 = time.time()
            m = patch(copy.deepcopy(base), oracle_config(label, power, gamma, budget))
            acc = accuracy(base, m, batch)
            rows.append({"label": label, "power": power, "gamma": gamma, "accuracy": acc,
                         "wall_s": round(time.time() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def train_scorer(base: nn.Module, scorer: str, *, label: str, power: float, gamma: float, budget: int,
                 valid: dict, steps: int, eval_every: int, patience: int, lr: float, span_nats: float,
                 batch: int = 4, seed: int = 0, train_len: int | None = None,
                 valid_budget: int | None = None) -> dict[str, Any]:
    """Train ``scorer`` (model frozen) on the teacher's ``label`` with the decay learned from ``gamma``.

    Training sequences have ``train_len`` tokens (default the task's ``TRAIN_LEN``); validation runs at
    ``valid_budget`` (default ``budget``: runs trained at different budgets compare at one).  Returns the history
    of validation accuracies, the best step, and the best state (in memory)."""
    train_len = T.TRAIN_LEN if train_len is None else train_len
    rng = decay_range_for_context(train_len, span_nats)
    rng["gamma_min"] = min(rng["gamma_min"], 1.0 - 2.0 * (1.0 - gamma))
    rng["gamma_max"] = max(rng["gamma_max"], 1.0 - 0.5 * (1.0 - gamma))
    cfg = KVpopConfig(sinks=SINKS, window=WINDOW, budget=budget, scorer=scorer, mask_source="scorer",
                      target_source="teacher", label=label, label_power=power, gamma_min=rng["gamma_min"],
                      gamma_max=rng["gamma_max"], gamma_init=gamma)
    torch.manual_seed(seed)
    model = patch(copy.deepcopy(base), cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for layer in kvpop_layers(model) for p in layer.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    hist: list[dict] = []
    best = {"accuracy": -1.0, "step": 0, "state": None}
    bad = 0
    t0 = time.time()
    for step in range(1, steps + 1):
        seeds = [T.train_seed(seed * 1_000_003 + step * batch + j) for j in range(batch)]
        ids = T.make_batch(seeds, train_len)["input_ids"]
        set_teacher_targets(model, _teacher_targets(base, cfg, ids))
        model.train()
        model(ids, use_cache=False)
        loss = score_loss(model)
        set_teacher_targets(model, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % eval_every == 0 or step == steps:
            if valid_budget is not None and valid_budget != budget:
                acc = accuracy(base, patch(model, budget=valid_budget), valid)
                patch(model, budget=budget)
            else:
                acc = accuracy(base, model, valid)
            g = torch.cat([layer.gamma().detach() for layer in kvpop_layers(model)])
            hist.append({"step": step, "loss": float(loss.detach()), "valid_accuracy": acc, "gamma_min": float(g.min()),
                         "gamma_max": float(g.max()), "wall_s": round(time.time() - t0, 1)})
            print(json.dumps({"scorer": scorer, **hist[-1]}), flush=True)
            if acc > best["accuracy"]:
                best = {"accuracy": acc, "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
                bad = 0
            else:
                bad += 1
                if bad >= patience:
                    break
    model.load_state_dict(best["state"])
    return {"model": model, "history": hist, "best_step": best["step"], "best_valid": best["accuracy"],
            "config": cfg.to_dict(), "train_wall_s": round(time.time() - t0, 1)}


def head_adaptive(base: nn.Module, model: nn.Module, valid: dict, test: dict, *, min_k: int = 0,
                  chunk: int = 16) -> dict[str, Any]:
    """Head-adaptive budgets for one policy: ``model`` patched with its uniform config (the oracle's or a
    scorer's) at the budget to share.  The importance of every (layer, KV head) by ``ablation_importance``
    on ``valid`` (the policy's own mask; the oracle's exact label from ``base``), ``allocate`` at the same
    total with ``min_k``, then the accuracy on ``test`` with those budgets and with the uniform ones."""
    cfg = kvpop_layers(model)[0].config
    t0 = time.time()
    ids = valid["input_ids"]
    imp = ablation_importance(model, [ids[i:i + chunk] for i in range(0, ids.shape[0], chunk)], config=cfg,
                              teacher=base)
    L, H = imp.shape
    rows = allocate(imp, total=L * H * cfg.budget, sinks=cfg.sinks, window=cfg.window, min_k=min_k)
    uniform_acc = accuracy(base, model, test)
    adaptive = copy.deepcopy(model)
    patch(adaptive, cfg.replace(head_budgets=rows))
    return {"importance": imp.tolist(), "head_budgets": [list(r) for r in rows], "min_k": min_k,
            "uniform_accuracy": uniform_acc, "adaptive_accuracy": accuracy(base, adaptive, test),
            "wall_s": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.label_study", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="lookahead")
    p.add_argument("--model", default=None, help="the dense model (default: the task's shipped one)")
    p.add_argument("--budget", type=int, default=64, help="the budget of the oracle grid and of the scorers' training")
    p.add_argument("--test-budgets", default=None,
                   help="comma-separated budgets of the test stage (default: --budget); scorers are re-budgeted")
    p.add_argument("--valid-budget", type=int, default=None,
                   help="budget of the scorers' validation (default --budget)")
    p.add_argument("--train-len", type=int, default=None,
                   help="length of the training and validation sequences (default: the task's TRAIN_LEN)")
    p.add_argument("--n-valid", type=int, default=64)
    p.add_argument("--n-test", type=int, default=64)
    p.add_argument("--test-len", type=int, default=None, help="length of the test sequences (default --train-len)")
    p.add_argument("--stages", default="oracle,scorers,test")
    p.add_argument("--scorers", default="mlp,mlstm")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--patience", type=int, default=100,
                   help="stop after this many evaluations without a better validation accuracy (the best state is kept "
                        "whatever; default 100: run every step)")
    p.add_argument("--lr", type=float, default=3e-3, help="scorer lr (1e-2 was unstable, 1e-3 slow: RESULTS)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--span-nats", type=float, default=8.0,
                   help="age penalty over the training length at the decay's lower end (decay_range_for_context)")
    p.add_argument("--choice", default=None, help="LABEL:POWER:GAMMA: skip the oracle grid, use this cell")
    p.add_argument("--save-dir", default=None, help="write each trained scorer's best state here (NAME.safetensors)")
    p.add_argument("--load", action="append", default=[],
                   help="SCORER=FILE: a scorer file saved by an earlier run, for the test stage")
    p.add_argument("--head-adaptive", choices=("ablation",), default=None,
                   help="test stage: also head-adaptive budgets chosen by ablation_importance on the validation "
                        "sequences (the oracle with the mean and the max label, and each scorer)")
    p.add_argument("--min-k", type=int, default=0, help="--head-adaptive: the fewest long-range slots a head gets")
    p.add_argument("--out", required=True)
    args = parse(p, argv)
    if args.min_k < 0:
        p.error(f"--min-k must be >= 0, got {args.min_k}")
    from kvpop.evaluation.evaluate import load_base_model

    global T
    T = TASKS[args.task]
    train_len = args.train_len or T.TRAIN_LEN
    test_len = args.test_len or train_len
    try:
        test_budgets = [int(b) for b in (args.test_budgets or str(args.budget)).split(",") if b]
    except ValueError:
        p.error(f"--test-budgets takes comma-separated ints, got {args.test_budgets!r}")
    torch.manual_seed(0)
    base = load_base_model(args.model or T.SHIPPED_MODEL)
    for q in base.parameters():
        q.requires_grad_(False)
    stages = set(args.stages.split(","))
    out_path = Path(args.out)
    res: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() else {}
    res["command"] = "python -m studies.label_study " + " ".join(argv if argv is not None else sys.argv[1:])
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res["task"] = args.task
    valid = T.make_batch([T.valid_seed(i) for i in range(args.n_valid)], train_len)

    def save() -> None:
        out_path.write_text(json.dumps(res, indent=1) + "\n")

    if "oracle" in stages:
        t0 = time.time()
        res["oracle_valid"] = oracle_grid(base, valid, args.budget)
        res["oracle_wall_s"] = round(time.time() - t0, 1)
        save()
    if args.choice:
        lab, pw, gm = args.choice.split(":")
        choice = {"label": lab, "power": float(pw), "gamma": float(gm)}
    else:
        rows = res.get("oracle_valid")
        if not rows:
            print("no oracle grid: run the oracle stage or pass --choice", file=sys.stderr)
            return 2
        choice = max(rows, key=lambda r: r["accuracy"])  # max() keeps the first of equal cells
        choice = {k: choice[k] for k in ("label", "power", "gamma")}
    res["choice"] = choice
    print("choice", json.dumps(choice), flush=True)
    trained = {}
    if "scorers" in stages:
        res["scorers"] = {}
        for s in [x for x in args.scorers.split(",") if x]:
            r = train_scorer(base, s, budget=args.budget, valid=valid, steps=args.steps, eval_every=args.eval_every,
                             patience=args.patience, lr=args.lr, span_nats=args.span_nats, batch=args.batch,
                             train_len=train_len, valid_budget=args.valid_budget, **choice)
            trained[s] = r.pop("model")
            res["scorers"][s] = r
            if args.save_dir:
                Path(args.save_dir).mkdir(parents=True, exist_ok=True)
                save_scorers(trained[s], Path(args.save_dir) / f"{s}.safetensors")
            save()
    for spec in args.load:
        s, _, path = spec.partition("=")
        m = copy.deepcopy(base)
        patch(m, read_scorer_config(path))
        load_scorers(m, path)
        trained[s] = m
    if "test" in stages:
        test = T.make_batch([T.test_seed(i) for i in range(args.n_test)], test_len)
        t0 = time.time()
        per_budget = {}
        for budget in test_budgets:
            rows = {}
            for lab, pw in LABEL_GRID:  # the oracle of every label at the chosen decay
                m = patch(copy.deepcopy(base), oracle_config(lab, pw, choice["gamma"], budget))
                rows[f"oracle ({lab} label{'' if lab != 'power' else f', a={pw:g}'})"] = accuracy(base, m, test)
            for s, m in trained.items():
                c = kvpop_layers(m)[0].config
                lab = c.label if c.label != "power" else f"power a={c.label_power:g}"
                rows[f"kvpop-{s} (scorer-only, {lab} label)"] = accuracy(base, rebudget(m, budget), test)
            rows["dense"] = _dense_accuracy(base, test)
            per_budget[str(budget)] = rows
            print(json.dumps({"budget": budget, **rows}), flush=True)
            if args.head_adaptive:
                ha = res.setdefault("head_adaptive", {}).setdefault(str(budget), {})
                for lab in ("mean", "max"):
                    m = patch(copy.deepcopy(base), oracle_config(lab, 1.0, choice["gamma"], budget))
                    ha[f"oracle ({lab} label)"] = head_adaptive(base, m, valid, test, min_k=args.min_k)
                    print(json.dumps({"budget": budget, f"oracle ({lab} label)": ha[f"oracle ({lab} label)"]}),
                          flush=True)
                    save()
                for s, m in trained.items():
                    ha[f"kvpop-{s}"] = head_adaptive(base, rebudget(m, budget), valid, test, min_k=args.min_k)
                    print(json.dumps({"budget": budget, f"kvpop-{s}": ha[f"kvpop-{s}"]}), flush=True)
                    save()
        rows = per_budget[str(test_budgets[0])]
        res["test"] = rows if len(test_budgets) == 1 else per_budget
        res["test_len"] = test_len
        res["test_wall_s"] = round(time.time() - t0, 1)
        if args.head_adaptive:
            res["head_adaptive_rule"] = (f"ablation_importance on the {args.n_valid} validation sequences under each "
                                         f"policy's own mask, allocate at the same total, min_k={args.min_k}")
        save()
    save()
    return 0


@torch.no_grad()
def _dense_accuracy(base: nn.Module, batch: dict) -> float:
    logits = base(batch["input_ids"], use_cache=False).logits
    pred = logits.gather(1, batch["answer_positions"][..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)
    return float((pred == batch["answers"]).float().mean())


if __name__ == "__main__":
    raise SystemExit(main())
