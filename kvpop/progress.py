"""Progress reporting for long loops (``kvpop train``, ``kvpop eval``, ``kvpop demo``, ``kvpop pretrain``).

:func:`progress` returns a tqdm bar when the stream (stderr by default) is a terminal, and otherwise a
:class:`LineProgress` that writes one plain line every ``every`` steps and one at the end: a bar redrawn
with carriage returns into a file or a pipe (a scheduler's log, ``2> log``) piles up as one line of tens
of kilobytes.  Both have ``update``, ``set_postfix``, ``set_postfix_str``, ``write`` and ``close`` and work as
context managers; ``enabled=False`` gives a no-op.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["progress", "one_bar", "LineProgress", "NullProgress", "CostETA", "LINES", "is_terminal",
           "quiet_library_bars"]

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
                 file: TextIO | None = None, eta: bool = True) -> None:
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
        self.eta = eta  # False: the caller says the ETA (in the postfix, e.g. CostETA's)

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
        if self.eta and self.total and 0 < done and self.n < self.total:
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


class CostETA:
    """An ETA over jobs of unequal cost: each job has a kind (e.g. ``"decode"``: token by token, ``"forward"``: one
    pass) and a size in units (e.g. tokens); the seconds per unit are measured per kind as jobs finish, and the
    ETA is the remaining units of each kind at that kind's rate.  While a kind with work left has not been timed
    yet, the ETA is a lower bound that names it (a plain bar's rate, averaged over kinds, can be off by hours when
    a token-by-token policy comes last)."""

    def __init__(self, jobs: list[tuple[str, float]]) -> None:
        self.left: dict[str, float] = {}
        for kind, units in jobs:
            self.left[kind] = self.left.get(kind, 0.0) + float(units)
        self.spent: dict[str, list[float]] = {}  # kind -> [seconds, units] measured
        self._t: float | None = None

    def start(self) -> None:
        """A job starts now."""
        self._t = time.monotonic()

    def done(self, kind: str, units: float) -> None:
        """``units`` of a job of ``kind`` finished since :meth:`start` (or the last ``done``)."""
        now = time.monotonic()
        dt = now - (self._t if self._t is not None else now)
        self._t = now
        sec_units = self.spent.setdefault(kind, [0.0, 0.0])
        sec_units[0] += dt
        sec_units[1] += float(units)
        self.left[kind] = max(0.0, self.left.get(kind, 0.0) - float(units))

    def text(self) -> str:
        """``ETA 123s``, or ``ETA >= 45s (decode not timed yet)``; empty when nothing is left."""
        eta, untimed = 0.0, []
        for kind, units in self.left.items():
            if units <= 0:
                continue
            sec, done = self.spent.get(kind, (0.0, 0.0))
            if done > 0:
                eta += sec / done * units
            else:
                untimed.append(kind)
        if not untimed and eta <= 0:
            return ""
        return f"ETA {eta:.0f}s" if not untimed else f"ETA >= {eta:.0f}s ({', '.join(untimed)} not timed yet)"


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
             every: int | None = None, file: TextIO | None = None, eta: bool = True, **tqdm_kwargs: Any) -> Any:
    """A progress reporter for ``total`` steps (module docstring).

    ``file``: the stream (default ``sys.stderr``); a tqdm bar when it is a terminal, else a
    :class:`LineProgress` writing a line every ``every`` steps (default: about :data:`LINES` lines in all).
    ``tqdm_kwargs`` go to tqdm only.  ``enabled=False``: a :class:`NullProgress`.  ``eta=False``: no ETA from the
    bar's own rate (the caller gives one in the postfix, e.g. :class:`CostETA`'s).
    """
    if not enabled:
        return NullProgress()
    if _SHARED:  # inside one_bar(): the scope's bar, opened by its first call and continued by the rest
        scope = _SHARED[-1]
        if scope.bar is None:
            scope.bar = _open(total, desc=desc, initial=initial, every=every, file=file, eta=eta, **tqdm_kwargs)
        return _Continued(scope.bar)
    return _open(total, desc=desc, initial=initial, every=every, file=file, eta=eta, **tqdm_kwargs)


class _Scope:
    bar: Any = None


_SHARED: list[_Scope] = []


class _Continued:
    """A scope's bar as one call sees it: everything passes through but :meth:`close` (the scope closes it)."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)

    def close(self) -> None:
        pass

    def __enter__(self) -> _Continued:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


@contextlib.contextmanager
def one_bar() -> Iterator[None]:
    """One bar for a job done in several calls (a run trained in segments between validations): the first
    :func:`progress` call inside the scope opens the bar, every later one continues it (its elapsed time and
    ETA count from the job's start, not the segment's), and the bar closes when the scope ends."""
    scope = _Scope()
    _SHARED.append(scope)
    try:
        yield
    finally:
        _SHARED.remove(scope)
        if scope.bar is not None:
            scope.bar.close()


def _open(total: int | None, *, desc: str, initial: int, every: int | None, file: TextIO | None, eta: bool,
          **tqdm_kwargs: Any) -> Any:
    if not is_terminal(file):
        return LineProgress(total, desc=desc, initial=initial, every=every, file=file, eta=eta)
    from tqdm.auto import tqdm

    if not eta:
        tqdm_kwargs.setdefault("bar_format", "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    return tqdm(total=total, initial=initial, desc=desc or None, dynamic_ncols=True, file=file, **tqdm_kwargs)
