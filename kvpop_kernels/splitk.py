"""Split-K plumbing shared by the two decode ops (``fixed_budget_decode``, ``ragged_paged_decode``).

Both cut the keys of one (batch row, KV head) into ``num_splits`` chunks of whole ``block_n`` tiles;
stage 1 runs a base-2 online softmax over its chunk (:func:`online_softmax_tile`) and writes a
normalised partial output with its natural-log LSE (:func:`store_split`); stage 2 merges the splits
(:func:`merge_splits`).  Here: those three Triton helpers, the split planner (:func:`plan_splits`), the
operand-precision rule (:func:`upcast_operands`) and the constants both launchers use.  The
contract of the ops: docs/DESIGN.md section 4.
"""
from __future__ import annotations

import math

import torch

from ._utils import interpreting

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["CACHE_DTYPES", "LOG2E", "NATIVE_DOT_IN_INTERPRETER", "merge_splits", "online_softmax_tile",
           "plan_splits", "sm_count", "store_split", "upcast_operands"]

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes of the queries, keys and values the decode kernels take."""
LOG2E = 1.4426950408889634
NATIVE_DOT_IN_INTERPRETER = False
"""Tests only: feed 16-bit operands to ``tl.dot`` under the interpreter as on the GPU (right for
float16, whose numpy arithmetic is real; bfloat16 arithmetic is wrong in the interpreter)."""


def upcast_operands(dtype: torch.dtype) -> bool:
    """True when the kernels upcast keys and values to float32 right after the loads (float32 caches,
    and the interpreter unless :data:`NATIVE_DOT_IN_INTERPRETER`); else 16-bit ``tl.dot`` operands."""
    return dtype == torch.float32 or (interpreting() and not NATIVE_DOT_IN_INTERPRETER)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device index)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_splits(n_keys: int, programs: int, block_n: int, num_splits: int | None,
                device: torch.device) -> tuple[int, int]:
    """``(num_splits, chunk)`` for ``programs`` (row, KV head) pairs of at most ``n_keys`` keys each.

    ``chunk`` is a multiple of ``block_n``; split ``i`` takes keys ``[i*chunk, (i+1)*chunk)``.  By
    default enough programs to cover the GPU about twice (a few in the interpreter), never an empty
    trailing split; an explicit ``num_splits`` is honoured as given (trailing splits may be empty).
    ``n_keys = 0`` plans one split of one tile."""
    n_blocks = max(1, _cdiv(n_keys, block_n))
    if num_splits is None:
        target = 2 * sm_count(device) if device.type == "cuda" else 4
        num_splits = max(1, min(n_blocks, _cdiv(target, max(programs, 1))))
        chunk = _cdiv(n_blocks, num_splits) * block_n
        return _cdiv(max(n_keys, 1), chunk), chunk
    return num_splits, _cdiv(n_blocks, num_splits) * block_n


if triton is not None:
    _LN2 = tl.constexpr(math.log(2.0))

    @triton.jit
    def online_softmax_tile(q, k, v, valid, qk_scale, m_i, l_i, acc, UPCAST: tl.constexpr):
        """One tile of keys ``k, v [BLOCK_N, BLOCK_D]`` (``valid [BLOCK_N]``) for the query tile ``q``:
        the base-2 online-softmax update of ``(m_i, l_i, acc)`` in float32 (``qk_scale`` has log2(e)
        folded in).  ``UPCAST``: float32 operands and an ieee ``tl.dot``, else 16-bit operands."""
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def store_split(MID_O, MID_L, mrow, m_i, l_i, acc, bad, g_ok, d, d_ok, D):
        """Write one split's normalised partial output ``MID_O[mrow, :D]`` and its natural-log LSE
        ``MID_L[mrow]`` from the base-2 state ``(m_i, l_i, acc)`` (``-inf`` / zeros for an empty
        chunk); NaN for both where ``bad`` (an index the guards refused), which the merge keeps."""
        nonempty = l_i > 0
        l_div = tl.where(nonempty, l_i, 1.0)
        o = tl.where(bad, float("nan"), acc / l_div[:, None])
        lse = tl.where(nonempty, (m_i + tl.log2(l_div)) * _LN2, float("-inf"))
        lse = tl.where(bad, float("nan"), lse)
        tl.store(MID_O + mrow[:, None] * D + d[None, :], o, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(MID_L + mrow, lse, mask=g_ok)

    @triton.jit
    def merge_splits(MID_O, MID_L, orow0, lrow0, NS, D, d, d_ok, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                     skip):
        """Online-softmax merge of ``NS`` normalised partial outputs ``MID_O[orow0 + i, :D]`` with their
        natural-log LSEs ``MID_L[lrow0 + i]`` (``-inf`` for an empty split), ``BLOCK_S`` splits per vector
        step -> ``(out [BLOCK_D], lse)``; zeros and ``-inf`` when every split is empty, NaN when a
        split is NaN.  Split ``skip`` (``-1``: none) is left out (after the loads, which do not wait for it)."""
        m_i = float("-inf")
        l_i = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i0 in range(0, NS, BLOCK_S):
            i = i0 + tl.arange(0, BLOCK_S)
            i_ok = i < NS
            lse_i = tl.load(MID_L + lrow0 + i, mask=i_ok, other=float("-inf"))
            o_i = tl.load(MID_O + (orow0 + i)[:, None] * D + d[None, :], mask=i_ok[:, None] & d_ok[None, :],
                          other=0.0)
            lse_i = tl.where(i == skip, float("-inf"), lse_i)
            m_new = tl.maximum(m_i, tl.max(lse_i, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            beta = tl.exp(lse_i - m_safe)  # 0 for empty splits (lse = -inf), NaN for a refused one
            acc = acc * alpha + tl.sum(o_i * beta[:, None], axis=0)
            l_i = l_i * alpha + tl.sum(beta, axis=0)
            m_i = m_new
        l_div = tl.where(l_i == 0, 1.0, l_i)  # (a NaN sum stays NaN: out and lse both NaN)
        return acc / l_div, m_i + tl.log(l_div)
