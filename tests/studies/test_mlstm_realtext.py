"""studies.mlstm_realtext: the mLSTM scorer beside the MLP scorer and the recency fine-tune on real text.

The runs themselves take minutes each (studies/results/evidence/realtext/mlstm.md); here: the rows differ only
in their priority, the record's figures and intervals are those of the per-sequence values it reads, a test
split's values come from the test log only, and what is not scored yet is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from studies import ledger
from studies import mlstm_realtext as M
from studies.controls_realtext import EVAL_BUDGETS, VALID_SEQUENCES
from studies.paired import paired_interval


def test_rows_differ_only_in_their_priority(tmp_path):
    cmds = {r: M.train_command(Path("m"), tmp_path, r, 1, tmp_path / "o") for r in M.ROWS}
    without = {r: [x for x in c if x not in M.ROWS[r][1]] for r, c in cmds.items()}
    assert len({tuple(v) for v in without.values()}) == 1  # the same command once each row's priority is out
    for c in cmds.values():
        assert c[c.index("--seed") + 1] == "1" and c[c.index("--lm-weight") + 1] == "0.1" and "--resume" not in c
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "last.pt").write_bytes(b"")
    assert M.train_command(Path("m"), tmp_path, "kvpop-mlp-joint[lm 0.1]", 0, tmp_path / "o")[-1] == "--resume"
    ev = M.eval_command(Path("m"), tmp_path / "o", "kvpop-mlstm-joint[lm 0.1]", Path("d.jsonl"), 48, tmp_path / "e")
    assert ev[ev.index("--policies") + 1] == "dense,kvpop-mlstm-joint" and ev[ev.index("--n-sequences") + 1] == "48"


def _fake_results(path: Path, policy: str, per_budget: dict[int, list[float]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"policy": policy, "budget": b, "per_sequence": v} for b, v in per_budget.items()]
    (path / "results.json").write_text(json.dumps({"rows": rows}))


def _history(d: Path, steps: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "scorers.safetensors").write_bytes(b"")
    (d / "history.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))


def test_record_figures_and_intervals_are_the_values_read(tmp_path):
    rng = np.random.default_rng(0)
    vals = {}
    for k, (row, (d, _, pol)) in enumerate(M.ROWS.items()):
        vals[row] = {}
        for s in M.SEEDS:
            v = {b: (rng.normal(0.01 * k, 0.005, VALID_SEQUENCES)).tolist() for b in EVAL_BUDGETS}
            vals[row][s] = v
            _fake_results(tmp_path / "valid" / d / f"seed{s}", pol, v)
    rec = M.record(tmp_path, splits=["validation"], n_boot=500)
    sp = rec["splits"]["validation"]
    assert not sp["test"] and sp["sequences"] == VALID_SEQUENCES
    f = next(x for x in sp["figures"] if x["row"] == "kvpop-mlp-joint[lm 0.1]" and x["budget"] == 128)
    assert f["mean"] == pytest.approx(np.mean([np.mean(vals["kvpop-mlp-joint[lm 0.1]"][s][128]) for s in M.SEEDS]))
    assert len(sp["comparisons"]) == 3 * len(EVAL_BUDGETS)
    c = next(x for x in sp["comparisons"] if x["budget"] == 64 and x["a"].startswith("kvpop-mlstm")
             and x["b"].startswith("fixed"))
    from studies.controls_realtext import clusters_of

    ref = paired_interval([vals["kvpop-mlstm-joint[lm 0.1]"][s][64] for s in M.SEEDS],
                          [vals["fixed-finetune[streaming,lm 0.1]"][s][64] for s in M.SEEDS],
                          clusters=clusters_of(M.VALID, VALID_SEQUENCES), n_boot=500)
    assert c["mean_diff"] == pytest.approx(ref.mean_diff) and c["ci95"] == pytest.approx(list(ref.ci95))
    # the streaming row is 0.02 above the mLSTM's by construction: the interval says so
    assert c["verdict"] == "a better"
    md = M.markdown(rec)
    assert "| kvpop-mlstm-joint[lm 0.1] |" in md and md.count("| 128 |") == 3


def test_a_missing_seed_or_an_untrained_run_is_refused(tmp_path):
    for row, (d, _, pol) in M.ROWS.items():
        for s in (0, 1):
            _fake_results(tmp_path / "valid" / d / f"seed{s}", pol, {b: [0.0] * VALID_SEQUENCES for b in EVAL_BUDGETS})
    with pytest.raises(ValueError, match="not every \\(row, seed\\) is scored"):
        M.record(tmp_path, splits=["validation"])
    for row in M.ROWS:
        for s in M.SEEDS:
            _history(M.run_dir(tmp_path, row, s), M.STEPS if (row, s) != ("kvpop-mlp-joint[lm 0.1]", 2) else 3)
    assert not M.trained(M.run_dir(tmp_path, "kvpop-mlp-joint[lm 0.1]", 2))
    with pytest.raises(ValueError, match="not trained yet: kvpop-mlp-joint\\[lm 0.1\\] seed 2"):
        M.test_stage(tmp_path, tmp_path, tmp_path / "t.jsonl")


def test_a_test_split_is_read_from_the_test_log_only(tmp_path):
    log = ledger.TestLog(tmp_path)
    for k, row in enumerate(M.ROWS):
        for s in M.SEEDS:
            log.once(f"test_fresh3|{row}|{s}", lambda k=k: {str(b): [0.001 * k] * M.TEST_RECORDS for b in EVAL_BUDGETS})
    got = M.split_values(tmp_path, "test_fresh3")
    assert got["kvpop-mlp-joint[lm 0.1]"][2][128] == [0.001] * M.TEST_RECORDS
    # scored once: asking again returns the logged values without scoring
    assert ledger.TestLog(tmp_path).once("test_fresh3|kvpop-mlp-joint[lm 0.1]|2", lambda: 1 / 0)[str(64)][0] == 0.001
    rec = M.record(tmp_path, splits=["test_fresh3"], n_boot=200)
    assert rec["splits"]["test_fresh3"]["test"] and rec["splits"]["test_fresh3"]["sequences"] == M.TEST_RECORDS
    assert M.split_values(tmp_path, "test_fresh9") == {r: {} for r in M.ROWS}


def test_the_test_stage_scores_each_row_and_seed_once(tmp_path, monkeypatch):
    for row in M.ROWS:
        for s in M.SEEDS:
            _history(M.run_dir(tmp_path, row, s), M.STEPS)
    calls = []

    def fake_run(cmd, log, *, name):
        calls.append(name)
        out, pol = Path(cmd[cmd.index("--out") + 1]), cmd[cmd.index("--policies") + 1].split(",")[1]
        _fake_results(out, pol, {b: [float(len(calls))] * M.TEST_RECORDS for b in EVAL_BUDGETS})
        return 0.0

    monkeypatch.setattr(M, "run_logged", fake_run)
    split = tmp_path / "test_freshX.jsonl"
    M.test_stage(tmp_path, tmp_path, split)
    assert len(calls) == len(M.ROWS) * len(M.SEEDS)
    first = M.split_values(tmp_path, "test_freshX")
    M.test_stage(tmp_path, tmp_path, split)  # again: nothing is scored a second time
    assert len(calls) == len(M.ROWS) * len(M.SEEDS) and M.split_values(tmp_path, "test_freshX") == first
    lines = (tmp_path / "test_log.jsonl").read_text().splitlines()
    assert len(lines) == len(calls) and len({json.loads(x)["key"] for x in lines}) == len(calls)


def test_fourth_fresh_split_excludes_every_earlier_split():
    """test_fresh4 (the study's test split): no file of the shipped validation / test splits nor of the three
    earlier fresh splits, every file of the test bucket, the hashes its record names; remade from the record
    where the installed packages are the versions it was drawn from."""
    import hashlib
    from importlib import metadata

    from studies import evidence_realtext as RT
    from studies import realtext_corpus as C

    rec = json.loads((RT.SHIPPED / "test_fresh4.json").read_text())
    man = json.loads((RT.SHIPPED / "manifest.json").read_text())
    new = set(rec["files"])
    earlier = {n: set(json.loads((RT.SHIPPED / n).read_text())["files"])
               for n in ("test_fresh.json", "test_fresh2.json", "test_fresh3.json")}
    assert not new & (set(man["splits"]["test"]["files"]) | set(man["splits"]["validation"]["files"]))
    assert all(not new & f for f in earlier.values()) and set(rec["excluded_earlier_fresh_files"]) == set(earlier)
    st = man["settings"]
    assert all(C.split_of(k, st["seed"], st["valid_frac"], st["test_frac"]) == "test" for k in new)
    assert rec["files_used_hash"] == hashlib.blake2b("\n".join(sorted(new)).encode(), digest_size=16).hexdigest()
    assert C.file_hash(RT.SHIPPED / "test_fresh4.jsonl") == rec["jsonl_blake2b"]
    assert rec["corpus_train_blake2b"] == man["splits"]["train"]["jsonl_blake2b"]
    assert rec["package_versions"] == man["package_versions"]  # drawn from the corpus's own package versions
    lines = (RT.SHIPPED / "test_fresh4.jsonl").read_text().splitlines()
    assert len(lines) == rec["records"] == M.TEST_RECORDS and all(len(json.loads(x)["input_ids"]) == 1024
                                                                  for x in lines)
    if any(metadata.version(C.DISTRIBUTIONS.get(p, p)) != rec["package_versions"][C.DISTRIBUTIONS.get(p, p)]
           for p in st["packages"]):
        pytest.skip("other package versions are installed than the split was drawn from: its files differ")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        RT.fresh_test_split(Path(d), Path(d), n_records=M.TEST_RECORDS, hash_seed=rec["hash_seed"], name="test_fresh4",
                            exclude=tuple(RT.SHIPPED / n for n in sorted(earlier)))
        assert C.file_hash(Path(d) / "test_fresh4.jsonl") == rec["jsonl_blake2b"]
