"""``paged_mlstm_decode``: one mLSTM decode step on states that live in the pages of a paged cache, read and
written in place.  Oracle: ``kvpop_kernels.reference.paged_mlstm_decode`` (each row's pages gathered whole, the
chunk's read-outs in the matrix form in float64, the pages scattered back), on odd shapes (3 heads, ``d = 5``, a
6-token chunk, a ring of 3 keys of 7, pages of 13 floats: every part of the state straddles pages), shuffled block
tables over stale pages, rows at position 0 (start empty), at a chunk's end (the state carried on), mid-chunk, and
padded (``pos < 0``: nothing read or written).  Against the plugin's PyTorch decode:
``tests/vllm/test_vllm_recurrent.py``."""
import pytest
import torch

from kvpop_kernels import reference
from kvpop_kernels.mlstm_decode import paged_mlstm_decode, state_offsets

H, d, L, W, D, P = 3, 5, 6, 3, 7, 13


def _case(N, seed):
    g = torch.Generator().manual_seed(seed)
    E = -(-state_offsets(H, d, L, W, D)[-1] // P)
    nb = N * E + 4
    pages = torch.randn(nb, P, generator=g)
    table = (torch.randperm(nb - 1, generator=g)[: N * E] + 1).view(N, E).to(torch.int32)
    return pages, table


def _token(N, g):
    kf, vf, q = torch.randn(3, N, H, d, generator=g).unbind(0)
    return kf, vf, torch.randn(N, H, generator=g), -torch.rand(N, H, generator=g), q, torch.randn(N, H, D, generator=g)


def test_steps_match_the_reference(backend):
    """Five rows (one padded) decode 14 steps, crossing two chunk ends; read-outs and every page match the
    reference's after each step; the pages of the padded row (a live row's stale table) and block 0 are
    untouched."""
    N = 5
    pages, table = _case(N, 0)
    table[3] = table[0]  # the padded row points at a live row's pages
    ref = pages.clone()
    pos = torch.tensor([0, 5, 4, -1, 11])
    g = torch.Generator().manual_seed(1)
    for step in range(14):
        args = _token(N, g)
        got = paged_mlstm_decode(pages, table, pos, *args, window=W, chunk=L)
        want = reference.paged_mlstm_decode(ref, table, pos, *args, window=W, chunk=L)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(pages, ref, atol=2e-5, rtol=2e-5)
        pos = torch.where(pos >= 0, pos + 1, pos)
    untouched = torch.tensor([b for b in range(pages.shape[0]) if b not in table.long().flatten().tolist()])
    assert 0 in untouched.tolist()
    assert torch.equal(pages[untouched], _case(N, 0)[0][untouched])


def test_padded_rows_write_nowhere(backend):
    """Rows at ``pos < 0`` (here all of them, over live rows' tables and the null block): no page changes and
    their read-outs are 0."""
    pages, table = _case(3, 2)
    before = pages.clone()
    g = torch.Generator().manual_seed(3)
    table[2] = 0
    out = paged_mlstm_decode(pages, table, torch.tensor([-1, -1, -1]), *_token(3, g), window=W, chunk=L)
    assert torch.equal(pages, before) and torch.equal(out, torch.zeros(3, H, d))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(H, d, L, W, D, P), (8, 64, 128, 16, 128, 4096)], ids=["odd", "qwen3-8b"])
def test_gpu_steps_match_the_reference(shape):
    """The Triton step compiled for this GPU: the odd shapes above and Qwen3-8B's scorer shapes (d 64, chunk 128,
    head dim 128, 16 KB pages), rows at 0, mid-chunk, one padded, over a chunk end; read-outs and pages against
    the reference on CPU copies (float32 dots: tf32 tolerance)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h, dd, ll, ww, hd, pp = shape
    g = torch.Generator().manual_seed(11)
    N = 4
    E = -(-state_offsets(h, dd, ll, ww, hd)[-1] // pp)
    nb = N * E + 4
    ref = torch.randn(nb, pp, generator=g) * 0.1
    table = (torch.randperm(nb - 1, generator=g)[: N * E] + 1).view(N, E).to(torch.int32)
    table[2] = table[0]
    pages = ref.cuda()
    pos = torch.tensor([0, ll - 3, -1, ll + 5])
    for _ in range(ll // 2 + 4):
        args = [torch.randn(N, h, dd, generator=g) for _ in range(2)]
        args += [torch.randn(N, h, generator=g), -torch.rand(N, h, generator=g), torch.randn(N, h, dd, generator=g),
                 torch.randn(N, h, hd, generator=g)]
        got = paged_mlstm_decode(pages, table.cuda(), pos.cuda(), *(a.cuda() for a in args), window=ww, chunk=ll)
        want = reference.paged_mlstm_decode(ref, table, pos, *args, window=ww, chunk=ll)
        torch.testing.assert_close(got.cpu(), want, atol=3e-3, rtol=3e-3)
        torch.testing.assert_close(pages.cpu(), ref, atol=3e-3, rtol=3e-3)
        ref.copy_(pages.cpu())  # carry the GPU's state on, so the tolerance does not compound
        pos = torch.where(pos >= 0, pos + 1, pos)


def test_bad_arguments_named():
    pages, table = _case(2, 0)
    g = torch.Generator().manual_seed(0)
    args = _token(2, g)
    pos = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="contiguous float32"):
        paged_mlstm_decode(pages.double(), table, pos, *args, window=W, chunk=L)
    with pytest.raises(ValueError, match="integer .* block table"):
        paged_mlstm_decode(pages, table[:, :2], pos, *args, window=W, chunk=L)
    with pytest.raises(TypeError, match="kf must be float32"):
        paged_mlstm_decode(pages, table, pos, args[0].double(), *args[1:], window=W, chunk=L)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        paged_mlstm_decode(pages, table, pos, *args, window=0, chunk=L)


_COMPILE_BODY = r"""
from kvpop_kernels import mlstm_decode as md
fn = md._mlstm_step
out = {}
# Qwen3-8B's scorer shapes: d 64, chunk 128, head dim 128; ring tiles of 16
cx = dict(BLOCK_DIM=64, BLOCK_L=128, BLOCK_HD=128, BLOCK_W=16)
ptrs = dict(PAGES="*fp32", TAB="*i32", POS="*i64", KF="*fp32", VF="*fp32", IG="*fp32", LF="*fp32", QF="*fp32",
            KN="*fp32", OUT="*fp32")
sig = {n: "constexpr" if n in cx else ptrs.get(n, "i32") for n in fn.arg_names}
for arch in (90, 80):
    k = triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
    out[f"sm_{arch}"] = {"shared": k.metadata.shared}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90_and_sm80():
    """The in-place mLSTM step builds through the whole CUDA compiler (TTIR -> PTX -> ptxas) for an H100/H200 (sm_90)
    and an A100 (sm_80) without a GPU, in a process without the interpreter, at Qwen3-8B's scorer shapes; shared
    memory within one block's."""
    from compile_check import PREAMBLE, run_without_interpreter

    res = run_without_interpreter(PREAMBLE + _COMPILE_BODY)
    assert set(res) == {"sm_90", "sm_80"}, res
    for name, r in res.items():
        assert r["shared"] <= 163 * 1024, (name, r)
