"""Where the studies write: the files the project ships are written only when asked (``--write-shipped``), and an
output directory that is a file is a usage error, not a traceback."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import kvpop.cli.writes as _w

__all__ = ["ROOT", "PACKAGE_DIR", "DATA", "RESULTS_DIR", "README_FILE", "is_shipped", "check_out_dir", "parse"]

ROOT = Path(__file__).resolve().parent.parent
"""The checkout: the studies sit beside the package, never inside it (the package does not import them)."""
PACKAGE_DIR = ROOT / "kvpop"
DATA = PACKAGE_DIR / "data"
"""The package's data: the shipped models and the real-text corpus the studies read."""
RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""The studies' results (the evidence ledger, the --auto, quantised, label and real-text records)."""
README_FILE = ROOT / "README.md"
"""The checkout's README (its headline block is the evidence ledger's rendering)."""


def is_shipped(path: str | os.PathLike) -> bool:
    """Whether writing ``path`` would change what the project ships (:func:`kvpop.cli.writes.is_shipped`, counting
    this checkout too)."""
    return _w.is_shipped(path, (ROOT,))


def check_writable(path: str | os.PathLike, option: str, write_shipped: bool) -> Path:
    """:func:`kvpop.cli.writes.check_writable`, counting this checkout too."""
    return _w.check_writable(path, option, write_shipped, (ROOT,))


def check_out_dir(path: str | os.PathLike, option: str = "--out", *, write_shipped: bool = False,
                  file: bool = False) -> Path:
    """:func:`kvpop.cli.writes.check_out_dir` (one rule for every command that writes), counting this checkout
    too."""
    return _w.check_out_dir(path, option, write_shipped=write_shipped, file=file, roots=(ROOT,))


WRITES = ("out", "record", "ledger_runs", "write")
"""The options by which a study writes (a directory or a file, each checked by :func:`parse`)."""


def _parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``p.parse_args(argv)`` under the one write rule of :mod:`kvpop.cli.writes`: every (sub)parser with a writing
    option (:data:`WRITES`) gets ``--write-shipped``, and a given path that lies in what the project ships (the
    package, studies/results, README.md, docs/) without it is a one-line error naming the option (exit 2), before
    any work."""
    for q in _parsers(p):
        dests = {a.dest for a in q._actions}
        if dests & set(WRITES) and "write_shipped" not in dests:
            q.add_argument("--write-shipped", action="store_true",
                           help="allow writing into what the project ships (the package, studies/results, README.md, "
                                "docs/); refused without it")
    a = p.parse_args(argv)
    for dest in WRITES:
        value = getattr(a, dest, None)
        if isinstance(value, (str, os.PathLike)):
            try:
                check_writable(value, f"--{dest.replace('_', '-')}", getattr(a, "write_shipped", False))
            except ValueError as e:  # one line, as the studies' other refusals (no usage block)
                print(f"{p.prog}: error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
    return a
