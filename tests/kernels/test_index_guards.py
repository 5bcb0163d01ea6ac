"""Index tensors of the decode ops and zero-size inputs of every public op.

``fixed_budget_decode``'s ``pos`` and ``ragged_paged_decode``'s ``table`` / ``lengths`` live on the device.
Checked (the default for CPU tensors, ``check=True`` anywhere) a bad value raises a ValueError before
anything is written; unchecked (``check=False``, the default on CUDA) every backend guards on the device:
the row / head with the bad index writes nothing, returns NaN, and the other rows and heads are exact.
Both backends: the Triton kernels through the interpreter (on CUDA on a GPU) and the PyTorch path."""
from __future__ import annotations

import pytest
import torch
from test_paged_decode import make_store

import kvpop_kernels._utils as kutils
from kvpop_kernels import (
    NEVER,
    SlotState,
    eviction_decisions,
    eviction_schedule,
    fixed_budget_decode,
    future_attention_target,
    ragged_paged_decode,
    reference,
    sparse_attention,
)

BAD_POS = [-10**6, -1, 2**31 - 1, 2**40]
S_, W_, K_ = 2, 3, 3  # sinks, window, long-range slots
B_ = S_ + W_ + K_


def _filled_rows(N, Hkv, G, D, gen):
    """Per-row states stepped through the reference (rows at different positions, past the first
    evictions), and each row's next position."""
    rows, nxt = [], []
    for n in range(N):
        st = [torch.zeros(Hkv, B_, D), torch.zeros(Hkv, B_, D), torch.full((Hkv, B_), -1, dtype=torch.int32),
              torch.full((Hkv, K_), float("-inf"))]
        steps = 9 + 2 * n
        for p in range(steps):
            q, kn, vn = torch.randn(Hkv * G, D, generator=gen), torch.randn(Hkv, D, generator=gen), \
                torch.randn(Hkv, D, generator=gen)
            reference.fixed_budget_decode(q, kn, vn, *st, torch.randn(Hkv, generator=gen), pos=p, sinks=S_, window=W_)
        rows.append(st)
        nxt.append(steps)
    return rows, nxt


def _batch(rows):
    return [torch.stack([r[i] for r in rows]).contiguous() for i in range(4)]


@pytest.mark.parametrize("bad", BAD_POS)
def test_decode_checks_positions_on_the_host(backend, bad):
    gen = torch.Generator().manual_seed(1)
    N, Hkv, G, D = 3, 2, 2, 16
    rows, nxt = _filled_rows(N, Hkv, G, D, gen)
    state = _batch(rows)
    before = [t.clone() for t in state]
    q, kn, vn, lp = (torch.randn(N, *s, generator=gen) for s in ((Hkv * G, D), (Hkv, D), (Hkv, D), (Hkv,)))
    pos = torch.tensor([nxt[0], bad, nxt[2]])
    with pytest.raises(ValueError, match=rf"pos must lie in \[0, 2\*\*31 - 2\].*\[{bad}\] in rows \[1\]"):
        fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=S_, window=W_)  # check=None: on for CPU
    with pytest.raises(ValueError, match="pos must lie"):
        fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=S_, window=W_, check=True)
    for a, b in zip(state, before):
        assert torch.equal(a, b)  # refused before anything was written
    if -2**31 <= bad < 2**31:  # an int32 tensor too
        with pytest.raises(ValueError, match="pos must lie"):
            fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos.to(torch.int32), sinks=S_, window=W_)
    with pytest.raises(TypeError, match="check must be True, False or None"):
        fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=S_, window=W_, check="yes")


@pytest.mark.parametrize("bad", BAD_POS)
def test_decode_guards_positions_on_the_device(backend, bad):
    """``check=False``: the row at a bad position writes nothing and returns NaN; no write lands outside
    the cache (an out-of-bounds store crashed the interpreter before); the other rows equal the reference."""
    gen = torch.Generator().manual_seed(2)
    N, Hkv, G, D = 3, 2, 2, 16
    rows, nxt = _filled_rows(N, Hkv, G, D, gen)
    state = _batch(rows)
    q, kn, vn, lp = (torch.randn(N, *s, generator=gen) for s in ((Hkv * G, D), (Hkv, D), (Hkv, D), (Hkv,)))
    pos = torch.tensor([nxt[0], bad, nxt[2]])
    kw = {"block_n": 16, "num_splits": 2} if backend == "triton" else {}
    out, lse = fixed_budget_decode(q, kn, vn, SlotState(*state), lp.clone(), pos=pos, sinks=S_, window=W_,
                                   check=False, **kw)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    for a, r in zip(state, rows[1]):
        assert torch.equal(a[1], r)  # untouched
    for n in (0, 2):
        ro, rl = reference.fixed_budget_decode(q[n], kn[n], vn[n], *rows[n], lp[n].clone(), pos=nxt[n], sinks=S_,
                                               window=W_)
        torch.testing.assert_close(out[n], ro, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lse[n], rl, atol=1e-4, rtol=1e-5)
        for a, r in zip(state, rows[n]):
            assert torch.equal(a[n], r)


def test_decode_default_check_reads_nothing_under_compile(monkeypatch):
    """``check=None`` does not read ``pos`` back while ``torch.compile`` traces: the PyTorch step stays one graph."""
    monkeypatch.setattr(kutils, "interpreting", lambda: False)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    N, Hkv, G, D = 2, 2, 2, 16
    rows, nxt = _filled_rows(N, Hkv, G, D, gen)
    eager, comp = _batch(rows), _batch(rows)
    q, kn, vn, lp = (torch.randn(N, *s, generator=gen) for s in ((Hkv * G, D), (Hkv, D), (Hkv, D), (Hkv,)))
    pos = torch.tensor(nxt)

    def step(*st):
        return fixed_budget_decode(q, kn, vn, SlotState(*st), lp, pos=pos, sinks=S_, window=W_)

    want = step(*eager)
    got = torch.compile(step, fullgraph=True, backend="eager")(*comp)
    for a, b in zip((*got, *comp), (*want, *eager)):
        torch.testing.assert_close(a, b)


# finite values everywhere (no NaN poison): a page read that the guard missed shows as a finite wrong output
STORE = dict(Hkv=3, G=2, D=24, F=6, n_fixed=5, P=4, lengths=[5, 0, 9], poison=False)


def _bad_store(case):
    q, fk, fv, nf, pk, pv, table, lens = make_store(**STORE)
    W, P, Np = table.shape[1], pk.shape[1], pk.shape[0]
    table, lens = table.clone(), lens.clone()
    if case == "length past W*P":
        lens[2] = W * P + 1
    elif case == "huge length":
        lens[2] = 2**40
    elif case == "negative length":
        lens[2] = -3
    elif case == "page past the pool":
        table[2, 1] = Np
    elif case == "negative page":
        table[2, 0] = -1
    return (q, fk, fv, nf, pk, pv, table, lens), 2


PAGED_CASES = ["length past W*P", "huge length", "negative length", "page past the pool", "negative page"]


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_checks_table_and_lengths_on_the_host(backend, case):
    args, _ = _bad_store(case)
    match = "lengths must lie in" if "length" in case else r"table\[2, [01]\] = -?\d+ names a page outside"
    with pytest.raises(ValueError, match=match):
        ragged_paged_decode(*args)
    with pytest.raises(ValueError, match=match):
        ragged_paged_decode(*args, check=True)
    with pytest.warns(DeprecationWarning, match="use check="), pytest.raises(ValueError, match=match):
        ragged_paged_decode(*args, validate=True)


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_guards_table_and_lengths_on_the_device(backend, case):
    """``check=False``: the head with a bad length or page reads nothing there (no read outside the pool
    or the table) and its query heads return NaN; the other heads equal the reference."""
    args, h = _bad_store(case)
    good = make_store(**STORE)
    kw = {"block_n": 16} if backend == "triton" else {}
    out, lse = ragged_paged_decode(*args, check=False, **kw)
    ro, rl = reference.ragged_paged_decode(*good)
    G = STORE["G"]
    bad_rows = torch.zeros(out.shape[0], dtype=torch.bool)
    bad_rows[h * G:(h + 1) * G] = True
    assert torch.isnan(out[bad_rows]).all() and torch.isnan(lse[bad_rows]).all()
    torch.testing.assert_close(out[~bad_rows], ro[~bad_rows], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse[~bad_rows], rl[~bad_rows], atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------------------ zero sizes
@pytest.mark.parametrize("shape", [(1, 2, 0), (0, 2, 5), (1, 0, 5)], ids=["S0", "B0", "H0"])
def test_schedule_of_nothing_is_empty(backend, shape):
    p = torch.randn(shape)
    ev = eviction_schedule(p, sinks=1, window=2, k=1)
    y, bnd = eviction_decisions(p, sinks=1, window=2, k=1)
    assert ev.shape == y.shape == bnd.shape == shape
    assert (ev.dtype, y.dtype, bnd.dtype) == (torch.int32, torch.int8, torch.int32)


@pytest.mark.parametrize("B,S", [(1, 0), (0, 5)], ids=["S0", "B0"])
def test_sparse_attention_and_target_of_nothing(backend, B, S):
    q = torch.randn(B, 4, S, 16, requires_grad=True)
    k = torch.randn(B, 2, S, 16, requires_grad=True)
    v = torch.randn(B, 2, S, 16, requires_grad=True)
    ev = torch.full((B, 2, S), NEVER, dtype=torch.int32)
    out, lse = sparse_attention(q, k, v, ev, sinks=1, window=2)
    assert out.shape == (B, 4, S, 16) and lse.shape == (B, 4, S) and lse.dtype == torch.float32
    (out.sum() + lse.sum()).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape
    t = future_attention_target(q.detach(), k.detach(), torch.zeros(B, 4, S), window=2)
    assert t.shape == (B, 2, S) and t.dtype == torch.float32


def test_zero_heads_or_head_size_are_refused(backend):
    ev = torch.full((1, 2, 5), NEVER, dtype=torch.int32)
    heads = r"number of query heads \(0\) must be a positive multiple"
    with pytest.raises(ValueError, match=heads):
        sparse_attention(torch.randn(1, 0, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), ev,
                         sinks=1, window=2)
    with pytest.raises(ValueError, match=heads):
        future_attention_target(torch.randn(1, 0, 5, 16), torch.randn(1, 2, 5, 16), torch.zeros(1, 0, 5), window=2)
    with pytest.raises(ValueError, match=r"must be >= 1, got 0"):
        sparse_attention(torch.randn(1, 2, 5, 0), torch.randn(1, 2, 5, 0), torch.randn(1, 2, 5, 0), ev,
                         sinks=1, window=2)
    st = [torch.zeros(2, 2, B_, 0), torch.zeros(2, 2, B_, 0), torch.full((2, 2, B_), -1, dtype=torch.int32),
          torch.full((2, 2, K_), float("-inf"))]
    with pytest.raises(ValueError, match=r"head size D .* must be >= 1, got 0"):
        fixed_budget_decode(torch.randn(2, 4, 0), torch.randn(2, 2, 0), torch.randn(2, 2, 0), SlotState(*st),
                            torch.zeros(2, 2), pos=3, sinks=S_, window=W_)
    st0 = [torch.zeros(2, 0, B_, 16), torch.zeros(2, 0, B_, 16), torch.full((2, 0, B_), -1, dtype=torch.int32),
           torch.full((2, 0, K_), float("-inf"))]
    with pytest.raises(ValueError, match=heads):
        fixed_budget_decode(torch.randn(2, 0, 16), torch.randn(2, 0, 16), torch.randn(2, 0, 16), SlotState(*st0),
                            torch.zeros(2, 0), pos=3, sinks=S_, window=W_)
    pool = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match=heads):
        ragged_paged_decode(torch.randn(0, 16), torch.zeros(0, 3, 16), torch.zeros(0, 3, 16), 2, pool, pool,
                            torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"head size D .* must be >= 1, got 0"):
        ragged_paged_decode(torch.randn(4, 0), torch.zeros(2, 3, 0), torch.zeros(2, 3, 0), 2, torch.zeros(2, 4, 0),
                            torch.zeros(2, 4, 0), torch.zeros(2, 1, dtype=torch.int64),
                            torch.zeros(2, dtype=torch.int64))


def test_decode_of_no_row_is_empty(backend):
    st = [torch.zeros(0, 2, B_, 16), torch.zeros(0, 2, B_, 16), torch.full((0, 2, B_), -1, dtype=torch.int32),
          torch.full((0, 2, K_), float("-inf"))]
    for pos in (3, torch.zeros(0, dtype=torch.int64)):
        out, lse = fixed_budget_decode(torch.randn(0, 4, 16), torch.randn(0, 2, 16), torch.randn(0, 2, 16),
                                       SlotState(*st), torch.zeros(0, 2), pos=pos, sinks=S_, window=W_)
        assert out.shape == (0, 4, 16) and lse.shape == (0, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize("F,n_fixed,pages,W", [(0, 0, 0, 0), (3, 2, 0, 2), (3, 0, 2, 0)],
                         ids=["nothing", "no-pool", "no-table"])
def test_paged_decode_of_empty_stores(backend, F, n_fixed, pages, W):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(4, 16, generator=gen)
    fk, fv = torch.randn(2, F, 16, generator=gen), torch.randn(2, F, 16, generator=gen)
    pool = torch.zeros(pages, 4, 16)
    table, lens = torch.zeros(2, W, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    out, lse = ragged_paged_decode(q, fk, fv, n_fixed, pool, pool, table, lens)
    ro, rl = reference.ragged_paged_decode(q, fk, fv, n_fixed, pool, pool, table, lens)
    torch.testing.assert_close(out, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rl)
    if n_fixed == 0:
        assert torch.isneginf(lse).all() and not out.any()
