"""target_source="teacher": the exact target computed inside the frozen teacher's forward, layer by layer."""
import pytest
import torch

pytest.importorskip("transformers")
from tiny import SMALL, record_qk, tiny_model

import kvpop
from kvpop_kernels import reference


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_teacher_targets_match_the_reference(family):
    torch.manual_seed(0)
    teacher = kvpop.make_teacher(tiny_model(family=family))
    cfg = kvpop.KVpopConfig(**SMALL, eps=1e-5)
    ids = torch.randint(0, 128, (2, 37))
    rec, ref_logits = record_qk(teacher, ids)
    prev = teacher.config._attn_implementation
    with torch.no_grad(), kvpop.teacher_targets(teacher, cfg) as targets:
        logits = teacher(ids).logits
    assert teacher.config._attn_implementation == prev  # restored
    assert sorted(targets) == sorted(rec) == list(range(teacher.config.num_hidden_layers))
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)  # the teacher still runs dense
    for i, (q, k, scale) in rec.items():
        lse = reference.dense_causal_attention(q, k, k, scale=scale)[1]
        want = reference.future_attention_target(q, k, lse, window=cfg.window, eps=cfg.eps, scale=scale)
        assert targets[i].shape == (2, k.shape[1], 37) and targets[i].dtype == torch.float32
        torch.testing.assert_close(targets[i], want, atol=1e-5, rtol=1e-5)
    assert not any(hasattr(m, "kvpop_target_spec") for m in teacher.modules())


def test_student_equal_to_teacher_takes_the_teachers_target_in_layer_0():
    """Layer 0's q, k do not depend on the mask: the teacher target there equals the student's dense one."""
    torch.manual_seed(1)
    base = tiny_model()
    teacher = kvpop.make_teacher(base)
    ids = torch.randint(0, 128, (1, 64))
    sums = {}
    for src in ("student", "teacher", "shuffled"):
        m = kvpop.make_teacher(base)
        m.requires_grad_(True)
        torch.manual_seed(5)
        kvpop.patch(m, **SMALL, target_lse="dense", target_source="student" if src == "student" else "teacher").train()
        if src != "student":
            with torch.no_grad(), kvpop.teacher_targets(teacher, kvpop.get_config(m)) as t:
                teacher(ids)
            if src == "shuffled":  # the layer reads what it is handed
                t = {i: v.flip(-1) for i, v in t.items()}
            kvpop.set_teacher_targets(m, t)
        m(ids)
        sums[src] = kvpop.kvpop_layers(m)[0].loss_terms["loss_sum"].detach()
        kvpop.score_loss(m)
    torch.testing.assert_close(sums["teacher"], sums["student"], atol=1e-5, rtol=1e-5)
    assert abs(float(sums["shuffled"] - sums["teacher"])) > 1e-3


def test_teacher_source_errors():
    m = kvpop.patch(tiny_model(), **SMALL, target_source="teacher").train()
    with pytest.raises(RuntimeError, match="teacher target"):
        m(torch.randint(0, 128, (1, 64)))
    with pytest.raises(ValueError, match="target_source"):
        kvpop.KVpopConfig(target_source="oracle")
    with pytest.raises(ValueError, match="unpatched"):
        with kvpop.teacher_targets(m, kvpop.get_config(m)):
            pass
    with pytest.raises(KeyError, match="layer 1"):
        kvpop.set_teacher_targets(m, {0: torch.zeros(1, 2, 64)})


def test_train_with_the_teacher_target():
    from kvpop.training.train import TrainConfig, train

    m = tiny_model()
    teacher = kvpop.make_teacher(m)
    torch.manual_seed(11)
    kvpop.patch(m, **SMALL, target_source="teacher")
    data = [torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(7))]
    hist = train(m, data, TrainConfig(steps=6, lr_scorer=1e-2, train_model=False, progress=False), teacher=teacher)
    assert hist[-1]["score"] < hist[0]["score"]
    assert all(layer.teacher_target is None for layer in kvpop.kvpop_layers(m))  # cleared after each step
