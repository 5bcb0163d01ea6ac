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
import math
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

from kvpop.core.files import atomic_write

__all__ = ["CheckpointError", "RunMismatch", "RunDirectoryError", "RunLock", "load_checkpoint", "atomic_save",
           "rng_state", "set_rng_state", "restore_rng_state", "check_progress", "check_state_dict", "StopSignals",
           "TrainingDiverged", "non_finite", "non_finite_parameters",
           "TrainingInterrupted", "append_jsonl", "write_jsonl", "MODEL_STEP_FILE", "output_step",
           "write_model_step", "clear_model_step"]

MODEL_STEP_FILE = "kvpop_step.json"
"""The file in a fine-tuned ``model/`` folder that holds the training step of its weights, ``{"step": N}``:
written by ``kvpop train`` (:func:`kvpop.training.train.save_model` with ``step=``) after the weights and
removed before they are rewritten, so a folder whose write did not finish has none."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: refused, unreadable, or of another run."""


class RunMismatch(CheckpointError):
    """A checkpoint of another run than the one asked for: ``what`` is ``"model"`` (the model files changed),
    ``"data"`` or ``"config"`` (the method's config; ``fields`` names the fields that differ)."""

    def __init__(self, message: str, what: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.what, self.fields = what, tuple(fields)


_GLOBAL = re.compile(r"(?:unsupported global:?\s*GLOBAL|unsupported GLOBAL)\s+([\w.]+)", re.I)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """``torch.load(path, map_location="cpu", weights_only=True)``; :class:`CheckpointError` naming the file when it
    holds anything else than tensors and plain containers (it is refused, never executed) or cannot be read."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"cannot read checkpoint {path}: it is a directory")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        if found or "global" in str(e).lower():
            what = f" (it names the Python object {found.group(1)})" if found else ""
            raise CheckpointError(
                f"checkpoint {path} was refused because loading it could run code: it holds objects other than "
                f"tensors and plain containers{what}, which kvpop never writes. Delete it or start in another "
                f"directory."
            ) from None
        raise CheckpointError(f"cannot read checkpoint {path}: not a file written by torch.save "
                              f"({_first_sentence(e)})") from None
    except (RuntimeError, EOFError, OSError, ValueError, RecursionError, MemoryError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {_first_sentence(e)} "
                              f"(empty, truncated or not a torch.save file?)") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(ck).__name__}, not a kvpop checkpoint (a dict)")
    return ck


def check_progress(ck: dict, path: Path, *, grad_accum: int = 1) -> tuple[int, int]:
    """``(step, consumed)`` of a training checkpoint, once they are ints that fit each other:
    ``step <= consumed <= step * grad_accum`` (every step consumes 1 .. ``grad_accum`` micro-batches; the
    larger of this run's and the checkpoint's own ``train_config.grad_accum`` counts).
    :class:`CheckpointError` naming the file and the entry otherwise (a ``consumed`` of ``10**12`` would
    make a resume skip data for ever)."""
    for name in ("step", "consumed"):
        if name not in ck:
            raise CheckpointError(f"checkpoint {path} has no {name!r} entry: it was not written by kvpop train "
                                  f"(or by another version); start in another directory")
        v = ck[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"checkpoint {path}: {name!r} is {type(v).__name__} {str(v)[:40]}, expected an "
                                  f"int >= 0")
    step, consumed = ck["step"], ck["consumed"]
    saved = ck.get("train_config") if isinstance(ck.get("train_config"), dict) else {}
    ga = saved.get("grad_accum")
    most = max(grad_accum, ga if isinstance(ga, int) and not isinstance(ga, bool) and ga > 0 else 1)
    if not step <= consumed <= step * most:
        raise CheckpointError(f"checkpoint {path} claims {consumed} micro-batches consumed in {step} steps of 1 to "
                              f"{most} micro-batches each: it is damaged or was edited; start in another directory")
    return step, consumed


def check_state_dict(saved: Any, expected: dict[str, torch.Tensor], path: Path, what: str = "model") -> None:
    """:class:`CheckpointError` naming the file and the first differing tensor when ``saved`` (the
    checkpoint's ``what`` entry) is not a state dict with the keys and shapes of ``expected``."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path}: its {what!r} entry is a {type(saved).__name__}, not a state dict")
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit the {what}: missing {missing[:4]}"
                              f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                              f"{' ...' if len(unexpected) > 4 else ''} (a checkpoint of another model or config?)")
    for k, t in expected.items():
        v = saved[k]
        if not isinstance(v, torch.Tensor) or v.shape != t.shape:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise CheckpointError(f"checkpoint {path}: tensor {k} has shape {got}, the {what} needs "
                                  f"{tuple(t.shape)} (a checkpoint of another model or config?)")


def restore_rng_state(st: Any, path: Path) -> None:
    """:func:`set_rng_state` of a checkpoint's ``rng`` entry; a missing or malformed one raises
    :class:`CheckpointError` naming the file, with the RNG states as they were."""
    before = rng_state()
    try:
        if not isinstance(st, dict):
            raise TypeError(f"a {type(st).__name__}, not a dict")
        set_rng_state(st)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as e:
        set_rng_state(before)
        raise CheckpointError(f"checkpoint {path}: its 'rng' entry cannot be restored ({type(e).__name__}: "
                              f"{str(e)[:200]}); it was not written by kvpop train, or is damaged") from None


def _first_sentence(e: BaseException) -> str:
    """An error's message without torch's advice (never "retry with weights_only=False")."""
    msg = " ".join(str(e).split())
    msg = re.sub(r"Weights only load failed\.\s*", "", msg)
    cut = re.search(r"(In PyTorch 2\.6|Re-running `torch\.load`|Please file an issue|Check the documentation|"
                    r"This is an internal miniz error)", msg)
    return (msg[:cut.start()] if cut else msg).strip()[:300] or "the file ended early"


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` into a fresh temporary file beside ``path``, flushed to the disk, then renamed over
    ``path`` (:func:`kvpop.core.files.atomic_write`): the previous checkpoint stays until the new one is
    complete.  A failed write raises :class:`CheckpointError` naming the file; ``path`` is then unchanged."""
    path = Path(path)
    try:
        atomic_write(path, lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as e:
        kept = "the previous checkpoint there is kept" if path.is_file() else "no earlier checkpoint is there"
        raise CheckpointError(f"cannot write checkpoint {path}: {type(e).__name__}: {_first_sentence(e)}; "
                              f"{kept}") from e


class RunDirectoryError(ValueError):
    """A run directory that cannot be used: not creatable, not writable, or in use by another run."""


class RunLock:
    """One run at a time in a directory: an exclusive ``flock`` on ``DIR/.kvpop.lock``, held from
    :meth:`acquire` to :meth:`release` (or as a context manager).  The operating system drops it when the
    process ends, however it ends, so a crashed run leaves no stale lock.  The file records the holder's
    pid for the message a second run gets (:class:`RunDirectoryError`).  Creating the directory and the
    lock file also proves the directory writable, before any work.  :meth:`release` removes the file while
    still holding the lock, so a finished run leaves nothing behind; a run that opened the file just before
    it was removed finds its lock on a file no longer in the directory and takes the new one instead."""

    NAME = ".kvpop.lock"

    def __init__(self, directory: str | os.PathLike, command: str = "kvpop", option: str = "--out") -> None:
        self.directory, self.command, self.option = Path(directory), command, option
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise RunDirectoryError(f"{self.option} {d} exists and is not a directory")
        while True:
            try:
                d.mkdir(parents=True, exist_ok=True)
                fd = os.open(d / self.NAME, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunDirectoryError(f"{self.option} {d}: cannot create or write in it "
                                        f"({e.strerror or type(e).__name__})") from None
            try:
                import fcntl
            except ImportError:  # no flock on this platform: no lock, the directory is writable
                self._fd = fd
                return self
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.read(fd, 64).decode("ascii", "replace").strip()
                os.close(fd)
                raise RunDirectoryError(
                    f"{self.option} {d} is in use by another {self.command} run (pid {holder or '?'}): two runs in "
                    f"one directory would overwrite each other's checkpoints and history. Wait for it to finish, "
                    f"or choose another {self.option}") from None
            try:  # the file we locked is still the directory's (a finishing run removes it under its lock)
                same = os.fstat(fd).st_ino == os.stat(d / self.NAME).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:  # removed while still locked: a run waiting on this file sees it gone and retries
                os.unlink(self.directory / self.NAME)
            except OSError:
                pass
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


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


class TrainingDiverged(ValueError):
    """Raised by a training loop whose loss or weights turned NaN or inf: the step is not taken, no
    checkpoint of it is written, and the last finished checkpoint (if any) stays.

    Attributes: ``step`` (the step that diverged), ``checkpoint`` (the path of the last good checkpoint
    or None), ``what`` (the values that were not finite)."""

    def __init__(self, step: int, what: str, checkpoint: Path | None, good_step: int | None) -> None:
        self.step, self.what, self.checkpoint = step, what, checkpoint
        kept = (f"{checkpoint} keeps step {good_step}, the last finite one" if checkpoint is not None
                and good_step is not None else "no checkpoint was written")
        super().__init__(
            f"step {step}: {what} is not finite (NaN or inf); the run stops without taking the step, and {kept}. "
            f"Lower the learning rates (--lr-model / --lr-scorer), keep gradient clipping on (--max-grad-norm), "
            f"or check the data")


def non_finite(values: dict[str, float]) -> str | None:
    """``"kl = nan, score = inf"`` for the entries of ``values`` that are not finite, or None."""
    bad = [f"{k} = {v}" for k, v in values.items() if not math.isfinite(v)]
    return ", ".join(bad) if bad else None


def non_finite_parameters(model: torch.nn.Module, world: int = 1, limit: int = 3) -> list[str]:
    """Names of (up to ``limit``) parameters holding NaN or inf: one reduction per parameter and a
    single host read (called before a checkpoint is written, not per step).  Sharded parameters are
    checked shard by shard; with ``world > 1`` the verdict is agreed over the ranks (a collective), and
    a rank whose own shards are finite reports ``"a parameter on another rank"``."""
    named = [(n, p.detach()) for n, p in model.named_parameters() if p.is_floating_point()]
    named = [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in named]
    named = [(n, t) for n, t in named if t.numel()]
    dev = named[0][1].device if named else torch.device("cpu")
    flags = (torch.stack([torch.isfinite(t).all().to(dev) for _, t in named]) if named
             else torch.ones(0, dtype=torch.bool, device=dev))
    n_bad = (~flags).sum().to(torch.int64).reshape(1)
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(n_bad)
    if not int(n_bad):
        return []
    bad = (~flags).nonzero().flatten().tolist()
    return [named[i][0] for i in bad[:limit]] or ["a parameter on another rank"]


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
    text = "".join(json.dumps(r) + "\n" for r in records)
    atomic_write(path, lambda f: f.write(text), binary=False)


def write_model_step(directory: str | os.PathLike, step: int) -> None:
    """Stamp ``directory`` (a saved model) with ``{"step": step}`` in :data:`MODEL_STEP_FILE`, atomically."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    text = json.dumps({"step": step}) + "\n"
    atomic_write(Path(directory) / MODEL_STEP_FILE, lambda f: f.write(text), binary=False)


def clear_model_step(directory: str | os.PathLike) -> None:
    """Remove the step stamp of ``directory`` (before its weights are rewritten)."""
    try:
        (Path(directory) / MODEL_STEP_FILE).unlink()
    except FileNotFoundError:
        pass


def output_step(path: str | os.PathLike) -> int | None:
    """The training step an output of ``kvpop train`` holds: for a layer file (``scorers.safetensors``,
    ``gates.safetensors``) its ``step`` metadata (:func:`kvpop.core.checkpoint.read_step`), for a model
    folder its :data:`MODEL_STEP_FILE`.  ``None`` when there is no stamp (written before stamps existed, by
    another tool, or a model folder whose write did not finish); ``ValueError`` naming the file for a
    stamp that cannot be read."""
    p = Path(path)
    if not p.is_dir():
        from kvpop.core.checkpoint import read_step

        return read_step(p)
    f = p / MODEL_STEP_FILE
    if not f.is_file():
        return None
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{f}: cannot read it as JSON ({type(e).__name__}: {str(e)[:200]})") from None
    v = doc.get("step") if isinstance(doc, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{f}: expected {{\"step\": N}} with an int N >= 0, got {json.dumps(doc)[:100]}")
    return v
