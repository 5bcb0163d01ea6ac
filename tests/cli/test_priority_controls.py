"""``kvpop train --priority-source`` then ``kvpop eval --run``: the same-structure controls (docs/DESIGN.md
section 12) train the model with no L_score, record their source, and are served with it."""
import json

import pytest
import torch
from safetensors.torch import load_file

from kvpop.cli import main
from kvpop.core.checkpoint import read_scorer_config
from kvpop.demo import task as T
from kvpop.evaluation import evaluate as E
from studies.paired import paired_interval

TRAIN = ["--seq-len", "64", "--sinks", "2", "--window", "8", "--budget", "24", "--no-progress"]
SOURCES = ("random", "keynorm+", "keynorm-", "window-attention", "oracle-label")


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.set_num_threads(1)


def _write(path, n, length, seed):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"input_ids": T.make_example(seed(i), length)["input_ids"].tolist()}) + "\n")
    return path


def test_each_control_trains_and_is_served_with_its_priority(tmp_path):
    data = _write(tmp_path / "train.jsonl", 2, 64, T.train_seed)
    traces = _write(tmp_path / "test.jsonl", 2, 64, T.test_seed)
    per_seq = {}
    for src in SOURCES:
        run = tmp_path / src
        assert main(["train", "--data", str(data), *TRAIN, "--steps", "2", "--priority-source", src,
                     "--out", str(run)]) == 0
        assert read_scorer_config(run / "scorers.safetensors").priority_source == src
        hist = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
        assert all(h["score"] == 0.0 for h in hist), src  # no L_score
        assert (run / "model" / "config.json").is_file()  # the model was fine-tuned
        out = tmp_path / f"eval-{src}"
        assert main(["eval", "--model", str(E.SHIPPED_MODEL), "--no-progress", "--no-plot", "--data", str(traces),
                     "--budgets", "24", "--policies", "kvpop-mlp-joint", "--run", str(run), "--out", str(out)]) == 0
        res = json.loads((out / "results.json").read_text())
        assert res["trained"]["kvpop-mlp-joint"]["priority_source"] == src
        assert "priority " + src in (out / "table.md").read_text()
        (row,) = res["rows"]
        per_seq[src] = row["per_sequence"]
        assert len(per_seq[src]) == 2 and sum(per_seq[src]) / 2 == pytest.approx(row["delta_nll"])
    # the synthetic task serves the oracle too (a teacher-forced prefill), with per-sequence accuracies
    out = tmp_path / "task-oracle"
    assert main(["eval", "--model", str(E.SHIPPED_MODEL), "--no-progress", "--no-plot", "--run",
                 str(tmp_path / "oracle-label"), "--policies", "kvpop-mlp-joint", "--train-len", "64", "--lengths",
                 "64", "--budgets", "24", "--n-sequences", "2", "--out", str(out)]) == 0
    (row,) = [r for r in json.loads((out / "results.json").read_text())["rows"] if r["policy"] == "kvpop-mlp-joint"]
    assert len(row["per_sequence_accuracy"]) == 2
    # the per-sequence values pair: the oracle against a causal control
    r = paired_interval(per_seq["oracle-label"], per_seq["keynorm+"], n_boot=200)
    assert r.ci95[0] <= r.mean_diff <= r.ci95[1]
    # the random scorer is its seeded init, never updated: one step or two, the same weights
    one = tmp_path / "random-1"
    assert main(["train", "--data", str(data), *TRAIN, "--steps", "1", "--priority-source", "random",
                 "--out", str(one)]) == 0
    a, b = load_file(str(one / "scorers.safetensors")), load_file(str(tmp_path / "random" / "scorers.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_options_that_contradict_a_control_are_refused(tmp_path):
    data = _write(tmp_path / "train.jsonl", 1, 64, T.train_seed)
    valid = _write(tmp_path / "valid.jsonl", 1, 64, T.valid_seed)
    for src, extra, msg in (("keynorm+", ["--no-train-model"], "nothing would be trained"),
                            ("random", ["--mask-source", "streaming"], "leave --mask-source out"),
                            ("window-attention", ["--head-budgets", "24,24"], "uniform budgets only"),
                            ("oracle-label", ["--auto", "--valid-data", str(valid)], "leave --auto out")):
        with pytest.raises(SystemExit) as e:
            main(["train", "--data", str(data), *TRAIN, "--steps", "1", "--priority-source", src, *extra,
                  "--out", str(tmp_path / "x")])
        assert msg in str(e.value.code)
    assert not (tmp_path / "x").exists()
