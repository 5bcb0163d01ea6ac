"""studies.controls_synthetic: the controls' configs, the lr choice, the figures, the paired comparisons and the
tables (tiny records, no model)."""
import pytest

from kvpop.demo import task as T
from studies import controls_synthetic as C

S = {"sinks": 4, "window": 32, "train_length": 1024, "tau": 1.0}
ROW = {"policy": "kvpop-mlp-joint", "settings": {"steps": 100, "k": 4, "lr_scorer": 0.01, "lr_model": 1e-4,
                                                 "target_source": "teacher", "label": "max", "decay_span": None,
                                                 "eval_every": 0, "patience": 0, "joint_init": "fresh",
                                                 "head_budgets": "ablation"}}


def test_a_control_keeps_the_rows_recipe_but_its_priority():
    c = C.control_config(S, ROW, "keynorm-", 128, 1e-3, 2)
    assert (c.steps, c.length, c.sinks, c.window, c.label) == (100, 1024, 4, 32, "max")
    assert (c.budget, c.lr_model, c.seed, c.priority_source) == (128, 1e-3, 2, "keynorm-")
    assert c.head_allocation is None and c.target_source == "student" and c.train_model
    f = C.control_config(S, ROW, "streaming", 128, 1e-4, 1)
    assert (f.steps, f.budget, f.lr_model, f.seed, f.priority_source) == (100, 128, 1e-4, 1, "scorer")
    with pytest.raises(ValueError, match="priority_source must be one of"):
        C.control_config(S, ROW, "keynorm", 128, 1e-4, 0)


def test_the_lr_choice_keeps_the_incumbent_unless_clearly_better():
    tie = [{"settings": {"lr_model": 1e-4}, "per_sequence": [0.5, 0.6, 0.7], "score": 0.6},
           {"settings": {"lr_model": 1e-3}, "per_sequence": [0.5, 0.7, 0.7], "score": 0.63}]
    best, dec = C.lr_choice(tie, stage="s")
    assert best["settings"]["lr_model"] == 1e-4 and not dec[0]["adopted"]
    clear = [tie[0], {"settings": {"lr_model": 1e-3}, "per_sequence": [0.9, 0.99, 1.0], "score": 0.96}]
    best, dec = C.lr_choice(clear, stage="s")
    assert best["settings"]["lr_model"] == 1e-3 and dec[0]["adopted"] and dec[0]["stage"] == "s"


def _runs():
    return {"kv": {"0": {"per_sequence": [1.0, 1.0, 0.9, 1.0]}, "1": {"per_sequence": [1.0, 0.95, 1.0, 1.0]}},
            "ctl": {"0": {"per_sequence": [0.1, 0.0, 0.2, 0.1]}, "1": {"per_sequence": [0.1, 0.1, 0.0, 0.2]}},
            "same": {"0": {"per_sequence": [1.0, 0.95, 1.0, 0.9]}}}


def test_figures_and_comparisons():
    figs = {f["row"]: f for f in C.figures(_runs())}
    assert figs["kv"]["per_seed"] == {"0": pytest.approx(0.975), "1": pytest.approx(0.9875)}
    assert figs["kv"]["mean"] == pytest.approx(0.98125) and figs["same"]["seeds"] == ["0"]
    cs = {c["b"]: c for c in C.comparisons("kvtrace", 128, _runs(), "kv", n_boot=500)}
    assert set(cs) == {"ctl", "same"}
    assert cs["ctl"]["mean_diff"] == pytest.approx(0.98125 - 0.1) and cs["ctl"]["verdict"] == "a better"
    assert cs["ctl"]["lower_is_better"] is False and cs["ctl"]["budget"] == 128
    only = C.comparisons("kvtrace", 128, _runs(), "ctl", against=("kv",), n_boot=500)
    assert [c["b"] for c in only] == ["kv"] and only[0]["verdict"] == "b better"


def test_the_tables_come_from_the_record():
    runs = _runs()
    rec = {"settings": {"budget": 128}, "dense": {"per_sequence": [1.0, 1.0, 1.0, 1.0]},
           "kvpop_row": {"name": "kv", "settings": {"lr_model": 1e-4}},
           "lr_selection": {"ctl": {"chosen": 1e-3, "decisions": [
               {"stage": "ctl lr_model", "incumbent": {"lr_model": 1e-4}, "challenger": {"lr_model": 1e-3},
                "mean_diff": 0.2, "se": 0.01, "adopted": True}]}},
           "untrained": {"keynorm_sign": None}, "figures": C.figures(runs),
           "comparisons": C.comparisons("kvtrace", 128, runs, "kv", n_boot=200), "oracle_against_control": []}
    md = C.markdown(rec)
    assert "| kv | 0.0001 | 2 | 0.9812 | 0.9750, 0.9875 |" in md
    assert "| ctl | 0.001 | 2 | 0.1000 |" in md and "| dense | - | - | 1.0000 |" in md
    assert "| ctl lr_model |" in md and "| yes |" in md
    assert "| kv | ctl | +0.8812 |" in md and "a better" in md


@pytest.mark.parametrize(("argv", "msg"), [(["--seeds", "1,2"], "must list seed 0"),
                                           (["--n-valid", "1"], "--n-valid must be >= 2")])
def test_bad_options(tmp_path, capsys, argv, msg):
    assert C.main(["--task", "kvtrace", "--out", str(tmp_path / "o"), *argv]) == 2
    assert msg in capsys.readouterr().err


def test_record_only_trains_and_scores_nothing_and_names_what_is_missing(tmp_path):
    rec = C.run_stage("kvtrace", tmp_path / "o", seeds=(0, 1), n_valid=2, train=False)
    assert (tmp_path / "o" / "controls.json").exists() and not (tmp_path / "o" / "scores").exists()
    assert rec["runs"] == {} and rec["comparisons"] == [] and rec["dense"] is None
    assert rec["kvpop_row"]["name"] == "kvpop-mlp-joint[paper]" and rec["kvpop_row"]["trained_at"] == 40
    assert rec["settings"]["budget"] == 128 and len(rec["split"]["fit"]) == len(rec["split"]["select"]) == 2
    assert "score untrained[keynorm+]" in rec["missing"]
    assert "fixed-finetune[keynorm] (its sign is not chosen yet)" in rec["missing"]
    assert "kvpop-mlp-joint[paper] seed 1 (not trained)" in rec["missing"]
    assert "oracle[label] lr0.0001 seed 0 (not trained)" in rec["missing"]
    assert "dms[tuned] seed 1 (not trained)" in rec["missing"]
    assert rec["split"]["dms_threshold_on"] == [T.valid_seed(2000), T.valid_seed(2001)]


def test_the_dms_settings_are_the_ledgers_choice():
    import json

    from studies.paths import RESULTS_DIR

    for task in ("kvtrace", "lookahead"):
        sel = json.loads((RESULTS_DIR / "evidence" / task / "selection.json").read_text())
        assert C.dms_settings(task) == sel["dms"]["chosen"]["settings"]
