"""The dms policy in the harness: mean-budget calibration, the row's per-head spread, ``kvpop eval --dms``."""
import copy
import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvpop.baselines import dms as D
from kvpop.baselines.dms import budget as DE
from kvpop.cli import main
from kvpop.demo import task as T
from kvpop.evaluation import evaluate as E

L = 128


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 'DMS run' as kvpop train --method dms writes it: random gates + a model directory."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=T.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=True, attention_dropout=0.0)
    base = Qwen3ForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("dms")
    base.save_pretrained(str(d / "model"))
    m = copy.deepcopy(base)
    D.patch_dms(m, sinks=2, window=4)
    with torch.no_grad():
        for la in D.dms_layers(m):
            la.gate.weight.normal_(0, 1.0)
            la.gate.bias.zero_()
    D.save_dms(m, d / DE.GATES)
    return d


def test_dms_runs_at_the_mean_budget(run_dir):
    base = E.load_base_model(run_dir / "model")
    model = E.policy_model(base, "dms", scorers=run_dir / DE.GATES, finetuned=base, sinks=2, window=4)
    ex = T.make_example(T.test_seed(0), L)
    for budget in (12, 24, 60):
        pred = E.sequence_predictions(model, ex, "dms", budget)
        assert pred.shape == ex["answers"].reshape(-1).shape
        st = DE.row_stats(model)
        assert st["dms_entries_mean"] <= budget
        assert st["dms_entries_min"] >= 6 and st["dms_entries_max"] <= L
    assert DE.row_stats(model) == {}
    with pytest.raises(ValueError, match="window=4"):
        E.policy_model(base, "dms", scorers=run_dir / DE.GATES, finetuned=base, sinks=2, window=8)
    with pytest.raises(ValueError, match="budget"):
        E.sequence_predictions(model, ex, "dms")


def test_calibration_is_the_largest_threshold_under_the_budget(run_dir):
    base = E.load_base_model(run_dir / "model")
    model = E.policy_model(base, "dms", scorers=run_dir / DE.GATES, finetuned=base, sinks=2, window=4)
    ids = T.make_example(T.test_seed(1), L)["input_ids"][None]
    with torch.no_grad():
        for budget in (9, 30):
            thr = DE.calibrate_threshold(model, ids, budget)
            logits, fixed, heads = DE._kept_logits(model, ids, thr)
            assert fixed + int((logits <= thr).sum()) / heads <= budget
            # under these logits the next larger gate value would take the mean over the budget
            above = logits[logits > thr]
            assert above.numel() and fixed + int((logits <= above.min()).sum()) / heads > budget


def test_kvpop_eval_with_a_dms_run(run_dir, tmp_path):
    rc = main(["eval", "--model", str(run_dir / "model"), "--dms", str(run_dir), "--policies", "dense,streaming,dms",
               "--train-len", str(L), "--lengths", str(L), "--budgets", "12,24", "--n-sequences", "1", "--sinks",
               "2", "--window", "4", "--no-progress", "--no-plot", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    dms = [r for r in rows if r["policy"] == "dms"]
    assert [r["budget"] for r in dms] == [12, 24]
    assert all(r["dms_threshold_from"] == "validation" and r["dms_valid_entries_mean"] <= r["budget"]
               and "dms_entries_std" in r for r in dms)
    assert "| dms |" in (tmp_path / "table.md").read_text()
    assert main(["eval", "--policies", "dense,dms", "--lengths", "128", "--budgets", "12", "--sinks", "2",
                 "--window", "4", "--no-progress"]) == 2


def test_calibration_on_a_batch_meets_the_budget_on_average_and_starts_from_nothing(run_dir):
    base = E.load_base_model(run_dir / "model")
    model = E.policy_model(base, "dms", scorers=run_dir / DE.GATES, finetuned=base, sinks=2, window=4)
    ids = torch.stack([T.make_example(T.valid_seed(i), L)["input_ids"] for i in range(3)])
    with torch.no_grad():
        thr = DE.calibrate_threshold(model, ids, 20)
        assert DE.mean_entries(model, ids, thr) <= 20
        per_seq = [DE.mean_entries(model, ids[i], thr) for i in range(3)]
        assert DE.mean_entries(model, ids, thr) == pytest.approx(sum(per_seq) / 3)
        logits, fixed, heads = DE._kept_logits(model, ids, thr)
        above = logits[logits > thr]
        assert above.numel() and fixed + int((logits <= above.min()).sum()) / heads > 20
        D.patch_dms(model, threshold=37.0)  # whatever threshold the model was left at: the same answer
        assert DE.calibrate_threshold(model, ids, 20) == thr


def test_evaluate_fixes_the_dms_threshold_on_validation_sequences(run_dir):
    """dms: one threshold per (budget, length) from the validation sequences, used for every test sequence;
    dms-test-calibrated: set on each test sequence."""
    base = E.load_base_model(run_dir / "model")
    model = E.policy_model(base, "dms", scorers=run_dir / DE.GATES, finetuned=base, sinks=2, window=4)
    cfg = E.EvalConfig(train_len=L, lengths=[L], budgets=[16], n_sequences=2, sinks=2, window=4, progress=False)
    res = E.evaluate({"dense": base, "dms": model, "dms-test-calibrated": model}, cfg, task=T)
    row = {r["policy"]: r for r in res["rows"]}
    valid = torch.stack([T.make_example(T.valid_seed(i), L)["input_ids"] for i in range(2)])
    thr = DE.calibrate_threshold(model, valid, 16)
    assert row["dms"]["dms_threshold"] == thr and row["dms"]["dms_threshold_from"] == "validation"
    assert row["dms"]["dms_valid_entries_mean"] == round(DE.mean_entries(model, valid, thr), 2) <= 16
    tests = [T.make_example(T.test_seed(i), L) for i in range(2)]
    correct = sum(E.sequence_correct(model, ex, "dms", 16, threshold=thr)[0] for ex in tests)
    assert row["dms"]["correct"] == correct
    ent = [DE.mean_entries(model, ex["input_ids"], thr) for ex in tests]
    assert row["dms"]["dms_entries_mean"] == pytest.approx(sum(ent) / 2, abs=0.01)
    assert row["dms-test-calibrated"]["dms_entries_mean"] <= 16
    assert "dms_threshold_from" not in row["dms-test-calibrated"]
    with pytest.raises(ValueError, match="takes none"):
        E.policy_logits(base, tests[0]["input_ids"], "dense", threshold=1.0)
