"""``kvpop demo --quick`` end to end (shipped models, PyTorch CPU path), and ``--select``."""
import json
import time
from pathlib import Path

import pytest

from kvpop.cli import main
from kvpop.demo.grid import JOINT_OF, RETROFITS
from kvpop.demo.search import CHOSEN, TASKS, label_variant
from kvpop.evaluation.evaluate import JOINT, LABEL_VARIANTS, POLICIES

RESULTS = Path(__file__).resolve().parents[2] / "kvpop" / "data" / "demo_results"


def _rows(res):
    return [(r["policy"], r["budget"], r["length"], r["accuracy"]) for r in res["rows"]]


@pytest.fixture(scope="module")
def lookahead_model(tmp_path_factory):
    """A tiny model of the lookahead task's vocabulary (one pre-training step: the demo's plumbing only)."""
    from kvpop.cli.pretrain import main as pretrain_main

    run = tmp_path_factory.mktemp("lookahead_run")
    tiny = ["--curriculum", "64:2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--intermediate", "32", "--eval-every", "1000", "--eval-n", "2", "--no-progress"]
    assert pretrain_main(["--task", "lookahead", "--out", str(run), "--steps", "1", *tiny]) == 0
    return run / "model_final"


def test_demo_quick_both_tasks_end_to_end_and_resume(tmp_path, capsys, lookahead_model):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--threads", "1", "--no-progress"]) == 0
    assert main(["demo", "--quick", "--task", "lookahead", "--model", str(lookahead_model), "--out", str(out),
                 "--threads", "1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    first = {}
    for task in TASKS:
        d = out / task
        res = json.loads((d / "results.json").read_text())
        first[task] = res
        assert res["split"] == "test" and res["train_len"] == 128 and res["demo"]["task"] == task
        assert 0.0 <= res["dense_accuracy"] <= 1.0
        # every policy; the joint retrofits on both label sources (the chosen one under the joint name)
        assert {r["policy"] for r in res["rows"]} == (set(POLICIES) - set(LABEL_VARIANTS)) | {
            label_variant(j, "teacher") for j in JOINT_OF}
        assert {r["length"] for r in res["rows"]} == {128, 256}
        assert {r["budget"] for r in res["rows"] if r["policy"] != "dense"} == {8, 16, 32}
        assert (d / "accuracy_vs_budget.png").read_bytes()[:4] == b"\x89PNG"
        for p in RETROFITS:
            assert (d / p / "done.json").exists()
            assert (d / p / "scorers.safetensors").exists() == (p != "fixed-finetune")
            assert (d / p / "model" / "model.safetensors").exists() == (p in JOINT or p == "fixed-finetune")
        assert (d / "dms" / "gates.safetensors").exists() and (d / "dms" / "model" / "model.safetensors").exists()
    assert "lookahead-trace" in first["lookahead"]["task"] and "kv-trace" in first["kvtrace"]["task"]
    assert printed.count("| kvpop-mlstm-joint |") == 4  # each task's accuracy table and decode table
    assert printed.count("| dms-test-calibrated |") == 2 * 6 + 2  # its dms.md rows and one accuracy row a task
    # resume: every part is reused, nothing is trained or measured again
    t0 = time.time()
    assert main(["demo", "--quick", "--task", "lookahead", "--model", str(lookahead_model), "--out", str(out),
                 "--threads", "1", "--no-progress", "--resume"]) == 0
    again = json.loads((out / "lookahead" / "results.json").read_text())
    assert _rows(again) == _rows(first["lookahead"])
    assert time.time() - t0 < 30


def test_select_quick_chooses_on_validation_sequences(tmp_path, capsys):
    out = tmp_path / "sel"
    assert main(["demo", "--quick", "--select", "--task", "kvtrace", "--out", str(out), "--no-progress"]) == 0
    sel = json.loads((out / "kvtrace" / "selection.json").read_text())
    assert sel["validation"]["split"] == "valid" and set(sel["chosen"]) == set(RETROFITS)
    by_policy = {}
    for c in sel["trials"]:
        by_policy.setdefault(c["policy"], []).append(c)
        assert set(c["val_accuracy"]) == {"8", "16", "32"}
        assert c["val_mean"] == pytest.approx(sum(c["val_accuracy"].values()) / 3)
    assert set(sel["split"]["fit"]).isdisjoint(sel["split"]["select"]) and len(sel["split"]["select"]) == 2
    for p, cs in by_policy.items():  # the choice is the rule's: the last decision, then the confirmation's
        assert all(len(c["per_sequence"]) == 2 for c in cs)
        ds = [d for d in sel["decisions"] if d["policy"] == p and d["stage"] != "confirmation"]
        conf = sel["confirmation"][p]
        if not ds:
            assert not conf["ran"] and sel["chosen"][p] == cs[0]["settings"]
            continue
        assert all(set(d) >= {"stage", "incumbent", "challenger", "mean_diff", "se", "margin", "adopted"} for d in ds)
        kept = ds[-1]["challenger"] if ds[-1]["adopted"] else ds[-1]["incumbent"]
        assert conf["ran"] and kept in [t["settings"] for t in conf["trials"]] and sel["chosen"][p] == conf["chosen"]
        assert [c["settings"].get("seed") for c in cs if c["stage"] == "confirmation"] == [1, 1]
    assert "chosen" in capsys.readouterr().out


def test_select_label_stage_then_the_demo_reuses_the_chosen_trials(tmp_path, capsys, monkeypatch):
    """``--select-stage label``: mean vs max label for each scorer-only retrofit, then fresh vs warm-started
    joint retrofits; a demo run in the same --out with those settings reuses the trials instead of training."""
    import kvpop.demo.search as S

    out = tmp_path / "sel"
    assert main(["demo", "--quick", "--select", "--select-stage", "label", "--task", "kvtrace", "--out", str(out),
                 "--no-progress"]) == 0
    sel = json.loads((out / "kvtrace" / "selection-label.json").read_text())
    by = {}
    for c in sel["trials"]:
        if c["stage"] != "confirmation":  # the second seed of the top two, after each retrofit's stages
            by.setdefault(c["policy"], []).append(c["settings"])
    for p in ("kvpop-mlp", "kvpop-mlstm"):
        assert sorted(c["label"] for c in by[p][:2]) == ["max", "mean"]
        assert all(c["eval_every"] == 50 for c in by[p])  # the kvtrace task's DEMO_GRID
        assert [c.get("head_budgets") for c in by[p]] == [None, None, "ablation"]  # after the label's choice
        ha = S.trial_dir(out / "kvtrace", p, by[p][-1])
        assert (ha / "head_budgets.json").exists() and not (S.trial_dir(out / "kvtrace", p, by[p][0])
                                                              / "head_budgets.json").exists()
    for j, sc in JOINT_OF.items():
        assert sorted(c["joint_init"] for c in by[j]) == ["fresh", "scorer-only"]
        assert all(c.get("head_budgets") == sel["chosen"][sc].get("head_budgets") for c in by[j])
        assert all(c["label"] == sel["chosen"][sc]["label"] for c in by[j])
    for p, c in sel["chosen"].items():  # the confirmation's choice of the top two by the rule
        if p != "fixed-finetune":
            conf = sel["confirmation"][p]
            assert conf["ran"] and c == conf["chosen"] and c in [t["settings"] for t in conf["trials"]]
    warm = S.trial_dir(out / "kvtrace", "kvpop-mlp-joint",
                        next(c for c in by["kvpop-mlp-joint"] if c["joint_init"] == "scorer-only"))
    assert "sha256" in json.loads((warm / "done.json").read_text())["settings"]["init_scorers"]
    capsys.readouterr()
    # the demo with the max-label settings of the trials: the scorer-only retrofits are adopted, not retrained
    monkeypatch.setattr(S, "QUICK", {**S.QUICK, "label": "max", "decay_span": None, "eval_every": 50, "patience": 0})
    assert main(["demo", "--quick", "--task", "kvtrace", "--out", str(out), "--no-progress", "--dms-steps", "0",
                 "--no-decode-check"]) == 0
    printed = capsys.readouterr().out
    for p in ("kvpop-mlp", "kvpop-mlstm"):
        assert f"retrofit {p}: 3 steps" in printed
        line = next(x for x in printed.splitlines() if f"retrofit {p}:" in x)
        assert "from the --select trial" in line and "label max" in line
    assert "from the --select trial" not in next(x for x in printed.splitlines() if "retrofit kvpop-mlp-joint:" in x)
    res = json.loads((out / "kvtrace" / "results.json").read_text())
    assert {r["policy"] for r in res["rows"]} >= {"kvpop-mlp", "kvpop-mlstm", "kvpop-mlp-joint"}


@pytest.mark.parametrize("task", ["kvtrace", "lookahead"])
def test_the_demo_defaults_are_the_shipped_validation_choice(task):
    """CHOSEN (the demo's defaults) is what `kvpop demo --select` chose, as recorded with its figures: the full
    grid's record, then each later stage's choice over it (the label family, then the label source)."""
    from kvpop.demo.search import selection_file

    chosen = {}
    for stage in ("all", "label", "target_source"):
        f = RESULTS / task / selection_file(stage)
        if f.exists():
            sel = json.loads(f.read_text())
            assert sel["validation"]["split"] == "valid"
            chosen.update(sel["chosen"])

    def norm(c):
        return {k: v if isinstance(v, str) or v is None else float(v) for k, v in c.items()}

    assert {p: norm(c) for p, c in chosen.items()} == {p: norm(c) for p, c in CHOSEN[task].items()}


def test_demo_bad_inputs(tmp_path, capsys, monkeypatch):
    x = str(tmp_path / "x")
    assert main(["demo", "--quick", "--task", "kvtrace", "--out", x, "--budgets", "5", "--no-progress"]) == 2
    assert "too small" in capsys.readouterr().err
    assert main(["demo", "--quick", "--out", x, "--steps", "0", "--no-progress"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["demo", "--quick", "--task", "all", "--out", x, "--model", x, "--no-progress"]) == 2
    assert "--model belongs to one task" in capsys.readouterr().err
    from kvpop.demo import lookahead_task

    with monkeypatch.context() as m:  # a task whose model is not shipped (none is missing today)
        m.setattr(lookahead_task, "SHIPPED_MODEL", tmp_path / "no-model")
        assert main(["demo", "--quick", "--task", "lookahead", "--out", x, "--no-progress"]) == 2
    assert "no shipped model yet" in capsys.readouterr().err
    assert main(["demo", "--quick", "--task", "kvtrace", "--out", x, "--train-budget", "3", "--no-progress"]) == 2
    assert "--train-budget 3 is too small" in capsys.readouterr().err


def test_adopting_a_trial_replaces_another_retrofit_and_keeps_the_same(tmp_path):
    import kvpop.demo.run as D
    from kvpop.demo.search import trial_dir

    c = {"steps": 3, "k": 4, "label": "max"}
    src = trial_dir(tmp_path, "kvpop-mlp", c)
    src.mkdir(parents=True)
    (src / "done.json").write_text(json.dumps({"settings": {"label": "max"}}))
    (src / "scorers.safetensors").write_bytes(b"new")
    dst = tmp_path / "kvpop-mlp"
    (dst / "done.json").write_text(json.dumps({"settings": {"label": "mean"}}))
    (dst / "head_budgets.json").write_text("{}")  # of the replaced retrofit: must not stay
    assert D.adopt_trial(tmp_path, "kvpop-mlp", c)
    assert (dst / "scorers.safetensors").read_bytes() == b"new" and not (dst / "head_budgets.json").exists()
    assert json.loads((dst / "done.json").read_text())["settings"] == {"label": "max"}
    (dst / "scorers.safetensors").write_bytes(b"kept")
    assert D.adopt_trial(tmp_path, "kvpop-mlp", c)  # the same retrofit: nothing copied again
    assert (dst / "scorers.safetensors").read_bytes() == b"kept"
    assert not D.adopt_trial(tmp_path, "kvpop-mlp", {**c, "k": 16})  # no such trial


def test_demo_with_head_adaptive_budgets_end_to_end(tmp_path, capsys, monkeypatch):
    """Retrofits with head-adaptive budgets through the whole demo: allocation, training, evaluation at every
    budget (re-budgeted by the saved importance), token-by-token decoding through the packed cache."""
    import kvpop.demo.search as S
    from kvpop.core.budgets import read_head_budgets

    monkeypatch.setattr(S, "QUICK", {**S.QUICK, "label": "max", "head_budgets": "ablation"})
    out = tmp_path / "ha"
    assert main(["demo", "--quick", "--task", "kvtrace", "--out", str(out), "--no-progress", "--dms-steps", "0"]) == 0
    d = out / "kvtrace"
    res = json.loads((d / "results.json").read_text())
    for p in ("kvpop-mlp", "kvpop-mlstm", "kvpop-mlp-joint", "kvpop-mlstm-joint"):
        rows = read_head_budgets(d / p / "head_budgets.json")["head_budgets"]
        assert sum(map(sum, rows)) == len(rows) * len(rows[0]) * res["demo"]["retrofit"][p]["settings"]["budget"]
        assert {r["budget"] for r in res["rows"] if r["policy"] == p} == {8, 16, 32}
    assert {r["policy"] for r in res["decode"]} >= {"kvpop-mlp", "kvpop-mlstm"}
    assert all(r["differ"] == 0 for r in res["decode"])  # decoding through the packed cache reads as the prefill
