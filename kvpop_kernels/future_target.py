"""``future_attention_target``: the transposed LSE-shifted column-sum attention (training target).

STUB: the CPU path calls the dense reference; the Triton kernel is not written yet.
"""
from __future__ import annotations

import torch

from . import reference


def future_attention_target(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, window: int,
                            eps: float = 1e-6, scale: float | None = None) -> torch.Tensor:
    """Training target ``r_tgt [B, Hkv, S]`` float32; see ``reference.future_attention_target``."""
    return reference.future_attention_target(q, k, lse, window=window, eps=eps, scale=scale)
