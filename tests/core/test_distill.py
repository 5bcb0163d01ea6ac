"""The distillation KL (docs/DESIGN.md section 3): top-k with a rest bucket, dense and fused/chunked."""
import pytest
import torch

from kvpop import TeacherTopK, distill_loss, fused_distill_loss, fused_teacher_topk, teacher_topk


def _folded_kl(s, t, k):
    """Literal statement in float64: both softmaxes over the full vocabulary, folded into K + rest."""
    s, t = s.double(), t.double()
    ps, pt = torch.softmax(s, -1), torch.softmax(t, -1)
    idx = torch.topk(t, min(k, t.shape[-1]), dim=-1).indices
    ps_k, pt_k = ps.gather(-1, idx), pt.gather(-1, idx)
    ps_r, pt_r = 1 - ps_k.sum(-1), (1 - pt_k.sum(-1)).clamp(min=0)
    kl = (pt_k * (pt_k.log() - ps_k.log())).sum(-1)
    rest = torch.where(pt_r > 0, pt_r * (pt_r.log() - ps_r.clamp(min=1e-300).log()), torch.zeros_like(pt_r))
    return (kl + rest).mean()


def test_matches_the_literal_folded_kl_and_full_kl_when_k_covers_v():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 300), torch.randn(2, 5, 300)
    torch.testing.assert_close(distill_loss(s, t, top_k=16).double(), _folded_kl(s, t, 16), atol=1e-6, rtol=1e-5)
    s, t = torch.randn(3, 4, 50), torch.randn(3, 4, 50)
    full = (torch.softmax(t, -1) * (torch.log_softmax(t, -1) - torch.log_softmax(s, -1))).sum(-1).mean()
    torch.testing.assert_close(distill_loss(s, t, top_k=256), full, atol=1e-6, rtol=1e-5)


def test_student_equal_to_teacher_gives_zero_and_a_shift_changes_nothing():
    torch.manual_seed(1)
    s = 3 * torch.randn(2, 5, 300)
    assert float(distill_loss(s, s.clone(), top_k=8)) == pytest.approx(0.0, abs=1e-6)
    assert float(distill_loss(s + 3.0, s, top_k=8)) == pytest.approx(0.0, abs=1e-5)  # softmax is shift-invariant
    assert float(distill_loss(s, s + torch.randn_like(s), top_k=8)) > 1e-3


def test_moving_student_mass_outside_the_set_costs():
    """The old renormalised-student KL gave 0 here: the student keeps the teacher's shape on the top-k set
    but moves ever more of its mass to tokens outside it."""
    torch.manual_seed(2)
    t = 2 * torch.randn(4, 200)
    idx = torch.topk(t, 16, dim=-1).indices
    outside = torch.ones_like(t, dtype=torch.bool).scatter_(-1, idx, False)
    losses = [float(distill_loss(t + shift * outside, t, top_k=16)) for shift in (0.0, 1.0, 3.0, 10.0)]
    assert losses[0] == pytest.approx(0.0, abs=1e-6)
    assert all(a < b for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] > 5.0  # ~all of the student's mass outside the set: ~log(1 / p_S(K)) per position


@pytest.mark.parametrize("k", [7, 64])
def test_gradient_matches_autograd_through_the_literal_kl(k):
    torch.manual_seed(3)
    s = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 64, dtype=torch.float64)
    _folded_kl(s, t, k).backward()
    s32 = s.detach().float().requires_grad_(True)
    distill_loss(s32, t.float(), top_k=k).backward()
    torch.testing.assert_close(s32.grad.double(), s.grad, atol=1e-6, rtol=1e-4)


def test_teacher_topk_and_mask_and_errors():
    torch.manual_seed(4)
    s, t = torch.randn(2, 6, 40, requires_grad=True), torch.randn(2, 6, 40)
    tk = teacher_topk(t, 5)
    assert isinstance(tk, TeacherTopK) and tk.logp.shape == (2, 6, 5) and tk.rest.shape == (2, 6)
    torch.testing.assert_close(tk.logp.exp().sum(-1) + tk.rest.exp(), torch.ones(2, 6))
    torch.testing.assert_close(distill_loss(s, tk), distill_loss(s, t, top_k=5))
    assert torch.isneginf(teacher_topk(t, 40).rest).all()
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, :3] = True
    torch.testing.assert_close(distill_loss(s, t, top_k=5, mask=mask), distill_loss(s[0, :3], t[0, :3], top_k=5))
    with pytest.raises(ValueError, match="one shape"):
        distill_loss(s, t[..., :10])
    with pytest.raises(TypeError, match="TeacherTopK"):
        distill_loss(s, (tk.logp, tk.indices))
    with pytest.raises(ValueError, match="top_k"):
        distill_loss(s, t, top_k=0)


# ----------------------------------------------------------------------------- fused, chunked
@pytest.mark.parametrize("N,V,k,chunk,bias", [(37, 101, 8, 5, False), (23, 64, 64, 7, True), (9, 50, 3, 100, False)])
def test_fused_equals_dense_loss_and_gradients(N, V, k, chunk, bias):
    """fp32, odd positions and chunk sizes, V not a multiple of the chunk (and k == V: no rest bucket)."""
    torch.manual_seed(5)
    H = 12
    h_t, h_s = torch.randn(N, H), torch.randn(N, H, requires_grad=True)
    W_t, W = torch.randn(V, H), torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if bias else None
    tk = fused_teacher_topk(h_t, W_t, k, chunk_size=chunk)
    ref_t = teacher_topk(h_t @ W_t.t(), k)
    for a, r in zip(tk, ref_t):
        torch.testing.assert_close(a, r)
    mask = torch.rand(N) > 0.3
    fused = fused_distill_loss(h_s, W, tk, bias=b, mask=mask, chunk_size=chunk)
    grads = torch.autograd.grad(fused, [h_s, W] + ([b] if bias else []))
    logits = h_s @ W.t() + (b if bias else 0)
    dense = distill_loss(logits, ref_t, mask=mask)
    ref_grads = torch.autograd.grad(dense, [h_s, W] + ([b] if bias else []))
    torch.testing.assert_close(fused, dense, atol=1e-6, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-4)


def test_fused_batched_shapes_and_tied_weight():
    """[B, S, H] hidden states; one weight used twice (tied embeddings) gets both gradients."""
    torch.manual_seed(6)
    B, S, H, V = 2, 13, 8, 30
    emb = torch.randn(V, H, requires_grad=True)
    ids = torch.randint(0, V, (B, S))
    h = torch.tanh(emb[ids])
    t = teacher_topk(torch.randn(B, S, V), 4)
    loss = fused_distill_loss(h, emb, t, chunk_size=6)
    (g,) = torch.autograd.grad(loss, emb)
    h2 = torch.tanh(emb[ids])
    (g2,) = torch.autograd.grad(distill_loss(h2 @ emb.t(), t), emb)
    torch.testing.assert_close(g, g2, atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="positions"):
        fused_distill_loss(h[:, :5], emb, t)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_distill_loss(h, emb, t, chunk_size=0)
    with pytest.raises(TypeError, match="TeacherTopK"):
        fused_distill_loss(h, emb, (t.logp, t.indices))


def test_fused_under_autocast_matmuls_in_bf16_softmax_in_float32():
    """Under bf16 autocast the head's matmuls run in bf16 (forward and recomputed backward), the loss is
    float32 and close to the float32 one; gradients keep the inputs' dtypes."""
    torch.manual_seed(7)
    N, H, V = 19, 16, 70
    h = torch.randn(N, H, requires_grad=True)
    W = (0.3 * torch.randn(V, H)).requires_grad_(True)
    t = fused_teacher_topk(torch.randn(N, H), W.detach(), 5, chunk_size=4)
    ref = fused_distill_loss(h, W, t, chunk_size=4)
    ref_g = torch.autograd.grad(ref, [h, W])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_distill_loss(h, W, t, chunk_size=4)
        t_ac = fused_teacher_topk(torch.randn(N, H), W.detach(), 5, chunk_size=4)
    assert got.dtype == torch.float32 and t_ac.logp.dtype == torch.float32
    got_g = torch.autograd.grad(got, [h, W])
    assert float((got - ref).detach().abs()) > 0  # bf16 matmuls really ran
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    for g, r in zip(got_g, ref_g):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, atol=2e-2, rtol=5e-2)
