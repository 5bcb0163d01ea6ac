"""``kvpop train --auto`` end to end (issues 58, 59 and 62): the last line says how to evaluate and serve the chosen
run, the scores say their scale, a resumed search refuses a chosen trial whose files are gone (leaving OUT's run as
it was) and a trial record whose score is not its per-sequence mean, takes the default patience given explicitly,
and a fixed-mask search trains only trials that can differ."""
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvpop.cli import main  # noqa: E402

QUICK = ["--auto", "--task", "--seq-len", "96", "--budget", "32", "--sinks", "2", "--window", "8",
         "--valid-sequences", "2", "--no-progress", "--steps", "2", "--auto-budget", "4"]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto62") / "run"
    assert main(["train", *QUICK, "--out", str(out)]) == 0
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    rec = json.loads((dst / "selection.json").read_text())
    return dst, rec


def test_the_last_line_says_how_to_evaluate_and_serve_and_the_scales(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--out", str(out)]) == 0
    cap = capsys.readouterr()
    last = cap.out.strip().splitlines()[-1]
    assert "Evaluate: kvpop eval --model" in last and f"--run {out}" in last and "--budgets 32" in last
    assert f"Serve: vllm serve {out / 'model'} --hf-overrides" in last and "kvpop_scorers" in last
    # the label stage's oracle and the trained trials say which scale their score is on
    assert "label {'label': 'mean'}: oracle NLL over dense" in cap.err
    assert "trained trial's select score (error rate at the task's graded positions" in cap.err
    rec = json.loads((out / "selection.json").read_text())
    assert "selection power: 2 select sequences" in cap.err and rec["power"]["n_select"] == 2
    assert "cannot_tell" in rec and rec["tie_rule"].startswith("two trials the rule cannot tell apart")
    scales = {t["stage"]: t["scale"] for t in rec["trials"]}
    assert scales["label"].startswith("oracle NLL") and scales["lm_weight"].startswith("error rate")


def test_a_resumed_search_refuses_a_chosen_trial_whose_files_are_gone(searched, tmp_path):
    """Issue 59: the good OUT/scorers.safetensors was deleted before the chosen trial's file was found missing."""
    out, rec = _copy(searched, tmp_path)
    good = (out / "scorers.safetensors").read_bytes()
    (out / rec["chosen"]["dir"] / "scorers.safetensors").unlink()
    with pytest.raises(SystemExit, match="lacks scorers.safetensors"):
        main(["train", *QUICK, "--out", str(out), "--resume"])
    assert (out / "scorers.safetensors").read_bytes() == good


def test_a_trial_record_whose_score_was_edited_is_refused(searched, tmp_path):
    out, rec = _copy(searched, tmp_path)
    f = out / rec["chosen"]["dir"] / "trial.json"
    t = json.loads(f.read_text())
    t["score"] = t["score"] - 0.5
    f.write_text(json.dumps(t))
    with pytest.raises(SystemExit, match=r"trial\.json.*not the mean of its"):
        main(["train", *QUICK, "--out", str(out), "--resume"])


def test_the_default_patience_given_explicitly_resumes(searched, tmp_path):
    out, _ = _copy(searched, tmp_path)
    assert main(["train", *QUICK, "--out", str(out), "--resume", "--auto-patience", "2"]) == 0
    with pytest.raises(SystemExit, match="auto-patience"):
        main(["train", *QUICK, "--out", str(out), "--resume", "--auto-patience", "3"])


def test_a_fixed_mask_search_spends_the_budget_on_models_that_differ(tmp_path):
    """Issue 59: --mask-source streaming --auto-budget 4 trained two identical models (label / scorer-lr trials)."""
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--mask-source", "streaming", "--out", str(out)]) == 0
    rec = json.loads((out / "selection.json").read_text())
    trained = [t for t in rec["trials"] if t["steps"]]
    assert [t["stage"] for t in trained] == ["lm_weight", "lm_weight"]
    assert [t["settings"]["lm_weight"] for t in trained] == [0.0, 0.1]
    assert not any(t["stage"] == "label" for t in rec["trials"])
    status = {s["stage"]: s["status"] for s in rec["stages"]}
    assert status["lr_scorer"] == status["head_budgets"] == status["fixed_decay"] == "not applicable"
    assert rec["chosen"]["served_as"] == "fixed-finetune"
