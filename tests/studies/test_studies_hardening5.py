"""Round five (issue 59): the studies write under kvpop's one write rule (kvpop/cli/writes.py via
studies.paths.parse), and their tracebacks became one-line errors.  The table is docs/HARDENING.md, "Round five
(issue 59)"."""
from __future__ import annotations

import hashlib

import pytest

from studies import decay_realtext as D
from studies import evidence_realtext as RT
from studies import fresh_realtext as FR
from studies import mlstm_realtext as M
from studies.paths import RESULTS_DIR, ROOT

SHIPPED_RECORD = RESULTS_DIR / "evidence" / "realtext" / "fresh2.json"
CONTROLS = RESULTS_DIR / "evidence" / "realtext" / "controls.json"


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return " ".join(err.split())


def test_fresh_realtext_never_replaces_a_shipped_record_without_write_shipped(tmp_path, capsys):
    before = (_digest(SHIPPED_RECORD), _digest(SHIPPED_RECORD.with_suffix(".md")))
    with pytest.raises(SystemExit) as e:
        FR.main(["--out", str(tmp_path / "empty"), "--controls", str(CONTROLS), "--record", str(SHIPPED_RECORD),
                 "--partial"])
    assert e.value.code == 2
    err = _one_line(capsys.readouterr().err)
    assert "--record" in err and "lies in what the project ships" in err and "--write-shipped" in err
    assert (_digest(SHIPPED_RECORD), _digest(SHIPPED_RECORD.with_suffix(".md"))) == before


def test_fresh_realtext_ledger_runs_into_the_shipped_archive_is_a_one_line_error(tmp_path, capsys):
    rec = tmp_path / "rec.json"
    rc = FR.main(["--out", str(tmp_path / "empty"), "--controls", str(CONTROLS), "--record", str(rec), "--partial",
                  "--ledger-runs", str(RESULTS_DIR / "evidence"), "--write-shipped"])
    assert rc == 2
    err = _one_line(capsys.readouterr().err)
    assert "--ledger-runs" in err and "is the shipped archive" in err and "SameFileError" not in err
    assert not rec.exists()  # refused before the record is written


@pytest.mark.parametrize("module, argv", [
    ("studies.equal_bytes", ["--instrument", "kvtrace", "--out", "studies/results/_probe"]),
    ("studies.reconcile_mlstm", ["--summary"]),  # its default --out is studies/results/reconcile
    ("studies.auto_realtext", ["record", "--out", "OUT", "--split", "S", "--write", "studies/results/x.json"]),
    ("studies.decay_realtext", ["record", "--out", "OUT", "--base", "B", "--write",
                                "studies/results/evidence/realtext/decay.json"]),
])
def test_every_study_refuses_writing_shipped_results_without_write_shipped(module, argv, capsys, monkeypatch):
    import importlib

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 2
    err = _one_line(capsys.readouterr().err)
    assert "lies in what the project ships" in err and "add --write-shipped" in err


def test_decay_record_before_a_selection_is_a_one_line_error(tmp_path, capsys):
    assert D.main(["record", "--out", str(tmp_path), "--base", str(tmp_path)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("python -m studies.decay_realtext: error:") and "no final selection yet" in err


def test_decay_test_draws_no_split_into_the_package_without_write_shipped(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(D, "check_trained", lambda *a, **k: {})
    monkeypatch.setattr(D, "test_stage", lambda *a, **k: pytest.fail("scored without a split"))
    name = "test_fresh_hardening5"
    assert D.main(["test", "--out", str(tmp_path), "--base", str(tmp_path), "--corpus", str(tmp_path),
                   "--split-name", name]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"--split-name {name}: a new fresh split would be drawn into" in err and "--write-shipped" in err
    assert not any(M.SHIPPED.glob(f"{name}*"))


def test_decay_test_checks_its_runs_before_drawing_and_says_too_few_records_in_one_line(tmp_path, capsys,
                                                                                         monkeypatch):
    drawn = []
    monkeypatch.setattr(RT, "fresh_test_split", lambda *a, **k: drawn.append(k))
    assert D.main(["test", "--out", str(tmp_path), "--base", str(tmp_path), "--split-name", "test_fresh_h5"]) == 2
    assert "no final selection yet" in _one_line(capsys.readouterr().err) and not drawn  # nothing drawn in vain

    def too_few(*a, n_records, **k):
        raise ValueError(f"only 3 fresh test records could be made (asked for {n_records})")

    monkeypatch.setattr(D, "check_trained", lambda *a, **k: {})
    monkeypatch.setattr(RT, "fresh_test_split", too_few)
    assert D.main(["test", "--out", str(tmp_path), "--base", str(tmp_path), "--split-name", "test_fresh_h5",
                   "--test-records", "4"]) == 2
    assert "only 3 fresh test records could be made (asked for 4)" in _one_line(capsys.readouterr().err)


def test_auto_realtext_record_before_any_score_is_a_one_line_error(tmp_path, capsys):
    from studies import auto_realtext as AR

    assert AR.main(["record", "--out", str(tmp_path / "empty"), "--split", str(tmp_path / "fresh.jsonl")]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("python -m studies.auto_realtext: error:") and "no row scored on fresh.jsonl" in err
