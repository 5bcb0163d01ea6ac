"""Library side of ``kvpop train``'s round three: the label's exponent and epsilon bounded where
float32 computes them faithfully, head-budgets files with a bad importance table, the step stamped into a
run's outputs, and a resume refused when the model files changed.  The table is docs/HARDENING.md."""
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
from tiny import SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
import kvpop_kernels  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _exact_power_label(q, k, lse, window, eps, a):
    """float64 log-domain reference of the power label: log(eps + exp((logsumexp(a x) - log N) / a))."""
    S, D = q.shape[2], q.shape[3]
    G = q.shape[1] // k.shape[1]
    x = torch.einsum("bhud,bhtd->bhut", q.double(), k.double().repeat_interleave(G, 1)) * D ** -0.5
    x = x - lse.double()[..., None]
    u, t = torch.arange(S).view(S, 1), torch.arange(S).view(1, S)
    x = x.masked_fill(~(u >= t + window), -math.inf)
    n = torch.clamp(S - torch.arange(S) - window, min=1).double()
    log_m = (torch.logsumexp(a * x, dim=2) - torch.log(n)) / a
    r = torch.log(eps + torch.exp(log_m))
    return r.view(q.shape[0], k.shape[1], G, S).amax(2), S - window


def test_the_power_labels_exponent_is_bounded_where_float32_computes_it():
    from kvpop.core.config import LABEL_POWER_RANGE

    lo, hi = LABEL_POWER_RANGE
    for bad in (1e-300, 1e-10, lo / 2, hi * 2, 1e300):
        with pytest.raises(ValueError, match=r"label_power must lie in \[0.01, 10000\]"):
            kvpop.KVpopConfig(label="power", label_power=bad)
        with pytest.raises(ValueError, match="label_power must lie in"):
            kvpop.patch(tiny_model(), label="power", label_power=bad, **SMALL)
    # inside the range the label a config computes is the float64 log-domain one (1e-300 gave NaN, 1e-10 the max)
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 96, 16) * 2, torch.randn(1, 2, 96, 16) * 2
    logits = torch.einsum("bhud,bhtd->bhut", q, k.repeat_interleave(2, 1)) * 16 ** -0.5
    lse = torch.logsumexp(logits.masked_fill(~torch.ones(96, 96).tril().bool(), -math.inf), -1)
    for a in (lo, 1.0, hi):
        cfg = kvpop.KVpopConfig(sinks=2, window=8, budget=24, label="power", label_power=a)
        got = kvpop_kernels.future_attention_target(q, k, lse, **cfg.target_kwargs())
        want, n = _exact_power_label(q, k, lse, cfg.window, cfg.eps, a)
        assert torch.isfinite(got).all() and (got[..., :n] - want[..., :n].float()).abs().max() < 1e-3, a


def test_eps_is_bounded_to_what_the_float32_target_can_hold():
    for bad in (1e300, 10.0, 1e-31, 1e-300):
        with pytest.raises(ValueError, match=r"eps must lie in \[1e-30, 1\]"):
            kvpop.KVpopConfig(eps=bad)
    assert kvpop.KVpopConfig(eps=1e-30).eps == 1e-30 and kvpop.KVpopConfig(eps=1.0).eps == 1.0


def test_a_head_budgets_file_with_a_bad_importance_is_a_value_error_naming_file_and_field(tmp_path):
    from kvpop.core.budgets import read_head_budgets

    p = tmp_path / "hb.json"
    for imp in ("high", [[1.0, 2.0], [3.0]], [["a", "b"], ["c", "d"]], [[1, None], [2, 3]], [[True, 1], [1, 1]],
                {"layer0": [1, 2]}):
        p.write_text(json.dumps({"head_budgets": [[24, 24], [24, 24]], "importance": imp}))
        with pytest.raises(ValueError, match=f'{p}: "importance" must be a list of 2 lists of 2 numbers'):
            read_head_budgets(p)
    p.write_text(json.dumps({"head_budgets": [[24, 24], [24, 24]], "importance": [[1, -2], [0, 1]]}))
    with pytest.raises(ValueError, match=f'{p}: "importance": scores must be finite and >= 0'):
        read_head_budgets(p)
    p.write_text(json.dumps({"head_budgets": [[24, 24], [24, 24]], "min_k": "3"}))
    with pytest.raises(ValueError, match="min_k must be an int"):
        read_head_budgets(p)


def test_scorers_and_models_carry_the_step_they_were_saved_at(tmp_path):
    from kvpop.core.checkpoint import read_step
    from kvpop.training.runstate import output_step
    from kvpop.training.train import save_model

    m = kvpop.patch(tiny_model(), **SMALL)
    kvpop.save_scorers(m, tmp_path / "plain.safetensors")
    kvpop.save_scorers(m, tmp_path / "s.safetensors", step=7)
    assert read_step(tmp_path / "plain.safetensors") is None and read_step(tmp_path / "s.safetensors") == 7
    kvpop.load_scorers(kvpop.patch(tiny_model(), **SMALL), tmp_path / "s.safetensors")  # still a scorer file
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        kvpop.save_scorers(m, tmp_path / "bad.safetensors", step=-1)
    save_model(m, tmp_path / "model", step=7)
    assert output_step(tmp_path / "model") == 7 and output_step(tmp_path / "s.safetensors") == 7
    save_model(m, tmp_path / "model")  # a save without a step leaves no stamp of the weights it replaced
    assert output_step(tmp_path / "model") is None
    save_model(m, tmp_path / "model", step=8)
    assert output_step(tmp_path / "model") == 8


def test_a_resume_refuses_changed_model_files_naming_them(tmp_path):
    from kvpop.training.runstate import RunMismatch
    from kvpop.training.train import TrainConfig, train

    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 128, (1, 48), generator=g) for _ in range(2)]
    cfg = dict(progress=False, checkpoint_dir=str(tmp_path), model_fingerprint={"config.json": "a", "w.bin": "b"})
    m = kvpop.patch(tiny_model(), **SMALL)
    train(m, data, TrainConfig(steps=1, **cfg))
    m = kvpop.patch(tiny_model(), **SMALL)
    cfg["model_fingerprint"] = {"config.json": "a", "w.bin": "c", "extra.bin": "d"}
    with pytest.raises(RunMismatch, match=r"other model files: extra.bin \(new\), w.bin changed since") as e:
        train(m, data, TrainConfig(steps=2, **cfg), resume=True)
    assert e.value.what == "model" and e.value.fields == ("extra.bin", "w.bin")
    with pytest.raises(RunMismatch, match="another KVpopConfig: budget was 24, now 25") as e:
        train(kvpop.patch(tiny_model(), **{**SMALL, "budget": 25}), data, TrainConfig(steps=2, **cfg), resume=True)
    assert e.value.fields == ("budget",)
