"""``kvpop schedule``: the eviction schedule of a priority sequence, shown per head.

Example::

    kvpop schedule --length 64 --sinks 2 --window 8 --budget 20 --heads 2 --seed 0

For every KV head it prints one character per token, as seen by the last query:
``S`` sink, ``W`` in the window, ``#`` kept in a long-range slot, ``.`` evicted; then
the kept long-range positions and, per token, the query at which it was evicted.
"""
from __future__ import annotations

import argparse
import json

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--length", type=int, default=64, help="sequence length S (default 64)")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens s (default 4)")
    p.add_argument("--window", type=int, default=8, help="window w (default 8)")
    p.add_argument("--budget", type=int, default=24, help="entries per KV head B = s + w + k (default 24)")
    p.add_argument("--heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random priorities (default 0)")
    p.add_argument("--priorities", type=str, default=None,
                   help="comma-separated priorities of one head instead of random ones")
    p.add_argument("--json", action="store_true", help="print evict_at as JSON instead of the picture")


def strip(visible: list[bool], sinks: int, window: int) -> str:
    """One character per token ``t <= q`` of query ``q = len(visible) - 1``, given its visibility row."""
    q = len(visible) - 1
    chars = []
    for t, vis in enumerate(visible):
        if not vis:
            chars.append(".")
        elif t < sinks:
            chars.append("S")
        elif t > q - window:
            chars.append("W")
        else:
            chars.append("#")
    return "".join(chars)


def run(args: argparse.Namespace) -> int:
    from kvpop_kernels import NEVER, eviction_schedule, visible_at

    if args.sinks < 0 or args.window < 1:
        raise SystemExit(f"kvpop schedule: --sinks must be >= 0 and --window >= 1, got {args.sinks} and {args.window}")
    k = args.budget - args.sinks - args.window
    if k < 0:
        raise SystemExit(f"kvpop schedule: --budget ({args.budget}) must be >= --sinks + --window "
                         f"({args.sinks + args.window})")
    if args.priorities:
        try:
            values = [float(x) for x in args.priorities.split(",") if x.strip()]
        except ValueError as e:
            raise SystemExit(f"kvpop schedule: --priorities must be comma-separated numbers ({e})") from None
        if not values:
            raise SystemExit(f"kvpop schedule: --priorities lists no number (got {args.priorities!r}); give "
                             f"comma-separated numbers, e.g. --priorities 0.5,-1,2")
        priority = torch.tensor(values).view(1, 1, -1)
    else:
        if args.length < 1 or args.heads < 1:
            raise SystemExit("kvpop schedule: --length and --heads must be >= 1")
        g = torch.Generator().manual_seed(args.seed)
        priority = torch.randn(1, args.heads, args.length, generator=g)
    ev = eviction_schedule(priority, sinks=args.sinks, window=args.window, k=k)[0]
    S = priority.shape[-1]
    if args.json:
        print(json.dumps({"sinks": args.sinks, "window": args.window, "k": k,
                          "evict_at": [[None if e == NEVER else e for e in row] for row in ev.tolist()]}))
        return 0
    q = S - 1
    print(f"S={S} sinks={args.sinks} window={args.window} k={k} (budget {args.budget}); "
          f"what query {q} sees: S sink, W window, # long-range, . evicted")
    last = visible_at(ev, q, sinks=args.sinks, window=args.window)  # [H, S]
    for h, row in enumerate(ev.tolist()):
        vis = last[h].tolist()
        kept = [t for t in range(args.sinks, max(q - args.window + 1, args.sinks)) if vis[t]]
        print(f"head {h}: {strip(vis, args.sinks, args.window)}")
        print(f"        long-range slots hold {kept}")
        evicted = {t: e for t, e in enumerate(row) if e != NEVER}
        print(f"        evicted (token: at query) {evicted}")
    return 0
