"""Writing files so that a failure never leaves a half-written file under the final name."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "write_json", "replace_files"]


def atomic_write(path: str | os.PathLike, write: Callable[[IO[Any]], None], *, binary: bool = True) -> None:
    """Write ``path`` through ``write(f)`` as a whole or not at all.

    ``write`` fills a fresh temporary file of a unique name beside ``path`` (so a stale or foreign
    ``path.tmp`` cannot block it), which is flushed to the disk and then renamed over ``path``.  On
    any failure (an ``OSError`` such as a full disk, an error in ``write``, a ``KeyboardInterrupt``) the
    temporary file is removed, ``path`` keeps its previous content, and the error propagates.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb" if binary else "x", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself reaches the disk (POSIX: fsync the directory)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` to ``path`` as JSON (indent 1, a final newline) through :func:`atomic_write`."""
    text = json.dumps(obj, indent=1) + "\n"
    atomic_write(path, lambda f: f.write(text), binary=False)


def replace_files(src: str | os.PathLike, dst: str | os.PathLike, names: Sequence[str]) -> None:
    """Each of ``names`` (a file or a directory) in ``dst`` replaced by ``src``'s: removed from ``dst`` first, then
    copied when ``src`` has it (so nothing of an earlier occupant stays beside what is copied); ``dst`` is made
    when missing."""
    import shutil

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (dst / name).is_dir():
            shutil.rmtree(dst / name)
        elif (dst / name).exists():
            (dst / name).unlink()
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)
        elif (src / name).exists():
            shutil.copy2(src / name, dst / name)
