"""The ``kvpop`` command on bad and edge input (issue 10): usage errors before any work, resume that
compares what matters, interrupts that keep what finished.  The table is docs/HARDENING.md."""
import json
import os
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_cli_train import FAST, _write_ids  # noqa: E402  (tests/cli/test_cli_train.py)

from kvpop.cli import main  # noqa: E402
from kvpop.training.runstate import load_checkpoint  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def _usage_error(*argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return str(e.value.code)


# ----------------------------------------------------------------------------- train: points 1, 8, 9, 10
def test_train_resume_compares_resolved_paths_and_ignores_run_only_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_ids(tmp_path / "d.jsonl")
    common = ["train", "--tiny", "--checkpoint-every", "1", *FAST]
    assert main([*common, "--data", "d.jsonl", "--steps", "1", "--out", "run"]) == 0
    # --out and --data spelled three ways, --device and --no-progress added or dropped: the same run
    assert main([*common, "--data", "./d.jsonl", "--steps", "2", "--out", "./run", "--resume", "--device", "cpu"]) == 0
    assert main([*[a for a in common if a != "--no-progress"], "--data", str(tmp_path / "d.jsonl"), "--steps", "3",
                 "--out", str(tmp_path / "run"), "--resume"]) == 0
    assert [h["step"] for h in _lines(tmp_path / "run" / "history.jsonl")] == [1, 2, 3]
    # what changes the run is still refused
    _write_ids(tmp_path / "other.jsonl", seed=1)
    assert "--data" in _usage_error(*common, "--data", "other.jsonl", "--steps", "4", "--out", "run", "--resume")
    assert "--budget" in _usage_error(*[a if a != "24" else "25" for a in common], "--data", "d.jsonl",
                                      "--steps", "4", "--out", "run", "--resume")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    msg = _usage_error(*[a for a in common if a != "--tiny"], "--model", "m", "--data", "d.jsonl", "--steps", "4",
                       "--out", "run", "--resume")
    assert "--model" in msg and "--tiny" in msg


def test_train_refuses_a_last_pt_that_would_run_code(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    argv = ["train", "--tiny", "--data", str(data), "--out", str(out), *FAST]
    assert main([*argv, "--steps", "1"]) == 0
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    torch.save({"model": Payload()}, out / "last.pt")
    msg = _usage_error(*argv, "--steps", "2", "--resume")
    assert msg.startswith("kvpop train: checkpoint") and "was refused" in msg
    assert not marker.exists()


def test_train_sigterm_writes_the_last_step_and_resume_finishes_the_run(tmp_path, monkeypatch, capsys):
    from kvpop.training import data as data_io

    data = _write_ids(tmp_path / "d.jsonl", n=8)
    common = ["train", "--tiny", "--data", str(data), "--grad-accum", "2", "--checkpoint-every", "0", "--steps", "4",
              *FAST]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main([*common, "--out", str(full)]) == 0

    real = data_io.make_batches

    class SigtermAt:  # SIGTERM while step 2 loads its first micro-batch
        def __init__(self, batches):
            self.batches, self.n = batches, 0

        def __iter__(self):
            for b in self.batches:
                self.n += 1
                if self.n == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield b

    monkeypatch.setattr(data_io, "make_batches", lambda *a, **k: SigtermAt(real(*a, **k)))
    assert main([*common, "--out", str(part)]) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after step 2" in capsys.readouterr().err
    assert load_checkpoint(part / "last.pt")["step"] == 2
    assert [h["step"] for h in _lines(part / "history.jsonl")] == [1, 2]
    monkeypatch.setattr(data_io, "make_batches", real)
    assert main([*common, "--out", str(part), "--resume"]) == 0
    assert _lines(part / "history.jsonl") == _lines(full / "history.jsonl")
    a, b = load_checkpoint(full / "last.pt")["model"], load_checkpoint(part / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_device_cuda_gets_an_index(monkeypatch):
    """``--device cuda`` names this process's GPU (torch.cuda.set_device refuses a device without index)."""
    import argparse

    from kvpop.cli import train as cli_train

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(torch.cuda._utils._get_device_index(d)))
    monkeypatch.setenv("WORLD_SIZE", "1")
    rank, world, device, started = cli_train._setup_dist(argparse.Namespace(device="cuda"))
    assert device == torch.device("cuda", 0) and seen == [0] and not started
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cli_train._UserError, match="CUDA is not available"):
        cli_train._setup_dist(argparse.Namespace(device="cuda"))
    with pytest.raises(cli_train._UserError, match="--device 'gpu0'"):
        cli_train._setup_dist(argparse.Namespace(device="gpu0"))


@pytest.mark.gpu
def test_train_device_cuda_runs(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    assert main(["train", "--tiny", "--data", str(data), "--device", "cuda", "--steps", "1",
                 "--out", str(tmp_path / "run"), *FAST]) == 0


# ----------------------------------------------------------------------------- point 10: eval, demo, schedule
@pytest.fixture
def no_work(monkeypatch):
    """Any model load or evaluation fails the test: a usage error must come before them."""
    from kvpop.demo import evaluate as E

    def work(*a, **k):
        raise AssertionError("work started before the usage error")

    for name in ("load_base_model", "evaluate", "retrofit"):
        monkeypatch.setattr(E, name, work)


@pytest.mark.parametrize("command", ["eval", "demo"])
def test_eval_and_demo_check_their_arguments_before_any_work(tmp_path, capsys, no_work, command):
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a directory")
    cases = [
        (["--out", str(a_file)], "exists and is not a directory"),
        (["--out", str(a_file / "sub")], "cannot create it"),
        (["--n-sequences", "0"], "--n-sequences must be >= 1, got 0"),
        (["--n-sequences", "-3"], "--n-sequences must be >= 1, got -3"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--window", "0"], "--window must be >= 1, got 0"),
        (["--sinks", "-1"], "--sinks must be >= 0, got -1"),
        (["--train-len", "0"], "--train-len must be >= 1, got 0"),
        (["--budgets", "0,128"], "--budgets must be positive, got [0]"),
        (["--lengths", ","], "--lengths lists no number"),
    ]
    if command == "demo":
        cases += [(["--steps", "0"], "--steps must be >= 1"), (["--lr-scorer", "0"], "--lr-scorer must be a finite"),
                  (["--tau", "nan"], "--tau must be a finite number > 0, got nan"),
                  (["--train-length", "0"], "--train-length must be >= 1, got 0"),
                  (["--dms-steps", "-1"], "--dms-steps must be >= 0"),
                  (["--dms-target-keep", "0"], "--dms-target-keep must be in (0, 1]"),
                  (["--dms-lr", "0"], "--dms-lr must be a finite number > 0")]
    for extra, msg in cases:
        argv = [command, *extra]
        if "--out" not in extra:
            argv += ["--out", str(tmp_path / "out")]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"kvpop {command}: error: ") and msg in err, (extra, err)


def test_schedule_usage_errors(capsys):
    for argv, msg in [(["--priorities", ","], "--priorities lists no number"),
                      (["--priorities", " , ,"], "--priorities lists no number"),
                      (["--window", "0"], "--window >= 1"), (["--sinks", "-2"], "--sinks must be >= 0")]:
        with pytest.raises(SystemExit, match=msg):
            main(["schedule", *argv])
    assert main(["schedule", "--priorities", "1,nan,3,0.5", "--sinks", "1", "--window", "1", "--budget", "3"]) == 0
    assert "head 0: S.#W" in capsys.readouterr().out  # NaN ranks as -inf: token 1 is the one evicted


def test_demo_interrupted_says_how_to_resume(tmp_path, monkeypatch, capsys):
    from kvpop.demo import evaluate as E
    from kvpop.training.train import TrainingInterrupted

    def retrofit(*a, **k):  # what train raises once the step in flight is checkpointed
        raise TrainingInterrupted(signal.SIGTERM, 2, tmp_path / "last.pt")

    monkeypatch.setattr(E, "retrofit", retrofit)
    assert main(["demo", "--quick", "--no-progress", "--out", str(tmp_path / "d")]) == 128 + signal.SIGTERM
    assert "--resume to continue" in capsys.readouterr().err
