"""What a training run keeps on disk, and how it stops (``kvpop train``, ``kvpop pretrain``).

* :func:`load_checkpoint` reads a checkpoint with ``torch.load(..., weights_only=True)``: only tensors
  and plain containers, so a ``last.pt`` in a run directory cannot run code when a run resumes.  What
  the loops store fits that: state dicts, numbers, strings, and RNG states as tensors
  (:func:`rng_state` / :func:`set_rng_state`).
* :class:`StopSignals` defers SIGINT and SIGTERM to the end of the step in flight, so a loop can write
  a checkpoint of that finished step and stop (:class:`TrainingInterrupted`); a second signal aborts
  at once.
* ``history.jsonl``: one line per finished step, appended as it finishes (:func:`append_jsonl`) and,
  on resume, rewritten from the checkpoint (:func:`write_jsonl`), so the file of an interrupted and
  resumed run equals the uninterrupted run's.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CheckpointError", "load_checkpoint", "atomic_save", "rng_state", "set_rng_state", "StopSignals",
           "TrainingInterrupted", "append_jsonl", "write_jsonl"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: refused, unreadable, or of another run."""


def load_checkpoint(path: str | os.PathLike) -> dict:
    """``torch.load(path, map_location="cpu", weights_only=True)``; :class:`CheckpointError` naming the file when it
    holds anything else than tensors and plain containers (it is refused, never executed) or cannot be read."""
    path = Path(path)
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\. Please|\n\n|$)", str(e), re.S)
        detail = " ".join((found.group(1) if found else str(e)).split())
        if "Unsupported global" in detail:
            raise CheckpointError(
                f"checkpoint {path} was refused: it holds objects other than tensors and plain containers, and "
                f"loading them could run code ({detail}). It was not written by this version of kvpop; delete "
                f"it or start in another directory."
            ) from None
        raise CheckpointError(f"cannot read checkpoint {path}: not a file written by torch.save ({detail})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(ck).__name__}, not a kvpop checkpoint (a dict)")
    return ck


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """The torch (and CUDA), numpy and Python RNG states, as tensors, numbers and tuples only."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    st = {"torch": torch.get_rng_state(), "python": random.getstate(),
          "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


class TrainingInterrupted(KeyboardInterrupt):
    """Raised by a training loop stopped by SIGINT/SIGTERM once its last finished step is checkpointed.

    Attributes: ``signum`` (the signal), ``step`` (the last finished step), ``checkpoint`` (its path or None).
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"; {checkpoint} holds it (resume to continue)" if checkpoint else ""
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}{where}")


class StopSignals:
    """Context manager (or ``install()`` ... ``restore()``): SIGINT and SIGTERM set :attr:`signum`
    instead of stopping the process; a second signal raises ``KeyboardInterrupt`` at once.  The previous
    handlers come back on exit.  Outside the main thread (where Python cannot install handlers) or with
    ``enabled=False`` it does nothing.

    ``requested(world)`` says whether any rank got a signal (a collective when ``world > 1``, so that all
    ranks stop after the same step)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, enabled: bool = True, name: str = "kvpop") -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.name = name
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborted without a checkpoint")
        self.signum = signum
        print(f"{self.name}: {signal.Signals(signum).name} received; stopping after the step in flight "
              f"(send it again to abort at once)", file=sys.stderr, flush=True)

    def install(self) -> StopSignals:
        if self.enabled and not self._old:
            self._old = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def requested(self, world: int = 1, device: torch.device | None = None) -> int | None:
        """The signal to stop for (the largest signal number over the ranks), or None."""
        if world <= 1:
            return self.signum
        import torch.distributed as dist

        t = torch.tensor([self.signum or 0], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t) or None


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line and flush it to the OS."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Write ``path`` anew with one JSON line per record (atomically: a temporary file, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
