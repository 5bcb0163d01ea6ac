"""studies.auto_task_test: a joint run scored on the kvtrace ledger's fresh test seeds, and its refusal."""
import json

import pytest

from kvpop.cli import main as kvpop_main
from studies import auto_task_test as T


def test_scores_a_joint_run_on_the_fresh_test_seeds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    run = tmp_path / "run"
    assert kvpop_main(["train", "--task", "--seq-len", "128", "--budget", "40", "--sinks", "4", "--window", "32",
                       "--lr-model", "1e-4", "--steps", "1", "--no-progress", "--out", str(run)]) == 0
    assert T.main(["--run", str(run), "--out", str(tmp_path / "test"), "--n-test", "1"]) == 0
    res = json.loads((tmp_path / "test" / "test_results.json").read_text())
    rows = {(r["policy"], r["length"]): r for r in res["rows"]}
    assert set(rows) == {("dense", 2048), ("dense", 4096), ("kvpop-mlp-joint", 2048), ("kvpop-mlp-joint", 4096)}
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows.values())
    assert "kvpop-mlp-joint L=2048 B=128: accuracy" in capsys.readouterr().out


def test_scores_a_lookahead_run_on_its_test_seeds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    run = tmp_path / "run"
    assert kvpop_main(["train", "--task", "lookahead", "--seq-len", "512", "--budget", "40", "--sinks", "4",
                       "--window", "32", "--lr-model", "1e-4", "--steps", "1", "--no-progress", "--out", str(run)]) == 0
    assert T.main(["--task", "lookahead", "--run", str(run), "--out", str(tmp_path / "test"), "--n-test", "1"]) == 0
    res = json.loads((tmp_path / "test" / "test_results.json").read_text())
    kv = {(r["length"], r["budget"]) for r in res["rows"] if r["policy"] == "kvpop-mlp-joint"}
    assert kv == {(512, 64), (1024, 64)}  # the lookahead ledger's lengths and headline budget
    assert "kvpop-mlp-joint L=512 B=64: accuracy" in capsys.readouterr().out


def test_refuses_a_directory_without_a_joint_run(tmp_path):
    with pytest.raises(SystemExit, match="needs a joint run's scorers.safetensors and model/"):
        T.main(["--run", str(tmp_path), "--out", str(tmp_path / "o")])
