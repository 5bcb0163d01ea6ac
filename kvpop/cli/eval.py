"""``kvpop eval``: accuracy of eviction policies at fixed budgets on the key-value trace task.

Example (after ``kvpop demo --out demo``, which writes the retrofitted parts)::

    kvpop eval --run demo/kvtrace/kvpop-mlp --run demo/kvtrace/kvpop-mlstm-joint --run demo/kvtrace/dms \
               --run fixed-finetune=demo/kvtrace/fixed-finetune --out eval-out

``--run [POLICY=]DIR`` takes a ``kvpop train --out`` directory whole, whatever the method (scorers,
fine-tuned model, DMS gates, and the settings they were trained with; ``kvpop.cli.trained`` says which policy
a directory serves); ``--scorers POLICY=FILE``, ``--finetuned POLICY=DIR`` and ``--dms DIR`` name the parts
one by one.  Sinks and window are the runs' own (saved in the scorer / gate file): a ``--sinks`` or
``--window`` that contradicts them is refused with both values named, as is a set of runs trained at
different ones; the budgets may differ from training on purpose, and the table's "trained at" column says
what each run was trained at.  A run trained with head-adaptive budgets is served with its rows at its own
budget and, at another, with rows shared anew by the importance in its ``head_budgets.json``
(``kvpop.core.budgets.rebudget``); without that importance another budget is refused.

Every non-dense number goes through ``kvpop.patch`` + ``kvpop.KVpopCache`` (see ``kvpop.evaluation.evaluate``), the
``dms`` row through ``kvpop.baselines.dms.patch_dms`` + ``DMSCache`` at the same mean budget.
Policies without what they need (scorers, a fine-tuned model) are skipped unless named in
``--policies``, which then raises a clear error.

On your own model and traces (``--data``; see ``kvpop.evaluation.trace_eval``)::

    kvpop eval --model my-model --data traces.jsonl --run runs/mlstm --run runs/dms --out eval-out

``--model`` is any local directory saved with ``save_pretrained`` (a family ``kvpop.patch``
supports); ``--data`` is JSONL of ``{"input_ids": [...]}`` or ``{"text": "..."}`` (tokenized with the
model directory's tokenizer).  Each trace is run teacher-forced under every policy and budget; the
table gives, over the positions past the largest budget (the same positions for every column, so the
dense reference is one number), the mean next-token NLL's increase over the dense model and the top-1
agreement with the dense model's predictions, and for DMS the entries its heads held (mean / min / max
over heads, at the last position and per quarter of the positions) (``results.json``, ``table.md``,
``nll_vs_budget.png``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .trained import models_line
from .trained import parse_ints as _ints
from .trained import policy_models as _policy_models
from .trained import row_models as _row_models
from .trained import rows_ran as _ran
from .trained import run_settings as _settings
from .trained import with_named as _with_named
from .writes import check_not_finished


def _pairs(values: list[str] | None, what: str) -> dict[str, str]:
    from kvpop.policies import POLICIES

    out = {}
    for v in values or []:
        if "=" not in v:
            raise ValueError(f"--{what} takes POLICY=PATH, got {v!r}")
        p, path = v.split("=", 1)
        if p not in POLICIES or p == "dense":
            raise ValueError(f"--{what}: unknown policy {p!r}; allowed: {[x for x in POLICIES if x != 'dense']}")
        if p in out:
            raise ValueError(f"--{what} {p}= is given twice: {out[p]} and {path}")
        out[p] = path
    return out



def check_common(args: argparse.Namespace) -> None:
    """Usage errors in the options of ``add_common`` (and ``--seq-len``), raised before any work."""
    for name, low in (("n_sequences", 1), ("train_len", 1), ("threads", 1), ("sinks", 0), ("window", 1),
                      ("seq_len", 2)):
        v = getattr(args, name, None)
        if v is not None and v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    for name in ("lengths", "budgets"):
        given = getattr(args, name, None)
        values = _ints(given, f"--{name}")
        if values is None:
            continue
        if not values:
            raise ValueError(f"--{name} lists no number (got {given!r})")
        bad = [x for x in values if x < 1]
        if bad:
            raise ValueError(f"--{name} must be positive, got {bad}")


def check_out(out: str | None, *, write_shipped: bool = False) -> Path | None:
    """``--out`` as a directory that exists and is writable (created if needed), checked before any work; one in
    what the project ships (the package's demo results, studies/results, ...) only with ``write_shipped``
    (:mod:`kvpop.cli.writes`)."""
    from .writes import check_writable

    if out is None:
        return None
    path = check_writable(out, "--out", write_shipped)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create it ({e.strerror or e})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"--out {path}: the directory is not writable")
    return path


def add_common(p: argparse.ArgumentParser, *, of_runs: bool = False) -> None:
    """Options shared by ``kvpop eval`` and ``kvpop demo`` (``of_runs``: sinks and window default to the
    evaluated runs' own, as in ``kvpop eval``)."""
    p.add_argument("--model", default=None, help="base model directory (default: the shipped tiny_qwen3)")
    p.add_argument("--train-len", type=int, default=None, help="L_train of the model (default 2048)")
    p.add_argument("--lengths", default=None, help="test lengths, comma-separated (default L_train,2*L_train)")
    p.add_argument("--budgets", default=None,
                   help="budgets, comma-separated (default 6.25%%,12.5%%,25%% of L_train: 128,256,512)")
    p.add_argument("--n-sequences", type=int, default=None, help="test sequences per length")
    runs = ("the trained runs' own, else " if of_runs else "")
    refused = ("; a value other than the runs' is refused" if of_runs else "")
    p.add_argument("--sinks", type=int, default=None, help=f"sink tokens (default {runs}4{refused})")
    p.add_argument("--window", type=int, default=None,
                   help=f"recent window (default {runs}32: the package default 256 does not fit a 128-entry "
                        f"budget{refused})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the tiny model's ops are too small for more; "
                        "2 threads made token-by-token decoding 3-15x slower on a busy 2-core machine)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress report (a tqdm bar when stderr is a terminal, else a line every few steps)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG plot")
    from .writes import add_write_options

    add_write_options(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, of_runs=True)
    p.add_argument("--run", action="append", metavar="[POLICY=|NAME=]DIR",
                   help="a kvpop train --out directory (or a kvpop demo OUT/<task>/<policy>), whatever the method: its "
                        "scorers, fine-tuned model, DMS gates and the settings they were trained with; the policy is "
                        "read from what DIR holds (scorers alone: kvpop-mlp / kvpop-mlstm; scorers + model/: "
                        "kvpop-mlp-joint / kvpop-mlstm-joint; gates: dms; model alone: name it, fixed-finetune=DIR); "
                        "POLICY= overrides it (e.g. kvpop-mlp=DIR serves a joint run's scorers as kvpop-mlp); "
                        "NAME= (a name that is no policy) names the run: its row is POLICY[NAME], so two runs of one "
                        "policy compare in one table (--run auto=r/auto --run paper=r/paper; POLICY[NAME]=DIR does "
                        "both); repeatable, one unnamed run per policy")
    p.add_argument("--scorers", action="append", metavar="POLICY=FILE",
                   help="special case of --run: a scorer file alone, for kvpop-mlp, kvpop-mlstm, kvpop-mlp-joint or "
                        "kvpop-mlstm-joint (the joint ones with --finetuned POLICY=DIR, the model trained with them; "
                        "repeatable)")
    p.add_argument("--finetuned", action="append", metavar="POLICY=DIR",
                   help="special case of --run: a fine-tuned model directory for fixed-finetune, or the model to serve "
                        "a --scorers policy on (repeatable)")
    p.add_argument("--dms", default=None, metavar="DIR",
                   help="special case of --run: a DMS run for the dms policy, DIR/gates.safetensors and DIR/model "
                        "(kvpop train --method dms --out DIR, or the demo's OUT/kvtrace/dms)")
    p.add_argument("--policies", default=None, help="comma-separated policies (default: all that can run)")
    p.add_argument("--out", default=None, help="directory for results.json, table.md and accuracy_vs_budget.png")
    p.add_argument("--data", default=None, metavar="JSONL",
                   help='your own traces: JSONL of {"input_ids": [...]} or {"text": ...} (tokenized with --model\'s '
                        "tokenizer); measures teacher-forced NLL and top-1 agreement with dense past the budget "
                        "(default budgets 6.25/12.5/25%% of the longest trace; on short traces those below sinks + "
                        "window + 1 are left out and the runs' trained budgets measured, as the command says)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="with --data: cut every record into sequences of this many tokens (default: records whole)")
    p.add_argument("--dms-valid-data", default=None, metavar="JSONL",
                   help="with --data and a dms run: choose DMS's gate threshold per budget on these validation traces "
                        "and keep it fixed for --data (default: calibrated on each evaluated trace, which sees it)")
    from .problems import add_arguments as add_problems

    add_problems(p)


def _trained(args: argparse.Namespace) -> dict:
    """policy -> :class:`kvpop.cli.trained.Trained` from ``--run``, ``--scorers``, ``--finetuned`` and ``--dms``
    (files checked and configs read here, before any model is loaded)."""
    from kvpop.core.checkpoint import read_scorer_config
    from kvpop.evaluation import evaluate as E
    from kvpop.training.outputs import check_same_step

    from .trained import GATES_FILE, SCORERS_FILE, Trained, dms_run, read_run

    out: dict[str, Trained] = {}

    def add(t: Trained) -> None:
        twin = next((o for o in out.values() if t.name is not None and o.name == t.name), None)
        if twin is not None and twin.key != t.key:  # one name, two rows: the name no longer says which run is which
            raise ValueError(f"the name {t.name!r} is given to two runs: {twin.source} and {t.source}; give each run "
                             f"its own name (--run NAME=DIR)")
        if t.key in out:
            hint = ("" if t.name is not None else f"; to compare two runs of one policy, name them: --run NAME=DIR "
                    f"(e.g. --run a={out[t.key].source.split('=')[-1]} --run b={t.source.split('=')[-1]}), each shown "
                    f"as its row {t.policy}[NAME]")
            raise ValueError(f"policy {t.key!r} is given twice: {out[t.key].source} and {t.source}{hint}")
        out[t.key] = t

    for spec in args.run or []:
        add(read_run(spec))
    for p, path in _pairs(args.scorers, "scorers").items():
        if p not in E.SCORER_OF:
            raise ValueError(f"--scorers is for {', '.join(E.SCORER_OF)}, got {p!r}")
        add(Trained(p, f"--scorers {p}={path}", scorers=Path(path), config=read_scorer_config(path)))
    if args.dms is not None:
        d = Path(args.dms)
        if not (d / GATES_FILE).is_file():
            raise FileNotFoundError(f"--dms {d}: no {GATES_FILE} there (kvpop train --method dms --out DIR writes it)")
        add(dms_run(d, f"--dms {d}"))
    for p, path in _pairs(args.finetuned, "finetuned").items():
        given = f"--finetuned {p}={path}"
        if p in ("tova", "h2o"):
            raise ValueError(f"{given}: the {p} row is the base model (--model) under the {p} cache, and kvpop eval "
                             f"has no row for a fine-tuned model under it (fixed-finetune is a fine-tuned model under "
                             f"the streaming cache); to run {p} on {path}, give --model {path}")
        if p in E.DMS_POLICIES:
            raise ValueError(f"{given}: a DMS run's gates and model are given together: --dms RUN or --run RUN (the "
                             f"kvpop train --method dms --out directory)")
        if p == "streaming":  # a fine-tuned model under the streaming cache is the fixed-finetune row
            p = "fixed-finetune"
        if p in out and out[p].model is not None:
            raise ValueError(f"policy {p!r} has two fine-tuned models: {out[p].model} ({out[p].source}) and {path}")
        if p in out:
            out[p].model = Path(path)
        else:
            out[p] = Trained(p, given, model=Path(path))
        if given.startswith("--finetuned streaming="):
            out[p].extra["given_as"] = "streaming"
    for t in out.values():
        if t.policy in E.SCORER_OF and t.scorers is None:
            near = [f for f in (t.model / SCORERS_FILE, t.model.parent / SCORERS_FILE) if f.is_file()]
            hint = f" (e.g. --scorers {t.policy}={near[0]})" if near else ""
            raise ValueError(f"{t.source}: {t.policy} serves trained scorers on this model, but no scorer file "
                             f"({SCORERS_FILE}) was given for it: add --scorers {t.policy}=FILE{hint}, or give the "
                             f"whole run: --run {t.policy}=RUN")
        if t.policy in E.JOINT and t.model is None:
            raise ValueError(f"{t.source}: the {t.policy} scorers were trained together with a model and serve only "
                             f"on it, but no model was given: add --finetuned {t.policy}=DIR (the run's model/), or "
                             f"give the whole run: --run RUN")
        if (t.source.startswith("--scorers") and t.model is not None and t.scorers is not None
                and t.scorers.parent.resolve() == t.model.parent.resolve()):  # the parts of one run, named one by one
            check_same_step(t.model.parent, t.scorers, t.model, t.source)
    return out




def _traces(data_io, records: list, seq_len: int | None, option: str, path: str) -> list:
    """The traces of a JSONL file's ``records``: cut at ``seq_len``, else whole (a record of fewer than 2 tokens has no
    token to score, and is skipped); ValueError naming the option and file when none is left."""
    import torch

    if seq_len is not None:
        return data_io.chunk(records, seq_len, source=f"{option} {path}",
                             warn=lambda m: print(f"kvpop eval: warning: {m}", file=sys.stderr))
    out = [torch.tensor(r, dtype=torch.int64) for r in records if len(r) >= 2]
    if not out:
        raise ValueError(f"{option} {path}: no trace to evaluate: each of its {len(records)} record(s) has fewer than "
                         f"2 tokens (a trace needs a token to predict from and one to score)")
    return out


def _run_traces(args: argparse.Namespace, trained: dict, wanted) -> int:
    import torch

    from kvpop.evaluation import evaluate as E
    from kvpop.evaluation import trace_eval as TE
    from kvpop.training import data as data_io

    t0 = time.time()
    try:
        if args.model is None:
            raise ValueError("--data needs --model DIR (the model whose traces these are)")
        for name in ("lengths", "train_len"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} is for the synthetic task, not --data "
                                 f"(use --seq-len / --budgets)")
        sinks, window, summary = _settings(args, trained, wanted)
        base = TE.load_model(args.model)
        records = data_io.read_jsonl(args.data, vocab_size=base.config.vocab_size,
                                     tokenizer=lambda: data_io.load_tokenizer(args.model),
                                     tokenizer_source=str(args.model))
        traces = _traces(data_io, records, args.seq_len, "--data", args.data)
        if args.n_sequences is not None:
            traces = traces[:args.n_sequences]
        cfg = TE.TraceEvalConfig(budgets=_ints(args.budgets), sinks=sinks, window=window,
                                 policies=_with_named(wanted or E.POLICIES, trained, wanted),
                                 progress=not args.no_progress,
                                 trained_budgets=[v["budget"] for v in summary.values() if "budget" in v])
        lengths = [int(t.numel()) for t in traces]
        cfg.resolve(lengths)
        if cfg.note is not None:
            print(f"kvpop eval: --budgets not given: {cfg.note}", file=sys.stderr)
        models = _policy_models(E, base, cfg.policies, wanted, trained, sinks=cfg.sinks, window=cfg.window,
                                budget=cfg.budgets[0], load=TE.load_model, budgets=cfg.budgets)
        if args.dms_valid_data is not None:
            if "dms" not in models:
                raise ValueError("--dms-valid-data chooses DMS's threshold: it needs a dms run (--run DIR of "
                                 "kvpop train --method dms, or --dms DIR)")
            if Path(args.dms_valid_data).resolve() == Path(args.data).resolve():
                raise ValueError(f"--dms-valid-data {args.dms_valid_data} is the evaluated --data itself: give "
                                 f"validation traces the evaluation does not score")
            vrec = data_io.read_jsonl(args.dms_valid_data, vocab_size=base.config.vocab_size,
                                      tokenizer=lambda: data_io.load_tokenizer(args.model),
                                      tokenizer_source=str(args.model))
            vtr = _traces(data_io, vrec, args.seq_len, "--dms-valid-data", args.dms_valid_data)
            if args.n_sequences is not None:
                vtr = vtr[:args.n_sequences]
            cfg.dms_thresholds = TE.dms_thresholds_on(models["dms"], vtr, cfg.budgets)
        rows = TE.evaluate_traces(models, traces, cfg)
    except (ValueError, FileNotFoundError, TypeError, NotImplementedError) as e:
        print(f"kvpop eval: error: {e}", file=sys.stderr)
        return 2
    results = TE.trace_results(rows, cfg, lengths=lengths, extra={
        "model": str(args.model), "data": str(args.data), "seq_len": args.seq_len,
        "trained": {p: summary[p] for p in summary if p in models},
        "dms_thresholds": None if cfg.dms_thresholds is None else {str(b): t for b, t in cfg.dms_thresholds.items()},
        "dms_valid_data": args.dms_valid_data,
        "threads": torch.get_num_threads(), "eval_seconds": round(time.time() - t0, 1),
        "row_models": _ran(args._row_models, models)})
    table = TE.format_trace_table(results)
    print(table)
    print(models_line(results["row_models"]))
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

    from kvpop.demo import task as T
    from kvpop.evaluation import evaluate as E

    try:
        wanted = None if args.policies is None else [x.strip() for x in args.policies.split(",") if x.strip()]
        if wanted is not None:
            if not wanted:
                raise ValueError(f"--policies lists no policy (got {args.policies!r}); allowed: {list(E.POLICIES)}")
            E._check_policies(wanted)
        if args.data is None and args.seq_len is not None:
            raise ValueError("--seq-len is for --data")
        check_common(args)
        if args.out is not None:  # a finished evaluation is replaced only when asked
            check_not_finished(args.out, ("results.json",), "a finished kvpop eval", overwrite=args._overwrite)
        check_out(args.out, write_shipped=args._write_shipped)
        trained = _trained(args)
        for t in trained.values():
            if t.extra.get("given_as") and wanted is not None and t.policy not in wanted:
                raise ValueError(f"{t.source} is evaluated as the {t.policy} row, which --policies {args.policies} "
                                 f"leaves out: add {t.policy} to --policies")
        for t in trained.values():
            if t.extra.get("given_as") == "streaming":
                print(f"kvpop eval: {t.source} is evaluated as the fixed-finetune row (a fine-tuned model under the "
                      f"streaming cache); the streaming row stays the base model", file=sys.stderr)
        if args.model is not None or args.data is None:  # --data without --model is refused below
            args._row_models = _row_models(trained, Path(args.model) if args.model else E.SHIPPED_MODEL, wanted)
        torch.set_num_threads(args.threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvpop eval: error: {e}", file=sys.stderr)
        return 2
    if args.problems is not None:
        if args.data is not None:
            print("kvpop eval: error: --problems and --data are two different evaluations; give one", file=sys.stderr)
            return 2
        from .problems import run as run_problems

        return run_problems(args, trained, wanted)
    if args.data is not None:
        return _run_traces(args, trained, wanted)
    try:
        sinks, window, summary = _settings(args, trained, wanted)
        cfg = E.EvalConfig(train_len=args.train_len or 2048, lengths=_ints(args.lengths),
                           budgets=_ints(args.budgets), n_sequences=4 if args.n_sequences is None else args.n_sequences,
                           sinks=sinks, window=window, policies=_with_named(wanted or E.POLICIES, trained, wanted),
                           progress=not args.no_progress)
        base = E.load_base_model(args.model)
        models = _policy_models(E, base, cfg.policies, wanted, trained, sinks=cfg.sinks, window=cfg.window,
                                budget=cfg.budgets[0], load=E.load_base_model, budgets=cfg.budgets)
        t0 = time.time()
        results = E.evaluate(models, cfg, task=T)
        results["eval_seconds"] = round(time.time() - t0, 1)
        results["trained"] = {p: summary[p] for p in summary if p in models}
        results["row_models"] = _ran(args._row_models, models)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvpop eval: error: {e}", file=sys.stderr)
        return 2
    E.write_outputs(results, Path(args.out) if args.out else None, not args.no_plot)
    print(models_line(results["row_models"]))
    return 0
