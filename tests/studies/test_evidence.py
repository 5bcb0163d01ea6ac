"""The evidence ledger's rules (kvpop.studies.ledger): one selection rule, test splits scored once, the
ledger refuses rows scored more than once, the README's headline block is the ledger's rendering."""
import json
from pathlib import Path

import pytest

from kvpop.studies import ledger as V

ROOT = Path(__file__).resolve().parents[2]


def test_choose_takes_the_best_and_the_first_of_equals():
    ts = [{"score": 0.5, "i": 0}, {"score": 0.9, "i": 1}, {"score": 0.9, "i": 2}, {"score": 0.1, "i": 3}]
    assert V.choose(ts)["i"] == 1
    assert V.choose(ts, higher_is_better=False)["i"] == 3
    assert V.choose([{"score": 0.2, "i": 0}, {"score": 0.2, "i": 1}], higher_is_better=False)["i"] == 0
    with pytest.raises(ValueError, match="at least one"):
        V.choose([])


def test_test_log_scores_a_key_once_across_processes(tmp_path):
    calls = []

    def evaluate():
        calls.append(1)
        return {"value": len(calls)}

    log = V.TestLog(tmp_path)
    assert log.once("row|seed0", evaluate) == {"value": 1}
    assert log.once("row|seed0", evaluate) == {"value": 1}
    again = V.TestLog(tmp_path)  # a new runner (a resumed or repeated run) reads the log back
    assert again.once("row|seed0", evaluate) == {"value": 1}
    assert len(calls) == 1
    assert again.once("row|seed1", evaluate) == {"value": 2}
    assert again.count("row|seed0", "row|seed1") == 1 and again.count("row|seed2") == 0


def _row(**kw):
    r = {"instrument": "realtext", "policy": "p", "recipe": {}, "steps": 10, "seeds": [0.1, 0.2, 0.3], "mean": 0.2,
         "min": 0.1, "max": 0.3, "value": 0.2, "metric": "delta_nll", "trials": 3, "test_evaluations": 1,
         "budget": 128, "budget_fraction": 0.125, "headline": True, "legend": "a row"}
    return {**r, **kw}


def test_ledger_collects_instruments_and_refuses_rows_scored_twice(tmp_path):
    with pytest.raises(ValueError, match="no <instrument>/evidence_rows.json"):
        V.build_ledger(tmp_path)
    (tmp_path / "realtext").mkdir()
    (tmp_path / "realtext" / "evidence_rows.json").write_text(json.dumps({"rows": [_row()]}))
    assert V.build_ledger(tmp_path)["rows"] == [_row()]
    (tmp_path / "realtext" / "evidence_rows.json").write_text(json.dumps({"rows": [_row(test_evaluations=2)]}))
    with pytest.raises(ValueError, match="scored on its test split 2 times"):
        V.build_ledger(tmp_path)


def test_update_readme_replaces_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{V.README_START}\nold\n{V.README_END}\nafter\n")
    ev = {"rows": [_row(), _row(policy="q", seeds=[0.5], mean=0.5, min=0.5, max=0.5, value=0.5, legend="")]}
    assert V.update_readme(readme, ev)
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith(f"{V.README_END}\nafter\n")
    assert "| p | +0.2000 (+0.1000 .. +0.3000) | 3 | 3 | 10 |" in text and "| q | +0.5000 | 1 | 3 | 10 |" in text
    assert "`p`: a row" in text and "old" not in text
    assert not V.update_readme(readme, ev)
    readme.write_text("no block\n")
    with pytest.raises(ValueError, match="no evidence block"):
        V.update_readme(readme, ev)


def test_shipped_ledger_holds_the_rules_and_the_readme_is_its_rendering():
    ev = json.loads(V.EVIDENCE_FILE.read_text())
    keys = {"instrument", "policy", "recipe", "steps", "seeds", "trials", "test_evaluations", "budget_fraction",
            "value"}
    assert ev["rows"] and all(keys <= set(r) for r in ev["rows"])
    assert {r["instrument"] for r in ev["rows"]} <= set(V.INSTRUMENTS)
    for r in ev["rows"]:
        assert r["test_evaluations"] == 1, r["policy"]
        if r["policy"].startswith(("kvpop", "dms", "fixed-finetune")) and r["headline"]:
            assert len(r["seeds"]) >= 3, (r["instrument"], r["policy"])  # every headline learned row
        assert r["value"] == pytest.approx(sum(r["seeds"]) / len(r["seeds"]))
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split(V.README_START, 1)[1].split(V.README_END, 1)[0]
    assert block == "\n" + V.render_headline(ev), "regenerate: python -m kvpop.studies.evidence readme"
    for inst in {r["instrument"] for r in ev["rows"]}:  # every instrument: the control and DMS beside KVpop
        pols = {r["policy"] for r in ev["rows"] if r["instrument"] == inst}
        assert any(p.startswith("fixed-finetune[streaming]") for p in pols), inst
        assert any(p.startswith("dms") for p in pols), inst
        dms = next(r for r in ev["rows"] if r["instrument"] == inst and r["policy"].startswith("dms"))
        best_kv = max(r["trials"] for r in ev["rows"] if r["instrument"] == inst and r["policy"].startswith("kvpop"))
        assert dms["trials"] >= best_kv, inst


def test_fresh_realtext_test_split_is_reproducible_and_disjoint(tmp_path):
    from kvpop.studies import evidence_realtext as RT
    from kvpop.studies import realtext_corpus as C

    shipped = json.loads((RT.SHIPPED / "test_fresh.json").read_text())
    man = json.loads((RT.SHIPPED / "manifest.json").read_text())
    used = set(man["splits"]["test"]["files"]) | set(man["splits"]["validation"]["files"])
    assert not used & set(shipped["files"])
    st = man["settings"]
    assert all(C.split_of(k, st["seed"], st["valid_frac"], st["test_frac"]) == "test" for k in shipped["files"])
    assert C.file_hash(RT.SHIPPED / "test_fresh.jsonl") == shipped["jsonl_blake2b"]
    from importlib import metadata

    if any(metadata.version(C.DISTRIBUTIONS.get(p, p)) != v for p, v in
           ((p, man["package_versions"][C.DISTRIBUTIONS.get(p, p)]) for p in st["packages"])):
        pytest.skip("other package versions are installed: the corpus's files differ")
    RT.fresh_test_split(tmp_path, tmp_path, n_records=shipped["records"])
    assert C.file_hash(tmp_path / "test_fresh.jsonl") == shipped["jsonl_blake2b"]


def test_dms_extension_one_factor_at_a_time_longer_only_while_it_helps_and_resumes(tmp_path, monkeypatch):
    """--stage dms-extend: the extension's trials start from the first choice, one factor at a time; 800 steps
    runs only because 600 helped; a rerun repeats no trial; the best of every trial becomes ``rechosen``."""
    import argparse

    from kvpop.studies import evidence_realtext as R

    c0 = {"lr_gate": 0.01, "lr_model": 3e-4, "steps": 400, "target_keep": 0.125}
    first = {"settings": c0, "score": 0.030, "dir": "d0"}
    V.write_json(tmp_path / "selection.json", {"final": True, "trials_of": {"kvpop": 1, "dms": 1},
                                               "dms": {"trials": [first], "chosen": first}})
    made = []
    scores = {600: 0.028, 800: 0.029, 0.1: 0.025, 0.15: 0.040, "sched": 0.031}

    def fake_trial(corpus, out, log, c):
        made.append(c)
        key = "sched" if "schedule_steps" in c else (c["steps"] if c["steps"] != 400 else c["target_keep"])
        return {"settings": c, "score": scores[key], "dir": str(len(made))}

    monkeypatch.setattr(R, "_dms_trial", fake_trial)
    a = argparse.Namespace(jobs=1)
    rec = R._extend_dms(a, tmp_path, tmp_path, tmp_path / "log")
    assert all(sum(c[k] != c0[k] for k in c0) + ("schedule_steps" in c) == 1 for c in made)  # one factor each
    assert [c["steps"] for c in made if c["steps"] != 400] == [600, 800]
    assert {"schedule_steps": 200} == {k: v for c in made for k, v in c.items() if k == "schedule_steps"}
    assert rec["dms"]["rechosen"]["settings"] == {**c0, "target_keep": 0.1}
    assert rec["trials_of"]["dms_with_extension"] == 1 + 5 and rec["dms"]["chosen"] == first
    n = len(made)
    R._extend_dms(a, tmp_path, tmp_path, tmp_path / "log")  # resumed: nothing runs twice
    assert len(made) == n
    scores[600] = 0.031  # 600 steps no better than the first choice: no 800-step trial
    made.clear()
    (tmp_path / "selection.json").write_text(json.dumps({"final": True, "trials_of": {"dms": 1},
                                                         "dms": {"trials": [first], "chosen": first}}))
    R._extend_dms(a, tmp_path, tmp_path, tmp_path / "log")
    assert 800 not in [c["steps"] for c in made]
    with pytest.raises(ValueError, match="final"):
        R._extend_dms(a, tmp_path, tmp_path / "elsewhere", tmp_path / "log")


def test_realtext_select_writes_split_decisions_and_confirmation(tmp_path, monkeypatch):
    """The real-text study's DMS grid on the one rule (made-up per-sequence scores): a trial inside the margin is
    kept out, the top two are retrained with seed 1 and chosen on the mean, the record has every field."""
    import argparse

    from kvpop.studies import evidence_realtext as R

    monkeypatch.setattr(R, "DMS_GRID", {"lr_gate": (0.02, 0.05, 0.1), "lr_model": (1e-4,), "steps": (150,),
                                        "target_keep": (0.125,)})
    per = {0.02: [0.05, 0.06, 0.04, 0.05], 0.05: [0.049, 0.061, 0.041, 0.048], 0.1: [0.03, 0.031, 0.029, 0.03]}
    made = []

    def fake_trial(corpus, out, log, c, seed=0):
        made.append((c["lr_gate"], seed))
        ps = [x + 0.001 * seed for x in per[c["lr_gate"]]]
        return {"settings": c, "score": sum(ps) / 4, "per_sequence": ps, "dir": f"{c['lr_gate']}/{seed}"}

    monkeypatch.setattr(R, "_dms_trial", fake_trial)
    (tmp_path / "dms_select").mkdir()
    rec = R._select(argparse.Namespace(), tmp_path, tmp_path, tmp_path / "log")
    assert rec["split"]["select"] == list(range(R.VALID_SEQUENCES)) and rec["split"]["fit"] == []
    dms = [d for d in rec["decisions"] if d["stage"] == "dms lr_gate"]
    assert [d["adopted"] for d in dms] == [False, True]  # 0.05 better on the mean by less than 2 SE: kept out
    assert 0 < dms[0]["mean_diff"] < dms[0]["margin"]
    assert rec["dms"]["chosen"]["settings"]["lr_gate"] == 0.1 and rec["confirmation"]["ran"]
    assert sorted(made[-2:]) == [(0.02, 1), (0.1, 1)]  # the top two by the rule, retrained with seed 1
    assert not any(d["paired"] for d in rec["decisions"] if d["stage"].startswith("kvpop"))  # shipped, old format
