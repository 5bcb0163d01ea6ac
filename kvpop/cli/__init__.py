"""The ``kvpop`` console command.

Subcommands are registered in ``SUBCOMMANDS``: each entry names a module of ``kvpop.cli`` with
``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "schedule": ("kvpop.cli.schedule", "show which tokens each head keeps for a priority sequence"),
    "train": ("kvpop.cli.train",
              "train KVpop scorers (and fine-tune the model) on a JSONL data set or the synthetic task"),
    "eval": ("kvpop.cli.eval", "eviction policies at fixed cache budgets: accuracy on the synthetic task, or "
                               "NLL / top-1 agreement with dense on your model's own traces (--data)"),
    "demo": ("kvpop.cli.demo", "retrofit the shipped tiny model, evaluate, write results.json and a plot"),
    "pretrain": ("kvpop.cli.pretrain", "dense pre-training of the shipped tiny model on the synthetic task, or of a "
                 "small Qwen3 on token-id JSONL (--data)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpop",
        description="Learned fixed-budget KV-cache eviction (KVpop) for Qwen3, Qwen2 and Llama models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command != "schedule":  # the commands that load models: no transformers bar into a log file
        from kvpop.progress import quiet_library_bars

        quiet_library_bars()
    if isinstance(getattr(args, "model", None), str) and not os.path.exists(args.model):
        from kvpop.models.directory import resolve_model_dir

        try:  # a hub id: its snapshot in the local Hugging Face cache, as transformers finds it offline
            args.model = str(resolve_model_dir(args.model))
        except FileNotFoundError as e:
            if args.command == "train":  # kvpop train's own way of refusing (exit status 1)
                raise SystemExit(f"kvpop train: {e}") from None
            print(f"kvpop {args.command}: error: {e}", file=sys.stderr)
            return 2
        print(f"kvpop {args.command}: --model: the local Hugging Face cache's snapshot {args.model}", file=sys.stderr)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
