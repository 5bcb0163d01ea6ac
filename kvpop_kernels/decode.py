"""``fixed_budget_decode``: the fused batch-1 decode step over a fixed budget of slots.

STUB: calls the reference; the Triton kernel is not written yet.
"""
from __future__ import annotations

import torch

from . import reference


def fixed_budget_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, *,
                        pos: int, sinks: int, window: int, scale: float | None = None):
    """See ``reference.fixed_budget_decode`` for the slot layout and the step."""
    return reference.fixed_budget_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio,
                                         leaving_prio, pos=pos, sinks=sinks, window=window, scale=scale)
