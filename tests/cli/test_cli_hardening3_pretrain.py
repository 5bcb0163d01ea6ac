"""``kvpop pretrain`` on bad and edge input, round three: a diverging run stops at its last finite
checkpoint, a resume refuses changed settings, validation must differ from training data, and every option,
data file and manifest is checked before any work.  The table is docs/HARDENING.md ("### kvpop pretrain")."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_cli_hardening import _lines  # noqa: E402  (tests/cli/test_cli_hardening.py)
from test_cli_train import _write_ids  # noqa: E402  (tests/cli/test_cli_train.py)

from kvpop.cli import main  # noqa: E402
from kvpop.training.runstate import load_checkpoint  # noqa: E402

TASK = ["--curriculum", "64:2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--intermediate", "32", "--eval-every", "1000", "--eval-n", "2", "--min-stage-steps", "1000", "--no-progress",
        "--warmup", "1"]
"""A tiny model on the synthetic task: a step takes a fraction of a second."""
DATA = ["--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--intermediate", "32",
        "--seq-len", "32", "--batch-size", "2", "--eval-n", "2", "--eval-every", "1000", "--no-progress",
        "--warmup", "1"]
"""The same with --data (give the data file and --out)."""


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.set_num_threads(1)


def _data(d: Path, vocab: int = 50) -> Path:
    """``d/train.jsonl`` (6 records of 40 ids) with ``d/validation.jsonl`` beside it (2 other records)."""
    d.mkdir(parents=True, exist_ok=True)
    _write_ids(d / "validation.jsonl", n=2, length=40, vocab=vocab, seed=1)
    return _write_ids(d / "train.jsonl", n=6, length=40, vocab=vocab)


def _pretrain(capsys, *argv) -> tuple[int, str]:
    """``(exit status, stderr)`` of ``kvpop pretrain ARGV`` (a ``SystemExit`` counts as its status)."""
    capsys.readouterr()
    try:
        rc = main(["pretrain", *map(str, argv)])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    return rc, capsys.readouterr().err.strip()


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("resumed at step")]
    assert len(lines) == 1 and lines[0].startswith("kvpop pretrain: ") and "Traceback" not in err, err
    return lines[0]


def _finite(ckpt: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load_checkpoint(ckpt)["model"].values() if t.is_floating_point())


# ----------------------------------------------------------------------------- item 1: the finite-loss guard
@pytest.mark.parametrize("with_data", [False, True])
def test_pretrain_stops_a_diverging_run_at_its_last_finite_checkpoint(tmp_path, capsys, with_data):
    out = tmp_path / "run"
    argv = [*(["--data", _data(tmp_path / "d"), *DATA] if with_data else TASK), "--out", out, "--steps", "4",
            "--ckpt-every", "1", "--lr", "1e30"]
    rc, err = _pretrain(capsys, *argv)
    msg = _one_line(err)
    assert rc == 1, err
    assert msg.startswith("kvpop pretrain: step 2: the loss") and "is not finite" in msg, msg
    assert "ckpt.pt keeps step 1, the last finite one" in msg and "--lr" in msg, msg
    ck = load_checkpoint(out / "ckpt.pt")
    assert ck["state"]["step"] == 1 and _finite(out / "ckpt.pt")
    assert [r["step"] for r in _lines(out / "log.jsonl")] == [1]  # the step not taken is not logged
    assert not (out / "model_final").exists()


def test_pretrain_never_overwrites_a_good_checkpoint_with_non_finite_weights(tmp_path, capsys, monkeypatch):
    from kvpop.demo import pretrain as P

    out = tmp_path / "run"
    argv = [*TASK, "--out", out, "--ckpt-every", "1"]
    assert _pretrain(capsys, *argv, "--steps", "2")[0] == 0
    good = load_checkpoint(out / "ckpt.pt")
    # the resumed run's update makes the weights inf and NaN while the loss of that step is still finite
    monkeypatch.setattr(P, "_lr_at", lambda step, args: float("inf"))
    rc, err = _pretrain(capsys, *argv, "--steps", "4", "--resume")
    msg = _one_line(err)
    assert rc == 1 and msg.startswith("kvpop pretrain: step 3: the weights") and "keeps step 2" in msg, err
    kept = load_checkpoint(out / "ckpt.pt")
    assert kept["state"]["step"] == 2
    assert all(torch.equal(good["model"][k], kept["model"][k]) for k in good["model"])
    assert json.loads((out / "model_final" / "training_state.json").read_text())["step"] == 2  # the first run's


# ----------------------------------------------------------------------------- item 3: resume with other settings
def test_pretrain_resume_refuses_changed_settings_naming_each(tmp_path, capsys):
    out = tmp_path / "run"
    assert _pretrain(capsys, *TASK, "--out", out, "--steps", "1")[0] == 0
    saved = (out / "args.json").read_text()
    rc, err = _pretrain(capsys, *[a if a != "32" else "64" for a in TASK], "--out", out, "--steps", "2", "--resume",
                        "--seed", "3")
    msg = _one_line(err)
    assert rc == 2 and "--resume" in msg and "--seed (was 0, now 3)" in msg and "--hidden (was 32, now 64)" in msg
    assert "--intermediate (was 32, now 64)" in msg and "--steps (was" not in msg, msg
    assert (out / "args.json").read_text() == saved and load_checkpoint(out / "ckpt.pt")["state"]["step"] == 1
    # what only affects the run may change: --steps, --threads, --no-progress, --ckpt-every, --max-minutes
    again = [a for a in TASK if a != "--no-progress"]
    assert _pretrain(capsys, *again, "--out", out, "--steps", "2", "--resume", "--threads", "1",
                     "--ckpt-every", "7", "--max-minutes", "30")[0] == 0


def test_pretrain_data_resume_refuses_changed_settings_and_another_model_size(tmp_path, capsys):
    data = _data(tmp_path / "d")
    out = tmp_path / "run"
    assert _pretrain(capsys, "--data", data, *DATA, "--out", out, "--steps", "1")[0] == 0
    saved = (out / "args.json").read_text()
    changed = [a if a not in ("32", "2") else {"32": "20", "2": "3"}[a] for a in DATA]
    rc, err = _pretrain(capsys, "--data", data, *changed, "--out", out, "--steps", "2", "--resume", "--seed", "1")
    msg = _one_line(err)
    assert rc == 2 and all(f"--{k} (was" in msg for k in ("seq-len", "batch-size", "seed", "hidden")), msg
    rc, err = _pretrain(capsys, "--data", data, *DATA, "--out", out, "--steps", "2", "--resume", "--hidden", "48")
    msg = _one_line(err)
    assert rc == 2 and "--hidden (was 32, now 48)" in msg, msg
    assert (out / "args.json").read_text() == saved
    # the same settings (and --vocab-size given as the value it had: the largest id + 1) resume
    vocab = max(max(json.loads(x)["input_ids"]) for x in data.read_text().splitlines()) + 1
    assert _pretrain(capsys, "--data", data, *DATA, "--out", out, "--steps", "2", "--resume",
                     "--vocab-size", vocab)[0] == 0


# ----------------------------------------------------------------------------- item 6: validation = training data
def test_pretrain_refuses_validation_data_with_the_training_data_content(tmp_path, capsys):
    data = _data(tmp_path / "d")
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(data, copy)
    spaced = tmp_path / "spaced.jsonl"  # the same records written otherwise
    spaced.write_text("".join(json.dumps({"input_ids": r}, indent=None, separators=(", ", " : ")) + "\n\n"
                              for r in (json.loads(x)["input_ids"] for x in data.read_text().splitlines())))
    for valid in (data, copy, spaced):
        rc, err = _pretrain(capsys, "--data", data, *DATA, "--out", tmp_path / "run", "--steps", "1",
                            "--valid-data", valid)
        msg = _one_line(err)
        assert rc == 2 and "--valid-data" in msg and "training" in msg, msg
        assert not (tmp_path / "run" / "ckpt.pt").exists()
    shutil.copyfile(data, data.parent / "validation.jsonl")  # the default validation file, a copy of the data
    rc, err = _pretrain(capsys, "--data", data, *DATA, "--out", tmp_path / "run", "--steps", "1")
    assert rc == 2 and "validation.jsonl" in _one_line(err)


# ----------------------------------------------------------------------------- items 7, 9, 10: before any work
@pytest.mark.parametrize("extra,needle", [
    (["--vocab-size", "0"], "--vocab-size must be"),
    (["--vocab-size", "-5"], "--vocab-size must be"),
    (["--max-positions", "8"], "--max-positions must be >= --seq-len"),
    (["--max-positions", "0"], "--max-positions must be >= --seq-len"),
    (["--kv-heads", "3"], "--kv-heads"),
    (["--heads", "0"], "--heads must be"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "0"], "--lr must be a finite number"),
    (["--clip", "inf"], "--clip must be a finite number"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--threads", "0"], "--threads must be"),
    (["--warmup", "-1"], "--warmup must be"),
])
def test_pretrain_data_usage_errors_name_the_option_before_any_work(tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    rc, err = _pretrain(capsys, "--data", _data(tmp_path / "d"), *DATA, "--out", out, "--steps", "1", *extra)
    assert rc == 2 and needle in _one_line(err), err
    assert not out.exists()  # refused before the run directory is made


@pytest.mark.parametrize("extra,needle", [
    (["--curriculum", "32:1"], "--curriculum: stage 32:1 is shorter than the task's minimum length 64"),
    (["--curriculum", "64:0"], "--curriculum: stage 64:0"),
    (["--curriculum", "64:2,x"], "--curriculum"),
    (["--kv-heads", "3"], "--kv-heads"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--rope-theta", "-1"], "--rope-theta must be a finite number"),
    (["--eval-every", "0"], "--eval-every must be"),
    (["--max-minutes", "nan"], "--max-minutes must be a finite number"),
])
def test_pretrain_task_usage_errors_name_the_option_before_any_work(tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    rc, err = _pretrain(capsys, *TASK, "--out", out, "--steps", "1", *extra)
    assert rc == 2 and needle in _one_line(err), err
    assert not out.exists()


def test_pretrain_out_that_is_a_file_or_cannot_be_made_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    for out, needle in ((tmp_path / "f", "exists and is not a directory"), (tmp_path / "f" / "sub", "cannot create"),
                        (Path("/proc/kvpop-run"), "cannot create")):
        for argv in (["--data", _data(tmp_path / "d"), *DATA], TASK):
            rc, err = _pretrain(capsys, *argv, "--out", out, "--steps", "1")
            assert rc == 2 and needle in _one_line(err), err
    assert (tmp_path / "f").read_text() == "x"


# ----------------------------------------------------------------------------- item 9: token ids, manifests
def test_pretrain_data_checks_every_token_id_when_loading(tmp_path, capsys):
    data = _data(tmp_path / "d")
    lines = data.read_text().splitlines()
    lines[3] = json.dumps({"input_ids": [-1] + json.loads(lines[3])["input_ids"][1:]})
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    rc, err = _pretrain(capsys, "--data", data, *DATA, "--out", out, "--steps", "1")  # no vocab given: max id + 1
    msg = _one_line(err)
    assert rc == 2 and f"{data}:4: token id -1 is outside" in msg, msg
    assert not (out / "ckpt.pt").exists()


@pytest.mark.parametrize("manifest,needle", [
    ('{"vocab": 5}', "'vocab' must be an object"),
    ("[1, 2]", "holds a JSON list"),
    ('{"vocab": {"vocab_size": "many"}}', "'vocab_size' must be an int >= 1"),
    ('{"vocab": {"vocab_size": 0}}', "'vocab_size' must be an int >= 1"),
    ('{"vocab": {"vocab_size": 64, "pad": 64}}', "'pad' must be"),
    ('{"vocab": {"vocab_size": 64}, "splits": {"train": 3}}', "'splits'"),
    ('{"vocab": {"vocab_size": 64}, "package_versions": [1]}', "'package_versions'"),
    ('{"vocab": ', "not valid JSON"),
])
def test_pretrain_data_refuses_a_malformed_manifest_naming_the_field(tmp_path, capsys, manifest, needle):
    data = _data(tmp_path / "d")
    (data.parent / "manifest.json").write_text(manifest)
    out = tmp_path / "run"
    rc, err = _pretrain(capsys, "--data", data, *DATA, "--out", out, "--steps", "1")
    msg = _one_line(err)
    assert rc == 2 and needle in msg and "manifest.json" in msg, msg
    assert not (out / "ckpt.pt").exists()


def test_pretrain_data_refuses_a_vocab_size_that_cuts_off_a_special_id(tmp_path, capsys):
    data = _data(tmp_path / "d")
    (data.parent / "manifest.json").write_text(json.dumps({"vocab": {"vocab_size": 64, "bos": 60, "pad": 62}}))
    rc, err = _pretrain(capsys, "--data", data, *DATA, "--out", tmp_path / "run", "--steps", "1", "--vocab-size", "61")
    msg = _one_line(err)
    assert rc == 2 and "pad" in msg and "--vocab-size 61" in msg, msg


def test_realtext_corpus_refuses_to_write_an_empty_split(tmp_path, capsys):
    from studies import realtext_corpus as C

    site = tmp_path / "site"
    (site / "alpha").mkdir(parents=True)
    (site / "alpha" / "mod.py").write_text("x = 1\n" * 400)  # one file: one split gets it, the others none
    out = tmp_path / "corpus"
    rc = C.main(["--out", str(out), "--site-packages", str(site), "--stdlib", "", "--packages", "alpha",
                 "--splits", "train,validation,test", "--seq-len", "64"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("realtext_corpus: error: ") and "no records" in err and len(err.splitlines()) == 1
    assert not list(out.glob("*.jsonl")) and not (out / "manifest.json").exists()
