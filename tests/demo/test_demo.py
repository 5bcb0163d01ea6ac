"""``kvpop demo --quick`` end to end (shipped model, PyTorch CPU path)."""
import json
import time

import pytest

from kvpop.cli import main
from kvpop.demo.evaluate import POLICIES


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_demo_quick_end_to_end_and_resume(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--threads", "1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert isinstance(res["task"], str) and res["train_len"] == 128
    assert 0.0 <= res["dense_accuracy"] <= 1.0
    assert {r["policy"] for r in res["rows"]} == set(POLICIES)
    assert {r["length"] for r in res["rows"]} == {128, 256}
    assert {r["budget"] for r in res["rows"] if r["policy"] != "dense"} == {8, 16, 32}
    for r in res["rows"]:
        assert isinstance(r["budget"], int) and isinstance(r["accuracy"], float)
    assert (out / "accuracy_vs_budget.png").read_bytes()[:4] == b"\x89PNG"
    for p in ("kvpop-mlp", "kvpop-mlstm"):
        assert (out / p / "scorers.safetensors").exists() and (out / p / "done.json").exists()
    assert (out / "fixed-finetune" / "model" / "model.safetensors").exists()
    assert (out / "dms" / "gates.safetensors").exists() and (out / "dms" / "model" / "model.safetensors").exists()
    assert "| kvpop-mlp |" in printed
    # resume: every part is reused, nothing is trained or measured again
    t0 = time.time()
    assert main(["demo", "--quick", "--out", str(out), "--threads", "1", "--no-progress", "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert [(r["policy"], r["budget"], r["length"], r["accuracy"]) for r in again["rows"]] == \
        [(r["policy"], r["budget"], r["length"], r["accuracy"]) for r in res["rows"]]
    assert time.time() - t0 < 20


def test_demo_bad_inputs(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path / "x"), "--budgets", "5", "--no-progress"]) == 2
    assert "too small" in capsys.readouterr().err
    assert main(["demo", "--quick", "--out", str(tmp_path / "x"), "--steps", "1,2", "--no-progress"]) == 2
    assert "--steps" in capsys.readouterr().err
