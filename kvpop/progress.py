"""Progress reporting for long loops (``kvpop train``, ``kvpop eval``, ``kvpop demo``, ``kvpop pretrain``).

:func:`progress` returns a tqdm bar when the stream (stderr by default) is a terminal, and otherwise a
:class:`LineProgress` that writes one plain line every ``every`` steps and one at the end: a bar redrawn
with carriage returns into a file or a pipe (a scheduler's log, ``2> log``) piles up as one line of tens
of kilobytes.  Both have ``update``, ``set_postfix``, ``set_postfix_str``, ``write`` and ``close`` and work as
context managers; ``enabled=False`` gives a no-op.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

__all__ = ["progress", "LineProgress", "NullProgress", "LINES", "is_terminal", "quiet_library_bars"]

LINES = 20
"""Lines a :class:`LineProgress` writes over a run by default (``every = ceil(total / LINES)``)."""


class NullProgress:
    """A progress object that reports nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, s: str = "") -> None:
        pass

    def close(self) -> None:
        pass

    def write(self, s: str) -> None:
        """Print a message line to stdout (as ``tqdm.write``)."""
        print(s, file=sys.stdout, flush=True)

    def __enter__(self) -> NullProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LineProgress(NullProgress):
    """One line ``desc: n/total (pct%), elapsed, ETA, postfix`` every ``every`` steps and at :meth:`close`."""

    def __init__(self, total: int | None, *, desc: str = "", initial: int = 0, every: int | None = None,
                 file: TextIO | None = None) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.total = total
        self.desc = desc
        self.n = self._start = initial
        self.every = every if every is not None else max(1, math.ceil((total or LINES) / LINES))
        self.file = file
        self.postfix = ""
        self._t0 = time.monotonic()
        self._last = initial  # n at the last line written
        self._closed = False

    def set_postfix(self, **kwargs: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in kwargs.items())

    def set_postfix_str(self, s: str = "") -> None:
        self.postfix = str(s)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n // self.every > self._last // self.every:
            self._write()

    def _write(self) -> None:
        self._last = self.n
        dt = time.monotonic() - self._t0
        parts = [f"{self.n}/{self.total}" if self.total else f"{self.n}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{dt:.0f}s")
        done = self.n - self._start
        if self.total and 0 < done and self.n < self.total:
            parts.append(f"ETA {dt / done * (self.total - self.n):.0f}s")
        if self.postfix:
            parts.append(self.postfix)
        out = self.file if self.file is not None else sys.stderr
        print(f"{self.desc}: " + ", ".join(parts) if self.desc else ", ".join(parts), file=out, flush=True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.n != self._last:
                self._write()


def is_terminal(stream: Any = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``) is a terminal (False for a closed or detached stream)."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (ValueError, OSError):
        return False


def quiet_library_bars() -> None:
    """When stderr is not a terminal, switch off transformers' own bars (its "Loading weights" bar)."""
    if not is_terminal():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def progress(total: int | None, *, desc: str = "", initial: int = 0, enabled: bool = True,
             every: int | None = None, file: TextIO | None = None, **tqdm_kwargs: Any) -> Any:
    """A progress reporter for ``total`` steps (module docstring).

    ``file``: the stream (default ``sys.stderr``); a tqdm bar when it is a terminal, else a
    :class:`LineProgress` writing a line every ``every`` steps (default: about :data:`LINES` lines in all).
    ``tqdm_kwargs`` go to tqdm only.  ``enabled=False``: a :class:`NullProgress`.
    """
    if not enabled:
        return NullProgress()
    if not is_terminal(file):
        return LineProgress(total, desc=desc, initial=initial, every=every, file=file)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc or None, dynamic_ncols=True, file=file, **tqdm_kwargs)
