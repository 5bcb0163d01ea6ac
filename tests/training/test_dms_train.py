"""DMS through the training loop and ``kvpop train --method dms``: the compression loss pulls the keep
rate down its schedule, the model distils from the dense original, checkpoints hold the gates."""
import json

import pytest
import torch
from tiny import tiny_model

from kvpop.baselines import dms as D
from kvpop.cli import main
from kvpop.training.train import TrainConfig, train


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_train_drives_the_keep_rate_to_the_target(tmp_path):
    model = tiny_model()
    D.patch_dms(model, sinks=2, window=4, target_keep=0.5, schedule_steps=4, tau=0.5)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (2, 40), generator=g) for _ in range(4)]
    hist = train(model, data, TrainConfig(steps=14, lr_scorer=0.2, lr_model=1e-3, progress=False,
                                          checkpoint_dir=str(tmp_path)))
    assert hist[0]["target_keep"] == pytest.approx(1 / 1.25) and hist[3]["target_keep"] == pytest.approx(0.5)
    assert hist[-1]["target_keep"] == pytest.approx(0.5)
    assert hist[0]["keep_frac"] > 0.95
    assert hist[-1]["keep_frac"] < 0.75, [round(h["keep_frac"], 3) for h in hist]
    assert all(h["kl"] >= 0 for h in hist) and any(h["kl"] > 0 for h in hist[1:])
    assert (tmp_path / "gates.safetensors").exists() and not (tmp_path / "scorers.safetensors").exists()
    loaded = D.load_dms(tiny_model(), tmp_path / "gates.safetensors")
    for a, b in zip(D.dms_layers(model), D.dms_layers(loaded)):
        torch.testing.assert_close(a.gate.bias, b.gate.bias)


def test_kvpop_train_method_dms(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--method", "dms", "--tiny", "--task", "--seq-len", "64", "--sinks", "2", "--window", "8",
               "--steps", "3", "--target-keep", "0.25", "--no-progress", "--out", str(out)])
    assert rc == 0
    assert (out / "gates.safetensors").exists() and (out / "model" / "config.json").exists()
    hist = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist] == [1, 2, 3] and hist[-1]["target_keep"] == pytest.approx(0.25)
    cfg = D.read_dms_config(out / "gates.safetensors")
    assert (cfg.sinks, cfg.window, cfg.target_keep, cfg.schedule_steps) == (2, 8, 0.25, 3)
    assert "keep" in capsys.readouterr().out


def test_kvpop_train_method_dms_user_errors(tmp_path):
    base = ["train", "--method", "dms", "--tiny", "--task", "--seq-len", "64", "--window", "8", "--steps", "1",
            "--no-progress"]
    with pytest.raises(SystemExit, match="schedule_steps must be >= 1"):
        main(base + ["--schedule-steps", "0", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="target_keep"):
        main(base + ["--target-keep", "1.5", "--out", str(tmp_path / "b")])


def _hist(out):
    return [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]


def test_dms_defaults_reach_the_target_keep_on_the_shipped_model(tmp_path, capsys):
    """kvpop train --method dms with its default learning rates on the shipped model: the keep fraction of
    the last 10 steps is within KEEP_MARGIN (25%) of the target (measured: 0.115-0.123 over seeds 0-2 at
    this size; with 1e-3, the former shared default, the gates barely move: keep 0.98 at length 256)."""
    from kvpop.training.rundir import KEEP_MARGIN, keep_miss

    out = tmp_path / "run"
    assert main(["train", "--method", "dms", "--task", "--seq-len", "128", "--window", "16", "--steps", "60",
                 "--target-keep", "0.125", "--no-progress", "--out", str(out)]) == 0
    hist = _hist(out)
    keep = sum(h["keep_frac"] for h in hist[-10:]) / 10
    assert abs(keep - 0.125) <= KEEP_MARGIN * 0.125, [round(h["keep_frac"], 3) for h in hist]
    assert keep_miss(hist) is None and "missed its target" not in capsys.readouterr().err
    assert hist[0]["keep_frac"] > 0.95  # it did start from keeping everything


def test_a_dms_run_that_misses_its_target_warns(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--method", "dms", "--tiny", "--task", "--seq-len", "64", "--window", "8", "--steps", "4",
                 "--target-keep", "0.125", "--lr-scorer", "1e-3", "--no-progress", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: DMS's keep fraction" in err and "missed its target" in err and "--lr-scorer, now 0.001" in err


def test_learning_rates_default_per_method():
    from kvpop.training.train import LEARNING_RATES, learning_rates

    assert learning_rates(TrainConfig(), "dms") == (1e-5, 5e-2) == tuple(LEARNING_RATES["dms"].values())
    assert learning_rates(TrainConfig(), "kvpop") == (1e-5, 1e-3)
    assert learning_rates(TrainConfig(lr_scorer=0.2), "dms") == (1e-5, 0.2)
    with pytest.raises(ValueError, match="unknown method 'h2o'"):
        learning_rates(TrainConfig(), "h2o")
    with pytest.raises(ValueError, match="lr_scorer must be a finite number > 0"):
        TrainConfig(lr_scorer=0.0)


def test_dms_training_noise_is_the_runs_own_stream():
    """The relaxation noise comes from the run's generator (seeded by TrainConfig.seed), not the global
    stream: data that draws from the global stream as it is read (a shuffling loader, say) changes nothing;
    another seed changes the gates."""
    import copy

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, attention_dropout=0.0)
    base = Qwen3ForCausalLM(cfg).eval()
    batches = [torch.randint(0, 64, (1, 40)) for _ in range(3)]

    class Loader:
        def __init__(self, draws):
            self.draws = draws

        def __iter__(self):
            for b in batches:
                torch.rand(self.draws)  # someone else's use of the global stream
                yield b

    def run(seed, draws):
        m = copy.deepcopy(base)
        D.patch_dms(m, sinks=2, window=4, target_keep=0.3, schedule_steps=2)
        train(m, Loader(draws), TrainConfig(steps=3, lr_scorer=0.1, train_model=False, progress=False, seed=seed))
        assert all(la.generator is None for la in D.dms_layers(m))  # nothing left on the model
        return torch.cat([la.gate.weight.detach().reshape(-1) for la in D.dms_layers(m)])

    a = run(5, 1)
    assert torch.equal(a, run(5, 7))
    assert not torch.equal(a, run(6, 1))
