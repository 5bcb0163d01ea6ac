"""``packed_slot_decode``: the packed (head-adaptive) decode over a paged cache, float slots and 8-bit codes
dequantised on load.  Oracle: ``kvpop.vllm.slots.decode_attention`` (float slots) and
``kvpop.vllm.quantized.decode_attention`` (codes and scales; its gather and dequantisation in PyTorch), on pages of
stale bytes with shuffled block tables, budgets no multiple of the block size, rows shared by several layers; and
``kvpop_kernels.reference.ragged_paged_decode`` over each head's slots gathered and dequantised one by one."""
import pytest
import torch

from kvpop.vllm import quantized
from kvpop.vllm.slots import PackedSlots, decode_attention
from kvpop_kernels import reference
from kvpop_kernels.slot_decode import packed_slot_decode

D, G = 16, 3


def _case(storage, budgets, rows, bs, base, seed):
    g = torch.Generator().manual_seed(seed)
    hkv = len(budgets)
    layout = PackedSlots(budgets, rows, base)
    per_req = -(-(base + sum(budgets)) // (rows * bs))
    N = 4
    nb = per_req * N + 3
    if storage == "float32":
        kv = torch.randn(nb, rows, bs, 2 * D, generator=g)
        K, V, ks, vs = kv[..., :D], kv[..., D:], None, None
    else:
        dtype = torch.int8 if storage == "int8" else torch.uint8
        kv = torch.randint(0, 256, (nb, rows, bs, 2 * (D + 4)), generator=g, dtype=torch.uint8).view(dtype)
        K, V, ks, vs = quantized.page_views(kv, D)
        # the occupied slots hold sane scales and codes; the rest stale bytes (never read)
        ks.copy_(torch.rand(ks.shape, generator=g) * 0.05 + 0.001), vs.copy_(torch.rand(vs.shape, generator=g) + 0.01)
        if storage == "fp8":
            codes = (torch.randn(nb, rows, bs, 2, D, generator=g) * 20).to(torch.float8_e4m3fn).view(torch.uint8)
            K.copy_(codes[..., 0, :]), V.copy_(codes[..., 1, :])
    perm = torch.randperm(nb, generator=g)
    table = perm[: N * per_req].view(N, per_req).to(torch.int32)
    pos = torch.tensor([0, 5, 17, 400])
    q = torch.randn(N, hkv * G, D, generator=g)
    return layout, K, V, ks, vs, table, pos, q


@pytest.mark.parametrize("storage", ["float32", "int8", "fp8"])
@pytest.mark.parametrize("budgets,rows,bs,base", [((13, 29, 6), 6, 4, 5), ((40, 40), 2, 32, 0)],
                         ids=["packed-13-29-6", "uniform-40"])
def test_matches_pytorch_decode(backend, storage, budgets, rows, bs, base):
    layout, K, V, ks, vs, table, pos, q = _case(storage, budgets, rows, bs, base, seed=len(budgets))
    scale = D ** -0.5
    if ks is None:
        want = decode_attention(K, V, table, pos, q, layout=layout, scale=scale).float()
    else:
        want = quantized.decode_attention(K, V, ks, vs, table, pos, q, layout=layout, scale=scale)
    b = torch.tensor(budgets, dtype=torch.int32)
    offs = torch.tensor([base + o for o in layout.offsets], dtype=torch.int64)
    got = packed_slot_decode(q, K, V, table, pos, b, offs, rows=rows, block_size=bs, scale=scale, k_scale=ks,
                             v_scale=vs, max_budget=max(budgets), block_n=16)
    torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=2e-5)


def _brute_force(layout, K, V, ks, vs, table, pos, q, rows, bs, scale):
    """Each request's attention by the reference, its heads' occupied slots read one at a time: packed index
    ``u = offset_h + j`` (``j < min(pos + 1, B_h)``) at block ``table[n, u // (rows * bs)]``, row
    ``(u // bs) % rows``, slot ``u % bs``; a code times its slot's scale."""
    def read(x, s, blk, r, o):
        c = x[blk, r, o]
        c = c.view(torch.float8_e4m3fn) if c.dtype == torch.uint8 else c
        return c.float() if s is None else c.float() * float(s[blk, r, o])

    hkv, D = len(layout.budgets), K.shape[-1]
    outs = []
    for n in range(q.shape[0]):
        bmax = max(layout.budgets)
        pk, pv = torch.zeros(hkv, bmax, D), torch.zeros(hkv, bmax, D)
        lengths = torch.zeros(hkv, dtype=torch.long)
        for h, (b_h, off) in enumerate(zip(layout.budgets, layout.offsets)):
            lengths[h] = min(int(pos[n]) + 1, b_h)
            for j in range(int(lengths[h])):
                u = layout.base + off + j
                blk, r, o = int(table[n, u // (rows * bs)]), (u // bs) % rows, u % bs
                pk[h, j], pv[h, j] = read(K, ks, blk, r, o), read(V, vs, blk, r, o)
        tab = torch.arange(hkv)[:, None]  # head h's keys: one page of bmax slots, page h
        out, _ = reference.ragged_paged_decode(q[n].float(), pk[:, :0], pv[:, :0], 0, pk, pv, tab, lengths,
                                                scale=scale)
        outs.append(out)
    return torch.stack(outs)


@pytest.mark.parametrize("storage", ["float32", "int8", "fp8"])
def test_matches_the_reference(backend, storage):
    budgets, rows, bs, base = (13, 29, 6), 6, 4, 5
    layout, K, V, ks, vs, table, pos, q = _case(storage, budgets, rows, bs, base, seed=7)
    scale = D ** -0.5
    b = torch.tensor(budgets, dtype=torch.int32)
    offs = torch.tensor([base + o for o in layout.offsets], dtype=torch.int64)
    got = packed_slot_decode(q, K, V, table, pos, b, offs, rows=rows, block_size=bs, scale=scale, k_scale=ks,
                             v_scale=vs, block_n=16)
    want = _brute_force(layout, K, V, ks, vs, table, pos, q, rows, bs, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "fp8"])
def test_gpu_matches_the_reference(storage):
    """The Triton kernel compiled for this GPU (codes dequantised on load), packed budgets no multiple of the block
    size, against the brute force on CPU copies."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    budgets, rows, bs, base = (13, 29, 6), 6, 4, 5
    layout, K, V, ks, vs, table, pos, q = _case("float32" if storage == "bfloat16" else storage, budgets, rows, bs,
                                                base, seed=8)
    if storage == "bfloat16":
        K, V, q = K.bfloat16(), V.bfloat16(), q.bfloat16()
    scale = D ** -0.5
    want = _brute_force(layout, K, V, ks, vs, table, pos, q.float(), rows, bs, scale)
    b = torch.tensor(budgets, dtype=torch.int32)
    offs = torch.tensor([base + o for o in layout.offsets], dtype=torch.int64)
    cu = [None if x is None else x.cuda() for x in (q, K, V, table, pos, b, offs, ks, vs)]
    got = packed_slot_decode(*cu[:7], rows=rows, block_size=bs, scale=scale, k_scale=cu[7], v_scale=cu[8],
                             block_n=16)
    tol = 2e-2 if storage == "bfloat16" else 3e-3
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


def test_bad_arguments_named():
    layout, K, V, ks, vs, table, pos, q = _case("int8", (13, 29, 6), 6, 4, 5, seed=0)
    b = torch.tensor(layout.budgets)
    offs = torch.tensor(layout.offsets)
    with pytest.raises(ValueError, match="8-bit codes .* need k_scale and v_scale"):
        packed_slot_decode(q, K, V, table, pos, b, offs, rows=6, block_size=4, scale=1.0)
    with pytest.raises(ValueError, match="k's page must be"):
        packed_slot_decode(q, K, V, table, pos, b, offs, rows=5, block_size=4, scale=1.0, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        packed_slot_decode(q, K, V, table, pos, b[:2], offs[:2], rows=6, block_size=4, scale=1.0, k_scale=ks,
                           v_scale=vs)


_COMPILE_SCRIPT = r"""
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as exc:
    print(json.dumps({"skip": repr(exc)})); sys.exit(0)
from kvpop_kernels import slot_decode as sd
fn = sd._slot_decode
out = {}
# (query dtype, slots, arch): float slots, int8 codes, fp8 e4m3 bytes (sm_90 only: no e4m3 below sm_89)
for qd, kv, arch in (("bf16", "bf16", 90), ("fp16", "fp16", 80), ("fp32", "fp32", 80), ("bf16", "i8", 90),
                     ("bf16", "i8", 80), ("bf16", "u8", 90)):
    quant = kv in ("i8", "u8")
    cx = dict(G=4, G_PAD=16, D=128, BLOCK_D=128, BLOCK_N=32, QUANT=quant, FP8=kv == "u8")
    ptrs = dict(Q="*" + qd, K="*" + kv, V="*" + kv, KS="*fp32", VS="*fp32", TAB="*i32", POS="*i64", BUD="*i32",
                OFF="*i64", OUT="*fp32", qk_scale="fp32")
    sig = {n: "constexpr" if n in cx else ptrs.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    out[f"{qd}/{kv}/sm_{arch}"] = {"shared": k.metadata.shared}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90_and_sm80():
    """The packed decode builds through the whole CUDA compiler (TTIR -> PTX -> ptxas) for an H100/H200 (sm_90) and
    an A100 (sm_80) without a GPU, in a process without the interpreter: float slots (bf16, fp16, fp32), int8
    codes, fp8 e4m3 codes (sm_90), Qwen3's group of 4 and head size 128; shared memory within one block's."""
    from compile_check import run_without_interpreter

    res = run_without_interpreter(_COMPILE_SCRIPT)
    assert len(res) == 6, res
    for name, r in res.items():
        assert r["shared"] <= 163 * 1024, (name, r)
