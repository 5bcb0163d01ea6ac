"""``fixed_budget_decode(layout=QuantizedLayout(...))``: keys and values of every slot in int8 or fp8 with a
float32 scale per slot and KV head.

Every step is compared with ``reference.quantized_fixed_budget_decode`` (the new token quantised per head,
the float reference's placement with codes and scales moving together, attention over the dequantised
slots): outputs and LSE, and the codes, scales, positions and priorities bit for bit, over steps from an
empty cache through the first evictions, rows of a batch at different positions, in the uniform and the
packed layout, on both backends (the Triton kernels through the interpreter, the PyTorch CPU path).  Then
the quantised step against the float32 step on the same inputs (the error quantisation costs), and the
refusals.
"""
from __future__ import annotations

import pytest
import torch
from test_decode_kernel import assert_close_rms
from test_decode_packed import step_inputs

from kvpop_kernels import SlotState, fixed_budget_decode, reference
from kvpop_kernels.layout import PackedLayout, QuantizedLayout, UniformLayout, dequantize, quantize

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = ["int8", pytest.param("fp8", marks=pytest.mark.skipif(FP8 is None, reason="no float8 in this torch"))]


def qstate(N, slots, D, s, w, budgets, kv_dtype):
    """An empty quantised state: codes, codes, k_scale, v_scale, slot_pos, slot_prio."""
    store = torch.int8 if kv_dtype == "int8" else FP8
    if budgets is None:
        Hkv, B = slots
        shape, lr = (N, Hkv, B), (N, Hkv, B - s - w)
    else:
        T = sum(budgets)
        shape, lr = (N, T), (N, T - len(budgets) * (s + w))
    return [torch.zeros(*shape, D, dtype=store), torch.zeros(*shape, D, dtype=store), torch.zeros(shape),
            torch.zeros(shape), torch.full(shape, -1, dtype=torch.int32), torch.full(lr, float("-inf"))]


def _same_codes(name, a, b, sa, sb, kv_dtype, n, pos):
    """On the GPU a code may land on the other side of a rounding tie (Triton's float32 division is not the
    CPU's correctly rounded one): the dequantised slots agree to one code step, the scales to float32
    rounding."""
    da, db = dequantize(a, sa), dequantize(b, sb)
    step = sb[..., None] * (1.0 if kv_dtype == "int8" else 0.0) + db.abs() * (0.0 if kv_dtype == "int8" else 2.0 ** -3)
    assert bool(((da - db).abs() <= step * 1.001 + 1e-6).all()), f"{name} of row {n} off by more than a code at {pos}"


def run_quantized(kv_dtype, Hkv, G, D, s, w, steps, *, budgets=None, B=None, N=2, start=(0, 5), seed=0,
                  device="cpu"):
    """``device="cuda"``: the state and inputs on the GPU (the Triton kernels compiled), the reference on CPU
    copies; positions and priorities bit for bit, codes to one code step (``_same_codes``)."""
    gen = torch.Generator().manual_seed(seed)
    base = UniformLayout() if budgets is None else PackedLayout(budgets)
    lay = QuantizedLayout(kv_dtype, base)
    state = [t.to(device) for t in qstate(N, (Hkv, B), D, s, w, budgets, kv_dtype)]
    rows = [[t[0].clone() for t in qstate(1, (Hkv, B), D, s, w, budgets, kv_dtype)] for _ in range(N)]
    pos = torch.tensor(start[:N], dtype=torch.int64)
    for _ in range(steps):
        q, kn, vn, lp = step_inputs(N, Hkv, G, D, gen)
        kc, vc, ks, vs, sp, pr = state
        dev = [x.to(device) for x in (q, kn, vn, lp)]
        o, l = fixed_budget_decode(*dev[:3], SlotState(kc, vc, sp, pr, k_scale=ks, v_scale=vs), dev[3],
                                   pos=pos.to(device), sinks=s, window=w, layout=lay)
        o, l = o.cpu(), l.cpu()
        for n in range(N):
            rkc, rvc, rks, rvs, rsp, rpr = rows[n]
            ro, rl = reference.quantized_fixed_budget_decode(
                q[n], kn[n], vn[n], rkc, rvc, rks, rvs, rsp, rpr, lp[n].clone(), pos=int(pos[n]), sinks=s, window=w,
                kv_dtype=kv_dtype, head_budgets=budgets)
            tol = (1e-4, 1e-5, 1e-5) if device == "cpu" else (2e-3, 2e-3, 1e-3)  # tf32 dots on the GPU
            assert_close_rms(o[n], ro, *tol)
            assert_close_rms(l[n], rl, *tol)
            got = [t[n].cpu() for t in state]
            if device != "cpu":
                for i, name in ((0, "k_codes"), (1, "v_codes")):
                    _same_codes(name, got[i], rows[n][i], got[i + 2], rows[n][i + 2], kv_dtype, n, int(pos[n]))
                    torch.testing.assert_close(got[i + 2], rows[n][i + 2], atol=0, rtol=1e-6)
                got, want = got[4:], rows[n][4:]
                names = ("slot_pos", "slot_prio")
            else:
                want = rows[n]
                names = ("k_codes", "v_codes", "k_scale", "v_scale", "slot_pos", "slot_prio")
            for name, a, b in zip(names, got, want):
                if a.dtype == FP8:
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                assert torch.equal(a, b), f"{name} of row {n} differs from the reference at pos {int(pos[n])}"
        pos = pos + 1


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_quantize_round_trip(kv_dtype):
    """Half a code step per element for int8 (a scale of max|x| / 127), e4m3's relative step for fp8; a zero
    vector stays zero with scale 0."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 37, generator=gen) * torch.rand(3, 5, 1, generator=gen) * 10
    x[1, 2] = 0
    codes, sc = quantize(x, kv_dtype)
    assert sc.shape == (3, 5) and sc.dtype == torch.float32 and sc[1, 2] == 0
    err = (dequantize(codes, sc) - x).abs()
    if kv_dtype == "int8":
        assert codes.dtype == torch.int8
        assert bool((err <= sc[..., None] * 0.5 + 1e-6).all())
    else:
        assert codes.dtype == FP8
        assert bool((err <= x.abs() * 2.0 ** -4 + sc[..., None] * 2.0 ** -9 + 1e-7).all())
    assert bool((dequantize(codes, sc)[1, 2] == 0).all())


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True], ids=["uniform", "packed"])
def test_steps_match_reference(backend, kv_dtype, packed):
    """From empty through the first evictions, two rows at different positions, odd head size."""
    if packed:
        run_quantized(kv_dtype, 3, 2, 20, 2, 3, 14, budgets=(5, 9, 12))
    else:
        run_quantized(kv_dtype, 2, 2, 20, 2, 3, 14, B=9)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True], ids=["uniform", "packed"])
def test_gpu_steps_match_reference(kv_dtype, packed):
    """The Triton kernels compiled for this GPU, Qwen3's head size (D = 128, G = 4): the same steps as on CPU,
    through the first evictions, against the reference on CPU copies."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if packed:
        run_quantized(kv_dtype, 4, 4, 128, 4, 16, 60, budgets=(20, 29, 47, 21), N=3, start=(0, 9, 30),
                      device="cuda")
    else:
        run_quantized(kv_dtype, 2, 4, 128, 4, 16, 60, B=37, N=3, start=(0, 9, 30), device="cuda")


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_close_to_the_float32_step(backend, kv_dtype):
    """The same steps in float32 and quantised: the outputs differ by what 8 bits cost (relative RMS below
    2% for int8, 6% for fp8's 3 mantissa bits), the positions and priorities not at all."""
    gen = torch.Generator().manual_seed(5)
    N, Hkv, G, D, s, w, B = 2, 2, 4, 24, 2, 4, 12
    f32 = [torch.zeros(N, Hkv, B, D), torch.zeros(N, Hkv, B, D), torch.full((N, Hkv, B), -1, dtype=torch.int32),
           torch.full((N, Hkv, B - s - w), float("-inf"))]
    qs = qstate(N, (Hkv, B), D, s, w, None, kv_dtype)
    lay = QuantizedLayout(kv_dtype)
    pos = torch.tensor([0, 3])
    rms = []
    for _ in range(16):
        q, kn, vn, lp = step_inputs(N, Hkv, G, D, gen, ties=False)
        of, _ = fixed_budget_decode(q, kn, vn, SlotState(*f32), lp.clone(), pos=pos, sinks=s, window=w)
        oq, _ = fixed_budget_decode(q, kn, vn, SlotState(qs[0], qs[1], qs[4], qs[5], k_scale=qs[2], v_scale=qs[3]),
                                    lp.clone(), pos=pos, sinks=s, window=w, layout=lay)
        rms.append(float((oq - of).pow(2).mean().sqrt() / of.pow(2).mean().sqrt()))
        assert torch.equal(qs[4], f32[2]) and torch.equal(qs[5], f32[3])
        pos = pos + 1
    assert max(rms) < (0.02 if kv_dtype == "int8" else 0.06), rms
    assert max(rms) > 0  # the quantised step did quantise


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_empty_slots_scales_are_never_read(backend, kv_dtype):
    """Whatever an empty slot's scale holds (NaN here, as in memory nobody wrote) never reaches the output: the
    steps from an empty cache equal the reference's on a zeroed state while long-range slots are still empty
    in several chunks (the ring filling, the first evictions)."""
    gen = torch.Generator().manual_seed(9)
    N, Hkv, G, D, s, w, B = 1, 2, 2, 16, 2, 4, 46
    state = qstate(N, (Hkv, B), D, s, w, None, kv_dtype)
    state[2].fill_(float("nan"))
    state[3].fill_(float("nan"))
    ref = [t[0].clone() for t in qstate(1, (Hkv, B), D, s, w, None, kv_dtype)]
    lay = QuantizedLayout(kv_dtype)
    kw = {"num_splits": 3, "block_n": 16} if backend == "triton" else {}
    for pos in range(20):
        q, kn, vn, lp = step_inputs(N, Hkv, G, D, gen, ties=False)
        o, l = fixed_budget_decode(q, kn, vn, SlotState(state[0], state[1], state[4], state[5], k_scale=state[2],
                                                        v_scale=state[3]), lp.clone(), pos=torch.tensor([pos]),
                                   sinks=s, window=w, layout=lay, **kw)
        ro, rl = reference.quantized_fixed_budget_decode(q[0], kn[0], vn[0], *ref, lp[0].clone(), pos=pos, sinks=s,
                                                         window=w, kv_dtype=kv_dtype)
        assert_close_rms(o[0], ro)
        assert_close_rms(l[0], rl)
        assert torch.equal(state[4][0], ref[4]) and torch.equal(state[5][0], ref[5])



# the values where rounding is decided, in units of the scale (each row's largest is qmax: scale 1 exactly)
EDGES = {
    "int8": [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 3.4999, 126.5, -127.0, 0.0, -0.0, 1e-3],
    # e4m3: ties to even among normals (1.0625, 1.1875, 248) and subnormals (k * 2**-9), the largest subnormal
    # rounding up to the smallest normal, a value past the last code, zeros of either sign
    "fp8": [448.0, 1.0625, 1.1875, -1.0625, 248.0, 300.0, 2.5 * 2.0 ** -9, 0.5 * 2.0 ** -9, 1.5 * 2.0 ** -9,
            -3.5 * 2.0 ** -9, 2.0 ** -6 - 2.0 ** -12, 2.0 ** -10, 0.0, -0.0, 447.9],
}


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_new_token_codes_on_the_rounding_edges(backend, kv_dtype):
    """The new token's codes and scales as the step stores them are bit for bit ``quantize``'s on the values where
    rounding is decided (int8 rounds half up, fp8 e4m3 to nearest even, fp8's subnormals and its largest code,
    zeros of either sign), a unit scale in the first KV head and a scale of no simple form in the second.  (The
    Triton step quantises in its launch: fp8 in integer arithmetic.)"""
    vals = torch.tensor(EDGES[kv_dtype])
    Hkv, G, D, s, w, B = 2, 2, vals.numel(), 2, 3, 8
    kn = torch.stack([vals, vals * 0.3712]).unsqueeze(0)  # [1, Hkv, D]
    vn = -kn.flip(-1)
    q = torch.randn(1, Hkv * G, D, generator=torch.Generator().manual_seed(3))
    kc, vc, ks, vs, sp, pr = qstate(1, (Hkv, B), D, s, w, None, kv_dtype)
    fixed_budget_decode(q, kn, vn, SlotState(kc, vc, sp, pr, k_scale=ks, v_scale=vs), torch.zeros(1, Hkv),
                        pos=torch.tensor([0]), sinks=s, window=w, layout=QuantizedLayout(kv_dtype))
    for name, codes, scale, x in (("key", kc, ks, kn), ("value", vc, vs, vn)):
        want, want_scale = quantize(x[0], kv_dtype)
        got = codes[0, :, 0]  # the new token's slot (sink 0)
        if got.dtype == FP8:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want), f"{name} codes {got.tolist()} != quantize's {want.tolist()}"
        assert torch.equal(scale[0, :, 0], want_scale), name


def test_triton_step_quantises_in_its_launch(monkeypatch):
    """The Triton step quantises the new token inside its one launch: no PyTorch pass before it (the layout's
    ``encode`` and ``quantize`` are never called), and its steps still equal the reference's, codes bit for bit."""
    from kvpop_kernels import _utils as kutils
    from kvpop_kernels.layout import quantized as lq

    if not kutils.interpreting():
        pytest.skip("the interpreter runs the Triton step on the CPU (TRITON_INTERPRET=1)")

    def refuse(*args, **kwargs):
        raise AssertionError("the new token was quantised outside the launch")

    monkeypatch.setattr(lq.QuantizedLayout, "encode", refuse)
    monkeypatch.setattr(lq, "quantize", refuse)
    for kv_dtype in ("int8",) if FP8 is None else ("int8", "fp8"):
        run_quantized(kv_dtype, 2, 2, 12, 2, 3, 9, B=8)


def test_refusals():
    N, Hkv, D, s, w, B = 1, 2, 16, 1, 2, 6
    q, kn, vn, lp = step_inputs(N, Hkv, 1, D, torch.Generator().manual_seed(0))
    kc, vc, ks, vs, sp, pr = qstate(N, (Hkv, B), D, s, w, None, "int8")
    lay = QuantizedLayout("int8")
    with pytest.raises(ValueError, match=r"kv_dtype must be None .* \['int8', 'fp8'\], got 'int4'"):
        QuantizedLayout("int4")
    with pytest.raises(TypeError, match="pass k_scale= a float32 tensor"):
        fixed_budget_decode(q, kn, vn, SlotState(kc, vc, sp, pr), lp, pos=0, sinks=s, window=w, layout=lay)
    with pytest.raises(ValueError, match="k_scale must be float32 with slot_pos's shape"):
        fixed_budget_decode(q, kn, vn, SlotState(kc, vc, sp, pr, k_scale=ks[..., 1:], v_scale=vs), lp, pos=0, sinks=s,
                            window=w, layout=lay)
    with pytest.raises(ValueError, match=r"k_cache must have dtype in \['torch.int8'\]"):
        fixed_budget_decode(q, kn, vn, SlotState(kc.float(), vc, sp, pr, k_scale=ks, v_scale=vs), lp, pos=0, sinks=s,
                            window=w, layout=lay)
    with pytest.raises(ValueError, match="scales of a quantised layout"):
        fixed_budget_decode(q, kn, vn, SlotState(kc.float(), vc.float(), sp, pr, k_scale=ks, v_scale=vs), lp, pos=0,
                            sinks=s, window=w)
    with pytest.raises(ValueError, match="k_scale and v_scale share memory"):
        fixed_budget_decode(q, kn, vn, SlotState(kc, vc, sp, pr, k_scale=ks, v_scale=ks), lp, pos=0, sinks=s,
                            window=w, layout=lay)
    with pytest.raises(ValueError, match="layout= or head_budgets=, not both"):
        fixed_budget_decode(q, kn, vn, SlotState(kc, vc, sp, pr), lp, pos=0, sinks=s, window=w, layout=lay,
                            head_budgets=(6, 6))
