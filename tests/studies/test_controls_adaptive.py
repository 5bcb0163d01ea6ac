"""studies.controls_adaptive: the controls get the KVpop row's per-head budgets, the key norm's sign from
controls.json, a test split disjoint from every earlier one, and no write into studies/results without
--write-shipped (no model trained)."""
import json
from pathlib import Path

import pytest

from studies import controls_adaptive as A
from studies import controls_synthetic as C
from studies.paths import RESULTS_DIR

S = {"sinks": 4, "window": 32, "train_length": 512, "tau": 1.0}
ROW = {"policy": "kvpop-mlp-joint", "settings": {"steps": 200, "k": 12, "lr_scorer": 0.003, "lr_model": 1e-4,
                                                 "target_source": "teacher", "label": "max", "decay_span": None,
                                                 "eval_every": 0, "patience": 0, "joint_init": "fresh",
                                                 "head_budgets": "ablation"}}
ROWS = [[141, 36], [43, 36]]  # 2 layers x 2 KV heads, mean 64
PLAN = {"rows": ROWS, "importance": [[0.26, 0.0], [0.017, 0.0008]], "min_k": 0, "granularity": 1,
        "from": "kvpop/seed0/head_budgets.json", "measured_on": {"rule": "ablation"}, "trained_rows": [[81, 36],
                                                                                                      [39, 36]]}


def test_the_split_is_fresh():
    assert (A.FIRST, A.N_TEST) == (40_000, 128)
    A.check_disjoint(A.FIRST, A.N_TEST, A.earlier())  # no error
    ranges = A.earlier()
    assert (20_000, 20_127) in ranges and (10_000, 10_007) in ranges and ranges[0][0] == 0
    for first in (0, 10_000, 20_000, 20_100):
        with pytest.raises(ValueError, match="meets the earlier"):
            A.check_disjoint(first, A.N_TEST, ranges)


def test_the_controls_and_the_keynorm_sign_come_from_controls_json():
    src = A.control_sources({"untrained": {"keynorm_chosen": "keynorm+"}})
    assert src == {"fixed-finetune[random]": "random", "fixed-finetune[keynorm]": "keynorm+",
                   "oracle[label]": "oracle-label"}
    assert A.control_sources({"untrained": {"keynorm_chosen": "keynorm-"}})["fixed-finetune[keynorm]"] == "keynorm-"
    with pytest.raises(ValueError, match="no key-norm sign"):
        A.control_sources({"untrained": {"keynorm_chosen": None}})
    assert "fixed-finetune[window-attention]" in A.NOT_RUN and "fixed-finetune[window-attention]" not in A.ADAPTIVE
    assert A.NOT_CAUSAL == ("oracle[label]",)


def test_a_controls_config_holds_the_rows_and_its_priority():
    cfg = C.control_config(S, ROW, "keynorm+", 64, 1e-3, 1)
    kv = A.adaptive_kv(ROW["policy"], cfg, ROWS)
    assert kv.head_budgets == ((141, 36), (43, 36)) and kv.budget == 64
    assert kv.priority_source == "keynorm+" and (kv.sinks, kv.window, kv.label) == (4, 32, "max")


def test_train_adaptive_trains_with_the_given_rows(tmp_path, monkeypatch):
    from kvpop.demo import retrofit as R

    seen = {}

    def fake_run(base, d, settings, cfg, attach, save, train_model, rseed, **kw):
        seen.update(settings=settings, cfg=cfg, train_model=train_model, rseed=rseed)
        attach("model")
        return Path(d)

    monkeypatch.setattr(R, "_run", fake_run)
    monkeypatch.setattr(R, "patch", lambda m, kv: seen.setdefault("kv", kv))
    cfg = C.control_config(S, ROW, "oracle-label", 64, 1e-4, 2)
    A.train_adaptive(None, ROW["policy"], tmp_path / "run", cfg, ROWS, PLAN, None)
    assert seen["kv"].head_budgets == ((141, 36), (43, 36)) and seen["kv"].priority_source == "oracle-label"
    assert seen["settings"]["head_budgets"] == ROWS and seen["settings"]["priority_source"] == "oracle-label"
    assert seen["settings"]["seed"] == 2 and seen["train_model"]
    assert seen["rseed"] == R.retrofit_seed(ROW["policy"], 2)
    hb = json.loads((tmp_path / "run" / "head_budgets.json").read_text())
    assert hb["head_budgets"] == ROWS and hb["budget"] == 64 and hb["importance"] == PLAN["importance"]
    with pytest.raises(ValueError, match="head_allocation"):
        from dataclasses import replace

        A.train_adaptive(None, ROW["policy"], tmp_path / "x", replace(cfg, priority_source="random",
                                                                      head_allocation="ablation"), ROWS, PLAN, None)


def test_every_control_of_the_stage_gets_the_kvpop_rows(tmp_path, monkeypatch):
    st = A.AdaptiveStage.__new__(A.AdaptiveStage)
    st.out, st.s, st.row, st.budget, st.train, st.missing, st.mod, st.base = tmp_path, S, ROW, 64, True, [], None, None
    st.plan, st.task = PLAN, "lookahead"
    got = []

    def fake_train(base, policy, d, cfg, rows, plan, mod):
        got.append((cfg.priority_source, cfg.lr_model, cfg.seed, cfg.budget, rows))
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / "done.json").write_text(json.dumps({"settings": {"head_budgets": rows}}))

    monkeypatch.setattr(A, "train_adaptive", fake_train)
    monkeypatch.setattr(A.AdaptiveStage, "score", lambda self, tag, make, policy: {"per_sequence": [1.0, 0.5],
                                                                                   "tag": tag})
    r = st.control("fixed-finetune[random]", "random", 1e-3, 2)
    assert got == [("random", 1e-3, 2, 64, ROWS)]
    assert r["tag"] == "fixed-finetune[random]/lr0.001/seed2" and r["settings"]["head_budgets"] == ROWS


def test_serving_refuses_other_rows(monkeypatch):
    st = A.AdaptiveStage.__new__(A.AdaptiveStage)
    st.plan, st.pm, st.base = PLAN, {}, None

    class S_:
        @staticmethod
        def policy_model(E, base, policy, d, pm):
            return "m"

    st.S, st.E = S_, None
    monkeypatch.setattr(A, "served_rows", lambda m: ((141, 36), (43, 36)))
    assert st.served("kvpop-mlp-joint", "d") == "m"
    monkeypatch.setattr(A, "served_rows", lambda m: None)  # uniform
    with pytest.raises(ValueError, match="not the KVpop row's"):
        st.served("kvpop-mlp-joint", "d")


def test_intervals_carry_the_seed_level_check():
    runs = {"kv": {s: {"per_sequence": [1.0, 1.0, 0.9, 1.0]} for s in "012"},
            "ctl": {s: {"per_sequence": [0.1, 0.0, 0.2 + int(s) / 10, 0.1]} for s in "012"},
            "dense": {"0": {"per_sequence": [1.0] * 4}}}
    cs = A.intervals(runs, "kv", 64, n_boot=300)
    assert [c["b"] for c in cs] == ["ctl"]
    c = cs[0]
    assert c["verdict"] == "a better" and c["seed_t"]["n_seeds"] == 3 and c["split"] == A.SPLIT
    assert c["strength"].startswith("a better") and c["not_causal_b"] is False


def test_no_write_into_the_shipped_results_without_the_flag(capsys, tmp_path):
    target = RESULTS_DIR / "evidence" / "lookahead" / "adaptive_should_not_exist"
    with pytest.raises(SystemExit) as e:
        A.main(["--out", str(target)])
    assert e.value.code == 2 and "--write-shipped" in capsys.readouterr().err
    assert not target.exists()
    with pytest.raises(SystemExit):
        A.main(["--out", str(tmp_path / "x"), "--record", str(RESULTS_DIR / "evidence" / "lookahead" / "nope.json")])
    assert not (tmp_path / "x").exists() and not (RESULTS_DIR / "evidence" / "lookahead" / "nope.json").exists()


def test_the_shipped_record_and_its_tables_agree():
    f = RESULTS_DIR / "evidence" / "lookahead" / "controls_adaptive.json"
    rec = json.loads(f.read_text())
    assert f.with_suffix(".md").read_text() == A.markdown(rec)
    assert rec["split"] == A.SPLIT and rec["test_sequences"] == "test_seed(40000..40127)"
    assert all(v == 1 for v in rec["scorings"].values())
    rows = rec["head_budgets"]["served_rows"]
    for row in A.ADAPTIVE:
        for run in rec["runs"][row].values():
            assert run["settings"]["head_budgets"] == rows and len(run["per_sequence"]) == 128
