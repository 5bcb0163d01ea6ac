"""studies.paper_exact: the two-stage learning-rate choice, the paper's settings at the served budget, the check of
a trained run's options, and the tables (tiny records, no model)."""
import json

import pytest

from kvpop.training.auto import PAPER
from studies import paper_exact as P


def _trials(scores: dict):
    """``trials_of`` over fixed per-sequence values by (lr_scorer, lr_model); records every call."""
    calls = []

    def trials_of(ls, lm):
        calls.append((ls, lm))
        v = scores.get((ls, lm))
        return None if v is None else {"settings": {"lr_scorer": ls, "lr_model": lm}, "per_sequence": v,
                                       "score": sum(v) / len(v)}
    return trials_of, calls


FLAT = [0.5, 0.6, 0.7, 0.5]


def test_the_scorer_lr_then_the_model_lr_by_the_rule():
    clear = [0.9, 0.95, 1.0, 0.92]
    f, calls = _trials({(1e-3, 1e-4): FLAT, (3e-3, 1e-4): [0.5, 0.6, 0.72, 0.5], (1e-2, 1e-4): clear,
                        (1e-2, 1e-3): [0.5, 0.5, 0.6, 0.4]})
    r = P.select(f, P.LR_SCORER, (1e-4, 1e-3), higher_is_better=True, stop_early=False)
    assert r["chosen"] == {"lr_scorer": 1e-2, "lr_model": 1e-4}
    assert calls == [(1e-3, 1e-4), (3e-3, 1e-4), (1e-2, 1e-4), (1e-2, 1e-3)]
    assert [d["adopted"] for d in r["decisions"]] == [False, True, False]  # a tie keeps the incumbent
    assert [d["stage"] for d in r["decisions"]] == ["paper-exact lr_scorer"] * 2 + ["paper-exact lr_model"]
    assert len(r["trials"]) == 4


def test_lower_is_better_and_stopping_early():
    low = [0.01, 0.012, 0.011, 0.01]
    f, calls = _trials({(1e-3, 1e-4): FLAT, (3e-3, 1e-4): FLAT, (1e-2, 1e-4): FLAT, (1e-3, 3e-4): low,
                        (1e-3, 1e-3): FLAT})
    r = P.select(f, P.LR_SCORER, (1e-4, 3e-4, 1e-3), higher_is_better=False, stop_early=True)
    assert r["chosen"] == {"lr_scorer": 1e-3, "lr_model": 3e-4}  # 3e-4 adopted, so 1e-3 was tried (and lost)
    assert calls[-1] == (1e-3, 1e-3)
    f, calls = _trials({(1e-3, 1e-4): FLAT, (3e-3, 1e-4): FLAT, (1e-2, 1e-4): FLAT, (1e-3, 3e-4): FLAT})
    r = P.select(f, P.LR_SCORER, (1e-4, 3e-4, 1e-3), higher_is_better=False, stop_early=True)
    assert r["chosen"] == {"lr_scorer": 1e-3, "lr_model": 1e-4} and (1e-3, 1e-3) not in calls


def test_nothing_is_chosen_before_every_trial_is_there():
    f, _ = _trials({(1e-3, 1e-4): FLAT, (3e-3, 1e-4): FLAT})
    r = P.select(f, P.LR_SCORER, (1e-4, 1e-3), higher_is_better=True, stop_early=False)
    assert r["chosen"] is None and len(r["trials"]) == 2
    f, _ = _trials({(a, 1e-4): FLAT for a in P.LR_SCORER})
    r = P.select(f, P.LR_SCORER, (1e-4, 1e-3), higher_is_better=True, stop_early=False)
    assert r["chosen"] is None and len(r["trials"]) == 3


def test_the_candidates_are_autos():
    assert P.LR_SCORER == pytest.approx((1e-3, 3e-3, 1e-2))


def test_the_synthetic_row_trains_at_the_served_budget(monkeypatch):
    import studies.controls_synthetic as C

    row = {"policy": "kvpop-mlp-joint", "chosen": True, "settings": {
        "steps": 200, "k": 12, "lr_scorer": 3e-3, "lr_model": 1e-4, "label": "max", "decay_span": None,
        "target_source": "teacher", "joint_init": "scorer-only", "head_budgets": "ablation"}}
    monkeypatch.setattr(C, "kvpop_row", lambda task, s: ("kvpop-mlp-joint[max]", row))
    c = P.synthetic_settings("lookahead", {"sinks": 4, "window": 32}, 64)
    assert c["k"] == 28 and c["steps"] == 200 and "head_budgets" not in c
    assert (c["label"], c["decay_span"], c["target_source"], c["joint_init"]) == ("mean", None, "student", "fresh")


def _args(tmp_path, **over):
    a = {**PAPER, "budget": 128, "priority_source": "scorer", "allocate": None, "head_budgets": None,
         "init_scorers": None, "no_train_model": False, "lr_scorer": 3e-3, **over}
    (tmp_path / "args.json").write_text(json.dumps(a))
    return tmp_path


def test_a_run_that_departs_from_the_paper_is_refused_by_name(tmp_path):
    P.check_paper_args(_args(tmp_path))
    with pytest.raises(ValueError, match="allocate"):
        P.check_paper_args(_args(tmp_path, allocate="ablation"))
    with pytest.raises(ValueError, match="budget"):
        P.check_paper_args(_args(tmp_path, budget=40))
    with pytest.raises(ValueError, match="lm_weight"):
        P.check_paper_args(_args(tmp_path, lm_weight=0.1))
    with pytest.raises(ValueError, match="label"):
        P.check_paper_args(_args(tmp_path, label="max"))


def test_the_tables_come_from_the_record():
    rec = {"instrument": "kvtrace", "selection": {
        "chosen": {"lr_scorer": 1e-3, "lr_model": 1e-3},
        "trials": [{"settings": {"lr_scorer": 1e-3, "lr_model": 1e-4}, "score": 0.2661}],
        "decisions": [{"stage": "paper-exact lr_model", "incumbent": {}, "challenger": {}, "mean_diff": 0.2368,
                       "se": 0.0225, "adopted": True}]},
        "validation": {"comparisons": [{"budget": 128, "b": "ctl", "mean_diff": 0.3449, "ci95": [0.29, 0.40],
                                        "seeds_a": 3, "seeds_b": 3, "verdict": "a better"}]},
        "tests": [{"split": "test_fresh2", "comparisons": [{"budget": 128, "b": "ctl", "mean_diff": -0.1,
                                                            "ci95": [-0.2, -0.01], "seeds": {"a": 3, "b": 3},
                                                            "verdict": "b better"}]}]}
    md = P.markdown(rec)
    assert "| 0.001, 0.0001 | 0.2661 |" in md and "| paper-exact lr_model | {} | {} | +0.2368 | 0.0225 | yes |" in md
    assert "| 128 | - | ctl | +0.3449 | [+0.2900, +0.4000] | 3 / 3 | a better |" in md
    assert "test_fresh2:" in md and "| 128 | - | ctl | -0.1000 | [-0.2000, -0.0100] | 3 / 3 | b better |" in md
