"""``kvpop pretrain``: dense pre-training of the shipped tiny model on a synthetic task, or of a small
Qwen3 on a JSONL data set of token ids (``--data``).

Usage::

    kvpop pretrain --out runs/tiny --steps 6000 --threads 1
    kvpop pretrain --out runs/tiny --resume          # continue exactly where it stopped
    kvpop pretrain --out runs/tiny --export DIR      # copy OUT/model to DIR with its test accuracy
    kvpop pretrain --data train.jsonl --out runs/code --layers 4 --steps 1500   # real text (token ids)
    kvpop pretrain --data train.jsonl --out runs/code --export DIR   # copy OUT/model with its TRAINING.md

What the training does (curriculum, losses, checkpoints, outputs): :mod:`kvpop.demo.pretrain`; with
``--data``: :mod:`kvpop.demo.pretrain_data`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpop.demo.pretrain import TASKS, PretrainSettings, check_args, curriculum, export_model, get_task, pretrain


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run directory (checkpoints, log, model)")
    p.add_argument("--steps", type=int, default=6000, help="total optimiser steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--task", default="kvtrace", choices=sorted(TASKS),
                   help="the synthetic task: kvtrace (kvpop.demo.task, the default) or lookahead "
                        "(kvpop.demo.lookahead_task)")
    p.add_argument("--curriculum", default=None,
                   help="comma-separated LENGTH:BATCH stages; the last length is L_train (default: "
                        + "; ".join(f"{name} {spec}" for name, (_, spec) in TASKS.items()) + ")")
    p.add_argument("--advance-acc", type=float, default=0.9,
                   help="move to the next stage when the train-accuracy EMA passes this")
    p.add_argument("--min-stage-steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--cooldown", type=int, default=0,
                   help="decay the lr linearly to 0 over the last this many of --steps "
                        "(may be set when resuming)")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--filler-weight", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-n", type=int, default=32, help="test sequences per evaluation")
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (with a checkpoint) after this")
    p.add_argument("--stop-acc", type=float, default=1.01,
                   help="stop once test accuracy at L_train reaches this")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--export", metavar="DIR", default=None,
                   help="do not train: copy OUT/model (or --export-from) to DIR with its accuracy")
    p.add_argument("--export-from", default="model", help="subdirectory of OUT to export")
    from .writes import add_write_options

    add_write_options(p)  # --write-shipped: export into the package (kvpop/data/...); --overwrite: over a model
    p.add_argument("--export-lengths", default=None,
                   help="comma-separated lengths to evaluate on export (default L_train/2, L_train, 2 L_train)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress report (a tqdm bar on a terminal, else a line per N steps)")
    d = p.add_argument_group("real data (--data; kvpop.demo.pretrain_data)")
    d.add_argument("--data", default=None, metavar="JSONL",
                   help='train on this JSONL of {"input_ids": [...]} records (e.g. python -m '
                        "studies.realtext_corpus --splits train) instead of a synthetic task; the task options "
                        "(--task, --curriculum, --advance-acc, --filler-weight, --stop-acc, ...) are refused")
    d.add_argument("--valid-data", default=None, metavar="JSONL",
                   help="validation records (default: validation.jsonl beside --data); the first --eval-n "
                        "sequences")
    d.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    d.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    d.add_argument("--vocab-size", type=int, default=None,
                   help="default: the manifest.json beside --data, else the largest id + 1")
    d.add_argument("--max-positions", type=int, default=None,
                   help="max_position_embeddings (default 2 --seq-len)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvpop pretrain`` on its own (for :func:`main`)."""
    p = argparse.ArgumentParser(prog="kvpop pretrain", description="dense pre-training of the shipped tiny model on "
                                "a synthetic task")
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    # the settings only (no parser bookkeeping), typed: they are written to args.json and the checkpoints
    try:  # the one write rule (kvpop.cli.writes): nothing shipped without --write-shipped, no model replaced
        _check_writes(args)
    except ValueError as e:
        print(f"kvpop pretrain: error: {e}", file=sys.stderr)
        return 2
    args = PretrainSettings(**{k: v for k, v in vars(args).items() if k != "command" and not k.startswith("_")})
    data_only = [n for n in ("valid_data", "vocab_size", "max_positions") if getattr(args, n) is not None]
    if args.data is None and data_only:
        print(f"kvpop pretrain: error: --{data_only[0].replace('_', '-')} is for --data", file=sys.stderr)
        return 2
    try:  # every option before any work (a training's data, manifest and resume are checked as it starts)
        if not args.export:
            if args.data is not None:
                from kvpop.demo.pretrain_data import _check_args

                _check_args(args)
            else:
                check_args(args)
        elif args.data is None:
            L_train = curriculum(args)[-1][0]
            lengths = _export_lengths(args, L_train)
    except ValueError as e:
        print(f"kvpop pretrain: error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, args.threads))
    if args.data is not None:
        from kvpop.demo.pretrain_data import export_data_model, pretrain_data

        if not args.export:
            return _locked(args, pretrain_data)
        try:
            export_data_model(Path(args.out) / args.export_from, args.export,
                              command=f"kvpop pretrain --data {args.data} --out {args.out} --export {args.export}")
        except ValueError as e:
            print(f"kvpop pretrain: error: {e}", file=sys.stderr)
            return 2
        print(f"exported {Path(args.out) / args.export_from} to {args.export}")
        return 0
    if not args.export:
        return _locked(args, pretrain)
    task = get_task(args.task)
    command = (f"kvpop pretrain --out {args.out} --task {args.task} --export {args.export} "
               f"--export-from {args.export_from} --export-lengths {','.join(map(str, lengths))} "
               f"--eval-n {args.eval_n}")
    rec = export_model(Path(args.out) / args.export_from, args.export, lengths=lengths,
                       n=args.eval_n, command=command, task=task)
    print(json.dumps(rec["test_accuracy"]))
    return 0


def _check_writes(args: argparse.Namespace) -> None:
    """``--out`` and ``--export DIR`` under :mod:`kvpop.cli.writes`' rule: in what the project ships only with
    ``--write-shipped``; an ``--export`` over a directory that holds a model only with ``--overwrite``."""
    from .writes import check_not_finished, check_out_dir, check_writable

    shipped = getattr(args, "_write_shipped", False)
    check_writable(args.out, "--out", shipped)  # the run directory's own checks come with the training
    if args.export:
        src = Path(args.out) / args.export_from
        if not (src / "config.json").is_file():
            raise ValueError(f"--export: {src} holds no model (no config.json): give the --out of a finished kvpop "
                             f"pretrain run (and --export-from, its subdirectory to export)")
        check_out_dir(args.export, "--export", write_shipped=shipped)
        check_not_finished(args.export, ("model.safetensors", "config.json"), "an exported model",
                           overwrite=getattr(args, "_overwrite", False), option="--export")


def _export_lengths(args: PretrainSettings, L_train: int) -> list[int]:
    """``--export-lengths`` (default L_train / 2, L_train, 2 L_train), each at least the task's minimum length."""
    low = get_task(args.task).DEFAULT.min_length()
    if not args.export_lengths:
        return sorted({max(low, L_train // 2), L_train, 2 * L_train})
    try:
        lengths = [int(x) for x in args.export_lengths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--export-lengths must be comma-separated integers, got {args.export_lengths!r}") from None
    if not lengths or min(lengths) < low:
        raise ValueError(f"--export-lengths must list lengths >= {low} (the task's minimum), got "
                         f"{args.export_lengths!r}")
    return lengths


def _locked(args: PretrainSettings, fn) -> int:
    """``fn(args)`` holding ``--out``'s run lock: two trainings in one run directory would overwrite each
    other's checkpoints and log (an export only reads the run, and takes no lock)."""
    from kvpop.training.runstate import RunDirectoryError, RunLock

    lock = RunLock(args.out, "kvpop pretrain")
    try:
        lock.acquire()
    except RunDirectoryError as e:
        print(f"kvpop pretrain: error: {e}", file=sys.stderr)
        return 2
    try:
        return fn(args)
    finally:
        lock.release()


def main(argv: list[str] | None = None) -> int:
    """``kvpop pretrain ARGS`` as a function: parse ``argv`` (default ``sys.argv[1:]``) and run."""
    return run(build_parser().parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
