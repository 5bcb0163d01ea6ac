"""studies.equal_bytes_trained: the rows and their names, each comparison wired to its two rows (synthetic
per-sequence values with a known offset per row), the byte check, the record and its tables, and the refusals
(studies/results without --write-shipped, an untrained seed, a split sharing a record with the train split).
No model is trained or loaded."""
import json

import pytest

from studies import equal_bytes_trained as T
from studies import ledger
from studies.paths import RESULTS_DIR

OFFSET = {T.INT8: 0.010, T.BF16_128: 0.011, T.BF16_75_SERVED: 0.050, T.BF16_75_TRAINED: 0.020}
SEEDS = ("0", "1", "2")
N = 12
CLUSTERS = [i // 2 for i in range(N)]  # 6 source files, 2 sequences each


def synthetic_runs(offset=OFFSET, seeds=SEEDS, bytes_=None):
    """Each row's per-sequence values: its offset, a per-sequence level shared by every row, a small per-seed
    wobble (so the seeds have a spread)."""
    bytes_ = bytes_ or {T.INT8: 81824.0, T.BF16_128: 139168.0, T.BF16_75_SERVED: 81504.0,
                        T.BF16_75_TRAINED: 81504.0}
    runs = {}
    for r in T.rows():
        for s in seeds:
            per = [offset[r["row"]] + 0.001 * (i % 5) + 0.0003 * int(s) * ((i + len(r["row"])) % 3 - 1)
                   for i in range(N)]
            runs.setdefault(r["row"], {})[s] = {**r, "seed": s, "per_sequence": per,
                                                "bytes_per_sequence": bytes_[r["row"]], "decode_seconds": 1.0,
                                                "n": N}
    return runs


def test_rows_name_the_trained_budget_and_the_runs_they_serve():
    rs = T.rows()
    assert [r["row"] for r in rs] == ["int8@B=128,w=32", "bf16@B=128,w=32", "bf16@B=75,w=32",
                                      "bf16@B=75,w=32[trained at 75]"]
    assert [(r["dtype"], r["budget"], r["trained_at"]) for r in rs] == [
        ("int8", 128, 128), ("bf16", 128, 128), ("bf16", 75, 128), ("bf16", 75, 75)]
    assert all(r["window"] == 32 for r in rs)
    assert T.run_dir("/o", 75, "1").as_posix() == "/o/runs/B75/seed1"
    assert [(a, b) for a, b, _ in T.COMPARISONS] == [
        (T.INT8, T.BF16_75_TRAINED), (T.INT8, T.BF16_75_SERVED), (T.BF16_75_TRAINED, T.BF16_75_SERVED),
        (T.INT8, T.BF16_128)]


def test_each_comparison_is_a_minus_b_of_its_own_rows():
    comps = T.compare(synthetic_runs(), CLUSTERS, n_boot=400)
    assert len(comps) == 4
    for c, (a, b, what) in zip(comps, T.COMPARISONS):
        assert (c["a"], c["b"], c["at"]) == (a, b, what)
        assert c["mean_diff"] == pytest.approx(OFFSET[a] - OFFSET[b], abs=1e-3)
        assert c["seeds"] == list(SEEDS) and c["seeds_a"] == c["seeds_b"] == 3
        assert c["n_clusters"] == 6
        assert c["seed_t"]["n_seeds"] == 3
        assert c["seed_t"]["mean_diff"] == pytest.approx(c["mean_diff"], abs=1e-12)
        assert c["lower_is_better"] is True
    headline, old, buys, slots = comps
    assert headline["verdict"] == old["verdict"] == buys["verdict"] == "a better"  # lower NLL increase
    assert headline["ci95"][1] < 0 and buys["ci95"][1] < 0
    assert headline["seed_t"]["verdict"] == "a better"
    assert slots["mean_diff"] == pytest.approx(-0.001, abs=1e-3)
    # the trained-at-75 row worse than int8 by construction: the headline turns around, b better
    worse = {**OFFSET, T.BF16_75_TRAINED: 0.001}
    h = T.compare(synthetic_runs(worse), CLUSTERS, n_boot=400)[0]
    assert h["mean_diff"] > 0 and h["verdict"] == "b better"


def test_two_seeds_compare_and_unpaired_seeds_are_refused():
    comps = T.compare(synthetic_runs(seeds=("0", "1")), CLUSTERS, n_boot=200)
    assert all(c["seeds"] == ["0", "1"] and c["seed_t"]["n_seeds"] == 2 for c in comps)
    runs = synthetic_runs()
    del runs[T.BF16_75_TRAINED]["2"]
    with pytest.raises(ValueError, match="pairs them"):
        T.compare(runs, CLUSTERS, n_boot=50)


def test_the_16_bit_rows_at_75_must_hold_no_more_bytes_than_int8():
    assert T.check_bytes(synthetic_runs())[T.BF16_75_TRAINED] == 81504.0
    more = {T.INT8: 81824.0, T.BF16_128: 139168.0, T.BF16_75_SERVED: 81504.0, T.BF16_75_TRAINED: 82592.0}
    with pytest.raises(ValueError, match="not equal bytes"):
        T.check_bytes(synthetic_runs(bytes_=more))
    runs = synthetic_runs()
    runs[T.INT8]["1"]["bytes_per_sequence"] = 1.0
    with pytest.raises(ValueError, match="different bytes"):
        T.check_bytes(runs)


class FakeSplit:
    def __init__(self, path):
        self.path, self.n, self.clusters = path, N, CLUSTERS
        self.dense = [0.5] * N


def test_the_record_and_its_tables_come_from_the_test_log(tmp_path):
    runs = synthetic_runs()
    tl = ledger.TestLog(tmp_path / "test")
    for r in T.rows():
        for s in SEEDS:
            tl.once(f"{r['row']}|seed{s}", lambda r=r, s=s: runs[r["row"]][s])
    calls = []
    tl.once(f"{T.INT8}|seed0", lambda: calls.append(1))  # logged once: never scored again
    assert calls == []
    for b in T.BUDGETS:
        for s in SEEDS:
            d = T.run_dir(tmp_path, b, s)
            d.mkdir(parents=True)
            (d / "train.json").write_text(json.dumps({"best_step": 189, "seconds": 1.0, "validations": [
                {"step": 63, "fit_score": 0.02}, {"step": 250, "fit_score": 0.01}]}))
    rec = T.build_record(tmp_path, FakeSplit(tmp_path / "t.jsonl"), tl, SEEDS, manifest={"m": 1},
                         overlap={"train": {"records_shared": 0}}, commands=["c"], n_boot=200)
    assert rec["test"]["missing"] == [] and len(rec["test"]["comparisons"]) == 4
    assert rec["bytes_per_sequence"][T.BF16_75_TRAINED] <= rec["bytes_per_sequence"][T.INT8]
    assert set(rec["training"]) == {"75", "128"} and rec["split"]["n_clusters"] == 6
    fig = {f["row"]: f for f in rec["test"]["figures"]}
    assert fig[T.BF16_75_TRAINED]["trained_at"] == 75
    assert fig[T.BF16_75_TRAINED]["mean"] == pytest.approx(OFFSET[T.BF16_75_TRAINED] + 0.001 * 20 / 12, abs=1e-3)
    md = T.markdown(json.loads(json.dumps(rec)))
    assert "bf16@B=75,w=32[trained at 75] | 75 | 81,504 | 0.9961" in md
    assert md.count("| int8@B=128,w=32 | bf16@B=75,w=32") == 2
    # a seed missing from the log: listed, no interval drawn
    rec2 = T.build_record(tmp_path, FakeSplit(tmp_path / "t.jsonl"), tl, ("0", "1", "2", "1x"), manifest=None,
                          overlap={}, commands=[], n_boot=50)
    assert rec2["test"]["comparisons"] == [] and f"{T.INT8}|seed1x" in rec2["test"]["missing"]


def test_refusals(tmp_path, capsys):
    shipped = RESULTS_DIR / "evidence" / "realtext"
    with pytest.raises(SystemExit) as e:
        T.main(["test", "--out", str(tmp_path), "--split", str(tmp_path / "s.jsonl"), "--record", str(shipped)])
    assert e.value.code == 2 and "--write-shipped" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        T.main(["train", "--out", str(shipped / "x"), "--budget", "75", "--seed", "0"])
    assert T.main(["train", "--out", str(tmp_path), "--budget", "64", "--seed", "0"]) == 2
    assert "allowed budgets" in capsys.readouterr().err
    # an untrained seed, then a split that shares a record with the train split
    split = tmp_path / "s.jsonl"
    split.write_text(json.dumps({"input_ids": [256] + [1] * 1023}) + "\n")
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"input_ids": [256] + [1] * 1023}) + "\n")
    valid = tmp_path / "valid.jsonl"
    valid.write_text(json.dumps({"input_ids": [256] + [2] * 1023}) + "\n")
    args = ["test", "--out", str(tmp_path), "--split", str(split), "--record", str(tmp_path / "rec"),
            "--seeds", "0", "--data", str(train), "--valid-data", str(valid), "--n", "1"]
    assert T.main(args) == 2
    assert "not trained" in capsys.readouterr().err
    for b in T.BUDGETS:
        T.run_dir(tmp_path, b, "0").mkdir(parents=True)
        (T.run_dir(tmp_path, b, "0") / "train.json").write_text("{}")
    assert T.main(args) == 2
    assert "in the train split" in capsys.readouterr().err
    assert not (tmp_path / "rec").exists()


def test_a_missing_train_split_is_named_with_how_to_build_it(tmp_path, capsys):
    """The default --data / --valid-data are the files the study used on its machine: elsewhere a missing one
    is refused before any work, naming the flag and the command that builds the split."""
    rc = T.main(["train", "--out", str(tmp_path / "o"), "--budget", "75", "--seed", "0",
                 "--data", str(tmp_path / "none.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "--data" in err and "none.jsonl" in err and "studies.realtext_corpus" in err
    assert not (tmp_path / "o" / "runs").exists()
