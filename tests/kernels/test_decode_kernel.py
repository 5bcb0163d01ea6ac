"""``fixed_budget_decode`` against ``reference.fixed_budget_decode`` and the eviction schedule.

Every step compares ``out``, ``lse`` AND the whole cache state (``k_cache, v_cache, slot_pos,
slot_prio``, bit for bit) after the in-place update, over many consecutive steps from an empty
cache: sink writes (``pos < s``), a ring that is not full yet, the first evictions, ties and NaN
priorities, ``k = 0``.  Both backends: the Triton kernels (interpreter on the CPU) and the
PyTorch CPU path (``_utils.interpreting`` patched to False).
"""
from __future__ import annotations

import re

import pytest
import torch

import kvpop_kernels._utils as kutils
from kvpop_kernels import SlotState, eviction_schedule, fixed_budget_decode, reference, splitk

HAS_CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------- helpers

def decode_flat(**a):
    """``fixed_budget_decode`` of one flat dict of arguments, the state's tensors by their field names among them
    (how the guard tests vary one tensor at a time)."""
    state = SlotState(**{k: a.pop(k) for k in ("k_cache", "v_cache", "slot_pos", "slot_prio", "k_scale", "v_scale")
                         if k in a})
    q, k_new, v_new, leaving_prio = (a.pop(n) for n in ("q", "k_new", "v_new", "leaving_prio"))
    return fixed_budget_decode(q, k_new, v_new, state, leaving_prio, **a)


def empty_cache(Hkv, B, D, k, dtype=torch.float32, device="cpu", fill=0.0):
    """An empty fixed-budget cache: ``[k_cache, v_cache, slot_pos, slot_prio]``."""
    return [
        torch.full((Hkv, B, D), fill, dtype=dtype, device=device),
        torch.full((Hkv, B, D), fill, dtype=dtype, device=device),
        torch.full((Hkv, B), -1, dtype=torch.int32, device=device),
        torch.full((Hkv, k), float("-inf"), dtype=torch.float32, device=device),
    ]


def clone_state(state, device=None):
    return [t.clone() if device is None else t.to(device, copy=True) for t in state]


def random_step_inputs(Hq, Hkv, D, dtype=torch.float32, ties=True, nan=True, gen=None):
    q = torch.randn(Hq, D, generator=gen).to(dtype)
    kn = torch.randn(Hkv, D, generator=gen).to(dtype)
    vn = torch.randn(Hkv, D, generator=gen).to(dtype)
    if ties:  # few distinct values: many ties, broken by position
        lp = torch.randint(0, 3, (Hkv,), generator=gen).float()
    else:
        lp = torch.randn(Hkv, generator=gen)
    if nan:
        u = torch.rand(Hkv, generator=gen)
        lp = torch.where(u < 0.15, torch.full_like(lp, float("nan")), lp)
        lp = torch.where((u >= 0.15) & (u < 0.2), torch.full_like(lp, float("-inf")), lp)
    return q, kn, vn, lp


def assert_close_rms(out, ref, atol=1e-4, rtol=1e-5, rms=1e-5):
    out, ref = out.float(), ref.float()
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    err = (out - ref).pow(2).mean().sqrt()
    scale = ref.pow(2).mean().sqrt().clamp_min(1e-12)
    assert err / scale <= rms, f"relative RMS error {float(err / scale):.3g} > {rms}"


def assert_same_state(state, ref_state, pos):
    names = ("k_cache", "v_cache", "slot_pos", "slot_prio")
    for name, a, b in zip(names, state, ref_state):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differs from the reference after the step at pos={pos}"


def run_and_compare(Hkv, G, D, s, w, k, steps, *, dtype=torch.float32, ties=True, nan=True,
                    device="cpu", seed=0, atol=1e-4, rtol=1e-5, rms=1e-5, **kw):
    gen = torch.Generator().manual_seed(seed)
    B = s + w + k
    Hq = Hkv * G
    state = empty_cache(Hkv, B, D, k, dtype, device)
    ref_state = empty_cache(Hkv, B, D, k, dtype, "cpu")
    for pos in range(steps):
        q, kn, vn, lp = random_step_inputs(Hq, Hkv, D, dtype, ties, nan, gen)
        ro, rl = reference.fixed_budget_decode(q, kn, vn, *ref_state, lp.clone(), pos=pos, sinks=s, window=w)
        o, l = fixed_budget_decode(q.to(device), kn.to(device), vn.to(device), SlotState(*state), lp.to(device),
                                   pos=pos, sinks=s, window=w, **kw)
        assert o.shape == (Hq, D) and o.dtype == dtype and l.shape == (Hq,) and l.dtype == torch.float32
        assert_close_rms(o.cpu(), ro, atol, rtol, rms)
        assert_close_rms(l.cpu(), rl, atol, rtol, rms)
        assert_same_state(state, ref_state, pos)
    return state


# --------------------------------------------------------------------- step by step
SHAPES = [
    # Hkv, G, D, s, w, k, steps
    pytest.param(2, 4, 60, 3, 5, 4, 26, id="gqa4-D60"),
    pytest.param(3, 1, 64, 4, 6, 5, 24, id="mha-D64"),
    pytest.param(2, 2, 32, 2, 5, 0, 16, id="k0"),
    pytest.param(1, 8, 16, 0, 3, 6, 20, id="s0-G8"),
    pytest.param(2, 3, 24, 5, 2, 3, 17, id="wide-sinks"),
]


@pytest.mark.parametrize("Hkv,G,D,s,w,k,steps", SHAPES)
def test_steps_match_reference(backend, Hkv, G, D, s, w, k, steps):
    kw = {"block_n": 16, "num_splits": 2} if backend == "triton" else {}
    run_and_compare(Hkv, G, D, s, w, k, steps, **kw)


def test_distinct_priorities(backend):
    kw = {"block_n": 16, "num_splits": 3} if backend == "triton" else {}
    run_and_compare(2, 2, 40, 2, 4, 6, 22, ties=False, nan=False, seed=3, **kw)


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (2, 16), (5, 16), (None, 32), (None, None)])
def test_triton_split_layouts(num_splits, block_n):
    """Chunks of many blocks, one block, empty trailing splits; the special slots in any chunk."""
    if not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend")
    # B = 31 slots: with block_n = 16, 2 blocks; the ring slot and the destination move across splits
    run_and_compare(1, 4, 20, 2, 9, 20, 44, num_splits=num_splits, block_n=block_n, seed=1)


def test_triton_many_splits():
    """More splits than the merge's vector width (32): stage 2 loops; most splits are empty."""
    if not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend")
    run_and_compare(1, 2, 16, 1, 3, 4, 12, num_splits=37, block_n=16, seed=4)


def test_torch_path_long_run(monkeypatch):
    """The PyTorch path over many steps (several ring cycles, a full long-range part)."""
    monkeypatch.setattr(kutils, "interpreting", lambda: False)
    run_and_compare(2, 2, 8, 4, 8, 12, 120, seed=5)


def _warm_state(Hkv, G, D, s, w, k, steps, dtype, gen, ties=False):
    """A realistic cache after ``steps`` tokens, built with the PyTorch path."""
    state = empty_cache(Hkv, s + w + k, D, k, dtype)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(kutils, "interpreting", lambda: False)  # the PyTorch path
        for pos in range(steps):
            q, kn, vn, lp = random_step_inputs(Hkv * G, Hkv, D, dtype, ties=ties, nan=ties, gen=gen)
            fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=s, window=w)
    return state


def test_triton_full_cache_default_splits():
    """A full cache of several hundred slots (the argmin spans several blocks, with tied lowest
    priorities in different blocks), the default split plan, a few steps."""
    if not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend")
    gen = torch.Generator().manual_seed(7)
    Hkv, G, D, s, w, k = 2, 4, 32, 4, 32, 600
    B = s + w + k
    state0 = _warm_state(Hkv, G, D, s, w, k, 1300, torch.float32, gen, ties=True)
    ref_state = clone_state(state0)
    state = clone_state(state0)
    assert int((state0[2] >= 0).sum()) == Hkv * B
    for i, pos in enumerate(range(1300, 1305)):
        q, kn, vn, lp = random_step_inputs(Hkv * G, Hkv, D, ties=True, nan=False, gen=gen)
        lp = lp + 10.0 * (i % 2)  # keeps the leaving token on odd steps; ties on even ones
        ro, rl = reference.fixed_budget_decode(q, kn, vn, *ref_state, lp.clone(), pos=pos, sinks=s, window=w)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=s, window=w)
        assert_close_rms(o, ro)
        assert_close_rms(l, rl)
        assert_same_state(state, ref_state, pos)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dropped"])
def test_triton_evicted_slot_in_every_split(keep):
    """Stage 1 finds one eviction candidate per chunk and stage 2 the head's lowest: the evicted slot in each
    split in turn (a full cache, distinct priorities), the query aligned with its key so that the slot
    dominates the attention (attended when the leaving token is dropped, not when it replaces the slot), and
    the leaving token's own key as large."""
    if not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend")
    gen = torch.Generator().manual_seed(13)
    Hkv, G, D, s, w, k = 1, 2, 16, 2, 4, 58  # B = 64: four chunks of 16 slots (long-range from slot 6)
    B = s + w + k
    state0 = _warm_state(Hkv, G, D, s, w, k, 200, torch.float32, gen)
    assert int((state0[2] >= 0).sum()) == B
    for i, slot in enumerate((7, 20, 41, 63)):  # long-range slots in splits 0, 1, 2, 3
        pos = 200 + i
        state, ref_state = clone_state(state0), clone_state(state0)
        prio = torch.linspace(1.0, 2.0, k).reshape(1, k)
        prio[0, slot - s - w] = 0.5  # the lowest
        state[3].copy_(prio)
        ref_state[3].copy_(prio)
        ring = s + (pos - w - s) % w
        q = (4.0 * state0[0][0, slot]).repeat(G, 1) + 0.1 * torch.randn(G, D, generator=gen)
        q[1] = 4.0 * state0[0][0, ring]  # the second query head looks at the leaving token
        kn, vn = torch.randn(Hkv, D, generator=gen), torch.randn(Hkv, D, generator=gen)
        lp = torch.tensor([0.75 if keep else 0.25])
        ro, rl = reference.fixed_budget_decode(q, kn, vn, *ref_state, lp.clone(), pos=pos, sinks=s, window=w)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=s, window=w, num_splits=4,
                                   block_n=16)
        assert_close_rms(o, ro)
        assert_close_rms(l, rl)
        assert_same_state(state, ref_state, pos)
        assert (int(state[2][0, slot]) == pos - w) == keep  # the leaving token took the slot, or not


@pytest.mark.parametrize("num_splits", [4, 1], ids=["4-splits", "1-split"])
def test_fused_combine_and_its_counter(num_splits):
    """One launch per step: the last of a (row, KV head)'s split programs to take a ticket from its counter merges
    the partials and writes the cache back.  The evicted slot in each split in turn (and in the one split), the
    leaving token kept and dropped, two rows of two KV heads at once; after every call each counter is back at
    zero, and the next call on the same counters (the same state, one position on) is right too.  A counter left
    non-zero would make no program the last one: the outputs would stay NaN (the tests poison new buffers)."""
    if not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend")
    from kvpop_kernels import decode as dec

    gen = torch.Generator().manual_seed(17)
    N, Hkv, G, D, s, w, k = 2, 2, 2, 16, 2, 4, 58  # B = 64: four chunks of 16 slots with num_splits=4
    rows = [_warm_state(Hkv, G, D, s, w, k, 200, torch.float32, gen) for _ in range(N)]
    state0 = [torch.stack([r[i] for r in rows]) for i in range(4)]
    for i, slot in enumerate((7, 20, 41, 63)):  # long-range slots in splits 0, 1, 2, 3 of four
        state, ref_state = clone_state(state0), clone_state(state0)
        prio = torch.linspace(1.0, 2.0, k).repeat(N, Hkv, 1)
        prio[:, :, slot - s - w] = 0.5  # the lowest of every head
        state[3].copy_(prio)
        ref_state[3].copy_(prio)
        for pos, keep in ((200 + 2 * i, i % 2 == 0), (201 + 2 * i, i % 2 == 1)):  # two calls, same counters
            q = (4.0 * state[0][:, :, slot]).repeat_interleave(G, dim=1) + 0.1 * torch.randn(N, Hkv * G, D,
                                                                                             generator=gen)
            kn, vn = torch.randn(N, Hkv, D, generator=gen), torch.randn(N, Hkv, D, generator=gen)
            lp = torch.full((N, Hkv), 0.75 if keep else 0.25)
            lp[1, 0] = 0.25 if keep else 0.75  # one head of the other row decides the other way
            ref = [reference.fixed_budget_decode(q[n], kn[n], vn[n], *(t[n] for t in ref_state), lp[n].clone(),
                                                 pos=pos, sinks=s, window=w) for n in range(N)]
            o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=torch.full((N,), pos), sinks=s,
                                       window=w, num_splits=num_splits, block_n=16)
            assert_close_rms(o, torch.stack([r[0] for r in ref]))
            assert_close_rms(l, torch.stack([r[1] for r in ref]))
            assert_same_state(state, ref_state, pos)
            assert (int(state[2][0, 0, slot]) == pos - w) == keep  # the leaving token took the slot, or not
            assert int(dec.ticket_counters(q.device, N * Hkv)[:N * Hkv].abs().sum()) == 0  # reset for the next call


def test_empty_slots_are_ignored(backend):
    """Whatever an empty slot holds (NaN here) never reaches the output."""
    gen = torch.Generator().manual_seed(11)
    Hkv, G, D, s, w, k = 2, 2, 16, 2, 4, 3
    B = s + w + k
    state = empty_cache(Hkv, B, D, k, fill=float("nan"))
    ref_state = empty_cache(Hkv, B, D, k)
    kw = {"block_n": 16} if backend == "triton" else {}
    for pos in range(12):
        q, kn, vn, lp = random_step_inputs(Hkv * G, Hkv, D, gen=gen)
        ro, rl = reference.fixed_budget_decode(q, kn, vn, *ref_state, lp.clone(), pos=pos, sinks=s, window=w)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=s, window=w, **kw)
        assert_close_rms(o, ro)
        assert_close_rms(l, rl)
        assert torch.equal(state[2], ref_state[2]) and torch.equal(state[3], ref_state[3])
        valid = state[2] >= 0
        assert torch.equal(state[0][valid], ref_state[0][valid]) and torch.equal(state[1][valid], ref_state[1][valid])


def test_strided_cache_views(backend):
    """Caches that are views into larger buffers (any strides) are updated in place through the
    views; nothing outside them is touched."""
    gen = torch.Generator().manual_seed(13)
    Hkv, G, D, s, w, k = 2, 2, 16, 2, 3, 4
    B = s + w + k
    kbuf = torch.zeros(Hkv, B, 2 * D)  # k_cache = kbuf[..., :D]: slot stride 2D
    vbuf = torch.zeros(B, Hkv, D)  # v_cache = vbuf.transpose(0, 1): head stride D, slot stride Hkv*D
    pbuf = torch.full((B, Hkv), -1, dtype=torch.int32)  # slot_pos = pbuf.t()
    rbuf = torch.full((Hkv, 2 * k), float("-inf"))  # slot_prio = rbuf[:, ::2]
    state = [kbuf[..., :D], vbuf.transpose(0, 1), pbuf.t(), rbuf[:, ::2]]
    ref_state = empty_cache(Hkv, B, D, k)
    kw = {"block_n": 16, "num_splits": 2} if backend == "triton" else {}
    for pos in range(16):
        q, kn, vn, lp = random_step_inputs(Hkv * G, Hkv, D, gen=gen)
        ro, rl = reference.fixed_budget_decode(q, kn, vn, *ref_state, lp.clone(), pos=pos, sinks=s, window=w)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=s, window=w, **kw)
        assert_close_rms(o, ro)
        assert_close_rms(l, rl)
        assert_same_state([t.contiguous() for t in state], ref_state, pos)
    assert torch.equal(kbuf[..., D:], torch.zeros(Hkv, B, D))
    assert torch.isinf(rbuf[:, 1::2]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_caches(backend, dtype):
    """16-bit caches: bit-exact cache updates, fp32 accumulation (upcast after the loads)."""
    kw = {"block_n": 16} if backend == "triton" else {}
    run_and_compare(2, 2, 32, 2, 4, 5, 14, dtype=dtype, atol=1e-2, rtol=1e-2, rms=1e-2, **kw)


def test_triton_native_fp16_dot(monkeypatch):
    """The GPU's 16-bit ``tl.dot`` branch (no upcast, probabilities cast to the cache dtype),
    run in the interpreter with float16 (its numpy arithmetic is real, unlike bfloat16's)."""
    if HAS_CUDA or not kutils.interpreting():
        pytest.skip("interpreter-only check (on CUDA the gpu tests run this branch)")
    monkeypatch.setattr(splitk, "NATIVE_DOT_IN_INTERPRETER", True)
    run_and_compare(2, 4, 64, 2, 4, 5, 14, dtype=torch.float16, atol=1e-2, rtol=1e-2, rms=1e-2, block_n=16)


def test_scale_argument(backend):
    gen = torch.Generator().manual_seed(2)
    Hkv, G, D, s, w, k = 1, 2, 16, 1, 3, 2
    B = s + w + k
    state, ref_state = empty_cache(Hkv, B, D, k), empty_cache(Hkv, B, D, k)
    kw = {"block_n": 16} if backend == "triton" else {}
    for pos in range(8):
        q, kn, vn, lp = random_step_inputs(Hkv * G, Hkv, D, gen=gen)
        ro, rl = reference.fixed_budget_decode(q, kn, vn, *ref_state, lp.clone(), pos=pos, sinks=s, window=w,
                                               scale=0.7)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=s, window=w, scale=0.7, **kw)
        assert_close_rms(o, ro)
        assert_close_rms(l, rl)


# ----------------------------------------------------------- tie to the eviction schedule
def _decode_sequence_and_check_schedule(Hkv, s, w, k, S, priority, **kw):
    """Decode ``S`` tokens with ``leaving_prio = priority[:, pos - w]``; at every step the long-range
    slots must hold exactly ``{t : s <= t <= q - w, evict_at[t] > q}`` (q = pos)."""
    D, G = 8, 1
    evict_at = eviction_schedule(priority[None], sinks=s, window=w, k=k)[0].long()  # [Hkv, S]
    state = empty_cache(Hkv, s + w + k, D, k)
    gen = torch.Generator().manual_seed(0)
    t_all = torch.arange(S)
    for pos in range(S):
        q, kn, vn, _ = random_step_inputs(Hkv * G, Hkv, D, gen=gen)
        # tag each token's key with its position so the slot contents can be checked too
        kn[:, 0] = float(pos)
        lp = priority[:, pos - w].clone() if pos - w >= 0 else torch.zeros(Hkv)
        fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=s, window=w, **kw)
        slot_pos = state[2]
        for h in range(Hkv):
            lr = slot_pos[h, s + w:]
            got = sorted(int(t) for t in lr if t >= 0)
            want = t_all[(t_all >= s) & (t_all <= pos - w) & (evict_at[h] > pos)].tolist()
            assert got == want, f"head {h}, q={pos}: long-range slots {got} != schedule {want}"
            win = sorted(int(t) for t in slot_pos[h, :s + w] if t >= 0)
            assert win == list(range(0, min(s, pos + 1))) + list(range(max(s, pos - w + 1), pos + 1))
            filled = slot_pos[h] >= 0
            assert torch.equal(state[0][h, filled, 0], slot_pos[h, filled].float())
            prio_kept = state[3][h][lr >= 0]
            want_p = priority[h, lr[lr >= 0].long()]
            want_p = torch.where(torch.isnan(want_p), torch.full_like(want_p, float("-inf")), want_p)
            assert torch.equal(prio_kept, want_p)


def _schedule_priorities(Hkv, S, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, 6, (Hkv, S), generator=g).float()  # ties
    p[torch.rand(Hkv, S, generator=g) < 0.1] = float("nan")
    return p


@pytest.mark.parametrize("s,w,k,S", [(4, 8, 10, 90), (0, 5, 3, 60), (2, 6, 0, 30), (3, 4, 1, 40)])
def test_decode_follows_schedule_torch(monkeypatch, s, w, k, S):
    monkeypatch.setattr(kutils, "interpreting", lambda: False)
    _decode_sequence_and_check_schedule(3, s, w, k, S, _schedule_priorities(3, S, S + k))


def test_decode_follows_schedule_triton():
    if not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend")
    S = 40
    _decode_sequence_and_check_schedule(2, 2, 5, 6, S, _schedule_priorities(2, S, 9), block_n=16, num_splits=2)


# ------------------------------------------------------------------------------ guards
def _good_args(Hq=4, Hkv=2, D=16, s=2, w=4, k=3, dtype=torch.float32):
    B = s + w + k
    return dict(q=torch.randn(Hq, D, dtype=dtype), k_new=torch.randn(Hkv, D, dtype=dtype),
                v_new=torch.randn(Hkv, D, dtype=dtype), k_cache=torch.zeros(Hkv, B, D, dtype=dtype),
                v_cache=torch.zeros(Hkv, B, D, dtype=dtype),
                slot_pos=torch.full((Hkv, B), -1, dtype=torch.int32),
                slot_prio=torch.full((Hkv, k), float("-inf")), leaving_prio=torch.zeros(Hkv),
                pos=0, sinks=s, window=w)


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.randn(4, 16, 1, 1)), ValueError, "q must be 2-D"),
    (dict(q=torch.randn(1, 4, 16)), ValueError, "k_new must be 3-D"),
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.randn(3, 16)), ValueError, "multiple of the number of KV heads"),
    (dict(k_new=torch.randn(2, 15)), ValueError, r"k_new must be \[Hkv, D\]"),
    (dict(v_new=torch.randn(3, 16)), ValueError, r"v_new must be \[Hkv, D\]"),
    (dict(k_cache=torch.zeros(2, 9, 8)), ValueError, "k_cache and v_cache"),
    (dict(v_cache=torch.zeros(2, 8, 16)), ValueError, "k_cache and v_cache"),
    (dict(slot_pos=torch.full((2, 9), -1, dtype=torch.int64)), ValueError, "slot_pos must have dtype"),
    (dict(slot_pos=torch.full((2, 8), -1, dtype=torch.int32)), ValueError, r"slot_pos must be \[Hkv, B\]"),
    (dict(slot_prio=torch.zeros(2, 4)), ValueError, r"slot_prio must be \[Hkv, k\]"),
    (dict(slot_prio=torch.zeros(2, 3, dtype=torch.float64)), ValueError, "slot_prio must have dtype"),
    (dict(leaving_prio=torch.zeros(3)), ValueError, r"leaving_prio must be \[Hkv\]"),
    (dict(leaving_prio=torch.zeros(2, dtype=torch.bfloat16)), ValueError, "leaving_prio must have dtype"),
    (dict(k_new=torch.randn(2, 16, dtype=torch.bfloat16)), ValueError, "k_new must have q's dtype"),
    (dict(q=torch.randn(4, 16, dtype=torch.float64)), ValueError, "q must be float16, bfloat16 or float32"),
    (dict(pos=-1), ValueError, "pos must be >= 0"),
    (dict(pos=1.0), TypeError, "pos must be an int"),
    (dict(pos=2**31), ValueError, "pos must fit"),
    (dict(window=0), ValueError, "window must be >= 1"),
    (dict(sinks=-1), ValueError, "sinks must be >= 0"),
    (dict(window=8, slot_prio=torch.zeros(2, 0)), ValueError, "must be >= sinks \\+ window"),
    (dict(scale=-1.0), ValueError, "scale must be a positive"),
])
def test_guards(change, exc, match):
    args = _good_args()
    args.update(change)
    with pytest.raises(exc, match=match):
        decode_flat(**args)


def test_guard_requires_grad():
    args = _good_args()
    args["k_cache"].requires_grad_(True)
    with pytest.raises(ValueError, match="must not require grad"):
        decode_flat(**args)


def test_guard_num_splits():
    if not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend")
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        decode_flat(**_good_args(), num_splits=0)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        decode_flat(**_good_args(), block_n=24)


# ------------------------------------------------------------ GPU compile without a GPU
@pytest.mark.slow
def test_kernels_compile_for_gpu():
    """The fused step's kernel goes through the whole CUDA compiler (TTIR -> PTX -> ptxas, sm_90 and sm_80) without a
    GPU, the uniform and the packed layout, float and quantised slots (int8; fp8 e4m3 on sm_90), odd G and head_dim: the
    type/layout errors the interpreter does not see.  ``benchmarks/tools/registers.py`` does it and reports each
    kernel's registers and spills (docs/DESIGN.md section 9 quotes it)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "benchmarks.tools.registers"], env=env, cwd=root, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    if "configuration" not in res.stdout:
        pytest.skip(res.stdout.strip())
    rows = [line.split() for line in res.stdout.splitlines()[1:]]
    assert len(rows) == 9, res.stdout  # one fused kernel per configuration
    for row in rows:
        assert row[-2].isdigit() and int(row[-2]) <= 255 and re.fullmatch(r"\d+/\d+", row[-1]), row


# -------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("G,D", [(4, 128), (1, 64), (8, 60)])
def test_gpu_bf16_steps(G, D):
    """bf16 on the GPU: many steps from empty with small slots, reference on CPU copies."""
    run_and_compare(4, G, D, 4, 16, 24, 90, dtype=torch.bfloat16, device="cuda",
                    atol=2e-2, rtol=2e-2, rms=2e-2, seed=G)


def full_state(Hkv, D, s, w, k, pos, dtype, gen):
    """A consistent full cache just before the step at ``pos`` (``pos >= s + w + k``): sinks, the
    last ``w`` tokens in the ring, ``k`` distinct older tokens with tied priorities in the
    long-range slots (in random slot order)."""
    B = s + w + k
    kc = torch.randn(Hkv, B, D, generator=gen).to(dtype)
    vc = torch.randn(Hkv, B, D, generator=gen).to(dtype)
    slot_pos = torch.empty(Hkv, B, dtype=torch.int32)
    slot_pos[:, :s] = torch.arange(s, dtype=torch.int32)
    ring_t = torch.arange(pos - w, pos)
    slot_pos[:, s + (ring_t - s) % w] = ring_t.to(torch.int32)
    for h in range(Hkv):
        slot_pos[h, s + w:] = (torch.randperm(pos - w - s, generator=gen)[:k] + s).to(torch.int32)
    slot_prio = torch.randint(0, 50, (Hkv, k), generator=gen).float()
    return [kc, vc, slot_pos, slot_prio]


def _full_budget_steps(device, dtype, Hkv, G, D, s, w, k, tol, **kw):
    """Four steps from a full cache (reference on CPU copies), keeping the leaving token every
    other step (otherwise it competes with tied priorities)."""
    gen = torch.Generator().manual_seed(0)
    pos0 = 3 * (s + w + k)
    ref_state = full_state(Hkv, D, s, w, k, pos0, dtype, gen)
    state = clone_state(ref_state, device)
    for i, pos in enumerate(range(pos0, pos0 + 4)):
        q, kn, vn, _ = random_step_inputs(Hkv * G, Hkv, D, dtype, gen=gen)
        lp = torch.randint(0, 50, (Hkv,), generator=gen).float() + 30.0 * (i % 2)
        ro, rl = reference.fixed_budget_decode(q, kn, vn, *ref_state, lp.clone(), pos=pos, sinks=s, window=w)
        o, l = fixed_budget_decode(q.to(device), kn.to(device), vn.to(device), SlotState(*state), lp.to(device),
                                   pos=pos, sinks=s, window=w, **kw)
        assert_close_rms(o.cpu(), ro, tol, tol, tol)
        assert_close_rms(l.cpu(), rl, tol, tol, tol)
        assert_same_state(state, ref_state, pos)


def test_full_budget_bf16_small(backend):
    """The GPU test below at a small size: bf16, a full cache, the default split plan."""
    _full_budget_steps("cpu", torch.bfloat16, 2, 4, 64, 4, 16, 300, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2048 - 4 - 256, 4096 - 4 - 256])
def test_gpu_bf16_qwen3_budget(k):
    """Qwen3-8B shapes (32 / 8 heads, D 128, bf16) at a full budget, default split plan."""
    _full_budget_steps("cuda", torch.bfloat16, 8, 4, 128, 4, 256, k, 2e-2)


@pytest.mark.gpu
def test_gpu_fp32_full_budget():
    """fp32 caches on the GPU go through the upcast path (``input_precision="ieee"``): tight tolerance."""
    _full_budget_steps("cuda", torch.float32, 8, 4, 128, 4, 256, 2048 - 260, 1e-4)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """The step has no host synchronisation: it can be captured in a CUDA graph and replayed."""
    gen = torch.Generator().manual_seed(1)
    Hkv, G, D, s, w, k = 8, 4, 128, 4, 64, 200
    pos = 1000
    st = full_state(Hkv, D, s, w, k, pos, torch.bfloat16, gen)
    state, ref_state = clone_state(st, "cuda"), clone_state(st, "cuda")
    q, kn, vn, lp = (t.cuda() for t in random_step_inputs(Hkv * G, Hkv, D, torch.bfloat16, nan=False, gen=gen))
    fixed_budget_decode(q, kn, vn, SlotState(*clone_state(st, "cuda")), lp, pos=pos, sinks=s, window=w)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=s, window=w)
    for t, t0 in zip(state, st):  # capture does not run the kernels: restore the state, then replay
        t.copy_(t0)
    g.replay()
    ro, rl = fixed_budget_decode(q, kn, vn, SlotState(*ref_state), lp, pos=pos, sinks=s, window=w)
    torch.cuda.synchronize()
    assert torch.equal(o, ro) and torch.equal(l, rl)
    assert_same_state(state, ref_state, pos)
