"""``kvpop eval``: accuracy of eviction policies at fixed budgets on the key-value trace task.

Example (after ``kvpop demo --out demo``, which writes the retrofitted parts)::

    kvpop eval --scorers kvpop-mlp=demo/kvpop-mlp/scorers.safetensors \\
               --scorers kvpop-mlstm=demo/kvpop-mlstm/scorers.safetensors \\
               --finetuned fixed-finetune=demo/fixed-finetune/model --out eval-out

Every non-dense number goes through ``kvpop.patch`` + ``kvpop.KVpopCache`` (see ``kvpop.demo.evaluate``), the
``dms`` row through ``kvpop.core.dms.patch_dms`` + ``DMSCache`` at the same mean budget (``--dms DIR``).
Policies without what they need (scorers, a fine-tuned model) are skipped unless named in
``--policies``, which then raises a clear error.

On your own model and traces (``--data``; see ``kvpop.demo.trace_eval``)::

    kvpop eval --model my-model --data traces.jsonl --scorers kvpop-mlstm=run/scorers.safetensors \
               --out eval-out

``--model`` is any local directory saved with ``save_pretrained`` (a family ``kvpop.patch``
supports); ``--data`` is JSONL of ``{"input_ids": [...]}`` or ``{"text": "..."}`` (tokenized with the
model directory's tokenizer).  Each trace is run teacher-forced under every policy and budget; the
table gives, over the positions past the budget, the mean next-token NLL's increase over the dense
model and the top-1 agreement with the dense model's predictions (``results.json``, ``table.md``,
``nll_vs_budget.png``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _pairs(values: list[str] | None, what: str) -> dict[str, str]:
    from kvpop.demo.evaluate import POLICIES

    out = {}
    for v in values or []:
        if "=" not in v:
            raise ValueError(f"--{what} takes POLICY=PATH, got {v!r}")
        p, path = v.split("=", 1)
        if p not in POLICIES or p == "dense":
            raise ValueError(f"--{what}: unknown policy {p!r}; allowed: {[x for x in POLICIES if x != 'dense']}")
        out[p] = path
    return out


def _ints(s: str | None) -> list[int] | None:
    if s is None:
        return None
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {s!r}") from None


def check_common(args: argparse.Namespace) -> None:
    """Usage errors in the options of ``add_common`` (and ``--seq-len``), raised before any work."""
    for name, low in (("n_sequences", 1), ("train_len", 1), ("threads", 1), ("sinks", 0), ("window", 1),
                      ("seq_len", 2)):
        v = getattr(args, name, None)
        if v is not None and v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    for name in ("lengths", "budgets"):
        given = getattr(args, name, None)
        values = _ints(given)
        if values is None:
            continue
        if not values:
            raise ValueError(f"--{name} lists no number (got {given!r})")
        bad = [x for x in values if x < 1]
        if bad:
            raise ValueError(f"--{name} must be positive, got {bad}")


def check_out(out: str | None) -> Path | None:
    """``--out`` as a directory that exists and is writable (created if needed), checked before any work."""
    if out is None:
        return None
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create it ({e.strerror or e})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"--out {path}: the directory is not writable")
    return path


def add_common(p: argparse.ArgumentParser) -> None:
    """Options shared by ``kvpop eval`` and ``kvpop demo``."""
    p.add_argument("--model", default=None, help="base model directory (default: the shipped tiny_qwen3)")
    p.add_argument("--train-len", type=int, default=None, help="L_train of the model (default 2048)")
    p.add_argument("--lengths", default=None, help="test lengths, comma-separated (default L_train,2*L_train)")
    p.add_argument("--budgets", default=None,
                   help="budgets, comma-separated (default 6.25%%,12.5%%,25%% of L_train: 128,256,512)")
    p.add_argument("--n-sequences", type=int, default=None, help="test sequences per length")
    p.add_argument("--sinks", type=int, default=None, help="sink tokens (default 4)")
    p.add_argument("--window", type=int, default=None,
                   help="recent window (default 32: the package default 256 does not fit a 128-entry budget)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the tiny model's ops are too small for more; "
                        "2 threads made token-by-token decoding 3-15x slower on a busy 2-core machine)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plot", action="store_true", help="write no PNG plot")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--scorers", action="append", metavar="POLICY=FILE",
                   help="scorer file for kvpop-mlp / kvpop-mlstm (repeatable)")
    p.add_argument("--finetuned", action="append", metavar="POLICY=DIR",
                   help="fine-tuned model directory for fixed-finetune (or to serve kvpop-* scorers; repeatable)")
    p.add_argument("--dms", default=None, metavar="DIR",
                   help="a DMS run for the dms policy: DIR/gates.safetensors and DIR/model (kvpop train --method dms "
                        "--out DIR, or the demo's OUT/dms)")
    p.add_argument("--policies", default=None, help="comma-separated policies (default: all that can run)")
    p.add_argument("--out", default=None, help="directory for results.json, table.md and accuracy_vs_budget.png")
    p.add_argument("--data", default=None, metavar="JSONL",
                   help='your own traces: JSONL of {"input_ids": [...]} or {"text": ...} (tokenized with --model\'s '
                        "tokenizer); measures teacher-forced NLL and top-1 agreement with dense past the budget "
                        "(default budgets 6.25/12.5/25%% of the longest trace)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="with --data: cut every record into sequences of this many tokens (default: records whole)")


def finish(results: dict, out: Path | None, plot: bool) -> None:
    from kvpop.demo.evaluate import format_table, plot_results, write_results

    table = format_table(results)
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_results(results, out / "results.json")
        (out / "table.md").write_text(table + "\n")
        if plot:
            plot_results(results, out / "accuracy_vs_budget.png")
        print(f"wrote {out / 'results.json'}" + (f" and {out / 'accuracy_vs_budget.png'}" if plot else ""))


def _policy_models(E, base, cfg_policies, wanted, scorers: dict, finetuned: dict, *, sinks: int, window: int,
                   budget: int, load, dms_dir: str | None = None) -> dict:
    """policy -> model for every policy of ``cfg_policies`` that has what it needs (``dms``: the DMS run
    ``dms_dir`` holding ``gates.safetensors`` and ``model/``)."""
    models = {"dense": base}
    shared = None
    for p in cfg_policies:
        if p == "dense":
            continue
        if p == "dms":
            if dms_dir is None:
                if wanted is not None:
                    raise ValueError("policy 'dms' needs --dms DIR (a kvpop train --method dms run)")
                continue
            models[p] = E.policy_model(base, "dms", scorers=Path(dms_dir) / "gates.safetensors",
                                       finetuned=load(Path(dms_dir) / "model"), sinks=sinks, window=window)
            continue
        ft = load(finetuned[p]) if p in finetuned else None
        if p in E.SCORER_OF and p not in scorers:
            if wanted is not None:
                raise ValueError(f"policy {p!r} needs --scorers {p}=FILE")
            continue
        if p == "fixed-finetune" and ft is None:
            if wanted is not None:
                raise ValueError("policy 'fixed-finetune' needs --finetuned fixed-finetune=DIR")
            continue
        if p in ("streaming", "tova", "h2o") and ft is None:
            shared = shared or E.policy_model(base, "streaming", sinks=sinks, window=window, budget=budget)
            models[p] = shared
            continue
        models[p] = E.policy_model(base, p, scorers=scorers.get(p), finetuned=ft, sinks=sinks, window=window,
                                   budget=budget)
    return models


def _run_traces(args: argparse.Namespace, scorers: dict, finetuned: dict, wanted) -> int:
    import torch

    from kvpop.demo import evaluate as E
    from kvpop.demo import trace_eval as TE
    from kvpop.training import data as data_io

    t0 = time.time()
    try:
        if args.model is None:
            raise ValueError("--data needs --model DIR (the model whose traces these are)")
        for name in ("lengths", "train_len"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} is for the synthetic task, not --data "
                                 f"(use --seq-len / --budgets)")
        base = TE.load_model(args.model)
        records = data_io.read_jsonl(args.data, vocab_size=base.config.vocab_size,
                                     tokenizer=lambda: data_io.load_tokenizer(args.model),
                                     tokenizer_source=str(args.model))
        if args.seq_len is not None:
            traces = data_io.chunk(records, args.seq_len, source=str(args.data))
        else:
            traces = [torch.tensor(r, dtype=torch.int64) for r in records if len(r) >= 2]
        if args.n_sequences is not None:
            traces = traces[:args.n_sequences]
        cfg = TE.TraceEvalConfig(budgets=_ints(args.budgets),
                                 sinks=E.DEFAULT_SINKS if args.sinks is None else args.sinks,
                                 window=E.DEFAULT_WINDOW if args.window is None else args.window,
                                 policies=wanted or E.POLICIES, progress=not args.no_progress)
        lengths = [int(t.numel()) for t in traces]
        cfg.resolve(lengths)
        models = _policy_models(E, base, cfg.policies, wanted, scorers, finetuned, sinks=cfg.sinks,
                                window=cfg.window, budget=cfg.budgets[0], load=TE.load_model, dms_dir=args.dms)
        rows = TE.evaluate_traces(models, traces, cfg)
    except (ValueError, FileNotFoundError, TypeError, NotImplementedError) as e:
        print(f"kvpop eval: error: {e}", file=sys.stderr)
        return 2
    results = TE.trace_results(rows, cfg, lengths=lengths, extra={
        "model": str(args.model), "data": str(args.data), "seq_len": args.seq_len,
        "scorers": scorers, "finetuned": finetuned, "threads": torch.get_num_threads(),
        "eval_seconds": round(time.time() - t0, 1)})
    table = TE.format_trace_table(results)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        E.write_results(results, out / "results.json")
        (out / "table.md").write_text(table + "\n")
        if not args.no_plot:
            TE.plot_trace_results(results, out / "nll_vs_budget.png")
        print(f"wrote {out / 'results.json'}" + ("" if args.no_plot else f" and {out / 'nll_vs_budget.png'}"))
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpop.demo import evaluate as E

    try:
        scorers = _pairs(args.scorers, "scorers")
        finetuned = _pairs(args.finetuned, "finetuned")
        for p in scorers:
            if p not in E.SCORER_OF:
                raise ValueError(f"--scorers is for kvpop-mlp / kvpop-mlstm, got {p!r}")
        wanted = None if args.policies is None else [x.strip() for x in args.policies.split(",") if x.strip()]
        if wanted is not None:
            E._check_policies(wanted)
        if args.data is None and args.seq_len is not None:
            raise ValueError("--seq-len is for --data")
        check_common(args)
        check_out(args.out)
        torch.set_num_threads(args.threads)
    except ValueError as e:
        print(f"kvpop eval: error: {e}", file=sys.stderr)
        return 2
    if args.data is not None:
        return _run_traces(args, scorers, finetuned, wanted)
    try:
        cfg = E.EvalConfig(train_len=args.train_len or 2048, lengths=_ints(args.lengths),
                           budgets=_ints(args.budgets), n_sequences=4 if args.n_sequences is None else args.n_sequences,
                           sinks=E.DEFAULT_SINKS if args.sinks is None else args.sinks,
                           window=E.DEFAULT_WINDOW if args.window is None else args.window,
                           policies=wanted or E.POLICIES, progress=not args.no_progress)
        base = E.load_base_model(args.model)
        models = _policy_models(E, base, cfg.policies, wanted, scorers, finetuned, sinks=cfg.sinks,
                                window=cfg.window, budget=cfg.budgets[0], load=E.load_base_model, dms_dir=args.dms)
        t0 = time.time()
        results = E.evaluate(models, cfg)
        results["eval_seconds"] = round(time.time() - t0, 1)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvpop eval: error: {e}", file=sys.stderr)
        return 2
    finish(results, Path(args.out) if args.out else None, not args.no_plot)
    return 0
