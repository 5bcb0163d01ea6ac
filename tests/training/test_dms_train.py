"""DMS through the training loop and ``kvpop train --method dms``: the compression loss pulls the keep
rate down its schedule, the model distils from the dense original, checkpoints hold the gates."""
import json

import pytest
import torch
from tiny import tiny_model

from kvpop.cli import main
from kvpop.core import dms as D
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
