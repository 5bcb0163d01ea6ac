"""eviction_schedule / eviction_decisions against the brute-force reference and docs/DESIGN.md invariants."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpop_kernels
import kvpop_kernels._utils as kutils
from kvpop_kernels import NEVER, eviction_decisions, eviction_schedule, visible_at
from kvpop_kernels import reference as ref


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """Run a test through the Triton kernels (interpreter on CPU) and through the PyTorch CPU path."""
    if request.param == "torch":
        if torch.cuda.is_available():
            pytest.skip("the PyTorch path is the CPU path")
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    elif not (torch.cuda.is_available() or kutils.interpreting()):
        pytest.skip("no Triton backend")
    return request.param


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_against_reference(p, s, w, k):
    ev = eviction_schedule(p, sinks=s, window=w, k=k)
    y, bnd = eviction_decisions(p, sinks=s, window=w, k=k)
    ev_ref = ref.eviction_schedule(p.cpu(), sinks=s, window=w, k=k)
    y_ref, bnd_ref = ref.eviction_decisions(p.cpu(), sinks=s, window=w, k=k)
    assert ev.dtype == torch.int32 and y.dtype == torch.int8 and bnd.dtype == torch.int32
    assert ev.shape == y.shape == bnd.shape == p.shape
    torch.testing.assert_close(ev.cpu(), ev_ref, rtol=0, atol=0)
    torch.testing.assert_close(y.cpu(), y_ref, rtol=0, atol=0)
    torch.testing.assert_close(bnd.cpu(), bnd_ref, rtol=0, atol=0)
    mask = ref.visible_mask(ev_ref, sinks=s, window=w)  # [B, H, S, S]
    for q in range(p.shape[-1]):  # the one-query mask row (kvpop schedule's) is the oracle's row q
        assert torch.equal(visible_at(ev, q, sinks=s, window=w).cpu(), mask[..., q, :])
    return ev, y, bnd


CASES = [
    # S, sinks, window, k
    (1, 4, 8, 3),      # S < sinks
    (3, 4, 2, 2),      # S < sinks, tiny window
    (17, 2, 5, 3),
    (17, 4, 32, 3),    # S < window
    (63, 4, 8, 0),     # k = 0
    (63, 0, 1, 5),     # no sinks, window of one token
    (64, 4, 8, 100),   # budget >= S
    (63, 63, 4, 5),    # sinks == S
    (17, 30, 4, 2),    # sinks > S
    (63, 4, 63, 5),    # window == S
    (200, 4, 16, 11),
    (200, 0, 3, 1),    # k = 1
]


@pytest.mark.parametrize("S,s,w,k", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_matches_brute_force(backend, S, s, w, k, ties):
    g = torch.Generator().manual_seed(S * 7 + k)
    if ties:
        p = torch.randint(0, 3, (2, 3, S), generator=g).float()
    else:
        p = torch.randn(2, 3, S, generator=g)
    _check_against_reference(p.to(_dev()), s, w, k)


@pytest.mark.parametrize("ks", [(37, 0), (1, 1000)])
def test_long_sequence_matches_brute_force(backend, ks):
    """S = 1000 (not a power of two, ten levels of the tree), ties and NaN, a head-adaptive k with k = 0
    and k = S: against the brute force and the heap replay of decoding."""
    g = torch.Generator().manual_seed(1000 + ks[0])
    p = torch.randn(1, 2, 1000, generator=g)
    p[..., ::7] = p[..., 3::7][..., :p[..., ::7].shape[-1]]  # ties
    p[0, 0, 100:900:13] = float("nan")
    ev, y, bnd = _check_against_reference(p.to(_dev()), 4, 16, list(ks))
    ev_h, y_h, bnd_h = ref.eviction_replay(p, sinks=4, window=16, k=list(ks))
    assert torch.equal(ev.cpu(), ev_h) and torch.equal(y.cpu(), y_h) and torch.equal(bnd.cpu(), bnd_h)


@pytest.mark.parametrize("S", [1, 2, 17, 64, 65, 300])
def test_replay_oracle_is_the_brute_force(S):
    """The heap replay (the oracle of long sequences) against the per-query brute force."""
    p = torch.randint(0, 4, (2, 3, S)).float()
    p[0, 1, ::5] = float("nan")
    for s, w, k in ((2, 5, 3), (0, 1, [0, 4, 2 * S])):
        ev, y, bnd = ref.eviction_replay(p, sinks=s, window=w, k=k)
        assert torch.equal(ev, ref.eviction_schedule(p, sinks=s, window=w, k=k))
        y_ref, bnd_ref = ref.eviction_decisions(p, sinks=s, window=w, k=k)
        assert torch.equal(y, y_ref) and torch.equal(bnd, bnd_ref)


def test_signed_zeros_tie():
    """-0.0 == +0.0: the two tie (newer wins) on every path, whatever a sort does with the sign bit."""
    p = torch.tensor([[[0.0, -0.0, 0.0, -0.0, 1.0, -0.0, 0.0, -0.0, -0.0, 0.0, 0.0, -0.0]]])
    want = ref.eviction_schedule(p.abs(), sinks=1, window=2, k=2)
    y_want, b_want = ref.eviction_decisions(p.abs(), sinks=1, window=2, k=2)
    assert torch.equal(ref.eviction_schedule(p, sinks=1, window=2, k=2), want)
    # the sorts see no sign bit (a GPU radix sort orders -0.0 below +0.0; the CPU sort does not)
    from kvpop_kernels import schedule as sc

    assert not torch.signbit(sc._clean(p[0], 0)).any()
    if kutils.interpreting():
        pf = torch.empty(1, 12)
        sc._prep_kernel[(1, 1)](p, pf, 12, 1, BLOCK=16)
        assert torch.equal(pf[0, :-1], p[0, 0, 1:].abs().flip(-1)) and pf[0, -1] == float("-inf")
        assert not torch.signbit(pf[0, :-1]).any()
    for interp in (False, True):
        if interp and not kutils.interpreting():
            continue
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kutils, "interpreting", lambda v=interp: v)
            assert torch.equal(eviction_schedule(p, sinks=1, window=2, k=2), want)
            y, bnd = eviction_decisions(p, sinks=1, window=2, k=2)
            assert torch.equal(y, y_want) and torch.equal(bnd, b_want)


def test_cpu_path_in_row_batches(monkeypatch):
    """The CPU path runs a few rows at a time (its arrays stay in the cache): batches of one and of two
    rows, a per-head k, give the reference's schedule and decisions."""
    from kvpop_kernels import schedule as sc

    monkeypatch.setattr(kutils, "interpreting", lambda: False)
    p = torch.randint(0, 4, (3, 2, 40)).float()
    threads = torch.get_num_threads()
    seen = []
    real_rows = sc._torch_rows
    monkeypatch.setattr(sc, "_torch_rows", lambda pr, *a: seen.append(pr.shape[0]) or real_rows(pr, *a))
    try:  # rows per pass: max(the cache's chunk / S, the intra-op threads), the last pass what is left
        for chunk, n_threads, want in ((40, 1, [1] * 6), (80, 1, [2] * 3), (40, 4, [4, 2])):
            monkeypatch.setattr(sc, "_CPU_CHUNK", chunk)
            torch.set_num_threads(n_threads)
            seen.clear()
            _check_against_reference(p, 2, 3, [3, 0])
            assert seen[:len(want)] == want, (chunk, n_threads, seen)
    finally:
        torch.set_num_threads(threads)


def test_triton_and_torch_build_the_same_tree():
    """The Triton path's levels (a sort of the level keys + running counts) equal the CPU path's
    (a stable partition per level), for the tree of ``perm`` and of ``rank``."""
    from kvpop_kernels import schedule as sc

    if not kutils.interpreting():
        pytest.skip("the Triton path runs on CPU tensors through the interpreter")
    for S in (1, 2, 5, 64, 100):
        p = torch.randint(0, 5, (2, 2, S)).float()
        perm, rank = sc._torch_order(p.double().view(4, S), 1)
        for of_perm in (True, False):
            perm_t, rank_t, Z = sc._triton_tree(p, 1, of_perm=of_perm)
            assert torch.equal(perm_t.long(), perm) and torch.equal(rank_t.long(), rank)
            assert torch.equal(Z.long(), torch.stack(sc._torch_tree(perm if of_perm else rank), 1))


_priorities = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5]),  # heavy ties (and signed zeros, which tie)
    st.floats(-4, 4, allow_nan=False, width=32),
    st.sampled_from([float("inf"), float("-inf"), float("nan")]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    S=st.integers(0, 48),
    s=st.integers(0, 5),
    w=st.integers(1, 12),
    k=st.integers(0, 10),
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
)
def test_hypothesis_matches_brute_force(backend, data, S, s, w, k, batch, heads):
    vals = data.draw(st.lists(_priorities, min_size=batch * heads * S, max_size=batch * heads * S))
    p = torch.tensor(vals, dtype=torch.float32).view(batch, heads, S)
    if data.draw(st.booleans()):  # head-adaptive: one k per KV head
        k = data.draw(st.lists(st.integers(0, 60), min_size=heads, max_size=heads))
    _check_against_reference(p.to(_dev()), s, w, k)


def test_nan_ranks_as_negative_infinity(backend):
    p = torch.randn(1, 2, 80)
    p[0, 0, 10:30:3] = float("nan")
    p[0, 1, 5:60:2] = float("nan")
    q = torch.where(torch.isnan(p), torch.full_like(p, float("-inf")), p)
    a = eviction_schedule(p.to(_dev()), sinks=4, window=6, k=5)
    b = eviction_schedule(q.to(_dev()), sinks=4, window=6, k=5)
    assert torch.equal(a, b)
    # a NaN token never displaces a kept finite one
    ev = a.cpu()[0, 0]
    for t in range(10, 30, 3):
        assert ev[t] == t + 6


@pytest.mark.parametrize("S,s,w,k", [(120, 4, 8, 7), (50, 2, 10, 0), (90, 0, 3, 20)])
def test_constant_score_is_streaming(backend, S, s, w, k):
    """A constant scorer makes KVpop a sink + sliding window of w + k tokens (ties go to the newer)."""
    p = torch.full((1, 2, S), 3.5)
    ev = eviction_schedule(p.to(_dev()), sinks=s, window=w, k=k).cpu()
    vis = ref.visible_mask(ev, sinks=s, window=w)
    qq = torch.arange(S).view(S, 1)
    tt = torch.arange(S).view(1, S)
    streaming = (tt <= qq) & ((tt < s) | (tt > qq - (w + k)))
    assert torch.equal(vis[0, 0], streaming) and torch.equal(vis[0, 1], streaming)


@pytest.mark.parametrize("S,s,w,k", [(150, 4, 8, 9), (150, 1, 20, 3), (40, 4, 4, 1)])
def test_invariants(backend, S, s, w, k):
    p = torch.randn(2, 2, S)
    ev, y, bnd = (x.cpu() for x in _check_against_reference(p.to(_dev()), s, w, k))
    # no query ever sees more than B = s + w + k keys
    vis = ref.visible_mask(ev, sinks=s, window=w)
    assert int(vis.sum(-1).max()) <= s + w + k
    # sinks are never evicted; tokens still in the window at the end are NEVER
    assert (ev[..., :s] == NEVER).all()
    assert (ev[..., max(S - w, 0):] == NEVER).all()
    # where a decision exists, y = +1 exactly when the token survives its own step
    t = torch.arange(S).expand_as(ev)
    decided = y != 0
    assert decided.any()
    assert torch.equal((y == 1)[decided], (ev > t + w)[decided])
    # bnd is the lowest-ranked member of the long-range set just before t competes
    for b in range(2):
        for h in range(2):
            for tok in torch.nonzero(decided[b, h]).flatten().tolist():
                kept = [u for u in range(s, tok) if ev[b, h, u] >= tok + w]
                assert len(kept) == k
                low = min(kept, key=lambda u: (float(p[b, h, u]), u))
                assert int(bnd[b, h, tok]) == low
    # no decision without a full long-range set
    assert (bnd[~decided] == -1).all()


def test_evicted_tokens_never_return(backend):
    p = torch.randn(1, 3, 120)
    ev = eviction_schedule(p.to(_dev()), sinks=4, window=8, k=6).cpu()
    vis = ref.visible_mask(ev, sinks=4, window=8)[0]  # [H, q, t]
    # once a key disappears from a query's view it stays out for every later query
    seen_then_gone = vis[:, :-1, :] & ~vis[:, 1:, :]
    came_back = torch.zeros_like(vis[:, 0, :])
    for q in range(1, 119):
        came_back |= (vis[:, q, :] & ~vis[:, q - 1, :]) & (torch.arange(120) < q)
    assert seen_then_gone.any() and not came_back.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_float_dtypes(backend, dtype):
    p = torch.randint(-20, 20, (1, 2, 60)).to(dtype)  # exactly representable in every dtype
    _check_against_reference(p.to(_dev()), 4, 6, 5)


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(priority=torch.zeros(3, 5)), ValueError, "priority must be 3-D"),
        (dict(priority=torch.zeros(1, 2, 5, dtype=torch.int32)), ValueError, "floating"),
        (dict(priority=[[[0.0]]]), TypeError, "torch.Tensor"),
        (dict(window=0), ValueError, "window must be >= 1"),
        (dict(sinks=-1), ValueError, "sinks must be >= 0"),
        (dict(k=-2), ValueError, "k must be >= 0"),
        (dict(k=2.0), TypeError, "k must be an int"),
    ],
)
def test_bad_input(kwargs, err, match):
    args = dict(priority=torch.zeros(1, 2, 5), sinks=1, window=2, k=1)
    args.update(kwargs)
    prio = args.pop("priority")
    for fn in (eviction_schedule, eviction_decisions):
        with pytest.raises(err, match=match):
            fn(prio, **args)


def test_visible_at_bad_input():
    ev = torch.full((1, 2, 5), NEVER, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"0 <= q < S = 5, got 5"):
        visible_at(ev, 5, sinks=1, window=2)
    with pytest.raises(ValueError, match="int32/int64"):
        visible_at(ev.float(), 0, sinks=1, window=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        visible_at([NEVER], 0, sinks=1, window=2)
    with pytest.raises(ValueError, match="window must be >= 1"):
        visible_at(ev, 0, sinks=1, window=0)


def test_public_api_exports_never():
    assert kvpop_kernels.NEVER == 2**31 - 1 == ref.NEVER


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1000, 4096])
def test_gpu_matches_cpu_path(S):
    p = torch.randn(2, 8, S)
    tie = torch.arange(0, S - 3, 7)
    p[:, :, tie] = p[:, :, tie + 3]  # some ties (any S: the first GPU run found S = 4096 broke the slicing)
    kw = dict(sinks=4, window=256, k=300)
    ev_cpu, y_cpu, b_cpu = ref.eviction_replay(p, **kw)
    ev = eviction_schedule(p.cuda(), **kw).cpu()
    y, bnd = (x.cpu() for x in eviction_decisions(p.cuda(), **kw))
    assert torch.equal(ev, ev_cpu)
    assert torch.equal(y, y_cpu)
    assert torch.equal(bnd, b_cpu)
    for dtype in (torch.bfloat16, torch.float16):  # half-precision priorities rank exactly in float32
        ph = p.to(dtype)
        ev_h, y_h, b_h = ref.eviction_replay(ph, **kw)
        assert torch.equal(eviction_schedule(ph.cuda(), **kw).cpu(), ev_h)
        y, bnd = (x.cpu() for x in eviction_decisions(ph.cuda(), **kw))
        assert torch.equal(y, y_h) and torch.equal(bnd, b_h)


# ------------------------------------------------------------------ per-head k (head-adaptive budgets)
def _definition_mask(p, s, w, ks):
    """The mask straight from docs/DESIGN.md section 2, per head with its own k: query q sees the sinks,
    its window and the top k[h] of E(q) = {s <= t <= q - w} (ties to the newer token, NaN as -inf)."""
    p = torch.nan_to_num(p.double().cpu(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    Bsz, H, S = p.shape
    vis = torch.zeros(Bsz, H, S, S, dtype=torch.bool)
    for b in range(Bsz):
        for h in range(H):
            pr = p[b, h].tolist()
            for q in range(S):
                elig = sorted(range(s, q - w + 1), key=lambda t: (pr[t], t), reverse=True)
                for t in elig[: ks[h]]:
                    vis[b, h, q, t] = True
                for t in range(q + 1):
                    if t < s or t > q - w:
                        vis[b, h, q, t] = True
    return vis


def _per_head_uniform(p, s, w, ks):
    """The uniform-k ops run one head at a time, each with its own k."""
    evs, ys, bnds = [], [], []
    for h, kh in enumerate(ks):
        ph = p[:, h:h + 1].contiguous()
        evs.append(eviction_schedule(ph, sinks=s, window=w, k=kh))
        y, bnd = eviction_decisions(ph, sinks=s, window=w, k=kh)
        ys.append(y)
        bnds.append(bnd)
    return torch.cat(evs, 1), torch.cat(ys, 1), torch.cat(bnds, 1)


HEAD_K_CASES = [
    # S, sinks, window, k per head
    (37, 4, 8, (0, 3, 40)),            # k = 0, a k >= S
    (37, 2, 5, (7, 0, 1, 29, 2)),      # H = 5, one head with k = S - s - w (never evicts)
    (129, 4, 16, (11, 0, 200)),
    (129, 0, 1, (64, 5, 129, 1, 0)),   # no sinks, window of one token, k = S
    (17, 4, 32, (3, 0, 5)),            # S < window: nothing to decide on any head
]


@pytest.mark.parametrize("S,s,w,ks", HEAD_K_CASES)
@pytest.mark.parametrize("form", ["list", "tensor64", "tensor32"])
@pytest.mark.parametrize("ties", [False, True])
def test_per_head_k_matches_reference_and_definition(backend, S, s, w, ks, form, ties):
    H = len(ks)
    g = torch.Generator().manual_seed(S * 31 + H + sum(ks))
    p = torch.randint(0, 3, (2, H, S), generator=g).float() if ties else torch.randn(2, H, S, generator=g)
    k = {"list": list(ks), "tensor64": torch.tensor(ks), "tensor32": torch.tensor(ks, dtype=torch.int32)}[form]
    if isinstance(k, torch.Tensor):
        k = k.to(_dev())
    p = p.to(_dev())
    ev = eviction_schedule(p, sinks=s, window=w, k=k)
    y, bnd = eviction_decisions(p, sinks=s, window=w, k=k)
    ev_ref = ref.eviction_schedule(p.cpu(), sinks=s, window=w, k=ks)
    y_ref, bnd_ref = ref.eviction_decisions(p.cpu(), sinks=s, window=w, k=ks)
    assert ev.dtype == torch.int32 and y.dtype == torch.int8 and bnd.dtype == torch.int32
    assert torch.equal(ev.cpu(), ev_ref) and torch.equal(y.cpu(), y_ref) and torch.equal(bnd.cpu(), bnd_ref)
    # the mask of the schedule is the definition's, head by head with its own k
    assert torch.equal(ref.visible_mask(ev.cpu(), sinks=s, window=w), _definition_mask(p, s, w, ks))
    # and per-head k is the uniform op run on each head alone
    ev1, y1, bnd1 = _per_head_uniform(p, s, w, ks)
    assert torch.equal(ev, ev1) and torch.equal(y, y1) and torch.equal(bnd, bnd1)
    # per head: no decision without k[h] tokens before t; a head with k = 0 keeps sinks + window only
    t = torch.arange(S)
    for h, kh in enumerate(ks):
        n_dec = int((y[:, h] != 0).sum())
        assert n_dec == 2 * max(0, S - w - s - kh) if kh > 0 else n_dec == 0
        if kh == 0:
            elig = (t >= s) & (t + w <= S - 1)
            assert torch.equal(ev.cpu()[:, h][:, elig], (t + w)[elig].to(torch.int32).expand(2, -1))


def test_per_head_k_equal_entries_is_uniform(backend):
    p = torch.randn(3, 4, 90).to(_dev())
    for kk in (0, 6, 200):
        a = eviction_schedule(p, sinks=3, window=7, k=kk)
        assert torch.equal(a, eviction_schedule(p, sinks=3, window=7, k=[kk] * 4))
        assert torch.equal(a, eviction_schedule(p, sinks=3, window=7, k=torch.full((4,), kk, device=_dev())))
        ya, ba = eviction_decisions(p, sinks=3, window=7, k=kk)
        yb, bb = eviction_decisions(p, sinks=3, window=7, k=(kk,) * 4)
        assert torch.equal(ya, yb) and torch.equal(ba, bb)


def test_per_head_k_numpy_and_big_values(backend):
    import numpy as np

    p = torch.randn(1, 3, 50).to(_dev())
    ks = [2**40, 0, 9]  # a huge k means "keep everything" (clamped, never overflows int32)
    want = ref.eviction_schedule(p.cpu(), sinks=2, window=4, k=[50, 0, 9])
    assert torch.equal(eviction_schedule(p, sinks=2, window=4, k=ks).cpu(), want)
    assert torch.equal(eviction_schedule(p, sinks=2, window=4, k=np.array(ks)).cpu(), want)
    assert torch.equal(eviction_schedule(p, sinks=2, window=4, k=torch.tensor(ks, device=_dev())).cpu(), want)


@pytest.mark.parametrize(
    "k,err,match",
    [
        ([1, 2], ValueError, r"one entry per KV head, 3 .*got 2"),
        ((1, 2, 3, 4), ValueError, r"one entry per KV head, 3 .*got 4"),
        ([1, -1, 2], ValueError, r"must be >= 0, got -1 at head 1"),
        ([1, 2.0, 2], TypeError, r"must hold ints, got float"),
        ([1, True, 2], TypeError, r"must hold ints, got bool"),
        (torch.tensor([1, 2]), ValueError, r"\[H\] = \[3\].*got shape \(2,\)"),
        (torch.tensor([[1, 2, 3]]), ValueError, r"1-D .*got shape \(1, 3\)"),
        (torch.tensor([1, -4, 2]), ValueError, r"must be >= 0.*negative at heads \[1\]"),
        (torch.tensor([1.0, 2.0, 3.0]), TypeError, r"integer tensor .*torch.float32"),
        (torch.tensor([True, False, True]), TypeError, r"integer tensor .*torch.bool"),
        ("abc", TypeError, r"k must be an int, a sequence"),
        (None, TypeError, r"k must be an int, a sequence"),
    ],
)
def test_per_head_k_bad_input(k, err, match):
    prio = torch.zeros(2, 3, 9)
    for fn in (eviction_schedule, eviction_decisions):
        with pytest.raises(err, match=match):
            fn(prio, sinks=1, window=2, k=k)


def test_unchecked_negative_tensor_k_counts_as_zero(backend):
    """check=False: the tensor is not read on the host; a negative entry is clamped to 0 on the device."""
    p = torch.randn(2, 3, 40).to(_dev())
    kt = torch.tensor([-3, 4, 100], device=_dev())
    got = eviction_schedule(p, sinks=2, window=5, k=kt, check=False)
    assert torch.equal(got, eviction_schedule(p, sinks=2, window=5, k=[0, 4, 100]))
    with pytest.raises(ValueError, match="must be >= 0"):
        eviction_schedule(p, sinks=2, window=5, k=kt, check=True)


def test_cuda_tensor_k_is_not_read_on_the_host(monkeypatch):
    """The Triton path takes a device tensor k without reading it back: no .tolist/.item/bool on it."""
    from kvpop_kernels import schedule as sched

    if not (torch.cuda.is_available() or kutils.interpreting()):
        pytest.skip("no Triton backend")
    p = torch.randn(1, 3, 40).to(_dev())
    kt = torch.tensor([0, 4, 7], device=_dev())
    want = ref.eviction_schedule(p.cpu(), sinks=2, window=5, k=[0, 4, 7])
    # pretend the tensor lives on a device: host_check then says "do not read"
    monkeypatch.setattr(sched, "host_check", lambda check, device: False)

    def refuse(*a, **kw):
        raise AssertionError("k was read on the host")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    assert torch.equal(eviction_schedule(p, sinks=2, window=5, k=kt), want)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1000, 4097])
def test_gpu_per_head_k_matches_cpu_path(S):
    p = torch.randn(2, 8, S)
    ks = torch.tensor([0, 1, 300, 17, S, 2 * S, 64, 999])
    ev_cpu, y_cpu, b_cpu = ref.eviction_replay(p, sinks=4, window=256, k=ks.clamp(max=S))
    for k in (ks.cuda(), ks.tolist()):
        ev = eviction_schedule(p.cuda(), sinks=4, window=256, k=k).cpu()
        y, bnd = (x.cpu() for x in eviction_decisions(p.cuda(), sinks=4, window=256, k=k))
        assert torch.equal(ev, ev_cpu)
        assert torch.equal(y, y_cpu) and torch.equal(bnd, b_cpu)


_GPU_SCRIPT = r"""
import contextlib, importlib, io, json, os, re, sys, warnings
os.environ.update(TRITON_DUMP_PTXAS_LOG="1", TRITON_ALWAYS_COMPILE="1")  # Triton prints its own ptxas -v log
warnings.filterwarnings("ignore")
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as exc:
    print(json.dumps({"skip": repr(exc)})); sys.exit(0)
sc = importlib.import_module("kvpop_kernels.schedule")
ptrs = dict(P="*fp32", PF="*fp32", J="*i64", PERM="*i32", RANK="*i32", KEYS="*i32", SK="*i32", Z="*i32",
            EV="*i32", K="*i32", Y="*i8", BND="*i32")
builds = [("_prep_kernel", dict(BLOCK=sc._BLOCK), {}), ("_prep_kernel", dict(BLOCK=sc._BLOCK), {"P": "*bf16"}),
          ("_order_kernel", dict(OF_PERM=True, BLOCK=sc._BLOCK), {}),
          ("_order_kernel", dict(OF_PERM=False, BLOCK=sc._BLOCK), {"KEYS": "*i64"}),
          ("_counts_kernel", dict(BLOCK=sc._SCAN_BLOCK), {}),
          ("_schedule_walk_kernel", dict(BLOCK=sc._BLOCK), {}), ("_decisions_walk_kernel", dict(BLOCK=sc._BLOCK), {})]
out = {}
for arch in (90, 80):
    for name, cx, extra in builds:
        fn = getattr(sc, name)
        sig = {n: "constexpr" if n in cx else {**ptrs, **extra}.get(n, "i32") for n in fn.arg_names}
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": 4})
        regs = re.search(r"Used (\d+) registers", log.getvalue())
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
        if not (regs and spill):
            print(json.dumps({"skip": "this Triton does not print the ptxas log"})); sys.exit(0)
        out[f"sm_{arch} {name} {sorted(extra.values())}"] = {
            "shared": k.metadata.shared, "registers": int(regs.group(1)), "spill": [int(x) for x in spill.groups()]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_schedule_kernels_compile_for_gpu():
    """Every kernel of the schedule and the decisions (the per-head k loaded on the device, int32 and int64
    level keys, float32 and bf16 priorities) builds for sm_90 and sm_80 through ptxas in a process without
    the interpreter (no GPU needed), without register spills."""
    from compile_check import run_without_interpreter

    res = run_without_interpreter(_GPU_SCRIPT)
    names = {"_prep_kernel", "_order_kernel", "_counts_kernel", "_schedule_walk_kernel", "_decisions_walk_kernel"}
    assert {key.split()[1] for key in res} == names and len(res) == 14, sorted(res)
    for key, r in res.items():
        assert r["spill"] == [0, 0] and r["registers"] <= 128 and r["shared"] <= 227 * 1024, (key, r)
