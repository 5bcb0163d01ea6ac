"""Where the studies write: the files the project ships are written only when asked (``--write-shipped``), and an
output directory that is a file is a usage error, not a traceback."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ROOT", "PACKAGE_DIR", "DATA", "RESULTS_DIR", "README_FILE", "is_shipped", "check_out_dir"]

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
    """Whether writing ``path`` would change what the project ships: anything in the package (the corpus, the
    models), the studies' results (the ledger, its archive, the results documents), the checkout's README.md or
    docs/."""
    p = Path(path).resolve()
    return p == README_FILE or any(p == d or d in p.parents for d in (PACKAGE_DIR, RESULTS_DIR, ROOT / "docs"))


def check_writable(path: str | os.PathLike, option: str, write_shipped: bool) -> Path:
    """``path`` (given as ``option``), once it is not a shipped one, or ``write_shipped`` allows it
    (ValueError naming the option otherwise)."""
    if is_shipped(path) and not write_shipped:
        raise ValueError(f"{option} {path} lies in what the project ships (the package, studies/results, README.md, "
                         f"docs/); add --write-shipped to rewrite it")
    return Path(path)


def check_out_dir(path: str | os.PathLike, option: str = "--out", *, write_shipped: bool = False,
                  file: bool = False) -> Path:
    """``path`` as an output directory (with ``file``: a file to write): ValueError naming ``option`` when it is
    an existing file (with ``file``: an existing directory), a directory above it exists and is not a directory,
    or it lies in what the project ships without ``write_shipped``."""
    p = check_writable(path, option, write_shipped)
    if file and p.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file")
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir() and not (file and q == p):
                raise ValueError(f"{option} {path} exists and is not a directory" if q == p else
                                 f"{option} {path}: {q} exists and is not a directory")
            break
    return p
