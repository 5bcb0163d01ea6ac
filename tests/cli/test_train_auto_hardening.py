"""``kvpop train --auto`` reuses and overwrites only what it should: ``--resume`` refuses a search of other options
or data (naming what changed) and tampered trial records (naming the file), ``--auto`` refuses an OUT holding a plain
run and validation data that is the training data, a signal says how to resume, each trial's start and validations
are printed as they happen; kill -9 mid-trial then ``--resume`` gives the uninterrupted search's choice."""
import contextlib
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvpop.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# the shipped tiny model on the task at S = 96 > budget 32; two validation sequences (as tests/cli/test_train_auto.py)
BASE = ["--auto", "--task", "--seq-len", "96", "--budget", "32", "--sinks", "2", "--window", "8",
        "--valid-sequences", "2"]
QUICK = [*BASE, "--no-progress"]
SEARCH = ["--steps", "2", "--auto-budget", "4"]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _record(out):
    return json.loads((Path(out) / "selection.json").read_text())


def _outcome(out):
    """What a search chose and measured (not its wall times)."""
    rec = _record(out)
    keep = ("stage", "settings", "score", "steps", "dir", "best_step", "validations", "per_sequence")
    return [{k: t.get(k) for k in keep} for t in rec["trials"]], rec["skipped"], rec["chosen"]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """An uninterrupted search (progress on: its stderr is kept) and what it printed."""
    out = tmp_path_factory.mktemp("auto") / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", *BASE, *SEARCH, "--out", str(out)]) == 0
    return out, err.getvalue()


def _copy(searched, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(searched[0], out)
    return out


def _files(out):
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()
            and p.name != ".lock"}


def test_each_trial_start_and_its_validations_are_printed_as_they_happen(searched):
    lines = searched[1].splitlines()
    first = next(i for i, x in enumerate(lines) if "lm_weight" in x and "started in" in x)
    v1 = next(i for i, x in enumerate(lines) if "validation at step 1/2" in x)
    done = next(i for i, x in enumerate(lines) if "lm_weight" in x and ": trained trial's select score" in x)
    assert first < v1 < done  # before the trial ends, not after it
    assert sum("started in" in x for x in lines) == 4  # two label oracles, two trained trials
    assert sum("validation at step" in x for x in lines) == 4  # two per trained trial


@pytest.mark.parametrize("change, message", [
    (["--budget", "30"], r"--budget \(was 32, now 30\)"),
    (["--seq-len", "112"], r"--seq-len \(was 96, now 112\)"),
    (["--task", "lookahead"], r"--task \(was 'kvtrace', now 'lookahead'\).*the content of the model directory"),
    (["--steps", "3", "--auto-budget", "9"], r"--steps \(was 2, now 3\)"),
    (["--valid-sequences", "3"], r"--valid-sequences \(was 2, now 3\)"),
    (["--seed", "1"], r"--seed \(was 0, now 1\)"),
    (["--auto-patience", "1"], r"--auto-patience \(was 2, now 1\)"),  # the default's value, not "not given"
])
def test_resume_refuses_a_search_of_other_options(searched, tmp_path, change, message):
    out = _copy(searched, tmp_path)
    before = _files(out)
    with pytest.raises(SystemExit, match=r"--auto --resume: .*trial.json is a trial of a search with other options "
                                         r"or data.*" + message):
        main(["train", *QUICK, *SEARCH, *change, "--out", str(out), "--resume"])
    assert _files(out) == before  # refused before any work


def test_resume_refuses_an_interrupted_trial_of_other_options(searched, tmp_path):
    """A trial interrupted before its record (no trial.json) is checked by the record of its start."""
    out = _copy(searched, tmp_path)
    chosen = out / _record(out)["chosen"]["dir"]
    for d in (out / "auto").iterdir():
        if d != chosen:
            shutil.rmtree(d)
    (chosen / "trial.json").unlink()
    with pytest.raises(SystemExit, match=r"search.json is a trial of a search with other options.*--budget"):
        main(["train", *QUICK, *SEARCH, "--budget", "30", "--out", str(out), "--resume"])


def _tamper_dir(r, outside):
    r["dir"] = os.path.relpath(outside, outside.parent.parent / "run")


@pytest.mark.parametrize("tamper, message", [
    (lambda r, o: r.update(dir=str(o)), "not the directory the record lies in"),
    (_tamper_dir, "not the directory the record lies in"),
    (lambda r, o: r.update(score=math.nan), "nan, not a finite number"),
    (lambda r, o: r.update(score="0.01"), '"score" must be a number, got str'),
    (lambda r, o: r.pop("search_inputs"), "does not say which options and data"),
    (None, "not a readable JSON record"),
])
def test_resume_refuses_a_tampered_trial_record_naming_it(searched, tmp_path, tamper, message):
    out = _copy(searched, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "scorers.safetensors").write_bytes(b"not the chosen run")
    f = out / _record(out)["chosen"]["dir"] / "trial.json"
    if tamper is None:
        f.write_text(f.read_text()[:40])  # truncated
    else:
        r = json.loads(f.read_text())
        tamper(r, outside)
        f.write_text(json.dumps(r))
    before = _files(out)
    with pytest.raises(SystemExit, match=message) as e:
        main(["train", *QUICK, "--steps", "2", "--auto-budget", "6", "--out", str(out), "--resume"])
    assert str(f) in str(e.value)
    assert _files(out) == before  # nothing followed, nothing copied into OUT


def _ids(n, length, seed):
    g = random.Random(seed)
    return [{"input_ids": [g.randrange(640) for _ in range(length)]} for _ in range(n)]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_data_search_resume_refuses_edited_files_and_valid_data_that_is_training_data(tmp_path, capsys):
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    recs = _ids(4, 70, 0)
    _write(train, recs)
    _write(valid, _ids(2, 70, 1))
    out = tmp_path / "run"
    cmd = ["train", "--auto", "--data", str(train), "--valid-data", str(valid), "--seq-len", "64", "--budget", "24",
           "--sinks", "2", "--window", "8", "--steps", "1", "--auto-budget", "1", "--label", "mean",
           "--auto-patience", "0", "--valid-sequences", "1", "--no-progress", "--out", str(out)]
    assert main(cmd) == 0
    assert main([*cmd, "--resume"]) == 0 and "(reused)" in capsys.readouterr().err  # the same search: reused
    for path, flag in ((valid, "--valid-data"), (train, "--data")):
        saved = path.read_bytes()
        path.write_bytes(saved.replace(b"1", b"2", 1))  # edited in place, same size
        with pytest.raises(SystemExit, match=f"the content of {flag} \\(edited since the trial ran"):
            main([*cmd, "--resume"])
        path.write_bytes(saved)
    assert main([*cmd, "--resume"]) == 0  # restored: the same search again
    # validation records that are the training records, in another order, with and without --pack
    shuffled = tmp_path / "shuffled.jsonl"
    _write(shuffled, [recs[2], recs[0], recs[3]])
    for pack in ([], ["--pack"]):
        with pytest.raises(SystemExit, match=r"--valid-data .*shuffled.jsonl: all 3 of its records are training "
                                             r"records of --data .* --auto's search must score its trials on "
                                             r"held-out records"):
            main([*cmd[:-1], str(tmp_path / "o"), "--valid-data", str(shuffled), *pack])
    assert not (tmp_path / "o" / "auto").exists()
    copy = tmp_path / "copy.jsonl"
    shutil.copy(train, copy)
    for given in (str(train), str(copy)):
        with pytest.raises(SystemExit, match="--auto's search must score its trials on held-out records"):
            main([*cmd[:-1], str(tmp_path / "o"), "--valid-data", given])


def test_auto_refuses_an_out_holding_a_plain_run_and_plain_train_names_auto_resume(searched, tmp_path):
    plain = tmp_path / "plain"
    assert main(["train", "--task", "--seq-len", "96", "--budget", "32", "--sinks", "2", "--window", "8", "--steps",
                 "1", "--no-progress", "--no-train-model", "--out", str(plain)]) == 0
    before = _files(plain)
    for resume in ([], ["--resume"]):
        with pytest.raises(SystemExit, match="holds a run of kvpop train without --auto .*last.pt.*choose another"):
            main(["train", *QUICK, *SEARCH, "--out", str(plain), *resume])
    assert _files(plain) == before
    # the other way: a plain run into an --auto OUT is refused, its advice naming --auto --resume
    out = _copy(searched, tmp_path)
    before = _files(out)
    for resume in ([], ["--resume"]):
        with pytest.raises(SystemExit, match="holds a kvpop train --auto search .*same kvpop train --auto command "
                                             "and --resume"):
            main(["train", "--task", "--seq-len", "96", "--budget", "32", "--sinks", "2", "--window", "8",
                  "--steps", "3", "--no-progress", "--out", str(out), *resume])
    assert _files(out) == before
    # an interrupted search (trials, no selection.json yet) is continued with --resume only
    part = tmp_path / "part"
    (part / "auto" / "label-mean").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds the trials of an earlier --auto search .*add --resume"):
        main(["train", *QUICK, *SEARCH, "--out", str(part)])


@pytest.mark.parametrize("budget", ["9" * 400, "1" * 400 + "m", "1" * 30 + ".5"])
def test_auto_budget_of_too_many_digits_is_refused(tmp_path, budget):
    with pytest.raises(SystemExit, match=r"--auto-budget .*too large"):
        main(["train", *QUICK, "--steps", "2", "--auto-budget", budget, "--out", str(tmp_path / "o")])


def test_valid_data_help_names_auto(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--valid-data FILE.jsonl with --allocate or --auto" in text and "--auto scores every trial on them" in text


def test_a_signal_during_scoring_says_how_to_resume_and_the_search_resumes(tmp_path, monkeypatch, capsys):
    """SIGTERM while a trial is scored (no training step in flight, so no kvpop train handler): the search stops
    with 143 and says what happened and how to resume; the resumed search finishes."""
    import kvpop.cli.auto as A

    real = A._task_scorer

    def stopping(*a, **kw):
        def score(d, part):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
            raise AssertionError("not stopped")
        return score

    monkeypatch.setattr(A, "_task_scorer", stopping)
    out = tmp_path / "run"
    cmd = ["train", *QUICK, "--steps", "1", "--auto-budget", "1", "--label", "mean", "--out", str(out)]
    assert main(cmd) == 143
    err = capsys.readouterr().err
    assert "kvpop train --auto: stopped by SIGTERM" in err and \
        "run the same kvpop train --auto command with --resume" in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers restored
    monkeypatch.setattr(A, "_task_scorer", real)
    assert main([*cmd, "--resume"]) == 0 and _record(out)["chosen"] is not None


def test_kill_9_mid_trial_then_resume_gives_the_uninterrupted_choice(searched, tmp_path):
    out = tmp_path / "run"
    cmd = ["train", *QUICK, *SEARCH, "--out", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "kvpop", *cmd], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not list(out.glob("auto/*lmweight-0.1_*/last.pt")):  # the second trained trial, mid-way
            assert proc.poll() is None, "the search ended before it could be killed"
            assert time.time() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not list(out.glob("auto/*lmweight-0.1_*/trial.json"))  # killed before that trial's record
    assert main([*cmd, "--resume"]) == 0
    # the same trials, validations, skips and choice; the scores to float noise (the reference search ran in this
    # process, the killed one in another: the label oracles' NLL differed in the 7th digit)
    (got, skipped, chosen), (want, skipped_ref, chosen_ref) = _outcome(out), _outcome(searched[0])
    assert skipped == skipped_ref and (chosen["settings"], chosen["dir"]) == (chosen_ref["settings"], chosen_ref["dir"])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a["score"] == pytest.approx(b["score"], abs=1e-5)
        assert [v["step"] for v in a["validations"] or []] == [v["step"] for v in b["validations"] or []]
        assert [v["fit_score"] for v in a["validations"] or []] == \
            pytest.approx([v["fit_score"] for v in b["validations"] or []], abs=1e-5)
        assert a.get("per_sequence") == pytest.approx(b.get("per_sequence"), abs=1e-5)
        noisy = ("score", "validations", "per_sequence")
        assert {k: a[k] for k in a if k not in noisy} == {k: b[k] for k in b if k not in noisy}
    from safetensors.torch import load_file

    x, y = load_file(str(out / "scorers.safetensors")), load_file(str(searched[0] / "scorers.safetensors"))
    assert x.keys() == y.keys() and all((x[k].float() - y[k].float()).abs().max() <= 1e-5 for k in x)


def test_auto_refuses_valid_data_with_task_and_an_out_whose_auto_is_a_file(tmp_path):
    valid = tmp_path / "v.jsonl"
    _write(valid, _ids(2, 100, 0))
    with pytest.raises(SystemExit, match="--auto --task scores every trial on the task's validation sequences"):
        main(["train", *QUICK, *SEARCH, "--valid-data", str(valid), "--out", str(tmp_path / "o")])
    out = tmp_path / "o2"
    out.mkdir()
    (out / "auto").write_text("")
    with pytest.raises(SystemExit, match="auto is not a directory, where the search keeps its trials"):
        main(["train", *QUICK, *SEARCH, "--out", str(out)])
