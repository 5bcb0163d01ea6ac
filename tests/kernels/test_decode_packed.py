"""``fixed_budget_decode(head_budgets=...)``: the packed layout of head-adaptive budgets.

Every step is compared with ``reference.fixed_budget_decode(head_budgets=...)`` (a plain loop over the
heads of the uniform reference): outputs, LSE and the whole packed state bit for bit, over many steps
from an empty cache through the first evictions, rows of a batch at different positions, ties and NaN
priorities, heads with ``k_h = 0``.  Both backends (the Triton kernels through the interpreter, the
PyTorch CPU path).  Equal budgets give the uniform kernel's results; the index guards behave as the
uniform kernel's (``test_index_guards.py``).
"""
from __future__ import annotations

import pytest
import torch
from test_decode_kernel import assert_close_rms, decode_flat

import kvpop_kernels._utils as kutils
from kvpop_kernels import SlotState, fixed_budget_decode, reference

HAS_CUDA = torch.cuda.is_available()


def packed_state(N, budgets, D, s, w, fill=0.0, dtype=torch.float32):
    T = sum(budgets)
    K = T - len(budgets) * (s + w)
    return [torch.full((N, T, D), fill, dtype=dtype), torch.full((N, T, D), fill, dtype=dtype),
            torch.full((N, T), -1, dtype=torch.int32), torch.full((N, K), float("-inf"))]


def step_inputs(N, Hkv, G, D, gen, *, ties=True):
    q = torch.randn(N, Hkv * G, D, generator=gen)
    kn = torch.randn(N, Hkv, D, generator=gen)
    vn = torch.randn(N, Hkv, D, generator=gen)
    lp = torch.randint(0, 3, (N, Hkv), generator=gen).float() if ties else torch.randn(N, Hkv, generator=gen)
    u = torch.rand(N, Hkv, generator=gen)
    lp = torch.where(u < 0.12, torch.full_like(lp, float("nan")), lp)
    lp = torch.where((u >= 0.12) & (u < 0.17), torch.full_like(lp, float("-inf")), lp)
    return q, kn, vn, lp


def run_packed(budgets, G, D, s, w, steps, *, N=3, start=(0, 4, 11), seed=0, ties=True, as_tensor=False,
               device="cpu", dtype=torch.float32, tol=(1e-4, 1e-5, 1e-5), **kw):
    """Step a batch of ``N`` rows (at positions ``start``) and every row through the reference (on CPU copies)."""
    gen = torch.Generator().manual_seed(seed)
    Hkv = len(budgets)
    rows = [[t[0].clone() for t in packed_state(1, budgets, D, s, w, dtype=dtype)] for _ in range(N)]
    state = [t.to(device) for t in packed_state(N, budgets, D, s, w, dtype=dtype)]
    pos = torch.tensor(start[:N], dtype=torch.int64)
    hb = torch.tensor(budgets, device=device) if as_tensor else budgets
    for _ in range(steps):
        q, kn, vn, lp = (x.to(dtype) if x.is_floating_point() and x.dim() == 3 else x
                         for x in step_inputs(N, Hkv, G, D, gen, ties=ties))
        o, l = fixed_budget_decode(q.to(device), kn.to(device), vn.to(device), SlotState(*state), lp.to(device),
                                   pos=pos.to(device), sinks=s, window=w, head_budgets=hb, **kw)
        assert o.shape == (N, Hkv * G, D) and l.shape == (N, Hkv * G) and l.dtype == torch.float32
        for n in range(N):
            ro, rl = reference.fixed_budget_decode(q[n], kn[n], vn[n], *rows[n], lp[n].clone(), pos=int(pos[n]),
                                                   sinks=s, window=w, head_budgets=budgets)
            assert_close_rms(o[n].cpu(), ro, *tol)
            assert_close_rms(l[n].cpu(), rl, *tol)
            for name, a, b in zip(("k_cache", "v_cache", "slot_pos", "slot_prio"), state, rows[n]):
                assert torch.equal(a[n].cpu(), b), f"{name} of row {n} differs from the reference at pos {int(pos[n])}"
        pos = pos + 1
    return state


CASES = [
    # budgets as (s + w) + k_h, G, D, s, w, steps
    pytest.param((0, 5, 17), 2, 24, 2, 3, 30, id="Hkv3-G2-D24-k0,5,17"),
    pytest.param((0, 5, 17), 2, 40, 4, 5, 28, id="Hkv3-G2-D40-k0,5,17"),
    pytest.param((9, 0, 2, 0), 1, 24, 1, 4, 22, id="Hkv4-mha-k9,0,2,0"),
    pytest.param((0, 0, 0), 3, 16, 2, 3, 14, id="all-k0"),
    pytest.param((3, 30), 4, 20, 0, 3, 38, id="s0-skewed"),
]


@pytest.mark.parametrize("ks,G,D,s,w,steps", CASES)
def test_packed_steps_match_reference(backend, ks, G, D, s, w, steps):
    budgets = tuple(s + w + k for k in ks)
    kw = {"block_n": 16, "num_splits": 3} if backend == "triton" else {}
    run_packed(budgets, G, D, s, w, steps, **kw)


def test_packed_distinct_priorities_and_tensor_budgets(backend):
    """Budgets as a tensor give the tuple's results (distinct priorities: no tie decides)."""
    budgets = (5 + 3, 5 + 11, 5 + 1)
    kw = {"block_n": 16} if backend == "triton" else {}
    run_packed(budgets, 2, 24, 2, 3, 24, ties=False, as_tensor=True, seed=5, **kw)


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (9, 16), (None, None)])
def test_triton_packed_splits(num_splits, block_n):
    """Splits cut over the largest head: the small heads' programs past their budget write empty partials."""
    if not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend")
    run_packed((5, 5 + 2, 5 + 40), 2, 24, 2, 3, 30, N=2, start=(0, 25), seed=2, num_splits=num_splits,
               block_n=block_n)


@pytest.mark.gpu
@pytest.mark.parametrize("as_tensor", [False, True])
def test_gpu_packed_bf16(as_tensor):
    """bf16 on the GPU, Qwen3-like groups (G = 4, D = 128), skewed budgets with a k_h = 0 head, default plan;
    the reference on CPU copies: the same cache state bit for bit, outputs to bf16 tolerance."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    s, w = 4, 16
    run_packed((s + w, s + w + 9, s + w + 70, s + w + 3), 4, 128, s, w, 120, N=3, start=(0, 40, 77), seed=6,
               as_tensor=as_tensor, device="cuda", dtype=torch.bfloat16, tol=(2e-2, 2e-2, 2e-2))


def test_equal_budgets_equal_the_uniform_layout(backend):
    """All budgets equal: the packed state is the uniform ``[N, Hkv, B, D]`` state flattened, step by step."""
    gen = torch.Generator().manual_seed(3)
    N, Hkv, G, D, s, w, k = 3, 3, 2, 40, 2, 4, 6
    B = s + w + k
    packed = packed_state(N, (B,) * Hkv, D, s, w)
    uniform = [packed[0].clone().view(N, Hkv, B, D), packed[1].clone().view(N, Hkv, B, D),
               packed[2].clone().view(N, Hkv, B), packed[3].clone().view(N, Hkv, k)]
    pos = torch.tensor([0, 3, 8])
    kw = {"block_n": 16, "num_splits": 2} if backend == "triton" else {}
    for _ in range(20):
        q, kn, vn, lp = step_inputs(N, Hkv, G, D, gen)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*packed), lp.clone(), pos=pos, sinks=s, window=w,
                                   head_budgets=(B,) * Hkv, **kw)
        uo, ul = fixed_budget_decode(q, kn, vn, SlotState(*uniform), lp.clone(), pos=pos, sinks=s, window=w, **kw)
        assert_close_rms(o, uo)
        assert_close_rms(l, ul)
        for a, b in zip(packed, uniform):
            assert torch.equal(a, b.reshape(a.shape))
        pos = pos + 1


def test_batch1_form(backend):
    gen = torch.Generator().manual_seed(4)
    s, w, budgets, D = 1, 3, (4, 9, 6), 16
    state = [t[0] for t in packed_state(1, budgets, D, s, w)]
    ref = [t.clone() for t in state]
    for p in range(14):
        q, kn, vn, lp = (x[0] for x in step_inputs(1, 3, 2, D, gen))
        o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp.clone(), pos=p, sinks=s, window=w,
                                   head_budgets=budgets)
        ro, rl = reference.fixed_budget_decode(q, kn, vn, *ref, lp.clone(), pos=p, sinks=s, window=w,
                                               head_budgets=budgets)
        assert o.shape == (6, D) and l.shape == (6,)
        assert_close_rms(o, ro)
        assert_close_rms(l, rl)
        for a, b in zip(state, ref):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------ guards and errors
S_, W_ = 2, 3
BUD_ = (S_ + W_ + 4, S_ + W_, S_ + W_ + 7)


def _filled(N=3, G=2, D=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    state = packed_state(N, BUD_, D, S_, W_)
    pos = torch.tensor([13, 9, 17][:N])
    for p in range(18):
        q, kn, vn, lp = step_inputs(N, len(BUD_), G, D, gen)
        row_pos = (pos - 18 + p)
        live = row_pos >= 0
        for n in range(N):
            if live[n]:
                reference.fixed_budget_decode(q[n], kn[n], vn[n], *[t[n] for t in state], lp[n],
                                              pos=int(row_pos[n]), sinks=S_, window=W_, head_budgets=BUD_)
    return state, pos, step_inputs(N, len(BUD_), G, D, gen)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's reductions over NaN
@pytest.mark.parametrize("bad", [-1, 2**31 - 1, 2**40])
def test_packed_guards_positions(backend, bad):
    """A bad position: refused on the host by default on the CPU; unchecked, that row writes nothing and
    returns NaN, the other rows equal the reference."""
    state, pos, (q, kn, vn, lp) = _filled()
    before = [t.clone() for t in state]
    pos[1] = bad
    with pytest.raises(ValueError, match="pos must lie"):
        fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=S_, window=W_, head_budgets=BUD_)
    for a, b in zip(state, before):
        assert torch.equal(a, b)
    o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp.clone(), pos=pos, sinks=S_, window=W_,
                               head_budgets=BUD_, check=False)
    assert torch.isnan(o[1]).all() and torch.isnan(l[1]).all()
    for a, b in zip(state, before):
        assert torch.equal(a[1], b[1])  # the refused row: nothing written
    for n in (0, 2):
        ref = [t[n].clone() for t in before]
        ro, rl = reference.fixed_budget_decode(q[n], kn[n], vn[n], *ref, lp[n].clone(), pos=int(pos[n]), sinks=S_,
                                               window=W_, head_budgets=BUD_)
        assert_close_rms(o[n], ro)
        assert_close_rms(l[n], rl)
        for a, b in zip(state, ref):
            assert torch.equal(a[n], b)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
@pytest.mark.parametrize("budgets", [(9, 5, 13), (9, 5, 11), (-4, 5, 26), (9, 40, 8), (30, 5, 1)])
def test_packed_budget_tensor_checked_and_guarded(backend, budgets):
    """A tensor of budgets that does not fit the tensors: ``ValueError`` when read on the host (the default on
    the CPU; always on the PyTorch path, which builds its indices from the values); unchecked on Triton
    the heads whose slots leave the tensors return NaN and write nothing, the others are exact."""
    state, pos, (q, kn, vn, lp) = _filled()
    before = [t.clone() for t in state]
    hb = torch.tensor(budgets)
    with pytest.raises(ValueError, match=r"head_budgets\[|head_budgets sum to"):
        fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=S_, window=W_, head_budgets=hb)
    if backend == "torch":
        with pytest.raises(ValueError, match=r"head_budgets\[|head_budgets sum to"):
            fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=pos, sinks=S_, window=W_, head_budgets=hb,
                                check=False)
        return
    o, l = fixed_budget_decode(q, kn, vn, SlotState(*state), lp.clone(), pos=pos, sinks=S_, window=W_,
                               head_budgets=hb, check=False)
    T, K, sw = state[0].shape[1], state[3].shape[1], S_ + W_
    want = [t.clone() for t in before]  # the good heads stepped by the uniform reference, the bad ones untouched
    off = koff = 0
    G = q.shape[1] // len(budgets)
    for h, b in enumerate(budgets):
        kh = b - sw
        good = kh >= 0 and off >= 0 and off + b <= T and koff >= 0 and koff + kh <= K
        heads = slice(h * G, (h + 1) * G)
        if good:
            for n in range(q.shape[0]):
                ro, rl = reference.fixed_budget_decode(
                    q[n, heads], kn[n, h:h + 1], vn[n, h:h + 1], want[0][n, off:off + b][None],
                    want[1][n, off:off + b][None], want[2][n, off:off + b][None], want[3][n, koff:koff + kh][None],
                    lp[n, h:h + 1].clone(), pos=int(pos[n]), sinks=S_, window=W_)
                assert_close_rms(o[n, heads], ro)
                assert_close_rms(l[n, heads], rl)
        else:
            assert torch.isnan(o[:, heads]).all() and torch.isnan(l[:, heads]).all()
        off, koff = off + b, koff + kh
    for name, a, b in zip(("k_cache", "v_cache", "slot_pos", "slot_prio"), state, want):
        assert torch.equal(a, b), f"{name}: a bad head wrote, or a good head differs from the reference"


def test_packed_errors():
    N, D = 2, 16
    state = packed_state(N, BUD_, D, S_, W_)
    q, kn, vn, lp = step_inputs(N, 3, 2, D, torch.Generator().manual_seed(0))

    def call(**over):
        a = dict(q=q, k_new=kn, v_new=vn, k_cache=state[0], v_cache=state[1], slot_pos=state[2],
                 slot_prio=state[3], leaving_prio=lp)
        hb = over.pop("head_budgets", BUD_)
        a.update(over)
        return decode_flat(**a, pos=0, sinks=S_, window=W_, head_budgets=hb)

    with pytest.raises(ValueError, match=r"head_budgets sum to 27"):
        call(head_budgets=(BUD_[0] + 1, BUD_[1], BUD_[2]))
    with pytest.raises(ValueError, match=r"head_budgets\[1\] = 4 must be >= sinks \+ window = 5"):
        call(head_budgets=(BUD_[0] + 1, 4, BUD_[2]))
    with pytest.raises(TypeError, match=r"head_budgets\[0\] must be an int"):
        call(head_budgets=(9.0, 5, 12))
    with pytest.raises(TypeError, match="head_budgets must be None, a tuple of ints or a 1-D int tensor"):
        call(head_budgets="9,5,12")
    with pytest.raises(ValueError, match="as a tensor must be 1-D int32/int64"):
        call(head_budgets=torch.tensor(BUD_, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"k_new must be \[N, Hkv, D\].*len\(head_budgets\)"):
        call(head_budgets=(13, 13))
    with pytest.raises(ValueError, match=r"k_cache is the packed \[N, T, D\]"):
        call(k_cache=state[0].view(N, 1, -1, D))
    with pytest.raises(ValueError, match=r"slot_prio must be \[N, K\] = \[2, 11\]"):
        call(slot_prio=state[3][:, :-1])
    with pytest.raises(ValueError, match=r"slot_pos must be \[N, T\]"):
        call(slot_pos=state[2][:, :-1])
    with pytest.raises(ValueError, match=r"leaving_prio must be \[N, Hkv\]"):
        call(leaving_prio=lp[:, :2])
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        call(v_cache=state[0])
