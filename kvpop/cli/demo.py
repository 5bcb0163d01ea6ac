"""``kvpop demo``: retrofit the shipped tiny Qwen3 models and measure accuracy vs cache budget.

::

    kvpop demo --out demo-out                    # the kvtrace task
    kvpop demo --task lookahead --out demo-out   # the lookahead task
    kvpop demo --task all --out demo-out         # both

This module parses the arguments and calls the library: one task's run is :func:`kvpop.demo.run.run_task`
(the retrofits, every policy at the task's budgets, at L_train and 2x L_train, on test sequences through
``kvpop.KVpopCache``, and its files); ``--select`` is :func:`kvpop.demo.search.select`, the demo's stages
(:func:`kvpop.demo.grid.select_plan` over ``SELECT_GRID``; ``--select-stage label``: the label family,
the decay range, head-adaptive budgets and the joint retrofits' start, with early stopping on validation) run by
the one search of the library (:class:`kvpop.training.search.Search`, ``kvpop train --auto``'s too).  The
training settings are :data:`kvpop.demo.search.CHOSEN` (``kvpop/data/demo_results/chosen.json``, data, the
records of the search beside it).  ``--resume`` reuses finished retrofits and measured rows and continues an
unfinished retrofit from its checkpoint; ``--quick`` is a seconds-long smoke run (meaningless figures).  What
the demo does in detail and what it measured: ``kvpop/data/demo_results/README.md``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvpop.demo.grid import SELECT_STAGES
from kvpop.demo.search import TASKS

from .eval import _ints, add_common, check_common, check_out
from .writes import check_not_finished


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (one subdirectory per task)")
    p.add_argument("--task", default="kvtrace", choices=[*TASKS, "all"],
                   help="which task's model to retrofit and evaluate (default: kvtrace; lookahead: the shipped "
                        "kvpop/data/tiny_qwen3_lookahead, or --model DIR; all: one after the other)")
    p.add_argument("--select", action="store_true",
                   help="choose the training settings on validation sequences (kvpop.demo.grid.SELECT_GRID) "
                        "instead of running the demo; writes OUT/<task>/selection.json")
    p.add_argument("--select-stage", default="all", choices=SELECT_STAGES,
                   help="with --select: all (every setting), target_source (only the joint retrofits' label source, "
                        "student vs teacher, the other settings as CHOSEN) or label (the label family: label, decay "
                        "and scorer lr of the scorer-only retrofits, then the joint retrofits' start; the other "
                        "settings as CHOSEN)")
    p.add_argument("--resume", action="store_true",
                   help="reuse finished parts in --out (retrofits, measured rows) and continue unfinished ones")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: L_train 128, sinks 2, window 4, 2-3 training steps, 1 sequence")
    add_common(p)
    p.add_argument("--steps", type=int, default=None, help="training steps of every retrofit (default: CHOSEN)")
    p.add_argument("--train-length", type=int, default=None,
                   help="length of the training sequences (default L_train/2)")
    p.add_argument("--train-budget", type=int, default=None,
                   help="budget of the scorer training of every kvpop retrofit (default: sinks + window + k, "
                        "k from CHOSEN; fixed-finetune always trains at 12.5%% of --train-length)")
    p.add_argument("--lr-scorer", type=float, default=None, help="scorer learning rate (default: CHOSEN)")
    p.add_argument("--lr-model", type=float, default=None,
                   help="model learning rate of the joint retrofits and fixed-finetune (default: CHOSEN)")
    p.add_argument("--no-decode-check", action="store_true",
                   help="skip measuring the learned policies' reads by token-by-token decoding (default: at the middle "
                        "budget and L_train, beside the prefill's)")
    p.add_argument("--tau", type=float, default=None, help="temperature of the score loss (default 1.0)")
    p.add_argument("--dms-steps", type=int, default=None,
                   help="training steps of the DMS baseline (gates + model; default 100; 0 leaves dms out)")
    p.add_argument("--dms-target-keep", type=float, default=None,
                   help="keep fraction DMS is trained to (default 0.04, about the long-range share of the smallest "
                        "budget at L_train; chosen over 0.1 on validation sequences; evaluated at each budget's mean)")
    p.add_argument("--dms-lr", type=float, default=None, help="learning rate of the DMS gates (default 0.05)")


def options(args: argparse.Namespace):
    """The :class:`kvpop.demo.search.DemoOptions` of the command's arguments (what the demo's library reads; every
    option recorded in ``run.json``)."""
    from dataclasses import fields

    from kvpop.demo.search import DemoOptions

    return DemoOptions(**{f.name: getattr(args, f.name) for f in fields(DemoOptions) if f.name != "recorded"},
                       recorded={k: v for k, v in vars(args).items() if not k.startswith("_")})


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: a retrofit in flight checkpointed its last step
        print(f"\nkvpop demo: interrupted; finished parts are kept in {args.out}: run the same command with "
              f"--resume to continue", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)


def _run(args: argparse.Namespace) -> int:
    import torch

    t_start = time.time()
    out = Path(args.out)
    tasks = list(TASKS) if args.task == "all" else [args.task]
    from kvpop.training.runstate import RunLock

    lock = RunLock(out, "kvpop demo")  # one demo per --out: two would overwrite each other's parts
    try:
        check_common(args)
        check_out(args.out, write_shipped=args._write_shipped)
        if not args.select:  # a demo's outputs are replaced only when asked (--select's trials are reused by it)
            for task in tasks:
                check_not_finished(out / task, ("results.json", "demo_settings.json"), "a kvpop demo's output",
                                   overwrite=args._overwrite, resume=args.resume)
        lock.acquire()
        torch.set_num_threads(args.threads)
        if args.model is not None and len(tasks) > 1:
            raise ValueError("--model belongs to one task: give --task kvtrace or --task lookahead with it")
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        from kvpop.demo.run import run_task
        from kvpop.demo.search import base_model_dir, eval_config, retrofit_config, select
        from kvpop.demo.search import settings as settings_of
        from kvpop.evaluation import evaluate as E

        settings, opts = {}, options(args)
        lengths, budgets = _ints(args.lengths), _ints(args.budgets)
        for task in tasks:  # check every setting before training anything
            base_model_dir(opts, task)
            s = settings[task] = settings_of(opts, task, lengths=lengths, budgets=budgets)
            eval_config(E, s, opts)
            for p, c in s["retrofits"].items():
                retrofit_config(s, p, c)
        for task in tasks:
            (select if args.select else run_task)(opts, task, out / task, settings[task])
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvpop demo: error: {e}", file=sys.stderr)
        return 2
    finally:
        lock.release()
    print(f"[kvpop demo] done in {time.time() - t_start:.0f} s", flush=True)
    return 0
