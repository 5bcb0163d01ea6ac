"""The demo tasks as problems for ``kvpop eval --problems``: a CPU instrument for the generated-answer evaluation.

Each graded read of a test sequence becomes one problem: the prompt is the sequence up to and including
the read's KEY token (so the next token is the value the model must recall), the answer that VALUE token
as ``answer_ids``.  Greedy dense generation of one token then answers exactly what the teacher-forced
evaluation grades at that position (:func:`kvpop.evaluation.evaluate.sequence_correct`)::

    python -m kvpop.cli.task_problems --task kvtrace --length 512 --n-sequences 2 --out kvtrace.jsonl
    kvpop eval --problems kvtrace.jsonl --policies dense,streaming,tova --budgets 64,128 --out eval-problems
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["task_problems", "write_task_problems", "TASKS", "task_module"]

TASKS = ("kvtrace", "lookahead")


def task_module(name: str):
    if name == "kvtrace":
        from . import task
        return task
    if name == "lookahead":
        from . import lookahead_task
        return lookahead_task
    raise ValueError(f"--task must be one of {list(TASKS)}, got {name!r}")


def task_problems(task_name: str, length: int, n_sequences: int, *, first_seed: int = 0, split: str = "test",
                  reads: int | None = None) -> list[dict]:
    """Problem records of ``n_sequences`` sequences of ``length`` tokens of the named task (``split``:
    ``"test"`` or ``"valid"`` seeds); ``reads``: at most this many reads per sequence (the first ones)."""
    task = task_module(task_name)
    if split not in ("test", "valid"):
        raise ValueError(f"split must be 'test' or 'valid', got {split!r}")
    if isinstance(n_sequences, bool) or not isinstance(n_sequences, int) or n_sequences < 1:
        raise ValueError(f"n_sequences must be an int >= 1, got {n_sequences!r}")
    seed_of = task.test_seed if split == "test" else task.valid_seed
    out = []
    for i in range(n_sequences):
        seed = seed_of(first_seed + i)
        ex = task.make_example(seed, length, task.DEFAULT)
        ids = ex["input_ids"].reshape(-1).tolist()
        pos = ex["answer_positions"].reshape(-1).tolist()
        ans = ex["answers"].reshape(-1).tolist()
        for j, (p, a) in enumerate(zip(pos, ans)):
            if reads is not None and j >= reads:
                break
            out.append({"id": f"{task.NAME}-{seed}-{p}", "prompt_ids": ids[:p + 1], "answer_ids": [int(a)]})
    return out


def write_task_problems(path: str | os.PathLike, task_name: str, length: int, n_sequences: int, **kw) -> int:
    """Write :func:`task_problems` as JSONL to ``path``; returns the number of problems."""
    recs = task_problems(task_name, length, n_sequences, **kw)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return len(recs)
