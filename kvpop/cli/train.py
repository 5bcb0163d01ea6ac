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

What ``--out DIR`` receives, what ``--resume`` needs and how a run stops: :mod:`kvpop.training.rundir`
(head-adaptive budgets: :mod:`kvpop.training.allocation`; several processes under ``torchrun``:
:mod:`kvpop.training.distributed`).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvpop.demo.search import default_model, task_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvpop.baselines.dms import DMSConfig
    from kvpop.core.config import LABELS, MASK_SOURCES, SCORERS, TARGET_LSES, TARGET_SOURCES, KVpopConfig
    from kvpop.core.config import PRIORITY_SOURCES as PRIORITIES
    from kvpop.training.allocation import VALID_SEQUENCES
    from kvpop.training.rundir import KEEP_MARGIN
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
    dat.add_argument("--task", nargs="?", const="kvtrace", default=None, choices=("kvtrace", "lookahead"),
                     help="train on a synthetic task generated on the fly: kvtrace (kvpop.demo.task, what --task alone "
                          "means) or lookahead (kvpop.demo.lookahead_task); the default --model is the task's "
                          "shipped model")
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
                    help="priorities of the training mask: scorer (the learned policy), teacher (the oracle: the "
                         "exact label itself, from the --target-source model's queries), streaming (the fixed "
                         f"sinks + window pattern) (default {d.mask_source})")
    kv.add_argument("--priority-source", choices=PRIORITIES, default=None,
                    help="where the priority comes from, in the training mask and when served: scorer (the learned "
                         "scorer) or a control that is not learned, trained with no L_score (the model fine-tuned as "
                         "under --mask-source streaming): random (the scorer at its --seed init, frozen), keynorm+ / "
                         "keynorm- (the pre-RoPE key norm), window-attention (the attention the token got while in "
                         "the window), oracle-label (the exact label: not causal, refused when decoding) "
                         f"(default {d.priority_source}; docs/DESIGN.md section 12)")
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
    kv.add_argument("--init-scorers", type=str, default=None, metavar="FILE",
                    help="start the scorers from this scorer file (a scorer-only run's scorers.safetensors: a joint "
                         "retrofit's warm start) instead of their seeded initialisation; its scorer structure must "
                         "be this run's (kvpop.load_scorers checks it); budget and label may differ")
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
                    help="with --allocate or --auto: validation records (same format as --data, cut at --seq-len), "
                         "held out from the training file: --allocate measures each head's importance on them, "
                         "--auto scores every trial on them (with --task: the task's validation sequences)")
    kv.add_argument("--valid-sequences", type=int, default=None,
                    help=f"with --allocate or --auto: validation sequences measured (default {VALID_SEQUENCES}; with "
                         f"--allocate each head costs one forward over them, with --auto every validation of a trial "
                         f"scores them)")
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
    run.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads (default: torch's own, one per core); may change on --resume")
    from .auto import add_arguments as add_auto

    add_auto(p)


def interpreter_warning() -> str | None:
    """The warning for a CPU run under ``TRITON_INTERPRET=1`` outside the tests (which set it to test the kernels):
    the Triton kernels then run in Triton's CPU interpreter, far slower than the PyTorch path; None otherwise."""
    value = os.environ.get("TRITON_INTERPRET", "")
    if value.strip().lower() not in ("1", "true", "yes", "on") or "PYTEST_CURRENT_TEST" in os.environ:
        return None
    return (f"kvpop train: warning: TRITON_INTERPRET={value} is set, so on the CPU the Triton kernels run in Triton's "
            f"interpreter, hundreds of times slower than the PyTorch path (one step of a small model can take "
            f"minutes); unset it (or set TRITON_INTERPRET=0) unless you are testing the kernels")


def _allocation_notes(args: argparse.Namespace, kv_cfg, chosen) -> str:
    """What the user should know of ``--allocate``'s budgets: heads left without a long-range slot (and why), and
    heads held at --seq-len (a sequence fills no more)."""
    rows, doc = chosen
    flat = [b for r in rows for b in r]
    imp = [x for r in (doc or {}).get("importance") or [] for x in r]
    notes = []
    bare = [i for i, b in enumerate(flat) if b <= kv_cfg.sinks + kv_cfg.window]
    if bare:
        most = (f": their ablation raised the validation NLL by at most {max(imp[i] for i in bare):.4g} nats"
                if imp else "")
        notes.append(f"{len(bare)} of {len(flat)} heads keep no long-range slot (sinks + window only){most}; --min-k K "
                     f"gives every head at least K")
    full = sum(b >= args.seq_len for b in flat)
    if full:
        notes.append(f"{full} head(s) at --seq-len {args.seq_len}, what a sequence fills (more would never be used)")
    return "".join(f"; {n}" for n in notes)


class _UserError(Exception):
    pass


def _fail(msg: str) -> None:
    raise _UserError(msg)


def _checked(fn, *a, **kw):
    """``fn(*a, **kw)`` with its ``ValueError`` (a refusal of kvpop.training's run set-up, naming the option or
    file) said as the command's error."""
    try:
        return fn(*a, **kw)
    except ValueError as e:
        _fail(str(e))


def _load_model(args: argparse.Namespace, device):
    import torch

    if args.tiny:
        from kvpop.demo.pretrain import build_model

        model = build_model(seed=args.seed)
        source = None
    else:
        from kvpop.models import load_model_dir

        source = Path(args.model) if args.model else default_model(args)
        try:  # config.json checked first: an unsupported family is refused before any weight is allocated
            model = load_model_dir(source, dtype=torch.float32)
        except (OSError, ValueError) as e:
            _fail(f"--model {source}: {e}")
    if getattr(model.config, "attention_dropout", 0.0):
        model.config.attention_dropout = 0.0
    return model.to(device), source


def _data(args: argparse.Namespace, model, source: Path | None):
    """The training batches: the task's endless ones (``--task``), or ``--data`` cut and shuffled."""
    from kvpop.training import data as data_io

    if args.task:
        from kvpop.demo import task as kvtrace

        T = task_of(args)
        if model.config.vocab_size < T.VOCAB_SIZE:
            _fail(f"--task {args.task} needs a vocabulary of >= {T.VOCAB_SIZE} tokens; the model has "
                  f"{model.config.vocab_size}")
        try:
            return kvtrace.TaskBatches(args.seq_len, args.batch_size, T.DEFAULT, make_batch=T.make_batch)
        except ValueError as e:
            _fail(str(e))
    seqs = data_io.cut_file(args.data, args.seq_len, vocab_size=model.config.vocab_size, model_dir=source,
                            pack=args.pack, eos_token_id=getattr(model.config, "eos_token_id", None))
    if args.allocate is not None and args.valid_data is not None:  # its sequences are checked against these
        args._train_digests = data_io.digests(seqs)
    return data_io.make_batches(seqs, args.batch_size, seed=args.seed, source=args.data)


def _head_budgets(args: argparse.Namespace, kv_cfg, model, source: Path | None, out: Path):
    """The run's config with head-adaptive budgets (``--head-budgets`` / ``--allocate``, kvpop.training.allocation)
    and ``(rows, the document to write as OUT/head_budgets.json; None: nothing new)``."""
    from kvpop.core.budgets import HEAD_BUDGETS_FILE
    from kvpop.training import allocation as A

    if args.head_budgets is not None or args.resume:
        given = args.head_budgets is not None
        flag = f"--head-budgets {args.head_budgets}" if given else f"--allocate {args.allocate} --resume"
        return A.given_head_budgets(kv_cfg, model, args.head_budgets if given else out / HEAD_BUDGETS_FILE, flag,
                                    budget=args.budget, keep_doc=given,
                                    copy=out / HEAD_BUDGETS_FILE if given and args.resume else None)
    n = args.valid_sequences or A.VALID_SEQUENCES
    if args.valid_data is not None:
        seqs, what, both = A.validation_file(
            args.valid_data, args.seq_len, n, vocab_size=model.config.vocab_size, model_dir=source, pack=args.pack,
            eos_token_id=getattr(model.config, "eos_token_id", None),
            train_digests=getattr(args, "_train_digests", None), train_path=args.data)
        if both:
            print(f"kvpop train: warning: --valid-data {args.valid_data}: {both} of its {len(seqs)} sequences measured "
                  f"are training sequences of --data {args.data} too", file=sys.stderr)
    else:
        T = task_of(args)
        seqs = list(T.make_batch([T.valid_seed(i) for i in range(n)], args.seq_len)["input_ids"])
        what = f"{n} validation sequence(s) of the task (valid_seed(0..{n - 1})), {args.seq_len} tokens"
    if not seqs:
        _fail(f"--valid-data {args.valid_data} gives no sequence of --seq-len {args.seq_len} tokens")
    return A.measured_head_budgets(kv_cfg, model, A.validation_batches(seqs, args.batch_size), what,
                                   rule=args.allocate, min_k=args.min_k or 0)


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
    from kvpop.training.options import check_options

    _checked(check_options, args)
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


def _locked_run(args: argparse.Namespace, out: Path) -> int:
    from kvpop.training import rundir

    _checked(rundir.check_outputs, out, layer_file="gates.safetensors" if args.method == "dms" else
             "scorers.safetensors", train_model=not args.no_train_model)
    if (out / "selection.json").exists() and not getattr(args, "_auto_trial", False):
        _fail(f"--out {out} holds a kvpop train --auto search (selection.json) and its chosen run: continue the "
              f"search with the same kvpop train --auto command and --resume; a run without --auto would replace "
              f"the chosen run's files: choose another --out")
    if args.resume:
        _checked(rundir.check_resume_args, out, rundir.arg_dict(args))
    elif (out / "last.pt").exists():
        _fail(f"--out {out} already holds a run (last.pt); add --resume to continue it or choose another --out")
    if args.model is not None:  # before any work: the family, the config and the weight files (headers only)
        _checked(rundir.check_model, args.model)

    import torch

    from kvpop.training.methods import DMSMethod, KVpopMethod
    from kvpop.training.options import method_config, train_config
    from kvpop.training.runstate import CheckpointError, RunMismatch
    from kvpop.training.train import TrainingDiverged, TrainingInterrupted, learning_rates, save_model, train

    try:
        kv_cfg = method_config(args)
    except (TypeError, ValueError) as e:
        _fail(str(e))
    method = (KVpopMethod if args.method == "kvpop" else DMSMethod)(kv_cfg)
    from kvpop.training.distributed import finish_process, setup_process, wait_for_ranks

    rank, world, device, started = _checked(setup_process, args.device)
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if device.type == "cpu" and rank == 0 and interpreter_warning() is not None:
            print(interpreter_warning(), file=sys.stderr)
        if args.bf16 and device.type != "cuda":
            _fail(f"--bf16 needs a CUDA device (this run is on {device}); leave it out on the CPU")
        torch.manual_seed(args.seed)
        model, source = _load_model(args, device)
        model_print = _checked(rundir.model_print, source)
        data = _checked(_data, args, model, source)
        chosen = None
        if args.method == "kvpop" and (args.head_budgets is not None or args.allocate is not None):
            kv_cfg, chosen = _checked(_head_budgets, args, kv_cfg, model, source, out)
            method = KVpopMethod(kv_cfg)
            over = [b for r in kv_cfg.head_budgets for b in r if b > args.seq_len]
            if over and args.head_budgets is not None and rank == 0:
                print(f"kvpop train: warning: --head-budgets {args.head_budgets}: {len(over)} head(s) hold more than "
                      f"--seq-len {args.seq_len} entries (up to {max(over)}): a training sequence never fills them, "
                      f"and a head whose budget holds the whole sequence evicts nothing to learn from", file=sys.stderr)
        torch.manual_seed(args.seed)  # the scorers' initialisation
        try:
            method.attach(model)
        except (TypeError, ValueError) as e:
            _fail(f"cannot patch {source or 'the --tiny model'}: {e}")
        if args.init_scorers is not None:  # a warm start (a resume then restores last.pt's state over it)
            from kvpop.core.checkpoint import load_scorers

            try:
                load_scorers(model, args.init_scorers)
            except (OSError, ValueError) as e:
                _fail(f"--init-scorers {args.init_scorers}: {e}")
        tcfg = train_config(args, out, data_fingerprint=_checked(rundir.data_print, args.data),
                            model_fingerprint=model_print)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if not args.resume or not (out / "args.json").exists():
                rundir.write_args(out, rundir.arg_dict(args))
            if chosen is not None and chosen[1] is not None:
                written = rundir.write_head_budgets(out, *chosen)
                if args.allocate is not None:
                    print(f"kvpop train: --allocate {args.allocate}: per-head budgets {[list(r) for r in chosen[0]]} "
                          f"(mean {args.budget}){_allocation_notes(args, kv_cfg, chosen)}; wrote {written}",
                          file=sys.stderr)
        try:
            hist = train(model, data, tcfg, resume=args.resume, method=method)  # writes last.pt, history.jsonl
        except TrainingInterrupted as e:
            if rank == 0 and not getattr(args, "_auto_trial", False):  # --auto says it for the whole search
                print(f"kvpop train: {e}: run the same command with --resume to continue", file=sys.stderr)
            return 128 + e.signum
        except RunMismatch as e:
            _fail(rundir.mismatch_message(e, model_dir=source, head_budgets=args.head_budgets, out=out))
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
            line, warning = rundir.closing_report(out, hist, method=args.method, steps=args.steps, step=step,
                                                  train_model=not args.no_train_model,
                                                  lr_scorer=learning_rates(tcfg, args.method)[1])
            print(line)
            if warning is not None:
                print(warning, file=sys.stderr)
        wait_for_ranks(started)  # every rank done before the group is torn down
        return 0
    finally:
        finish_process(started)
