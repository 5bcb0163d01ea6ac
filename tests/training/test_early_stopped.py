"""kvpop.training.auto.early_stopped: the search's early stopping as one function (the trials of --auto and
one more seed of a trial, kvpop.studies.controls_realtext.auto_trial)."""
import json

from kvpop.training.auto import SERVED_FILES, early_stopped


def _trainer(d, trained):
    def train_to(step):
        trained.append(step)
        d.mkdir(parents=True, exist_ok=True)
        (d / "model").mkdir(exist_ok=True)
        for name in SERVED_FILES:
            p = d / name / "w" if name == "model" else d / name
            p.write_text(str(step))
    return train_to


def test_best_state_kept_patience_and_ties(tmp_path):
    d, trained = tmp_path / "run", []
    scores = iter([0.5, 0.4, 0.4, 0.6, 0.7, 0.1])
    seen = []
    best, vals = early_stopped(d, total=12, every=2, patience=2, train_to=_trainer(d, trained),
                               fit_score=lambda: next(scores), note=lambda r, b, before: seen.append((r["step"], b)))
    assert trained == [2, 4, 6, 8, 10]  # two validations without a better or equal score: stopped before 12
    assert best == {"step": 6, "fit_score": 0.4}  # the tie at step 6 goes to the later state
    assert [v["step"] for v in vals] == [2, 4, 6, 8, 10] and seen[:3] == [(2, True), (4, True), (6, True)]
    assert (d / "scorers.safetensors").read_text() == "6" and (d / "model" / "w").read_text() == "6"
    assert [json.loads(x)["step"] for x in (d / "validation.jsonl").read_text().splitlines()] == [2, 4, 6, 8, 10]


def test_resume_reads_recorded_validations(tmp_path):
    d, trained = tmp_path / "run", []
    d.mkdir()
    (d / "validation.jsonl").write_text(json.dumps({"step": 2, "fit_score": 0.3}) + "\n")
    _trainer(d / "best", [])(2)  # the best state of the first start, kept as the search keeps it
    scores = iter([0.2])
    best, vals = early_stopped(d, total=4, every=2, patience=2, train_to=_trainer(d, trained),
                               fit_score=lambda: next(scores))
    assert trained == [4] and best["step"] == 4 and [v["step"] for v in vals] == [2, 4]
