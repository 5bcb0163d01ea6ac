"""``python -m kvpop.cli.task_problems``: the demo tasks written as problems for ``kvpop eval --problems``
(:mod:`kvpop.demo.problems`), one per graded read::

    python -m kvpop.cli.task_problems --task kvtrace --length 512 --n-sequences 2 --out kvtrace.jsonl
"""
from __future__ import annotations

import argparse
import sys

from kvpop.demo.problems import TASKS, task_module, write_task_problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpop.cli.task_problems",
                                description="the demo tasks as problems for kvpop eval --problems")
    p.add_argument("--task", default="kvtrace", choices=TASKS)
    p.add_argument("--length", type=int, default=None, help="sequence length (default: the task's L_train)")
    p.add_argument("--n-sequences", type=int, default=2)
    p.add_argument("--reads", type=int, default=None, help="at most this many reads per sequence (default all)")
    p.add_argument("--split", default="test", choices=("test", "valid"))
    p.add_argument("--out", required=True, help="the JSONL file to write")
    args = p.parse_args(argv)
    try:
        length = args.length if args.length is not None else task_module(args.task).TRAIN_LEN
        n = write_task_problems(args.out, args.task, length, args.n_sequences, split=args.split, reads=args.reads)
    except ValueError as e:
        print(f"kvpop.cli.task_problems: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
