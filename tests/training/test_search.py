"""The one staged search (``kvpop.training.search``) against a brute-force reading of its rules: each stage varies
the best settings so far, the lowest score wins (the first of equals), a stage with ``start`` compares anew, a
finished trial is reused and never run again, the budget skips trials, the record after every trial; and the
plans of ``kvpop train --auto`` and ``kvpop demo --select``."""
import itertools
import json
import time

import pytest

from kvpop.demo.grid import JOINT_OF, RETROFITS, SCORER_ONLY, SELECT_GRID, select_plan
from kvpop.training.auto import auto_plan
from kvpop.training.search import Search, Stage, trial_tag


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
    assert [st.name for st in full] == ["label", "lm_weight", "fixed_decay", "fixed_mask", "head_budgets",
                                        "lr_scorer", "train_budget", "target_source", "decay", "warm_start"]
    assert full[3].variations == [{"mask_source": "streaming"}]
    # the stages of the learned scorer alone do not run once the fixed mask is chosen
    assert [st.name for st in full if st.when is not None] == ["fixed_decay", "head_budgets", "lr_scorer",
                                                               "target_source", "decay", "warm_start"]
    assert all(not st.when({"mask_source": "streaming"}) and st.when({"lr_scorer": 1e-3})
               for st in full if st.when is not None)
    # the user's --mask-source is kept as given; the fixed mask needs the model trained
    given = auto_plan(labels=["mean"], lr_scorers=[1e-3], train_budgets=[], given={"mask_source": "scorer"},
                      decay_nats=8.0, train_model=True)
    assert "fixed_mask" not in [st.name for st in given]
    # the oracle's mask is served by its scorers (learned); the user's own --mask-source streaming is the fixed mask
    from kvpop.training.auto import learned_mask

    assert learned_mask({"mask_source": "teacher"}) and learned_mask({})
    assert not learned_mask({"mask_source": "streaming"})
    fixed = auto_plan(labels=["mean"], lr_scorers=[1e-3], train_budgets=[], given={"mask_source": "streaming"},
                      decay_nats=8.0, train_model=True, warm_start=True)
    assert all(not st.when({"lr_scorer": 1e-3}) for st in fixed if st.when is not None)
    teacher = auto_plan(labels=["mean"], lr_scorers=[1e-3], train_budgets=[], given={"mask_source": "teacher"},
                        decay_nats=8.0, train_model=True, warm_start=True)
    assert all(st.when({"lr_scorer": 1e-3}) for st in teacher if st.when is not None)
    assert not full[0].trained and full[1].start == {"lm_weight": 0.0, "fixed_decay": None, "decay_nats": None,
                                                     "allocate": None, "target_source": "student",
                                                     "train_budget": None, "lr_scorer": 1e-3}
    fixed = auto_plan(labels=["max"], lr_scorers=[1e-3], train_budgets=[], given={"allocate": "ablation",
                      "decay_nats": 4.0}, decay_nats=8.0, train_model=False)
    assert [st.name for st in fixed] == ["given"]
    assert fixed[0].start["label"] == "max" and fixed[0].start["allocate"] == "ablation"


def test_a_conditional_stage_runs_only_where_its_test_holds(tmp_path):
    """``Stage.when``: tested on the best settings so far; a failing stage runs nothing and says so."""
    scores = {(): 0.5, (("m", "fixed"),): 0.1, (("m", "fixed"), ("x", 2)): 0.0}

    def run(c, d):
        return {"score": scores[tuple(sorted((k, v) for k, v in c.items() if k != "lr"))],
                "per_sequence": [scores[tuple(sorted((k, v) for k, v in c.items() if k != "lr"))]] * 8}

    s = Search(tmp_path / "a")
    plan = [Stage("lr", [{"lr": 1}], start={}), Stage("mask", [{"m": "fixed"}]),
            Stage("x", [{"x": 2}], when=lambda st: st.get("m") != "fixed")]
    best = s.run_plan(plan, run)
    assert best["settings"] == {"lr": 1, "m": "fixed"}
    assert [(x["stage"], x["status"]) for x in s.record["stages"]] == [("lr", "ran"), ("mask", "ran"),
                                                                       ("x", "not applicable")]
    assert s.summary()["not_applicable"] == ["x"]
    with pytest.raises(ValueError, match="cannot be conditional"):
        Search(tmp_path / "b").run_plan([Stage("x", [{"x": 1}], start={}, when=lambda st: True)], run)


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


# --------------------------------------------------------------------- the selection rule (issue 42)


def _brute_decision(inc, ch, higher_is_better=False):
    """The rule read independently: numpy's paired differences, their sample sd (ddof 1) over sqrt(n), the
    challenger adopted only when its mean improvement exceeds 2 of them."""
    import numpy as np

    d = np.asarray(ch, float) - np.asarray(inc, float)
    d = d if higher_is_better else -d
    if d.size < 2:
        return float(d.mean()), None, False
    se = float(np.std(d, ddof=1) / np.sqrt(d.size))
    return float(d.mean()), se, bool(d.mean() > 2 * se)


def test_the_rule_against_a_brute_force_paired_reading():
    import random
    import statistics

    from kvpop.training.search import MARGIN_SE, choose, paired, prefer

    assert MARGIN_SE == 2.0
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 12)
        inc = [rng.gauss(1.0, 0.3) for _ in range(n)]
        ch = [x + rng.gauss(rng.choice([-0.2, -0.05, 0.0, 0.1]), rng.choice([0.01, 0.1, 0.3])) for x in inc]
        for hib in (False, True):
            mean, se, adopted = _brute_decision(inc, ch, hib)
            d = prefer({"settings": {"i": 0}, "score": 0, "per_sequence": inc},
                       {"settings": {"i": 1}, "score": 0, "per_sequence": ch}, higher_is_better=hib)
            assert d["mean_diff"] == pytest.approx(mean) and d["se"] == pytest.approx(se)
            assert d["margin"] == pytest.approx(2 * se) and d["adopted"] == adopted and d["paired"]
            diffs = [(c - i) if hib else (i - c) for i, c in zip(inc, ch)]
            assert d["se"] == pytest.approx(statistics.stdev(diffs) / n ** 0.5)
    # a challenger lower on the mean by less than the margin is kept out; the earlier trial stays
    inc = {"settings": {"lr": 1}, "score": 1.0, "per_sequence": [1.0, 1.0, 1.0, 1.0]}
    near = {"settings": {"lr": 2}, "score": 0.98, "per_sequence": [0.9, 1.05, 0.95, 1.02]}
    d = prefer(inc, near)
    assert d["mean_diff"] == pytest.approx(0.02) and 0 < d["mean_diff"] < d["margin"] and not d["adopted"]
    assert choose([inc, near], higher_is_better=False) is inc
    far = {"settings": {"lr": 3}, "score": 0.5, "per_sequence": [0.5, 0.45, 0.55, 0.5]}
    log = []
    assert choose([inc, near, far], higher_is_better=False, decisions=log, stage="s") is far
    assert [x["adopted"] for x in log] == [False, True] and [x["challenger"] for x in log] == [{"lr": 2}, {"lr": 3}]
    assert all(x["stage"] == "s" for x in log)
    # the one tie rule: equal scores keep the incumbent; one sequence has no standard error and never replaces
    assert not prefer(inc, {**inc, "settings": {"lr": 4}})["adopted"]
    one = prefer({"score": 1, "per_sequence": [1.0]}, {"score": 0, "per_sequence": [0.0]})
    assert one["se"] is None and not one["adopted"]
    assert paired([1.0, 2.0], [1.0, 2.0]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same sequences"):
        paired([1.0], [1.0, 2.0])
    # a record written before the rule (no per-sequence scores) is compared by its score, no margin
    old = prefer({"score": 0.3}, {"score": 0.2})
    assert old["adopted"] and not old["paired"] and old["se"] is None


def test_the_split_is_disjoint_seeded_and_stable():
    from kvpop.training.search import resolution, split_keys

    keys = [f"rec{i}" for i in range(17)]
    fit, sel = split_keys(keys, 0)
    assert sorted(fit + sel) == list(range(17)) and not set(fit) & set(sel) and len(sel) == 9
    assert split_keys(keys, 0) == (fit, sel) and split_keys(keys, 1) != (fit, sel)
    fit, sel = split_keys(["a", "b", "a", "c"], 0)  # a duplicate record never lands in both parts
    assert not ({0, 2} <= set(fit) and {0, 2} & set(sel)) and not ({0, 2} & set(fit) and {0, 2} & set(sel))
    assert "warning" in resolution(3) and "no standard error" in resolution(1) and "warning" not in resolution(8)
    assert "0.0707" in resolution(8, 0.1)  # 2 * 0.1 / sqrt(8)


def test_confirmation_chooses_on_the_mean_of_two_seeds(tmp_path):
    from kvpop.training.search import confirm_choice

    a = {"settings": {"x": 1}, "score": 0.5, "per_sequence": [0.5, 0.5, 0.5]}
    b = {"settings": {"x": 2}, "score": 0.3, "per_sequence": [0.3, 0.31, 0.29]}
    c = {"settings": {"x": 3}, "score": 0.9, "per_sequence": [0.9, 0.9, 0.9]}
    again = {1: [0.5, 0.5, 0.5], 2: [0.7, 0.72, 0.68]}  # b's second seed is worse than a's: the mean keeps a
    chosen, rec = confirm_choice(b, [a, b, c], lambda t: {"score": sum(again[t["settings"]["x"]]) / 3,
                                                          "per_sequence": again[t["settings"]["x"]]},
                                 seed=("seed", 1))
    assert chosen is a and rec["ran"] and rec["changed"] and [t["settings"] for t in rec["trials"]] == [{"x": 1},
                                                                                                       {"x": 2}]
    assert rec["trials"][1]["per_sequence"] == pytest.approx([0.5, 0.515, 0.485])
    assert confirm_choice(a, [a], lambda t: t, seed=("seed", 1))[1]["ran"] is False
    # in a Search: the retrained trials carry the seed, and a budget too small says what to raise
    s = Search(tmp_path, budget=("steps", 4.0), log=lambda line: None)
    run = lambda st, d: {"score": st["x"], "per_sequence": [st["x"] + e for e in (0, .1, -.1)], "steps": 2}  # noqa: E731
    best = s.run_plan([Stage("x", [{"x": 1}, {"x": 2}], start={})], run, steps_of=lambda st: 2)
    _, rec = s.confirm(best, run, seed=("seed", 1), steps_of=lambda st: 2, raise_hint="; raise it to {need}")
    assert not rec["ran"] and "raise it to 8" in rec["why"]


def test_every_search_goes_through_the_one_rule(tmp_path, monkeypatch):
    """``kvpop train --auto`` (its library side, with made-up training and scores), ``kvpop demo --select`` (its
    search up to the first stage) and the evidence studies call :func:`kvpop.training.search.prefer`."""
    import argparse

    import kvpop.training.search as S

    calls = []
    real = S.prefer

    def spy(*a, **k):
        calls.append(k.get("stage"))
        return real(*a, **k)

    monkeypatch.setattr(S, "prefer", spy)
    # the studies: their choose and confirmation are the search module's
    from studies import evidence_realtext, evidence_synthetic, ledger

    for mod in (ledger, evidence_realtext, evidence_synthetic):
        assert mod.choose is S.choose
    assert evidence_realtext.confirm_choice is evidence_synthetic.confirm_choice is S.confirm_choice
    ledger.choose([{"score": 1}, {"score": 0}], stage="study")
    assert calls == ["study"]
    # kvpop train --auto
    from kvpop.training import auto

    calls.clear()
    monkeypatch.setattr(auto, "_check_trial_files", lambda *a, **k: None)  # made-up trials write no run files
    settings = auto.AutoSettings(out=str(tmp_path / "auto"), steps=2, seed=0, sinks=2, window=8, auto_budget="8",
                                 patience=0)
    scores = iter(range(100))
    rec = auto.search(settings, served=32, given={"label": "mean"}, lr_scorer=1e-3, train_model=False,
                      train=lambda run: 0, score=lambda d, part: [float(next(scores) % 3), 1.0, 2.0],
                      oracle=lambda st: [0.0, 0.0, 0.0], split={"fit": [1, 2], "select": [3, 4, 5]},
                      log=lambda line: None)
    assert calls and calls == [d["stage"] for d in rec["decisions"]] and "confirmation" in calls
    assert rec["split"] == {"fit": [1, 2], "select": [3, 4, 5]} and all("per_sequence" in t for t in rec["trials"])
    # kvpop demo --select: its search is Search.run_plan, which decides by prefer (the tests above)
    from kvpop.cli import demo as D
    from kvpop.demo import search as DS

    class Reached(Exception):
        pass

    def stop(self, *a, **k):
        raise Reached

    monkeypatch.setattr(S.Search, "run_plan", stop)
    p = argparse.ArgumentParser()
    D.add_arguments(p)
    a = p.parse_args(["--quick", "--select", "--task", "kvtrace", "--out", str(tmp_path / "demo"), "--no-progress"])
    with pytest.raises(Reached):
        DS.select(D.options(a), "kvtrace", tmp_path / "demo" / "kvtrace", DS.settings(D.options(a), "kvtrace"))
