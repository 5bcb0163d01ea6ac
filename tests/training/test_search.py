"""The one staged search (``kvpop.training.search``) against a brute-force reading of its rules: each stage varies
the best settings so far, the lowest score wins (the first of equals), a stage with ``start`` compares anew, a
finished trial is reused and never run again, the budget skips trials, the record after every trial; and the
plans of ``kvpop train --auto`` and ``kvpop demo --select``."""
import itertools
import json
import time

import pytest

from kvpop.training.search import (
    JOINT_OF,
    RETROFITS,
    SCORER_ONLY,
    SELECT_GRID,
    Search,
    Stage,
    auto_plan,
    select_plan,
    trial_tag,
)


def _objective(s):
    """A deterministic score with ties (x and y interact; z never matters)."""
    return round(abs(s.get("x", 0) - 2) + abs(s.get("y", 0) * s.get("x", 0) - 3) / 2, 3)


def _brute(plan, score):
    """The plan by its rules, with no record or directories: every trial a dict in the order run."""
    best, prev, ran, seen = None, {}, [], {}
    for st in plan:
        if st.start is not None:
            base, best = {**prev, **st.start}, None
        else:
            base = best["settings"]
        for v in st.variations:
            s = {**base, **v}
            if best is not None and s == best["settings"]:
                continue
            key = json.dumps(s, sort_keys=True)
            if key not in seen:  # a trial is run once; a later stage coming back to it takes its score
                seen[key] = {"settings": s, "score": score(s)}
                ran.append(seen[key])
            r = seen[key]
            if best is None or r["score"] < best["score"]:
                best = r
        prev = best["settings"]
    return best, ran


PLANS = [
    [Stage("x", [{"x": x} for x in (1, 2, 3)], start={"y": 1}), Stage("y", [{"y": y} for y in (1, 2, 3)])],
    [Stage("xy", [{"x": x, "y": y} for x, y in itertools.product((0, 1, 3), (2, 1))], start={}),
     Stage("z", [{"z": 5}]), Stage("x", [{"x": 2}, {"x": 1}])],
    [Stage("o", [{"x": 1}, {"x": 3}], start={}, trained=False), Stage("y", [{"y": 3}, {"y": 1}], start={"z": 0}),
     Stage("x", [{"x": 2}])],
]


@pytest.mark.parametrize("plan", PLANS)
def test_a_plan_runs_as_its_rules_say(tmp_path, plan):
    calls = []

    def run(s, d):
        calls.append(s)
        assert d == tmp_path / "sub" / trial_tag(s) and d.is_dir()
        return {"score": _objective(s), "steps": 10, "extra": s.get("x")}

    def oracle(s, d):
        calls.append(s)
        return {"score": -_objective(s)}  # another scale: the stage after it must compare anew

    def ref_score(s):
        return -_objective(s) if set(s) == {"x"} else _objective(s)

    search = Search(tmp_path, header={"what": "test"}, log=lambda line: None)
    best = search.run_plan(plan, run, oracle=oracle, subdir="sub", extra={"policy": "p"})
    want, ran = _brute(plan, ref_score)
    assert best["settings"] == want["settings"] and best["score"] == want["score"]
    assert [t["settings"] for t in search.record["trials"]] == [r["settings"] for r in ran] == calls
    rec = json.loads((tmp_path / "selection.json").read_text())
    assert rec["what"] == "test" and len(rec["trials"]) == len(ran)
    for t in rec["trials"]:
        assert t["policy"] == "p" and set(t) >= {"stage", "settings", "score", "steps", "seconds", "dir"}
        assert json.loads((tmp_path / t["dir"] / "trial.json").read_text()) == t
        assert t["steps"] == (0 if t["stage"] == "o" else 10)


def test_finished_trials_are_reused_and_the_budget_skips(tmp_path):
    plan = [Stage("x", [{"x": x} for x in (1, 2, 3, 4)], start={})]
    runs = []

    def run(s, d):
        runs.append(s["x"])
        return {"score": -s["x"], "steps": 5}

    first = Search(tmp_path, budget=("steps", 10.0), log=lambda line: None)
    best = first.run_plan(plan, run, steps_of=lambda s: 5)
    assert runs == [1, 2] and best["settings"] == {"x": 2}  # 10 steps: two trials of 5
    assert [s["settings"]["x"] for s in first.record["skipped"]] == [3, 4]
    lines = []
    again = Search(tmp_path, budget=("steps", 20.0), log=lines.append)
    best = again.run_plan(plan, run, steps_of=lambda s: 5)
    assert runs == [1, 2, 3, 4] and best["settings"] == {"x": 4}  # the first two reused, not run again
    assert sum("(reused)" in line for line in lines) == 2 and again.spent["steps"] == 20
    # a trial directory holding other settings under the same tag is not taken for a finished trial
    (tmp_path / trial_tag({"x": 5})).mkdir()
    (tmp_path / trial_tag({"x": 5}) / "trial.json").write_text(json.dumps({"settings": {"x": 6}, "score": 0}))
    Search(tmp_path, log=lambda line: None).run_plan([Stage("x", [{"x": 5}], start={})], run)
    assert runs[-1] == 5


def test_the_first_trained_trial_runs_whatever_the_budget_and_bad_plans_are_refused(tmp_path):
    def slow(c, d):
        time.sleep(0.2)  # recorded to 0.1 s: more than the budget's minutes
        return {"score": c["x"], "steps": 1}

    s = Search(tmp_path, budget=("minutes", 1e-6), log=lambda line: None)
    best = s.run_plan([Stage("x", [{"x": 1}, {"x": 2}], start={})], slow)
    assert best["settings"] == {"x": 1} and len(s.record["skipped"]) == 1
    with pytest.raises(ValueError, match="no trial ran before it"):
        Search(tmp_path / "b").run_plan([Stage("x", [{"x": 1}])], lambda c, d: {"score": 0})
    with pytest.raises(ValueError, match="needs an oracle"):
        Search(tmp_path / "c").run_plan([Stage("x", [{"x": 1}], start={}, trained=False)],
                                        lambda c, d: {"score": 0})


def test_auto_plan_leaves_out_what_the_user_gave():
    full = auto_plan(labels=["mean", "max"], lr_scorers=[1e-3, 1e-2], train_budgets=[50, 40], given={},
                     decay_nats=8.0, train_model=True, warm_start=True)
    assert [st.name for st in full] == ["label", "lr_scorer", "head_budgets", "train_budget", "target_source",
                                        "decay", "warm_start"]
    assert not full[0].trained and full[1].start == {"decay_nats": None, "allocate": None,
                                                     "target_source": "student", "train_budget": None}
    fixed = auto_plan(labels=["max"], lr_scorers=[1e-3], train_budgets=[], given={"allocate": "ablation",
                      "decay_nats": 4.0}, decay_nats=8.0, train_model=False)
    assert [st.name for st in fixed] == ["lr_scorer", "train_budget"]
    assert fixed[0].start["label"] == "max" and fixed[0].start["allocate"] == "ablation"


def test_the_demo_select_plans_reach_every_grid_value():
    chosen = {"kvpop-mlp": {"k": 4, "lr_scorer": 0.01, "steps": 100, "label": "max", "decay_span": None,
                            "eval_every": 0, "patience": 0, "head_budgets": "ablation"}}
    chosen["kvpop-mlstm"] = dict(chosen["kvpop-mlp"])
    plan = select_plan("all", "kvpop-mlp", SELECT_GRID, {}, {})
    assert [st.name for st in plan] == ["k x lr_scorer", "steps", "label x decay_span", "head_budgets"]
    assert {v["k"] for v in plan[0].variations} == set(SELECT_GRID["k"])
    joint = select_plan("all", "kvpop-mlp-joint", SELECT_GRID, {}, chosen)
    assert joint[0].start["head_budgets"] == "ablation" and joint[0].start["target_source"] == "student"
    assert [st.name for st in joint] == ["lr_model", "target_source", "joint_init"]
    assert select_plan("target_source", "kvpop-mlp", SELECT_GRID, {}, {}) == []
    assert select_plan("label", "fixed-finetune", SELECT_GRID, {}, {}) == []
    assert set(RETROFITS) == {*SCORER_ONLY, *JOINT_OF, "fixed-finetune"}
    with pytest.raises(ValueError, match="unknown select stage 'labels'"):
        select_plan("labels", "kvpop-mlp", SELECT_GRID, {}, {})
    with pytest.raises(ValueError, match="unknown demo retrofit"):
        select_plan("all", "dense", SELECT_GRID, {}, {})
