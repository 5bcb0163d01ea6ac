"""One computation of a token's priority, shared by every path that evicts (docs/DESIGN.md 2.4, 7).

* :func:`priority` is the formula ``p = r - t * log(gamma_h)``: the full-sequence forward (training,
  evaluation, a cache's prefill), the decode hooks, batched decoding and vLLM all call it.
* The scorers evaluate their per-token networks through :func:`to_rows` / :func:`head_linear` /
  :func:`silu`, so that a token's score does not depend on how many tokens are scored together:
  decoding scores one token per row, a prefill thousands, and both must give the same bits or the
  cache and the training mask disagree on near-ties.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ROW_BLOCK", "priority", "to_rows", "head_linear", "silu"]

ROW_BLOCK = 16
"""Rows are scored in blocks of this many: every matrix product a scorer runs has a multiple of
``ROW_BLOCK`` rows (never one row, where BLAS libraries switch to a matrix-vector kernel that sums in
another order), and every elementwise op sees a multiple of ``ROW_BLOCK`` rows (no scalar tail loop)."""


def priority(r: torch.Tensor, t: torch.Tensor, log_gamma: torch.Tensor) -> torch.Tensor:
    """Static priority ``p = r - t * log(gamma_h)`` (float32), the one copy of docs/DESIGN.md 2.4.

    ``r [N, Hkv, ...]`` raw scores (any float dtype; cast to float32 first), ``t`` the tokens' positions
    (an integer or float tensor of shape ``r.shape[2:]``, shared by the rows, or ``[N, *r.shape[2:]]``,
    per row), ``log_gamma [Hkv]``.  One float32 product and one float32 difference per element, in this
    order, on every path: elementwise IEEE operations, so ``p`` does not depend on how many tokens are
    priced together or on the device (positions up to ``2**24`` are exact in float32).
    """
    if r.dim() < 2 or log_gamma.shape != (r.shape[1],):
        raise ValueError(f"priority: need r [N, Hkv, ...] and log_gamma [Hkv]; got r {tuple(r.shape)}, "
                         f"log_gamma {tuple(log_gamma.shape)}")
    tail = tuple(r.shape[2:])
    tf = t.to(device=r.device, dtype=torch.float32)
    if tuple(tf.shape) == (r.shape[0], *tail):
        tf = tf.unsqueeze(1)  # per row: broadcast over the heads
    elif tuple(tf.shape) != tail:
        raise ValueError(f"priority: t must have shape {tail} or {(r.shape[0], *tail)} for r {tuple(r.shape)}, "
                         f"got {tuple(t.shape)}")
    lg = log_gamma.to(device=r.device, dtype=torch.float32).view(-1, *([1] * len(tail)))
    return r.float() - tf * lg


def to_rows(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``x [B, H, ..., F]`` -> ``(rows [H, M', F], back)``: one row per token and head, ``M'`` the
    ``M = B * prod(...)`` tokens padded with zero rows to a multiple of :data:`ROW_BLOCK`; ``back(y [H, M', *G])
    -> [B, H, ..., *G]`` drops the padding and restores the layout."""
    B, H, F_ = x.shape[0], x.shape[1], x.shape[-1]
    mid = tuple(x.shape[2:-1])
    rows = x.reshape(B, H, -1, F_).transpose(0, 1).reshape(H, -1, F_)
    M = rows.shape[1]
    pad = -M % ROW_BLOCK  # one token: a whole block
    rows = F.pad(rows, (0, 0, 0, pad)).contiguous()

    def back(y: torch.Tensor) -> torch.Tensor:
        g = tuple(y.shape[2:])
        y = y[:, :M].reshape(H, B, *mid, *g)
        return y.transpose(0, 1)

    return rows, back


def head_linear(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``rows [H, M', I] @ w [H, I, O]`` -> ``[H, M', O]`` (one batched matrix product per call; ``M'`` a
    multiple of :data:`ROW_BLOCK`, from :func:`to_rows`).  A row's result depends on that row and ``w``
    only: the product always has at least ``ROW_BLOCK`` rows, so it runs the same kernel and summation
    order whether one token or a whole sequence is scored (tests/core/test_priority.py)."""
    if rows.shape[1] % ROW_BLOCK:
        raise ValueError(f"head_linear takes rows padded to a multiple of {ROW_BLOCK} (kvpop.core.priority.to_rows), "
                         f"got {rows.shape[1]}")
    return torch.bmm(rows, w)


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x / (1.0 + torch.exp(-x))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1.0 + x * (1.0 - s))


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))`` in three elementwise ops.  ``F.silu`` on the CPU rounds
    differently in its vector loop and its scalar tail (about 4% of random inputs differ by an ulp), so an
    element's value would depend on where it falls in the tensor; ``exp``, ``+`` and ``/`` agree in both."""
    return _Silu.apply(x)
