"""``fixed_budget_decode`` at batch N equals N single-row calls (rows at different positions).

The single-row op is checked against ``reference.fixed_budget_decode`` in ``test_decode_kernel.py``;
here every batched step is compared with the same step run row by row (outputs, LSE and the whole
cache state, bit for bit for the state), on both backends (the Triton kernels through the
interpreter, and the PyTorch CPU path), odd shapes included.
"""
from __future__ import annotations

import pytest
import torch
from test_decode_kernel import assert_close_rms, decode_flat

from kvpop_kernels import SlotState, fixed_budget_decode, reference


def _state(N, Hkv, B, D, k, fill=0.0):
    return [torch.full((N, Hkv, B, D), fill), torch.full((N, Hkv, B, D), fill),
            torch.full((N, Hkv, B), -1, dtype=torch.int32), torch.full((N, Hkv, k), float("-inf"))]


def _inputs(N, Hq, Hkv, D, gen):
    q = torch.randn(N, Hq, D, generator=gen)
    kn = torch.randn(N, Hkv, D, generator=gen)
    vn = torch.randn(N, Hkv, D, generator=gen)
    lp = torch.randint(0, 3, (N, Hkv), generator=gen).float()  # many ties
    lp = torch.where(torch.rand(N, Hkv, generator=gen) < 0.15, torch.full_like(lp, float("nan")), lp)
    return q, kn, vn, lp


@pytest.mark.parametrize("N,Hkv,G,D,s,w,k,steps", [
    pytest.param(3, 2, 4, 60, 3, 5, 4, 16, id="N3-gqa4-D60"),
    pytest.param(5, 1, 1, 24, 0, 3, 6, 13, id="N5-mha-s0"),
    pytest.param(2, 3, 2, 16, 2, 4, 0, 12, id="N2-k0"),
])
def test_batch_equals_rows(backend, N, Hkv, G, D, s, w, k, steps):
    gen = torch.Generator().manual_seed(N * 7 + k)
    B = s + w + k
    Hq = Hkv * G
    state = _state(N, Hkv, B, D, k)
    rows = [[t[n].clone() for t in state] for n in range(N)]
    # rows start at different positions (as left-padded prompts do) and so cross the sinks, the
    # ring and the first evictions at different steps
    pos = torch.arange(N, dtype=torch.int64) * 3
    kw = {"block_n": 16, "num_splits": 2} if backend == "triton" else {}
    for _ in range(steps):
        q, kn, vn, lp = _inputs(N, Hq, Hkv, D, gen)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp.clone(), pos=pos, sinks=s, window=w, **kw)
        assert o.shape == (N, Hq, D) and l.shape == (N, Hq)
        for n in range(N):
            ro, rl = fixed_budget_decode(q[n], kn[n], vn[n], SlotState(*rows[n]), lp[n].clone(), pos=int(pos[n]),
                                         sinks=s, window=w, **kw)
            assert_close_rms(o[n], ro)
            assert_close_rms(l[n], rl)
            for a, b in zip(state, rows[n]):
                assert torch.equal(a[n], b)
        pos = pos + 1


def test_batch_matches_reference_with_int_pos(backend):
    """A Python int ``pos`` (every row at the same position) against the reference, row by row."""
    gen = torch.Generator().manual_seed(3)
    N, Hkv, G, D, s, w, k = 2, 2, 2, 16, 1, 3, 3
    B = s + w + k
    state = _state(N, Hkv, B, D, k)
    ref = [[t[n].clone() for t in state] for n in range(N)]
    kw = {"block_n": 16} if backend == "triton" else {}
    for pos in range(12):
        q, kn, vn, lp = _inputs(N, Hkv * G, Hkv, D, gen)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp.clone(), pos=pos, sinks=s, window=w, **kw)
        for n in range(N):
            ro, rl = reference.fixed_budget_decode(q[n], kn[n], vn[n], *ref[n], lp[n].clone(), pos=pos,
                                                   sinks=s, window=w)
            assert_close_rms(o[n], ro)
            assert_close_rms(l[n], rl)
            for a, b in zip(state, ref[n]):
                assert torch.equal(a[n], b)


@pytest.mark.parametrize("bad,match", [
    (dict(pos=torch.zeros(3, dtype=torch.int64)), r"pos as a tensor must be int32/int64 of shape \[N\]"),
    (dict(pos=torch.zeros(2)), "pos as a tensor must be int32/int64"),
    (dict(leaving_prio=torch.zeros(2)), r"leaving_prio must be 2-D"),
    (dict(slot_pos=torch.full((2, 2, 8), -1, dtype=torch.int32)), r"slot_pos must be \[N, Hkv, B\]"),
])
def test_batched_guards(bad, match):
    N, Hkv, D, s, w, k = 2, 2, 16, 2, 4, 3
    B = s + w + k
    args = dict(q=torch.randn(N, 4, D), k_new=torch.randn(N, Hkv, D), v_new=torch.randn(N, Hkv, D),
                k_cache=torch.zeros(N, Hkv, B, D), v_cache=torch.zeros(N, Hkv, B, D),
                slot_pos=torch.full((N, Hkv, B), -1, dtype=torch.int32),
                slot_prio=torch.full((N, Hkv, k), float("-inf")), leaving_prio=torch.zeros(N, Hkv),
                pos=torch.zeros(N, dtype=torch.int64), sinks=s, window=w)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        decode_flat(**args)
