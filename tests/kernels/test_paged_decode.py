"""``ragged_paged_decode`` against ``reference.ragged_paged_decode``: both backends (the Triton kernels
through the interpreter here, on CUDA on a GPU; the PyTorch CPU path), odd shapes (group sizes 1 and
3, head size 40, pages of 5, heads with no long-range token, an empty fixed part), shuffled and
strided page tables, unused pages and table entries poisoned with NaN / garbage (never read; on the
PyTorch path unused values are large finite garbage, which it multiplies by 0), and the input checks."""
from __future__ import annotations

import pytest
import torch

import kvpop_kernels._utils as kutils
from kvpop_kernels import ragged_paged_decode, reference

HAS_CUDA = torch.cuda.is_available()


def make_store(Hkv, G, D, F, n_fixed, P, lengths, *, dtype=torch.float32, spare_pages=3, gen=None,
               poison=True, table_dtype=torch.int64):
    """Random inputs: every head's pages drawn from a shuffled pool with spare pages; unused pages,
    unused fixed slots and table entries past a head's pages hold NaN / out-of-range garbage."""
    gen = gen or torch.Generator().manual_seed(0)
    Hq = Hkv * G
    q = torch.randn(Hq, D, generator=gen).to(dtype)
    fixed_k = torch.randn(Hkv, F, D, generator=gen).to(dtype)
    fixed_v = torch.randn(Hkv, F, D, generator=gen).to(dtype)
    need = [-(-n // P) for n in lengths]
    W = max(need + [1]) + 1
    n_pages = sum(need) + spare_pages
    pool_k = torch.randn(n_pages, P, D, generator=gen).to(dtype)
    pool_v = torch.randn(n_pages, P, D, generator=gen).to(dtype)
    order = torch.randperm(n_pages, generator=gen)
    table = torch.full((Hkv, W), 10**6 if poison else 0, dtype=table_dtype)
    used = torch.zeros(n_pages, P, dtype=torch.bool)
    at = 0
    for h, (n, m) in enumerate(zip(lengths, need)):
        table[h, :m] = order[at:at + m].to(table_dtype)
        for i in range(n):
            used[order[at + i // P], i % P] = True
        at += m
    if poison:  # never read by the kernel; the PyTorch path multiplies unreferenced values by 0
        pool_k[~used] = float("nan")
        pool_v[~used] = float("nan") if kutils.interpreting() or HAS_CUDA else 1e6
        fixed_k[:, n_fixed:] = float("nan")
        fixed_v[:, n_fixed:] = float("nan")
    return q, fixed_k, fixed_v, n_fixed, pool_k, pool_v, table, torch.tensor(lengths, dtype=torch.int64)


def check(args, tol=1e-5, **kw):
    ro, rl = reference.ragged_paged_decode(*args, scale=kw.get("scale"))
    o, l = ragged_paged_decode(*args, **kw)
    assert o.dtype == args[0].dtype and l.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(l).any()
    torch.testing.assert_close(o.float(), ro.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(l, rl, atol=tol, rtol=tol)


@pytest.mark.parametrize("Hkv,G,D,F,n_fixed,P,lengths", [
    (3, 3, 40, 7, 7, 5, [0, 13, 41]),     # group 3, head size 40, pages of 5 (41 = 8 pages + 1)
    (2, 1, 16, 5, 3, 4, [5, 0]),          # group 1, a partly filled fixed part, one head with no long tokens
    (4, 2, 32, 6, 6, 16, [1, 64, 17, 130]),  # a head across many tiles and splits
    (2, 4, 24, 0, 0, 3, [9, 3]),          # no fixed part at all
])
def test_matches_reference(backend, Hkv, G, D, F, n_fixed, P, lengths):
    args = make_store(Hkv, G, D, F, n_fixed, P, lengths)
    check(args, **({"block_n": 16} if backend == "triton" else {}))


@pytest.mark.parametrize("P", [1, 4, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_page_sizes_and_split_plans(backend, P, num_splits):
    args = make_store(2, 2, 32, 5, 5, P, [37, 70], gen=torch.Generator().manual_seed(P))
    kw = {"block_n": 16, "num_splits": num_splits} if backend == "triton" else {}
    check(args, **kw)


def test_every_head_empty_and_empty_pool(backend):
    """No key anywhere: zeros and -inf, never NaN (and zero-size pool and table are accepted)."""
    q = torch.randn(4, 16)
    fk = torch.randn(2, 3, 16)
    pool = torch.empty(0, 4, 16)
    o, l = ragged_paged_decode(q, fk, fk.clone(), 0, pool, pool.clone(), torch.empty(2, 0, dtype=torch.int64),
                               torch.zeros(2, dtype=torch.int64))
    assert torch.equal(o, torch.zeros(4, 16)) and torch.equal(l, torch.full((4,), float("-inf")))


def test_strided_table_and_int32_indices(backend):
    """A table that is a column slice of a wider buffer (as the DMS cache passes it), int32 tables and
    lengths, a scale."""
    q, fk, fv, nf, pk, pv, table, lens = make_store(3, 2, 16, 4, 4, 4, [9, 2, 23], table_dtype=torch.int32)
    wide = torch.full((3, table.shape[1] + 3), 10**6, dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    args = (q, fk, fv, nf, pk, pv, wide[:, :table.shape[1]], lens.to(torch.int32))
    check(args, scale=0.3, **({"block_n": 16} if backend == "triton" else {}))


def test_bf16_small(backend):
    """bf16 inputs (the interpreter upcasts after the loads; the GPU feeds tl.dot natively)."""
    args = make_store(2, 4, 64, 6, 6, 16, [100, 37], dtype=torch.bfloat16)
    check(args, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-4)])
def test_gpu_qwen3_shapes(dtype, tol):
    """Qwen3-8B heads (32 / 8, D 128) with DMS-like spread lengths, pages of 16, on the GPU."""
    args = make_store(8, 4, 128, 260, 260, 16, [300, 310, 1700, 3300, 0, 64, 5000, 2047], dtype=dtype)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    ro, rl = reference.ragged_paged_decode(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    o, l = ragged_paged_decode(*args)
    torch.testing.assert_close(o.float().cpu(), ro.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(l.cpu(), rl, atol=tol, rtol=tol)


def test_bad_inputs():
    q, fk, fv, nf, pk, pv, table, lens = make_store(2, 2, 16, 4, 4, 4, [3, 5], poison=False)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        ragged_paged_decode(q[:3], fk, fv, nf, pk, pv, table, lens)
    with pytest.raises(ValueError, match="q's dtype"):
        ragged_paged_decode(q, fk.double(), fv, nf, pk, pv, table, lens)
    with pytest.raises(ValueError, match="n_fixed must be <="):
        ragged_paged_decode(q, fk, fv, 5, pk, pv, table, lens)
    with pytest.raises(TypeError, match="n_fixed must be an int"):
        ragged_paged_decode(q, fk, fv, 2.0, pk, pv, table, lens)
    with pytest.raises(ValueError, match="table must have dtype"):
        ragged_paged_decode(q, fk, fv, nf, pk, pv, table.float(), lens)
    with pytest.raises(ValueError, match="pool_k and pool_v"):
        ragged_paged_decode(q, fk, fv, nf, pk, pv[:, :3], table, lens)
    with pytest.raises(ValueError, match=r"lengths \[Hkv\]"):
        ragged_paged_decode(q, fk, fv, nf, pk, pv, table, lens[:1])
    with pytest.raises(ValueError, match="lengths must lie"):
        ragged_paged_decode(q, fk, fv, nf, pk, pv, table, torch.tensor([3, 99]), check=True)
    bad = table.clone()
    bad[0, 0] = 50
    with pytest.raises(ValueError, match="outside the pool"):
        ragged_paged_decode(q, fk, fv, nf, pk, pv, bad, lens, check=True)
    ragged_paged_decode(q, fk, fv, nf, pk, pv, table, lens, check=True)


_SM90_SCRIPT = r"""
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as exc:
    print(json.dumps({"skip": repr(exc)})); sys.exit(0)
from kvpop_kernels import paged_decode as pd
P = "*" + sys.argv[1]
upcast = P == "*fp32"


def build(kernel, ptrs, constexprs, num_warps):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n) or ("fp32" if n == "qk_scale" else "i32")
           for n in kernel.arg_names}
    src = ASTSource(kernel, sig, constexprs, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 2})


s1 = build(pd._paged_stage1, dict(Q=P, FK=P, FV=P, PK=P, PV=P, TAB="*i64", LEN="*i64", MID_O="*fp32",
                                  MID_L="*fp32"),
           dict(G=4, G_PAD=16, BLOCK_D=128, BLOCK_N=32, UPCAST=upcast), 8 if upcast else 4)
s2 = build(pd._paged_stage2, dict(MID_O="*fp32", MID_L="*fp32", OUT=P, LSE="*fp32"), dict(BLOCK_S=32, BLOCK_D=128), 4)
print(json.dumps({"stage1_shared": s1.metadata.shared, "stage2_shared": s2.metadata.shared}))
"""


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_sm90(dtype):
    """Both stages compile for an H100/H200 (sm_90) without a GPU, in a process without the interpreter
    (Qwen3's group of 4, head size 128), within one block's shared memory."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, dtype], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(f"Triton's compiler API is not reachable: {res['skip']}")
    assert res["stage1_shared"] <= 227 * 1024 and res["stage2_shared"] <= 227 * 1024, res
