"""``kvpop train --auto``'s collaborators: the validation sequences, one trial's training (``kvpop train``
itself) and its score as ``kvpop eval --run`` serves it; the search is :func:`kvpop.training.auto.search`."""
from __future__ import annotations

import argparse
import copy
import signal
import sys
from pathlib import Path

from kvpop.demo.search import default_model, task_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--auto``, ``--auto-budget`` and ``--preset`` of ``kvpop train``."""
    auto = p.add_argument_group("settings chosen for you (kvpop.training.auto)")
    auto.add_argument("--auto", action="store_true",
                      help="choose the label, scorer lr, training budget, decay range, head budgets, label "
                           "source and the joint run's warm start on validation data (--valid-data, or the task's "
                           "validation sequences with --task), split into fit and select parts, a --steps run per "
                           "trial, the top two confirmed with a second seed; writes OUT/selection.json and OUT as "
                           "the chosen run (--resume continues a search)")
    auto.add_argument("--auto-budget", default=None, metavar="STEPS|MINUTES",
                      help="--auto's budget: trained steps over all trials (e.g. 400) or minutes (e.g. 30m) "
                           "(default: 5 trials of --steps)")
    auto.add_argument("--auto-patience", type=int, default=None, metavar="N",
                      help="--auto's early stopping: each trial validated on the fit part of validation every "
                           "--auto-eval-every steps and stopped after N validations without a better score, its best "
                           "state kept and scored once on the select part (default 2; 0: no early stopping, each "
                           "trial scored once after --steps)")
    auto.add_argument("--auto-eval-every", type=int, default=None, metavar="STEPS",
                      help="--auto's validation interval within a trial, in steps (default --steps / 4, rounded up)")
    auto.add_argument("--preset", choices=("paper",), default=None,
                      help="paper: the paper's method (MLP scorer, mean label, decay [0.999, 0.999999] from 0.9999, "
                           "the student's sparse label, uniform budgets)")


def check_auto_options(args: argparse.Namespace) -> None:
    """``--auto-budget`` and ``--preset`` where they mean something, and what ``--auto`` needs, before any work."""
    from kvpop.training.auto import early_stopping, parse_budget, preset_values

    if not args.auto:
        for name in ("auto_budget", "auto_patience", "auto_eval_every"):
            if getattr(args, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {getattr(args, name)} is an option of --auto's search: give --auto, or "
                                 f"leave it out")
        for k, v in preset_values(args.preset, vars(args)).items():
            setattr(args, k, v)
        return
    if args.preset is not None:
        raise ValueError(f"--preset {args.preset} fixes the settings --auto chooses: give one of them")
    if args.method != "kvpop":
        raise ValueError("--auto searches the settings of --method kvpop; --method dms has its own "
                         "(studies.evidence tunes it on validation)")
    if args.tiny:
        raise ValueError("--auto scores every trial as kvpop eval serves it, from a model directory: give --model DIR "
                         "(or leave it out for the shipped model) instead of --tiny")
    if args.head_budgets is not None:
        raise ValueError("--auto chooses between uniform and head-adaptive budgets itself: leave out --head-budgets "
                         "(or give --allocate ablation to fix that choice)")
    if args.data is not None and args.valid_data is None:
        raise ValueError("--auto chooses on validation data, never on the training data: give --valid-data "
                         "FILE.jsonl (records held out from --data)")
    if args.task and args.valid_data is not None:
        raise ValueError(f"--auto --task scores every trial on the task's validation sequences (--valid-sequences of "
                         f"them); --valid-data {args.valid_data} would not be what the search scores on: leave it "
                         f"out")
    if args.data is not None:
        _check_valid_file(args.valid_data, args.data)
    _check_out(Path(args.out), args.resume)
    parse_budget(args.auto_budget, args.steps)
    early_stopping(args.steps, args.auto_patience, args.auto_eval_every)


SELECT_FIRST = 1_000
"""With ``--task``: the select sequences are ``valid_seed(SELECT_FIRST + i)``; the fit sequences are
``valid_seed(0..n-1)``, the ones a trial's ``--allocate`` measures (``kvpop train --task``'s own)."""
SPLIT_SEED = 0
"""The seed of the hash that splits ``--valid-data``'s sequences into fit and select
(:func:`kvpop.training.search.split_keys`); fixed, so that ``--seed`` does not move the split."""


def _check_valid_file(valid: str, data: str) -> None:
    """``--valid-data`` is not the training file ``--data`` (the path, or a copy of its content): the search's
    trials must be scored on held-out records (:func:`_held_out` compares the records themselves)."""
    from kvpop.training.data import data_fingerprint

    if Path(valid).resolve() == Path(data).resolve():
        raise ValueError(f"--valid-data {valid} is the training file --data: --auto's search must score its trials "
                         f"on held-out records, never on what they trained on")
    try:
        same = data_fingerprint(valid) == data_fingerprint(data)
    except OSError:
        return  # unreadable: said when the file is read
    if same:
        raise ValueError(f"--valid-data {valid} has the same content as the training file --data {data} (a copy): "
                         f"--auto's search must score its trials on held-out records")


def _check_out(out: Path, resume: bool) -> None:
    """``--out`` holds nothing a search would replace or mix with: a plain run of ``kvpop train`` (its files would
    be replaced by the chosen trial's), or without ``--resume`` an earlier search (finished or interrupted)."""
    from kvpop.training.auto import RUN_FILES

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if (out / "auto").exists() and not (out / "auto").is_dir():
        raise ValueError(f"--out {out}: {out / 'auto'} is not a directory, where the search keeps its trials; move "
                         f"it away")
    searched = (out / "selection.json").exists() or (out / "auto").is_dir()
    run = [n for n in RUN_FILES if (out / n).exists()]
    if run and not searched:
        raise ValueError(f"--out {out} holds a run of kvpop train without --auto ({', '.join(run)}), which the "
                         f"search's chosen run would replace: choose another --out")
    if not resume and (out / "selection.json").exists():
        raise ValueError(f"--out {out} already holds a search (selection.json); add --resume to continue it, or "
                         f"choose another --out")
    if not resume and (out / "auto").is_dir() and any(p.is_dir() for p in (out / "auto").iterdir()):
        raise ValueError(f"--out {out} holds the trials of an earlier --auto search ({out / 'auto'}): add --resume to "
                         f"continue it (the same options), or choose another --out")


def _valid_sequences(args: argparse.Namespace, model, source: Path) -> tuple[dict, dict]:
    """``({"fit": seqs, "select": seqs}, the record's split)``: with ``--task``, ``n`` (``--valid-sequences``,
    default 8) of each (:data:`SELECT_FIRST`); with ``--valid-data``, its first ``2 n`` sequences split by a seeded
    hash of their tokens (:data:`SPLIT_SEED`), about half each."""
    from kvpop.training import allocation as A
    from kvpop.training.search import split_keys

    n = args.valid_sequences or A.VALID_SEQUENCES
    if args.task:
        if n > SELECT_FIRST:
            raise ValueError(f"--valid-sequences {n}: at most {SELECT_FIRST} with --task (the select part starts at "
                             f"valid_seed({SELECT_FIRST}))")
        T = task_of(args.task)
        fit, sel = [T.valid_seed(i) for i in range(n)], [T.valid_seed(SELECT_FIRST + i) for i in range(n)]
        parts = {"fit": list(T.make_batch(fit, args.seq_len)["input_ids"]),
                 "select": list(T.make_batch(sel, args.seq_len)["input_ids"])}
        return parts, {"of": f"the task's validation seeds (valid_seed(0..{n - 1}) fit, valid_seed({SELECT_FIRST}.."
                             f"{SELECT_FIRST + n - 1}) select)", "fit": fit, "select": sel}
    seqs, _, _ = A.validation_file(args.valid_data, args.seq_len, 2 * n, vocab_size=model.config.vocab_size,
                                   model_dir=source, pack=args.pack,
                                   eos_token_id=getattr(model.config, "eos_token_id", None), train_digests=None,
                                   train_path=args.data)
    if not seqs:
        raise ValueError(f"--valid-data {args.valid_data} gives no sequence of --seq-len {args.seq_len} tokens")
    _held_out(args, model, source, seqs)
    if len(seqs) < 2:
        raise ValueError(f"--valid-data {args.valid_data} gives {len(seqs)} sequence(s) of --seq-len {args.seq_len} "
                         f"tokens; --auto needs at least 2 (one to fit, one to select), 16 or more to resolve "
                         f"small differences")
    keys = [",".join(map(str, s.tolist())) for s in seqs]
    fit, sel = split_keys(keys, SPLIT_SEED)
    return ({"fit": [seqs[i] for i in fit], "select": [seqs[i] for i in sel]},
            {"of": f"the first {len(seqs)} sequences of {args.seq_len} tokens of --valid-data {args.valid_data} "
                   f"(their index in the file), split by sha256 of '{SPLIT_SEED}:' and their tokens",
             "fit": fit, "select": sel})


def _fit_file(out: Path, seqs: list) -> Path:
    """``out/auto/fit.jsonl``: the fit sequences as token-id records, the ``--valid-data`` of the trials that
    allocate (the allocation never sees the select sequences)."""
    import json

    f = out / "auto" / "fit.jsonl"
    f.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in seqs)
    if not f.exists() or f.read_text() != text:
        f.write_text(text)
    return f


def _held_out(args: argparse.Namespace, model, source: Path, seqs: list) -> None:
    """The validation sequences the search scores on are held out from ``--data``: refused when every record of
    ``--valid-data`` is a training record (in any order, so with ``--pack`` too), or every sequence measured is a
    training sequence; a warning when some are."""
    import hashlib

    from kvpop.training import data as D

    tok: dict = {}

    def tokenizer():
        tok.setdefault("t", D.load_tokenizer(source))
        return tok["t"]

    def records(path: str) -> list[list[int]]:
        return D.read_jsonl(path, vocab_size=model.config.vocab_size, tokenizer=tokenizer,
                            tokenizer_source=str(source))

    def digest(ids: list[int]) -> bytes:
        return hashlib.blake2b(repr(ids).encode(), digest_size=16).digest()

    try:
        train = records(args.data)
    except ValueError as e:
        raise ValueError(f"--data: {e}") from None
    valid = records(args.valid_data)
    train_records = {digest(r) for r in train}
    shared = sum(digest(r) in train_records for r in valid)
    why = ("--auto's search must score its trials on held-out records, never on what they trained on: give "
           "--valid-data records that are not in --data")
    if shared == len(valid):
        raise ValueError(f"--valid-data {args.valid_data}: all {len(valid)} of its records are training records of "
                         f"--data {args.data} too (in any order): {why}")
    eos = getattr(model.config, "eos_token_id", None)
    sep = getattr(tok.get("t"), "eos_token_id", None) if tok else eos
    sep = (sep[0] if sep else None) if isinstance(sep, list) else sep
    try:
        cut = D.digests(D.chunk(train, args.seq_len, pack=args.pack, sep_id=sep, source=args.data))
    except ValueError:
        cut = set()  # no training sequence of this length: each trial says so
    both = sum(bool(D.digests([x]) & cut) for x in seqs)
    if both == len(seqs):
        raise ValueError(f"--valid-data {args.valid_data}: all {len(seqs)} of its sequences measured are training "
                         f"sequences of --data {args.data} too: {why}")
    if both or shared:
        print(f"kvpop train --auto: warning: --valid-data {args.valid_data}: {shared} of its {len(valid)} records "
              f"({both} of the {len(seqs)} sequences measured) are training records of --data {args.data} too: the "
              f"trials' scores are partly measured on training data", file=sys.stderr)


def _served(base, d: Path, budget: int):
    """``(run, models)``: the run in ``d`` read as ``kvpop eval --run`` reads it, and its policy models (dense
    and the run's) at ``budget`` over ``base``."""
    from kvpop.evaluation import evaluate as E
    from kvpop.evaluation import trace_eval as TE

    from .trained import policy_models, read_run

    t = read_run(str(d))
    return t, policy_models(E, base, ["dense", t.policy], [t.policy], {t.policy: t}, sinks=t.config.sinks,
                            window=t.config.window, budget=budget, load=TE.load_model)


def _scorer(source: Path, parts: dict, budget: int):
    """``score(dir, part)``: the run in ``dir`` served by ``kvpop eval --run`` at ``budget`` on the ``part``
    (``"fit"`` or ``"select"``) sequences of ``parts``: each sequence's mean next-token NLL over dense past the
    budget."""
    from kvpop.evaluation import trace_eval as TE

    base = TE.load_model(source)

    def score(d: Path, part: str) -> list[float]:
        t, models = _served(base, d, budget)
        cfg = TE.TraceEvalConfig(budgets=[budget], sinks=t.config.sinks, window=t.config.window,
                                 policies=["dense", t.policy], progress=False)
        rows = TE.evaluate_traces(models, parts[part], cfg)
        each = next(r["per_sequence"] for r in rows if r["policy"] == t.policy)
        return [float(x) for x in each if x is not None]  # a trace too short to score is None in every row

    return score


def _task_scorer(source: Path, task, seeds: dict, length: int, budget: int):
    """``score(dir, part)`` with ``--task``: the run in ``dir`` served at ``budget`` on the task's validation
    examples of ``seeds[part]`` at ``length``, each one's error rate at its graded positions (1 - accuracy), the
    task's own measure (``kvpop eval --run`` on the task reports accuracy)."""
    from kvpop.evaluation import evaluate as E
    from kvpop.evaluation import trace_eval as TE

    base = TE.load_model(source)
    examples = {part: [task.make_example(x, length) for x in xs] for part, xs in seeds.items()}

    def score(d: Path, part: str) -> list[float]:
        t, models = _served(base, d, budget)
        out = []
        for ex in examples[part]:
            c, g = E.sequence_correct(models[t.policy], ex, t.policy, budget)
            out.append(1.0 - c / g)
        return out

    return score


def _settings(args: argparse.Namespace):
    """The :class:`kvpop.training.auto.AutoSettings` of the command's options (what the search itself reads)."""
    from kvpop.training.auto import AutoSettings

    return AutoSettings(out=args.out, steps=args.steps, seed=args.seed, sinks=args.sinks, window=args.window,
                        resume=args.resume, auto_budget=args.auto_budget, patience=args.auto_patience,
                        eval_every=args.auto_eval_every, allocate=args.allocate,
                        progress=not getattr(args, "no_progress", False))


def _with(args: argparse.Namespace, overrides: dict) -> argparse.Namespace:
    """A copy of the command's options with ``overrides`` (option name -> value) set over them: one trial's
    ``kvpop train`` (:meth:`kvpop.training.auto._Trials.options`) or a label's oracle."""
    ns = copy.copy(args)
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def auto_run(args: argparse.Namespace, train) -> int | None:
    """``kvpop train``'s entry: ``--auto``'s search (:func:`run_auto`) and its exit status, or ``None`` for one run
    (then ``--preset`` has been applied to ``args``); an option error exits naming it."""
    try:
        check_auto_options(args)
    except ValueError as e:
        raise SystemExit(f"kvpop train: {e}") from None
    return run_auto(args, train) if args.auto else None


def run_auto(args: argparse.Namespace, train) -> int:
    """``kvpop train --auto``: :func:`kvpop.training.auto.search` with ``train`` (``kvpop.cli.train.run``) as the
    trial's training."""
    import torch

    from kvpop.models import load_model_dir
    from kvpop.training.auto import SEARCHED, _Stopped, oracle_excess, search, summary_lines
    from kvpop.training.options import check_options, method_config
    from kvpop.training.rundir import check_model
    from kvpop.training.runstate import RunDirectoryError, RunLock
    from kvpop.training.train import LEARNING_RATES
    from kvpop.training.trial_records import check_trial_dirs, search_inputs

    given = {k: getattr(args, k) for k in SEARCHED if getattr(args, k, None) is not None}
    first = copy.copy(args)
    first.allocate = first.allocate or "ablation"  # the trials that allocate take --valid-data / --valid-sequences
    try:
        check_options(first)  # every option of the trials, before any work
    except ValueError as e:
        raise SystemExit(f"kvpop train: {e}") from None
    served = first.budget  # --budget, or the default check_options filled in: every trial is scored at it
    source = Path(args.model) if args.model else default_model(args.task)
    if args.model is not None:
        try:
            check_model(args.model)
        except ValueError as e:
            raise SystemExit(f"kvpop train: {e}") from None
    lock = RunLock(Path(args.out), "kvpop train --auto")
    try:
        lock.acquire()
    except RunDirectoryError as e:
        raise SystemExit(f"kvpop train: {e}") from None
    signals = _StopOnSignal().install()
    try:
        resolved = copy.copy(first)
        resolved.allocate = args.allocate  # as given (first's "ablation" only let its options be checked)
        inputs = search_inputs(resolved, model_dir=source)
        check_trial_dirs(Path(args.out), "auto", inputs)  # an earlier start's trials, before any work
        torch.manual_seed(args.seed)
        model = load_model_dir(source, dtype=torch.float32)
        parts, split = _valid_sequences(args, model, source)

        def oracle(settings: dict) -> list[float]:
            ns = _with(args, {**settings, "valid_data": None, "valid_sequences": None, "min_k": None})
            check_options(ns)
            return oracle_excess(model, parts["select"], method_config(ns), per_sequence=True)

        if args.task:  # the task's own measure: accuracy at its graded positions
            score = _task_scorer(source, task_of(args.task), {k: split[k] for k in ("fit", "select")}, args.seq_len,
                                 served)
            criterion = (f"validation error rate at the task's graded positions (1 - accuracy; lower is better) of "
                         f"{len(parts['select'])} select sequences, served as kvpop eval --run serves the run")
            fit_data = None  # a trial's --allocate measures valid_seed(0..n-1): the fit part
        else:
            score = _scorer(source, parts, served)
            criterion = "validation NLL over dense past the budget (nats; lower is better), served as kvpop eval " \
                        "--run serves the run"

            def fit_data(out: Path) -> dict:
                return {"valid_data": str(_fit_file(out, parts["fit"])), "valid_sequences": len(parts["fit"])}
        record = search(_settings(args), served=served, given=given, lr_scorer=LEARNING_RATES["kvpop"]["lr_scorer"],
                        train_model=not args.no_train_model, train=lambda run: train(_with(args, run)), score=score,
                        oracle=oracle, split=split, fit_data=fit_data,
                        log=lambda s: print(s, file=sys.stderr, flush=True), criterion=criterion, inputs=inputs)
        for line in summary_lines(record):
            print(f"kvpop train --auto: {line}", flush=True)
    except (_Stopped, _Signalled) as e:
        what = f"stopped by {signal.Signals(e.rc - 128).name}" if e.rc > 128 else f"stopped (exit status {e.rc})"
        print(f"kvpop train --auto: {what}; the finished trials and the interrupted one's last checkpoint are kept in "
              f"{args.out}: run the same kvpop train --auto command with --resume to continue the search where it "
              f"stopped", file=sys.stderr, flush=True)
        return e.rc
    except (ValueError, OSError) as e:
        raise SystemExit(f"kvpop train: {e}") from None
    finally:
        signals.restore()
        lock.release()
    return 0


class _Signalled(BaseException):
    """SIGINT or SIGTERM outside a trial's training steps (which stop after the step in flight themselves)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.rc = 128 + signum


class _StopOnSignal:
    """SIGINT and SIGTERM stop the search at once with :class:`_Signalled` (its finished trials, and the
    interrupted one's checkpoints and validations, are kept for ``--resume``), so that the search says what
    happened instead of dying silently; a trial's ``kvpop train`` installs its own handlers over these while it
    trains (stopping after the step in flight), and they come back after it.  Outside the main thread: nothing; a
    signal the caller ignores (``SIG_IGN``, e.g. SIGINT of a job started in the background by a script) stays
    ignored."""

    def __init__(self) -> None:
        self._old: dict = {}

    def _handler(self, signum: int, frame) -> None:
        raise _Signalled(signum)

    def install(self) -> _StopOnSignal:
        import threading

        if threading.current_thread() is threading.main_thread():  # a signal ignored by the caller stays ignored
            self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)
                         if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
