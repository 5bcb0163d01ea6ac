"""Dense pre-training of the tiny Qwen3 model on the key-value trace task (:mod:`kvpop.demo.task`).

The command is ``kvpop pretrain`` (its arguments and ``main``: :mod:`kvpop.cli.pretrain`); this module
holds the training itself (:func:`pretrain`).

The model is a ``transformers`` ``Qwen3ForCausalLM`` (GQA, head_dim 32). Training follows a
curriculum over sequence lengths (``--curriculum 128:64,256:32,512:16,1024:8,2048:4`` = length:batch);
it moves to the next stage when the moving average of training accuracy passes
``--advance-acc`` (after at least ``--min-stage-steps`` steps). The loss is cross-entropy on the
graded answer tokens plus ``--filler-weight`` times the loss on predicting filler after filler.
Every ``--eval-every`` steps it measures accuracy on held-out test seeds at the current length and
at the final length (``L_train``); the best model at ``L_train`` is written with
``save_pretrained`` to ``OUT/model`` (the last one to ``OUT/model_final``). ``OUT/ckpt.pt``
(written atomically) holds the model, optimiser, step, curriculum state and RNG states, so
``--resume`` continues exactly (SIGTERM/SIGINT checkpoint and stop cleanly). ``--cooldown N``
decays the learning rate linearly to 0 over the last N steps; it and ``--steps`` may be changed when resuming.

Every option is checked before any work (:func:`check_args`).  A step whose loss or gradient norm is not
finite is not taken and the run stops with :class:`PretrainDiverged`; no checkpoint or model of non-finite
weights is written, so ``OUT/ckpt.pt`` keeps the last finite step.  ``--resume`` refuses settings other than
those of the run in ``OUT/ckpt.pt`` (:func:`changed_settings`; the options of :data:`RESUMABLE` may change).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvpop.training.runstate import (
    CheckpointError,
    StopSignals,
    atomic_save,
    load_checkpoint,
    non_finite,
    non_finite_parameters,
    rng_state,
    set_rng_state,
    write_jsonl,
)

from . import task as T

__all__ = ["PretrainSettings", "TASKS", "get_task", "build_model", "pretrain", "evaluate", "export_model",
           "parse_curriculum", "check_args", "changed_settings", "PretrainDiverged", "check_step", "check_weights",
           "RESUMABLE"]

TASKS = {"kvtrace": ("kvpop.demo.task", "128:64,256:32,512:16,1024:8,2048:4"),
         "lookahead": ("kvpop.demo.lookahead_task", "128:64,256:32,512:16")}
"""Task name -> (module, default curriculum).  A task module has ``TaskConfig``, ``DEFAULT``,
``make_batch``, ``train_seed``, ``test_seed`` and ``describe`` (see ``kvpop.demo.task``)."""


def get_task(name: str):
    """The task module called ``name`` (a key of :data:`TASKS`)."""
    import importlib

    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; allowed: {sorted(TASKS)}")
    return importlib.import_module(TASKS[name][0])


def build_model(task_cfg: T.TaskConfig = T.DEFAULT, *, hidden: int = 128, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, head_dim: int = 32, intermediate: int = 384,
                max_positions: int = 8192, rope_theta: float = 1e6, seed: int = 0):
    """A freshly initialised tiny ``Qwen3ForCausalLM`` for the task's vocabulary (fp32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=task_cfg.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=True, bos_token_id=T.BOS_ID, eos_token_id=T.EOS_ID,
        pad_token_id=T.PAD_ID,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    return model


def parse_curriculum(spec: str) -> list[tuple[int, int]]:
    """``"128:64,256:32"`` -> ``[(128, 64), (256, 32)]`` (length, batch size)."""
    stages = []
    for part in spec.split(","):
        try:
            length, batch = part.split(":")
            stages.append((int(length), int(batch)))
        except ValueError:
            raise ValueError(f"bad curriculum stage {part!r}; expected LENGTH:BATCH") from None
    if not stages:
        raise ValueError("empty curriculum")
    return stages


@dataclass
class PretrainSettings:
    """The settings of one pre-training (``kvpop pretrain``'s options, field for field and in their order: the
    command builds it, :func:`pretrain` and :func:`kvpop.demo.pretrain_data.pretrain_data` take it).  Its dict
    (:func:`dataclasses.asdict`) is what ``args.json`` and the checkpoints record and a resume compares."""

    out: str
    steps: int = 6000
    resume: bool = False
    seed: int = 0
    threads: int = 1
    task: str = "kvtrace"
    curriculum: str | None = None
    advance_acc: float = 0.9
    min_stage_steps: int = 50
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: int = 100
    cooldown: int = 0
    clip: float = 1.0
    filler_weight: float = 0.1
    eval_every: int = 100
    eval_n: int = 32
    ckpt_every: int = 25
    max_minutes: float | None = None
    stop_acc: float = 1.01
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 384
    rope_theta: float = 1e6
    export: str | None = None
    export_from: str = "model"
    export_lengths: str | None = None
    no_progress: bool = False
    data: str | None = None
    valid_data: str | None = None
    seq_len: int = 1024
    batch_size: int = 4
    vocab_size: int | None = None
    max_positions: int | None = None


RESUMABLE = frozenset({"steps", "resume", "out", "threads", "no_progress", "max_minutes", "cooldown", "ckpt_every",
                       "eval_every", "stop_acc", "export", "export_from", "export_lengths", "command_line"})
"""Options that may change between a run and its ``--resume``: how long, where and how visibly it runs (and
when it evaluates); every other one changes what is trained and is refused (:func:`changed_settings`)."""


class PretrainDiverged(ValueError):
    """A pre-training step whose loss or gradient norm, or weights about to be written, are not finite (NaN or
    inf): the step is not taken, nothing of it is written, and ``checkpoint`` keeps ``good_step`` (None: no
    checkpoint of this run was written)."""

    def __init__(self, step: int, what: str, checkpoint: Path, good_step: int | None, *, weights: bool = False):
        self.step, self.what, self.checkpoint, self.good_step = step, what, checkpoint, good_step
        kept = (f"{checkpoint} keeps step {good_step}, the last finite one" if good_step is not None
                else "no checkpoint was written")
        done = "the run stops without writing them" if weights else "the run stops without taking the step"
        super().__init__(f"step {step}: {what} {'are' if weights else 'is'} not finite (NaN or inf); {done}, and "
                         f"{kept}. Lower the learning rate (--lr) in a fresh run, keep gradient clipping on (--clip), "
                         f"or check the data")


def check_step(step: int, loss: torch.Tensor, grad_norm: torch.Tensor, checkpoint: Path,
               good_step: int | None) -> float:
    """The loss of pre-training step ``step`` as a float, after checking it and the gradient norm are finite
    (:class:`PretrainDiverged` before the optimiser takes the step otherwise)."""
    lv = float(loss.detach())
    bad = non_finite({"loss": lv, "grad_norm": float(grad_norm)})
    if bad:  # the step is not taken; the checkpoint keeps the last finite one
        raise PretrainDiverged(step + 1, f"the loss or its gradient ({bad})", checkpoint, good_step)
    return lv


def check_weights(model: torch.nn.Module, step: int, checkpoint: Path, good_step: int | None) -> None:
    """:class:`PretrainDiverged` when any weight of ``model`` is not finite (before anything of it is written)."""
    bad = non_finite_parameters(model)
    if bad:
        raise PretrainDiverged(step, f"the weights ({', '.join(bad)})", checkpoint, good_step, weights=True)


def _number(args: PretrainSettings, name: str, *, low: float, strict: bool = False, integer: bool = False) -> None:
    v = getattr(args, name, None)
    if v is None:
        return
    opt = f"--{name.replace('_', '-')}"
    rel = ">" if strict else ">="
    if integer:
        if v < low:
            raise ValueError(f"{opt} must be {rel} {low}, got {v}")
    elif not (math.isfinite(v) and (v > low if strict else v >= low)):
        raise ValueError(f"{opt} must be a finite number {rel} {low:g}, got {v}")


def check_args(args: PretrainSettings, *, data: bool = False) -> None:
    """ValueError naming the first option of ``kvpop pretrain`` (the namespace of its parser) out of its range:
    the model sizes, step counts and numbers, the curriculum (task) or ``--vocab-size`` / ``--max-positions``
    (``data``: with ``--data``).  Called before any work."""
    for name, low in (("steps", 1), ("threads", 1), ("hidden", 1), ("layers", 1), ("heads", 1), ("kv_heads", 1),
                      ("head_dim", 1), ("intermediate", 1), ("eval_every", 1), ("eval_n", 1), ("ckpt_every", 1),
                      ("warmup", 0), ("cooldown", 0), ("min_stage_steps", 0)):
        _number(args, name, low=low, integer=True)
    if args.kv_heads > args.heads or args.heads % args.kv_heads:
        raise ValueError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads} (and so be <= it): each KV "
                         f"head serves --heads / --kv-heads query heads")
    for name in ("lr", "clip", "rope_theta"):
        _number(args, name, low=0, strict=True)
    for name in ("weight_decay", "filler_weight", "max_minutes"):  # --max-minutes 0: stop after one step
        _number(args, name, low=0)
    for name in ("advance_acc", "stop_acc"):
        _number(args, name, low=-math.inf)
    if data:
        for name, low in (("seq_len", 2), ("batch_size", 1), ("vocab_size", 1)):
            _number(args, name, low=low, integer=True)
        if args.max_positions is not None and args.max_positions < args.seq_len:
            raise ValueError(f"--max-positions must be >= --seq-len ({args.seq_len}): the model is trained on "
                             f"positions 0 .. {args.seq_len - 1}, got {args.max_positions}")
        return
    curriculum(args)


def curriculum(args: PretrainSettings) -> list[tuple[int, int]]:
    """The stages of ``--curriculum`` (default: the task's), checked against the task: ValueError naming the
    stage that is shorter than the task's minimum length or has a batch < 1."""
    spec = args.curriculum or TASKS[args.task][1]
    try:
        stages = parse_curriculum(spec)
    except ValueError as e:
        raise ValueError(f"--curriculum: {e}") from None
    low = get_task(args.task).DEFAULT.min_length()
    for length, batch in stages:
        if length < low:
            raise ValueError(f"--curriculum: stage {length}:{batch} is shorter than the task's minimum length {low} "
                             f"(--task {args.task})")
        if batch < 1:
            raise ValueError(f"--curriculum: stage {length}:{batch} has a batch of {batch}; it must be >= 1")
    return stages


def changed_settings(saved, now: dict, *, skip=()) -> list[str]:
    """``"--name (was X, now Y)"`` for each setting in ``now`` that differs from ``saved`` (the settings a
    checkpoint holds), in the order of ``now``; :data:`RESUMABLE` and ``skip`` are not compared, nor a setting
    the checkpoint does not hold (an option added since)."""
    if not isinstance(saved, dict):
        return []
    return [f"--{k.replace('_', '-')} (was {saved[k]!r}, now {v!r})" for k, v in now.items()
            if k in saved and k not in RESUMABLE and k not in skip and saved[k] != v]


def refuse_changed(diff: list[str], ckpt_path: Path) -> None:
    """ValueError listing ``diff`` (of :func:`changed_settings`) when it is not empty."""
    if diff:
        raise ValueError(f"--resume needs the settings of the run in {ckpt_path}; these differ: {', '.join(diff)} "
                         f"(--steps, --cooldown, --max-minutes, --ckpt-every, --eval-every, --threads and the like may "
                         f"change; other settings are another run: give another --out)")


def _loss_and_acc(model, batch: dict, task_cfg: T.TaskConfig, filler_weight: float):
    ids = batch["input_ids"]
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, L, H]
    pos = batch["answer_positions"]
    ans = batch["answers"]
    h_ans = torch.gather(hidden, 1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = model.lm_head(h_ans)  # [B, n, V]
    loss = F.cross_entropy(logits.flatten(0, 1), ans.flatten())
    acc = (logits.argmax(-1) == ans).float().mean()
    if filler_weight > 0:
        fb = task_cfg.filler_base
        cur_f = ids[:, :-1] >= fb
        nxt_f = ids[:, 1:] >= fb
        m = cur_f & nxt_f
        lf = model.lm_head(hidden[:, :-1][m])
        loss = loss + filler_weight * F.cross_entropy(lf, ids[:, 1:][m])
    return loss, acc


@torch.no_grad()
def evaluate(model, length: int, n: int = 32, batch_size: int = 8,
             task_cfg=None, first_seed: int = 0, task=T) -> float:
    """Dense accuracy on test seeds ``test_seed(first_seed .. first_seed + n - 1)`` of the task module
    ``task`` (default :mod:`kvpop.demo.task`) at ``length``."""
    T = task
    task_cfg = task_cfg if task_cfg is not None else T.DEFAULT
    model.eval()
    correct = total = 0
    for i in range(0, n, batch_size):
        seeds = [T.test_seed(first_seed + j) for j in range(i, min(n, i + batch_size))]
        b = T.make_batch(seeds, length, task_cfg)
        hidden = model.model(input_ids=b["input_ids"], use_cache=False).last_hidden_state
        pos = b["answer_positions"]
        h = torch.gather(hidden, 1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
        pred = model.lm_head(h).argmax(-1)
        correct += int((pred == b["answers"]).sum())
        total += pred.numel()
    model.train()
    return correct / max(1, total)


def _save_model(model, path: Path, info: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    (tmp / "training_state.json").write_text(json.dumps(info, indent=2))
    if path.exists():
        import shutil
        old = path.with_name(path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def export_model(src: str | os.PathLike, dst: str | os.PathLike, *, lengths: list[int],
                 n: int = 32, command: str | None = None, task=T) -> dict:
    """Copy a trained model (``save_pretrained`` dir ``src``) to ``dst`` as ``config.json`` +
    ``model.safetensors`` and write ``dst/training.json`` with its test accuracy at ``lengths``.

    Returns the dict written to ``training.json``.
    """
    from transformers import Qwen3ForCausalLM

    src, dst = Path(src), Path(dst)
    model = Qwen3ForCausalLM.from_pretrained(src).eval()
    model.config.use_cache = True
    info = {}
    if (src / "training_state.json").exists():
        info = json.loads((src / "training_state.json").read_text())
    acc = {str(L): round(evaluate(model, L, n=n, batch_size=4, task=task), 4) for L in lengths}
    tmp = dst.with_name(dst.name + ".tmp")
    import shutil
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        os.replace(tmp / name, dst / name)
    shutil.rmtree(tmp)
    record = {"task": task.describe(), "task_config": task.DEFAULT.to_dict(),
              "test_accuracy": acc, "eval_sequences_per_length": n,
              "test_seeds": f"test_seed(0..{n - 1})", "train_step": info.get("step"),
              "train_wall_s": info.get("elapsed_s"), "train_args": info.get("args"),
              "export_command": command, "n_params": sum(p.numel() for p in model.parameters())}
    (dst / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def restore_checkpoint(ckpt_path: Path, model, opt, out: Path, check=None) -> dict:
    """Load ``ckpt_path`` into ``model``, ``opt`` and the RNGs and trim ``out/log.jsonl`` to the steps it
    finished; returns the checkpoint.  ``check(ck)``, when given, may refuse it (raise) before anything is
    restored."""
    try:
        ck = load_checkpoint(ckpt_path)
    except CheckpointError as e:
        raise SystemExit(f"kvpop pretrain: {e}") from None
    if check is not None:
        check(ck)
    try:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        what = "; ".join(x.strip() for x in str(e).splitlines() if x.strip())
        raise ValueError(f"checkpoint {ckpt_path} does not fit this model and optimiser ({type(e).__name__}: "
                         f"{what[:300]}); resume with the settings of its run") from None
    set_rng_state(ck["rng"])
    # the log keeps the lines of the steps the checkpoint finished, none of those it did not
    log_path = out / "log.jsonl"
    if log_path.exists():
        lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
        write_jsonl(log_path, [r for r in lines if r.get("step", 0) <= ck["state"]["step"]])
    return ck


def _lr_at(step: int, args) -> float:
    """Linear warm-up, constant, then a linear cool-down to 0 over the last ``--cooldown`` steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.cooldown > 0 and step >= args.steps - args.cooldown:
        return args.lr * max(0.0, args.steps - step) / args.cooldown
    return args.lr


def pretrain(args: PretrainSettings) -> int:
    """Pre-train (or resume) the tiny model in ``args.out`` with the settings of ``kvpop pretrain`` (built by
    :mod:`kvpop.cli.pretrain`); returns the command's exit status.  The phases: the settings checked, the model
    and optimiser built (:meth:`_Pretraining.build`), the resume (:meth:`_Pretraining.resume`), then the steps
    (:meth:`_Pretraining.run`: each :meth:`~_Pretraining.step`, the evaluations and the checkpoints)."""
    try:
        check_args(args)
    except ValueError as e:
        print(f"kvpop pretrain: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = _Pretraining.build(args, out)
    if args.resume:
        try:
            run.resume()
        except ValueError as e:
            print(f"kvpop pretrain: error: {e}", file=sys.stderr)
            return 2
    if run.state["step"] == 0:
        write_jsonl(out / "log.jsonl", [])  # a fresh run starts a fresh log
    run.model.train()
    (out / "args.json").write_text(json.dumps({**asdict(args), "task": run.task_cfg.to_dict()}, indent=2))
    return run.run()


class _RunFiles:
    """What both pre-training runs (:class:`_Pretraining`, ``pretrain_data``'s ``_DataRun``) share: the checkpoint
    ``OUT/ckpt.pt`` and the check that the weights are finite before anything of them is written."""

    out: Path
    model: torch.nn.Module
    state: dict
    good_step: int | None

    @property
    def ckpt_path(self) -> Path:
        return self.out / "ckpt.pt"

    def finite_weights(self) -> None:  # before anything of the weights is written
        check_weights(self.model, self.state["step"], self.ckpt_path, self.good_step)


@dataclass
class _Pretraining(_RunFiles):
    """One pre-training run: its settings, task and curriculum, the model and optimiser, the progress
    (``state``, saved in ``ckpt.pt``) and ``good_step``, the step ``ckpt.pt`` holds (finite weights: no
    checkpoint of others is written)."""

    args: PretrainSettings
    out: Path
    task: Any
    task_cfg: Any
    stages: list[tuple[int, int]]
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    state: dict
    good_step: int | None = None

    @property
    def L_train(self) -> int:
        return self.stages[-1][0]

    @classmethod
    def build(cls, args: PretrainSettings, out: Path) -> _Pretraining:
        """The model (the task's embedding start when it has one) and its AdamW (no decay on vectors)."""
        task = get_task(args.task)
        stages = curriculum(args)
        task_cfg = task.DEFAULT
        model = build_model(task_cfg, hidden=args.hidden, layers=args.layers, heads=args.heads,
                            kv_heads=args.kv_heads, head_dim=args.head_dim,
                            intermediate=args.intermediate,
                            max_positions=max(8192, 4 * stages[-1][0]), rope_theta=args.rope_theta,
                            seed=args.seed)
        if hasattr(task, "init_embeddings"):  # a task's own start for its embeddings (see the task module)
            task.init_embeddings(model.get_input_embeddings().weight, task_cfg)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, betas=(0.9, 0.98))
        state = {"step": 0, "stage": 0, "stage_step": 0, "ema_acc": 0.0, "best_acc": -1.0,
                 "elapsed_s": 0.0, "history": []}
        return cls(args, out, task, task_cfg, stages, model, opt, state)

    def resume(self) -> None:
        """``ckpt.pt`` read back (ValueError when it was trained with other settings than the resumable ones)."""
        if not self.ckpt_path.exists():
            print(f"no checkpoint at {self.ckpt_path}; starting fresh", file=sys.stderr)
            return

        def norm(a: dict) -> dict:  # the default curriculum spelled out or left out: the same run
            return {**a, "curriculum": a.get("curriculum") or TASKS.get(a.get("task"), (None, None))[1]}

        def same_settings(ck: dict) -> None:
            saved = ck.get("args")
            refuse_changed(changed_settings(norm(saved) if isinstance(saved, dict) else saved,
                                            norm(asdict(self.args))), self.ckpt_path)

        self.state = restore_checkpoint(self.ckpt_path, self.model, self.opt, self.out, check=same_settings)["state"]
        self.good_step = self.state["step"]
        print(f"resumed at step {self.state['step']} stage {self.state['stage']}", file=sys.stderr)

    def checkpoint(self) -> None:
        self.finite_weights()
        atomic_save({"model": self.model.state_dict(), "optim": self.opt.state_dict(), "state": self.state,
                     "args": asdict(self.args), "task": self.task_cfg.to_dict(), "rng": rng_state()}, self.ckpt_path)
        self.good_step = self.state["step"]

    def run(self) -> int:
        """The steps up to ``--steps``: evaluations every ``--eval-every`` steps, checkpoints every
        ``--ckpt-every``, a stop on ``--max-minutes``, ``--stop-acc`` or a signal; the exit status."""
        from kvpop.progress import progress

        args, state = self.args, self.state
        bar = progress(args.steps, desc="kvpop pretrain", initial=state["step"], enabled=not args.no_progress,
                       mininterval=5.0)
        signals = StopSignals(name="kvpop pretrain").install()  # checkpoint and stop cleanly on SIGTERM / SIGINT
        t0 = time.time() - state["elapsed_s"]
        log = open(self.out / "log.jsonl", "a")
        try:
            while state["step"] < args.steps:
                rec, length, advanced = self.step(t0, bar)
                done = state["step"] >= args.steps
                if state["step"] % args.eval_every == 0 or done or advanced:
                    self.evaluate(rec, length, done, bar)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                stop = bool(args.max_minutes is not None and state["elapsed_s"] > 60 * args.max_minutes)
                if rec.get("test_acc_Ltrain", 0.0) >= args.stop_acc or signals.signum is not None:
                    stop = True
                if state["step"] % args.ckpt_every == 0 or done or stop or advanced:
                    self.checkpoint()
                if stop:
                    break
            if self.good_step != state["step"]:
                self.checkpoint()
            if state["step"] >= args.steps:
                _save_model(self.model, self.out / "model_final", {"step": state["step"], "L_train": self.L_train,
                                                                   "elapsed_s": state["elapsed_s"],
                                                                   "args": asdict(args)})
        except PretrainDiverged as e:
            print(f"kvpop pretrain: {e}", file=sys.stderr)
            return 1
        finally:
            if bar is not None:
                bar.close()
            signals.restore()
            log.close()
        print(json.dumps({"done": True, "step": state["step"], "best_test_acc_Ltrain": state["best_acc"],
                          "elapsed_s": round(state["elapsed_s"], 1)}), flush=True)
        if signals.signum is not None:
            print(f"kvpop pretrain: stopped by a signal after step {state['step']}; {self.ckpt_path} holds it: "
                  f"run the same command with --resume to continue", file=sys.stderr)
            return 128 + signals.signum
        return 0

    def step(self, t0: float, bar: Any) -> tuple[dict, int, bool]:
        """One optimiser step on the current stage's batch (:class:`PretrainDiverged` before a non-finite one is
        taken), the curriculum advanced when the stage is learnt; ``(record, length, advanced)``."""
        args, state, model, opt = self.args, self.state, self.model, self.opt
        step = state["step"]
        length, bsz = self.stages[state["stage"]]
        max_batch = max(b for _, b in self.stages)
        seeds = [self.task.train_seed(step * max_batch + i) for i in range(bsz)]
        batch = self.task.make_batch(seeds, length, self.task_cfg)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, args)
        loss, acc = _loss_and_acc(model, batch, self.task_cfg, args.filler_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        check_step(step, loss, gn, self.ckpt_path, self.good_step)
        opt.step()
        a = float(acc)
        loss = loss.detach()
        state["ema_acc"] = a if state["stage_step"] == 0 else 0.95 * state["ema_acc"] + 0.05 * a
        state["step"] += 1
        state["stage_step"] += 1
        state["elapsed_s"] = time.time() - t0
        rec = {"step": state["step"], "L": length, "loss": round(float(loss), 4), "acc": round(a, 4),
               "ema": round(state["ema_acc"], 4), "gn": round(float(gn), 3),
               "t": round(state["elapsed_s"], 1)}
        if bar is not None:
            bar.set_postfix(L=length, loss=f"{float(loss):.3f}", acc=f"{state['ema_acc']:.3f}")
            bar.update(1)
        advanced = False
        if (state["stage"] + 1 < len(self.stages) and state["stage_step"] >= args.min_stage_steps
                and state["ema_acc"] >= args.advance_acc):
            state["stage"] += 1
            state["stage_step"] = 0
            advanced = True
            rec["advance_to"] = self.stages[state["stage"]][0]
        return rec, length, advanced

    def evaluate(self, rec: dict, length: int, done: bool, bar: Any) -> None:
        """The test accuracy at the current length (and at ``L_train`` every fifth evaluation or at the end) into
        ``rec``; the best model of each length (``model_L<length>``) and at ``L_train`` (``model``) saved."""
        args, state, model, L_train = self.args, self.state, self.model, self.L_train
        self.finite_weights()  # the models below are saved from these weights
        acc_cur = evaluate(model, length, n=args.eval_n, task_cfg=self.task_cfg, task=self.task)
        rec["test_acc_cur"] = round(acc_cur, 4)
        best_len = state.setdefault("best_by_length", {})
        if acc_cur > best_len.get(str(length), -1.0):
            best_len[str(length)] = acc_cur
            _save_model(model, self.out / f"model_L{length}", {"step": state["step"], "length": length,
                                                               "test_acc": acc_cur, "elapsed_s": state["elapsed_s"],
                                                               "args": asdict(args)})
        if length == L_train:
            acc_tr = acc_cur
        elif state["step"] % (args.eval_every * 5) == 0 or done:
            acc_tr = evaluate(model, L_train, n=args.eval_n, task_cfg=self.task_cfg, task=self.task)
        else:
            acc_tr = None
        if acc_tr is not None:
            rec["test_acc_Ltrain"] = round(acc_tr, 4)
            if acc_tr > state["best_acc"]:
                state["best_acc"] = acc_tr
                _save_model(model, self.out / "model", {"step": state["step"], "L_train": L_train,
                                                        "test_acc_Ltrain": acc_tr, "elapsed_s": state["elapsed_s"],
                                                        "args": asdict(args)})
                rec["saved"] = True
        state["history"].append(rec)
        msg = json.dumps(rec)
        (bar.write(msg) if bar is not None else print(msg, flush=True))
        sys.stdout.flush()
