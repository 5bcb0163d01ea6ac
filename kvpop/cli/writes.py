"""Where a command may write: one rule for ``kvpop train|eval|demo|pretrain --export`` and every study.

What the project ships (anything in the installed package, ``studies/results``, the checkout's ``README.md`` and
``docs/``) is written only with ``--write-shipped``; a finished output (a directory holding what a finished run of
the command writes) is replaced only with ``--resume`` (where the command has it) or ``--overwrite``.  The studies
import these from here (``studies.paths``); kvpop never imports the studies.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["PACKAGE_DIR", "ROOT", "RESULTS_DIR", "README_FILE", "DOCS_DIR", "is_shipped", "check_writable",
           "check_out_dir", "check_not_finished", "add_write_options"]

PACKAGE_DIR = Path(__file__).resolve().parent.parent
"""The installed package (wherever it is installed: a checkout, or an interpreter's site-packages)."""
ROOT = PACKAGE_DIR.parent
"""The checkout the package sits in (when installed in place)."""
RESULTS_DIR = ROOT / "studies" / "results"
README_FILE = ROOT / "README.md"
DOCS_DIR = ROOT / "docs"


def _shipped_places(roots: Iterable[Path]) -> tuple[list[Path], list[Path]]:
    """(directories, files) the project ships, for the package here and each checkout of ``roots``."""
    dirs, files = [PACKAGE_DIR], []
    for r in (ROOT, *roots):
        r = Path(r).resolve()
        dirs += [r / "kvpop", r / "studies" / "results", r / "docs"]
        files.append(r / "README.md")
    return dirs, files


def is_shipped(path: str | os.PathLike, roots: Iterable[Path] = ()) -> bool:
    """Whether writing ``path`` would change what the project ships: anything in the package (the corpus, the models,
    the demo's results), the studies' results (the ledger, its archive, the records), the checkout's README.md or
    docs/ (paths resolved, so ``./kvpop/../kvpop/data`` and a symlink into it count).  ``roots``: other checkouts
    to count (the studies' own, when the package is installed elsewhere)."""
    p = Path(path).resolve()
    dirs, files = _shipped_places(roots)
    return p in files or any(p == d or d in p.parents for d in dirs)


def check_writable(path: str | os.PathLike, option: str, write_shipped: bool, roots: Iterable[Path] = ()) -> Path:
    """``path`` (given as ``option``), once it is not a shipped one, or ``write_shipped`` allows it
    (ValueError naming the option otherwise)."""
    if not write_shipped and is_shipped(path, roots):
        raise ValueError(f"{option} {path} lies in what the project ships (the package, studies/results, README.md, "
                         f"docs/); add --write-shipped to rewrite it")
    return Path(path)


def check_out_dir(path: str | os.PathLike, option: str = "--out", *, write_shipped: bool = False,
                  file: bool = False, roots: Iterable[Path] = ()) -> Path:
    """``path`` as an output directory (with ``file``: a file to write): ValueError naming ``option`` when it is
    an existing file (with ``file``: an existing directory), a directory above it exists and is not a directory,
    or it lies in what the project ships without ``write_shipped``."""
    p = check_writable(path, option, write_shipped, roots)
    if file and p.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file")
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir() and not (file and q == p):
                raise ValueError(f"{option} {path} exists and is not a directory" if q == p else
                                 f"{option} {path}: {q} exists and is not a directory")
            break
    return p


def check_not_finished(out: str | os.PathLike, marks: Iterable[str], what: str, *, overwrite: bool,
                       option: str = "--out", resume: bool | None = None) -> None:
    """ValueError when ``out`` holds any of ``marks`` (the files a finished ``what`` leaves there) and neither
    ``--overwrite`` nor (``resume`` not None: the command has one) ``--resume`` was given; ``what`` says what holds
    them (e.g. "a finished kvpop eval")."""
    found = [m for m in marks if (Path(out) / m).exists()]
    if not found or overwrite or resume:
        return
    how = "add --resume to reuse its finished parts, --overwrite to replace it" if resume is not None else \
        "add --overwrite to replace it"
    raise ValueError(f"{option} {out} holds {what} ({', '.join(found)}): {how}, or choose another {option}")


def add_write_options(p, *, overwrite: bool = True) -> None:
    """``--write-shipped`` (and ``--overwrite``) on parser ``p``: run-only options (``_write_shipped``,
    ``_overwrite``: a run's recorded arguments leave ``_``-names out, so a ``--resume`` may add or drop them)."""
    p.add_argument("--write-shipped", dest="_write_shipped", action="store_true",
                   help="allow writing into what the project ships (the installed package, studies/results, "
                        "README.md, docs/); refused without it")
    if overwrite:
        p.add_argument("--overwrite", dest="_overwrite", action="store_true",
                       help="replace a finished output in --out (refused without it)")
