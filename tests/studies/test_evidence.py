"""The evidence ledger's rules (studies.ledger): one selection rule, test splits scored once, the
ledger refuses rows scored more than once, the README's headline block is the ledger's rendering; its command
writes shipped files only with --write-shipped and checks every ledger before writing anything."""
import json
from pathlib import Path

import pytest

from studies import ledger as V

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
    assert block == "\n" + V.render_headline(ev), "regenerate: python -m studies.evidence readme --write-shipped"
    for inst in {r["instrument"] for r in ev["rows"]}:  # every instrument: the control and DMS beside KVpop
        pols = {r["policy"] for r in ev["rows"] if r["instrument"] == inst}
        assert any(p.startswith("fixed-finetune[streaming]") for p in pols), inst
        assert any(p.startswith("dms") for p in pols), inst
        dms = next(r for r in ev["rows"] if r["instrument"] == inst and r["policy"].startswith("dms"))
        best_kv = max(r["trials"] for r in ev["rows"] if r["instrument"] == inst and r["policy"].startswith("kvpop"))
        assert dms["trials"] >= best_kv, inst


def _cli(capsys, *argv):
    from studies import evidence as E

    rc = E.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out + err


def _shipped_state():
    return [(f, f.read_bytes()) for f in (V.EVIDENCE_FILE, ROOT / "README.md") if f.exists()] + \
        [(f, f.read_bytes()) for f in sorted((V.EVIDENCE_FILE.parent / "evidence").rglob("*")) if f.is_file()]


def _runs(tmp_path, *instruments):
    ev = json.loads(V.EVIDENCE_FILE.read_text())
    for inst in instruments:
        (tmp_path / "runs" / inst).mkdir(parents=True)
        comps = [c for c in ev.get("comparisons", []) if c["instrument"] == inst]
        V.write_json(tmp_path / "runs" / inst / "evidence_rows.json",
                     {"rows": [r for r in ev["rows"] if r["instrument"] == inst], **({"comparisons": comps} if comps
                                                                                      else {})})
    return tmp_path / "runs", ev


def test_evidence_writes_shipped_files_only_with_write_shipped(tmp_path, capsys, monkeypatch):
    """ledger without --out, readme without --readme, or either aimed at a shipped file: refused, nothing
    written; --write-shipped writes the shipped ledger, its archive and the README (here monkeypatched copies)."""
    from studies import evidence as E

    runs, ev = _runs(tmp_path, "realtext")
    before = _shipped_state()
    for argv, says in ((["ledger", "--runs", runs], "give --out FILE, or --write-shipped"),
                       (["ledger", "--runs", runs, "--out", V.EVIDENCE_FILE], "add --write-shipped"),
                       (["ledger", "--runs", runs, "--out", tmp_path / "l.json", "--archive",
                         V.EVIDENCE_FILE.parent / "evidence"], "--archive"),
                       (["readme"], "give --readme FILE, or --write-shipped"),
                       (["readme", "--readme", ROOT / "README.md"], "add --write-shipped"),
                       (["readme", "--readme", V.EVIDENCE_FILE.parent / "evidence.md", "--every-budget"],
                        "add --write-shipped")):
        rc, msg = _cli(capsys, *argv)
        assert rc == 2 and says in msg and "Traceback" not in msg, (argv, msg)
    assert _shipped_state() == before
    rc, msg = _cli(capsys, "ledger", "--runs", runs, "--out", tmp_path / "mine" / "evidence.json")
    assert rc == 0 and (tmp_path / "mine" / "evidence" / "realtext" / "evidence_rows.json").exists(), msg
    assert _shipped_state() == before
    led, readme = tmp_path / "shipped" / "evidence.json", tmp_path / "README.md"
    V.write_json(led, ev)
    readme.write_text(f"x\n{V.README_START}\nold\n{V.README_END}\n")
    monkeypatch.setattr(E, "EVIDENCE_FILE", led)
    monkeypatch.setattr(E, "README_FILE", readme)
    assert _cli(capsys, "ledger", "--runs", runs, "--write-shipped")[0] == 0
    assert (tmp_path / "shipped" / "evidence" / "realtext" / "evidence_rows.json").exists()
    assert _cli(capsys, "readme", "--evidence", led, "--write-shipped")[0] == 0
    assert V.render_headline(ev) in readme.read_text() and "\nold\n" not in readme.read_text()
    assert _shipped_state() == before


def test_ledger_from_one_instrument_keeps_the_others_rows(tmp_path, capsys):
    """--runs holding one instrument rebuilds its rows and keeps the other instruments' of the ledger it replaces
    (it dropped 60 of the 90 rows)."""
    runs, ev = _runs(tmp_path, "realtext")
    out = tmp_path / "evidence.json"
    V.write_json(out, ev)
    rc, msg = _cli(capsys, "ledger", "--runs", runs, "--out", out)
    assert rc == 0 and "kvtrace, lookahead kept" in msg, msg
    assert json.loads(out.read_text()) == ev
    changed = [dict(r, policy=r["policy"] + "-new") if r["instrument"] == "realtext" else r for r in ev["rows"]]
    V.write_json(runs / "realtext" / "evidence_rows.json",
                 {"rows": [r for r in changed if r["instrument"] == "realtext"]})
    assert _cli(capsys, "ledger", "--runs", runs, "--out", out)[0] == 0
    assert json.loads(out.read_text())["rows"] == changed
    out.write_text("{")  # an --out that holds no ledger is left as it is
    rc, msg = _cli(capsys, "ledger", "--runs", runs, "--out", out)
    assert rc == 2 and f"{out}: not a JSON ledger" in msg and "move it away" in msg and out.read_text() == "{", msg
    rc, msg = _cli(capsys, "ledger", "--runs", runs, "--out", tmp_path / "o.json", "--archive", runs)
    assert rc == 2 and "is --runs itself" in msg and not (tmp_path / "o.json").exists(), msg


BAD_LEDGERS = {
    "only test_evaluations": ({"rows": [{"test_evaluations": 1}]}, "row 0 lacks instrument, policy"),
    "not JSON": ("{rows: nope", "not a JSON ledger"),
    "a list": ([], "not a ledger"),
    "rows not a list": ({"rows": 3}, "not a ledger"),
    "a row not an object": ({"rows": [7]}, "row 0 is int"),
    "string mean": ({"rows": [_row(mean="0.2")]}, "row 0 (realtext p B=128): mean must be a finite number"),
    "NaN seed": ({"rows": [_row(seeds=[float("nan")])]}, "seeds must be a non-empty list of finite numbers"),
    "bool budget": ({"rows": [_row(budget=True)]}, "budget must be an int > 0"),
    "unknown instrument": ({"rows": [_row(instrument="kvtrac")]}, "instrument must be one of"),
    "unknown metric": ({"rows": [_row(metric="acc")]}, "metric must be one of"),
    "scored twice": ({"rows": [_row(test_evaluations=2)]}, "scored on its test split 2 times"),
    "mean not the seeds'": ({"rows": [_row(mean=0.5, value=0.5)]}, "not the mean, min and max of its seeds"),
    "a row twice": ({"rows": [_row(), _row()]}, "row 1 (realtext p B=128) repeats row 0"),
    "two metrics": ({"rows": [_row(), _row(policy="q", metric="accuracy")]}, "where realtext's rows have"),
    "headline not bool": ({"rows": [_row(headline="yes")]}, "headline must be true or false"),
}


@pytest.mark.parametrize("case", sorted(BAD_LEDGERS))
def test_malformed_ledgers_are_refused_naming_file_and_row(case, tmp_path, capsys):
    """Every malformed ledger (given to readme, or a runner's evidence_rows.json given to ledger) is a usage error
    naming the file and the row, with nothing written (it was a KeyError / TypeError traceback, or accepted)."""
    content, says = BAD_LEDGERS[case]
    bad = tmp_path / "bad.json"
    bad.write_text(content if isinstance(content, str) else json.dumps(content))
    readme = tmp_path / "R.md"
    readme.write_text(f"{V.README_START}\nold\n{V.README_END}\n")
    rc, msg = _cli(capsys, "readme", "--evidence", bad, "--readme", readme)
    assert rc == 2 and str(bad) in msg and says in msg and "Traceback" not in msg, msg
    assert readme.read_text() == f"{V.README_START}\nold\n{V.README_END}\n"
    (tmp_path / "runs" / "realtext").mkdir(parents=True)
    rows = tmp_path / "runs" / "realtext" / "evidence_rows.json"
    rows.write_text(bad.read_text())
    rc, msg = _cli(capsys, "ledger", "--runs", tmp_path / "runs", "--out", tmp_path / "out.json")
    assert rc == 2 and str(rows) in msg and "Traceback" not in msg and not (tmp_path / "out.json").exists(), msg


def test_ledger_refuses_rows_filed_under_another_instrument_and_a_readme_not_text(tmp_path, capsys):
    (tmp_path / "runs" / "kvtrace").mkdir(parents=True)
    rows = tmp_path / "runs" / "kvtrace" / "evidence_rows.json"
    rows.write_text(json.dumps({"rows": [_row()]}))  # a realtext row in kvtrace's file
    rc, msg = _cli(capsys, "ledger", "--runs", tmp_path / "runs", "--out", tmp_path / "l.json")
    assert rc == 2 and f"{rows}: row 0 (realtext p B=128) is of instrument 'realtext', in kvtrace's rows" in msg, msg
    (tmp_path / "R.md").write_bytes(b"\xff\xfe not text")
    rc, msg = _cli(capsys, "readme", "--readme", tmp_path / "R.md")
    assert rc == 2 and f"{tmp_path / 'R.md'} is not UTF-8 text" in msg, msg


def test_readme_never_empties_the_block_or_drops_an_instrument(tmp_path, capsys):
    ev = json.loads(V.EVIDENCE_FILE.read_text())
    readme = tmp_path / "R.md"
    readme.write_text((ROOT / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    before = readme.read_bytes()
    for rows, says in (([], "holds no headline row, its table would be empty"),
                       ([dict(r, headline=False) for r in ev["rows"]], "would be empty"),
                       ([r for r in ev["rows"] if r["instrument"] == "realtext"], "would drop kvtrace, lookahead")):
        V.write_json(tmp_path / "l.json", {"rows": rows})
        rc, msg = _cli(capsys, "readme", "--evidence", tmp_path / "l.json", "--readme", readme)
        assert rc == 2 and says in msg and "nothing written" in msg, msg
        assert readme.read_bytes() == before
    with pytest.raises(ValueError, match="would be empty"):
        V.update_readme(readme, {"rows": []})


def test_study_out_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    """realtext_corpus and the evidence runners with --out an existing file (or under one): one line naming the
    option (was FileExistsError), before any work; --out inside the package needs --write-shipped."""
    from studies import realtext_corpus as C

    f = tmp_path / "file"
    f.write_text("x")
    for out in (f, f / "sub"):
        assert C.main(["--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"realtext_corpus: error: --out {out}") and "not a directory" in err, err
        for argv in (["synthetic", "--task", "kvtrace", "--out", out], ["realtext", "--out", out]):
            rc, msg = _cli(capsys, *argv)
            assert rc == 2 and f"--out {out}" in msg and "not a directory" in msg and len(msg.splitlines()) == 1
    assert C.main(["--out", str(C.SHIPPED_DIR)]) == 2  # the package's corpus
    assert "--write-shipped" in capsys.readouterr().err
    assert C.main(["--out", str(V.EVIDENCE_FILE.parent / "corpus")]) == 2  # the studies' results
    assert "--write-shipped" in capsys.readouterr().err and not (V.EVIDENCE_FILE.parent / "corpus").exists()
    rc, msg = _cli(capsys, "synthetic", "--task", "kvtrace", "--out", V.EVIDENCE_FILE.parent / "x")
    assert rc == 2 and "--write-shipped" in msg and not (V.EVIDENCE_FILE.parent / "x").exists()
    assert f.read_text() == "x"


def test_fresh_realtext_test_split_is_reproducible_and_disjoint(tmp_path):
    from studies import evidence_realtext as RT
    from studies import realtext_corpus as C

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


def test_second_fresh_realtext_split_excludes_every_earlier_split_and_is_reproducible(tmp_path):
    """test_fresh2 (issue 43 item 3: the first fresh split was scored, so spent): no file of the shipped
    validation / test splits nor of test_fresh, every file of the test bucket, its listing hash and JSONL hash
    as recorded, and the stage's function remakes it from the record's hash seed and exclusions."""
    import hashlib

    from studies import evidence_realtext as RT
    from studies import realtext_corpus as C

    rec = json.loads((RT.SHIPPED / "test_fresh2.json").read_text())
    first = json.loads((RT.SHIPPED / "test_fresh.json").read_text())
    man = json.loads((RT.SHIPPED / "manifest.json").read_text())
    new = set(rec["files"])
    assert not new & (set(man["splits"]["test"]["files"]) | set(man["splits"]["validation"]["files"]))
    assert not new & set(first["files"]) and rec["excluded_earlier_fresh_files"] == {"test_fresh.json": 29}
    st = man["settings"]
    assert all(C.split_of(k, st["seed"], st["valid_frac"], st["test_frac"]) == "test" for k in new)
    assert rec["files_used_hash"] == hashlib.blake2b("\n".join(sorted(new)).encode(), digest_size=16).hexdigest()
    assert C.file_hash(RT.SHIPPED / "test_fresh2.jsonl") == rec["jsonl_blake2b"] and rec["hash_seed"] != 2
    lines = (RT.SHIPPED / "test_fresh2.jsonl").read_text().splitlines()
    assert len(lines) == rec["records"] == 48 and all(len(json.loads(x)["input_ids"]) == 1024 for x in lines)
    with pytest.raises(ValueError, match="name must be a new split"):
        RT.fresh_test_split(tmp_path, tmp_path, n_records=1, name="validation")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="no files list"):
        RT.fresh_test_split(tmp_path, tmp_path, n_records=1, name="x", exclude=(tmp_path / "bad.json",))
    from importlib import metadata

    if any(metadata.version(C.DISTRIBUTIONS.get(p, p)) != v for p, v in
           ((p, rec["package_versions"][C.DISTRIBUTIONS.get(p, p)]) for p in st["packages"])):
        pytest.skip("other package versions are installed than the split was made from: its files differ")
    RT.fresh_test_split(tmp_path, tmp_path, n_records=48, hash_seed=rec["hash_seed"], name="test_fresh2",
                        exclude=(RT.SHIPPED / "test_fresh.json",))
    assert C.file_hash(tmp_path / "test_fresh2.jsonl") == rec["jsonl_blake2b"]
    assert json.loads((tmp_path / "test_fresh2.json").read_text())["files"] == rec["files"]


def test_dms_extension_one_factor_at_a_time_longer_only_while_it_helps_and_resumes(tmp_path, monkeypatch):
    """--stage dms-extend: the extension's trials start from the first choice, one factor at a time; 800 steps
    runs only because 600 helped; a rerun repeats no trial; the best of every trial becomes ``rechosen``."""
    import argparse

    from studies import evidence_realtext as R

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

    from studies import evidence_realtext as R

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


def _cmp(**kw):
    c = {"instrument": "realtext", "budget": 128, "a": "k", "b": "c", "mean_diff": -0.01, "ci95": [-0.02, -0.001],
         "n_sequences": 4, "n_clusters": 2, "seeds": {"a": 2, "b": 2}, "method": "paired bootstrap", "split": "t2",
         "reference": "original", "verdict": "a better", "lower_is_better": True}
    return {**c, **kw}


def _split_rows():
    ps = {"k": [[0.1, 0.1, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2]], "c": [[0.3, 0.3, 0.2, 0.2], [0.2, 0.2, 0.3, 0.3]]}
    return [_row(policy=p, seeds=[sum(x) / 4 for x in v], mean=sum(sum(x) / 4 for x in v) / 2,
                 value=sum(sum(x) / 4 for x in v) / 2, min=min(sum(x) / 4 for x in v),
                 max=max(sum(x) / 4 for x in v), split="t2", per_sequence=v, headline=False) for p, v in ps.items()]


def test_ledger_takes_rows_of_a_second_split_per_sequence_values_and_comparisons():
    """issue 43 item 2: rows of one policy on two splits are two rows; per_sequence averages to the seeds;
    comparisons name rows of their split, say their seeds, and say "better" only where the interval excludes 0."""
    rows = [_row(policy="k"), *_split_rows()]
    ok = {"rows": rows, "comparisons": [_cmp(), _cmp(reference="same weights")]}
    assert V.check_ledger(ok, "L") == rows and V.check_comparisons(ok, "L") == ok["comparisons"]
    assert V.check_comparisons({"rows": rows}, "L") == []
    bad_ps = [*_split_rows()]
    bad_ps[0] = {**bad_ps[0], "per_sequence": [[0.1] * 4, [0.2] * 4]}
    with pytest.raises(ValueError, match="per_sequence .* is not one list per seed"):
        V.check_ledger({"rows": bad_ps}, "L")
    with pytest.raises(ValueError, match="per_sequence must be a list, one per seed"):
        V.check_ledger({"rows": [_row(per_sequence=[[0.1], [0.2, 0.3]])]}, "L")
    with pytest.raises(ValueError, match="repeats row 0 .*split"):
        V.check_ledger({"rows": [_row(split="t2"), _row(split="t2")]}, "L")
    cases = [
        (_cmp(verdict="no difference shown"), "verdict 'no difference shown', where its interval"),
        (_cmp(ci95=[-0.001, 0.002], verdict="a better"), "says 'no difference shown'"),
        (_cmp(b="x"), "b = 'x' is no row of realtext at B=128 scored on 't2'"),
        (_cmp(split="other"), "a = 'k' is no row"),
        (_cmp(seeds={"a": 3, "b": 2}), "seeds.a is 3, its row has 2"),
        (_cmp(n_clusters=5), "5 clusters of 4 sequences"),
        (_cmp(b="k"), "a and b are the same row"),
        (_cmp(ci95=[0.1, -0.1]), "ci95 must be"),
        ({k: v for k, v in _cmp().items() if k != "split"}, "lacks split"),
    ]
    for c, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(")):
            V.check_ledger({"rows": rows, "comparisons": [c]}, "L")
    with pytest.raises(ValueError, match="repeats comparison 0"):
        V.check_ledger({"rows": rows, "comparisons": [_cmp(), _cmp()]}, "L")
    with pytest.raises(ValueError, match="comparisons must be a list"):
        V.check_ledger({"rows": rows, "comparisons": {}}, "L")


def test_ledger_build_and_merge_carry_comparisons(tmp_path):
    rows = [_row(policy="k"), *_split_rows()]
    (tmp_path / "realtext").mkdir()
    (tmp_path / "realtext" / "evidence_rows.json").write_text(json.dumps({"rows": rows, "comparisons": [_cmp()]}))
    led = V.build_ledger(tmp_path)
    assert led == {"rows": rows, "comparisons": [_cmp()]}
    kv = [_row(instrument="kvtrace", metric="accuracy")]
    merged, kept = V.merge_ledger({"rows": kv}, led["rows"], led["comparisons"])
    assert kept == ["realtext"] and merged == {"rows": kv + rows, "comparisons": [_cmp()]}
    merged, _ = V.merge_ledger(led, [_row(policy="old")], [])  # realtext rebuilt: its new comparisons only
    assert merged == led
    assert V.merge_ledger({"rows": kv}, [], []) == ({"rows": kv}, [])


def test_tables_show_one_policy_on_two_splits_as_two_rows():
    ev = {"rows": [_row(policy="k"), *_split_rows()]}
    t = V.render_headline(ev, every_budget=True)
    assert "| k | +0.2000 (+0.1000 .. +0.3000) |" in t and "| k on t2 | +0.1750 (+0.1500 .. +0.2000) |" in t
    assert "| c on t2 |" in t and "`k on t2`: a row" in t
    assert "on t2" not in V.render_headline(ev)  # headline rows only: the split's rows are not headline
