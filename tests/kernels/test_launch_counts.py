"""Kernel launches per decode step and per layer, counted on the CPU (issue 60).

A decode step that is launch-bound on a GPU (the first GPU run measured 19.9 us for 2 us of bytes when the step
was three launches) shows here as a count, without a GPU: ``count_launches`` wraps the launcher of Triton's
interpreter (``triton.runtime.interpreter.InterpretedFunction.run``, what ``kernel[grid](...)`` calls under
``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets) and counts every launch by kernel name.

The bounds below are what the current design promises (docs/kernels.md, "Kernel launches"): one fused launch per
``fixed_budget_decode`` call whatever the layout, so one per layer and decode step of a ``KVpopCache``, batch 1 or
many.  A change that adds a launch fails here; one that removes launches lowers the constant of its path.
"""
from __future__ import annotations

import collections
import contextlib

import pytest
import torch

import kvpop_kernels._utils as kutils
from kvpop_kernels import fixed_budget_decode
from kvpop_kernels.layout import PackedLayout, QuantizedLayout, UniformLayout

# launches of one fixed_budget_decode call, per layout (batch 1 or N): the fused step (placement of the new
# token, split-K attention, the last program of each row combining the splits)
DECODE_LAUNCHES_UNIFORM = 1
DECODE_LAUNCHES_PACKED = 1  # head-adaptive budgets
DECODE_LAUNCHES_QUANTIZED = 1  # int8 / fp8 slots, the new token quantised in the same launch
# launches per layer of one KVpopCache decode step of a patched model (the policy's work is PyTorch ops)
CACHE_STEP_LAUNCHES_PER_LAYER = 1  # batch 1
BATCHED_STEP_LAUNCHES_PER_LAYER = 1  # batch > 1: still one launch, every row in its grid

S, W = 2, 8


@contextlib.contextmanager
def count_launches():
    """Count the Triton launches inside the block by kernel name (a ``collections.Counter``), under the
    interpreter.  Compile-only calls (``warmup=True``) are not launches."""
    from triton.runtime.interpreter import InterpretedFunction

    counts: collections.Counter = collections.Counter()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            counts[getattr(self.fn, "__name__", repr(self.fn))] += 1
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield counts
    finally:
        InterpretedFunction.run = original


@pytest.fixture(autouse=True)
def _interpreter():
    if not kutils.interpreting():
        pytest.skip("launches are counted through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)")


def _check(counts: collections.Counter, bound: int, what: str, per: int = 1) -> None:
    """At least one launch per ``per`` (the Triton path ran: the hook cannot pass by counting nothing), at most
    ``bound`` per ``per``."""
    total = sum(counts.values())
    assert total >= per, f"{what}: no Triton launch counted ({dict(counts)}): the hook or the path changed"
    assert total <= bound * per, f"{what}: {total / per:g} launches per step, the bound is {bound}: {dict(counts)}"


def test_the_counter_counts_launches_and_not_compiles():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(X, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(X + i, tl.load(X + i) + 1)

    x = torch.zeros(4)
    with count_launches() as counts:
        add_one[(1,)](x, 4)
        add_one[(2,)](x, 4)
        add_one.warmup(x, 4, grid=(1,))
    assert counts == {"add_one": 2}
    assert x.tolist() == [3.0] * 4  # grids of 1 and 2 programs, each adding one: the kernel really ran


def _layout(kind: str, hkv: int, budget: int):
    if kind == "uniform":
        return UniformLayout(budget)
    if kind == "packed":
        return PackedLayout(tuple(budget + 2 * (h == 0) - 2 * (h == 1) for h in range(hkv)))
    return QuantizedLayout(kind, UniformLayout(budget))


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind, bound", [("uniform", DECODE_LAUNCHES_UNIFORM), ("packed", DECODE_LAUNCHES_PACKED),
                                         ("int8", DECODE_LAUNCHES_QUANTIZED), ("fp8", DECODE_LAUNCHES_QUANTIZED)])
def test_fixed_budget_decode_launches(kind, bound, n):
    """Every layout's step, batch 1 and 2, through evictions (the cache fills after ``budget`` steps)."""
    if kind == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    hq, hkv, d, budget, steps = 4, 2, 16, 12, 15
    lay = _layout(kind, hkv, budget)
    state = lay.empty_state(n, hkv, S, W, k_dim=d, v_dim=d, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    with count_launches() as counts:
        for p in range(steps):
            q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
            fixed_budget_decode(q, k, v, state, torch.randn(n, hkv, generator=gen), pos=torch.full((n,), p),
                                sinks=S, window=W, layout=lay)
    _check(counts, bound, f"fixed_budget_decode ({kind}, batch {n})", per=steps)


@pytest.mark.parametrize("n, bound", [(1, CACHE_STEP_LAUNCHES_PER_LAYER), (3, BATCHED_STEP_LAUNCHES_PER_LAYER)])
def test_cache_decode_step_launches_per_layer(n, bound):
    """One decode step of a tiny patched Qwen3 through a ``KVpopCache`` (after a prompt longer than the budget):
    launches per layer, batch 1 and the batched path."""
    from tiny import SMALL, tiny_model

    import kvpop
    from kvpop.models import cache_kwarg_name

    model = kvpop.patch(tiny_model(), **SMALL)
    cache = kvpop.KVpopCache(model)
    kw = {cache_kwarg_name(): cache}
    layers = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (n, 2 * SMALL["budget"]), generator=gen)
    with torch.no_grad():
        nxt = model(ids, use_cache=True, **kw).logits[:, -1:].argmax(-1)
        for step in range(3):
            with count_launches() as counts:
                nxt = model(nxt, use_cache=True, **kw).logits[:, -1:].argmax(-1)
            _check(counts, bound, f"KVpopCache decode step {step} (batch {n}), per layer", per=layers)
