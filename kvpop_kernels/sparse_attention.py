"""``sparse_attention``: sink + window + top-k masked attention (forward and backward).

STUB: the CPU path calls the dense reference; the Triton kernels are not written yet.
"""
from __future__ import annotations

import torch

from . import reference


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, evict_at: torch.Tensor, *,
                     sinks: int, window: int, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B,Hq,S,D], lse float32 [B,Hq,S])``; see ``reference.sparse_attention``."""
    return reference.sparse_attention(q, k, v, evict_at, sinks=sinks, window=window, scale=scale)
