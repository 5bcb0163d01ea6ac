"""DMS's training hooks: the step the schedule is at (:func:`set_dms_step`) and the auxiliary
compression loss of the last training forward (:func:`dms_loss`)."""
from __future__ import annotations

import torch
from torch import nn

from kvpop.core import lifecycle as L

from .config import dms_target
from .gates import dms_layers
from .patching import SPEC

__all__ = ["set_dms_generator", "set_dms_step", "dms_loss"]


def set_dms_generator(model: nn.Module, generator: torch.Generator | None) -> None:
    """Draw the relaxation's logistic noise of every DMS layer from ``generator`` (``None``: the global
    stream).  ``kvpop.training.train`` gives a training run its own generator, seeded by its seed, so that
    the run draws the same noise whatever ran before it in the process."""
    if L.owner(model, SPEC) is None:
        raise ValueError("set_dms_generator needs a DMS-patched model")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    for layer in dms_layers(model):
        layer.generator = generator


def set_dms_step(model: nn.Module, step: int) -> None:
    """Tell the model the optimiser step being taken (1-based; the auxiliary loss's target follows
    :func:`dms_target`, reached at ``step = schedule_steps``)."""
    if L.owner(model, SPEC) is None:
        raise ValueError("set_dms_step needs a DMS-patched model")
    L.state(model, SPEC)["step"] = int(step)


def dms_loss(model: nn.Module, *, reset: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted auxiliary loss of the last training forward and its statistics.

    ``aux_weight * mean_b relu(target_evict - evict_frac_b)`` with ``evict_frac_b`` the mean hard
    (straight-through) decision over the layers, KV heads and tokens ``t >= s`` of sequence ``b``.
    Statistics: ``keep_frac`` (1 - the mean decision), ``target_keep`` (1 - target), ``aux``.  Returns
    ``(0, ...)`` without grad when no layer recorded decisions (an eval forward).
    """
    owner = L.owner(model, SPEC)
    if owner is None:
        raise ValueError("dms_loss needs a DMS-patched model")
    state = L.state(owner, SPEC)
    cfg = state["config"]
    target = dms_target(cfg, state["step"])
    fracs = []
    for layer in dms_layers(owner):
        ev = layer.last_evict
        if ev is None:
            continue
        n_old = max(ev.shape[-1] - cfg.sinks, 1)
        fracs.append(ev.sum(dim=(1, 2)) / (n_old * ev.shape[1]))  # [B]
        if reset:
            layer.last_evict = None
    if not fracs:
        return torch.zeros(()), {"keep_frac": float("nan"), "target_keep": 1.0 - target, "aux": 0.0}
    frac = torch.stack(fracs).mean(0)  # [B]
    aux = torch.relu(target - frac).mean()
    return cfg.aux_weight * aux, {"keep_frac": 1.0 - float(frac.detach().mean()), "target_keep": 1.0 - target,
                                  "aux": float(aux.detach())}

