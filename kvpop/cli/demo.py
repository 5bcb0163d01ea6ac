"""``kvpop demo``: retrofit the shipped tiny Qwen3 model and measure accuracy vs cache budget.

::

    kvpop demo --out demo

1. loads the shipped dense model (``kvpop/data/tiny_qwen3``, trained at L_train = 2048 on the
   key-value trace task of ``kvpop.task``);
2. retrofits, each a short ``kvpop.train`` run on sequences of L_train / 2 tokens, saved into ``--out``
   as soon as it finishes: ``kvpop-mlp`` and ``kvpop-mlstm`` (the scorers learn ``L_score`` with
   ``mask_source="scorer"``, the model frozen, at a small training budget: ``sinks + window + 4``,
   i.e. k = 4 long-range slots, see below) and ``fixed-finetune`` (the model fine-tuned, KL to the
   frozen original, with a fixed StreamingLLM mask at 12.5 % of its training length: the paper's
   fine-tune-only ablation);
   and the learned baseline ``dms`` (gates and model together, ``kvpop.demo.dms``, ``--dms-steps``);
3. evaluates dense, streaming, tova, h2o, fixed-finetune, kvpop-mlp, kvpop-mlstm and dms at budgets of
   6.25 %, 12.5 % and 25 % of L_train (re-budgeting with ``kvpop.patch(model, budget=...)``), at
   L_train and 2x L_train, every sequence through a ``kvpop.KVpopCache``;
4. prints the table and writes ``results.json``, ``table.md`` and ``accuracy_vs_budget.png``.

Why the scorers train at a small budget: ``L_score`` teaches the scorer the keep/drop decisions at
the boundary of the training budget's k slots.  With k = 4 the boundary lies among the most-attended
tokens (on this task, the facts), and the scorer learns to rank exactly those first; at the 12.5 %
budget (k = 92 at 1024 tokens) the boundary lies among filler, and the facts are ranked less
reliably.  Measured with this demo (6 test sequences per length), accuracy of kvpop-mlp /
kvpop-mlstm at 2048 tokens and budgets 128/256/512: 0.22/0.62/0.98 and 0.37/0.80/1.00 with
``--train-budget 128`` (k = 92), 0.99/1.00/1.00 and 1.00/1.00/1.00 with the default (k = 4).  The scorers are
then re-budgeted (``kvpop.patch(model, budget=...)``) for every evaluated budget.

Interrupted? Run it again with ``--resume``: finished retrofits (``DIR/<policy>/done.json``) and
measured rows (``DIR/rows.jsonl``) are reused, an unfinished retrofit continues from its last
checkpoint.  ``--quick`` is a seconds-long smoke run (tiny lengths and steps; meaningless figures).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from .eval import _ints, add_common, check_common, check_out, finish

RETROFITS = ("kvpop-mlp", "kvpop-mlstm", "fixed-finetune")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (retrofitted parts, results.json, plot)")
    p.add_argument("--resume", action="store_true",
                   help="reuse finished parts in --out (retrofits, measured rows) and continue unfinished ones")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: L_train 128, sinks 2, window 4, 2-3 training steps, 1 sequence")
    add_common(p)
    p.add_argument("--steps", default=None,
                   help="training steps: one number, or mlp,mlstm,finetune (default 100,100,30)")
    p.add_argument("--train-length", type=int, default=None,
                   help="length of the training sequences (default L_train/2 = 1024)")
    p.add_argument("--train-budget", type=int, default=None,
                   help="budget of the scorer training (default sinks + window + 4: k = 4 long-range slots; "
                        "fixed-finetune always trains at 12.5%% of --train-length)")
    p.add_argument("--lr-scorer", type=float, default=None, help="scorer learning rate (default 1e-2)")
    p.add_argument("--lr-model", type=float, default=None, help="model learning rate of fixed-finetune (default 1e-4)")
    p.add_argument("--tau", type=float, default=None, help="temperature of the score loss (default 1.0)")
    p.add_argument("--dms-steps", type=int, default=None,
                   help="training steps of the DMS baseline (gates + model; default 100; 0 leaves dms out)")
    p.add_argument("--dms-target-keep", type=float, default=None,
                   help="keep fraction DMS is trained to (default 0.04, about the long-range share of the smallest "
                        "budget at L_train; chosen over 0.1 on validation sequences; evaluated at each budget's mean)")
    p.add_argument("--dms-lr", type=float, default=None, help="learning rate of the DMS gates (default 0.05)")


def _settings(args: argparse.Namespace) -> dict:
    q = args.quick
    train_len = args.train_len or (128 if q else 2048)
    steps = _ints(args.steps) if args.steps else ([3, 3, 2] if q else [100, 100, 30])
    if len(steps) == 1:
        steps = steps * 3
    if len(steps) != 3:
        raise ValueError(f"--steps takes one number or three (mlp,mlstm,finetune), got {args.steps!r}")
    if min(steps) < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps!r}")
    for name in ("train_length", "train_budget"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.dms_steps is not None and args.dms_steps < 0:
        raise ValueError(f"--dms-steps must be >= 0 (0 leaves dms out), got {args.dms_steps}")
    if args.dms_target_keep is not None and not 0 < args.dms_target_keep <= 1:
        raise ValueError(f"--dms-target-keep must be in (0, 1], got {args.dms_target_keep}")
    for name in ("lr_scorer", "lr_model", "tau", "dms_lr"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v}")
    return {
        "train_len": train_len,
        "lengths": _ints(args.lengths) or [train_len, 2 * train_len],
        "budgets": _ints(args.budgets),
        "n_sequences": args.n_sequences if args.n_sequences is not None else (1 if q else 6),
        "sinks": (2 if q else 4) if args.sinks is None else args.sinks,
        "window": (4 if q else 32) if args.window is None else args.window,
        "steps": dict(zip(RETROFITS, steps)),
        "train_length": args.train_length if args.train_length is not None else (train_len if q else train_len // 2),
        "train_budget": args.train_budget,
        "lr_scorer": 1e-2 if args.lr_scorer is None else args.lr_scorer,
        "lr_model": 1e-4 if args.lr_model is None else args.lr_model,
        "tau": 1.0 if args.tau is None else args.tau,
        "dms_steps": (3 if q else 100) if args.dms_steps is None else args.dms_steps,
        "dms_target_keep": 0.04 if args.dms_target_keep is None else args.dms_target_keep,
        "dms_lr": 0.05 if args.dms_lr is None else args.dms_lr,
    }


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: a retrofit in flight checkpointed its last step
        print(f"\nkvpop demo: interrupted; finished parts are kept in {args.out}: run the same command with "
              f"--resume to continue", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)


def _run(args: argparse.Namespace) -> int:
    import torch

    from kvpop.demo import evaluate as E

    t_start = time.time()
    out = Path(args.out)
    try:
        check_common(args)
        check_out(args.out)
        torch.set_num_threads(args.threads)
        s = _settings(args)
        cfg = E.EvalConfig(train_len=s["train_len"], lengths=s["lengths"], budgets=s["budgets"],
                           n_sequences=s["n_sequences"], sinks=s["sinks"], window=s["window"],
                           progress=not args.no_progress)
        least = s["sinks"] + s["window"] + 1
        ft_budget = int(round(0.125 * s["train_length"]))
        if ft_budget < least:
            raise ValueError(f"training budget {ft_budget} (12.5% of --train-length {s['train_length']}) is below "
                             f"sinks + window + 1 = {least}: raise --train-length or lower --window")
        sc_budget = s["train_budget"] if s["train_budget"] is not None else s["sinks"] + s["window"] + 4
        if sc_budget < least:
            raise ValueError(f"--train-budget {sc_budget} is too small: it must be >= sinks + window + 1 = {least}")
        base = E.load_base_model(args.model)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvpop demo: error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    settings_file = out / "demo_settings.json"
    stamp = {k: v for k, v in s.items()}
    stamp["model"] = str(Path(args.model).resolve()) if args.model else "shipped"
    if not args.resume or not settings_file.exists() or json.loads(settings_file.read_text()) != stamp:
        if rows_file.exists():
            rows_file.unlink()
    settings_file.write_text(json.dumps(stamp, indent=1))
    progress = not args.no_progress

    # 1. retrofits, each saved as it finishes
    timings = {}
    for p in RETROFITS:
        t0 = time.time()
        rc = E.RetrofitConfig(steps=s["steps"][p], length=s["train_length"], batch=1,
                              budget=ft_budget if p == "fixed-finetune" else sc_budget,
                              sinks=s["sinks"], window=s["window"], lr_scorer=s["lr_scorer"],
                              lr_model=s["lr_model"], tau=s["tau"], train_model=(p == "fixed-finetune"),
                              checkpoint_every=max(1, min(50, s["steps"][p] // 4)))
        print(f"[kvpop demo] retrofit {p}: {rc.steps} steps at length {rc.length}, budget {rc.budget}", flush=True)
        E.retrofit(base, p, out / p, rc, resume=args.resume, progress=progress)
        timings[f"retrofit_{p}_s"] = round(time.time() - t0, 1)

    if s["dms_steps"] > 0:  # the learned baseline: gates and model together (kvpop.demo.dms)
        from kvpop.demo.dms import retrofit_dms

        t0 = time.time()
        rc = E.RetrofitConfig(steps=s["dms_steps"], length=s["train_length"], batch=1, sinks=s["sinks"],
                              window=s["window"], lr_scorer=s["dms_lr"], lr_model=s["lr_model"], train_model=True,
                              checkpoint_every=max(1, min(50, s["dms_steps"] // 4)))
        print(f"[kvpop demo] retrofit dms: {rc.steps} steps at length {rc.length}, target keep "
              f"{s['dms_target_keep']}", flush=True)
        retrofit_dms(base, out / "dms", rc, target_keep=s["dms_target_keep"], resume=args.resume, progress=progress)
        timings["retrofit_dms_s"] = round(time.time() - t0, 1)

    # 2. the models of every policy
    pm = dict(sinks=cfg.sinks, window=cfg.window, budget=cfg.budgets[0])
    shared = E.policy_model(base, "streaming", **pm)
    models = {"dense": base, "streaming": shared, "tova": shared, "h2o": shared,
              "fixed-finetune": E.policy_model(base, "fixed-finetune",
                                               finetuned=E.load_base_model(out / "fixed-finetune" / "model"), **pm),
              "kvpop-mlp": E.policy_model(base, "kvpop-mlp", scorers=out / "kvpop-mlp" / "scorers.safetensors", **pm),
              "kvpop-mlstm": E.policy_model(base, "kvpop-mlstm", scorers=out / "kvpop-mlstm" / "scorers.safetensors",
                                            **pm)}
    if s["dms_steps"] > 0:
        models["dms"] = E.policy_model(base, "dms", scorers=out / "dms" / "gates.safetensors",
                                       finetuned=E.load_base_model(out / "dms" / "model"), **pm)

    # 3. evaluation, each row appended to rows.jsonl as soon as it is measured
    done = {}
    if rows_file.exists():
        for line in rows_file.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[f"{r['policy']}|{r['budget']}|{r['length']}"] = r

    def save_row(row: dict) -> None:
        with open(rows_file, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    print(f"[kvpop demo] evaluating {len(cfg.policies)} policies, budgets {cfg.budgets}, lengths {cfg.lengths}, "
          f"{cfg.n_sequences} sequences each", flush=True)
    t0 = time.time()
    results = E.evaluate(models, cfg, done=done, on_row=save_row)
    timings["eval_s"] = round(time.time() - t0, 1)
    timings["total_s"] = round(time.time() - t_start, 1)
    results["demo"] = {"settings": stamp, "timings": timings, "threads": torch.get_num_threads(),
                       "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                       "retrofit": {p: json.loads((out / p / "done.json").read_text())
                                    for p in RETROFITS + (("dms",) if s["dms_steps"] > 0 else ())}}
    finish(results, out, not args.no_plot)
    print(f"[kvpop demo] done in {timings['total_s']:.0f} s", flush=True)
    return 0
