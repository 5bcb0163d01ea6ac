"""A search's trial records are checked before they are reused (``kvpop.training.trial_records``): the schema, the
record's directory confined to its own, finite scores, the file named in every error, and the inputs (options and
data fingerprints) a ``kvpop train --auto`` trial ran under."""
import json
import math

import pytest

from kvpop.training.search import Search, Stage
from kvpop.training.trial_records import (
    INPUTS_KEY,
    STARTED_FILE,
    check_inputs,
    check_trial_dirs,
    read_trial,
    read_validations,
)

INPUTS = {"options": {"budget": 32, "seq_len": 96, "auto_budget": "4"}, "files": {"data": "size=1 blake2b=aa",
                                                                                 "model": {"config.json": "x"}}}


def _record(out, **kw):
    d = out / "auto" / "t"
    d.mkdir(parents=True, exist_ok=True)
    r = {"stage": "lr", "settings": {"x": 1}, "score": 0.5, "steps": 2, "seconds": 1.0, "dir": "auto/t", **kw}
    (d / "trial.json").write_text(json.dumps(r))
    return d / "trial.json"


def test_a_good_record_is_read_with_extra_entries_kept_and_its_inputs_left_out(tmp_path):
    f = _record(tmp_path, per_sequence=[0.4, 0.6], split={"fit": [0]}, validations=[{"step": 1, "score": 0.4}],
                scorer_only={"score": 0.3, "steps": 1}, **{INPUTS_KEY: INPUTS})
    r = read_trial(f, out=tmp_path, settings={"x": 1}, inputs=INPUTS)
    assert r["per_sequence"] == [0.4, 0.6] and r["split"] == {"fit": [0]} and INPUTS_KEY not in r
    assert read_trial(f, out=tmp_path, settings={"x": 2}) is None  # another trial's settings under the same tag


@pytest.mark.parametrize("change, message", [
    ({"dir": "../../elsewhere"}, "not the directory the record lies in"),
    ({"dir": "/tmp"}, "not the directory the record lies in"),
    ({"score": float("nan")}, "nan, not a finite number"),
    ({"score": float("inf")}, "inf, not a finite number"),
    ({"score": "0.1"}, '"score" must be a number, got str'),
    ({"score": True}, '"score" must be a number, got bool'),
    ({"score": None}, '"score" must be a number'),
    ({"steps": -1}, '"steps" must be a whole number'),
    ({"steps": 1.5}, '"steps" must be a whole number'),
    ({"seconds": "x"}, '"seconds" must be a number'),
    ({"stage": 3}, '"stage" must be a string'),
    ({"validations": [{"step": 1, "score": float("nan")}]}, r'"validations"\[0\]\["score"\] is nan'),
    ({"validations": {"step": 1}}, '"validations" must be a list'),
    ({"per_sequence": [0.1, float("nan")]}, r'"per_sequence"\[1\] is nan'),
    ({"per_sequence": ["0.1"]}, r'"per_sequence"\[0\] must be a number'),
    ({"per_sequence": []}, '"per_sequence" must be a non-empty list'),
    ({"scorer_only": {"score": "bad", "steps": 1}}, '"score" must be a number'),
    ({"best_step": "2"}, '"best_step" must be a whole number'),
])
def test_a_bad_record_is_refused_naming_its_file(tmp_path, change, message):
    f = _record(tmp_path, **change)
    with pytest.raises(ValueError, match=message) as e:
        read_trial(f, out=tmp_path, settings={"x": 1})
    assert str(e.value).startswith(str(f))


@pytest.mark.parametrize("text, message", [
    ('{"stage": "lr", "settings": {"x": 1}, "sco', "not a readable JSON record"),  # truncated
    ("[1, 2]", "a trial record is a JSON object, got list"),
    ("", "not a readable JSON record"),
    ("[" * 100000, "not a readable JSON record"),
])
def test_an_unreadable_record_names_its_file(tmp_path, text, message):
    f = _record(tmp_path)
    f.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        read_trial(f, out=tmp_path, settings={"x": 1})
    assert str(e.value).startswith(str(f))


def test_the_inputs_of_a_trial_must_be_this_searchs(tmp_path):
    other = json.loads(json.dumps(INPUTS))
    other["options"].update(budget=30, auto_budget="40")  # --auto-budget may change, --budget not
    other["files"]["data"] = "size=2 blake2b=bb"
    other["files"]["model"] = {"config.json": "y"}
    f = _record(tmp_path, **{INPUTS_KEY: other})
    with pytest.raises(ValueError, match=r"--budget \(was 30, now 32\); the content of --data \(edited since") as e:
        read_trial(f, out=tmp_path, settings={"x": 1}, inputs=INPUTS)
    assert str(f) in str(e.value) and "auto-budget (was" not in str(e.value)
    assert "the content of the model directory (--model) (config.json changed" in str(e.value)
    f = _record(tmp_path)  # no inputs recorded: cannot be checked, so not reused
    with pytest.raises(ValueError, match="does not say which options and data"):
        read_trial(f, out=tmp_path, settings={"x": 1}, inputs=INPUTS)
    same = json.loads(json.dumps(INPUTS))
    same["options"]["auto_budget"] = "400"
    check_inputs(same, INPUTS, "here")  # only the budget differs: the same search


def test_check_trial_dirs_refuses_before_any_work_and_a_partial_trials_start_is_checked(tmp_path):
    d = tmp_path / "auto" / "t"
    d.mkdir(parents=True)
    other = {**INPUTS, "options": {**INPUTS["options"], "seq_len": 128}}
    (d / STARTED_FILE).write_text(json.dumps({INPUTS_KEY: other}))  # interrupted before its record
    with pytest.raises(ValueError, match=r"search.json is a trial of a search with other options.*--seq-len"):
        check_trial_dirs(tmp_path, "auto", INPUTS)
    (d / STARTED_FILE).write_text(json.dumps({INPUTS_KEY: INPUTS}))
    assert check_trial_dirs(tmp_path, "auto", INPUTS) == 1


def test_search_records_its_inputs_and_refuses_a_fresh_nan_score(tmp_path):
    plan = [Stage("x", [{"x": 1}, {"x": 2}], start={})]
    lines = []
    s = Search(tmp_path, inputs=INPUTS, log=lines.append)
    s.run_plan(plan, lambda c, d: {"score": c["x"], "steps": 1})
    f = tmp_path / "x-1" / "trial.json"
    assert json.loads(f.read_text())[INPUTS_KEY] == INPUTS and INPUTS_KEY not in s.record["trials"][0]
    assert json.loads((tmp_path / "x-1" / STARTED_FILE).read_text()) == {INPUTS_KEY: INPUTS}
    assert lines[0].endswith(f"x {{'x': 1}}: started in {tmp_path / 'x-1'}")  # each trial's start, as it happens
    other = {**INPUTS, "options": {**INPUTS["options"], "budget": 1}}
    with pytest.raises(ValueError, match="--budget"):
        Search(tmp_path, inputs=other, log=lines.append).run_plan(plan, lambda c, d: {"score": 0, "steps": 1})
    with pytest.raises(ValueError, match="nan, not a finite number"):
        Search(tmp_path / "n", log=lines.append).run_plan(plan, lambda c, d: {"score": math.nan, "steps": 1})


def test_validation_lines_are_checked(tmp_path):
    f = tmp_path / "validation.jsonl"
    f.write_text('{"step": 1, "score": 0.5}\n\n{"step": 2, "score": 0.4}\n')
    assert [v["step"] for v in read_validations(f)] == [1, 2]
    f.write_text('{"step": 1, "score": 0.5}\n{"step": 2, "score": NaN}\n')
    with pytest.raises(ValueError, match=r"validation.jsonl:2: a validation\[\"score\"\] is nan"):
        read_validations(f)
    f.write_text('{"step": 1, "sc}\n')
    with pytest.raises(ValueError, match=r"validation.jsonl:1: not a JSON record"):
        read_validations(f)
    # a process killed while appending a line leaves it without its newline: cut, that validation runs again
    f.write_text('{"step": 1, "score": 0.5}\n{"step": 2, "sc')
    assert read_validations(f) == [{"step": 1, "score": 0.5}]
    assert f.read_text() == '{"step": 1, "score": 0.5}\n'
    f.write_text('{"step": 1, "sc')
    assert read_validations(f) == [] and f.read_text() == ""
