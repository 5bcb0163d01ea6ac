"""studies.label_study: the oracle's fixed decay, the oracle without eviction equals dense, a scorer run."""
import pytest
import torch

pytest.importorskip("transformers")

import kvpop
from kvpop.demo import lookahead_task as T
from kvpop.evaluation.evaluate import load_base_model
from studies import label_study as L


@pytest.fixture(scope="module")
def base():
    m = load_base_model(T.SHIPPED_MODEL)
    m.requires_grad_(False)
    return m


def test_fixed_decay_is_the_layers_decay(base):
    for g in (0.99, 0.999999):
        m = kvpop.patch(kvpop.make_teacher(base), L.oracle_config("max", 1.0, g, 64))
        got = torch.cat([lay.gamma().detach() for lay in kvpop.kvpop_layers(m)]).double()
        assert torch.allclose(got, torch.full_like(got, g), rtol=0, atol=1e-7), got
    with pytest.raises(ValueError, match="gamma"):
        L.fixed_decay(1.0)


def test_oracle_without_eviction_is_dense_and_with_eviction_differs(base):
    batch = T.make_batch([T.valid_seed(i) for i in range(2)], T.TRAIN_LEN)
    dense = L._dense_accuracy(base, batch)
    m = kvpop.patch(kvpop.make_teacher(base), L.oracle_config("power", 4.0, 0.999, T.TRAIN_LEN))
    assert L.accuracy(base, m, batch) == dense == 1.0
    m = kvpop.patch(kvpop.make_teacher(base), L.oracle_config("mean", 1.0, 0.99, 64))
    assert L.accuracy(base, m, batch) < 0.9  # the paper's label at a strong decay loses facts


def test_train_scorer_keeps_the_best_validation_state(base):
    valid = T.make_batch([T.valid_seed(0)], T.TRAIN_LEN)
    r = L.train_scorer(base, "mlp", label="max", power=1.0, gamma=0.9999, budget=64, valid=valid, steps=3,
                       eval_every=1, patience=5, lr=1e-2, span_nats=8.0, batch=1)
    assert [h["step"] for h in r["history"]] == [1, 2, 3]
    best = max(r["history"], key=lambda h: h["valid_accuracy"])
    assert r["best_valid"] == best["valid_accuracy"] and r["best_step"] == best["step"]
    assert L.accuracy(base, r["model"], valid) == r["best_valid"]  # the model holds the best state
    assert r["config"]["label"] == "max" and r["config"]["gamma_min"] < 0.985  # the context-tied range (8 nats)


def test_kvtrace_task_and_test_budgets(tmp_path):
    out = tmp_path / "r.json"
    assert L.main(["--task", "kvtrace", "--stages", "scorers,test", "--scorers", "mlp", "--choice", "max:1.0:0.999999",
                   "--steps", "1", "--eval-every", "1", "--n-valid", "1", "--n-test", "1", "--train-len", "512",
                   "--budget", "64", "--test-budgets", "48,64", "--out", str(out)]) == 0
    import json

    res = json.loads(out.read_text())
    assert res["task"] == "kvtrace" and res["test_len"] == 512 and sorted(res["test"]) == ["48", "64"]
    for rows in res["test"].values():
        assert rows["dense"] == 1.0
        assert rows["oracle (max label)"] >= rows["oracle (mean label)"]
        assert 0.0 <= rows["kvpop-mlp (scorer-only, max label)"] <= 1.0
    with pytest.raises(SystemExit):
        L.main(["--task", "kvtrace", "--test-budgets", "a,b", "--out", str(out)])


def test_head_adaptive_stage(base, tmp_path):
    """--head-adaptive ablation: importance on the validation sequences under each oracle's own mask,
    allocate at the same total, test accuracy with those budgets beside the uniform ones; saved in the output."""
    import json

    from kvpop.core.budgets import ablation_importance, allocate

    out = tmp_path / "r.json"
    assert L.main(["--stages", "test", "--choice", "mean:1.0:0.999999", "--head-adaptive", "ablation", "--n-valid",
                   "2", "--n-test", "2", "--min-k", "2", "--train-len", "256", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    ha = res["head_adaptive"]["64"]
    assert set(ha) == {"oracle (mean label)", "oracle (max label)"}
    valid = T.make_batch([T.valid_seed(i) for i in range(2)], 256)
    test = T.make_batch([T.test_seed(i) for i in range(2)], 256)
    cfg = L.oracle_config("mean", 1.0, 0.999999, 64)
    imp = ablation_importance(kvpop.patch(kvpop.make_teacher(base), cfg), [valid["input_ids"]], config=cfg,
                              teacher=base)
    r = ha["oracle (mean label)"]
    assert torch.allclose(imp, torch.tensor(r["importance"], dtype=torch.float64), rtol=0, atol=1e-9)
    rows = allocate(imp, total=4 * 64, sinks=L.SINKS, window=L.WINDOW, min_k=2)
    assert [list(x) for x in rows] == r["head_budgets"] and min(min(x) for x in rows) >= L.SINKS + L.WINDOW + 2
    assert r["uniform_accuracy"] == res["test"]["oracle (mean label)"]
    m = kvpop.patch(kvpop.make_teacher(base), cfg.replace(head_budgets=rows))
    assert r["adaptive_accuracy"] == L.accuracy(base, m, test)
    assert "min_k=2" in res["head_adaptive_rule"]


def test_validation_at_another_budget_than_training(base):
    valid = T.make_batch([T.valid_seed(0)], T.TRAIN_LEN)
    r = L.train_scorer(base, "mlp", label="max", power=1.0, gamma=0.9999, budget=64, valid=valid, steps=2,
                       eval_every=1, patience=5, lr=1e-2, span_nats=8.0, batch=1, valid_budget=48)
    m = r["model"]
    assert kvpop.kvpop_layers(m)[0].config.budget == 64  # trained (and returned) at its own budget
    assert L.accuracy(base, kvpop.patch(m, budget=48), valid) == r["best_valid"]  # validated at 48
