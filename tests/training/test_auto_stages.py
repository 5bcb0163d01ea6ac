"""``kvpop train --auto``'s stages (issue 62): the next-token loss and a fixed decay searched, in the order of what
moved real text's score most, the fixed-mask stage within the default budget, the stages that cannot change a
fixed-mask model left out; the tie rule for trials the select part cannot tell apart, the selection power, and
the trial records' checks (issue 59's --auto rows)."""
import json
import math

import pytest

from kvpop.training.auto import (
    DEFAULT_TRIALS,
    FIXED_DECAYS,
    LM_WEIGHTS,
    _check_trial_files,
    auto_plan,
    default_budget,
    fixed_decay_options,
    next_steps,
    serve_cost,
)
from kvpop.training.search import Search, Stage, cannot_tell, power, prefer, split_keys, tie_break
from kvpop.training.trial_records import check_inputs, check_record, effective_options


def _plan(given=None, train_model=True, labels=("mean", "max")):
    return auto_plan(labels=list(labels), lr_scorers=[1e-3, 3e-3, 1e-2], train_budgets=[59, 41], given=given or {},
                     decay_nats=8.0, train_model=train_model, warm_start=train_model)


def _trained_trials(plan):
    """The trials each stage adds, in plan order (the start stage's first is the start, and a variation equal to
    it is not run again)."""
    out = []
    for st in plan:
        if st.trained:
            base = st.start or {}
            out.append((st.name, sum({**base, **v} != base for v in st.variations)))
    return out


def test_the_stages_that_moved_real_text_most_come_first():
    plan = _plan()
    assert [st.name for st in plan][:4] == ["label", "lm_weight", "fixed_decay", "fixed_mask"]
    assert [v.get("lm_weight") for v in plan[1].variations] == [None, *LM_WEIGHTS]  # the start first
    assert plan[1].start["lm_weight"] == 0.0 and plan[1].start["fixed_decay"] is None
    assert [v["fixed_decay"] for v in plan[2].variations] == list(FIXED_DECAYS)
    assert [st.name for st in plan][4:] == ["head_budgets", "lr_scorer", "train_budget", "target_source", "decay",
                                            "warm_start"]


def test_the_default_budget_reaches_the_fixed_mask_stage():
    """The start trial, the two other lm weights, the two fixed decays and the fixed mask, plus the confirmation's
    two: the default budget pays for all of them (it reserves the confirmation's two first)."""
    unit, value = default_budget(250)
    assert unit == "steps" and value == DEFAULT_TRIALS * 250
    before_fixed_mask = 1  # the start trial
    for name, n in _trained_trials(_plan()):
        before_fixed_mask += n
        if name == "fixed_mask":
            break
    assert before_fixed_mask + 2 <= DEFAULT_TRIALS


def test_a_given_setting_fixes_its_stage_and_the_fixed_mask_runs_no_scorer_stage():
    names = [st.name for st in _plan({"lm_weight": 0.1, "decay": {"gamma_min": 0.99}})]
    assert "lm_weight" not in names and "fixed_decay" not in names and "decay" not in names
    assert _plan({"lm_weight": 0.1})[1].start["lm_weight"] == 0.1
    # --mask-source streaming: no label oracle, and every stage of the learned scorer not applicable
    plan = _plan({"mask_source": "streaming"})
    assert plan[0].name == "lm_weight" and plan[0].start is not None
    learned_only = [st for st in plan if st.when is not None]
    assert {st.name for st in learned_only} == {"fixed_decay", "head_budgets", "lr_scorer", "target_source",
                                                "decay", "warm_start"}
    assert not any(st.when({**plan[0].start}) for st in learned_only)
    assert {st.name for st in plan if st.when is None} == {"lm_weight", "train_budget"}
    # without training the model, no next-token loss (it trains the model) and no fixed mask
    names = [st.name for st in _plan(train_model=False)]
    assert "lm_weight" not in names and "fixed_mask" not in names and names[1] == "fixed_decay"


def test_a_fixed_mask_search_trains_only_trials_that_differ_in_the_model(tmp_path):
    """Issue 59: --mask-source streaming spent the budget on label / scorer-lr trials, identical models."""
    plan = _plan({"mask_source": "streaming"})
    ran = []

    def run(settings, d):
        ran.append(settings)
        return {"score": 0.1 * len(ran), "per_sequence": [0.1 * len(ran)] * 3, "steps": 10}

    Search(tmp_path, log=lambda line: None).run_plan(plan, run, steps_of=lambda s: 10)
    keys = [{k: v for k, v in s.items() if k in ("lm_weight", "train_budget")} for s in ran]
    assert len(keys) == len({json.dumps(k, sort_keys=True) for k in keys}) == len(ran) == 5


def test_fixed_decay_options_hold_the_decay():
    o = fixed_decay_options(0.995)
    assert o["gamma_min"] == 0.995 and o["gamma_min"] < o["gamma_init"] < o["gamma_max"] < 0.99501
    assert o["decay_nats"] is None
    with pytest.raises(ValueError, match="fixed decay"):
        fixed_decay_options(1.0)


def test_two_trials_it_cannot_tell_apart_go_to_the_cheaper_to_serve(tmp_path):
    inc = {"settings": {"mask_source": None}, "score": 0.10, "per_sequence": [0.10, 0.12, 0.08, 0.10]}
    fixed = {"settings": {"mask_source": "streaming"}, "score": 0.101, "per_sequence": [0.11, 0.11, 0.09, 0.094]}
    d = prefer(inc, fixed)
    assert not d["adopted"] and cannot_tell(d)  # the rule alone keeps the incumbent, silently by order

    def cost(s):
        return serve_cost(s, train_model=True)

    t = tie_break(d, inc, fixed, cost)
    assert t["adopted"] and t["cannot_tell"] and t["interval"][0] < 0 < t["interval"][1]
    assert not tie_break(d, fixed, inc, cost)["adopted"]  # the cheaper incumbent stays
    # a search records every such pair, with its interval and what was kept
    s = Search(tmp_path, log=lambda line: None, cost=cost)
    scores = {None: inc, "streaming": fixed}
    best = s.run_plan([Stage("a", [{"mask_source": None}], start={}), Stage("fixed_mask",
                                                                           [{"mask_source": "streaming"}])],
                      lambda st, d: {k: v for k, v in scores[st["mask_source"]].items() if k != "settings"})
    assert best["settings"] == {"mask_source": "streaming"}
    (c,) = s.record["cannot_tell"]
    assert c["kept"] == {"mask_source": "streaming"} and c["interval"] == t["interval"]
    # a difference the rule resolves is decided by it, not by cost
    better = {**inc, "per_sequence": [0.0, 0.02, 0.0, 0.01]}
    r = tie_break(prefer(fixed, better), fixed, better, cost)
    assert r["adopted"] and not r["cannot_tell"]


def test_power_says_what_the_select_part_resolves_and_needs():
    p = power(16, 0.02, target=0.005, spread_of="x")
    assert p["resolvable"] == pytest.approx(2 * 0.02 / 4) and p["detectable_80"] == pytest.approx(2.8 * 0.02 / 4)
    assert p["n_for_target"] == math.ceil((2.8 * 0.02 / 0.005) ** 2)
    assert power(1, 0.02, target=0.005, spread_of="x")["resolvable"] is None


def test_a_larger_validation_file_goes_to_the_select_part():
    keys = [str(i) for i in range(40)]
    fit, sel = split_keys(keys, 0, n_fit=8)
    assert len(fit) == 8 and len(sel) == 32 and not set(fit) & set(sel)
    assert split_keys(keys[:16], 0, n_fit=8) == split_keys(keys[:16], 0)  # 2 n or fewer: halves, as before


def test_an_edited_score_is_refused_naming_the_file():
    rec = {"settings": {}, "stage": "x", "score": 0.2, "steps": 1, "seconds": 1.0, "per_sequence": [0.1, 0.3]}
    check_record(rec, "t.json")
    with pytest.raises(ValueError, match=r"t\.json.*not the mean of its 2"):
        check_record({**rec, "score": 0.01}, "t.json")


def test_the_default_patience_given_explicitly_is_the_same_search():
    was = {"options": {"steps": 8, "auto_patience": None, "auto_eval_every": None}, "files": {}}
    now = {"options": {"steps": 8, "auto_patience": 2, "auto_eval_every": 2}, "files": {}}
    check_inputs(was, now, "t.json")
    assert effective_options(was["options"])["auto_patience"] == 2
    with pytest.raises(ValueError, match="auto-patience"):
        check_inputs(was, {"options": {**now["options"], "auto_patience": 3}, "files": {}}, "t.json")


def test_a_trial_missing_its_files_is_refused_before_out_is_touched(tmp_path):
    t = tmp_path / "auto" / "trial"
    t.mkdir(parents=True)
    (t / "args.json").write_text("{}")
    (t / "model").mkdir()
    with pytest.raises(ValueError, match="lacks scorers.safetensors"):
        _check_trial_files(t)
    (t / "scorers.safetensors").write_bytes(b"x")
    _check_trial_files(t)
    (t / "args.json").write_text('{"allocate": "ablation"}')  # an allocating trial needs its head budgets too
    with pytest.raises(ValueError, match="lacks head_budgets.json"):
        _check_trial_files(t)


@pytest.mark.parametrize("served_as,model,policy", [("fixed-finetune", "OUT/model", '"kvpop_policy": "streaming"'),
                                                    ("kvpop", "OUT/model", '"kvpop_scorers": "OUT/scorers')])
def test_the_last_line_says_how_to_evaluate_and_serve(served_as, model, policy):
    rec = {"chosen": {"settings": {"a": 1}, "served_as": served_as,
                      "cannot_tell": [{"a": {"a": 1}, "b": {"a": 2}, "interval": [-0.01, 0.02]}]}}
    line = next_steps(rec, out="OUT", source="SRC", budget=128, sinks=4, window=32, seq_len=1024, train_model=True)
    assert "kvpop eval --model SRC --run OUT --data TRACES.jsonl --seq-len 1024 --budgets 128" in line
    assert f"vllm serve {model} --hf-overrides" in line and policy in line
    assert "could not tell it from {'a': 2} (difference in [-0.0100, +0.0200])" in line
    scorer_only = next_steps({"chosen": {"settings": {}, "served_as": "kvpop"}}, out="OUT", source="SRC",
                             budget=128, sinks=4, window=32, seq_len=1024, train_model=False)
    assert "vllm serve SRC --hf-overrides" in scorer_only and "could not tell" not in scorer_only
