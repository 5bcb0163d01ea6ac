"""int32 safety of the Triton path: huge ``window``/``sinks``/``k`` are clamped to
equivalent values, and every row offset (sequence index x stride) is computed in int64.

With transformers' transposed query views the stride over the sequence is ``Hq * D`` (4096 for
Qwen3-8B), so ``index * stride`` passes 2**31 near S = 524K tokens: a length this method is for.
Allocating such tensors is out of reach of a CPU test, so the offsets are checked where they are
made: in the Triton IR of each kernel built for sm_90 (no GPU needed).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvpop_kernels as kk
from kvpop_kernels import NEVER, reference

ROOT = Path(__file__).resolve().parents[2]
HUGE = (2**31 - 5, 2**31 - 1, 2**40)


# ----------------------------------------------------------------------------- clamped arguments
@pytest.mark.parametrize("huge", HUGE)
def test_schedule_and_decisions_clamp_window_sinks_and_k(huge):
    S = 40
    p = torch.randn(1, 2, S)
    cases = [dict(sinks=2, window=huge, k=3), dict(sinks=2, window=4, k=huge), dict(sinks=huge, window=4, k=3)]
    for kw in cases:
        clamped = {n: min(v, S) for n, v in kw.items()}
        want = reference.eviction_schedule(p, **clamped)
        ev = kk.eviction_schedule(p, **kw)  # the Triton kernel through the interpreter
        assert ev.dtype == torch.int32 and int(ev.min()) >= 0, kw
        torch.testing.assert_close(ev, want, rtol=0, atol=0, msg=str(kw))
        y, bnd = kk.eviction_decisions(p, **kw)
        y_ref, bnd_ref = reference.eviction_decisions(p, **clamped)
        assert torch.equal(y, y_ref) and torch.equal(bnd, bnd_ref), kw
    assert torch.equal(kk.eviction_schedule(p, sinks=2, window=huge, k=3), torch.full_like(want, NEVER))


@pytest.mark.parametrize("huge", HUGE)
def test_target_clamps_the_window(huge):
    q, k = torch.randn(1, 4, 37, 16), torch.randn(1, 2, 37, 16)
    _, lse = reference.dense_causal_attention(q, k, k)
    r = kk.future_attention_target(q, k, lse, window=huge)  # interpreter
    torch.testing.assert_close(r, reference.future_attention_target(q, k, lse, window=37))
    assert torch.allclose(r, torch.full_like(r, torch.log(torch.tensor(1e-6)).item()))


# ----------------------------------------------------------------------------- int64 row offsets
_IR_SCRIPT = r"""
import importlib, json, re, sys
try:
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except Exception as exc:
    print(json.dumps({"skip": repr(exc)})); sys.exit(0)
sa = importlib.import_module("kvpop_kernels.sparse_attention")
ft = importlib.import_module("kvpop_kernels.future_target")
TARGET = GPUTarget("cuda", 90, 32)


def jit_function(kernel):
    while not isinstance(kernel, JITFunction):  # under an autotuner
        kernel = kernel.fn
    return kernel


def source_ir(kernel, ptrs, constexprs):
    # the kernel's IR as written (before any optimisation), for an sm_90 build
    fn = jit_function(kernel)
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n) or ("fp32" if n in ("qk_scale", "scale", "eps", "power")
                                                                     else "i32") for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs)
    try:
        from triton.compiler.compiler import make_backend
        backend = make_backend(TARGET)
        options = backend.parse_options({"num_warps": 4})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = src.make_ir(TARGET, options, backend.get_codegen_implementation(options),
                             backend.get_module_map(), context)
        return str(module)
    except Exception:  # another Triton's internals: compile it all the way and read its TTIR
        return triton.compile(src, target=TARGET, options={"num_warps": 4, "num_stages": 2}).asm["ttir"]


def row_stride_uses(text):
    # every use of a stride over the sequence axis (an i32 argument stride_<x>s) in every function of the
    # module (the kernel and the @triton.jit helpers it calls), but for passing it on to a helper
    out = {}
    for func in text.split("tt.func")[1:]:
        head, _, body = func.partition("{")
        for n in re.findall(r"%(stride_\w*s): i32", head):
            uses = [ln.strip() for ln in body.splitlines() if re.search("%" + n + r"\b(?!:)", ln)]
            out.setdefault(n, []).extend(u for u in uses if "tt.call" not in u)
    return out


P, common = "*bf16", dict(D=128, BLOCK_D=128, LOWP=True, DOT_PREC="tf32")
kernels = {
    "sparse fwd": (sa._fwd_kernel, dict(Q=P, K=P, V=P, EV="*i32", LIST="*i32", CNT="*i32", O=P, LSE="*fp32"),
                   dict(BLOCK_M=128, BLOCK_Q=32, BLOCK_N=64, **common)),
    "sparse dq": (sa._dq_kernel, dict(Q=P, K=P, V=P, EV="*i32", LIST="*i32", CNT="*i32", O=P, DO=P, LSE="*fp32",
                                      DLSE="*fp32", DELTA="*fp32", DQ=P),
                  dict(BLOCK_M=128, BLOCK_Q=32, BLOCK_N=64, HAS_DLSE=True, **common)),
    "sparse dkdv": (sa._dkdv_kernel, dict(Q=P, K=P, V=P, EV="*i32", PERM="*i32", QLO="*i32", QHI="*i32",
                                          ORDER="*i32", DO=P, LSE="*fp32", DELTA="*fp32", DK=P, DV=P),
                    dict(BLOCK_M=64, BLOCK_N=64, **common)),
    "future target": (ft._target_kernel, dict(Q=P, K=P, L="*fp32", OUT="*fp32"),
                      dict(BLOCK_T=64, BLOCK_U=64, BLOCK_D=128, EVEN_D=True, UPCAST=False, DOT_PREC="tf32",
                           LABEL=1)),
}
res = {}
for name, (kernel, ptrs, constexprs) in kernels.items():
    res[name] = row_stride_uses(source_ir(kernel, ptrs, constexprs))
print(json.dumps(res))
"""


@pytest.mark.slow
def test_row_offsets_are_int64_in_every_kernel():
    """Each stride over the sequence axis enters the kernels' IR only through a sign extension to i64,
    so ``index * stride`` is an i64 product (an i32 one wraps past 2**31)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _IR_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(f"Triton's compiler API is not reachable: {res['skip']}")
    for kernel, strides in res.items():
        assert strides, kernel
        for stride, uses in strides.items():
            assert uses, (kernel, stride, "never used: the check would pass vacuously")
            bad = [u for u in uses if ("arith.extsi %" + stride + " : i32 to i64") not in u]
            assert not bad, (kernel, stride, bad)
