"""Run directories and interrupted runs: a checkpoint cannot run code, SIGINT/SIGTERM lose
nothing a run finished, bad arguments are refused up front.  The table is docs/HARDENING.md."""
import json
import os
import signal

import pytest
import torch

pytest.importorskip("transformers")
from tiny import SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
from kvpop.training.runstate import CheckpointError, load_checkpoint  # noqa: E402
from kvpop.training.train import TrainConfig, TrainingInterrupted, train  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


class Payload:
    """Unpickling this runs ``exec``: what a hostile ``last.pt`` could carry."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def write_hostile_checkpoint(path, marker):
    torch.save({"model": Payload(marker), "step": 1, "consumed": 1}, path)


class SignalAt:
    """A re-iterable of batches that sends ``signum`` to this process when it yields its ``at``-th batch
    (counting over all passes); a stand-in for Ctrl-C or a scheduler's SIGTERM in the middle of a step."""

    def __init__(self, batches, at, signum):
        self.batches, self.at, self.signum, self.n = batches, at, signum, 0

    def __iter__(self):
        for b in self.batches:
            self.n += 1
            if self.n == self.at:
                os.kill(os.getpid(), self.signum)
            yield b


def _data(n=3, B=2, S=48):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (B, S), generator=g) for _ in range(n)]


def _fresh():
    m = tiny_model()
    t = kvpop.make_teacher(m)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    torch.manual_seed(11)  # identical scorer init in every run
    return kvpop.patch(m, **SMALL), t


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- point 1: weights_only
def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    marker = tmp_path / "payload-ran"
    write_hostile_checkpoint(tmp_path / "last.pt", marker)
    m, t = _fresh()
    with pytest.raises(CheckpointError, match=r"last.pt was refused.*could run code"):
        train(m, _data(), TrainConfig(steps=2, progress=False, checkpoint_dir=str(tmp_path)), teacher=t, resume=True)
    assert not marker.exists()
    # what train writes loads with weights_only=True and resumes
    out = tmp_path / "good"
    train(m, _data(), TrainConfig(steps=1, progress=False, checkpoint_dir=str(out)), teacher=t)
    ck = load_checkpoint(out / "last.pt")
    assert ck["step"] == 1 and isinstance(ck["rng"]["numpy"]["keys"], torch.Tensor)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")


def test_pretrain_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    from kvpop.cli.pretrain import main as pretrain

    marker = tmp_path / "payload-ran"
    write_hostile_checkpoint(tmp_path / "ckpt.pt", marker)
    with pytest.raises(SystemExit, match=r"kvpop pretrain: checkpoint .*ckpt.pt was refused"):
        pretrain(["--out", str(tmp_path), "--resume", "--steps", "1", *PRETRAIN_TINY])
    assert not marker.exists()


# ----------------------------------------------------------------------------- point 8: interrupts
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(tmp_path, signum):
    cfg = TrainConfig(steps=5, grad_accum=2, lr_model=1e-3, lr_scorer=1e-2, warmup_steps=2, progress=False)
    before = signal.getsignal(signal.SIGINT)  # the default handler, or SIG_IGN in a background job
    m_full, t_full = _fresh()
    train(m_full, _data(), cfg, teacher=t_full, checkpoint_dir=str(tmp_path / "full"))

    part = tmp_path / "part"
    m_a, t_a = _fresh()
    # the signal arrives while step 3 loads its second micro-batch; no periodic checkpoint
    with pytest.raises(TrainingInterrupted) as e:
        train(m_a, SignalAt(_data(), 6, signum), cfg, teacher=t_a, checkpoint_dir=str(part))
    assert e.value.step == 3 and e.value.signum == signum and isinstance(e.value, KeyboardInterrupt)
    assert load_checkpoint(part / "last.pt")["step"] == 3
    assert [h["step"] for h in _lines(part / "history.jsonl")] == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored

    # a line of a step the checkpoint did not finish (a crash between checkpoints) is dropped on resume
    with open(part / "history.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "kl": -1.0}) + "\n")
    m_b, t_b = _fresh()
    rest = train(m_b, _data(), cfg, teacher=t_b, checkpoint_dir=str(part), resume=True)
    assert [h["step"] for h in rest] == [4, 5]
    assert _lines(part / "history.jsonl") == _lines(tmp_path / "full" / "history.jsonl")
    assert load_checkpoint(part / "last.pt")["history"] == _lines(tmp_path / "full" / "history.jsonl")
    for (n, p), q in zip(m_full.named_parameters(), m_b.parameters()):
        assert torch.equal(p, q), n


def test_a_second_signal_aborts_at_once(tmp_path):
    class Twice(SignalAt):
        def __iter__(self):
            for b in super().__iter__():
                if self.n == self.at:
                    os.kill(os.getpid(), self.signum)
                yield b

    before = signal.getsignal(signal.SIGINT)
    m, t = _fresh()
    with pytest.raises(KeyboardInterrupt) as e:
        train(m, Twice(_data(), 2, signal.SIGINT), TrainConfig(steps=5, progress=False),
              teacher=t, checkpoint_dir=str(tmp_path))
    assert not isinstance(e.value, TrainingInterrupted) and "second SIGINT" in str(e.value)
    assert not (tmp_path / "last.pt").exists()
    assert signal.getsignal(signal.SIGINT) is before


PRETRAIN_TINY = ["--curriculum", "64:2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                 "--intermediate", "32", "--eval-every", "1000", "--eval-n", "2", "--ckpt-every", "1000",
                 "--no-progress", "--min-stage-steps", "1000"]


def test_pretrain_interrupted_and_resumed_equals_the_uninterrupted_one(tmp_path, monkeypatch, capsys):
    from kvpop.cli.pretrain import main as pretrain_main
    from kvpop.demo import pretrain as P

    def log(out):
        return [{k: v for k, v in r.items() if k != "t"} for r in _lines(out / "log.jsonl")]

    full, part = tmp_path / "full", tmp_path / "part"
    assert pretrain_main(["--out", str(full), "--steps", "4", *PRETRAIN_TINY]) == 0
    real, calls = P.T.make_batch, []

    def make_batch(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # in step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(P.T, "make_batch", make_batch)
    assert pretrain_main(["--out", str(part), "--steps", "4", *PRETRAIN_TINY]) == 128 + signal.SIGTERM
    monkeypatch.setattr(P.T, "make_batch", real)
    assert [r["step"] for r in log(part)] == [1, 2]
    with open(part / "log.jsonl", "a") as f:  # a step the checkpoint did not finish
        f.write(json.dumps({"step": 3, "loss": -1.0}) + "\n")
    assert pretrain_main(["--out", str(part), "--steps", "4", "--resume", *PRETRAIN_TINY]) == 0
    assert log(part) == log(full)
    a, b = load_checkpoint(full / "ckpt.pt")["model"], load_checkpoint(part / "ckpt.pt")["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ----------------------------------------------------------------------------- point 10: the library's arguments
def test_train_refuses_a_one_shot_iterator_up_front():
    m, t = _fresh()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(TypeError, match=r"re-iterable.*generator.*list\(\.\.\.\)"):
        train(m, (b for b in _data()), TrainConfig(steps=1, progress=False), teacher=t)
    with pytest.raises(TypeError, match=r"re-iterable.*list_iterator"):
        train(m, iter(_data()), TrainConfig(steps=1, progress=False), teacher=t)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("field,value", [("lr_model", float("nan")), ("lr_model", 0.0), ("lr_scorer", float("inf")),
                                         ("lr_scorer", -1e-3), ("weight_decay", float("nan")),
                                         ("score_weight", -1.0), ("max_grad_norm", float("nan")),
                                         ("max_grad_norm", 0.0), ("betas", (0.9, 1.0)), ("lr_model", "1e-5")])
def test_train_config_rejects_non_finite_and_out_of_range_numbers(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


# ============================================================================ round two (docs/HARDENING.md)
# ----------------------------------------------------------------------------- item 9: atomic checkpoints
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from kvpop.training import runstate

    cfg = TrainConfig(steps=3, lr_model=1e-3, lr_scorer=1e-2, progress=False, checkpoint_every=1,
                      checkpoint_dir=str(tmp_path))
    (tmp_path / "last.pt.tmp").mkdir()  # a stale or foreign temporary name in the way blocks nothing
    m, t = _fresh()
    real_save, calls = torch.save, []

    def save(obj, f, *a, **k):  # the disk fills up while the third checkpoint is half written
        calls.append(1)
        if len(calls) == 3 and isinstance(obj, dict) and "step" in obj:
            f.write(b"half a checkpoint")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(runstate.torch, "save", save)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*last.pt: OSError: .*No space left on "
                                              r"device.*the previous checkpoint there is kept"):
        train(m, _data(), cfg, teacher=t)
    monkeypatch.setattr(runstate.torch, "save", real_save)
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 2  # the finished steps up to the last good write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.jsonl", "last.pt", "last.pt.tmp",
                                                          "scorers.safetensors"]  # no temporary file left
    m2, t2 = _fresh()
    assert [h["step"] for h in train(m2, _data(), cfg, teacher=t2, resume=True)] == [3]


def test_an_interrupt_while_writing_leaves_the_previous_checkpoint(tmp_path):
    from kvpop.training.runstate import atomic_save

    atomic_save({"step": 1}, tmp_path / "last.pt")

    class Boom:
        def __reduce__(self):
            raise KeyboardInterrupt  # Ctrl-C in the middle of torch.save

    with pytest.raises(KeyboardInterrupt):
        atomic_save({"step": 2, "x": Boom()}, tmp_path / "last.pt")
    assert load_checkpoint(tmp_path / "last.pt") == {"step": 1} and len(list(tmp_path.iterdir())) == 1


# ----------------------------------------------------------------------------- the refusal of a code-carrying last.pt
@pytest.mark.parametrize("payload", ["exec", "os.system", "module"])
def test_a_code_carrying_checkpoint_is_refused_for_that_reason(tmp_path, payload):
    class System:
        def __reduce__(self):
            return os.system, ("true",)

    obj = {"exec": Payload(tmp_path / "ran"), "os.system": System(), "module": torch.nn.Linear(2, 2)}[payload]
    torch.save({"model": obj, "step": 1}, tmp_path / "last.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "last.pt")
    msg = str(e.value)
    assert "was refused because loading it could run code" in msg, msg
    assert "weights_only" not in msg and "Re-running" not in msg and "trusted source" not in msg, msg


def test_unreadable_checkpoints_name_the_file_and_the_reason(tmp_path):
    torch.save({"step": torch.zeros(1000)}, tmp_path / "good.pt")
    raw = (tmp_path / "good.pt").read_bytes()
    cases = {"empty.pt": b"", "truncated.pt": raw[: len(raw) // 2], "zip.pt": b"PK\x03\x04 not a zip"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=f"cannot read checkpoint .*{name}") as e:
            load_checkpoint(tmp_path / name)
        assert "miniz" not in str(e.value) and "weights_only" not in str(e.value)
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- item 6: the finite-loss guard
def test_a_diverging_run_stops_and_keeps_the_last_finite_checkpoint(tmp_path):
    from kvpop.training.train import TrainingDiverged

    cfg = TrainConfig(steps=8, lr_model=1e3, lr_scorer=1e6, max_grad_norm=None, progress=False, checkpoint_every=1,
                      checkpoint_dir=str(tmp_path))
    m, t = _fresh()
    with pytest.raises(TrainingDiverged, match=r"step 2: the loss \(score = nan\) is not finite .*last.pt keeps step "
                                               r"1, the last finite one") as e:
        train(m, _data(), cfg, teacher=t)
    assert e.value.step == 2
    ck = load_checkpoint(tmp_path / "last.pt")
    assert ck["step"] == 1 and all(bool(torch.isfinite(v).all()) for v in ck["model"].values())
    assert [h["step"] for h in _lines(tmp_path / "history.jsonl")] == [1]  # no line of the diverged step
    # weights that turned non-finite (the loss of the step that made them was finite) are never checkpointed
    m2, t2 = _fresh()
    with torch.no_grad():
        next(p for n, p in m2.named_parameters() if "mlp" in n and "kvpop" not in n).fill_(float("inf"))
    with pytest.raises(TrainingDiverged, match="is not finite"):
        train(m2, _data(), TrainConfig(steps=2, progress=False, checkpoint_dir=str(tmp_path / "b")), teacher=t2)
    assert not (tmp_path / "b" / "last.pt").exists()


# ----------------------------------------------------------------------------- item 12 and damaged checkpoints
def _good_checkpoint(tmp_path):
    cfg = TrainConfig(steps=1, progress=False, checkpoint_dir=str(tmp_path))
    m, t = _fresh()
    train(m, _data(), cfg, teacher=t)
    return load_checkpoint(tmp_path / "last.pt")


@pytest.mark.parametrize("damage,msg", [
    (lambda ck: ck.update(consumed=10**12), r"claims 1000000000000 micro-batches consumed in 1 steps"),
    (lambda ck: ck.update(consumed=-1), r"'consumed' is int -1, expected an int >= 0"),
    (lambda ck: ck.update(step="5"), r"'step' is str 5, expected an int >= 0"),
    (lambda ck: ck.pop("step"), r"has no 'step' entry"),
    (lambda ck: ck.pop("rng"), r"its 'rng' entry cannot be restored"),
    (lambda ck: ck["rng"].pop("numpy"), r"its 'rng' entry cannot be restored \(KeyError"),
    (lambda ck: ck["model"].update({k: torch.zeros(3) for k in list(ck["model"])[:1]}),
     r"tensor .* has shape \(3,\), the model needs"),
    (lambda ck: ck["model"].pop(next(iter(ck["model"]))), r"does not fit the model: missing"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_entry(tmp_path, damage, msg):
    ck = _good_checkpoint(tmp_path)
    damage(ck)
    torch.save(ck, tmp_path / "last.pt")
    m, t = _fresh()
    with pytest.raises(CheckpointError, match=msg):
        train(m, _data(), TrainConfig(steps=3, progress=False, checkpoint_dir=str(tmp_path)), teacher=t, resume=True)
    if "rng" in msg:  # a refused rng entry leaves the RNG as it was
        from kvpop.training.runstate import restore_rng_state

        rng = torch.get_rng_state()
        with pytest.raises(CheckpointError):
            restore_rng_state(ck.get("rng"), tmp_path / "last.pt")
        assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("with_data", [False, True])
def test_a_second_pretrain_in_the_same_out_is_refused_while_the_first_holds_it(tmp_path, capsys, with_data):
    """``kvpop pretrain`` (task or ``--data``) holds ``--out``'s run lock: a second run there is refused with
    the holder's pid before it writes anything; once the lock is released the run proceeds."""
    import json

    from kvpop.cli.pretrain import main as pretrain_main
    from kvpop.training.runstate import RunLock

    out = tmp_path / "run"
    argv = ["--out", str(out), "--steps", "1", *PRETRAIN_TINY]
    if with_data:
        data = tmp_path / "ids.jsonl"
        for k, f in enumerate((data, tmp_path / "validation.jsonl")):  # the validation file found beside the data
            f.write_text("".join(json.dumps({"input_ids": [(i * 7 + j + 3 * k) % 50 for j in range(80)]}) + "\n"
                                 for i in range(8)))  # other records: validation must not be the training data
        argv = ["--data", str(data), "--vocab-size", "64", "--seq-len", "64", "--batch-size", "2", "--out", str(out),
                "--steps", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                "--intermediate", "32", "--eval-every", "1000", "--eval-n", "2", "--no-progress"]
    with RunLock(out, "kvpop pretrain"):
        assert pretrain_main(argv) == 2
        assert f"in use by another kvpop pretrain run (pid {os.getpid()})" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == [".kvpop.lock"]
    assert pretrain_main(argv) == 0
