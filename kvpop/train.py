"""A KVpop training loop: the model distils from its frozen original, the scorers learn ``L_score``.

:func:`train` runs optimiser steps over a re-iterable of token batches on a *patched* model:

* per micro-batch: the teacher's top-``k`` logits (no grad), the patched student's forward (sparse
  attention with the scorer's mask; every layer records its ``L_score`` terms), then
  ``loss = KL_topk(teacher || student) + score_weight * L_score``, divided by ``grad_accum``;
  the two terms touch disjoint parameters (scorer inputs are detached), so one backward serves both;
* every ``grad_accum`` micro-batches: gradient clipping (model and scorers separately), one AdamW step
  with two parameter groups (``lr_model`` for the model, ``lr_scorer`` for scorers and decays; no weight
  decay on the decays), a linear warm-up of ``warmup_steps``;
* a tqdm bar with ``kl``, ``score``, the scorer's decision accuracy and the gamma range;
* checkpoints every ``checkpoint_every`` steps (and at the end) into ``checkpoint_dir``:
  ``last.pt`` (model and scorer state, optimiser, scheduler, step, micro-batches consumed, RNG states)
  written to a temporary file and renamed, plus ``scorers.safetensors`` (``kvpop.save_scorers``).
  ``resume=True`` loads ``last.pt`` and fast-forwards the data to where it stopped, so a resumed
  run repeats the next step of the uninterrupted run exactly (tests/test_train.py).

Several processes (``torchrun``): when ``torch.distributed`` is initialised with more than one rank,
the model is wrapped in ``DistributedDataParallel`` (``find_unused_parameters=True``: a forward with
no eviction decision leaves the scorers unused), rank ``r`` takes the micro-batches ``r, r + W, ...``
of ``data``, gradients are averaged over the ranks, the logged losses are averaged too, and rank 0
alone writes checkpoints and draws the progress bar.  With ``balance=False`` in the ``KVpopConfig``
two ranks compute exactly the step of one process on both batches (tests/test_train.py, gloo on the
CPU); with class balancing each rank balances its own decisions.  FSDP is not wired here.

``activation_checkpointing=True`` turns on transformers' non-reentrant activation checkpointing
(see ``kvpop.patch`` for why the reentrant form cannot work).

The teacher must hold the *original* weights: by default ``train`` makes it with
``kvpop.make_teacher(model)`` before loading a checkpoint, i.e. from the weights the model has when
``train`` is called -- call it on the original model, also when resuming.  Pass ``teacher=`` to reuse
one (e.g. a teacher on another device).  ``train_model=False`` freezes the model and trains the
scorers only (then the teacher is not needed and no KL is computed).
"""
from __future__ import annotations

import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from .checkpoint import save_scorers
from .loss import distill_loss, score_loss, score_stats, teacher_topk
from .patch import get_config, is_patched, make_teacher

__all__ = ["TrainConfig", "train"]


@dataclass
class TrainConfig:
    """Options of :func:`train` (steps count optimiser steps, each of ``grad_accum`` micro-batches)."""

    steps: int = 100
    lr_model: float = 1e-5
    lr_scorer: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    top_k: int = 256
    score_weight: float = 1.0
    train_model: bool = True
    activation_checkpointing: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    progress: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("warmup_steps", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every > 0 needs checkpoint_dir")


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


def _rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class _Step(nn.Module):
    """One student forward returning ``(logits, L_score, stats)``: under DDP the score loss must be an
    output of the wrapped forward, or DDP takes the scorers for unused parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor):
        out = self.model(ids, use_cache=False)
        stats = score_stats(self.model)
        ls = score_loss(self.model)
        return out.logits, ls.to(out.logits.device), stats


def train(model: nn.Module, data: Iterable, config: TrainConfig | None = None, *, teacher: nn.Module | None = None,
          resume: bool = False, **overrides: Any) -> list[dict[str, float]]:
    """Train a patched Qwen3 ``model`` in place; returns one dict of losses/statistics per optimiser step.

    Args:
        model: a model patched by ``kvpop.patch`` (its ``KVpopConfig`` decides the mask and the loss).
        data: a re-iterable (list, DataLoader) of ``[B, S]`` token-id tensors or dicts with
            ``input_ids``; cycled over as long as needed.  Rows of one batch have one length.
        config: a :class:`TrainConfig`; ``**overrides`` replace its fields.
        teacher: the frozen dense teacher; default ``kvpop.make_teacher(model)`` (see the module docstring).
        resume: continue from ``checkpoint_dir/last.pt`` when it exists.
    """
    if not is_patched(model):
        raise ValueError("train needs a patched model: call kvpop.patch(model, ...) first")
    cfg = config or TrainConfig()
    if overrides:
        cfg = TrainConfig(**{**asdict(cfg), **overrides})
    kv_cfg = get_config(model)
    torch.manual_seed(cfg.seed)
    rank, world = _dist()
    if cfg.train_model and teacher is None:
        teacher = make_teacher(model)
    if cfg.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    scorer_params = [(n, p) for n, p in model.named_parameters() if ".kvpop." in n or n.startswith("kvpop.")]
    scorer_ids = {id(p) for _, p in scorer_params}
    model_params = [p for p in model.parameters() if id(p) not in scorer_ids]
    for p in model_params:
        p.requires_grad_(cfg.train_model)
    for _, p in scorer_params:
        p.requires_grad_(True)
    groups = [
        {"params": [p for n, p in scorer_params if not n.endswith("decay_logit")], "lr": cfg.lr_scorer,
         "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in scorer_params if n.endswith("decay_logit")], "lr": cfg.lr_scorer,
         "weight_decay": 0.0},
    ]
    if cfg.train_model:
        groups.append({"params": model_params, "lr": cfg.lr_model, "weight_decay": cfg.weight_decay})
    opt = torch.optim.AdamW(groups, betas=cfg.betas)
    warm = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)

    step, consumed = 0, 0
    ckpt_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    last = ckpt_dir / "last.pt" if ckpt_dir else None
    if resume and last is not None and last.exists():
        ck = torch.load(last, map_location="cpu", weights_only=False)
        if ck.get("kvpop_config") != kv_cfg.to_json():
            raise ValueError(f"checkpoint {last} was written with another KVpopConfig: {ck.get('kvpop_config')}")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        step, consumed = ck["step"], ck["consumed"]
        _set_rng_state(ck["rng"])

    runner: nn.Module = _Step(model)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev0 = next(model.parameters()).device
        runner = DDP(runner, device_ids=[dev0.index] if dev0.type == "cuda" else None,
                     find_unused_parameters=True)

    def save() -> None:
        if rank != 0:
            _barrier(world)
            return
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                      "step": step, "consumed": consumed, "rng": _rng_state(), "kvpop_config": kv_cfg.to_json(),
                      "train_config": asdict(cfg)}, last)
        save_scorers(model, ckpt_dir / "scorers.safetensors")
        _barrier(world)

    history: list[dict[str, float]] = []
    if step >= cfg.steps:
        return history
    model.train()
    batches = _micro_batches(data, consumed, rank, world)
    bar = None
    if cfg.progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="kvpop train", dynamic_ncols=True)
    try:
        while step < cfg.steps:
            kl_acc = ls_acc = 0.0
            stats_acc: dict[str, float] = {}
            for _ in range(cfg.grad_accum):
                ids = _input_ids(next(batches))
                consumed += 1
                dev = next(model.parameters()).device
                ids = ids.to(dev)
                topk = None
                if cfg.train_model:
                    with torch.no_grad():
                        t_dev = next(teacher.parameters()).device
                        vals, idx = teacher_topk(teacher(ids.to(t_dev)).logits, cfg.top_k)
                        topk = (vals.to(dev), idx.to(dev))
                logits, ls, st = runner(ids)
                loss = cfg.score_weight * ls.to(logits.device)
                kl = torch.zeros(())
                if cfg.train_model:
                    kl = distill_loss(logits, topk, top_k=cfg.top_k)
                    loss = loss + kl
                if loss.requires_grad:
                    (loss / cfg.grad_accum).backward()
                kl_acc += float(kl.detach()) / cfg.grad_accum
                ls_acc += float(ls.detach()) / cfg.grad_accum
                for key in ("accuracy", "keep_frac"):
                    stats_acc[key] = stats_acc.get(key, 0.0) + st[key] / cfg.grad_accum
                stats_acc["gamma_min"], stats_acc["gamma_max"] = st["gamma_min"], st["gamma_max"]
                del logits, loss
            gnorm = {}
            if cfg.max_grad_norm is not None:
                gnorm["gnorm_scorer"] = float(torch.nn.utils.clip_grad_norm_([p for _, p in scorer_params],
                                                                             cfg.max_grad_norm))
                if cfg.train_model:
                    gnorm["gnorm_model"] = float(torch.nn.utils.clip_grad_norm_(model_params, cfg.max_grad_norm))
            if world > 1:
                kl_acc, ls_acc = _mean_over_ranks([kl_acc, ls_acc], world, dev)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            rec = {"step": step, "kl": kl_acc, "score": ls_acc, **stats_acc, **gnorm}
            history.append(rec)
            if bar is not None:
                bar.update(1)
                acc = rec.get("accuracy", math.nan)
                bar.set_postfix(kl=f"{kl_acc:.4f}", score=f"{ls_acc:.4f}", acc=f"{acc:.3f}",
                                gamma=f"{rec['gamma_min']:.6f}..{rec['gamma_max']:.6f}")
            if ckpt_dir is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                save()
        if ckpt_dir is not None:
            save()
    finally:
        if bar is not None:
            bar.close()
    return history
