"""The results log of a long ``kvpop eval --problems`` run, and its resume.

One line per (policy, budget, problem) is appended to ``OUT/problems.jsonl`` as soon as the problem's samples
are done (generations included; :func:`append_row`); a resumed run reads it back (:func:`open_log` checks
that the settings match ``OUT/settings.json``) and runs only what is missing.  A line cut by an interruption
is dropped, and its problem runs again.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["RESULTS_LOG", "SETTINGS", "row_key", "load_log", "open_log", "append_row"]

RESULTS_LOG = "problems.jsonl"
SETTINGS = "settings.json"


def row_key(policy: str, budget: int | None, index: int) -> str:
    """The key of one (policy, budget, problem index) row of the log."""
    return f"{policy}|{budget}|{index}"


def load_log(path: Path) -> dict[str, dict]:
    """The rows of the results log ``path`` by :func:`row_key` (none when it is absent); a torn last line is
    dropped from the file, so that the next append starts a fresh line."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a line cut by the interruption: its problem runs again
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON; the results log is damaged (move it away to start "
                             f"over)") from None
        done[row_key(row["policy"], row["budget"], row["index"])] = row
    # drop a torn last line so the next append starts a fresh line
    if raw and not raw.endswith(b"\n"):
        keep = raw[:raw.rfind(b"\n") + 1]
        path.write_bytes(keep)
    return done


def open_log(out: Path, settings: dict, resume: bool) -> tuple[Path, dict[str, dict]]:
    """``(the log's path, the rows already done)`` of a run in ``out`` with ``settings``, ``settings.json``
    written: ``resume`` continues the log there (the settings must match), else an existing log is refused."""
    out.mkdir(parents=True, exist_ok=True)
    log, stamp = out / RESULTS_LOG, out / SETTINGS
    done: dict[str, dict] = {}
    if resume and stamp.exists():
        prev = json.loads(stamp.read_text())
        if prev != json.loads(json.dumps(settings)):  # JSON round trip: tuples as lists
            now = json.loads(json.dumps(settings))
            diff = sorted(k for k in set(prev) | set(now) if prev.get(k) != now.get(k))
            raise ValueError(f"--resume: {out} holds a run with other settings ({', '.join(diff)} differ); "
                             f"use another --out or the same settings")
        done = load_log(log)
    elif log.exists() and log.stat().st_size:
        if not resume:
            raise ValueError(f"{log} exists (an earlier run); give --resume to continue it or another --out")
        raise ValueError(f"--resume: {out} holds {log.name} but not the {SETTINGS} of its run, so its settings "
                         f"cannot be checked; use another --out")
    stamp.write_text(json.dumps(settings, indent=1) + "\n")
    return log, done


def append_row(log: Path, row: dict) -> None:
    """Append one problem's row to the log and flush it to the disk."""
    with log.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
