"""The work of ``eviction_schedule`` + ``eviction_decisions`` grows as ``S log S``, counted without a GPU.

The Triton path runs through the interpreter with its memory operations counted (every element a kernel
loads or stores, masked-out lanes excluded) plus the elements ``torch.sort`` orders (a radix sort on a GPU:
a fixed number of passes over its keys).  The PyTorch path counts the elements of every tensor the
top-level ATen ops read (the profiler's input shapes).  From ``S = 1024`` to ``S = 4096`` an
``S log S`` algorithm does ``4 * 12/10 = 4.8`` times the work, the former all-pairs kernel ``16`` times.
"""
import math

import pytest
import torch

import kvpop_kernels._utils as kutils
from kvpop_kernels import eviction_decisions, eviction_schedule

S_SMALL, S_LARGE = 1024, 4096
LOG_RATIO = 4 * math.log2(S_LARGE) / math.log2(S_SMALL)  # 4.8


def _call(S):
    g = torch.Generator().manual_seed(S)
    p = torch.randn(1, 2, S, generator=g)
    p[..., 1::3] = p[..., ::3][..., : p[..., 1::3].shape[-1]]  # ties
    kw = dict(sinks=4, window=S // 16, k=[S // 8, S // 3])  # head-adaptive budgets
    eviction_schedule(p, **kw)
    eviction_decisions(p, **kw)


def _counting(mp, fn):
    """Run ``fn()`` with every interpreted kernel load and store and every ``torch.sort`` counted: returns
    ``{"elements", "bytes"}`` moved by the kernels (masked-out lanes excluded) and ``{"sorted",
    "sort_bytes"}`` (the input's elements; input + values + int64 indices bytes)."""
    from triton.runtime.interpreter import InterpreterBuilder

    count = dict(elements=0, bytes=0, sorted=0, sort_bytes=0)
    load, store, sort = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store, torch.sort

    def tally(ptrs, mask):
        n = int(mask.data.sum())
        count["elements"] += n
        count["bytes"] += n * ptrs.get_element_ty().primitive_bitwidth // 8

    def counted_load(self, ptrs, mask, *a, **kw):
        tally(ptrs, mask)
        return load(self, ptrs, mask, *a, **kw)

    def counted_store(self, ptrs, value, mask, *a, **kw):
        tally(ptrs, mask)
        return store(self, ptrs, value, mask, *a, **kw)

    def counted_sort(x, *a, **kw):
        count["sorted"] += x.numel()
        count["sort_bytes"] += x.numel() * (2 * x.element_size() + 8)
        return sort(x, *a, **kw)

    with mp.context() as m:
        m.setattr(InterpreterBuilder, "create_masked_load", counted_load)
        m.setattr(InterpreterBuilder, "create_masked_store", counted_store)
        m.setattr(torch, "sort", counted_sort)
        fn()
    return count


def _triton_work(S, monkeypatch):
    """Elements loaded and stored by the kernels + elements sorted, for one call of each op."""
    c = _counting(monkeypatch, lambda: _call(S))
    return {"mem": c["elements"], "sorted": c["sorted"]}


def _torch_work(S):
    """Elements read by the top-level ATen ops of one call of each op on the PyTorch path."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _call(S)
    total = 0
    for ev in prof.events():
        if ev.cpu_parent is None and ev.name.startswith("aten::"):
            total += sum(math.prod(s) for s in ev.input_shapes if s)
    return total


def test_triton_path_work_is_s_log_s(monkeypatch):
    if not kutils.interpreting():
        pytest.skip("counts the kernels' work through Triton's interpreter")
    small, large = _triton_work(S_SMALL, monkeypatch), _triton_work(S_LARGE, monkeypatch)
    ratio = (large["mem"] + large["sorted"]) / (small["mem"] + small["sorted"])
    assert 0.8 * LOG_RATIO < ratio < 1.15 * LOG_RATIO, (small, large, ratio)
    # per token and per op: a bounded number of memory operations per level of the tree (<= 10 L + 30),
    # where the all-pairs kernel touched S of them
    L = math.ceil(math.log2(S_LARGE))
    per_token = (large["mem"] + large["sorted"]) / (2 * S_LARGE * 2)
    assert per_token <= 10 * L + 30, per_token


def test_torch_path_work_is_s_log_s(monkeypatch):
    monkeypatch.setattr(kutils, "interpreting", lambda: False)
    small, large = _torch_work(S_SMALL), _torch_work(S_LARGE)
    assert small > 0
    ratio = large / small
    assert 0.8 * LOG_RATIO < ratio < 1.15 * LOG_RATIO, (small, large, ratio)


@pytest.mark.parametrize("S", [100, 1024])
@pytest.mark.parametrize("decisions", [False, True])
def test_gpu_traffic_is_what_the_kernels_move(monkeypatch, S, decisions):
    """``gpu_traffic`` (the bytes a roofline of the schedule divides by) against the bytes the kernels load
    and store through the interpreter plus each sort's input and outputs.  With no sinks, a window of one
    and k = 1 every token asks but the last two of each row (no decision / never evicted) and the top one."""
    from kvpop_kernels.schedule import _levels, gpu_traffic

    if not kutils.interpreting():
        pytest.skip("counts the kernels' bytes through Triton's interpreter")
    p = torch.randn(2, 3, S, dtype=torch.bfloat16)
    op = eviction_decisions if decisions else eviction_schedule
    c = _counting(monkeypatch, lambda: op(p, sinks=0, window=1, k=1))
    moved = c["bytes"] + c["sort_bytes"]
    want = gpu_traffic(2, 3, S, priority_bytes=2, decisions=decisions)
    idle = 6 * 3 * (4 * _levels(S) + 4)  # rows x idle tokens x (one Z load per level + the perm gather)
    assert want - idle <= moved <= want, (c, want)
    assert abs(gpu_traffic(1, 8, 16384) / (8 * 16384 * (48 + 32 * 14)) - 1) < 1e-3  # the docstring's form
