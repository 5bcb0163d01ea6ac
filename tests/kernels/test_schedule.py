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
    (200, 4, 16, 11),
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


_priorities = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 0.5]),  # heavy ties
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
    p[:, :, ::7] = p[:, :, 3::7][..., : p[:, :, ::7].shape[-1]]  # some ties
    kw = dict(sinks=4, window=256, k=300)
    from kvpop_kernels.schedule import _cpu_schedule

    ev_cpu, y_cpu, b_cpu = _cpu_schedule(p, 4, 256, 300, decisions=True)
    ev = eviction_schedule(p.cuda(), **kw).cpu()
    y, bnd = (x.cpu() for x in eviction_decisions(p.cuda(), **kw))
    assert torch.equal(ev, torch.from_numpy(ev_cpu))
    assert torch.equal(y, torch.from_numpy(y_cpu))
    assert torch.equal(bnd, torch.from_numpy(b_cpu))
