"""Joining a ``torchrun`` launch (``kvpop train``): this process's device and the process group.

Under ``torchrun`` (``WORLD_SIZE > 1``) each process joins the process group (NCCL on CUDA, gloo on the
CPU), uses ``cuda:LOCAL_RANK`` when CUDA is available, and takes every ``WORLD_SIZE``-th batch; the model
is replicated (``--dist ddp``) or sharded with FSDP2 (``--dist fsdp``, see ``kvpop.training.train``).  With
``--batch-size B`` on ``W`` processes a step sees ``W * B * --grad-accum`` sequences.
"""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

__all__ = ["setup_process", "wait_for_ranks", "finish_process"]


def setup_process(device: str | None = None) -> tuple[int, int, torch.device, bool]:
    """Choose this process's device and join the torchrun process group when ``WORLD_SIZE > 1``; returns
    ``(rank, world, device, started)`` (``started``: this call joined the group, so :func:`finish_process`
    leaves it).  ``device``: as the user named it (plain ``"cuda"``: this process's GPU); default
    ``cuda[:LOCAL_RANK]`` when CUDA is available, else the CPU.  ValueError naming ``--device`` when it
    names no device or CUDA is not there."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device:
        name = device
        try:
            dev = torch.device(name)
        except RuntimeError as e:
            raise ValueError(f"--device {name!r}: {e}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--device {name}: CUDA is not available on this machine")
            if dev.index is None:  # plain "cuda": this process's GPU
                dev = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    elif torch.cuda.is_available():
        dev = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    started = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        started = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, dev, started


def wait_for_ranks(started: bool) -> None:
    """Wait for every rank of the group :func:`setup_process` joined (nothing when it joined none): the ranks
    finish together before the group is left (rank 0 writes and prints last; a rank tearing down gloo while
    its peer still ran once aborted)."""
    if started and dist.is_initialized():
        dist.barrier()


def finish_process(started: bool) -> None:
    """Leave the process group :func:`setup_process` joined (nothing when it joined none).  Garbage is
    collected first, so that a sharded model no longer referenced (FSDP holds the group) releases it now,
    while the interpreter is whole, not in its finalisation after the group is gone."""
    if started and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
