"""The ``kvpop`` console command.

Subcommands are registered in ``SUBCOMMANDS``: each entry names a module with
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only when
their subcommand runs, so ``kvpop --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "schedule": ("kvpop.cli_schedule", "show which tokens each head keeps for a priority sequence"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpop",
        description="Learned fixed-budget KV-cache eviction (KVpop) for Qwen3 models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
