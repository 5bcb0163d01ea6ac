"""A KVpop training loop: the model distils from its frozen original, the method's layers learn their loss.

:func:`train` runs optimiser steps over a re-iterable of token batches on a patched model, driven by a
method object (:mod:`kvpop.training.methods`; no branch on the method in the loop): fused top-k
distillation, two AdamW groups, progress, atomic checkpoints with exact resume, SIGINT/SIGTERM handled
after the step in flight, DDP / FSDP2 over ranks, bf16 autocast.  The contract of each of these is
docs/DESIGN.md section 10, "The training loop".
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvpop.core.distill import next_token_nll
from kvpop.core.loss import TeacherTopK, fused_distill_loss, fused_output_head, fused_teacher_topk

from .methods import METHODS, TrainingMethod, method_for
from .runstate import (
    CheckpointError,
    RunMismatch,
    StopSignals,
    TrainingDiverged,
    TrainingInterrupted,
    append_jsonl,
    atomic_save,
    check_progress,
    check_state_dict,
    clear_model_step,
    load_checkpoint,
    non_finite,
    non_finite_parameters,
    restore_rng_state,
    rng_state,
    write_jsonl,
    write_model_step,
)

__all__ = ["TrainConfig", "train", "save_model", "DIST_MODES", "TrainingInterrupted", "TrainingDiverged",
           "LEARNING_RATES", "learning_rates"]

DIST_MODES = ("ddp", "fsdp")
LEARNING_RATES = {name: dict(cls.learning_rates) for name, cls in METHODS.items()}
"""Each registered method's default learning rates (``TrainConfig``'s ``None``), from its
``TrainingMethod.learning_rates`` (DMS's gates need a large one: ``DMSMethod``)."""


def learning_rates(config: TrainConfig, method: str | TrainingMethod) -> tuple[float, float]:
    """``(lr_model, lr_scorer)`` of ``config`` for ``method`` (a method object, or the name of a registered
    one: ``"kvpop"``, ``"dms"``), a ``None`` field taking the method's default."""
    if isinstance(method, TrainingMethod):
        d = method.learning_rates
    elif method in METHODS:
        d = METHODS[method].learning_rates
    else:
        raise ValueError(f"unknown method {method!r}; allowed: {list(METHODS)}")
    return (d["lr_model"] if config.lr_model is None else config.lr_model,
            d["lr_scorer"] if config.lr_scorer is None else config.lr_scorer)


@dataclass
class TrainConfig:
    """Options of :func:`train` (steps count optimiser steps, each of ``grad_accum`` micro-batches).

    ``dist`` (``"ddp"`` or ``"fsdp"``) picks the wrapping when ``torch.distributed`` runs several ranks;
    ``bf16`` turns on bf16 autocast (CUDA only); see the module docstring for both.  ``loss_chunk``:
    positions per chunk of the fused LM head + KL (default: a ``[chunk, V]`` float32 buffer of ~128 MiB).
    ``lr_model`` / ``lr_scorer`` (the scorers and decays, or DMS's gates): ``None`` is the method's default
    (:data:`LEARNING_RATES`: 1e-5 / 1e-3 for KVpop, 1e-5 / 5e-2 for DMS).  ``data_fingerprint``: what
    identifies the training data (``kvpop train`` stores :func:`kvpop.training.data.data_fingerprint` of
    ``--data``); it is saved in the checkpoint, and a resume with another one is refused.
    ``model_fingerprint``: the same for the model the run starts from (and the teacher is made of),
    ``{file name: fingerprint}`` (``kvpop train`` stores :func:`kvpop.training.data.model_fingerprint` of
    ``--model``); a resume where a file's differs is refused, naming the file.
    """

    steps: int = 100
    lr_model: float | None = None
    lr_scorer: float | None = None
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    top_k: int = 256
    score_weight: float = 1.0
    lm_weight: float = 0.0
    train_model: bool = True
    activation_checkpointing: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    progress: bool = True
    progress_total: int | None = None  # the bar's total when this call trains one segment of a longer run
    seed: int = 0
    dist: str = "ddp"
    bf16: bool = False
    loss_chunk: int | None = None
    data_fingerprint: str | None = None
    model_fingerprint: dict[str, str] | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("warmup_steps", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.loss_chunk is not None and (isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int)
                                            or self.loss_chunk < 1):
            raise ValueError(f"loss_chunk must be an int >= 1 or None (automatic), got {self.loss_chunk!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every > 0 needs checkpoint_dir")
        if self.lm_weight and not self.train_model:
            raise ValueError(f"lm_weight {self.lm_weight!r} needs train_model=True: the next-token NLL trains the "
                             f"model's weights only (the scorers' inputs are detached)")
        if self.dist not in DIST_MODES:
            raise ValueError(f"dist must be one of {list(DIST_MODES)}, got {self.dist!r}")
        for name, low in (("lr_model", "> 0"), ("lr_scorer", "> 0"), ("weight_decay", ">= 0"),
                          ("score_weight", ">= 0"), ("lm_weight", ">= 0")):
            v = getattr(self, name)
            if v is None and name.startswith("lr_"):
                continue  # the method's default
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
                v > 0 if low == "> 0" else v >= 0)
            if not ok:
                raise ValueError(f"{name} must be a finite number {low}, got {v!r}")
        g = self.max_grad_norm
        if g is not None and not (isinstance(g, (int, float)) and not isinstance(g, bool) and math.isfinite(g)
                                  and g > 0):
            raise ValueError(f"max_grad_norm must be a finite number > 0 or None (no clipping), got {g!r}")
        if not (len(self.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        mf = self.model_fingerprint
        if mf is not None and not (isinstance(mf, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                               for k, v in mf.items())):
            raise ValueError(f"model_fingerprint must be None or a dict of file name -> fingerprint (str), got "
                             f"{str(mf)[:100]}")


def _input_ids(batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        batch = batch["input_ids"]
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2:
        raise ValueError(f"a batch must be a [B, S] tensor of token ids (or a dict with 'input_ids'), got "
                         f"{type(batch).__name__}{tuple(batch.shape) if isinstance(batch, torch.Tensor) else ''}")
    return batch


def _micro_batches(data: Iterable, skip: int, rank: int = 0, world: int = 1):
    """Cycle over ``data`` (re-iterable) forever; this rank's share is every ``world``-th item from
    ``rank``; the first ``skip`` items of that share are skipped (resume)."""
    own = idx = 0
    while True:
        own_start = own
        for batch in data:
            if idx % world == rank:
                if own >= skip:
                    yield batch
                own += 1
            idx += 1
        if own == own_start:
            raise ValueError(f"the training data yielded no batch for rank {rank} of {world} "
                             f"(it needs at least {world} batches)")


def _dist() -> tuple[int, int]:
    """``(rank, world_size)`` of an initialised process group, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mean_over_ranks(values: list[float], world: int, device: torch.device) -> list[float]:
    if world == 1:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / world).tolist()


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


class _Step(nn.Module):
    """One student forward returning ``(kl, the method's auxiliary loss, stats)``.

    The KL is computed where the model applies its LM head (:func:`kvpop.core.loss.fused_output_head`):
    chunked, fused with the head, never holding ``[S, V]`` logits.  With ``lm_weight > 0`` the same head also
    gives the next-token NLL of ``ids`` (:func:`next_token_nll`, another chunked pass) and the KL returned is
    ``kl + lm_weight * nll``; ``stats["kl"]`` and ``stats["nll"]`` then hold the two terms.  Under DDP both
    losses must be outputs of the wrapped forward (or DDP takes the scorers and the head for unused
    parameters); under FSDP2 the head's weight is unsharded only inside the root module's forward.
    """

    def __init__(self, model: nn.Module, method: TrainingMethod, chunk_size: int | None = None,
                 lm_weight: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.method = method
        self.chunk_size = chunk_size
        self.lm_weight = lm_weight

    def forward(self, ids: torch.Tensor, teacher: TeacherTopK | None = None):
        lm = self.lm_weight > 0 and teacher is not None
        if teacher is None:  # scorers only: no head at all
            fn = lambda h, w, b: h.new_zeros((), dtype=torch.float32)  # noqa: E731
        elif lm:
            fn = lambda h, w, b: (fused_distill_loss(h, w, teacher, bias=b, chunk_size=self.chunk_size),  # noqa: E731
                                  next_token_nll(h, w, ids, bias=b, chunk_size=self.chunk_size))
        else:
            fn = lambda h, w, b: fused_distill_loss(h, w, teacher, bias=b, chunk_size=self.chunk_size)  # noqa: E731
        with fused_output_head(self.model, fn) as res:
            self.model(ids, use_cache=False)
        ls, stats = self.method.aux_loss(self.model)
        if not lm:
            kl = res["value"]
            return kl, ls.to(kl.device), stats
        kl, nll = res["value"]
        stats = {**stats, "kl": float(kl.detach()), "nll": float(nll.detach())}
        return kl + self.lm_weight * nll, ls.to(kl.device), stats


def teacher_step(teacher: nn.Module, ids: torch.Tensor, top_k: int | None, *,
                 chunk_size: int | None = None) -> TeacherTopK | None:
    """The teacher's :class:`~kvpop.core.loss.TeacherTopK` of ``ids`` (no grad, no ``[S, V]`` logits);
    ``top_k=None``: the forward alone (for :func:`kvpop.teacher_targets`), no LM head, returns ``None``."""
    if top_k is None:
        fn = lambda h, w, b: None  # noqa: E731
    else:
        fn = lambda h, w, b: fused_teacher_topk(h, w, top_k, bias=b, chunk_size=chunk_size)  # noqa: E731
    with torch.no_grad(), fused_output_head(teacher, fn) as res:
        teacher(ids, use_cache=False)
    return res["value"]


def _is_method_param(name: str) -> bool:
    """A parameter of any training method's layers (KVpop's scorers, DMS's gates, ...)."""
    return any(m.owns(name) for m in METHODS.values())


def _split_params(model: nn.Module, method: TrainingMethod
                  ) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Parameter]]:
    """``(the method's (name, parameter) pairs, the model's parameters)``."""
    own = [(n, p) for n, p in model.named_parameters() if method.owns(n)]
    ids = {id(p) for _, p in own}
    return own, [p for p in model.parameters() if id(p) not in ids]


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers`` for Qwen3)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"FSDP: cannot find the decoder layers of {type(model).__name__} (expected .model.layers)")
    return list(layers)


def _broadcast_from_rank0(model: nn.Module) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def _fully_shard(model: nn.Module, ignored: set[nn.Parameter] | None) -> None:
    """FSDP2: one unit per decoder layer, then the root (in place), on a 1-D mesh over all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = next(model.parameters()).device
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    kw = {"mesh": mesh}
    if ignored:
        kw["ignored_params"] = ignored
    for layer in _decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def _average_grads(params: list[nn.Parameter], world: int) -> None:
    """Average the gradients of replicated (unsharded) parameters over the ranks; a parameter whose
    gradient is ``None`` on every rank keeps ``None`` (as under DDP with unused parameters)."""
    import torch.distributed as dist

    if not params:
        return
    dev = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params])
    dist.all_reduce(has)
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for p, h in zip(params, has.tolist()):
        n = p.numel()
        if h > 0:
            g = flat[off:off + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        off += n


def _full_norm(norm: torch.Tensor) -> float:
    if hasattr(norm, "full_tensor"):  # a DTensor (FSDP2 gradients)
        norm = norm.full_tensor()
    return float(norm)


def _full_state_dicts(model: nn.Module, opt: torch.optim.Optimizer | None = None):
    """Full (unsharded) model and optimiser state dicts on rank 0 (collective; other ranks get ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, opt, options=opts) if opt is not None else None
    return msd, osd


def save_model(model: nn.Module, path: str | os.PathLike, *, include_scorers: bool = False,
               step: int | None = None) -> None:
    """Write a (possibly FSDP2-sharded, patched) model with ``save_pretrained`` to the folder ``path``.

    The scorer tensors are left out unless ``include_scorers`` (save them with ``kvpop.save_scorers``),
    so ``from_pretrained(path)`` gives a plain transformers model.  ``step``: the training step of the
    weights, stamped in ``path/kvpop_step.json`` (:data:`kvpop.training.runstate.MODEL_STEP_FILE`; removed
    before the weights are written, also without ``step``, and written after them, so a write that did not
    finish leaves none).
    Collective under FSDP2 (every rank must call it); with several ranks only rank 0 writes.
    """
    rank, world = _dist()
    if Path(path).exists() and not Path(path).is_dir():  # save_pretrained would only log it and write nothing
        raise ValueError(f"cannot save the model to {path}: it exists and is not a directory")
    fsdp = _is_fsdp(model)
    sd = _full_state_dicts(model)[0] if fsdp else None
    if rank == 0:
        if Path(path).is_dir():  # a stamp of earlier weights never outlives them
            clear_model_step(path)
        if sd is None:
            sd = model.state_dict()
        if not include_scorers:
            sd = {k: v for k, v in sd.items() if not _is_method_param(k)}
        sd = {k: v.detach().cpu() for k, v in sd.items()}
        if fsdp and getattr(model.config, "tie_word_embeddings", False):
            # the gathered copies no longer share storage: re-tie them so save_pretrained drops the output one
            names = {id(mod): n for n, mod in model.named_modules()}
            emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()
            if emb_in is not None and emb_out is not None:
                k_in, k_out = names[id(emb_in)] + ".weight", names[id(emb_out)] + ".weight"
                if k_in in sd and k_out in sd:
                    sd[k_out] = sd[k_in]
        model.save_pretrained(str(path), state_dict=sd)
        if fsdp:  # save_pretrained records the class name, which FSDP2 prefixed with "FSDP"
            import json

            cfg_path = Path(path) / "config.json"
            conf = json.loads(cfg_path.read_text())
            conf["architectures"] = [a[4:] if a.startswith("FSDP") else a for a in conf.get("architectures") or []]
            tmp = cfg_path.with_name("config.json.tmp")
            tmp.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, cfg_path)
        if step is not None:
            write_model_step(path, step)
    _barrier(world)


@dataclass
class _Run:
    """What the phases of one :func:`train` call share: the model and its method, the settings, the
    process group, the optimiser, the checkpoint directory and the progress (``step``, ``consumed``
    micro-batches, ``past``: the history the checkpoint brought, ``history``: this call's steps,
    ``good_step``: the last finite checkpoint)."""

    model: nn.Module
    method: TrainingMethod
    cfg: TrainConfig
    rank: int
    world: int
    fsdp: bool
    dev: torch.device
    teacher: nn.Module | None
    need_targets: bool
    scorer_params: list
    model_params: list
    opt: torch.optim.Optimizer
    sched: Any
    ckpt_dir: Path | None
    step: int = 0
    consumed: int = 0
    past: list = field(default_factory=list)
    history: list = field(default_factory=list)
    good_step: int | None = None
    hist_path: Path | None = None

    @property
    def last(self) -> Path | None:
        return self.ckpt_dir / "last.pt" if self.ckpt_dir else None

    def save(self) -> None:
        """The checkpoint (``last.pt``) and the method's layer file of this step; never of diverged weights."""
        bad = non_finite_parameters(self.model, self.world)
        if bad:
            raise TrainingDiverged(self.step, f"the weights ({', '.join(bad)})", self.last, self.good_step)
        self.good_step = self.step
        msd = osd = None
        if self.fsdp:
            msd, osd = _full_state_dicts(self.model, self.opt)
        if self.rank != 0:
            _barrier(self.world)
            return
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = {"model": msd if self.fsdp else self.model.state_dict(), "scheduler": self.sched.state_dict(),
                 "step": self.step, "consumed": self.consumed, "rng": rng_state(),
                 "kvpop_config": self.method.config_json(), "train_config": asdict(self.cfg),
                 "world_size": self.world, "history": self.past + self.history}
        state["optimizer_fqn" if self.fsdp else "optimizer"] = osd if self.fsdp else self.opt.state_dict()
        state.update(self.method.run_state())
        atomic_save(state, self.last)
        self.method.save(self.model, self.ckpt_dir, step=self.step)
        _barrier(self.world)


def train(model: nn.Module, data: Iterable, config: TrainConfig | None = None, *, teacher: nn.Module | None = None,
          resume: bool = False, method: TrainingMethod | None = None, **overrides: Any) -> list[dict[str, float]]:
    """Train a patched Qwen3 ``model`` in place; returns one dict of losses/statistics per optimiser step.

    Args:
        model: a model patched by ``kvpop.patch`` (its ``KVpopConfig`` decides the mask and the loss) or by
            another method (``kvpop.baselines.dms.patch_dms``); with ``method=`` also an unpatched one.
        data: a re-iterable (list, DataLoader) of ``[B, S]`` token-id tensors or dicts with
            ``input_ids``; cycled over as long as needed.  Rows of one batch have one length.
        config: a :class:`TrainConfig`; ``**overrides`` replace its fields.
        teacher: the frozen dense teacher; default ``kvpop.make_teacher(model)`` (see the module docstring).
        resume: continue from ``checkpoint_dir/last.pt`` when it exists.  With no step left the checkpoint's
            weights are loaded and its method layer file (the scorers) is written anew from it, stamped with
            its step: a crash between ``last.pt`` and that file left the file of an earlier step.
        method: the :class:`~kvpop.training.methods.TrainingMethod` (default: the one the model is patched
            with, :func:`~kvpop.training.methods.method_for`); it attaches itself to an unpatched model.

    With ``dist="fsdp"`` and several ranks the model is sharded in place (FSDP2) and stays so.

    The phases: the method and the settings (:func:`_bind`, :func:`_settings`), the distributed setup and
    the optimiser (:func:`_setup`), the resume (:func:`_resume`), the history file (:func:`_open_history`),
    then the steps (:func:`_loop`: each :func:`_take_step`, the checkpoints and the stop signals).
    """
    method = _bind(model, method)
    if isinstance(data, Iterator) or not isinstance(data, Iterable):
        raise TypeError(f"data must be re-iterable (a list, a DataLoader, ...): it is cycled over and, on resume, "
                        f"fast-forwarded; got a {type(data).__name__}, which can be iterated only once (or not at "
                        f"all). Wrap it in list(...).")
    cfg = _settings(config, overrides, method)
    torch.manual_seed(cfg.seed)
    run = _setup(model, method, cfg, teacher)
    if resume:
        _resume(run)
    runner = _runner(run)
    _open_history(run)
    if run.step >= cfg.steps:
        if run.good_step is not None:  # a resume with nothing to do: every output of the checkpoint, anew
            if run.rank == 0:
                method.save(model, run.ckpt_dir, step=run.step)
            _barrier(run.world)
        return run.history
    _loop(run, runner, data)
    return run.history


def _bind(model: nn.Module, method: TrainingMethod | None) -> TrainingMethod:
    """The training method bound to ``model`` (default: the one it is patched with)."""
    if method is not None and not isinstance(method, TrainingMethod):
        raise TypeError(f"method must be a kvpop.training.methods.TrainingMethod or None, got "
                        f"{type(method).__name__}")
    return method_for(model) if method is None else method.bind(model)


def _settings(config: TrainConfig | None, overrides: dict, method: TrainingMethod) -> TrainConfig:
    """``config`` with ``overrides`` and the method's learning rates filled in."""
    cfg = config or TrainConfig()
    if overrides:
        cfg = TrainConfig(**{**asdict(cfg), **overrides})
    lr_model, lr_scorer = learning_rates(cfg, method)
    return TrainConfig(**{**asdict(cfg), "lr_model": lr_model, "lr_scorer": lr_scorer})


def _setup(model: nn.Module, method: TrainingMethod, cfg: TrainConfig, teacher: nn.Module | None) -> _Run:
    """The distributed setup: the process group's rank and size, the method started, the teacher, which
    parameters train, the FSDP2 sharding, and the optimiser with its warm-up schedule."""
    rank, world = _dist()
    method.start(model, cfg.seed, next(model.parameters()).device)
    fsdp = world > 1 and cfg.dist == "fsdp"
    dev = next(model.parameters()).device
    if cfg.bf16 and dev.type != "cuda":
        raise ValueError(f"bf16=True needs the model on a CUDA device (it is on {dev}); train in float32 on the CPU")
    need_targets = method.needs_targets()
    if (cfg.train_model or need_targets) and teacher is None:
        teacher = method.make_teacher(model, dtype=torch.bfloat16 if cfg.bf16 else None)
    if cfg.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    scorer_params, model_params = _split_params(model, method)
    for p in model_params:
        p.requires_grad_(cfg.train_model)
    for _, p in scorer_params:
        p.requires_grad_(True)
    if fsdp:
        scorer_params, model_params = _shard(model, method, teacher, scorer_params, dev)
    groups = method.param_groups(scorer_params, cfg)
    if cfg.train_model:
        groups.append({"params": model_params, "lr": cfg.lr_model, "weight_decay": cfg.weight_decay})
    opt = torch.optim.AdamW(groups, betas=cfg.betas)
    warm = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return _Run(model, method, cfg, rank, world, fsdp, dev, teacher, need_targets, scorer_params, model_params,
                opt, sched, Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None)


def _shard(model: nn.Module, method: TrainingMethod, teacher: nn.Module | None, scorer_params: list,
           dev: torch.device) -> tuple[list, list]:
    """FSDP2: the model (its scorers left whole) and a teacher on the same device type sharded in place, the
    weights first broadcast from rank 0; the parameters split anew (sharding replaced them)."""
    if _is_fsdp(model):
        raise ValueError("the model is already sharded with FSDP2; pass the unsharded patched model")
    _broadcast_from_rank0(model)
    _fully_shard(model, {p for _, p in scorer_params})
    if teacher is not None and not _is_fsdp(teacher) and next(teacher.parameters()).device.type == dev.type:
        _broadcast_from_rank0(teacher)
        _fully_shard(teacher, None)
    return _split_params(model, method)


def _resume(run: _Run) -> None:
    """The resume: ``last.pt`` (when there is one) read into the model, optimiser, schedule, random state and
    method state; the run continues from its step and its data position."""
    last = run.last
    if last is None or not last.exists():
        return
    if run.fsdp:
        run.step, run.consumed, run.past = _load_fsdp_checkpoint(run.model, run.opt, run.sched, last, run.method,
                                                                 run.rank, run.cfg)
    else:
        ck = load_checkpoint(last)
        run.step, run.consumed = _check_checkpoint(ck, last, run.method, run.cfg)
        if "optimizer" not in ck:
            raise CheckpointError(f"checkpoint {last} was written by an FSDP run (its optimiser state is keyed by "
                                  f"parameter names): resume it with dist='fsdp' (--dist fsdp)")
        check_state_dict(ck.get("model"), run.model.state_dict(), last)
        try:
            run.opt.load_state_dict(ck["optimizer"])
            run.sched.load_state_dict(ck["scheduler"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {last}: its optimiser or scheduler state does not fit this run "
                                  f"({type(e).__name__}: {str(e)[:200]})") from None
        run.model.load_state_dict(ck["model"])
        restore_rng_state(ck.get("rng"), last)
        run.method.load_run_state(ck, last)
        run.past = list(ck.get("history", []))
    run.good_step = run.step  # the last finite checkpoint


def _runner(run: _Run) -> nn.Module:
    """The module one micro-batch runs through (the model's forward and the method's losses); DDP-wrapped
    with several ranks and no FSDP."""
    runner: nn.Module = _Step(run.model, run.method, run.cfg.loss_chunk, run.cfg.lm_weight)
    if run.world > 1 and not run.fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(runner, device_ids=[run.dev.index] if run.dev.type == "cuda" else None,
                     find_unused_parameters=True)
    return runner


def _open_history(run: _Run) -> None:
    """``history.jsonl`` (rank 0, with a checkpoint directory): what the checkpoint finished, and no line of a
    step it did not."""
    if run.ckpt_dir is not None and run.rank == 0:
        run.hist_path = run.ckpt_dir / "history.jsonl"
        run.ckpt_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(run.hist_path, run.past)


def _autocast(cfg: TrainConfig):
    return torch.autocast("cuda", dtype=torch.bfloat16) if cfg.bf16 else contextlib.nullcontext()


def _loop(run: _Run, runner: nn.Module, data: Iterable) -> None:
    """The steps up to ``cfg.steps``: each taken, recorded and reported; a checkpoint every
    ``checkpoint_every`` steps and at the end; the stop signals (SIGINT, SIGTERM) honoured after a step."""
    cfg, model, method = run.cfg, run.model, run.method
    model.train()
    batches = _micro_batches(data, run.consumed, run.rank, run.world)
    bar = None
    if cfg.progress and run.rank == 0:
        from kvpop.progress import progress

        bar = progress(max(cfg.steps, cfg.progress_total or 0), initial=run.step, desc="kvpop train")
    noted = False
    stop = StopSignals(enabled=run.ckpt_dir is not None, name="kvpop train").install()
    method.enter(model)
    try:
        while run.step < cfg.steps:
            rec, length = _take_step(run, runner, batches)
            if bar is not None:  # the step's figures first: a line-per-N-steps report prints them at update
                bar.set_postfix(**method.postfix(rec))
                bar.update(1)
            if run.rank == 0 and not noted:
                note = method.note(rec, length)
                if note is not None:  # once per run: a step that needs explaining (e.g. nothing to rank)
                    noted = True
                    print(note, file=sys.stderr, flush=True)
            _checkpoint_or_stop(run, stop)
        if run.ckpt_dir is not None:
            run.save()
    finally:
        stop.restore()
        method.leave(model)
        if bar is not None:
            bar.close()


def _checkpoint_or_stop(run: _Run, stop: StopSignals) -> None:
    """After a step: the checkpoint when one is due; on a stop signal, a checkpoint (when not just written)
    and :class:`TrainingInterrupted`."""
    cfg = run.cfg
    saved = bool(run.ckpt_dir is not None and cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0)
    if saved:
        run.save()
    signum = stop.requested(run.world, run.dev) if run.ckpt_dir is not None else None
    if signum is not None:
        if not saved:
            run.save()
        raise TrainingInterrupted(signum, run.step, run.last)


def _micro_step(run: _Run, runner: nn.Module, ids: torch.Tensor) -> tuple[float, float, dict]:
    """One micro-batch: the teacher's targets, the forward, the loss's backward (scaled by the accumulation);
    ``(kl, score, stats)`` as floats."""
    cfg, model, method, teacher = run.cfg, run.model, run.method, run.teacher
    topk = targets = None
    if cfg.train_model or run.need_targets:
        t_dev = next(teacher.parameters()).device
        with _autocast(cfg), method.teacher_forward(teacher) as targets:
            if cfg.train_model:
                topk = teacher_step(teacher, ids.to(t_dev), cfg.top_k, chunk_size=cfg.loss_chunk)
                topk = topk.to(run.dev)
            else:
                teacher_step(teacher, ids.to(t_dev), None)
    method.before_forward(model, run.step + 1, targets)  # the step being taken, as in the history
    with _autocast(cfg):
        kl, ls, st = runner(ids, topk)
    loss = cfg.score_weight * ls + kl
    if loss.requires_grad:
        (loss / cfg.grad_accum).backward()
    out = float(kl.detach()), float(ls.detach()), st
    del kl, loss, topk, targets
    method.after_forward(model)
    return out


def _take_step(run: _Run, runner: nn.Module, batches) -> tuple[dict[str, float], int]:
    """One optimiser step over ``grad_accum`` micro-batches: gradients averaged and clipped, the step refused
    (:class:`TrainingDiverged`) on a non-finite loss or norm, its record appended to the history; returns the
    record and the micro-batches' length."""
    cfg = run.cfg
    kl_acc = ls_acc = 0.0
    stats_acc: dict[str, float] = {}
    for _ in range(cfg.grad_accum):
        ids = _input_ids(next(batches))
        run.consumed += 1
        ids = ids.to(run.dev)
        kl, ls, st = _micro_step(run, runner, ids)
        kl_acc += kl / cfg.grad_accum
        ls_acc += ls / cfg.grad_accum
        for key, val in st.items():  # gamma: the last value; the rest: the mean over micro-batches
            stats_acc[key] = val if key.startswith("gamma") else stats_acc.get(key, 0.0) + val / cfg.grad_accum
    if run.fsdp:
        _average_grads([p for _, p in run.scorer_params], run.world)
    gnorm = {}
    if cfg.max_grad_norm is not None:
        gnorm["gnorm_scorer"] = _full_norm(torch.nn.utils.clip_grad_norm_([p for _, p in run.scorer_params],
                                                                          cfg.max_grad_norm))
        if cfg.train_model:
            gnorm["gnorm_model"] = _full_norm(torch.nn.utils.clip_grad_norm_(run.model_params, cfg.max_grad_norm))
    if run.world > 1:
        kl_acc, ls_acc = _mean_over_ranks([kl_acc, ls_acc], run.world, run.dev)
    bad = non_finite({"kl": kl_acc, "score": ls_acc, **gnorm})  # the same on every rank
    if bad:  # the step is not taken; the last checkpoint stays
        raise TrainingDiverged(run.step + 1, f"the loss ({bad})", run.last, run.good_step)
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    run.step += 1
    # with lm_weight > 0, kl_acc is KL + lm_weight * NLL and stats_acc's "kl" and "nll" (the terms) replace it
    rec = {"step": run.step, "kl": kl_acc, "score": ls_acc, **stats_acc, **gnorm}
    run.history.append(rec)
    if run.hist_path is not None:
        append_jsonl(run.hist_path, rec)
    return rec, int(ids.shape[-1])


def _check_checkpoint(ck: dict, path: Path, method: TrainingMethod, cfg: TrainConfig) -> tuple[int, int]:
    """``(step, consumed)`` of a checkpoint this run can resume: same method config, same data (when both
    carry a fingerprint), progress that fits (:func:`kvpop.training.runstate.check_progress`)."""
    if ck.get("kvpop_config") != method.config_json():
        raise _config_mismatch(ck.get("kvpop_config"), method, path)
    saved = ck.get("train_config") if isinstance(ck.get("train_config"), dict) else {}
    then, now = saved.get("data_fingerprint"), cfg.data_fingerprint
    if then is not None and now is not None and then != now:
        raise RunMismatch(f"checkpoint {path} was trained on other data: the data file changed since (was "
                          f"{then}, now {now}); resume with the data it was trained on, or start in another "
                          f"directory", "data")
    then, now = saved.get("model_fingerprint"), cfg.model_fingerprint
    if isinstance(then, dict) and now is not None and then != now:
        changed = sorted(n for n in set(then) | set(now) if then.get(n) != now.get(n))
        said = ", ".join(n + (" (missing now)" if n not in now else " (new)" if n not in then else "")
                         for n in changed[:4]) + (" ..." if len(changed) > 4 else "")
        raise RunMismatch(f"checkpoint {path} was trained from other model files: {said} changed since the first "
                          f"run (the teacher is the model as loaded, so a resume must load the same one); restore the "
                          f"model it was trained from, or start in another directory", "model", tuple(changed))
    return check_progress(ck, path, grad_accum=cfg.grad_accum)


def _config_mismatch(saved: Any, method: TrainingMethod, path: Path) -> RunMismatch:
    """The error for a checkpoint of another method config, naming the fields that differ."""
    import json

    now = json.loads(method.config_json())
    try:
        then = json.loads(saved) if isinstance(saved, str) else None
    except (ValueError, RecursionError):
        then = None
    name = type(method.config).__name__
    if not isinstance(then, dict):
        return RunMismatch(f"checkpoint {path} was written with another method config ({name}): "
                           f"{str(saved)[:300]}", "config")
    fields = tuple(sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k)))
    said = "; ".join(f"{k} was {json.dumps(then.get(k))[:120]}, now {json.dumps(now.get(k))[:120]}"
                     for k in fields[:4]) + (" ..." if len(fields) > 4 else "")
    return RunMismatch(f"checkpoint {path} was written with another {name}: {said}", "config", fields)


def _load_fsdp_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, path: Path,
                          method: TrainingMethod, rank: int, cfg: TrainConfig) -> tuple[int, int, list]:
    """Rank 0 reads ``last.pt`` and broadcasts it into the sharded model and optimiser (collective)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    ck: dict = {}
    err = None
    if rank == 0:
        try:
            ck = load_checkpoint(path)
            _check_checkpoint(ck, path, method, cfg)
            if "optimizer_fqn" not in ck:
                raise CheckpointError(f"checkpoint {path} was written without FSDP: resume it with dist='ddp' "
                                 f"(--dist ddp) or in one process")
        except CheckpointError as e:
            err = str(e)
    keys = ("scheduler", "step", "consumed", "rng", "history")
    small = [{"err": err, **({k: ck.get(k, []) for k in keys} if err is None and rank == 0 else {})}]
    dist.broadcast_object_list(small, src=0)
    meta = small[0]
    if meta["err"]:
        raise CheckpointError(meta["err"])
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, ck.get("model", {}), options=opts)
    set_optimizer_state_dict(model, opt, ck.get("optimizer_fqn", {}), options=opts)
    sched.load_state_dict(meta["scheduler"])
    restore_rng_state(meta["rng"], path)
    return meta["step"], meta["consumed"], list(meta["history"])
