"""studies.fresh_synthetic: the synthetic tasks' final rows scored once on a fresh test split (no model run here:
the split's seeds, the test log, the record's figures and intervals, the ledger rows; and the shipped records)."""
from __future__ import annotations

import json
import re

import pytest

from kvpop.demo import task as T
from studies import fresh_synthetic as F
from studies import ledger
from studies.evidence_synthetic import FRESH_FIRST
from studies.paired import paired_interval
from studies.paths import DATA, RESULTS_DIR, ROOT

KV = "kvpop-mlp-joint[paper]"
ROWS = F.rows_of(KV)


def _controls() -> dict:
    runs = {}
    for row in ROWS[:-1]:
        seeds = ["0"] if row == F.UNTRAINED else ["0", "1", "2"]
        pol = {F.UNTRAINED: "streaming", F.DMS_ROW: "dms", "fixed-finetune[streaming]": "fixed-finetune"}.get(
            row, "kvpop-mlp-joint")
        runs[row] = {s: {**({} if row == F.UNTRAINED else {"dir": f"/r/{row}/seed{s}"}), "policy": pol,
                         "per_sequence": [0.5], **({"settings": {"steps": 100}} if row != F.UNTRAINED else {}),
                         **({"threshold": -1.5 + int(s)} if row == F.DMS_ROW else {})} for s in seeds}
    return {"instrument": "kvtrace", "kvpop_row": {"name": KV, "legend": "validation's choice", "settings": {}},
            "settings": {"budget": 128, "length": 2048, "sinks": 4, "window": 32, "metric": "accuracy"},
            "runs": runs, "split": {"fit": [T.valid_seed(0)], "select": [T.valid_seed(1000)],
                                    "dms_threshold_on": [T.valid_seed(2000)]},
            "lr_selection": {r: {"trials": [{}, {}], "chosen": 1e-4} for r in (*F.FINETUNED, F.ORACLE)}}


def _value(row: str, seed: str, i: int) -> float:
    """A row's accuracy on sequence ``i``: the KVpop row and the oracle near 1, the controls low, with noise."""
    base = {KV: 0.97, F.ORACLE: 0.99, F.DMS_ROW: 0.96, F.DENSE: 1.0}.get(row, 0.2)
    return min(1.0, base + 0.03 * ((i * 7 + int(seed) * 3) % 5) / 4)


def _evaluate(calls: list, n: int):
    def evaluate(row, seed, run):
        calls.append((row, seed))
        return [_value(row, seed, i) for i in range(n)]
    return evaluate


# ------------------------------------------------------------------------------------------- the split's seeds
def test_the_fresh_range_is_disjoint_from_every_earlier_one_and_from_training_and_validation():
    F.check_disjoint(F.FRESH2_FIRST, F.N_TEST, F.earlier_ranges())
    with pytest.raises(ValueError, match=r"meets the earlier test_seed\(10000\.\.10007\)"):
        F.check_disjoint(FRESH_FIRST + 7, 2, F.earlier_ranges())
    with pytest.raises(ValueError, match=r"test_seed\(0\.\.9999\)"):
        F.check_disjoint(63, 1, F.earlier_ranges())
    seeds = F.test_seeds(T, F.N_TEST)
    assert seeds[0] == T.test_seed(F.FRESH2_FIRST) and len(set(seeds)) == F.N_TEST
    assert all(T.TEST_SEED_BASE <= s < T.VALID_SEED_BASE for s in seeds)  # neither training nor validation
    assert max(T.train_seed(i) for i in (0, 10**6, 2 * 10**9)) < T.TEST_SEED_BASE
    for task in ("kvtrace", "lookahead"):  # the controls' validation and DMS calibration sequences
        split = json.loads((RESULTS_DIR / "evidence" / task / "controls.json").read_text())["split"]
        assert not set(seeds) & {*split["fit"], *split["select"], *split["dms_threshold_on"]}


def test_every_test_range_the_shipped_results_name_is_an_earlier_one_or_this_split():
    """The shipped documents and records name the test seeds they were scored on: each range lies inside one of
    ``earlier_ranges`` (so that list is complete) or is this split's own."""
    ours = (F.FRESH2_FIRST, F.FRESH2_FIRST + F.N_TEST - 1)
    found = set()
    for base in (RESULTS_DIR, DATA, ROOT / "docs"):
        for f in base.rglob("*"):
            if f.suffix in (".md", ".json", ".jsonl") and f.is_file():
                found |= {(int(a), int(b)) for a, b in re.findall(r"test_seed\((\d+)\.\.(\d+)\)", f.read_text())}
    assert (0, 5) in found and (FRESH_FIRST, FRESH_FIRST + 7) in found
    from studies import controls_adaptive as CA  # a later split, above this one (it checks itself against it)

    later = (CA.FIRST, CA.FIRST + CA.N_TEST - 1)
    for lo, hi in found - {ours}:
        assert any(a <= lo and hi <= b for a, b in [*F.earlier_ranges(), later]), (lo, hi)
        F.check_disjoint(*ours[:1], F.N_TEST, [(lo, hi)])


# ------------------------------------------------------------------------------------------------- the log
def test_run_table_takes_the_controls_runs_and_refuses_a_missing_row():
    t = F.run_table(_controls())
    assert list(t) == list(ROWS) and t[F.DENSE] == {"0": {"dir": None, "policy": "dense"}}
    assert t[F.DMS_ROW]["2"]["threshold"] == 0.5 and "per_sequence" not in t[KV]["0"]
    c = _controls()
    del c["runs"][F.ORACLE]
    with pytest.raises(ValueError, match=r"no runs of oracle\[label\]"):
        F.run_table(c)


def test_each_row_and_seed_is_scored_once_ever(tmp_path, capsys):
    table = F.run_table(_controls())
    calls: list = []
    keys = [(r, s) for r, ss in table.items() for s in ss]

    def flaky(row, seed, run):  # an interruption half way
        if row == F.ORACLE:
            raise RuntimeError("interrupted")
        return _evaluate(calls, 4)(row, seed, run)

    with pytest.raises(RuntimeError):
        F.score_all(tmp_path, table, flaky, n=4)
    first = list(calls)
    assert first == keys[:len(first)] and first and (F.ORACLE, "0") not in first
    tl = F.score_all(tmp_path, table, _evaluate(calls, 4), n=4)  # resumed: the rest only
    assert sorted(calls) == sorted(keys) and len(calls) == len(keys)
    tl = F.score_all(tmp_path, table, _evaluate(calls, 4), n=4)  # again: nothing scored
    assert len(calls) == len(keys) and len(tl.path.read_text().splitlines()) == len(keys)
    assert ledger.TestLog(tmp_path).entries[f"{KV}|seed1"]["result"]["per_sequence"] == [_value(KV, "1", i)
                                                                                          for i in range(4)]
    with pytest.raises(ValueError, match="3 values for 4 sequences"):
        F.score_all(tmp_path / "other", table, lambda r, s, run: [1.0] * 3, n=4)
    capsys.readouterr()


def test_the_record_refuses_a_partial_log_and_another_split(tmp_path):
    c = _controls()
    table = F.run_table(c)
    calls: list = []
    tl = F.score_all(tmp_path, {KV: table[KV]}, _evaluate(calls, 4), n=4)
    with pytest.raises(ValueError, match=r"not scored yet: fixed-finetune\[streaming\]\|seed0"):
        F.record("kvtrace", c, tl, table, n=4)
    tl = F.score_all(tmp_path, table, _evaluate(calls, 4), n=4)
    with pytest.raises(ValueError, match="not on this split"):
        F.record("kvtrace", c, tl, table, n=4, first=F.FRESH2_FIRST + 1)


# ------------------------------------------------------------------------------- the record and the ledger
def test_record_figures_comparisons_and_ledger_rows_match_a_recomputation(tmp_path, monkeypatch):
    c, n = _controls(), 12
    table = F.run_table(c)
    tl = F.score_all(tmp_path, table, _evaluate([], n), n=n)
    rec = F.record("kvtrace", c, tl, table, n=n, n_boot=400)
    assert rec["split"] == F.SPLIT and rec["test_sequences"] == f"test_seed({F.FRESH2_FIRST}..{F.FRESH2_FIRST + 11})"
    figs = {f["row"]: f for f in rec["figures"]}
    assert figs[KV]["per_seed"]["2"] == pytest.approx(sum(_value(KV, "2", i) for i in range(n)) / n)
    pairs = [(x["a"], x["b"]) for x in rec["comparisons"]]
    assert pairs == [(KV, r) for r in ROWS if r not in (KV, F.DENSE)] + [(F.ORACLE, "fixed-finetune[streaming]")]
    for x in rec["comparisons"]:
        va = [[_value(x["a"], s, i) for i in range(n)] for s in sorted(table[x["a"]])]
        vb = [[_value(x["b"], s, i) for i in range(n)] for s in sorted(table[x["b"]])]
        r = paired_interval(va, vb, n_boot=400, seed=0)
        assert (x["mean_diff"], x["ci95"]) == (pytest.approx(r.mean_diff), [pytest.approx(v) for v in r.ci95])
        assert x["seeds"] == {"a": len(va), "b": len(vb)} and x["split"] == F.SPLIT and x["n_clusters"] == n
    kv_vs_ctl = next(x for x in rec["comparisons"] if x["b"] == "fixed-finetune[streaming]")
    assert kv_vs_ctl["verdict"] == "a better" and kv_vs_ctl["ci95"][0] > 0
    sel = {"kvpop": {KV: {"trials": 18}}, "dms": {"trials": [{}] * 19}}
    led = F.ledger_rows(rec, c, sel)
    assert ledger.check_ledger(led, "fresh") == led["rows"] and len(led["rows"]) == len(ROWS)
    assert len(ledger.check_comparisons(led, "fresh")) == len(rec["comparisons"])
    by = {r["policy"]: r for r in led["rows"]}
    assert (by[KV]["trials"], by[F.DMS_ROW]["trials"], by["fixed-finetune[keynorm]"]["trials"]) == (18, 19, 3)
    assert (by[F.UNTRAINED]["trials"], by[F.UNTRAINED]["steps"], by[KV]["steps"]) == (0, None, 100)
    assert by[F.ORACLE]["not_causal"] and not by[KV]["headline"] and by[KV]["length"] == 2048
    assert by[F.DMS_ROW]["recipe"]["threshold"] == {"0": -1.5, "1": -0.5, "2": 0.5}
    assert by[KV]["mean"] == pytest.approx(figs[KV]["mean"]) and by[KV]["dense"] == 1.0
    md = F.markdown(rec)
    assert "| oracle[label] (not causal) | 3 |" in md and f"| {KV} | fixed-finetune[streaming] | +0." in md
    # into the shipped archive's rows: the earlier split's kept, this split's replaced on a second write
    arch = tmp_path / "results" / "evidence" / "kvtrace"
    arch.mkdir(parents=True)
    old = {**by[KV], "split": None, "per_sequence": None}
    old = {k: v for k, v in old.items() if v is not None}
    (arch / "evidence_rows.json").write_text(json.dumps({"rows": [old], "seeds": [0, 1, 2]}))
    (arch / "selection.json").write_text("{}")
    monkeypatch.setattr(ledger, "EVIDENCE_FILE", tmp_path / "results" / "evidence.json")
    for _ in range(2):
        ledger.write_split_rows(tmp_path / "L", "kvtrace", F.SPLIT, led)
    built = ledger.build_ledger(tmp_path / "L")
    assert built["rows"] == [old, *led["rows"]] and built["comparisons"] == led["comparisons"]
    assert (tmp_path / "L" / "kvtrace" / "selection.json").read_text() == "{}"
    with pytest.raises(ValueError, match="not of kvtrace's split 'other'"):
        ledger.write_split_rows(tmp_path / "L", "kvtrace", "other", led)
    # merge: one more row of the split joins the rows already written (twice: replaced, never repeated)
    extra = {**by[KV], "policy": "kvpop-mlp-joint[paper-exact]"}
    more = {"rows": [extra], "comparisons": [{**led["comparisons"][0], "a": extra["policy"]}]}
    for _ in range(2):
        ledger.write_split_rows(tmp_path / "L", "kvtrace", F.SPLIT, more, merge=True)
    built = ledger.build_ledger(tmp_path / "L")
    assert built["rows"] == [old, *led["rows"], extra]
    assert built["comparisons"] == [*led["comparisons"], *more["comparisons"]]


def test_main_refuses_few_sequences_and_an_unscored_record(tmp_path, capsys):
    assert F.main(["--task", "kvtrace", "--out", str(tmp_path / "o"), "--n-test", "1"]) == 2
    assert "--n-test must be >= 2" in capsys.readouterr().err
    assert F.main(["--task", "kvtrace", "--out", str(tmp_path / "o"), "--record-only"]) == 2
    assert "not scored yet: kvpop-mlp-joint[paper]|seed0" in capsys.readouterr().err
    assert not (tmp_path / "o" / "test_log.jsonl").exists() and not (tmp_path / "o" / "fresh_test.json").exists()


# ----------------------------------------------------------------------------------------- the shipped records
@pytest.mark.parametrize("task", ["kvtrace", "lookahead"])
def test_the_shipped_record_was_scored_once_and_its_intervals_and_ledger_rows_follow(task):
    d = RESULTS_DIR / "evidence" / task
    rec = json.loads((d / "fresh_test.json").read_text())
    log = [json.loads(x) for x in (d / "fresh_test_log.jsonl").read_text().splitlines() if x.strip()]
    keys = [e["key"] for e in log]
    name = rec["kvpop_row"]["name"]
    assert len(keys) == len(set(keys)) == sum(len(s) for s in rec["runs"].values()) and set(rec["runs"]) == set(
        F.rows_of(name))
    assert all((e["result"]["first"], e["result"]["n"]) == (F.FRESH2_FIRST, F.N_TEST) for e in log)
    for x in rec["comparisons"]:
        runs_a, runs_b = rec["runs"][x["a"]], rec["runs"][x["b"]]
        va = [runs_a[s]["per_sequence"] for s in sorted(runs_a, key=int)]
        vb = [runs_b[s]["per_sequence"] for s in sorted(runs_b, key=int)]
        r = paired_interval(va, vb, n_boot=x["n_boot"], seed=x["seed"])
        assert x["mean_diff"] == pytest.approx(r.mean_diff, abs=1e-12) and x["ci95"] == list(r.ci95)
        assert x["n_sequences"] == F.N_TEST
    # the split's rows in the ledger: this record's, and the paper's exact method scored once on the same split
    exact = next(t for t in json.loads((d / "paper_exact.json").read_text())["tests"] if t["split"] == F.SPLIT)
    every = {**rec["runs"], **exact["runs"]}
    rows = [r for r in json.loads((RESULTS_DIR / "evidence.json").read_text())["rows"]
            if r["instrument"] == task and r.get("split") == F.SPLIT]
    assert {r["policy"] for r in rows} == set(every)
    for r in rows:
        runs = every[r["policy"]]
        assert r["per_sequence"] == [runs[s]["per_sequence"] for s in sorted(runs, key=int)]
    led = json.loads((RESULTS_DIR / "evidence.json").read_text())
    comps = [c for c in ledger.check_comparisons(led, "evidence.json") if c["instrument"] == task
             and c["split"] == F.SPLIT]
    assert [(c["a"], c["b"], c["verdict"]) for c in comps] == [(x["a"], x["b"], x["verdict"])
                                                              for x in rec["comparisons"] + exact["comparisons"]]
