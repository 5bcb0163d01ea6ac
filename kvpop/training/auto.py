"""``kvpop train --auto``: the training settings chosen on the user's own validation split, within a budget.

A staged search (:func:`auto_plan`, its stages as data, run by :class:`kvpop.training.search.Search`, the one
search code path, ``kvpop demo --select``'s too), each stage starting from the best settings of the stages
before it:

1. ``label``: the label family (:data:`LABEL_CANDIDATES`), scored by each label's oracle (:func:`oracle_excess`:
   the model as loaded, evicting by the exact label of its own dense attention), which needs no training (its
   score is an oracle NLL over dense, not a trained trial's validation score: the log and the record say so);
2. ``lm_weight``: the next-token loss beside the KL (``--lm-weight``, :data:`LM_WEIGHTS`), when the model is
   trained;
3. ``fixed_decay``: the decay held fixed at each of :data:`FIXED_DECAYS` against the learned range;
4. ``fixed_mask``: the same fine-tune under the fixed StreamingLLM mask (``--mask-source streaming``: no learned
   eviction), when the model is trained and ``--mask-source`` is not given;
5. ``head_budgets``: uniform budgets against head-adaptive ones (``--allocate ablation``);
6. ``lr_scorer``: the scorers' learning rate (:data:`LR_FACTORS` of the method's default);
7. ``train_budget``: training at the served budget against tighter ones (:func:`train_budgets`); every trial is
   still scored at the served ``--budget``, and the chosen run's scorer file is written at it (:func:`_adopt`);
8. ``target_source``: the label from the model being trained (student) against the frozen original's
   (teacher), when the model is trained;
9. ``decay``: the paper's decay range against the range tied to ``--seq-len`` (:data:`DECAY_NATS`), with the
   decay learned;
10. ``warm_start``: the joint run started from the scorers of a scorer-only run of the same settings
    (``--init-scorers``; the trial trains both, twice ``--steps``) against fresh scorers, when the model is
    trained and ``--init-scorers`` is not given.

The order is that of what moved real text's validation and test scores most (``studies/results/auto.md``): the
next-token loss about 0.04-0.05 nats/token at 12.5 % memory, a fixed decay about as much at 6.25 %, the fixed
mask against the learned one a tie at 12.5 %, and head budgets, learning rate, training budget, label source,
decay range and warm start under 0.01 each; the default budget (:data:`DEFAULT_TRIALS`) reaches the first four.
Under the fixed mask (``fixed_mask``'s choice, or the user's ``--mask-source streaming``) the stages that vary
the learned scorer alone (:func:`learned_mask`) do not run: they cannot change the model served; the record's
``chosen.served_as`` is then ``fixed-finetune``, served as ``OUT/model`` with the streaming policy.  Two trials
the rule cannot tell apart go to the cheaper to serve (:func:`serve_cost`; the record's ``cannot_tell`` and
``tie_rule``), and before the trained trials the record's ``power`` says what difference the select part
resolves and how many select sequences a difference of :data:`TARGET` needs.

The validation sequences are split in two disjoint parts (``split`` in the record; ``kvpop.cli.auto``): the
*fit* part serves what learns from validation (a trial's ``--allocate ablation`` and early stopping), the
*select* part only scores trials, per sequence (``per_sequence``), and the choice between trials is the one rule
of :func:`kvpop.training.search.prefer` (2 paired standard errors; ``decisions``).  Every trial stops early
(:func:`early_stopping`): it is validated on the fit part every ``--auto-eval-every`` steps (its ``kvpop train``
extended by ``--resume``, the one uninterrupted run), stopped after ``--auto-patience`` validations without a
better score (a tie goes to the later state, the run as long as asked), and its outputs are its best validated state's
(``validations`` and ``best_step`` in its record; ``steps`` the last step trained), scored once on the select
part; ``--auto-patience 0`` trains every trial to ``--steps`` and scores it once.  The top two trials are then
trained again with ``--seed + 1`` and chosen on the mean (``confirmation``), paid from the budget (a steps
budget keeps ``2 x --steps`` for it when two trials fit besides; when it cannot pay, the record says why).
The record's ``summary`` (printed on stdout) says which stages ran, which were skipped for the budget, and the
``--auto-budget`` that runs them all.

Every trained trial is an ordinary ``kvpop train`` run of ``--steps`` steps in ``OUT/auto/<tag>``, scored on
the validation sequences as ``kvpop eval --run`` serves it (the mean next-token NLL over dense past the
budget, through ``kvpop.KVpopCache``; with ``--task`` the error rate at the task's graded positions, the task's
own measure: the NLL over all positions chose head-adaptive budgets that starve a head of the retrieval the
task grades; lower is better).  A stage's candidates after its first are skipped once
the budget (:func:`parse_budget`: trained steps, or minutes of the trials' wall time) would be overrun.  The
record is ``OUT/selection.json`` (``trials``: settings, validation score, steps, seconds; ``chosen``), written
after every trial; the chosen trial's files are then copied into ``OUT``, so ``OUT`` is a run that
``kvpop eval --run OUT`` and the vLLM plugin take as it is.  A finished trial (``OUT/auto/<tag>/trial.json``)
is never trained again: ``--resume`` continues an interrupted search where it stopped (the record, the budget
and the reuse are :class:`~kvpop.training.search.Search`'s), once every trial's record is checked and found to
be of the same options and data (:mod:`kvpop.training.trial_records`; only ``--auto-budget`` may change).

The search takes typed settings (:class:`AutoSettings`, which ``kvpop.cli.auto`` builds from the command's
options) and its collaborators as functions (one ``kvpop train`` run from a dict of option overrides, the
served score of one run), so that it never sees the command's parsed arguments and imports nothing above
:mod:`kvpop.training`; ``kvpop.cli.auto`` gives them.  :func:`auto_plan` (the stages, as data) is here too; the
engine that runs any plan is :mod:`kvpop.training.search`.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvpop.core.files import replace_files

from .auto_data import AutoSettings
from .trial_records import PATIENCE, early_stopping  # noqa: F401  (re-exported: the search's early stopping)

if TYPE_CHECKING:
    from kvpop.training.search import Stage

__all__ = ["PAPER", "LABEL_CANDIDATES", "SEARCHED", "AutoSettings", "parse_budget", "default_budget",
           "preset_values", "oracle_excess", "check", "run", "search", "auto_plan", "train_budgets", "early_stopping",
           "early_stopped", "summary_lines", "next_steps", "fixed_decay_options", "serve_cost", "power_line",
           "LM_WEIGHTS", "FIXED_DECAYS", "DECAY_OPTIONS"]

PAPER = {"scorer": "mlp", "label": "mean", "decay_nats": None, "gamma_min": 0.999, "gamma_max": 0.999999,
         "gamma_init": 0.9999, "mask_source": "scorer", "target_source": "student", "target_lse": "sparse"}
"""``--preset paper``: the paper's method (MLP scorer, the mean label, the decay range [0.999, 0.999999] from
0.9999, the scorers' own priorities as the training mask, the student's sparse label, uniform budgets)."""
LABEL_CANDIDATES = ("mean", "max")
"""The first stage's label families (``KVpopConfig.label``)."""
DECAY_NATS = 8.0
"""The third stage's alternative to the paper's decay range: ``--decay-nats 8`` (``gamma_min = exp(-8 / --seq-len)``,
``kvpop.decay_range_for_context``; the value the demo's selection grid tried)."""
SEARCHED = ("label", "lm_weight", "decay_nats", "lr_scorer", "allocate", "target_source", "init_scorers",
            "mask_source")
"""The settings the search chooses; one the user gave is kept as given (its stage has that one candidate).
``--lm-weight`` counts as given when it is not its default 0; any of ``--decay-nats`` / ``--gamma-min`` /
``--gamma-max`` / ``--gamma-init`` fixes the decay (``given["decay"]``: both decay stages left out)."""
DECAY_OPTIONS = ("decay_nats", "gamma_min", "gamma_max", "gamma_init")
"""The options that set the decay: one given fixes it (the ``fixed_decay`` and ``decay`` stages are left out)."""
LM_WEIGHTS = (0.0, 0.1, 1.0)
"""The ``lm_weight`` stage's next-token loss weights (``--lm-weight``): 0 (the KL alone, the default) and the
values the real-text studies chose from (issue 44: 0.1 chosen for the MLP joint row and the fixed-mask control,
1 for key norm and window attention; ``studies/results/evidence.md``)."""
FIXED_DECAYS = (0.995, 0.98)
"""The ``fixed_decay`` stage's decays, each held fixed (``--gamma-min G --gamma-max G + 2e-6 --gamma-init G +
1e-6``, :func:`fixed_decay_options`) against the learned range: an age penalty of about 5 and 20 nats over
1,024 tokens (``studies.decay_realtext.GAMMAS``, whose select part chose 0.995 on real text)."""
LR_FACTORS = (1.0, 3.0, 10.0)
"""The second stage's scorer learning rates, as factors of the method's default (the demo's selection chose
3e-3 and 1e-2 on its two tasks, above the default 1e-3)."""
TRAIN_K_DIVISORS = (4, 16)
"""The third stage's training budgets: the served budget's long-range slots ``k`` divided by each (at least one
slot), besides ``k`` itself (the demo's selection trained kvtrace at k = 4 and lookahead at k = 12 and served
them at k = 92 and 28)."""
RUN_FILES = ("scorers.safetensors", "gates.safetensors", "model", "head_budgets.json", "last.pt", "args.json",
             "history.jsonl")
"""What of the chosen trial is copied into ``OUT``."""
SERVED_FILES = ("scorers.safetensors", "model", "head_budgets.json")
"""A run's served outputs: what early stopping keeps of a trial's best validated state (``best/``)."""
MAX_BUDGET = 1e15
"""The largest ``--auto-budget`` taken (steps or minutes): more than any search spends, and exact as a float."""
DEFAULT_TRIALS = 8
"""The default budget: this many trained trials of ``--steps`` steps each: with the confirmation's two, six
for the stages, which reach the three that moved real text's score most (``lm_weight``'s three, ``fixed_decay``'s
two, ``fixed_mask``'s one; ``studies/results/auto.md``)."""
TARGET = {"nll": 0.005, "error": 0.05}
"""The difference the record's ``power`` says how many select sequences would detect (80 % power): 0.005
nats/token of NLL over dense (what separated real text's recipes at 12.5 % memory), 0.05 of a task's error rate."""


def fixed_decay_options(gamma: float) -> dict:
    """The options that hold the decay at ``gamma`` (``0 < gamma < 1``): the range ``[gamma, gamma + 2e-6]`` from
    ``gamma + 1e-6`` (as ``studies.decay_realtext`` trains it), ``--decay-nats`` off."""
    if not (isinstance(gamma, (int, float)) and 0 < gamma < 1 - 2e-6):
        raise ValueError(f"a fixed decay must lie in (0, 1 - 2e-6), got {gamma!r}")
    return {"gamma_min": gamma, "gamma_max": gamma + 2e-6, "gamma_init": gamma + 1e-6, "decay_nats": None}


def serve_cost(settings: Mapping[str, Any], *, train_model: bool, steps: int = 0) -> tuple[int, int]:
    """What a trial of ``settings`` costs to serve and to train, a sortable key (the tie rule of
    :func:`kvpop.training.search.tie_break`): served under the fixed mask (0: no scorer) < the scorers with the
    original model (1) < the scorers with a fine-tuned model (2); then the steps it trains (``steps``: the warm
    start trains twice)."""
    if not learned_mask(settings):
        return 0, steps
    return (2 if train_model else 1), steps


def train_budgets(budget: int, sinks: int, window: int) -> list[int]:
    """The third stage's tighter training budgets for a served ``budget``: ``sinks + window + max(1, k // d)`` for
    each divisor ``d`` of :data:`TRAIN_K_DIVISORS` (``k = budget - sinks - window``), distinct and below
    ``budget``, largest first; none when ``k <= 1``."""
    k = budget - sinks - window
    out: list[int] = []
    for d in TRAIN_K_DIVISORS:
        b = sinks + window + max(1, k // d)
        if b < budget and b not in out:
            out.append(b)
    return out


def parse_budget(text: str | None, steps: int) -> tuple[str, float]:
    """``--auto-budget``: ``"N"`` trained steps over every trial, or ``"Nm"`` / ``"Nmin"`` minutes of the trials'
    wall time; ``None``: :func:`default_budget`.  ValueError naming what was given and what is allowed."""
    if text is None:
        return default_budget(steps)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(m|min|minutes?)?\s*", str(text))
    if m is None:
        raise ValueError(f"--auto-budget {text!r}: give trained steps (an integer, e.g. 400) or minutes (e.g. 30m, "
                         f"30min)")
    value, unit = float(m.group(1)), "minutes" if m.group(2) else "steps"
    if not math.isfinite(value) or value > MAX_BUDGET:
        raise ValueError(f"--auto-budget {text[:40]}{'...' if len(text) > 40 else ''} ({len(m.group(1))} digits): "
                         f"too large; give at most {MAX_BUDGET:.0e} {unit}")
    if unit == "steps":
        if value != int(value):
            raise ValueError(f"--auto-budget {text!r}: a number of steps must be an integer (or say minutes: 30m)")
        if value < steps:
            raise ValueError(f"--auto-budget {text}: fewer steps than one trial's --steps {steps}; give at least "
                             f"{2 * steps} (two trials) or lower --steps")
    elif not (math.isfinite(value) and value > 0):
        raise ValueError(f"--auto-budget {text!r}: the minutes must be > 0")
    return unit, value


def default_budget(steps: int) -> tuple[str, float]:
    """:data:`DEFAULT_TRIALS` trials of ``steps`` trained steps each: it follows the run length the user chose
    for the model (a tiny model's 20-100 CPU steps, a large one's thousands on a GPU)."""
    return "steps", float(DEFAULT_TRIALS * steps)


def preset_values(preset: str | None, given: Mapping[str, Any]) -> dict[str, Any]:
    """``--preset paper``: the :data:`PAPER` settings a run takes (``{}`` without a preset), for the options
    ``given`` (each option's value, ``None`` when not given; ``allocate`` and ``head_budgets`` among them); an
    option the user gave with another value is refused naming both."""
    if preset is None:
        return {}
    if preset != "paper":
        raise ValueError(f"--preset {preset!r}: allowed: paper")
    for k, v in PAPER.items():
        was = given.get(k)
        if was is not None and was != v:
            raise ValueError(f"--preset paper sets --{k.replace('_', '-')} {v}; --{k.replace('_', '-')} {was} "
                             f"contradicts it: leave one out")
    if given.get("allocate") is not None or given.get("head_budgets") is not None:
        raise ValueError("--preset paper trains with uniform budgets: leave out --allocate / --head-budgets")
    return {k: v for k, v in PAPER.items() if v is not None}


def oracle_excess(model: torch.nn.Module, seqs: Sequence[torch.Tensor], config: Any, *,
                  per_sequence: bool = False) -> float | list[float]:
    """The mean next-token NLL over dense (nats) of ``model`` evicting by the exact label of ``config`` (its
    label, eps and decay) computed from its own dense attention: ``mask_source`` and ``target_source``
    ``"teacher"``, the model as loaded its own teacher.  ``seqs``: int64 ``[S]`` validation sequences, ``S``
    above ``config.budget``; no training, two forwards per sequence.  ``per_sequence``: the list of each
    sequence's own excess instead of the pooled mean."""
    from kvpop.core import patched, set_teacher_targets, teacher_targets

    cfg = config.replace(mask_source="teacher", target_source="teacher", head_budgets=None)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = dense = 0.0
    n = 0
    each: list[float] = []
    try:
        with torch.no_grad():
            for s in seqs:
                ids = s.reshape(1, -1).to(device=device, dtype=torch.long)
                with teacher_targets(model, cfg) as store:
                    logits = model(ids, use_cache=False).logits[:, :-1].float()
                targets = dict(store)
                d = float(F.cross_entropy(logits[0], ids[0, 1:], reduction="sum").double())
                dense += d
                with patched(model, cfg):
                    set_teacher_targets(model, targets)
                    logits = model(ids).logits[:, :-1].float()
                t = float(F.cross_entropy(logits[0], ids[0, 1:], reduction="sum").double())
                each.append((t - d) / (ids.shape[1] - 1))
                total += t
                n += ids.shape[1] - 1
    finally:
        model.train(was_training)
    return each if per_sequence else (total - dense) / n


def check(settings: AutoSettings) -> None:
    """What ``--auto`` needs of its settings, before any work: validation records held out from ``--data``
    (:func:`kvpop.training.auto_data.check_valid_file`), an ``--out`` it may write (``check_out``), a budget
    (:func:`parse_budget`) and early stopping (:func:`early_stopping`) it takes.  ValueError naming the option."""
    from .auto_data import check_out, check_valid_file

    if settings.data is not None:
        check_valid_file(settings.valid_data, settings.data)
    check_out(Path(settings.out), settings.resume, RUN_FILES)
    parse_budget(settings.auto_budget, settings.steps)
    early_stopping(settings.steps, settings.patience, settings.eval_every)


def run(settings: AutoSettings, *, options: Any, given: dict, source: Path, task: Any,
        train_trial: Callable[[dict], int], oracle_config: Callable[[dict], Any],
        scorer: Callable[..., Callable[[Path, str], list[float]]],
        task_scorer: Callable[..., Callable[[Path, str], list[float]]],
        log: Callable[[str], None] = print) -> dict:
    """``kvpop train --auto`` whole: its settings checked (:func:`check`), every option of the trials checked
    (``options``: the command's options with the trials' ``--allocate``, which
    :func:`kvpop.training.options.check_options` fills in), ``OUT`` locked, SIGINT and SIGTERM turned into
    :class:`_Signalled` (:class:`_StopOnSignal`), the earlier trials checked against the search's inputs
    (:func:`kvpop.training.trial_records.search_inputs`), the model in ``source`` loaded, the validation
    sequences split (:func:`kvpop.training.auto_data.valid_sequences`; ``task``: the task module of ``--task``),
    then :func:`search`; returns its record.

    The collaborators, given by ``kvpop.cli.auto``: ``train_trial(overrides)`` one ``kvpop train`` run of the
    command's options with ``overrides`` set over them (its exit status); ``oracle_config(settings)`` the method's
    config of those options with a label candidate's ``settings``; ``scorer(source, parts, budget)`` and, with
    ``--task``, ``task_scorer(source, task, seeds, length, budget)``: ``score(dir, part)``, a run served as
    ``kvpop eval --run`` serves it.  Raises ValueError (or :class:`~kvpop.training.runstate.RunDirectoryError`)
    naming what is at fault, :class:`_Stopped` when a trial's ``kvpop train`` stopped, :class:`_Signalled` on a
    signal outside a trial's training steps."""
    from kvpop.models import load_model_dir

    from .auto_data import fit_file, valid_sequences
    from .options import check_options
    from .rundir import check_model
    from .runstate import RunLock
    from .train import LEARNING_RATES
    from .trial_records import check_trial_dirs, search_inputs

    check(settings)
    check_options(options)  # every option of the trials, before any work
    served = options.budget  # --budget, or the default check_options filled in: every trial is scored at it
    if settings.model is not None:
        check_model(settings.model)
    out = Path(settings.out)
    lock = RunLock(out, "kvpop train --auto")
    lock.acquire()
    signals = _StopOnSignal().install()
    try:
        # --allocate as given (the options' "ablation" only let the allocating trials' options be checked)
        inputs = search_inputs(options, model_dir=source, overrides={"allocate": settings.allocate})
        check_trial_dirs(out, "auto", inputs)  # an earlier start's trials, before any work
        torch.manual_seed(settings.seed)
        model = load_model_dir(source, dtype=torch.float32)
        parts, split = valid_sequences(settings, model, source, task)

        def oracle(candidate: dict) -> list[float]:
            return oracle_excess(model, parts["select"], oracle_config(candidate), per_sequence=True)

        fit_data = None  # with --task, a trial's --allocate measures valid_seed(0..n-1): the fit part
        if settings.task:  # the task's own measure: accuracy at its graded positions
            score = task_scorer(source, task, {k: split[k] for k in ("fit", "select")}, settings.seq_len, served)
            criterion = (f"validation error rate at the task's graded positions (1 - accuracy; lower is better) of "
                         f"{len(parts['select'])} select sequences, served as kvpop eval --run serves the run")
        else:
            score = scorer(source, parts, served)
            criterion = "validation NLL over dense past the budget (nats; lower is better), served as kvpop eval " \
                        "--run serves the run"

            def fit_data(d: Path) -> dict:
                return {"valid_data": str(fit_file(d, parts["fit"])), "valid_sequences": len(parts["fit"])}
        return search(settings, served=served, given=given, lr_scorer=LEARNING_RATES["kvpop"]["lr_scorer"],
                      train_model=settings.train_model, train=train_trial, score=score, oracle=oracle, split=split,
                      fit_data=fit_data, log=log, criterion=criterion, inputs=inputs)
    finally:
        signals.restore()
        lock.release()


def search(settings: AutoSettings, *, served: int, given: dict, lr_scorer: float, train_model: bool,
           train: Callable[[dict], int], score: Callable[[Path, str], list[float]],
           oracle: Callable[[dict], list[float]], split: dict, fit_data: Callable[[Path], dict] | None = None,
           log: Callable[[str], None] = print,
           criterion: str = "validation NLL over dense past the budget (nats; lower is better), served as kvpop "
                            "eval --run serves the run", inputs: dict | None = None) -> dict:
    """Run the staged search of this module (:func:`auto_plan` on :class:`kvpop.training.search.Search`, the one
    search of ``kvpop demo --select`` too) of ``settings`` (``settings.out``: OUT) and return the record written
    to ``OUT/selection.json``.

    ``served``: the budget every trial is scored at and the chosen run is written for (``--budget`` as
    :func:`kvpop.training.options.check_options` fills it in); ``given``: the searched options
    (:data:`SEARCHED`) the user gave, fixed at their values; ``lr_scorer``: the
    method's default scorer learning rate; ``train_model``: whether the model is trained (the label-source
    stage); ``train(overrides)``: one ``kvpop train`` run of the command's options with ``overrides`` (a dict of
    option name to value, :meth:`_Trials.options`) set over them (its exit status); ``score(dir, part)``:
    the per-sequence validation scores of the run in ``dir`` on the ``"fit"`` or ``"select"`` sequences (lower is
    better); ``oracle(settings)``: the first stage's per-sequence scores of a label candidate on the select
    sequences; ``split``: the record's ``split`` (``fit`` and ``select``, disjoint); ``fit_data(out)``: the
    options a trial that allocates takes to measure its head budgets on the fit part alone (``valid_data``,
    ``valid_sequences``); ``criterion``: what ``score`` measures, for the record; ``inputs``: what the trials run
    under (:func:`kvpop.training.trial_records.search_inputs`; recorded in every trial, and a trial of other
    inputs is refused, never reused or continued)."""
    if not isinstance(settings, AutoSettings):
        raise TypeError(f"search takes AutoSettings (kvpop.cli.auto builds them from the command's options), got "
                        f"{type(settings).__name__}")
    out = Path(settings.out)
    s = _open_search(settings, out, served=served, split=split, log=log, criterion=criterion, inputs=inputs)
    trials = _Trials(settings, out, served=served, train=train, score=score, oracle=oracle, fit_data=fit_data,
                     log=log)

    def options(key: str, values: list) -> list:
        return [given[key]] if key in given else values

    plan = auto_plan(labels=options("label", list(LABEL_CANDIDATES)),
                     lr_scorers=options("lr_scorer", [lr_scorer * f for f in LR_FACTORS]),
                     train_budgets=train_budgets(served, settings.sinks, settings.window), given=given,
                     decay_nats=DECAY_NATS, train_model=train_model,
                     warm_start=train_model and "init_scorers" not in given)
    kind = "error" if settings.task else "nll"
    trials.scale = SCALE[kind]
    s.scales = {False: "oracle NLL over dense (the label's own oracle, no training: not on the trials' scale)",
                True: f"trained trial's select score ({SCALE[kind]})"}
    s.cost = lambda st: serve_cost({"mask_source": given.get("mask_source"), **st}, train_model=train_model,
                                   steps=trials.steps_of(st))
    s.record["tie_rule"] = TIE_RULE
    s.record["power"] = _power_before(s, plan, trials, kind)
    log(f"[kvpop train --auto] {power_line(s.record['power'], kind)}")
    hint = "; raise --auto-budget to {need} to run every stage and the confirmation"
    best = s.run_plan(plan, trials.trained, oracle=trials.oracle_trial, steps_of=trials.steps_of, subdir="auto")
    best, s.record["confirmation"] = s.confirm(best, trials.trained, seed=("seed", settings.seed + 1),
                                               steps_of=trials.steps_of, subdir="auto",
                                               raise_hint="; raise --auto-budget to {need} to run it")
    fixed = not learned_mask({"mask_source": given.get("mask_source"), **best["settings"]})
    s.record["chosen"] = {"settings": best["settings"], "score": best["score"], "dir": best["dir"],
                          "served_as": "fixed-finetune" if fixed else "kvpop", "scale": SCALE[kind],
                          "cannot_tell": _ties_of(s.record, best["settings"])}
    s.record["summary"] = s.summary(raise_hint=hint, confirmation=s.record["confirmation"])
    s.record["power_measured"] = _power_after(s.record, kind)
    s.save()
    _adopt(out, out / best["dir"], served)
    log(f"[kvpop train --auto] chosen {best['settings']} (select score {best['score']:.5f}, {SCALE[kind]}); "
        f"{len(s.record['trials'])} trials, {s.spent['steps']} trained steps; the run is {out}")
    if fixed:
        log(f"[kvpop train --auto] no learned eviction beat the same fine-tune under the fixed StreamingLLM mask on "
            f"this validation: serve {out / 'model'} with the streaming policy (vLLM: \"kvpop_policy\": "
            f"\"streaming\"; kvpop eval --run {out} serves it as fixed-finetune)")
    return s.record


SCALE = {"nll": "mean NLL over dense past the budget, nats/token, of the run as served; lower is better",
         "error": "error rate at the task's graded positions of the run as served; lower is better"}
"""What a trained trial's score is (``"nll"``: ``--valid-data``; ``"error"``: ``--task``)."""
TIE_RULE = ("two trials the rule cannot tell apart (the mean difference within 2 paired standard errors either "
            "way): the cheaper to serve is kept (the fixed mask < the scorers with the original model < the scorers "
            "with a fine-tuned model), then the one that trains fewer steps, then the incumbent (the earlier trial); "
            "every such pair is listed under cannot_tell with the interval of its difference (mean +- the margin)")
"""What the record's ``tie_rule`` says (docs/DESIGN.md section 7, "Selection")."""


def _power_before(s: Any, plan: Sequence[Stage], trials: _Trials, kind: str) -> dict:
    """The record's ``power``, before any trained trial: what the select part resolves given a per-sequence
    spread measured untrained: the paired difference of the two labels' oracles (the label stage's own trials,
    run here first and reused by it), or with one label the spread of its oracle's values; with ``--task`` the
    oracle's NLL is not the trials' scale, so only the count is given."""
    from kvpop.training.search import power

    n = len(s.record["split"]["select"])
    target = TARGET[kind]
    if kind != "nll":
        return power(n, None, target=target, spread_of="not known before two trained trials (the oracle's NLL is "
                                                        "not the task's error rate)")
    stage = plan[0]
    if stage.name == "label" and not stage.trained:
        a, b = (s.trial("label", {**stage.start, **v}, trials.oracle_trial, trained=False, subdir="auto")
                for v in stage.variations[:2])
        diffs = [x - y for x, y in zip(a["per_sequence"], b["per_sequence"])]
        of = f"the paired difference of the label oracles {a['settings']['label']} and {b['settings']['label']}"
    else:
        label = stage.start.get("label") if stage.start is not None else None
        diffs = trials.oracle({"label": label} if label else {})
        of = "the values of the label oracle (no second candidate to pair it with)"
    return power(n, _sd(diffs), target=target, spread_of=of)


def _power_after(record: dict, kind: str) -> dict | None:
    """The record's ``power_measured``: :func:`~kvpop.training.search.power` at the median per-sequence spread of
    the trained trials' paired differences (its decisions), ``None`` before two trained trials."""
    from kvpop.training.search import power

    ds = [d for d in record.get("decisions", []) if d.get("paired") and d.get("se") is not None
          and d.get("stage") != "label"]
    if not ds:
        return None
    spreads = sorted(d["se"] * math.sqrt(d["n"]) for d in ds)
    return power(ds[0]["n"], spreads[len(spreads) // 2], target=TARGET[kind],
                 spread_of=f"the median of the {len(ds)} trained decisions' paired differences")


def _sd(xs: Sequence[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def power_line(p: Mapping[str, Any], kind: str) -> str:
    """The record's ``power`` in words (printed before the trained trials)."""
    unit = "nats/token" if kind == "nll" else "of the error rate"
    if p.get("resolvable") is None:
        return (f"selection power: {p['n_select']} select sequences; the spread of a difference is "
                f"{p['spread_of']}: see power_measured in selection.json once two trials ran")
    return (f"selection power: {p['n_select']} select sequences resolve a difference of {p['resolvable']:.4f} "
            f"{unit} (the rule's 2 paired standard errors; spread {p['spread']:.4f}, from {p['spread_of']}) and "
            f"detect {p['detectable_80']:.4f} with 80 % power; a difference of {p['target']:g} needs "
            f"{p['n_for_target']} select sequences"
            + (" (give more validation records)" if p["n_for_target"] > p["n_select"] else ""))


def _ties_of(record: dict, settings: Mapping[str, Any]) -> list[dict]:
    """The record's ``cannot_tell`` pairs that the chosen ``settings`` is in."""
    return [c for c in record.get("cannot_tell", []) if settings in (c["a"], c["b"])]


def auto_plan(*, labels: Sequence[str], lr_scorers: Sequence[float], train_budgets: Sequence[int],
              given: Mapping[str, Any], decay_nats: float, train_model: bool,
              warm_start: bool = False, lm_weights: Sequence[float] = LM_WEIGHTS,
              fixed_decays: Sequence[float] = FIXED_DECAYS) -> list[Stage]:
    """``kvpop train --auto``'s stages (:class:`kvpop.training.search.Stage`s; :func:`search` gives the
    candidates): ``label`` scored by each label's oracle (untrained; absent with one label or a fixed mask), then,
    trained and compared anew, in the order of what moved real text's validation score most
    (``studies/results/auto.md``): ``lm_weight`` (the next-token loss: ``lm_weights``, when the model is
    trained), ``fixed_decay`` (each of ``fixed_decays`` held fixed against the learned range), ``fixed_mask``
    (the same fine-tune under the fixed StreamingLLM mask, when the model is trained), ``head_budgets``
    (``allocate ablation`` against uniform), ``lr_scorer``, ``train_budget``, when the model is trained
    ``target_source``, then ``decay`` (``decay_nats`` against the paper's range, with the decay learned) and,
    when the model is trained and ``warm_start``, ``warm_start`` (the joint run started from a scorer-only run's
    scorers, ``{"warm_start": "scorer-only"}``; a trial of it trains twice).  A setting in ``given`` (the
    user's; ``given["decay"]``: the decay options) is fixed and its stage left out.  The stages that change only
    the learned scorer (:func:`learned_mask`: label, fixed decay, head budgets, scorer lr, label source, decay
    range, warm start) do not run under the fixed mask (the user's ``--mask-source streaming``, or the
    ``fixed_mask`` stage's choice): they cannot change what is served."""
    from kvpop.training.search import Stage

    fixed = given.get("mask_source") == "streaming"

    def learned(settings: Mapping[str, Any]) -> bool:  # the user's --mask-source is in no trial's settings
        return learned_mask({"mask_source": given.get("mask_source"), **settings})

    def range_learned(settings: Mapping[str, Any]) -> bool:  # the decay range matters only with a learned decay
        return learned(settings) and settings.get("fixed_decay") is None

    decay_given = "decay" in given or "decay_nats" in given
    start: dict[str, Any] = {}
    plan = []
    if len(labels) > 1 and not fixed:
        plan.append(Stage("label", [{"label": x} for x in labels], start={}, trained=False))
    else:
        start["label"] = labels[0]
    if train_model:
        start["lm_weight"] = given.get("lm_weight", lm_weights[0] if lm_weights else 0.0)
    if not decay_given:
        start["fixed_decay"] = None
    start.update({"decay_nats": given.get("decay_nats"), "allocate": given.get("allocate"),
                  "target_source": given.get("target_source", "student"), "train_budget": None})
    if len(lr_scorers) > 1:
        start["lr_scorer"] = lr_scorers[0]
    # (name, variations, when): in the order of what moved the score most (module docstring)
    stages: list[tuple[str, list[dict], Callable | None]] = []
    if train_model and "lm_weight" not in given and len(lm_weights) > 1:
        stages.append(("lm_weight", [{"lm_weight": w} for w in lm_weights], None))
    if not decay_given and fixed_decays:
        stages.append(("fixed_decay", [{"fixed_decay": g} for g in fixed_decays], learned))
    if train_model and "mask_source" not in given:
        stages.append(("fixed_mask", [{"mask_source": "streaming"}], None))
    if "allocate" not in given:
        stages.append(("head_budgets", [{"allocate": "ablation"}], learned))
    if len(lr_scorers) > 1:
        stages.append(("lr_scorer", [{"lr_scorer": lr} for lr in lr_scorers], learned))
    if train_budgets:
        stages.append(("train_budget", [{"train_budget": b} for b in train_budgets], None))
    if train_model and "target_source" not in given:
        stages.append(("target_source", [{"target_source": "teacher"}], learned))
    if not decay_given:
        stages.append(("decay", [{"decay_nats": decay_nats}], range_learned))
    if train_model and warm_start:
        stages.append(("warm_start", [{"warm_start": "scorer-only"}], learned))
    # the first stage that can run under the start's settings starts the trained search (its first trial the
    # start itself); a stage of the learned scorer under the user's fixed mask never can
    first = next((k for k, (_, _, when) in enumerate(stages) if when is None or not fixed), None)
    if first is None:
        plan.append(Stage("given", [{}], start=start))
    else:
        name, variations, _ = stages.pop(first)
        plan.append(Stage(name, [{}, *variations], start=start))
    plan += [Stage(name, variations, when=when) for name, variations, when in stages]
    return plan


def learned_mask(settings: Mapping[str, Any]) -> bool:
    """Whether the trials of ``settings`` are served by their scorers: any training mask but the fixed
    StreamingLLM one (the ``fixed_mask`` stage's, or the user's ``--mask-source streaming``), under which the label
    source, the decay range and a warm start change nothing served."""
    return settings.get("mask_source") != "streaming"


def _open_search(settings: AutoSettings, out: Path, *, served: int, split: dict, log: Callable[[str], None],
                 criterion: str, inputs: dict | None):
    """The :class:`~kvpop.training.search.Search` of ``OUT`` (a finished one only with ``--resume``; every
    trial of an earlier start checked against ``inputs`` first), its header, budget and the confirmation's
    reserve."""
    from kvpop.training.search import Search, resolution
    from kvpop.training.trial_records import check_trial_dirs

    if (out / "selection.json").exists() and not settings.resume:
        raise ValueError(f"--out {out} already holds a search (selection.json); add --resume to continue it, or "
                         f"choose another --out")
    if inputs is not None:
        check_trial_dirs(out, "auto", inputs)  # every trial of an earlier start, before any work
    steps = settings.steps
    budget = parse_budget(settings.auto_budget, steps)
    header = {"criterion": f"{criterion}; the label stage: each label's oracle (NLL over dense)",
              "steps_per_trial": steps, "served_budget": served, "split": split, "rule": RULE}
    if inputs is not None:
        header["search_inputs"] = inputs
    s = Search(out, header=header, budget=budget, log=log, prefix="[kvpop train --auto]", inputs=inputs)
    n_fit, n_sel = len(split["fit"]), len(split["select"])
    log(f"[kvpop train --auto] validation split: {n_fit} fit sequences (head-budget allocation, early stopping), "
        f"{n_sel} select sequences (trial scores only); {resolution(n_sel)}")
    s.record["resolution"] = resolution(n_sel)
    if budget[0] == "steps" and budget[1] - 2 * steps >= 2 * steps:
        s.reserve(2 * steps)  # the confirmation's two retrained trials are paid for first
    return s


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


AUTO_OFF = {"auto": False, "auto_budget": None, "preset": None, "auto_patience": None, "auto_eval_every": None}
"""What every trial's ``kvpop train`` sets over the command's options: a trial is one plain run, not a search."""


class _Trials:
    """The trials of one ``--auto`` search: a trial's ``kvpop train`` run (:meth:`trained`, with the joint run's
    warm start), its early stopping on the fit sequences (:meth:`validated`) and a label's oracle
    (:meth:`oracle_trial`); the collaborators (``train``, ``score``, ``oracle``, ``fit_data``) are
    :func:`search`'s.  A trial's run is a dict of option overrides (:meth:`options`), which ``train`` sets over
    the command's own options."""

    def __init__(self, settings: AutoSettings, out: Path, *, served: int, train: Callable, score: Callable,
                 oracle: Callable, fit_data: Callable | None, log: Callable[[str], None]) -> None:
        self.settings, self.out, self.served = settings, out, served
        self.train_trial, self.score, self.oracle, self.fit_data, self.log = train, score, oracle, fit_data, log
        self.progress = settings.progress
        self.scale: str | None = None  # what a trained trial's score is, for its record
        self.every, self.patience = early_stopping(settings.steps, settings.patience, settings.eval_every)

    def steps_of(self, settings: dict) -> int:
        return self.settings.steps * (2 if settings.get("warm_start") else 1)

    def oracle_trial(self, settings: dict, d: Path) -> dict:
        sel = self.oracle(settings)
        return {"score": _mean(sel), "per_sequence": sel, "steps": 0,
                "scale": "oracle NLL over dense (the label's own exact eviction, untrained)"}

    def train_to(self, run: dict, d: Path, steps: int) -> None:
        """The run of overrides ``run`` in ``d`` trained up to ``steps`` (resumed when it has a checkpoint)."""
        # _auto_trial: a trial of this search (not in its args.json; the search says how to resume);
        # _progress_total: one count over the trial's validation segments
        rc = self.train_trial({**run, "out": str(d), "steps": steps, "resume": (d / "last.pt").exists(),
                         "_auto_trial": True, "_progress_total": self.settings.steps})
        if rc != 0:
            raise _Stopped(rc)

    def _note(self, rec: dict, better: bool, before: bool) -> None:
        """A trial's validation told (with ``--progress``)."""
        if self.progress:
            self.log(f"[kvpop train --auto]   validation at step {rec['step']}/{self.settings.steps}: fit score "
                     f"{rec['fit_score']:.5f}{' (best so far)' if better else ''}"
                     f"{' (recorded before)' if before else ''}")

    def validated(self, run: dict, d: Path) -> dict:
        """The run of overrides ``run`` in ``d``, validated on the fit sequences every ``every`` steps with
        ``patience`` (0: never), its best fit state kept, then scored once on the select sequences."""
        from kvpop.training.trial_records import check_score

        steps = self.settings.steps
        if not self.patience:
            self.train_to(run, d, steps)
            sel = self.score(d, "select")
            return {"score": _mean(sel), "per_sequence": sel, "steps": steps}

        from kvpop.progress import one_bar

        with one_bar():  # one bar over the trial's segments: its elapsed time and ETA are the trial's
            best, vals = early_stopped(d, total=steps, every=self.every, patience=self.patience,
                                       train_to=lambda target: self.train_to(run, d, target),
                                       fit_score=lambda: check_score(_mean(self.score(d, "fit")), d, '"fit_score"'),
                                       note=self._note)
        sel = self.score(d, "select")  # the best fit state, scored once on the select sequences
        return {"score": _mean(sel), "per_sequence": sel, "steps": vals[-1]["step"], "best_step": best["step"],
                "validations": vals}

    def options(self, settings: dict) -> tuple[dict, str | None]:
        """``(overrides, warm start)``: the option overrides of the trial of ``settings`` (:data:`AUTO_OFF`, the
        settings, ``budget`` the training budget: ``train_budget`` or the served one; the validation data of the
        fit part when it allocates, none when it does not) and its ``warm_start``."""
        run = {**AUTO_OFF, **settings}
        run["budget"] = settings.get("train_budget") or self.served  # trained at; scored at `served` all the same
        run.pop("train_budget", None)
        gamma = run.pop("fixed_decay", None)
        if gamma is not None:  # the decay held at gamma (the learned range's options replaced)
            run.update(fixed_decay_options(gamma))
        warm = run.pop("warm_start", None)
        if run.get("allocate", self.settings.allocate) is None:
            run["valid_data"] = run["valid_sequences"] = None
        elif self.fit_data is not None:  # the allocation measured on the fit sequences alone
            run.update(self.fit_data(self.out))
        return run, warm

    def trained(self, settings: dict, d: Path) -> dict:
        """The trial of ``settings`` in ``d``: ``kvpop train`` with them (trained at ``train_budget``, scored at
        the served budget), the joint run after its scorer-only warm start when ``warm_start`` says so."""
        run, warm = self.options(settings)
        before = 0
        if warm == "scorer-only":  # the scorers trained alone first, then the joint run starts from them
            # the model frozen: no next-token loss (it trains the model's weights)
            first = self.validated({**run, "no_train_model": True, "lm_weight": 0.0}, d / "scorer-only")
            before = first["steps"]
            run["init_scorers"] = str(d / "scorer-only" / "scorers.safetensors")
        r = self.validated(run, d)
        if warm == "scorer-only":
            r["scorer_only"] = first
        r["steps"] += before
        if self.scale:
            r["scale"] = self.scale
        return r


RULE = ("kvpop.training.search.prefer: a challenger replaces the incumbent only when its mean per-sequence "
        "improvement on the select sequences exceeds 2 paired standard errors; otherwise (ties included) the "
        "earlier trial stays")
"""What the record's ``rule`` says."""


def summary_lines(record: dict) -> list[str]:
    """What ran, in words, from a search record's ``summary``, ``split`` and ``confirmation``."""
    sm, conf = record.get("summary") or {}, record.get("confirmation") or {}
    sp = record.get("split") or {}
    lines = [f"validation split: {len(sp.get('fit', []))} fit sequences (allocation, early stopping), "
             f"{len(sp.get('select', []))} select sequences (trial scores); {record.get('resolution', '')}"]
    lines.append(f"stages run: {', '.join(sm.get('ran', [])) or 'none'}")
    if sm.get("resolution"):
        lines.append(f"what the select part resolved: {sm['resolution']}")
    part, skipped = sm.get("partly_skipped_for_budget", []), sm.get("skipped_for_budget", [])
    if sm.get("not_applicable"):
        lines.append(f"stages not run, as they could change nothing served under the choice (the fixed mask, or a "
                     f"fixed decay for the decay range): {', '.join(sm['not_applicable'])}")
    if part:
        lines.append(f"stages cut short by the budget: {', '.join(part)}")
    if skipped:
        lines.append(f"stages skipped for the budget: {', '.join(skipped)}")
    if sm.get("raise"):
        lines.append(sm["raise"].lstrip("; "))
    if conf.get("ran"):
        d = conf["decision"]
        lines.append(f"confirmation with a second seed: {conf['trials'][0]['settings']} against "
                     f"{conf['trials'][1]['settings']}, chosen {conf['chosen']}"
                     + (f" (mean difference {d['mean_diff']:.4g}, margin {d['margin']:.4g})"
                        if d.get("margin") is not None else ""))
    elif conf:
        lines.append(f"confirmation not run: {conf.get('why')}")
    return lines


def next_steps(record: Mapping[str, Any], *, out: str, source: str, budget: int, sinks: int, window: int,
               seq_len: int, train_model: bool, task: str | None = None) -> str:
    """The last line ``kvpop train --auto`` prints: what was chosen (and the trials it could not tell it from,
    decided by the record's ``tie_rule``), then how to evaluate the run (``kvpop eval --run OUT``) and how to serve
    it (``vllm serve`` with its ``--hf-overrides``), as what the run is: the fine-tune under the fixed mask
    (``served_as`` ``fixed-finetune``: ``OUT/model`` with the streaming policy), the scorers with the fine-tuned
    model (``OUT/model`` and ``OUT/scorers.safetensors``), or the scorers alone (the original model ``source``)."""
    ch = record.get("chosen") or {}
    o = Path(out)
    data = (f"--train-len {seq_len}" if task else f"--data TRACES.jsonl --seq-len {seq_len}")
    ev = (f"kvpop eval --model {source} --run {o} {data} --budgets {budget} --sinks {sinks} --window {window} "
          f"--out {o / 'eval'}")
    if ch.get("served_as") == "fixed-finetune":
        what = "the fine-tune under the fixed StreamingLLM mask (no scorer)"
        ov = {"architectures": ["KVpopQwen3ForCausalLM"], "kvpop_policy": "streaming",
              "kvpop_config": {"sinks": sinks, "window": window, "budget": budget}}
        model = o / "model"
    else:
        joint = train_model
        what = "KVpop's scorers " + ("with the fine-tuned model" if joint else "with the original model")
        ov = {"architectures": ["KVpopQwen3ForCausalLM"], "kvpop_scorers": str(o / "scorers.safetensors")}
        model = o / "model" if joint else Path(source)
    ties = ch.get("cannot_tell") or []
    tie = ""
    if ties:
        pairs = "; ".join(f"{c['b'] if c['a'] == ch.get('settings') else c['a']} (difference in "
                          f"[{c['interval'][0]:+.4f}, {c['interval'][1]:+.4f}])" for c in ties)
        tie = (f"; could not tell it from {pairs}: chosen by the tie rule (the cheaper to serve, then fewer steps, "
               f"then the earlier trial)")
    return (f"chosen {ch.get('settings')}: {what}{tie}. Evaluate: {ev}. Serve: vllm serve {model} --hf-overrides "
            f"'{json.dumps(ov)}'")


def early_stopped(d: Path, *, total: int, every: int, patience: int, train_to: Callable[[int], None],
                  fit_score: Callable[[], float],
                  note: Callable[[dict, bool, bool], None] | None = None) -> tuple[dict, list[dict]]:
    """A trial's training with early stopping, as the search runs it: ``train_to(step)`` trains the run in ``d``
    up to ``step`` (resuming it), every ``every`` steps and at ``total``, each followed by ``fit_score()`` (its
    validation on the fit sequences; lower is better), appended to ``d/validation.jsonl`` (a validation recorded
    there before an interruption is read, not redone); stopped after ``patience`` validations without a better or
    equal score (0: never); the best state's :data:`SERVED_FILES` kept in ``d/best`` and, at the end, in ``d``
    (a tie goes to the later state; ``last.pt`` stays the last step's).  ``note(record, best so far, recorded
    before)`` is told of every validation.  Returns ``(best validation, every validation)``."""
    from kvpop.training.trial_records import read_validations

    vfile, keep = d / "validation.jsonl", d / "best"
    done = read_validations(vfile) if vfile.exists() else []
    for r in done:  # a validation written before the fit / select split: its one score
        r.setdefault("fit_score", r.get("score"))
    vals: list[dict] = []
    best, bad = None, 0
    for target in [*range(every, total, every), total]:
        rec = next((r for r in done if r["step"] == target), None)  # validated before an interruption
        before = rec is not None
        if rec is None:
            train_to(target)
            rec = {"step": target, "fit_score": fit_score()}
            if best is None or rec["fit_score"] <= best["fit_score"]:  # the state first, then its record
                replace_files(d, keep, SERVED_FILES)
            with open(vfile, "a") as f:
                f.write(json.dumps(rec) + "\n")
        better = best is None or rec["fit_score"] <= best["fit_score"]  # a tie goes to the later state
        if note is not None:
            note(rec, better, before)
        vals.append(rec)
        if better:
            best, bad = rec, 0
        else:
            bad += 1
            if patience and bad >= patience:
                break
    if best["step"] != vals[-1]["step"]:
        replace_files(keep, d, SERVED_FILES)  # the outputs are the best state's (last.pt stays the last step's)
    return best, vals


class _Signalled(BaseException):
    """SIGINT or SIGTERM outside a trial's training steps (which stop after the step in flight themselves)."""

    def __init__(self, signum: int):
        import signal

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
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # a signal ignored by the caller stays ignored
            self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)
                         if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def restore(self) -> None:
        import signal

        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


class _Stopped(Exception):
    """A trial's ``kvpop train`` stopped with a non-zero exit status (interrupted)."""

    def __init__(self, rc: int):
        super().__init__(f"a trial stopped with exit status {rc}")
        self.rc = rc


def _adopt(out: Path, trial: Path, budget: int) -> None:
    """The chosen trial's run files (:data:`RUN_FILES`) into ``out``, replacing those of an earlier choice; a trial
    trained at another budget has its scorer file (and ``head_budgets.json``) written at ``budget``, the one every
    trial was scored at, so that ``OUT`` serves it with no other flag.  The trial's files are checked first
    (:func:`_check_trial_files`): nothing in ``out`` is removed for a trial that cannot replace it."""
    _check_trial_files(trial)
    replace_files(trial, out, RUN_FILES)
    _serve_at(out, budget)


def _check_trial_files(trial: Path) -> None:
    """The chosen trial ``trial`` holds what a run is served from: ``args.json``, ``scorers.safetensors``, the
    fine-tuned ``model/`` when its arguments train the model, and ``head_budgets.json`` when they allocate;
    ValueError naming what is missing (a trial's files deleted after its ``trial.json`` was written), before
    any file of ``OUT`` is touched."""
    need = ["args.json", "scorers.safetensors"]
    try:
        args = json.loads((trial / "args.json").read_text())
    except (OSError, ValueError):
        args = None
    if isinstance(args, dict):
        need += [*(["model"] if not args.get("no_train_model") else []),
                 *(["head_budgets.json"] if args.get("allocate") is not None else [])]
    missing = [n for n in need if not (trial / n).exists()]
    if missing:
        raise ValueError(f"the chosen trial {trial} lacks {', '.join(missing)} (deleted since its trial.json was "
                         f"written), so it cannot be adopted; {trial.parent.parent} was left as it was. Restore "
                         f"the files, or delete the directory {trial} to train that trial again, then rerun with "
                         f"--resume")


def _serve_at(out: Path, budget: int) -> None:
    """Rewrite ``out``'s scorer file for ``budget`` (:func:`kvpop.core.budgets.rescale`: uniform rows take the new
    budget; head-adaptive rows are shared anew by the importance in ``head_budgets.json``, which is rewritten with
    them); nothing when the file is at ``budget`` already."""
    from kvpop.core.budgets import HEAD_BUDGETS_FILE, read_head_budgets, rescale_by, write_head_budgets
    from kvpop.core.checkpoint import read_scorer_config, rewrite_scorer_config

    f = out / "scorers.safetensors"
    if not f.is_file():
        return
    cfg = read_scorer_config(f)
    if cfg.budget == budget:
        return
    plan = read_head_budgets(out / HEAD_BUDGETS_FILE) if cfg.head_budgets is not None else None
    new = rescale_by(cfg, budget, plan)
    rewrite_scorer_config(f, new)
    if plan is not None:
        extra = {k: v for k, v in plan.items()
                 if k not in ("head_budgets", "budget", "importance", "min_k", "granularity")}
        write_head_budgets(out / HEAD_BUDGETS_FILE, new.head_budgets, importance=plan.get("importance"),
                           min_k=plan.get("min_k", 0), granularity=plan.get("granularity", 1), **extra)
