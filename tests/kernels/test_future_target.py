"""``future_attention_target`` against the dense reference: Triton (interpreter / GPU) and the CPU path."""
import math

import pytest
import torch

import kvpop_kernels
import kvpop_kernels._utils as kutils
from kvpop_kernels import future_target as ft
from kvpop_kernels import reference as ref


def rel_rms(out: torch.Tensor, want: torch.Tensor) -> float:
    """RMS(want - out) / RMS(want) (fla's assert_close)."""
    out, want = out.double(), want.double()
    return ((want - out).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def assert_matches(out, want, atol=1e-4, rtol=1e-5, rms=1e-5):
    assert out.dtype == torch.float32
    assert out.shape == want.shape
    assert torch.isfinite(out).all(), "non-finite output (an unwritten tile?)"
    torch.testing.assert_close(out, want.float(), atol=atol, rtol=rtol)
    assert rel_rms(out, want) < rms


def make(B, Hq, Hkv, S, D, device="cpu", dtype=torch.float32, lse_kind="dense", window=8, sinks=2,
         kslots=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
    if lse_kind == "dense":
        _, lse = ref.dense_causal_attention(q, k, v)
    else:
        prio = torch.randn(B, Hkv, S, generator=g).to(device)
        evict_at = kvpop_kernels.eviction_schedule(prio, sinks=sinks, window=window, k=kslots)
        _, lse = ref.sparse_attention(q, k, v, evict_at, sinks=sinks, window=window)
    return q, k, lse


# (B, Hq, Hkv, S, D, window): odd S, GQA 4:1 / 1:1 / 3:1 / 8:1, batch > 1, D = 60 / 64 / 128 / 24
SHAPES = [
    (1, 4, 1, 200, 60, 16),
    (2, 2, 2, 63, 64, 8),
    (1, 4, 1, 17, 64, 4),
    (1, 1, 1, 1, 64, 1),
    (2, 3, 1, 45, 24, 1),
    (1, 8, 1, 70, 128, 5),
    (1, 4, 2, 100, 64, 40),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_S{}_D{}_w{}".format(*s))
@pytest.mark.parametrize("lse_kind", ["dense", "sparse"])
def test_triton_matches_reference(shape, lse_kind, device):
    B, Hq, Hkv, S, D, w = shape
    q, k, lse = make(B, Hq, Hkv, S, D, device=device, lse_kind=lse_kind, window=w)
    want = ref.future_attention_target(q, k, lse, window=w)
    assert kutils.use_triton(q)
    out = kvpop_kernels.future_attention_target(q, k, lse, window=w)
    assert_matches(out, want)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_S{}_D{}_w{}".format(*s))
@pytest.mark.parametrize("lse_kind", ["dense", "sparse"])
@pytest.mark.parametrize("chunk", [None, 16, 7])
def test_cpu_path_matches_reference(shape, lse_kind, chunk):
    B, Hq, Hkv, S, D, w = shape
    q, k, lse = make(B, Hq, Hkv, S, D, lse_kind=lse_kind, window=w)
    want = ref.future_attention_target(q, k, lse, window=w)
    out = ft._cpu_target(q, k, lse, w, 1e-6, D ** -0.5, chunk=chunk)
    assert_matches(out, want)


def test_public_cpu_dispatch_without_interpreter(monkeypatch):
    """Without TRITON_INTERPRET the public op takes the PyTorch path (and still matches)."""
    monkeypatch.setattr(kutils, "interpreting", lambda: False)
    called = []
    orig = ft._cpu_target
    monkeypatch.setattr(ft, "_cpu_target", lambda *a, **kw: called.append(1) or orig(*a, **kw))
    q, k, lse = make(2, 4, 2, 90, 60, lse_kind="sparse", window=10)
    want = ref.future_attention_target(q, k, lse, window=10, eps=1e-4, scale=0.2)
    out = kvpop_kernels.future_attention_target(q, k, lse, window=10, eps=1e-4, scale=0.2)
    assert called == [1]
    assert_matches(out, want)


@pytest.mark.parametrize("sinks,kslots", [(4, 0), (0, 3), (2, 1000), (300, 5)],
                         ids=["k0", "no_sinks", "budget_ge_S", "S_lt_sinks"])
@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_sparse_lse_schedules(sinks, kslots, path, device):
    """lse of sparse attention under k = 0, no sinks, budget >= S (== dense) and S < sinks."""
    B, Hq, Hkv, S, D, w = 1, 4, 2, 120, 32, 10
    q, k, lse = make(B, Hq, Hkv, S, D, device=device, lse_kind="sparse", window=w, sinks=sinks,
                     kslots=kslots)
    want = ref.future_attention_target(q, k, lse, window=w)
    if kslots >= S or sinks >= S:  # nothing evicted: the sparse normalisers are the dense ones
        qd, kd, lse_d = make(B, Hq, Hkv, S, D, device=device, lse_kind="dense", window=w)
        torch.testing.assert_close(lse, lse_d, atol=1e-5, rtol=1e-5)
    if path == "triton":
        out = kvpop_kernels.future_attention_target(q, k, lse, window=w)
    else:
        out = ft._cpu_target(q.cpu(), k.cpu(), lse.cpu(), w, 1e-6, D ** -0.5)
    assert_matches(out.cpu(), want.cpu())


@pytest.mark.parametrize("bt,bu", [(32, 16), (16, 32), (64, 16), (16, 16)])
def test_triton_tile_sizes(bt, bu, device):
    """Several key blocks straddling the diagonal, full blocks and a ragged tail."""
    q, k, lse = make(1, 2, 1, 150, 40, device=device, lse_kind="sparse", window=9)
    want = ref.future_attention_target(q, k, lse, window=9)
    out = ft._triton_target(q, k, lse, 9, 1e-6, 40 ** -0.5, block_t=bt, block_u=bu)
    assert_matches(out, want)


@pytest.mark.parametrize("path", ["triton", "cpu"])
@pytest.mark.parametrize("S,w", [(1, 1), (5, 5), (17, 40), (256, 256)])
def test_no_future_query_gives_log_eps(S, w, path, device):
    """S <= window: no query lies w after any key, every value is log(eps)."""
    eps = 1e-3
    q, k, lse = make(1, 4, 2, S, 32, device=device, window=w)
    if path == "triton":
        out = kvpop_kernels.future_attention_target(q, k, lse, window=w, eps=eps)
    else:
        out = ft._cpu_target(q.cpu(), k.cpu(), lse.cpu(), w, eps, 32 ** -0.5)
    assert out.shape == (1, 2, S) and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), torch.full((1, 2, S), math.log(eps)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_tail_keys_log_eps_and_known_value(path, device):
    """Keys with t + w > S-1 get log(eps); a one-query case equals its closed form."""
    S, w, D = 12, 5, 16
    q, k, lse = make(1, 1, 1, S, D, device=device, window=w)
    fn = (lambda *a: kvpop_kernels.future_attention_target(a[0], a[1], a[2], window=w)) if path == "triton" \
        else (lambda *a: ft._cpu_target(a[0].cpu(), a[1].cpu(), a[2].cpu(), w, 1e-6, D ** -0.5))
    out = fn(q, k, lse).cpu()
    assert torch.all(out[0, 0, S - w:] == torch.tensor(math.log(1e-6), dtype=torch.float32))
    # key t = S-1-w is seen by exactly one query u = S-1
    t, u = S - 1 - w, S - 1
    p = torch.exp((q[0, 0, u].double() @ k[0, 0, t].double()) * D ** -0.5 - lse[0, 0, u].double())
    assert abs(out[0, 0, t].item() - math.log(1e-6 + p.item())) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_inputs(dtype, device):
    """Non-fp32 inputs are read as they are and computed in fp32 (same values as the reference)."""
    q, k, lse = make(1, 4, 2, 80, 64, device=device, dtype=dtype, window=7)
    want = ref.future_attention_target(q, k, lse, window=7)
    out = kvpop_kernels.future_attention_target(q, k, lse, window=7)
    tol = dict(atol=1e-4, rtol=1e-5, rms=1e-5) if device == "cpu" else dict(atol=2e-2, rtol=2e-2, rms=1e-2)
    assert_matches(out, want, **tol)
    cpu = ft._cpu_target(q.cpu(), k.cpu(), lse.cpu(), 7, 1e-6, 64 ** -0.5)
    assert_matches(cpu, want.cpu(), atol=1e-4, rtol=1e-5, rms=1e-5)


def test_strided_inputs(device):
    """Views in the [B, S, H, D] layout of HF (transposed, non-contiguous) are read through strides."""
    B, Hq, Hkv, S, D, w = 2, 4, 2, 50, 32, 6
    q0, k0, lse0 = make(B, Hq, Hkv, S, D, device=device, window=w)
    q = q0.transpose(1, 2).contiguous().transpose(1, 2)
    k = k0.transpose(1, 2).contiguous().transpose(1, 2)
    lse = lse0.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous() and not lse.is_contiguous()
    want = ref.future_attention_target(q0, k0, lse0, window=w)
    assert_matches(kvpop_kernels.future_attention_target(q, k, lse, window=w), want)
    assert_matches(ft._cpu_target(q.cpu(), k.cpu(), lse.cpu(), w, 1e-6, D ** -0.5), want.cpu())


def test_max_over_group_is_taken(device):
    """The output is the max over query heads of the group, not e.g. the mean or head 0."""
    B, Hq, Hkv, S, D, w = 1, 4, 1, 40, 16, 3
    q, k, lse = make(B, Hq, Hkv, S, D, device=device, window=w)
    per_head = torch.stack([ref.future_attention_target(q[:, g:g + 1], k, lse[:, g:g + 1], window=w)
                            for g in range(Hq)], dim=0)
    out = kvpop_kernels.future_attention_target(q, k, lse, window=w)
    assert_matches(out, per_head.amax(dim=0))
    assert (per_head.amax(0) - per_head.amin(0)).abs().max() > 0.1  # the heads differ: the test can fail


def test_output_not_differentiable():
    q, k, lse = make(1, 2, 1, 30, 16, window=4)
    q.requires_grad_(True)
    out = kvpop_kernels.future_attention_target(q, k, lse, window=4)
    assert not out.requires_grad


def test_cpu_chunk_bounds_memory():
    """The CPU path's logits block is bounded: [B, Hq, chunk, S] with chunk * B*Hq*S <= max(2**24, 16 B Hq S)."""
    for B, Hq, S in [(1, 32, 2048), (1, 32, 16384), (4, 8, 4096), (1, 1, 64)]:
        c = ft._cpu_chunk(B, Hq, S)
        assert 16 <= c <= 1024
        assert c * B * Hq * S <= max(ft._CPU_CHUNK_ELEMS, 16 * B * Hq * S)


def test_cpu_long_sequence_matches_reference_rows():
    """S = 2048 on the PyTorch path (several chunks) against the reference."""
    q, k, lse = make(1, 2, 1, 2048, 16, window=256)
    want = ref.future_attention_target(q, k, lse, window=256)
    out = ft._cpu_target(q, k, lse, 256, 1e-6, 0.25)
    assert_matches(out, want)


# ------------------------------------------------------------------------ the label family
# (label, power): the max, the power mean at a = 1 (the mean), a non-integer a and a large a
LABELS = [("max", 4.0), ("power", 1.0), ("power", 2.5), ("power", 8.0), ("power", 40.0)]


def _ids(lp):
    return f"{lp[0]}{'' if lp[0] == 'max' else lp[1]}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_S{}_D{}_w{}".format(*s))
@pytest.mark.parametrize("lp", LABELS, ids=_ids)
def test_label_triton_matches_reference(shape, lp, device):
    B, Hq, Hkv, S, D, w = shape
    q, k, lse = make(B, Hq, Hkv, S, D, device=device, lse_kind="sparse", window=w, seed=3)
    want = ref.future_attention_target(q, k, lse, window=w, label=lp[0], power=lp[1])
    out = kvpop_kernels.future_attention_target(q, k, lse, window=w, label=lp[0], power=lp[1])
    assert_matches(out, want)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_S{}_D{}_w{}".format(*s))
@pytest.mark.parametrize("lp", LABELS, ids=_ids)
@pytest.mark.parametrize("chunk", [None, 7])
def test_label_cpu_path_matches_reference(shape, lp, chunk):
    B, Hq, Hkv, S, D, w = shape
    q, k, lse = make(B, Hq, Hkv, S, D, lse_kind="dense", window=w, seed=4)
    want = ref.future_attention_target(q, k, lse, window=w, label=lp[0], power=lp[1])
    out = ft._cpu_target(q, k, lse, w, 1e-6, D ** -0.5, chunk=chunk, label=lp[0], power=lp[1])
    assert_matches(out, want)


@pytest.mark.parametrize("bt,bu", [(32, 16), (16, 32)])
@pytest.mark.parametrize("lp", [("max", 4.0), ("power", 3.0)], ids=_ids)
def test_label_triton_tile_sizes(bt, bu, lp, device):
    """The running max crosses block boundaries (diagonal blocks, full blocks, a ragged tail)."""
    q, k, lse = make(1, 2, 1, 150, 40, device=device, lse_kind="sparse", window=9)
    want = ref.future_attention_target(q, k, lse, window=9, label=lp[0], power=lp[1])
    out = ft._triton_target(q, k, lse, 9, 1e-6, 40 ** -0.5, block_t=bt, block_u=bu, label=lp[0], power=lp[1])
    assert_matches(out, want)


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_power_one_is_the_mean_and_large_power_tends_to_the_max(path, device):
    """a = 1 gives the mean; for a = 1000 the power mean lies within log(N_t)/a below the max, and the
    three labels differ on these inputs (the test can fail)."""
    S, w, D = 90, 6, 32
    q, k, lse = make(2, 4, 2, S, D, device=device, window=w, seed=5)

    def run(label, power=4.0):
        if path == "triton":
            return kvpop_kernels.future_attention_target(q, k, lse, window=w, label=label, power=power).cpu()
        return ft._cpu_target(q.cpu(), k.cpu(), lse.cpu(), w, 1e-6, D ** -0.5, label=label, power=power)

    mean, mx, p1, p4, big = run("mean"), run("max"), run("power", 1.0), run("power", 4.0), run("power", 1000.0)
    torch.testing.assert_close(p1, mean, atol=2e-5, rtol=1e-5)
    n = torch.clamp(S - torch.arange(S) - w, min=1).float()
    gap = mx - big  # log(eps + max) - log(eps + power mean): in [0, log(N_t)/a] (up to rounding)
    assert float(gap.min()) > -1e-4
    assert torch.all(gap <= torch.log(n) / 1000.0 + 1e-4)
    assert torch.all(mean <= p4 + 1e-5) and torch.all(p4 <= mx + 1e-5)  # power means grow with a
    assert float((mx - mean).max()) > 1.0 and float((p4 - mean).max()) > 0.5


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_power_mean_is_computed_in_the_log_domain(path, device):
    """p^a of the small probabilities of a long, flat attention underflows float32 (so a direct
    float32 power mean would return log(eps)); the log-domain one matches the float64 brute force."""
    S, w, D, a = 400, 4, 16, 24.0
    q, k, lse = make(1, 2, 1, S, D, device=device, window=w, seed=6)
    q = q * 0.1  # flat attention: p ~ 1/u
    lse = ref.dense_causal_attention(q, k, k)[1]
    eps = 1e-30
    want = ref.future_attention_target(q, k, lse, window=w, label="power", power=a, eps=eps)
    logits = torch.einsum("bhud,bhtd->bhut", q.float(), k.float().repeat_interleave(2, 1)) * D ** -0.5
    p = torch.exp(logits - lse.float()[..., None])
    t = 200  # float32 p^a of key t's later attention: nothing left
    assert float(p[0, 0, t + w:, t].pow(a).sum()) == 0.0 and float(p[0, 1, t + w:, t].pow(a).sum()) == 0.0
    if path == "triton":
        out = kvpop_kernels.future_attention_target(q, k, lse, window=w, label="power", power=a, eps=eps)
    else:
        out = ft._cpu_target(q.cpu(), k.cpu(), lse.cpu(), w, eps, D ** -0.5, label="power", power=a)
    assert float(want[0, 0, t]) > math.log(eps) + 20  # the true label is far above log(eps)
    assert_matches(out.cpu(), want.cpu())


@pytest.mark.parametrize("path", ["triton", "cpu"])
@pytest.mark.parametrize("lp", [("max", 4.0), ("power", 4.0)], ids=_ids)
def test_label_no_future_query_gives_log_eps(lp, path, device):
    """Keys with no query u >= t + w get log(eps) under every label (no NaN from -inf - -inf)."""
    eps, S, w = 1e-3, 20, 6
    q, k, lse = make(1, 4, 2, S, 32, device=device, window=w)
    if path == "triton":
        out = kvpop_kernels.future_attention_target(q, k, lse, window=w, eps=eps, label=lp[0], power=lp[1])
    else:
        out = ft._cpu_target(q.cpu(), k.cpu(), lse.cpu(), w, eps, 32 ** -0.5, label=lp[0], power=lp[1])
    out = out.cpu()
    assert torch.isfinite(out).all()
    assert torch.all(out[..., S - w:] == torch.tensor(math.log(eps), dtype=torch.float32))
    assert torch.all(out[..., :S - w] > math.log(eps))
    big = kvpop_kernels.future_attention_target(q, k, lse, window=S, eps=eps, label=lp[0], power=lp[1])
    torch.testing.assert_close(big.cpu(), torch.full((1, 2, S), math.log(eps)), atol=1e-6, rtol=0)


def test_label_max_over_group_and_no_grad(device):
    """The group max is taken for the new labels too, and the output carries no gradient (the target is a
    label: there is no backward)."""
    q, k, lse = make(1, 4, 1, 40, 16, device=device, window=3)
    q.requires_grad_(True)
    for label in ("max", "power"):
        per_head = torch.stack([ref.future_attention_target(q[:, g:g + 1].detach(), k, lse[:, g:g + 1], window=3,
                                                            label=label) for g in range(4)], dim=0)
        out = kvpop_kernels.future_attention_target(q, k, lse, window=3, label=label)
        assert not out.requires_grad
        assert_matches(out, per_head.amax(dim=0))
        assert (per_head.amax(0) - per_head.amin(0)).abs().max() > 0.1


@pytest.mark.parametrize("label,power,exc,match", [
    ("median", 4.0, ValueError, "label must be one of"),
    (None, 4.0, ValueError, "label must be one of"),
    ("power", 0.0, ValueError, "power"),
    ("power", -2.0, ValueError, "power"),
    ("power", float("inf"), ValueError, "label='max'"),
    ("power", float("nan"), ValueError, "power"),
    ("max", "4", TypeError, "power"),
    ("power", True, TypeError, "power"),
])
def test_bad_label(label, power, exc, match):
    q, k, lse = _ok()
    with pytest.raises(exc, match=match):
        kvpop_kernels.future_attention_target(q, k, lse, window=2, label=label, power=power)


_SM90_SCRIPT = r"""
import importlib, json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as exc:
    print(json.dumps({"skip": repr(exc)})); sys.exit(0)
ft = importlib.import_module("kvpop_kernels.future_target")
fn = ft._target_kernel
out = {}
for label in (0, 1, 2):
    for P, bt, bu, prec in (("*bf16", 128, 64, "tf32"), ("*fp32", 64, 32, "tf32x3")):
        cx = dict(BLOCK_T=bt, BLOCK_U=bu, BLOCK_D=128, EVEN_D=True, UPCAST=P == "*fp32", DOT_PREC=prec, LABEL=label)
        ptrs = dict(Q=P, K=P, L="*fp32", OUT="*fp32")
        sig = {n: "constexpr" if n in cx else ptrs.get(n) or ("fp32" if n in ("qk_scale", "eps", "power") else "i32")
               for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, "num_stages": 2})
        out[f"{label}{P}"] = {"shared": k.metadata.shared}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_label_kernels_compile_for_sm90():
    """The target kernel builds for an H100/H200 (sm_90) with each label, bf16 and fp32 inputs, in a process
    without the interpreter (no GPU needed): no compile error, shared memory within one block's 227 KiB."""
    from compile_check import run_without_interpreter

    res = run_without_interpreter(_SM90_SCRIPT)
    assert len(res) == 6
    for name, r in res.items():
        assert r["shared"] <= 227 * 1024, (name, r)


# ----------------------------------------------------------------------------- bad input
def _ok():
    return make(1, 4, 2, 10, 16, window=2)


@pytest.mark.parametrize("case,exc,match", [
    ("lse_shape", ValueError, "lse must be"),
    ("lse_3heads", ValueError, "lse must be"),
    ("gqa", ValueError, "multiple"),
    ("window0", ValueError, "window"),
    ("window_float", TypeError, "window"),
    ("eps0", ValueError, "eps"),
    ("eps_neg", ValueError, "eps"),
    ("eps_str", TypeError, "eps"),
    ("k_len", ValueError, "k must be"),
    ("k_dim", ValueError, "k must be"),
    ("k_batch", ValueError, "k must be"),
    ("q_int", ValueError, "floating"),
    ("lse_int", ValueError, "floating"),
    ("q_3d", ValueError, "4-D"),
    ("q_list", TypeError, "torch.Tensor"),
    ("scale_neg", ValueError, "scale"),
    ("label", ValueError, "label"),
])
def test_bad_input(case, exc, match):
    q, k, lse = _ok()
    kw = dict(window=2)
    if case == "lse_shape":
        lse = lse[..., :-1]
    elif case == "lse_3heads":
        lse = lse[:, :3]
    elif case == "gqa":
        k = torch.randn(1, 3, 10, 16)
    elif case == "window0":
        kw["window"] = 0
    elif case == "window_float":
        kw["window"] = 2.0
    elif case == "eps0":
        kw["eps"] = 0.0
    elif case == "eps_neg":
        kw["eps"] = -1e-6
    elif case == "eps_str":
        kw["eps"] = "1e-6"
    elif case == "k_len":
        k = k[:, :, :-1]
    elif case == "k_dim":
        k = k[..., :8]
    elif case == "k_batch":
        k = torch.cat([k, k])
    elif case == "q_int":
        q = q.to(torch.int32)
    elif case == "lse_int":
        lse = lse.to(torch.int64)
    elif case == "q_3d":
        q = q[0]
    elif case == "q_list":
        q = q.tolist()
    elif case == "scale_neg":
        kw["scale"] = -1.0
    elif case == "label":
        kw["label"] = "sum"
    with pytest.raises(exc, match=match):
        kvpop_kernels.future_attention_target(q, k, lse, **kw)


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 128), (8, 1, 64), (6, 6, 96)])
@pytest.mark.parametrize("lse_kind", ["dense", "sparse"])
def test_gpu_bf16(Hq, Hkv, D, lse_kind):
    S, w = 1500, 128
    q, k, lse = make(1, Hq, Hkv, S, D, device="cuda", dtype=torch.bfloat16, lse_kind=lse_kind,
                     window=w, sinks=4, kslots=300)
    want = ref.future_attention_target(q, k, lse, window=w)
    out = kvpop_kernels.future_attention_target(q, k, lse, window=w)
    assert_matches(out, want, atol=2e-2, rtol=2e-2, rms=1e-2)


@pytest.mark.gpu
def test_gpu_fp32_and_tiles():
    q, k, lse = make(2, 4, 2, 777, 64, device="cuda", window=33)
    want = ref.future_attention_target(q, k, lse, window=33)
    assert_matches(kvpop_kernels.future_attention_target(q, k, lse, window=33), want, atol=1e-3,
                   rtol=1e-4, rms=1e-4)
    for bt, bu in [(64, 32), (128, 64), (16, 128)]:
        out = ft._triton_target(q, k, lse, 33, 1e-6, 0.125, block_t=bt, block_u=bu)
        assert_matches(out, want, atol=1e-3, rtol=1e-4, rms=1e-4)


@pytest.mark.gpu
def test_gpu_memory_is_linear_in_S():
    """S = 16384, 32/8 heads, D = 128: peak extra memory is the output and nothing of S x S size."""
    S = 16384
    q = torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.full((1, 32, S), 8.0, device="cuda")
    kvpop_kernels.future_attention_target(q, k, lse, window=256)  # autotune outside the measure
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = kvpop_kernels.future_attention_target(q, k, lse, window=256)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert torch.cuda.max_memory_allocated() - base <= 2 * out.numel() * 4 + (1 << 20)


@pytest.mark.gpu
@pytest.mark.parametrize("lp", [("max", 4.0), ("power", 4.0)], ids=_ids)
def test_gpu_labels_bf16(lp):
    q, k, lse = make(1, 8, 2, 1500, 128, device="cuda", dtype=torch.bfloat16, lse_kind="sparse", window=128,
                     sinks=4, kslots=300)
    want = ref.future_attention_target(q, k, lse, window=128, label=lp[0], power=lp[1])
    out = kvpop_kernels.future_attention_target(q, k, lse, window=128, label=lp[0], power=lp[1])
    assert_matches(out, want, atol=2e-2, rtol=2e-2, rms=1e-2)
