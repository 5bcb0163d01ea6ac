"""The label family through the config, the teacher's target, the oracle mask and the score loss; the
decay range tied to the training length (``decay_range_for_context``)."""
import math

import pytest
import torch

pytest.importorskip("transformers")
from tiny import SMALL, record_qk, tiny_model

import kvpop
from kvpop.core.config import decay_range_for_context
from kvpop_kernels import reference


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# ----------------------------------------------------------------------------- config
def test_label_config_defaults_roundtrip_and_errors():
    c = kvpop.KVpopConfig()
    assert (c.label, c.label_power) == ("mean", 4.0)
    assert c.target_kwargs() == {"window": 256, "eps": 1e-6, "label": "mean", "power": 4.0}
    c2 = kvpop.KVpopConfig(label="power", label_power=2.5)
    assert kvpop.KVpopConfig.from_json(c2.to_json()) == c2
    old = {k: v for k, v in c2.to_dict().items() if k not in ("label", "label_power")}  # an older checkpoint
    assert kvpop.KVpopConfig.from_dict(old).label == "mean"
    assert c2.structural_mismatch(kvpop.KVpopConfig()) == []  # the label does not change the scorer's shape
    with pytest.raises(ValueError, match=r"label must be one of \['mean', 'max', 'power'\], got 'median'"):
        kvpop.KVpopConfig(label="median")
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="label_power must be a finite number > 0"):
            kvpop.KVpopConfig(label="power", label_power=bad)
    for bad in ("4", True, None):
        with pytest.raises(TypeError, match="label_power must be a float"):
            kvpop.KVpopConfig(label_power=bad)


# ----------------------------------------------------------------------------- through the model
def _layer0_qk(model, ids):
    """Every layer's rotated q, k and scale of a dense forward (layer 0's do not depend on any mask)."""
    return record_qk(model, ids)[0]


@pytest.mark.parametrize("label,power", [("max", 4.0), ("power", 3.0), ("mean", 4.0)])
def test_teacher_targets_and_oracle_mask_use_the_label(label, power):
    torch.manual_seed(0)
    base = tiny_model()
    teacher = kvpop.make_teacher(base)
    ids = torch.randint(0, 128, (2, 53))
    rec = _layer0_qk(teacher, ids)
    cfg = kvpop.KVpopConfig(**SMALL, eps=1e-5, label=label, label_power=power)
    with torch.no_grad(), kvpop.teacher_targets(teacher, cfg) as targets:
        teacher(ids)
    for i, (q, k, scale) in rec.items():
        lse = reference.dense_causal_attention(q, k, k, scale=scale)[1]
        want = reference.future_attention_target(q, k, lse, window=8, eps=1e-5, scale=scale, label=label,
                                                 power=power)
        torch.testing.assert_close(targets[i], want, atol=1e-5, rtol=1e-5)
        if label != "mean":  # the label is not the mean on these inputs: the test can fail
            mean = reference.future_attention_target(q, k, lse, window=8, eps=1e-5, scale=scale)
            assert float((want - mean).abs().max()) > 0.1
    # the oracle mask (mask_source="teacher", the student's own dense target) in layer 0 uses the label
    m = kvpop.patch(kvpop.make_teacher(base), cfg, mask_source="teacher").eval()
    with torch.no_grad():
        m(ids)
    q, k, scale = rec[0]
    lse = reference.dense_causal_attention(q, k, k, scale=scale)[1]
    tgt = reference.future_attention_target(q, k, lse, window=8, eps=1e-5, scale=scale, label=label, power=power)
    layer = kvpop.kvpop_layers(m)[0]
    want_p = tgt - torch.arange(53).float() * layer.log_gamma().detach()[:, None]
    torch.testing.assert_close(layer.last_priority, want_p, atol=1e-5, rtol=1e-5)


def test_score_loss_trains_on_the_label():
    """Layer 0's L_score with label='max' equals score_loss_terms on the max target, and differs from the mean's."""
    from kvpop.core.loss import score_loss_terms

    torch.manual_seed(1)
    base = tiny_model()
    ids = torch.randint(0, 128, (1, 64))
    q, k, scale = _layer0_qk(kvpop.make_teacher(base), ids)[0]
    lse = reference.dense_causal_attention(q, k, k, scale=scale)[1]
    sums = {}
    for label in ("max", "mean"):
        m = kvpop.make_teacher(base)
        torch.manual_seed(5)
        kvpop.patch(m, **SMALL, target_lse="dense", label=label).train()
        layer = kvpop.kvpop_layers(m)[0]
        cap = {}
        hook = layer.scorer.register_forward_hook(lambda mod, a, o, cap=cap: cap.setdefault("r", o.detach()))
        m(ids)
        hook.remove()
        sums[label] = float(layer.loss_terms["loss_sum"].detach())
        kvpop.score_loss(m)
        tgt = reference.future_attention_target(q, k, lse, window=8, scale=scale, label=label)
        want = score_loss_terms(cap["r"], tgt, layer.log_gamma().detach(), sinks=2, window=8, k=14)
        assert abs(float(want["loss_sum"]) - sums[label]) < 1e-4 * max(1.0, abs(sums[label]))
    assert abs(sums["max"] - sums["mean"]) > 1e-3


# ----------------------------------------------------------------------------- decay range
@pytest.mark.parametrize("train_len,nats", [(512, 8.0), (16384, 16.0), (100, 0.5), (4096, 2.0)])
def test_decay_range_spans_the_stated_nats(train_len, nats):
    r = decay_range_for_context(train_len, nats)
    assert math.isclose(-train_len * math.log(r["gamma_min"]), nats, rel_tol=1e-9)
    assert r["gamma_max"] == kvpop.KVpopConfig().gamma_max
    c = kvpop.KVpopConfig(**r)  # a valid config (gamma_init strictly inside)
    assert c.gamma_min < c.gamma_init < c.gamma_max


def test_decay_range_init_and_errors():
    assert decay_range_for_context(512, 8.0)["gamma_init"] == 0.9999  # the default init when inside
    r = decay_range_for_context(512, 0.01)  # gamma_min = 0.99998 > 0.9999: the init moves inside
    assert r["gamma_min"] < r["gamma_init"] < r["gamma_max"]
    assert math.isclose(1 - r["gamma_init"], math.sqrt((1 - r["gamma_min"]) * (1 - r["gamma_max"])))
    with pytest.raises(ValueError, match="gamma_min"):
        decay_range_for_context(512, 1e-6)  # below gamma_max's own span
    with pytest.raises(ValueError, match="span_nats"):
        decay_range_for_context(512, 0.0)
    with pytest.raises(TypeError, match="train_len"):
        decay_range_for_context(512.0, 8.0)
    # the paper's fixed range spans 16.4 nats at its training length, 0.51 at the lookahead task's
    assert math.isclose(-16384 * math.log(0.999), 16.39, abs_tol=0.01)


def test_learned_decay_reaches_the_lower_end():
    """The learned per-head decay is free to reach gamma_min: gradient steps that ask for a stronger age
    penalty drive every head to within 1 % of the range's lower end (in 1 - gamma)."""
    r = decay_range_for_context(64, 8.0)
    m = kvpop.patch(tiny_model(), sinks=2, window=8, budget=24, **r)
    layers = kvpop.kvpop_layers(m)
    opt = torch.optim.Adam([lay.decay_logit for lay in layers], lr=0.5)
    for _ in range(200):
        loss = sum(lay.log_gamma().sum() for lay in layers)  # minimise log(gamma): the strongest decay
        opt.zero_grad()
        loss.backward()
        opt.step()
    for lay in layers:
        g = lay.gamma().detach().double()
        assert torch.all((1 - g) >= 0.99 * (1 - r["gamma_min"])), g
        assert torch.all(g >= r["gamma_min"] - 1e-7)
