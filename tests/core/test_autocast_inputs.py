"""Under autocast the kvpop attention takes its inputs in autocast's dtype, as SDPA does.

Found by the first GPU run (2026-12-04, ``tests/cli/test_cli_train.py::test_bf16_on_cuda``): under ``--bf16``
autocast, Qwen3's q/k norms (float32 weights) give float32 queries and keys beside a bf16 ``v_proj``, and the
kernels refused the mix.  CPU autocast takes the same route, so this runs here: a tiny patched Qwen3, float32
weights, under ``torch.autocast("cpu", bfloat16)``, its forward and backward in both the student (KVpop mask)
and the teacher-target attention, against the same model fed bf16 inputs by hand."""
import pytest
import torch

import kvpop
from kvpop.core.attention import autocast_inputs
from tests.tiny import tiny_model


def test_inputs_follow_autocast():
    q, k = torch.randn(2, 3), torch.randn(2, 3)
    v = torch.randn(2, 3, dtype=torch.bfloat16)
    assert [x.dtype for x in autocast_inputs(q, k, v)] == [torch.float32, torch.float32, torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {x.dtype for x in autocast_inputs(q, k, v)} == {torch.bfloat16}


@pytest.mark.parametrize("policy", ["kvpop", "streaming"])
def test_patched_forward_and_backward_under_autocast(policy):
    model = tiny_model()
    kvpop.patch(model, kvpop.KVpopConfig(sinks=2, window=8, budget=16, policy=policy))
    model.train()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids).logits
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    out.float().logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    model.zero_grad()
    with torch.no_grad():
        want = model(ids).logits  # float32 without autocast: bf16's rounding apart, the same function
    assert float((out.detach().float() - want).abs().max()) < 0.25


def test_teacher_targets_under_autocast():
    teacher = kvpop.make_teacher(tiny_model())
    cfg = kvpop.KVpopConfig(sinks=2, window=8, budget=16)
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), kvpop.teacher_targets(teacher, cfg) as want:
        teacher(ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), kvpop.teacher_targets(teacher, cfg) as got:
        teacher(ids)
    for i in want:
        assert got[i].dtype == torch.float32 and bool(torch.isfinite(got[i]).all())
        rel = (got[i] - want[i]).norm() / want[i].norm()
        assert float(rel) < 0.05, (i, float(rel))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_dms_under_autocast(train):
    """DMS's attention takes the same route: its evaluation runs the sparse kernel, which refused the mix too."""
    from kvpop.baselines import dms as D

    model = tiny_model()
    D.patch_dms(model, sinks=2, window=4)
    model.train(train)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.set_grad_enabled(train), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids).logits
    assert bool(torch.isfinite(out).all())
    if train:
        out.float().logsumexp(-1).mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
