"""``kvpop train``: retrofit KVpop onto a Qwen3 model (scorers + distillation fine-tune).

Examples (CPU, the shipped tiny model)::

    kvpop train --task --seq-len 256 --budget 96 --window 32 --steps 20 --out runs/kv
    kvpop train --data data.jsonl --seq-len 128 --budget 48 --window 16 --steps 20 --out runs/kv
    kvpop train --task --seq-len 256 --budget 96 --window 32 --steps 40 --out runs/kv --resume
    kvpop train --method dms --task --seq-len 1024 --window 32 --target-keep 0.125 --steps 100 --out runs/dms

Several GPUs::

    torchrun --nproc_per_node 8 -m kvpop train --model /models/Qwen3-8B --data data.jsonl \\
        --seq-len 8192 --budget 2048 --bf16 --dist fsdp --activation-checkpointing --out runs/q8

The model: ``--model DIR`` (``from_pretrained``, local files only), ``--tiny`` (a built-in tiny Qwen3
with random weights, seeded by ``--seed``) or, by default, the shipped ``kvpop/data/tiny_qwen3``.
The teacher is a frozen copy of that model as loaded.  The data: ``--data FILE.jsonl``
(``kvpop.training.data``: ``{"input_ids": [...]}`` or ``{"text": "..."}`` per line, texts tokenised with the
model directory's tokenizer) cut into sequences of ``--seq-len`` tokens, or ``--task`` (the synthetic
trace task of ``kvpop.demo.task``, generated on the fly at ``--seq-len``).

What ``--out DIR`` receives: ``last.pt`` (the full training state, written atomically every
``--checkpoint-every`` steps and at the end), ``scorers.safetensors`` (``kvpop.save_scorers``; load with
``kvpop.load_scorers``), ``model/`` (the fine-tuned model, ``save_pretrained`` without the scorer
tensors; not with ``--no-train-model``), with ``--method dms`` ``gates.safetensors`` instead of the scorers
(``kvpop.baselines.dms.load_dms``), ``args.json`` (the arguments) and ``history.jsonl`` (one line
of losses per step, appended as each step finishes).  The scorers (or gates) and ``model/`` are stamped with
the step of their weights (the file's ``step`` metadata, ``model/kvpop_step.json``;
:func:`kvpop.training.runstate.output_step`); a ``--resume`` with no step left writes both anew from
``last.pt`` (a crash between the writes leaves outputs of two steps).  Head-adaptive budgets (docs/DESIGN.md section 7):
``--head-budgets FILE.json`` trains with the given per-layer, per-KV-head budgets, ``--allocate ablation``
chooses them before training from each head's importance on validation sequences (``--valid-data``,
with ``--task`` the task's own), and both write ``head_budgets.json`` (the rows, and the importance that
``kvpop eval`` shares another budget by).  ``--resume`` continues from ``last.pt`` exactly (a
resumed run repeats the steps of an uninterrupted one, and its ``history.jsonl`` is the uninterrupted
run's); every argument but ``--steps``, ``--checkpoint-every``, ``--no-progress``, ``--device`` and the
spelling of ``--out`` must be the same as in the first run (checked against ``args.json``; file paths
are compared resolved).  SIGINT or SIGTERM (Ctrl-C, a scheduler's stop) ends the run after the step in
flight with a checkpoint of it (a second signal aborts at once); the exit status is then 128 + the
signal number.

Under ``torchrun`` (``WORLD_SIZE > 1``) each process joins the process group (NCCL on CUDA, gloo on the
CPU), uses ``cuda:LOCAL_RANK`` when CUDA is available, and takes every ``WORLD_SIZE``-th batch; the model
is replicated (``--dist ddp``) or sharded with FSDP2 (``--dist fsdp``, see ``kvpop.training.train``).  With
``--batch-size B`` on ``W`` processes a step sees ``W * B * --grad-accum`` sequences.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from kvpop.demo.task import SHIPPED_MODEL

# options of one method only (None: not given, then the method's default): given with the other method they
# would do nothing, and are refused (--no-balance is a flag: given when True)
_KVPOP_ONLY = ("budget", "scorer", "scorer_hidden", "mlstm_dim", "mask_source", "target_lse", "target_source", "tau",
               "tie_margin", "eps", "label", "label_power", "decay_nats", "gamma_min", "gamma_max", "gamma_init",
               "no_balance")
_DMS_ONLY = ("target_keep", "schedule_steps", "gate_tau", "gate_offset", "aux_weight")
_DMS_FIELDS = {"gate_tau": "tau"}  # option -> DMSConfig field where the names differ

# arguments that may change between a run and its --resume (--out is where the run is; paths are
# compared resolved)
_RESUMABLE = {"steps", "checkpoint_every", "no_progress", "resume", "out", "device"}
_PATHS = ("data", "model", "head_budgets", "valid_data")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvpop.baselines.dms import DMSConfig
    from kvpop.core.config import LABELS, MASK_SOURCES, SCORERS, TARGET_LSES, TARGET_SOURCES, KVpopConfig
    from kvpop.training.train import DIST_MODES, LEARNING_RATES

    d = KVpopConfig()
    dd = DMSConfig()
    p.add_argument("--method", choices=("kvpop", "dms"), default="kvpop",
                   help="kvpop: learned scorers with L_score (default); dms: the DMS baseline, per-token eviction "
                        "gates trained by the KL and a compression loss (kvpop.baselines.dms; --budget is not used)")
    src = p.add_argument_group("model and data")
    m = src.add_mutually_exclusive_group()
    m.add_argument("--model", type=str, default=None,
                   help="local model directory (from_pretrained, local files only); default: the shipped "
                        "tiny model kvpop/data/tiny_qwen3")
    m.add_argument("--tiny", action="store_true",
                   help="a built-in tiny Qwen3 (2 layers, vocab 640) with random weights")
    dat = src.add_mutually_exclusive_group()
    dat.add_argument("--data", type=str, default=None,
                     help='JSONL file, one {"input_ids": [...]} or {"text": "..."} per line')
    dat.add_argument("--task", action="store_true",
                     help="train on the synthetic trace task (kvpop.demo.task), generated on the fly")
    src.add_argument("--seq-len", type=int, default=4096,
                     help="tokens per sequence: records are cut into pieces of this length (default 4096)")
    src.add_argument("--pack", action="store_true",
                     help="concatenate the records (separated by the tokenizer's EOS when known) before cutting")

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, default=100, help="optimiser steps (default 100)")
    opt.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch and process (default 1)")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step (default 1)")
    lr = LEARNING_RATES
    opt.add_argument("--lr-model", type=float, default=None,
                     help=f"AdamW learning rate of the model (default: the method's, {lr['kvpop']['lr_model']:g} for "
                          f"kvpop and {lr['dms']['lr_model']:g} for dms)")
    opt.add_argument("--lr-scorer", type=float, default=None,
                     help=f"AdamW learning rate of the scorers and decays, or with --method dms of the DMS gates "
                          f"(default: the method's, {lr['kvpop']['lr_scorer']:g} for kvpop and "
                          f"{lr['dms']['lr_scorer']:g} for dms: the gates start at bias -gate-offset and must move "
                          f"by about that much within the schedule)")
    opt.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps (default 0)")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    opt.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping, <= 0 for none (default 1)")
    opt.add_argument("--top-k", type=int, default=256, help="teacher logits kept for the KL (default 256)")
    opt.add_argument("--loss-chunk", type=int, default=None,
                     help="positions per chunk of the fused LM head + KL (default: ~128 MiB of float32 logits)")
    opt.add_argument("--score-weight", type=float, default=1.0, help="weight of L_score (default 1)")
    opt.add_argument("--no-train-model", action="store_true", help="train the scorers only (the model is frozen)")
    opt.add_argument("--seed", type=int, default=0, help="seed of the scorers, --tiny weights and data order")

    kv = p.add_argument_group("KVpop (kvpop.KVpopConfig)")
    kv.add_argument("--budget", type=int, default=None, help=f"entries per KV head B (default {d.budget})")
    kv.add_argument("--sinks", type=int, default=d.sinks, help=f"sink tokens (default {d.sinks})")
    kv.add_argument("--window", type=int, default=d.window, help=f"recent window (default {d.window})")
    kv.add_argument("--scorer", choices=SCORERS, default=None, help=f"scorer (default {d.scorer})")
    kv.add_argument("--scorer-hidden", type=int, default=None, help=f"scorer MLP width (default {d.scorer_hidden})")
    kv.add_argument("--mlstm-dim", type=int, default=None,
                    help=f"mLSTM feature width (with --scorer mlstm; default {d.mlstm_dim})")
    kv.add_argument("--mask-source", choices=MASK_SOURCES, default=None,
                    help=f"priorities of the training mask (default {d.mask_source})")
    kv.add_argument("--target-lse", choices=TARGET_LSES, default=None,
                    help=f"normaliser of the target (default {d.target_lse})")
    kv.add_argument("--target-source", choices=TARGET_SOURCES, default=None,
                    help="whose attention makes the label: student, the model being trained (its own forward, "
                         "normalised by --target-lse: the cheap sparse normaliser by default), or teacher, the frozen "
                         "original (exact: its own dense forward with the full cache, layer by layer) (default "
                         f"{d.target_source}; kvpop demo's joint retrofits use student too: it beat teacher on the "
                         "validation sequences of both demo tasks, kvpop/data/demo_results/README.md)")
    kv.add_argument("--tau", type=float, default=None, help=f"temperature of L_score (default {d.tau})")
    kv.add_argument("--tie-margin", type=float, default=None,
                    help="near-tie discount of L_score, 1 - exp(-|margin| / tie_margin); 0 switches it off "
                         f"(default {d.tie_margin})")
    kv.add_argument("--eps", type=float, default=None,
                    help=f"epsilon of the target log(eps + m), in [1e-30, 1] (default {d.eps})")
    kv.add_argument("--label", choices=LABELS, default=None,
                    help="how the target pools the attention a token gets after leaving the window: mean (the "
                         "method's), max (its strongest later reader), power (power mean, --label-power) "
                         f"(default {d.label})")
    kv.add_argument("--label-power", type=float, default=None,
                    help=f"exponent a of --label power, in [0.01, 10000]: (mean_u p^a)^(1/a) (default {d.label_power}; "
                         "refused with another --label)")
    kv.add_argument("--decay-nats", type=float, default=None,
                    help="tie the decay range to the context: gamma_min = exp(-N / --seq-len), an age penalty of "
                         "N nats over a training sequence at the range's lower end (kvpop.decay_range_for_context; "
                         "replaces --gamma-min, and --gamma-init when 0.9999 falls outside)")
    kv.add_argument("--gamma-min", type=float, default=None,
                    help=f"lower end of the learned per-head decay (default {d.gamma_min})")
    kv.add_argument("--gamma-max", type=float, default=None,
                    help=f"upper end of the learned per-head decay (default {d.gamma_max})")
    kv.add_argument("--gamma-init", type=float, default=None,
                    help=f"initial decay, strictly inside the range (default {d.gamma_init})")
    hb = kv.add_mutually_exclusive_group()
    hb.add_argument("--head-budgets", type=str, default=None, metavar="FILE.json",
                    help="head-adaptive budgets (docs/DESIGN.md section 7): a JSON list (one per layer) of lists (one "
                         "budget per KV head), or an object with a \"head_budgets\" key (what --allocate writes), with "
                         "the uniform total layers x heads x --budget; copied into OUT/head_budgets.json")
    hb.add_argument("--allocate", choices=("ablation",), default=None,
                    help="head-adaptive budgets chosen before training: ablation = the validation NLL rise when one "
                         "head alone keeps no long-range slot (kvpop.core.budgets.ablation_importance, the run's label "
                         "of the model as loaded as the mask), shared at the uniform total by "
                         "kvpop.core.budgets.allocate; measured on "
                         "--valid-data (with --task: the task's validation sequences), never the training data; "
                         "budgets and importance go to OUT/head_budgets.json")
    kv.add_argument("--min-k", type=int, default=None,
                    help="with --allocate: the fewest long-range slots a head gets (default 0: a head may keep only "
                         "its sinks and window)")
    kv.add_argument("--valid-data", type=str, default=None, metavar="FILE.jsonl",
                    help="with --allocate: validation records (same format as --data, cut at --seq-len), not the "
                         "training file")
    kv.add_argument("--valid-sequences", type=int, default=None,
                    help=f"with --allocate: validation sequences measured (default {VALID_SEQUENCES}; each head costs "
                         f"one forward over them)")
    kv.add_argument("--no-balance", action="store_true",
                    help="do not balance keep/drop decisions in L_score (then several processes take "
                         "exactly the steps of one)")

    dm = p.add_argument_group(
        "DMS (--method dms, kvpop.baselines.dms.DMSConfig)",
        "DMS trains per-token eviction gates and the model (KL to the frozen original plus a compression loss "
        "whose target keep fraction falls linearly to --target-keep over --schedule-steps). Also used: --sinks, "
        "--window (the eviction delay), --lr-scorer (the gates' learning rate, default "
        f"{LEARNING_RATES['dms']['lr_scorer']:g}), --lr-model, --steps, --no-train-model; --budget and the scorer "
        "options are not. At the end the run warns when its keep fraction (mean of the last 10 steps) missed the "
        f"target by more than {KEEP_MARGIN:.0%} of it: then train longer or raise --lr-scorer. Evaluate it with "
        "kvpop eval --run OUT.")
    dm.add_argument("--target-keep", type=float, default=None,
                    help=f"keep fraction the compression loss drives the gates to (default {dd.target_keep}: "
                         f"compression ratio {1 / dd.target_keep:g})")
    dm.add_argument("--schedule-steps", type=int, default=None,
                    help="steps over which the target compression ratio rises linearly from 1 (default: --steps)")
    dm.add_argument("--gate-tau", type=float, default=None,
                    help=f"temperature of the Gumbel-sigmoid relaxation (default {dd.tau})")
    dm.add_argument("--gate-offset", type=float, default=None,
                    help=f"initial gate bias is minus this (default {dd.gate_offset}: every token kept at the start)")
    dm.add_argument("--aux-weight", type=float, default=None,
                    help=f"weight of the compression loss (default {dd.aux_weight})")

    run = p.add_argument_group("run")
    run.add_argument("--out", type=str, required=True, help="output directory (checkpoints, scorers, model)")
    run.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    run.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50; "
                                                                      "0: only at the end)")
    run.add_argument("--bf16", action="store_true", help="bf16 autocast with float32 weights (CUDA only)")
    run.add_argument("--activation-checkpointing", action="store_true", help="recompute activations in backward")
    run.add_argument("--dist", choices=DIST_MODES, default="ddp",
                     help="with several processes (torchrun): ddp or fsdp (FSDP2) (default ddp)")
    run.add_argument("--device", type=str, default=None,
                     help="device (default: cuda[:LOCAL_RANK] when available, else cpu)")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress report (a tqdm bar when stderr is a terminal, else a line every few steps)")
    from .auto import add_arguments as add_auto

    add_auto(p)


VALID_SEQUENCES = 8
"""``--allocate``'s default number of validation sequences."""

KEEP_MARGIN = 0.25
"""A DMS run warns when the mean keep fraction of its last :data:`KEEP_STEPS` steps is further than this
fraction of the target from the target (e.g. outside 0.094-0.156 for --target-keep 0.125)."""
KEEP_STEPS = 10


def keep_miss(history: list[dict]) -> tuple[float, float] | None:
    """``(keep, target)``: the mean keep fraction and mean target over the last :data:`KEEP_STEPS` steps of a
    DMS run's history when they differ by more than :data:`KEEP_MARGIN` of the target, else ``None``."""
    last = [h for h in history[-KEEP_STEPS:] if "keep_frac" in h and "target_keep" in h]
    if not last:
        return None
    keep = sum(h["keep_frac"] for h in last) / len(last)
    target = sum(h["target_keep"] for h in last) / len(last)
    return (keep, target) if abs(keep - target) > KEEP_MARGIN * target else None


class _UserError(Exception):
    pass


def _fail(msg: str) -> None:
    raise _UserError(msg)


def _fill_defaults(args: argparse.Namespace) -> set[str]:
    """The method options the user gave (``None`` in ``args`` is not given); fills in the method's default
    for the others, so that ``args`` (and ``args.json``) hold the values the run uses."""
    from kvpop.baselines.dms import DMSConfig
    from kvpop.core.config import KVpopConfig

    given = {n for n in (*_KVPOP_ONLY, *_DMS_ONLY)
             if (getattr(args, n, False) is True if n == "no_balance" else getattr(args, n, None) is not None)}
    d, dd = KVpopConfig(), DMSConfig()
    for n in _KVPOP_ONLY:
        if getattr(args, n, None) is None and n not in ("decay_nats", "no_balance"):
            setattr(args, n, getattr(d, n))
    for n in _DMS_ONLY:
        if getattr(args, n, None) is None and n != "schedule_steps":
            setattr(args, n, getattr(dd, _DMS_FIELDS.get(n, n)))
    return given


def _flags(names) -> str:
    return ", ".join(f"--{n.replace('_', '-')}" for n in names)


def _check_combinations(args: argparse.Namespace, given: set[str]) -> None:
    """Options that would do nothing in this run are refused, naming them (only those the user gave)."""
    if args.method == "dms" and given & set(_KVPOP_ONLY):
        names = [n for n in _KVPOP_ONLY if n in given]
        _fail(f"{_flags(names)}: {'an option' if len(names) == 1 else 'options'} of --method kvpop (its scorers, "
              f"label and budget); --method dms does not use {'it' if len(names) == 1 else 'them'}: leave "
              f"{'it' if len(names) == 1 else 'them'} out")
    if args.method == "kvpop" and given & set(_DMS_ONLY):
        names = [n for n in _DMS_ONLY if n in given]
        _fail(f"{_flags(names)}: {'an option' if len(names) == 1 else 'options'} of --method dms; the KVpop run "
              f"(--method kvpop, the default) does not use {'it' if len(names) == 1 else 'them'}: give --method dms, "
              f"or leave {'it' if len(names) == 1 else 'them'} out")
    if "label_power" in given and args.label != "power":
        _fail(f"--label-power {args.label_power:g} is the exponent of --label power; with --label {args.label} it does "
              f"nothing: give --label power, or leave --label-power out")
    if "mlstm_dim" in given and args.scorer != "mlstm":
        _fail(f"--mlstm-dim {args.mlstm_dim} is the feature width of --scorer mlstm; --scorer {args.scorer} does not "
              f"use it: give --scorer mlstm, or leave --mlstm-dim out")
    if "target_lse" in given and args.target_source == "teacher":
        _fail(f"--target-lse {args.target_lse} is the normaliser of the student's target; --target-source teacher "
              f"uses the teacher's exact dense one: leave --target-lse out")


def _check_args(args: argparse.Namespace) -> None:
    given = _fill_defaults(args)
    args._given = given  # not in args.json (a name with "_")
    for name in ("steps", "batch_size", "grad_accum", "seq_len", "top_k"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.loss_chunk is not None and args.loss_chunk < 1:
        _fail(f"--loss-chunk must be >= 1, got {args.loss_chunk}")
    for name in ("warmup_steps", "checkpoint_every"):
        if getattr(args, name) < 0:
            _fail(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
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
    _check_combinations(args, given)
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
    if args.method == "kvpop" and args.seq_len <= args.budget:
        _fail(f"--seq-len ({args.seq_len}) must be larger than --budget ({args.budget}): a sequence of at most "
              f"budget tokens evicts nothing, so the scorers get no training signal")


def _decay_range(args: argparse.Namespace) -> dict[str, float]:
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


def _setup_dist(args: argparse.Namespace):
    """Join the torchrun process group when WORLD_SIZE > 1; returns ``(rank, world, device, started)``."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device:
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            _fail(f"--device {args.device!r}: {e}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                _fail(f"--device {args.device}: CUDA is not available on this machine")
            if device.index is None:  # plain "cuda": this process's GPU
                device = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    elif torch.cuda.is_available():
        device = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    started = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        started = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, device, started


def _load_model(args: argparse.Namespace, device):
    import torch

    if args.tiny:
        from kvpop.demo.pretrain import build_model

        model = build_model(seed=args.seed)
        source = None
    else:
        from kvpop.models import load_model_dir

        source = Path(args.model) if args.model else SHIPPED_MODEL
        try:  # config.json checked first: an unsupported family is refused before any weight is allocated
            model = load_model_dir(source, dtype=torch.float32)
        except (OSError, ValueError) as e:
            _fail(f"--model {source}: {e}")
    if getattr(model.config, "attention_dropout", 0.0):
        model.config.attention_dropout = 0.0
    return model.to(device), source


def _data(args: argparse.Namespace, model, source: Path | None):
    from kvpop.training import data as data_io

    if args.task:
        from kvpop.demo import task as T

        if model.config.vocab_size < T.VOCAB_SIZE:
            _fail(f"--task needs a vocabulary of >= {T.VOCAB_SIZE} tokens; the model has {model.config.vocab_size}")
        return T.TaskBatches(args.seq_len, args.batch_size)
    seqs = _sequences(args, args.data, model, source)
    if args.allocate is not None and args.valid_data is not None:  # its sequences are checked against these
        args._train_digests = _digests(seqs)
    return data_io.make_batches(seqs, args.batch_size, seed=args.seed, source=args.data)


def _digests(seqs) -> set[bytes]:
    """A 16-byte BLAKE2 digest of each token sequence (what :func:`_valid_batches` compares, in little memory)."""
    import hashlib

    return {hashlib.blake2b(s.numpy().tobytes(), digest_size=16).digest() for s in seqs}


def _sequences(args: argparse.Namespace, path: str, model, source: Path | None) -> list:
    """The records of the JSONL file ``path`` cut into ``--seq-len`` sequences (``--pack`` as given)."""
    from kvpop.training import data as data_io

    tok_holder: dict = {}

    def tokenizer():
        if source is None:
            _fail(f"{path} has text records but --tiny has no tokenizer; give token ids or --model DIR")
        tok_holder["tok"] = data_io.load_tokenizer(source)
        return tok_holder["tok"]

    records = data_io.read_jsonl(path, vocab_size=model.config.vocab_size, tokenizer=tokenizer,
                                 tokenizer_source=str(source))
    sep = None
    if args.pack:
        tok = tok_holder.get("tok")
        sep = getattr(tok, "eos_token_id", None) if tok is not None else getattr(model.config, "eos_token_id", None)
        if isinstance(sep, list):
            sep = sep[0] if sep else None
    return data_io.chunk(records, args.seq_len, pack=args.pack, sep_id=sep, source=path)


def _valid_batches(args: argparse.Namespace, model, source: Path | None) -> tuple[list, str]:
    """``--allocate``'s validation token ids (batches of ``--batch-size``) and what they are, in words:
    ``--valid-data`` cut at ``--seq-len``, or with ``--task`` (and no file) the task's validation seeds."""
    import torch

    n = args.valid_sequences or VALID_SEQUENCES
    if args.valid_data is not None:
        try:
            seqs = _sequences(args, args.valid_data, model, source)[:n]
        except ValueError as e:
            _fail(f"--valid-data: {e}")
        what = f"{len(seqs)} sequence(s) of {args.seq_len} tokens from {args.valid_data}"
        train = getattr(args, "_train_digests", None)
        both = sum(d in train for d in _digests(seqs)) if train and seqs else 0
        if seqs and both == len(seqs):
            _fail(f"--valid-data {args.valid_data}: all {len(seqs)} of its sequences measured are training sequences "
                  f"of --data {args.data} too (its records are training records): the allocation must be measured on "
                  f"held-out records")
        if both:
            print(f"kvpop train: warning: --valid-data {args.valid_data}: {both} of its {len(seqs)} sequences measured "
                  f"are training sequences of --data {args.data} too", file=sys.stderr)
    else:
        from kvpop.demo import task as T

        seqs = list(T.make_batch([T.valid_seed(i) for i in range(n)], args.seq_len)["input_ids"])
        what = f"{n} validation sequence(s) of the task (valid_seed(0..{n - 1})), {args.seq_len} tokens"
    if not seqs:
        _fail(f"--valid-data {args.valid_data} gives no sequence of --seq-len {args.seq_len} tokens")
    b = args.batch_size
    return [torch.stack(seqs[i:i + b]) for i in range(0, len(seqs), b)], what


def _head_budgets(args: argparse.Namespace, kv_cfg, model, source: Path | None, out: Path):
    """The run's config with head-adaptive budgets (``--head-budgets`` / ``--allocate``) and the document to
    write as ``OUT/head_budgets.json`` (``None``: nothing new to write)."""
    import time

    from kvpop.core.budgets import HEAD_BUDGETS_FILE, ablation_budgets, read_head_budgets
    from kvpop.core.patching import check_head_budgets

    if args.head_budgets is not None:
        flag, path = f"--head-budgets {args.head_budgets}", args.head_budgets
    else:
        flag, path = f"--allocate {args.allocate} --resume", out / HEAD_BUDGETS_FILE
    if args.head_budgets is not None or args.resume:
        if args.head_budgets is None and not path.is_file():
            _fail(f"{flag}: {path} is missing (it holds the budgets the first run chose and trained with); restore it")
        try:
            hb = read_head_budgets(path)
        except ValueError as e:
            _fail(f"{flag}: {e}")
        if hb["budget"] != args.budget:
            rows = hb["head_budgets"]
            _fail(f"{flag}: the budgets hold a mean of {hb['budget']} entries per head ({sum(map(sum, rows))} "
                  f"over {len(hb['head_budgets'])} layers x {len(hb['head_budgets'][0])} KV heads), --budget is "
                  f"{args.budget}: give --budget {hb['budget']}")
        try:
            cfg = kv_cfg.replace(head_budgets=hb["head_budgets"])
            check_head_budgets(cfg, model)
        except (TypeError, ValueError) as e:
            _fail(f"{flag}: {e}")
        doc = None
        if args.head_budgets is not None and args.resume and (out / HEAD_BUDGETS_FILE).is_file():
            _same_head_budgets(flag, hb, out / HEAD_BUDGETS_FILE)  # before the run's copy is rewritten
        if args.head_budgets is not None:
            doc = {k: v for k, v in hb.items() if k not in ("head_budgets", "budget")}
            doc.setdefault("rule", "given")
            doc["source"] = str(Path(path).resolve())
        return cfg, (hb["head_budgets"], doc)
    batches, what = _valid_batches(args, model, source)
    t0 = time.time()
    try:  # the model as loaded is the frozen original: its own exact label is the mask
        rows, imp = ablation_budgets(model, batches, config=kv_cfg, min_k=args.min_k or 0)
    except (TypeError, ValueError) as e:
        _fail(f"--allocate {args.allocate}: {e}")
    doc = {"importance": imp.tolist(), "min_k": args.min_k or 0, "granularity": 1, "rule": "ablation",
           "measured_on": what,
           "measure": "kvpop.core.budgets.ablation_importance: the rise of the mean next-token NLL (nats) when one "
                      "head alone keeps no long-range slot; mask: the run's label (--label, --eps, --gamma-init) "
                      "computed exactly from the model's dense attention (mask_source='teacher', "
                      "target_source='teacher'); "
                      "the model as loaded, before training",
           "wall_s": round(time.time() - t0, 1)}
    return kv_cfg.replace(head_budgets=rows), (rows, doc)


def _same_head_budgets(flag: str, given: dict, copy: Path) -> None:
    """A ``--head-budgets FILE --resume`` whose FILE differs from the first run's copy in ``OUT`` is refused,
    naming the field: the checkpoint was trained with the copy's rows, and ``kvpop eval`` shares other budgets
    by its importance."""
    from kvpop.core.budgets import read_head_budgets

    try:
        saved = read_head_budgets(copy)
    except ValueError as e:
        _fail(f"{flag} --resume: the first run's copy is unreadable: {e}; restore it from {given.get('source', flag)}")
    for key in ("head_budgets", "importance", "min_k", "granularity"):
        then, now = saved.get(key), given.get(key)
        if key == "head_budgets":
            then, now = [list(r) for r in then], [list(r) for r in now]
        if then != now:
            _fail(f"{flag} --resume: its \"{key}\" differs from the first run's copy {copy}, which the checkpoint "
                  f"was trained with (was {json.dumps(then)[:120]}, now {json.dumps(now)[:120]}); restore the "
                  f"file, or start in another directory")


def _fingerprint(args: argparse.Namespace) -> str | None:
    """The --data file's fingerprint, kept in the checkpoint: a resume after the file was edited is refused."""
    if not args.data:
        return None
    from kvpop.training.data import data_fingerprint

    try:
        return data_fingerprint(args.data)
    except OSError as e:
        _fail(f"--data {args.data}: cannot read it ({e.strerror or e})")


def _model_fingerprint(source: Path | None) -> dict[str, str] | None:
    """The model directory's fingerprint (its config and weight files), kept in the checkpoint: a resume
    after a weight file was replaced in place is refused, naming it (``--tiny``: none)."""
    if source is None:
        return None
    from kvpop.training.data import model_fingerprint

    try:
        return model_fingerprint(source)
    except OSError as e:
        _fail(f"--model {source}: cannot read {e.filename or 'it'} ({e.strerror or e})")


def _check_resume_args(args: argparse.Namespace, out: Path) -> None:
    saved_path = out / "args.json"
    if not (out / "last.pt").exists():
        _fail(f"--resume: {out / 'last.pt'} does not exist (nothing to resume; drop --resume to start)")
    if not saved_path.exists():
        return
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        _fail(f"--resume: cannot read {saved_path} ({type(e).__name__}: {str(e)[:200]}); it records the first "
              f"run's arguments: restore it, or delete it to resume without the comparison")
    if not isinstance(saved, dict):
        _fail(f"--resume: {saved_path} holds a JSON {type(saved).__name__}, not the arguments of a run")
    saved = _comparable(saved)
    now = _comparable(_arg_dict(args))
    diff = [k for k in sorted(set(saved) | set(now)) if k not in _RESUMABLE and saved.get(k) != now.get(k)]
    if diff:
        _fail("--resume needs the arguments of the first run; these differ: "
              + ", ".join(f"--{k.replace('_', '-')} (was {saved.get(k)!r}, now {now.get(k)!r})" for k in diff))


def _arg_dict(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}


def _comparable(d: dict) -> dict:
    """The arguments with file paths resolved (``./data.jsonl``, ``data.jsonl`` and its absolute path agree)."""
    return {k: (str(Path(v).resolve()) if k in _PATHS and isinstance(v, str) else v) for k, v in d.items()}


def _mismatch(e, args: argparse.Namespace, source: Path | None, out: Path) -> str:
    """A resume's :class:`~kvpop.training.runstate.RunMismatch` with the option or file it comes from."""
    if e.what == "model":
        return f"--model {source}: {e}"
    if e.what == "config" and "head_budgets" in e.fields:
        from kvpop.core.budgets import HEAD_BUDGETS_FILE

        where = args.head_budgets if args.head_budgets is not None else out / HEAD_BUDGETS_FILE
        return (f"{e} (the per-head budgets are read from {where}: its \"head_budgets\" rows were edited since "
                f"the first run; restore them)")
    return str(e)


def run(args: argparse.Namespace) -> int:
    from .auto import auto_run

    rc = auto_run(args, run)  # --auto's search (None: the options say one run)
    if rc is not None:
        return rc
    try:
        return _run(args)
    except _UserError as e:
        raise SystemExit(f"kvpop train: {e}") from None


def _run(args: argparse.Namespace) -> int:
    _check_args(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        _fail(f"--out {out} exists and is not a directory")
    from kvpop.training.runstate import RunDirectoryError, RunLock

    lock = RunLock(out, "kvpop train")
    if int(os.environ.get("RANK", "0")) == 0:  # one run per --out: rank 0 holds the lock for the whole run
        try:
            lock.acquire()
        except RunDirectoryError as e:
            _fail(str(e))
    try:
        return _locked_run(args, out)
    finally:
        lock.release()


def _check_outputs(args: argparse.Namespace, out: Path) -> None:
    """Nothing in the way of what the run writes (a file where the model folder goes, a folder where a file goes)."""
    files = ["last.pt", "history.jsonl", "args.json", "head_budgets.json",
             "gates.safetensors" if args.method == "dms" else "scorers.safetensors"]
    for name in files:
        if (out / name).is_dir():
            _fail(f"--out {out}: {out / name} is a directory, where the run writes a file; move it away")
    model = out / "model"
    if not args.no_train_model and model.exists() and not model.is_dir():
        _fail(f"--out {out}: {model} exists and is not a directory, where the fine-tuned model goes; move it away "
              f"(or train with --no-train-model)")


def _locked_run(args: argparse.Namespace, out: Path) -> int:
    _check_outputs(args, out)
    if args.resume:
        _check_resume_args(args, out)
    elif (out / "last.pt").exists():
        _fail(f"--out {out} already holds a run (last.pt); add --resume to continue it or choose another --out")
    if args.model is not None:
        from kvpop.models import check_model_dir

        try:  # before any work: the family, the config and the weight files (headers only)
            check_model_dir(args.model)
        except (OSError, ValueError) as e:
            _fail(f"--model {args.model}: {e}")

    import torch
    import torch.distributed as dist

    from kvpop.baselines.dms import DMSConfig
    from kvpop.core.config import KVpopConfig
    from kvpop.training.methods import DMSMethod, KVpopMethod
    from kvpop.training.runstate import CheckpointError, RunMismatch
    from kvpop.training.train import (
        TrainConfig,
        TrainingDiverged,
        TrainingInterrupted,
        learning_rates,
        save_model,
        train,
    )

    try:
        if args.method == "kvpop":
            kv_cfg = KVpopConfig(budget=args.budget, sinks=args.sinks, window=args.window, scorer=args.scorer,
                                 scorer_hidden=args.scorer_hidden, mlstm_dim=args.mlstm_dim,
                                 mask_source=args.mask_source, target_lse=args.target_lse, tau=args.tau,
                                 balance=not args.no_balance, target_source=args.target_source,
                                 tie_margin=args.tie_margin, eps=args.eps, label=args.label,
                                 label_power=args.label_power, **_decay_range(args))
        else:  # DMS: the budget and the scorer options do not apply
            kv_cfg = DMSConfig(sinks=args.sinks, window=args.window, tau=args.gate_tau, gate_offset=args.gate_offset,
                               target_keep=args.target_keep,
                               schedule_steps=args.steps if args.schedule_steps is None else args.schedule_steps,
                               aux_weight=args.aux_weight)
    except (TypeError, ValueError) as e:
        _fail(str(e))
    method = (KVpopMethod if args.method == "kvpop" else DMSMethod)(kv_cfg)
    rank, world, device, started = _setup_dist(args)
    try:
        if args.bf16 and device.type != "cuda":
            _fail(f"--bf16 needs a CUDA device (this run is on {device}); leave it out on the CPU")
        torch.manual_seed(args.seed)
        model, source = _load_model(args, device)
        model_print = _model_fingerprint(source)
        try:
            data = _data(args, model, source)
        except ValueError as e:
            _fail(str(e))
        chosen = None
        if args.method == "kvpop" and (args.head_budgets is not None or args.allocate is not None):
            kv_cfg, chosen = _head_budgets(args, kv_cfg, model, source, out)
            method = KVpopMethod(kv_cfg)
        torch.manual_seed(args.seed)  # the scorers' initialisation
        try:
            method.attach(model)
        except (TypeError, ValueError) as e:
            _fail(f"cannot patch {source or 'the --tiny model'}: {e}")
        tcfg = TrainConfig(steps=args.steps, lr_model=args.lr_model, lr_scorer=args.lr_scorer,
                           weight_decay=args.weight_decay, grad_accum=args.grad_accum,
                           max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
                           warmup_steps=args.warmup_steps, top_k=args.top_k, score_weight=args.score_weight,
                           train_model=not args.no_train_model,
                           activation_checkpointing=args.activation_checkpointing, checkpoint_dir=str(out),
                           checkpoint_every=args.checkpoint_every, progress=not args.no_progress,
                           seed=args.seed, dist=args.dist, bf16=args.bf16, loss_chunk=args.loss_chunk,
                           data_fingerprint=_fingerprint(args), model_fingerprint=model_print)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if not args.resume or not (out / "args.json").exists():
                from kvpop.core.files import atomic_write

                saved = {**_comparable(_arg_dict(args)), "out": str(out.resolve())}
                text = json.dumps(saved, indent=2, sort_keys=True) + "\n"
                atomic_write(out / "args.json", lambda f: f.write(text), binary=False)
            if chosen is not None and chosen[1] is not None:
                from kvpop.core.budgets import HEAD_BUDGETS_FILE, write_head_budgets

                write_head_budgets(out / HEAD_BUDGETS_FILE, chosen[0], **chosen[1])
                if args.allocate is not None:
                    print(f"kvpop train: --allocate {args.allocate}: per-head budgets {[list(r) for r in chosen[0]]} "
                          f"(mean {args.budget}); wrote {out / HEAD_BUDGETS_FILE}", file=sys.stderr)
        try:
            hist = train(model, data, tcfg, resume=args.resume, method=method)  # writes last.pt, history.jsonl
        except TrainingInterrupted as e:
            if rank == 0:
                print(f"kvpop train: {e}: run the same command with --resume to continue", file=sys.stderr)
            return 128 + e.signum
        except RunMismatch as e:
            _fail(_mismatch(e, args, source, out))
        except (CheckpointError, TrainingDiverged) as e:
            _fail(str(e))
        from kvpop.training.runstate import output_step

        step = output_step(out / method.layer_file) if rank == 0 else None  # just written and stamped by train
        if not args.no_train_model:
            try:
                save_model(model, out / "model", step=step)
            except (OSError, ValueError) as e:
                _fail(f"{e} (the scorers and last.pt of the finished run are in {out})")
        if rank == 0:
            if hist:
                h = hist[-1]
                if args.method == "dms":
                    print(f"kvpop train: step {h['step']}: kl {h['kl']:.4f}, compression loss {h['score']:.4f}, "
                          f"keep {h['keep_frac']:.3f} (target {h['target_keep']:.3f}); wrote {out}")
                    whole = out / "history.jsonl"  # a resumed run's steps before this call too
                    miss = keep_miss([json.loads(x) for x in whole.read_text().splitlines()] if whole.exists()
                                     else hist)
                    if miss is not None:
                        print(f"kvpop train: warning: DMS's keep fraction {miss[0]:.3f} (mean of the last "
                              f"{KEEP_STEPS} steps) missed its target {miss[1]:.3f} by more than "
                              f"{KEEP_MARGIN:.0%}: train longer (--steps; the schedule ends at --schedule-steps) or "
                              f"raise the gates' learning rate (--lr-scorer, now {learning_rates(tcfg, 'dms')[1]:g})",
                              file=sys.stderr)
                else:
                    print(f"kvpop train: step {h['step']}: kl {h['kl']:.4f}, score {h['score']:.4f}, "
                          f"accuracy {h.get('accuracy', float('nan')):.3f}; wrote {out}")
            else:
                layer = "gates.safetensors" if args.method == "dms" else "scorers.safetensors"
                print(f"kvpop train: no step left, {out / 'last.pt'} is at step {step} >= --steps {args.steps}; "
                      f"rewrote {layer}{'' if args.no_train_model else ' and model/'} from it (step {step})")
        if started and dist.is_initialized():  # every rank done (rank 0 writes and prints last) before the
            dist.barrier()  # group is torn down: a rank tearing down gloo while its peer still ran once aborted
        return 0
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
