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

from .train_options import add_arguments as add_arguments  # the subcommand's parser builder


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

        source = Path(args.model) if args.model else default_model(args.task)
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

        T = task_of(args.task)
        if model.config.vocab_size < T.VOCAB_SIZE:
            _fail(f"--task {args.task} needs a vocabulary of >= {T.VOCAB_SIZE} tokens; the model has "
                  f"{model.config.vocab_size}")
        try:
            return kvtrace.TaskBatches(args.seq_len, args.batch_size, T.DEFAULT, make_batch=T.make_batch)
        except ValueError as e:
            _fail(str(e))
    seqs = data_io.cut_file(args.data, args.seq_len, vocab_size=model.config.vocab_size, model_dir=source,
                            pack=args.pack, eos_token_id=getattr(model.config, "eos_token_id", None),
                            warn=lambda m: print(f"kvpop train: warning: --data {m}", file=sys.stderr))
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
        T = task_of(args.task)
        seqs = list(T.make_batch([T.valid_seed(i) for i in range(n)], args.seq_len)["input_ids"])
        what = f"{n} validation sequence(s) of the task (valid_seed(0..{n - 1})), {args.seq_len} tokens"
    if not seqs:
        _fail(f"--valid-data {args.valid_data} gives no sequence of --seq-len {args.seq_len} tokens")
    return A.measured_head_budgets(kv_cfg, model, A.validation_batches(seqs, args.batch_size), what,
                                   rule=args.allocate, min_k=args.min_k or 0)


def run(args: argparse.Namespace) -> int:
    from .auto import auto_run
    from .writes import check_writable

    try:  # --auto's search and a plain run alike: nothing shipped is written without --write-shipped
        check_writable(args.out, "--out", getattr(args, "_write_shipped", False))
    except ValueError as e:
        raise SystemExit(f"kvpop train: {e}") from None
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

    from kvpop.training.options import method_config

    try:
        kv_cfg = method_config(args)
    except (TypeError, ValueError) as e:
        _fail(str(e))
    from kvpop.training.distributed import finish_process, setup_process, wait_for_ranks

    rank, _, device, started = _checked(setup_process, args.device)
    try:
        rc = _train_on(args, out, kv_cfg, rank, device)
        if rc == 0:
            wait_for_ranks(started)  # every rank done before the group is torn down
        return rc
    finally:
        finish_process(started)  # the model (and FSDP's hold on the group) is freed by now


def _train_on(args: argparse.Namespace, out: Path, kv_cfg, rank: int, device) -> int:
    """The run on this process once it joined the group: its model, data and scorers live in this frame
    only, so they (and an FSDP model's references to the process group) are freed before the group is left;
    a group torn down while a sharded model still held it once aborted in gloo's teardown."""
    import torch

    from kvpop.training import rundir
    from kvpop.training.methods import DMSMethod, KVpopMethod
    from kvpop.training.options import train_config
    from kvpop.training.runstate import CheckpointError, RunMismatch
    from kvpop.training.train import TrainingDiverged, TrainingInterrupted, learning_rates, save_model, train

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if device.type == "cpu" and rank == 0 and interpreter_warning() is not None:
        print(interpreter_warning(), file=sys.stderr)
    if args.bf16 and device.type != "cuda":
        _fail(f"--bf16 needs a CUDA device (this run is on {device}); leave it out on the CPU")
    method = (KVpopMethod if args.method == "kvpop" else DMSMethod)(kv_cfg)
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
                                              lr_scorer=learning_rates(tcfg, args.method)[1],
                                              priority_source=getattr(args, "priority_source", None))
        print(line)
        if warning is not None:
            print(warning, file=sys.stderr)
    return 0
