"""The options of a ``kvpop train`` run: which belong to which method, their defaults and checks, and the
method's config built from them (:func:`method_config`).

``args`` is the command's parsed namespace (``kvpop.cli.train``; an option not given is ``None``, then the
method's default).  :func:`check_options` checks every option before any work, each refusal a ``ValueError``
naming the option (the command says it as its error).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["KVPOP_ONLY", "DMS_ONLY", "fill_defaults", "check_combinations", "check_options", "decay_range",
           "method_config", "train_config"]

# options of one method only: given with the other method they would do nothing, and are refused
# (--no-balance is a flag: given when True)
KVPOP_ONLY = ("budget", "scorer", "scorer_hidden", "mlstm_dim", "mask_source", "target_lse", "target_source", "tau",
               "tie_margin", "eps", "label", "label_power", "decay_nats", "gamma_min", "gamma_max", "gamma_init",
               "no_balance", "init_scorers", "priority_source")
DMS_ONLY = ("target_keep", "schedule_steps", "gate_tau", "gate_offset", "aux_weight")
DMS_FIELDS = {"gate_tau": "tau"}  # option -> DMSConfig field where the names differ
MAX_LM_WEIGHT = 1e3
"""The largest ``--lm-weight``: the language-model loss at most a thousand times the distillation's KL."""
MIN_GAMMA = 0.5
"""The smallest decay ``gamma_min`` (an age penalty of ``-log 0.5 = 0.69`` nats per token: recency already)."""


def fill_defaults(args: Any) -> set[str]:
    """The method options the user gave (``None`` in ``args`` is not given); fills in the method's default
    for the others, so that ``args`` (and ``args.json``) hold the values the run uses."""
    from kvpop.baselines.dms import DMSConfig
    from kvpop.core.config import KVpopConfig

    given = {n for n in (*KVPOP_ONLY, *DMS_ONLY)
             if (getattr(args, n, False) is True if n == "no_balance" else getattr(args, n, None) is not None)}
    d, dd = KVpopConfig(), DMSConfig()
    for n in KVPOP_ONLY:
        if getattr(args, n, None) is None and n not in ("decay_nats", "no_balance", "init_scorers"):
            setattr(args, n, getattr(d, n))
    for n in DMS_ONLY:
        if getattr(args, n, None) is None and n != "schedule_steps":
            setattr(args, n, getattr(dd, DMS_FIELDS.get(n, n)))
    return given


def _flags(names) -> str:
    return ", ".join(f"--{n.replace('_', '-')}" for n in names)


def _unused_with_source(args: Any, given: set[str]) -> list[tuple[str, str]]:
    """``(option, why)`` of the given options that a ``--priority-source`` other than ``scorer`` leaves without
    effect: no source trains a scorer (its learning rate and L_score's own settings), only ``random`` builds one (its
    architecture), and only ``oracle-label`` reads the label family.  A value equal to the default is let through
    (it changes nothing either way: a study's recipe shared by every row may spell it out)."""
    from kvpop.core.config import KVpopConfig
    from kvpop.core.priority_sources import LEARNED_FORM
    from kvpop.training.methods import KVpopMethod

    src, d = args.priority_source, KVpopConfig()
    trains = "trains no scorer (no L_score, no scorer learning rate)"
    set_ = [n for n in ("scorer", "scorer_hidden", "mlstm_dim", "lr_scorer", "tau", "tie_margin", "label",
                        "label_power") if (n in given or n == "lr_scorer") and getattr(args, n, None) is not None
            and getattr(args, n) != (KVpopMethod.learning_rates["lr_scorer"] if n == "lr_scorer" else getattr(d, n))]
    out = []
    for n in set_:
        if n in ("scorer", "scorer_hidden", "mlstm_dim") and src not in LEARNED_FORM:
            out.append((n, "builds no scorer"))
        elif n in ("lr_scorer", "tau", "tie_margin"):
            out.append((n, trains))
        elif n in ("label", "label_power") and src != "oracle-label":
            out.append((n, "reads no label (only --priority-source oracle-label does)"))
    return out


def check_combinations(args: Any, given: set[str]) -> None:
    """Options that would do nothing in this run are refused, naming them (only those the user gave)."""
    if args.method == "dms" and given & set(KVPOP_ONLY):
        names = [n for n in KVPOP_ONLY if n in given]
        _fail(f"{_flags(names)}: {'an option' if len(names) == 1 else 'options'} of --method kvpop (its scorers, "
              f"label and budget); --method dms does not use {'it' if len(names) == 1 else 'them'}: leave "
              f"{'it' if len(names) == 1 else 'them'} out")
    if args.method == "kvpop" and given & set(DMS_ONLY):
        names = [n for n in DMS_ONLY if n in given]
        _fail(f"{_flags(names)}: {'an option' if len(names) == 1 else 'options'} of --method dms; the KVpop run "
              f"(--method kvpop, the default) does not use {'it' if len(names) == 1 else 'them'}: give --method dms, "
              f"or leave {'it' if len(names) == 1 else 'them'} out")
    if "label_power" in given and args.label != "power":
        _fail(f"--label-power {args.label_power:g} is the exponent of --label power; with --label {args.label} it does "
              f"nothing: give --label power, or leave --label-power out")
    if "mlstm_dim" in given and args.scorer != "mlstm":
        _fail(f"--mlstm-dim {args.mlstm_dim} is the feature width of --scorer mlstm; --scorer {args.scorer} does not "
              f"use it: give --scorer mlstm, or leave --mlstm-dim out")
    if args.method == "kvpop" and args.priority_source not in (None, "scorer"):
        if getattr(args, "no_train_model", False):
            _fail(f"--priority-source {args.priority_source} trains no scorer, so with --no-train-model nothing would "
                  f"be trained: leave --no-train-model out (the control fine-tunes the model)")
        if "mask_source" in given and args.mask_source != "scorer":
            _fail(f"--priority-source {args.priority_source} is the priority of the mask; --mask-source "
                  f"{args.mask_source} would replace it: leave --mask-source out")
        if getattr(args, "init_scorers", None) is not None:
            _fail(f"--init-scorers: --priority-source {args.priority_source} trains no scorer")
        unused = _unused_with_source(args, given)
        if unused:
            names, why = zip(*unused)
            _fail(f"{_flags(names)}: no effect with --priority-source {args.priority_source}, which "
                  f"{'; '.join(dict.fromkeys(why))}: leave {'it' if len(names) == 1 else 'them'} out")
        if args.priority_source == "window-attention" and (args.head_budgets is not None or args.allocate is not None):
            _fail("--priority-source window-attention is served with uniform budgets only (its sums sit in the "
                  "window's slots of the uniform cache): leave --head-budgets / --allocate out")
        if getattr(args, "auto", False):
            _fail(f"--auto searches the learned scorer's settings; --priority-source {args.priority_source} trains no "
                  f"scorer: leave --auto out (tune the control's --lr-model by runs of their own)")
        if args.allocate is not None:
            _fail(f"--allocate {args.allocate} measures each head's importance under the exact label's own ranking "
                  f"(the oracle mask), which --priority-source {args.priority_source} would replace: give the "
                  f"per-head budgets with --head-budgets (e.g. a scorer run's OUT/head_budgets.json), or leave "
                  f"--allocate out")
    if args.method == "kvpop" and args.mask_source == "streaming" and getattr(args, "no_train_model", False):
        _fail("--mask-source streaming is the fine-tune-only control (the model fine-tuned under the StreamingLLM "
              "mask, served as fixed-finetune): with --no-train-model no model would be trained and the run would "
              "serve as nothing: leave --no-train-model out")
    if "target_lse" in given and args.target_source == "teacher":
        _fail(f"--target-lse {args.target_lse} is the normaliser of the student's target; --target-source teacher "
              f"uses the teacher's exact dense one: leave --target-lse out")


def check_options(args: Any) -> None:
    """Every option checked before any work (:func:`fill_defaults` first): ranges, the data given, the options
    of ``--allocate`` and of the other method refused when they would do nothing (:func:`check_combinations`),
    validation data that is the training data."""
    given = fill_defaults(args)
    args._given = given  # not in args.json (a name with "_")
    for name in ("steps", "batch_size", "grad_accum", "seq_len", "top_k"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("loss_chunk", "threads"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup_steps", "checkpoint_every"):
        if getattr(args, name) < 0:
            _fail(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    lm = getattr(args, "lm_weight", 0.0)
    if not (math.isfinite(lm) and lm >= 0):
        _fail(f"--lm-weight must be a finite number >= 0, got {lm}")
    if lm > MAX_LM_WEIGHT:
        _fail(f"--lm-weight must be at most {MAX_LM_WEIGHT:g}, got {lm:g}: it weighs the language-model loss against "
              f"the distillation's KL (a weight far above 1 drowns the KL, and near 1e30 the gradients overflow)")
    if lm and args.no_train_model:
        _fail(f"--lm-weight {lm:g} trains the model's weights on the data; with --no-train-model nothing would use it")
    for name in ("lr_model", "lr_scorer"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            _fail(f"--{name.replace('_', '-')} must be a finite number > 0, got {v}")
    if not args.data and not args.task:
        _fail("give the training data: --data FILE.jsonl or --task")
    adaptive = args.head_budgets is not None or args.allocate is not None
    if args.method == "dms" and adaptive:
        _fail(f"{'--head-budgets' if args.head_budgets else '--allocate'} is for --method kvpop (DMS's gates decide "
              f"per token, with no fixed budget per head)")
    check_combinations(args, given)
    if args.method == "kvpop":
        from kvpop.core.config import EPS_RANGE, LABEL_POWER_RANGE

        if not (math.isfinite(args.eps) and EPS_RANGE[0] <= args.eps <= EPS_RANGE[1]):
            _fail(f"--eps must lie in [{EPS_RANGE[0]:g}, {EPS_RANGE[1]:g}], got {args.eps:g}: the target is "
                  f"log(eps + m) in float32, with m a mean attention probability (at most 1; default {1e-6:g})")
        lo, hi = LABEL_POWER_RANGE
        if not (math.isfinite(args.label_power) and lo <= args.label_power <= hi):
            _fail(f"--label-power must lie in [{lo:g}, {hi:g}], got {args.label_power:g}: the power mean is "
                  f"computed in float32, which cannot resolve a smaller exponent (below about 1e-10 it returns the "
                  f"max, at 1e-300 log(eps) everywhere); for the max give --label max")
    for name in ("min_k", "valid_data", "valid_sequences"):
        if getattr(args, name) is not None and args.allocate is None:
            _fail(f"--{name.replace('_', '-')} is an option of --allocate (give --allocate ablation, or leave it out)")
    if args.min_k is not None and args.min_k < 0:
        _fail(f"--min-k must be >= 0, got {args.min_k}")
    if args.valid_sequences is not None and args.valid_sequences < 1:
        _fail(f"--valid-sequences must be >= 1, got {args.valid_sequences}")
    if args.allocate is not None and args.valid_data is None and not args.task:
        _fail(f"--allocate {args.allocate} measures each head's importance on validation data, never on the training "
              f"data: give --valid-data FILE.jsonl (records held out from --data)")
    if args.valid_data is not None and args.data is not None and \
            Path(args.valid_data).resolve() == Path(args.data).resolve():
        _fail(f"--valid-data {args.valid_data} is the training file --data: the allocation must be measured on "
              f"held-out records")
    if args.valid_data is not None and args.data is not None and Path(args.valid_data).is_file() and \
            Path(args.data).is_file():
        from kvpop.training.data import data_fingerprint

        try:
            same = data_fingerprint(args.valid_data) == data_fingerprint(args.data)
        except OSError:
            same = False  # unreadable: said when the file is read
        if same:
            _fail(f"--valid-data {args.valid_data} has the same content as the training file --data {args.data} (a "
                  f"copy): the allocation must be measured on held-out records")
    if getattr(args, "init_scorers", None) is not None and not Path(args.init_scorers).is_file():
        _fail(f"--init-scorers {args.init_scorers}: no such file (give a scorer file, e.g. a scorer-only run's "
              f"OUT/scorers.safetensors)")
    if args.method == "kvpop":
        check_decay(args)
    if args.method == "kvpop" and args.seq_len <= args.budget:
        _fail(f"--seq-len ({args.seq_len}) must be larger than --budget ({args.budget}): a sequence of at most "
              f"budget tokens evicts nothing, so the scorers get no training signal")


def check_decay(args: Any) -> None:
    """The decay range the run trains with (:func:`decay_range`), each refusal naming the option that set it:
    ``--decay-nats`` a positive finite number; ``0 <`` :data:`MIN_GAMMA` ``<= gamma_min < gamma_max < 1`` with
    ``gamma_max`` below 1 in float32 and ``gamma_min`` below ``gamma_max`` in float32 (the layer computes the decay
    in float32: a range that rounds to 1.0 switches the decay off without a word)."""
    import numpy as np

    tied = args.decay_nats is not None
    if tied and not (math.isfinite(args.decay_nats) and args.decay_nats > 0):
        _fail(f"--decay-nats must be a positive finite number (the age penalty over --seq-len, in nats), got "
              f"{args.decay_nats:g}")
    for name in ("gamma_min", "gamma_max", "gamma_init"):
        v = getattr(args, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v < 1):
            _fail(f"--{name.replace('_', '-')} must lie strictly between 0 and 1, got {v:g}")
    try:
        rng = decay_range(args)
    except ValueError as e:  # the range's own refusal names its parameters: said as the options
        if not str(e).startswith("span_nats"):
            raise
        _fail(f"--decay-nats {args.decay_nats:g} over --seq-len {args.seq_len} gives gamma_min "
              f"{math.exp(-args.decay_nats / args.seq_len):.10g}, which must lie in (0, --gamma-max "
              f"{args.gamma_max:g}): "
              f"give a smaller --decay-nats")
    lo = f"--decay-nats {args.decay_nats:g} (gamma_min = exp(-N / --seq-len))" if tied else \
        f"--gamma-min {args.gamma_min:.10g}"
    if not rng["gamma_min"] < rng["gamma_max"]:
        _fail(f"{lo}, --gamma-max {rng['gamma_max']:.10g}: need gamma_min < gamma_max (the range the learned decay "
              f"moves in)")
    if not rng["gamma_min"] < rng["gamma_init"] < rng["gamma_max"]:
        _fail(f"{lo}, --gamma-max {rng['gamma_max']:.10g}: need gamma_min < --gamma-init < --gamma-max, and "
              f"gamma_init is {rng['gamma_init']:.10g} (default {0.9999:g}): give a --gamma-init strictly inside")
    if rng["gamma_min"] < MIN_GAMMA:
        _fail(f"{lo} gives gamma_min {rng['gamma_min']:.3g}, below {MIN_GAMMA:g}: an age penalty above "
              f"{-math.log(MIN_GAMMA):.2f} nats per token already orders every token by age alone, and far beyond it "
              f"the priorities overflow float32 (a NaN loss); give a gamma_min of at least {MIN_GAMMA:g}")
    f32 = {k: float(np.float32(v)) for k, v in rng.items()}
    if f32["gamma_max"] >= 1.0:
        _fail(f"--gamma-max {rng['gamma_max']:.10g} is 1.0 in float32 (the decay's precision), so the decay would be "
              f"off (no age penalty): give at most {float(np.nextafter(np.float32(1), np.float32(0))):.10g}")
    if not f32["gamma_min"] < f32["gamma_init"] < f32["gamma_max"]:
        _fail(f"{lo}, --gamma-max {rng['gamma_max']:.10g} and gamma_init {rng['gamma_init']:.10g} are not distinct "
              f"in float32 (the decay's precision: {f32['gamma_min']:.10g}, {f32['gamma_max']:.10g}, "
              f"{f32['gamma_init']:.10g}), so the learned decay could not move: widen the range")


def decay_range(args: Any) -> dict[str, float]:
    """``gamma_min/max/init`` of the run: the flags as given, or with ``--decay-nats`` the range tied to
    ``--seq-len`` (an explicit ``--gamma-init`` is kept when it lies inside)."""
    rng = {"gamma_min": args.gamma_min, "gamma_max": args.gamma_max, "gamma_init": args.gamma_init}
    if args.decay_nats is None:
        return rng
    from kvpop.core.config import decay_range_for_context

    given = getattr(args, "_given", set())
    if "gamma_min" in given:
        raise ValueError(f"--decay-nats {args.decay_nats:g} sets gamma_min itself (exp(-N / --seq-len)); "
                         f"leave out --gamma-min {args.gamma_min:g}, or --decay-nats")
    tied = decay_range_for_context(args.seq_len, args.decay_nats, gamma_max=args.gamma_max)
    if "gamma_init" in given:
        if not tied["gamma_min"] < args.gamma_init < tied["gamma_max"]:
            raise ValueError(f"--gamma-init {args.gamma_init:g} lies outside the decay range that --decay-nats "
                             f"{args.decay_nats:g} gives over --seq-len {args.seq_len}: ({tied['gamma_min']:.8g}, "
                             f"{tied['gamma_max']:.8g}); give a --gamma-init inside it, or leave it out (then "
                             f"{tied['gamma_init']:.8g})")
        tied["gamma_init"] = args.gamma_init
    return tied


def method_config(args: Any) -> Any:
    """The method's config of the run: a :class:`kvpop.KVpopConfig` (``--method kvpop``) or a
    :class:`kvpop.baselines.dms.DMSConfig` (``--method dms``: the budget and the scorer options do not apply)."""
    from kvpop.baselines.dms import DMSConfig
    from kvpop.core.config import KVpopConfig

    if args.method == "kvpop":
        return KVpopConfig(budget=args.budget, sinks=args.sinks, window=args.window, scorer=args.scorer,
                           scorer_hidden=args.scorer_hidden, mlstm_dim=args.mlstm_dim, mask_source=args.mask_source,
                           target_lse=args.target_lse, tau=args.tau, balance=not args.no_balance,
                           target_source=args.target_source, tie_margin=args.tie_margin, eps=args.eps,
                           label=args.label, label_power=args.label_power, priority_source=args.priority_source,
                           **decay_range(args))
    return DMSConfig(sinks=args.sinks, window=args.window, tau=args.gate_tau, gate_offset=args.gate_offset,
                     target_keep=args.target_keep,
                     schedule_steps=args.steps if args.schedule_steps is None else args.schedule_steps,
                     aux_weight=args.aux_weight)


def train_config(args: Any, out: Path, *, data_fingerprint: str | None, model_fingerprint: dict | None) -> Any:
    """The loop's :class:`kvpop.training.train.TrainConfig` of the run (checkpoints in ``out``); the
    fingerprints of the data file and the model directory go into the checkpoint
    (:func:`kvpop.training.rundir.data_print`, :func:`~kvpop.training.rundir.model_print`)."""
    from kvpop.training.train import TrainConfig

    return TrainConfig(steps=args.steps, lr_model=args.lr_model, lr_scorer=args.lr_scorer,
                       weight_decay=args.weight_decay, grad_accum=args.grad_accum,
                       max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
                       warmup_steps=args.warmup_steps, top_k=args.top_k, score_weight=args.score_weight,
                       lm_weight=getattr(args, "lm_weight", 0.0),
                       train_model=not args.no_train_model, activation_checkpointing=args.activation_checkpointing,
                       checkpoint_dir=str(out), checkpoint_every=args.checkpoint_every,
                       progress=not args.no_progress, progress_total=getattr(args, "_progress_total", None),
                       seed=args.seed, dist=args.dist, bf16=args.bf16,
                       loss_chunk=args.loss_chunk, data_fingerprint=data_fingerprint,
                       model_fingerprint=model_fingerprint)


def _fail(msg: str) -> NoReturn:
    raise ValueError(msg)
