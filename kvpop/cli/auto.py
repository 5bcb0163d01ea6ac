"""``kvpop train --auto``'s options and its collaborators: ``--auto``'s flags (:func:`add_arguments`), their
checks, the typed :class:`kvpop.training.auto.AutoSettings` built from them, one trial's training (``kvpop train``
itself, :class:`_Command`) and its score as ``kvpop eval --run`` serves it (:func:`_scorer`, :func:`_task_scorer`);
the search, its inputs and its trials are :func:`kvpop.training.auto.run`'s.  This module parses and prints."""
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
                      help="choose, on validation data, the next-token loss weight (--lm-weight 0, 0.1, 1), a "
                           "fixed decay (0.995, 0.98) against the learned one, whether a learned mask beats the same "
                           "fine-tune under the fixed StreamingLLM mask, head budgets, scorer lr, training budget, "
                           "label source, decay range and the joint run's warm start (--valid-data, or the task's "
                           "validation sequences with --task), split into fit and select parts, a --steps run per "
                           "trial, the top two confirmed with a second seed; writes OUT/selection.json and OUT as "
                           "the chosen run (--resume continues a search)")
    auto.add_argument("--auto-budget", default=None, metavar="STEPS|MINUTES",
                      help="--auto's budget: trained steps over all trials (e.g. 400) or minutes (e.g. 30m) "
                           "(default: 8 trials of --steps)")
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
    """``--auto-budget`` and ``--preset`` where they mean something, and the options ``--auto`` refuses, before
    any work (what ``--auto`` needs of its settings is :func:`kvpop.training.auto.check`'s)."""
    if not args.auto:
        for name in ("auto_budget", "auto_patience", "auto_eval_every"):
            if getattr(args, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {getattr(args, name)} is an option of --auto's search: give --auto, or "
                                 f"leave it out")
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
    """The :class:`kvpop.training.auto.AutoSettings` of the command's options (what the search reads of them)."""
    from kvpop.training.auto import AutoSettings

    return AutoSettings(out=args.out, steps=args.steps, seed=args.seed, sinks=args.sinks, window=args.window,
                        resume=args.resume, auto_budget=args.auto_budget, patience=args.auto_patience,
                        eval_every=args.auto_eval_every, allocate=args.allocate,
                        progress=not getattr(args, "no_progress", False), train_model=not args.no_train_model,
                        model=args.model, task=args.task, data=args.data, valid_data=args.valid_data,
                        valid_sequences=args.valid_sequences, seq_len=args.seq_len, pack=args.pack)


class _Command:
    """The command's own options as the search's collaborators: :meth:`options` a copy of them with overrides
    (option name -> value) set over them, :meth:`trial` one ``kvpop train`` run of such a copy (a trial,
    :meth:`kvpop.training.auto._Trials.options`), :meth:`oracle_config` the method's config of a label
    candidate (the first stage's oracle)."""

    def __init__(self, args: argparse.Namespace, train) -> None:
        self.args, self.train = args, train

    def options(self, overrides: dict) -> argparse.Namespace:
        ns = copy.copy(self.args)
        for k, v in overrides.items():
            setattr(ns, k, v)
        return ns

    def trial(self, overrides: dict) -> int:
        return self.train(self.options(overrides))

    def oracle_config(self, settings: dict):
        from kvpop.training.options import check_options, method_config

        # the oracle evicts by the exact label with uniform budgets: no allocation, no validation data
        ns = self.options({**settings, "valid_data": None, "valid_sequences": None, "min_k": None, "allocate": None})
        check_options(ns)
        return method_config(ns)


def auto_run(args: argparse.Namespace, train) -> int | None:
    """``kvpop train``'s entry: ``--auto``'s search (:func:`run_auto`) and its exit status, or ``None`` for one run
    (then ``--preset`` has been applied to ``args``); an option error exits naming it."""
    from kvpop.training.auto import preset_values

    try:
        check_auto_options(args)
        if args.auto:
            return run_auto(args, train)
        for k, v in preset_values(args.preset, vars(args)).items():
            setattr(args, k, v)
    except ValueError as e:
        raise SystemExit(f"kvpop train: {e}") from None
    return None


def run_auto(args: argparse.Namespace, train) -> int:
    """``kvpop train --auto``: :func:`kvpop.training.auto.run` of the command's :func:`_settings`, with ``train``
    (``kvpop.cli.train.run``) as the trials' training (:class:`_Command`); prints what ran, or how to resume."""
    from kvpop.training.auto import DECAY_OPTIONS, SEARCHED, _Signalled, _Stopped, next_steps, run, summary_lines

    command = _Command(args, train)
    first = command.options({"allocate": args.allocate or "ablation"})  # the allocating trials' options checked
    given = {k: getattr(args, k) for k in SEARCHED if getattr(args, k, None) is not None}
    if given.get("lm_weight") == 0.0:  # the default: searched (another value fixes it)
        del given["lm_weight"]
    decay = {k: getattr(args, k) for k in DECAY_OPTIONS if getattr(args, k, None) is not None}
    if decay:  # a decay given (range or value) is kept: neither decay stage runs
        given["decay"] = decay
    settings = _settings(args)
    try:
        task = task_of(args.task)
        source = Path(args.model) if args.model else default_model(args.task)
        record = run(settings, options=first, given=given, task=task, source=source, train_trial=command.trial,
                     oracle_config=command.oracle_config, scorer=_scorer, task_scorer=_task_scorer,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
    except (_Stopped, _Signalled) as e:
        what = f"stopped by {signal.Signals(e.rc - 128).name}" if e.rc > 128 else f"stopped (exit status {e.rc})"
        print(f"kvpop train --auto: {what}; the finished trials and the interrupted one's last checkpoint are kept in "
              f"{args.out}: run the same kvpop train --auto command with --resume to continue the search where it "
              f"stopped", file=sys.stderr, flush=True)
        return e.rc
    except (ValueError, OSError) as e:
        raise SystemExit(f"kvpop train: {e}") from None
    for line in summary_lines(record):
        print(f"kvpop train --auto: {line}", flush=True)
    print("kvpop train --auto: " + next_steps(record, out=args.out, source=str(source), budget=record["served_budget"],
                                              sinks=args.sinks, window=args.window, seq_len=args.seq_len,
                                              train_model=not args.no_train_model, task=args.task), flush=True)
    return 0
