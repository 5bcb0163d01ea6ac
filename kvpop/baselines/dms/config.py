"""DMS's settings (:class:`DMSConfig`) and the schedule of its target compression (:func:`dms_target`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpop.core.config import ConfigFields

__all__ = ["DMSConfig", "dms_target"]


def check_int(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")


def check_float(name: str, v: Any, lo: float | None = None, hi: float | None = None, *, open_lo: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (open_lo and v == lo)):
        raise ValueError(f"{name} must be {'>' if open_lo else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")


@dataclass(frozen=True)
class DMSConfig(ConfigFields):
    """Settings of DMS (module docstring).

    sinks, window: ``s`` first tokens never evicted; ``w``: the eviction delay (a token marked for
        eviction stays visible while it is among the ``w`` most recent tokens), the same window as KVpop's.
    tau: temperature of the Gumbel-sigmoid relaxation in training (default 0.1, the DMS code's).
    gate_offset: the gates' initial bias is ``-gate_offset`` (default 5: eviction probability ~0.7 %).
    threshold: hard decision ``evict = logit > threshold`` at evaluation and decoding (default 0, i.e.
        ``alpha > 1/2``); shifting it trades memory for accuracy without retraining.
    target_keep: the keep fraction the auxiliary loss drives the gates to at the end of the schedule
        (compression ratio ``1 / target_keep``; default 0.125).
    schedule_steps: steps over which the target compression ratio rises linearly from 1 (default 100).
    aux_weight: weight of the auxiliary loss (default 1).
    """

    sinks: int = 4
    window: int = 256
    tau: float = 0.1
    gate_offset: float = 5.0
    threshold: float = 0.0
    target_keep: float = 0.125
    schedule_steps: int = 100
    aux_weight: float = 1.0

    METHOD = "dms"

    def __post_init__(self) -> None:
        check_int("sinks", self.sinks, 0)
        check_int("window", self.window, 1)
        check_int("schedule_steps", self.schedule_steps, 1)
        check_float("tau", self.tau, 0.0, open_lo=True)
        check_float("gate_offset", self.gate_offset)
        check_float("threshold", self.threshold)
        check_float("target_keep", self.target_keep, 0.0, 1.0, open_lo=True)
        check_float("aux_weight", self.aux_weight, 0.0)



def dms_target(config: DMSConfig, step: int) -> float:
    """Target eviction fraction at optimiser step ``step``: ``1 - 1/CR`` with ``CR`` linear from 1 to
    ``1 / target_keep`` over ``schedule_steps`` (constant after)."""
    progress = min(max(step, 0) / config.schedule_steps, 1.0)
    cr = 1.0 + (1.0 / config.target_keep - 1.0) * progress
    return 1.0 - 1.0 / cr

