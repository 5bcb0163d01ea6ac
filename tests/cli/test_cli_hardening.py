"""The ``kvpop`` command on bad and edge input: usage errors before any work, resume that
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
    from kvpop.training.distributed import setup_process

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(torch.cuda._utils._get_device_index(d)))
    monkeypatch.setenv("WORLD_SIZE", "1")
    rank, world, device, started = setup_process("cuda")
    assert device == torch.device("cuda", 0) and seen == [0] and not started
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        setup_process("cuda")
    with pytest.raises(ValueError, match="--device 'gpu0'"):
        setup_process("gpu0")


@pytest.mark.gpu
def test_train_device_cuda_runs(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    assert main(["train", "--tiny", "--data", str(data), "--device", "cuda", "--steps", "1",
                 "--out", str(tmp_path / "run"), *FAST]) == 0


# ----------------------------------------------------------------------------- point 10: eval, demo, schedule
@pytest.fixture
def no_work(monkeypatch):
    """Any model load or evaluation fails the test: a usage error must come before them."""
    from kvpop.demo import retrofit as R
    from kvpop.evaluation import evaluate as E

    def work(*a, **k):
        raise AssertionError("work started before the usage error")

    for name in ("load_base_model", "evaluate"):
        monkeypatch.setattr(E, name, work)
    monkeypatch.setattr(R, "retrofit", work)


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
    from kvpop.demo import retrofit as R
    from kvpop.training.train import TrainingInterrupted

    def retrofit(*a, **k):  # what train raises once the step in flight is checkpointed
        raise TrainingInterrupted(signal.SIGTERM, 2, tmp_path / "last.pt")

    monkeypatch.setattr(R, "retrofit", retrofit)
    assert main(["demo", "--quick", "--no-progress", "--out", str(tmp_path / "d")]) == 128 + signal.SIGTERM
    assert "--resume to continue" in capsys.readouterr().err


# ============================================================================ round two (docs/HARDENING.md)
TRAIN = ["--tiny", "--steps", "1", *FAST]


# ----------------------------------------------------------------------------- item 7: one run per --out
def test_a_second_run_in_the_same_out_is_refused_while_the_first_holds_it(tmp_path):
    from kvpop.training.runstate import RunLock

    data = _write_ids(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--out", str(out), *TRAIN]
    with RunLock(out, "kvpop train"):  # what a first, running `kvpop train --out run` holds
        msg = _usage_error(*argv)
        assert f"--out {out} is in use by another kvpop train run (pid {os.getpid()})" in msg
        assert not (out / "last.pt").exists() and not (out / "history.jsonl").exists()
        with pytest.raises(SystemExit, match="in use by another kvpop train run"):
            main([*argv, "--resume"])
    # released (a run that ended, or crashed: the OS drops the lock): the next run proceeds
    assert main(argv) == 0 and load_checkpoint(out / "last.pt")["step"] == 1


def test_a_run_lock_is_held_by_a_live_process_and_dropped_when_it_dies(tmp_path):
    import subprocess
    import sys

    from kvpop.training.runstate import RunDirectoryError, RunLock

    code = ("import sys, time; from kvpop.training.runstate import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryError, match=f"pid {proc.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        proc.kill()
        proc.wait()
    RunLock(tmp_path).acquire().release()  # the killed holder left no stale lock


# ----------------------------------------------------------------------------- item 8: something in the way
def test_a_file_where_the_model_or_a_checkpoint_goes_is_refused_before_training(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    out.mkdir()
    (out / "model").write_text("in the way")
    argv = ["train", "--data", str(data), "--out", str(out), *TRAIN]
    msg = _usage_error(*argv)
    assert f"{out / 'model'} exists and is not a directory, where the fine-tuned model goes" in msg
    assert not (out / "last.pt").exists()
    assert main([*argv, "--no-train-model"]) == 0  # it does not need the model folder
    (out / "model").unlink()
    (out / "scorers.safetensors").unlink()
    (out / "scorers.safetensors").mkdir()
    assert "is a directory, where the run writes a file" in _usage_error(*argv)
    # the library refuses as well (save_pretrained alone would only log it and write nothing)
    from kvpop.training.train import save_model

    (tmp_path / "file").write_text("x")
    from tiny import tiny_model

    with pytest.raises(ValueError, match="exists and is not a directory"):
        save_model(tiny_model(), tmp_path / "file")


# ----------------------------------------------------------------------------- item 11: model directories
def _model_dirs(tmp_path):
    from tiny import tiny_model
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=640, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(tmp_path / "gpt2")
    tiny_model(family="llama", vocab_size=640).save_pretrained(tmp_path / "llama")
    tiny_model(vocab_size=640).save_pretrained(tmp_path / "qwen3")
    cfg = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "big").mkdir()  # a config that disagrees with its weights: it would allocate 4096-wide layers
    (tmp_path / "big" / "config.json").write_text(json.dumps({**cfg, "hidden_size": 4096}))
    (tmp_path / "big" / "model.safetensors").write_bytes((tmp_path / "qwen3" / "model.safetensors").read_bytes())
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_bytes(b'{"model_type": "qwen3", \xff')
    return tmp_path


MODEL_DIR_ERRORS = {
    "gpt2": "config.json has model_type 'gpt2'; kvpop supports the families 'qwen3', 'qwen2', 'llama'",
    "noweights": "has a config.json but no weights",
    "big": "the weights do not fit config.json: model.embed_tokens.weight is [640, 64], the config says "
           "[vocab_size, hidden_size] = [640, 4096]",
    "broken": "config.json is not UTF-8 text",
}


def test_model_directories_are_refused_from_their_files_before_any_weight_is_allocated(tmp_path, monkeypatch, capsys):
    import transformers

    dirs = _model_dirs(tmp_path)

    def allocate(*a, **k):
        raise AssertionError("a model was allocated before the directory was refused")

    for cls in (transformers.AutoModelForCausalLM, transformers.Qwen3ForCausalLM, transformers.PreTrainedModel):
        monkeypatch.setattr(cls, "from_pretrained", allocate)
    data = _write_ids(tmp_path / "d.jsonl")
    capsys.readouterr()
    for name, msg in MODEL_DIR_ERRORS.items():
        err = _usage_error("train", "--model", str(dirs / name), "--data", str(data), "--out",
                           str(tmp_path / "out"), *FAST, "--steps", "1")
        assert err.startswith(f"kvpop train: --model {dirs / name}: ") and msg in err, (name, err)
        assert main(["eval", "--model", str(dirs / name), "--n-sequences", "1", "--no-plot"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvpop eval: error: ") and msg in err, (name, err)
        assert main(["eval", "--model", str(dirs / name), "--data", str(data), "--no-plot"]) == 2
        assert msg in capsys.readouterr().err, name


def test_a_llama_directory_loads_as_llama_with_its_own_weights(tmp_path):
    from safetensors.torch import load_file

    from kvpop.evaluation.evaluate import load_base_model

    dirs = _model_dirs(tmp_path)
    m = load_base_model(dirs / "llama")
    assert type(m).__name__ == "LlamaForCausalLM"
    saved = load_file(str(dirs / "llama" / "model.safetensors"))
    assert all(torch.equal(m.state_dict()[k], v) for k, v in saved.items())


# ----------------------------------------------------------------------------- obscure errors: CLI and JSONL
def test_cli_obscure_errors_name_what_is_wrong(tmp_path, capsys):
    data = _write_ids(tmp_path / "d.jsonl")
    assert main(["eval", "--policies", ",", "--no-plot"]) == 2
    assert "--policies lists no policy (got ',')" in capsys.readouterr().err
    msg = _usage_error("train", "--data", str(data), "--out", "/proc/kvpop-run", *TRAIN)
    assert msg.startswith("kvpop train: --out /proc/kvpop-run: cannot create or write in it")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"input_ids": [1, 2, 3]}\n\n{"text": "caf\xe9"}\n')
    msg = _usage_error("train", "--data", str(bad), "--out", str(tmp_path / "o"), *TRAIN)
    assert f"{bad}:3: not UTF-8 text (byte 13 of the line is 0xe9)" in msg
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    msg = _usage_error("train", "--data", str(deep), "--out", str(tmp_path / "o"), *TRAIN)
    assert f"{deep}:1: not a record (JSON nested too deep to read)" in msg
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(b"")
    (tmp_path / "run" / "args.json").write_text("{broken")
    msg = _usage_error("train", "--data", str(data), "--out", str(tmp_path / "run"), *TRAIN, "--resume")
    assert "--resume: cannot read" in msg and "args.json" in msg


# ----------------------------------------------------------------------------- items 6 and 9: divergence, edited data
def test_train_stops_a_diverging_run_with_the_last_finite_checkpoint(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    msg = _usage_error("train", "--tiny", "--data", str(data), "--out", str(out), *FAST, "--steps", "6",
                       "--checkpoint-every", "1", "--lr-scorer", "1e6", "--lr-model", "1e3", "--max-grad-norm", "0")
    assert msg.startswith("kvpop train: step ") and "is not finite" in msg and "the last finite one" in msg, msg
    ck = load_checkpoint(out / "last.pt")
    assert ck["step"] >= 1 and all(bool(torch.isfinite(v).all()) for v in ck["model"].values())


def test_train_resume_refuses_a_data_file_edited_in_place(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    argv = ["train", "--tiny", "--data", str(data), "--out", str(out), *FAST, "--checkpoint-every", "1"]
    assert main([*argv, "--steps", "1"]) == 0
    os.utime(data)  # touched, content unchanged: the same data
    assert main([*argv, "--steps", "2", "--resume"]) == 0
    _write_ids(data, seed=5)  # the same path, other records
    msg = _usage_error(*argv, "--steps", "3", "--resume")
    assert "was trained on other data: the data file changed since" in msg, msg
