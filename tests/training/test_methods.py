"""The training loop's method interface: train() finds the method from the patch, a method object attaches
itself, and a new method plugs in (its parameter groups, loss, step hook and layer file) without the loop
knowing it."""
import pytest
import torch

pytest.importorskip("transformers")
from tiny import SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
from kvpop.baselines import dms as D  # noqa: E402
from kvpop.training.methods import DMSMethod, KVpopMethod, TrainingMethod, method_for  # noqa: E402
from kvpop.training.train import TrainConfig, train  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _data(n=2, B=1, S=40):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (B, S), generator=g) for _ in range(n)]


def test_the_method_is_found_from_the_patch():
    m = kvpop.patch(tiny_model(), **SMALL)
    meth = method_for(m)
    assert type(meth) is KVpopMethod and meth.config == kvpop.get_config(m)
    d = D.patch_dms(tiny_model(), sinks=2, window=8)
    assert type(method_for(d)) is DMSMethod and method_for(d).config == D.get_dms_config(d)
    with pytest.raises(ValueError, match="needs a patched model"):
        method_for(tiny_model())


def test_a_method_object_attaches_itself_and_matches_the_patch():
    m = tiny_model()
    cfg = kvpop.KVpopConfig(**SMALL)
    train(m, _data(1), TrainConfig(steps=1, progress=False, train_model=False), method=KVpopMethod(cfg))
    assert kvpop.get_config(m) == cfg
    with pytest.raises(ValueError, match="patched with KVpop, the method is DMS"):
        train(m, _data(1), TrainConfig(steps=1, progress=False), method=DMSMethod(D.DMSConfig(sinks=2, window=8)))
    with pytest.raises(TypeError, match="method must be"):
        train(m, _data(1), TrainConfig(steps=1, progress=False), method="kvpop")


def test_train_with_the_inferred_method_equals_train_with_the_explicit_one():
    """The default (method from the patch) and method=KVpopMethod(config) run the same steps."""
    def run(explicit):
        m = tiny_model()
        torch.manual_seed(3)
        kvpop.patch(m, **SMALL)
        method = KVpopMethod(kvpop.get_config(m)) if explicit else None
        return train(m, _data(), TrainConfig(steps=2, lr_model=1e-3, progress=False), method=method)

    assert run(False) == run(True)


class HalvedGates(DMSMethod):
    """A new method as a user would write it: DMS's gates with their own learning rate, a step hook that
    records the steps, and its own layer file name; the loop is not touched."""

    layer_file = "halved.safetensors"

    def __init__(self, config):
        super().__init__(config)
        self.steps = []

    def param_groups(self, params, cfg):
        return [{"params": [p for _, p in params], "lr": cfg.lr_scorer / 2, "weight_decay": 0.0}]

    def before_forward(self, model, step, targets):
        self.steps.append(step)
        super().before_forward(model, step, targets)

    def aux_loss(self, model):
        loss, stats = super().aux_loss(model)
        return 2 * loss, {**stats, "doubled": 1.0}


def test_a_new_method_plugs_in_without_touching_the_loop(tmp_path):
    m = D.patch_dms(tiny_model(), sinks=2, window=8, schedule_steps=2)
    method = HalvedGates(None)
    hist = train(m, _data(), TrainConfig(steps=3, grad_accum=2, progress=False, checkpoint_dir=str(tmp_path)),
                 method=method)
    assert method.config == D.get_dms_config(m)  # taken from the model it is bound to
    assert method.steps == [1, 1, 2, 2, 3, 3]  # the 1-based step, once per micro-batch
    assert all(h["doubled"] == 1.0 for h in hist)
    assert (tmp_path / "halved.safetensors").is_file() and not (tmp_path / "gates.safetensors").exists()
    g = D.load_dms(tiny_model(), tmp_path / "halved.safetensors")
    assert torch.equal(D.dms_layers(g)[0].gate.bias, D.dms_layers(m)[0].gate.bias)


def test_the_interface_says_what_a_method_must_provide():
    class Bare(TrainingMethod):
        spec = kvpop.core.patching.SPEC
        layer_file = "x.safetensors"

    m = kvpop.patch(tiny_model(), **SMALL)
    with pytest.raises(NotImplementedError):
        Bare(None).aux_loss(m)
    assert Bare(None).owns("model.layers.0.self_attn.kvpop.scorer.w") and not Bare(None).owns("lm_head.weight")


def test_a_control_that_trains_no_scorer_is_not_told_its_l_score_is_zero():
    """A step that ranked nothing gets the note for a learned priority, none for a priority that is not learned
    (no L_score by design)."""
    from kvpop.core.config import KVpopConfig

    rec = {"step": 1, "decisions": 0}
    cfg = KVpopConfig(sinks=2, window=4, budget=24)
    assert "no token competed" in KVpopMethod(cfg).note(rec, 128)
    assert KVpopMethod(cfg.replace(priority_source="keynorm+")).note(rec, 128) is None
    assert KVpopMethod(cfg).note({"step": 1, "decisions": 3}, 128) is None
