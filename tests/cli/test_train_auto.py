"""``kvpop train --auto``: the staged search on validation sequences, its record, the run it leaves, resuming
without repeating a finished trial, and its refusals; ``--preset paper``."""
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from tiny import tiny_model  # noqa: E402

from kvpop.cli import main  # noqa: E402
from kvpop.training.auto import PAPER, oracle_excess, parse_budget, preset_values, train_budgets  # noqa: E402

# the shipped tiny model on the task at S = 96 > budget 32; two validation sequences
QUICK = ["--auto", "--task", "--seq-len", "96", "--budget", "32", "--sinks", "2", "--window", "8",
         "--valid-sequences", "2", "--no-progress"]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _trials(out):
    return json.loads((Path(out) / "selection.json").read_text())["trials"]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto") / "run"
    assert main(["train", *QUICK, "--steps", "2", "--auto-budget", "4", "--out", str(out)]) == 0
    return out


def test_auto_writes_a_selection_and_a_run_kvpop_eval_serves(searched, tmp_path):
    rec = json.loads((searched / "selection.json").read_text())
    trained = [t for t in rec["trials"] if t["steps"] and t["stage"] != "confirmation"]
    assert [t["stage"] for t in rec["trials"] if not t["steps"]] == ["label", "label"]  # the oracle: no training
    assert len(trained) == 2 and all(t["steps"] == 2 for t in trained)  # the budget: 4 steps of 2-step trials
    assert [t["settings"]["lm_weight"] for t in trained] == [0.0, 0.1]  # the first stage: the next-token loss
    for t in rec["trials"]:
        assert set(t) >= {"stage", "settings", "score", "steps", "seconds"} and t["score"] == t["score"]
    # with --task the trained trials are scored by the task's own measure: the error rate at its graded positions
    assert rec["criterion"].startswith("validation error rate at the task's graded positions")
    assert all(0.0 <= t["score"] <= 1.0 for t in trained)
    # the rule: the second weight replaces the first only when the paired decision adopts it
    sel = rec["split"]["select"]
    assert set(sel).isdisjoint(rec["split"]["fit"]) and len(sel) == len(rec["split"]["fit"]) == 2
    assert all(len(t["per_sequence"]) == len(sel) for t in rec["trials"])
    (d,) = [d for d in rec["decisions"] if d["stage"] == "lm_weight"]
    assert set(d) >= {"stage", "incumbent", "challenger", "mean_diff", "se", "margin", "adopted"}
    best = trained[1] if d["adopted"] else trained[0]
    assert rec["chosen"]["settings"] == best["settings"] and rec["chosen"]["score"] == best["score"]
    # the confirmation's two trials of 2 steps do not fit the budget of 4: said, with what to raise
    assert not rec["confirmation"]["ran"] and "raise --auto-budget to" in rec["confirmation"]["why"]
    assert rec["summary"]["ran"] == ["label"] and rec["summary"]["partly_skipped_for_budget"] == ["lm_weight"]
    assert "fixed_mask" in rec["summary"]["skipped_for_budget"] and "--auto-budget" in rec["summary"]["raise"]
    assert [s["stage"] for s in rec["skipped"]][:1] == ["lm_weight"]  # the budget was spent before the third trial
    assert rec["skipped"][0]["settings"]["lm_weight"] == 1.0 and rec["served_budget"] == 32
    # OUT is the chosen trial's run: its scorers, and kvpop eval --run takes it with no other flag
    assert (searched / "scorers.safetensors").read_bytes() == \
        (searched / best["dir"] / "scorers.safetensors").read_bytes()
    ev = tmp_path / "eval"
    assert main(["eval", "--run", str(searched), "--train-len", "96", "--lengths", "96", "--budgets", "32",
                 "--n-sequences", "1", "--policies", "kvpop-mlp-joint", "--no-plot", "--no-progress",
                 "--out", str(ev)]) == 0
    rows = json.loads((ev / "results.json").read_text())["rows"]
    assert any(r["policy"] == "kvpop-mlp-joint" for r in rows)


def test_resume_continues_without_repeating_a_finished_trial(searched, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(searched, out)
    before = {t["dir"]: (out / t["dir"] / "trial.json").stat().st_mtime_ns for t in _trials(out)}
    with pytest.raises(SystemExit, match="already holds a search"):
        main(["train", *QUICK, "--steps", "2", "--auto-budget", "6", "--out", str(out)])
    assert main(["train", *QUICK, "--steps", "2", "--auto-budget", "6", "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr()
    assert "(reused)" in printed.err
    # stdout says what ran: the split, the stages run and skipped for the budget, and what to raise
    assert "validation split: 2 fit sequences" in printed.out and "2 select sequences" in printed.out
    assert "stages skipped for the budget: fixed_decay, fixed_mask, head_budgets" in printed.out
    assert "raise --auto-budget to" in printed.out
    assert "confirmation not run" in printed.out
    trials = _trials(out)
    assert {t["dir"]: (out / t["dir"] / "trial.json").stat().st_mtime_ns for t in trials
            if t["dir"] in before} == before  # none trained or scored again
    assert [t["stage"] for t in trials if t["steps"]] == ["lm_weight", "lm_weight", "lm_weight"]
    assert trials[-1]["settings"]["lm_weight"] == 1.0


@pytest.mark.parametrize("extra, message", [
    (["--auto-budget", "many"], "give trained steps"),
    (["--auto-budget", "1"], "fewer steps than one trial's --steps 2"),
    (["--auto-budget", "0m"], "minutes must be > 0"),
    (["--auto-budget", "2.5"], "must be an integer"),
    (["--preset", "paper"], "--preset paper fixes the settings --auto chooses"),
    (["--head-budgets", "x.json"], "leave out --head-budgets"),
    (["--method", "dms"], "--method kvpop"),
])
def test_auto_refuses_bad_options(tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", *QUICK, "--steps", "2", *extra, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o" / "selection.json").exists()


def test_auto_refusals_outside_the_task(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(100))}) + "\n")
    with pytest.raises(SystemExit, match="give --valid-data"):
        main(["train", "--auto", "--data", str(data), "--seq-len", "64", "--budget", "32",
              "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="instead of --tiny"):
        main(["train", "--auto", "--tiny", "--task", "--seq-len", "64", "--budget", "32",
              "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="--auto-budget 40 is an option of --auto"):
        main(["train", "--task", "--auto-budget", "40", "--out", str(tmp_path / "o")])


def test_train_budgets_are_tighter_than_the_served_one():
    assert train_budgets(128, 4, 32) == [4 + 32 + 23, 4 + 32 + 5]  # k = 92: k // 4, k // 16
    assert train_budgets(64, 4, 32) == [4 + 32 + 7, 4 + 32 + 1]  # k = 28: k // 16 = 1 slot
    assert train_budgets(40, 4, 32) == [4 + 32 + 1]  # k = 4: one candidate (k // 4 = k // 16 -> 1)
    assert train_budgets(37, 4, 32) == []  # k = 1: nothing tighter


@pytest.mark.parametrize("allocate", [False, True])
def test_a_run_trained_tighter_is_adopted_at_the_served_budget(tmp_path, allocate):
    """The chosen trial trained at budget 15 is served at the search's budget 32: its scorer file says 32 (the
    weights unchanged), head-adaptive rows are shared anew by their importance and written beside it."""
    from safetensors.torch import load_file

    from kvpop.core.budgets import read_head_budgets
    from kvpop.core.checkpoint import read_scorer_config
    from kvpop.training.auto import _adopt

    trial, out = tmp_path / "trial", tmp_path / "out"
    extra = ["--allocate", "ablation", "--valid-sequences", "1"] if allocate else []
    assert main(["train", "--task", "--seq-len", "96", "--budget", "15", "--sinks", "2", "--window", "8", "--steps",
                 "1", "--no-train-model", "--no-progress", *extra, "--out", str(trial)]) == 0
    out.mkdir()
    _adopt(out, trial, 32)
    got, trained = read_scorer_config(out / "scorers.safetensors"), read_scorer_config(trial / "scorers.safetensors")
    assert trained.budget == 15 and got.budget == 32
    assert got.replace(budget=15, head_budgets=trained.head_budgets) == trained  # nothing else changed
    a, b = load_file(str(out / "scorers.safetensors")), load_file(str(trial / "scorers.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    if allocate:
        rows = got.head_budgets
        assert sum(map(sum, rows)) == 32 * len(rows) * len(rows[0]) and rows != trained.head_budgets
        plan = read_head_budgets(out / "head_budgets.json")
        assert [tuple(r) for r in plan["head_budgets"]] == [tuple(r) for r in rows]
        assert plan["importance"] == read_head_budgets(trial / "head_budgets.json")["importance"]
    else:
        assert got.head_budgets is None
    _adopt(out, trial, 15)  # adopted again at its own budget: the trial's file as it is
    assert (out / "scorers.safetensors").read_bytes() == (trial / "scorers.safetensors").read_bytes()


def test_rewrite_scorer_config_refuses_another_structure(tmp_path):
    from kvpop.core.checkpoint import read_scorer_config, rewrite_scorer_config

    f = tmp_path / "s.safetensors"
    m = tiny_model()
    import kvpop

    kvpop.patch(m, sinks=2, window=8, budget=16)
    kvpop.save_scorers(m, f)
    with pytest.raises(ValueError, match="scorer_hidden"):
        rewrite_scorer_config(f, read_scorer_config(f).replace(scorer_hidden=7))
    with pytest.raises(TypeError, match="KVpopConfig"):
        rewrite_scorer_config(f, {"budget": 3})
    rewrite_scorer_config(f, read_scorer_config(f).replace(budget=20))
    assert read_scorer_config(f).budget == 20


def test_parse_budget():
    assert parse_budget("400", 20) == ("steps", 400.0)
    assert parse_budget("30m", 20) == ("minutes", 30.0) == parse_budget("30min", 20)
    assert parse_budget(None, 20) == ("steps", 160.0)  # eight trials of --steps
    with pytest.raises(ValueError, match="give at least 40"):
        parse_budget("10", 20)


def test_preset_paper_sets_the_paper_method_and_refuses_a_contradiction():
    given = {**{k: None for k in PAPER}, "allocate": None, "head_budgets": None}
    ns = preset_values("paper", given)
    assert (ns["label"], ns["gamma_min"], ns["gamma_init"], ns["target_source"], ns["target_lse"]) == \
        ("mean", 0.999, 0.9999, "student", "sparse")
    assert "decay_nats" not in ns and preset_values(None, given) == {}
    with pytest.raises(ValueError, match="--label max contradicts it"):
        preset_values("paper", {**given, "label": "max"})
    with pytest.raises(ValueError, match="uniform budgets"):
        preset_values("paper", {**given, "allocate": "ablation"})


def test_preset_paper_trains_the_paper_config(tmp_path):
    out = tmp_path / "p"
    assert main(["train", "--tiny", "--task", "--preset", "paper", "--seq-len", "64", "--budget", "24", "--sinks", "2",
                 "--window", "8", "--steps", "1", "--no-progress", "--no-train-model", "--out", str(out)]) == 0
    from kvpop.core.checkpoint import read_scorer_config

    cfg = read_scorer_config(out / "scorers.safetensors")
    assert (cfg.label, cfg.gamma_min, cfg.gamma_max, cfg.target_source) == ("mean", 0.999, 0.999999, "student")


def test_oracle_excess_is_zero_when_nothing_is_evicted_and_positive_when_much_is():
    import torch

    from kvpop.core.config import KVpopConfig

    model = tiny_model().train()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (40,), generator=g) for _ in range(2)]
    assert oracle_excess(model, seqs, KVpopConfig(budget=64, sinks=2, window=8)) == pytest.approx(0.0, abs=1e-6)
    tight = oracle_excess(model, seqs, KVpopConfig(budget=11, sinks=2, window=8))
    assert tight > 1e-4
    assert model.training  # its mode restored


def _tensors(f):
    from safetensors.torch import load_file

    return load_file(str(f))


def test_init_scorers_starts_from_the_file_and_refuses_what_does_not_fit(tmp_path):
    """``kvpop train --init-scorers``: a run whose scorer lr is too small to move them (1 step of 1e-12) ends
    with the file's scorers, not its own seeded ones; a missing file and another structure are refused."""
    base = ["train", "--task", "--seq-len", "96", "--budget", "32", "--sinks", "2", "--window", "8", "--steps", "1",
            "--no-progress"]
    assert main([*base, "--no-train-model", "--seed", "3", "--lr-scorer", "1e-2", "--out", str(tmp_path / "a")]) == 0
    src = tmp_path / "a" / "scorers.safetensors"
    for init, out in ((["--init-scorers", str(src)], "b"), ([], "c")):
        assert main([*base, "--lr-scorer", "1e-12", "--lr-model", "1e-12", *init, "--out", str(tmp_path / out)]) == 0
    a, b, c = (_tensors(tmp_path / x / "scorers.safetensors") for x in "abc")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    assert any((a[k] - c[k]).abs().max() > 1e-3 for k in a)  # the seeded start differs: the test can fail
    with pytest.raises(SystemExit, match="--init-scorers .*no such file"):
        main([*base, "--init-scorers", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "d")])
    with pytest.raises(SystemExit, match="--init-scorers .*scorer_hidden"):
        main([*base, "--scorer-hidden", "7", "--init-scorers", str(src), "--out", str(tmp_path / "e")])


def test_a_run_extended_by_resume_equals_the_uninterrupted_run(tmp_path):
    """What --auto's early stopping relies on: 2 steps, then --resume to 4, are the 4-step run bit for bit."""
    base = ["train", "--task", "--seq-len", "96", "--budget", "32", "--sinks", "2", "--window", "8", "--no-progress"]
    assert main([*base, "--steps", "4", "--out", str(tmp_path / "full")]) == 0
    assert main([*base, "--steps", "2", "--out", str(tmp_path / "seg")]) == 0
    assert main([*base, "--steps", "4", "--resume", "--out", str(tmp_path / "seg")]) == 0
    a, b = _tensors(tmp_path / "full" / "scorers.safetensors"), _tensors(tmp_path / "seg" / "scorers.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_early_stopping_gives_a_tie_to_the_later_state(tmp_path, monkeypatch):
    """The one tie rule (a tie goes to the default): between trials the incumbent, in early stopping the run as
    long as asked, so an equal later fit score replaces the kept state."""
    import kvpop.cli.auto as A
    from kvpop.training.runstate import output_step

    seq = iter([0.5, 0.5, 0.6, 0.6] * 50)  # per trial: equal at steps 1 and 2, then worse twice
    monkeypatch.setattr(A, "_task_scorer", lambda source, task, seeds, length, budget:
                        lambda d, part: [next(seq)] * 2 if part == "fit" else [0.3, 0.2])
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--steps", "4", "--auto-patience", "2", "--auto-eval-every", "1", "--label", "mean",
                 "--lr-scorer", "1e-3", "--decay-nats", "8", "--allocate", "ablation", "--target-source", "student",
                 "--auto-budget", "4", "--out", str(out)]) == 0
    t = json.loads((out / "selection.json").read_text())["trials"][0]
    assert [v["fit_score"] for v in t["validations"]] == [0.5, 0.5, 0.6, 0.6] and t["best_step"] == 2
    assert output_step(out / t["dir"] / "scorers.safetensors") == 2


def test_early_stopping_keeps_the_best_validated_state_and_the_warm_start_stage(tmp_path, monkeypatch):
    """Early stopping: each trial validated every --auto-eval-every steps, stopped after a validation without a
    better or equal score, its outputs the best step's; the last stage trains a scorer-only run first and starts
    the joint run from its scorers. The validation scores are made up (a fixed sequence per trial) so the test
    knows where each trial must stop."""
    import kvpop.cli.auto as A
    from kvpop.training.runstate import output_step

    seq = iter([0.5, 0.4, 0.45] * 50)  # per trial: better, then worse -> stops after 2 of 4 validations
    parts = []

    def score(d, part):
        parts.append(part)
        return [next(seq)] * 2 if part == "fit" else [0.3, 0.2]  # the select part scores every trial alike

    monkeypatch.setattr(A, "_task_scorer", lambda source, task, seeds, length, budget: score)
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--steps", "4", "--auto-patience", "1", "--auto-eval-every", "1", "--label", "mean",
                 "--lr-scorer", "1e-3", "--decay-nats", "8", "--allocate", "ablation", "--target-source", "student",
                 "--mask-source", "scorer", "--lm-weight", "0.1", "--auto-budget", "40", "--out", str(out)]) == 0
    rec = json.loads((out / "selection.json").read_text())
    assert [t["stage"] for t in rec["trials"]] == ["train_budget", "train_budget", "train_budget", "warm_start",
                                                   "confirmation", "confirmation"]
    for t in rec["trials"][:3]:
        assert [v["step"] for v in t["validations"]] == [1, 2, 3] and t["best_step"] == 2 and t["steps"] == 3
        assert [v["fit_score"] for v in t["validations"]] == [0.5, 0.4, 0.45]  # early stopping on the fit part
        assert t["per_sequence"] == [0.3, 0.2] and t["score"] == 0.25  # the best fit state scored once on select
        assert output_step(out / t["dir"] / "scorers.safetensors") == 2  # the best state, not the last
        assert output_step(out / t["dir"] / "model") == 2
    assert parts[:4] == ["fit", "fit", "fit", "select"]
    # equal select scores: no challenger adopted, the first trial stays, confirmed against the runner-up
    assert not any(d["adopted"] for d in rec["decisions"])
    conf = rec["confirmation"]
    assert conf["ran"] and conf["seed"] == 1 and [t["settings"] for t in conf["trials"]] == \
        [rec["trials"][0]["settings"], rec["trials"][1]["settings"]]
    assert [t["settings"]["seed"] for t in rec["trials"][4:]] == [1, 1]
    assert conf["chosen"] == rec["trials"][0]["settings"]
    warm = rec["trials"][3]
    assert warm["settings"]["warm_start"] == "scorer-only" and warm["steps"] == 6  # 3 scorer-only + 3 joint
    assert warm["scorer_only"]["best_step"] == 2
    args = json.loads((out / warm["dir"] / "args.json").read_text())
    assert args["init_scorers"].endswith("scorer-only/scorers.safetensors") and not args["no_train_model"]
    assert json.loads((out / warm["dir"] / "scorer-only" / "args.json").read_text())["no_train_model"]
    # OUT, a trial stopped early (its outputs of step 2, its last.pt of step 3), is served by kvpop eval --run
    assert output_step(out / "scorers.safetensors") == 2 and rec["chosen"]["dir"] == rec["trials"][0]["dir"]
    assert main(["eval", "--run", str(out), "--train-len", "96", "--lengths", "96", "--budgets", "32",
                 "--n-sequences", "1", "--policies", "kvpop-mlp-joint", "--no-plot", "--no-progress",
                 "--out", str(tmp_path / "ev")]) == 0
    # refusals
    with pytest.raises(SystemExit, match="--auto-eval-every 2 is the validation interval of early stopping"):
        main(["train", *QUICK, "--steps", "4", "--auto-eval-every", "2", "--auto-patience", "0",
              "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--auto-patience 1 is an option of --auto"):
        main(["train", "--task", "--steps", "4", "--auto-patience", "1", "--out", str(tmp_path / "x")])


def test_the_fixed_mask_fine_tune_is_chosen_where_it_wins(tmp_path, monkeypatch, capsys):
    """The ``fixed_mask`` stage: the same fine-tune under the fixed StreamingLLM mask, after the next-token loss
    and the fixed decay; when it wins by the rule on the select part, the learned scorer's own stages do not run, the
    record says it is served as ``fixed-finetune``, stdout says how to serve it, and ``kvpop eval --run OUT``
    serves it as that (the model fine-tuned, the fixed mask)."""
    import kvpop.cli.auto as A
    from kvpop.cli.trained import read_run

    def score(d, part):  # the fixed-mask trial is better on every select sequence
        fixed = json.loads((Path(d) / "args.json").read_text())["mask_source"] == "streaming"
        return [0.1, 0.2] if fixed else [0.3, 0.4]

    monkeypatch.setattr(A, "_task_scorer", lambda source, task, seeds, length, budget: score)
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--steps", "2", "--auto-patience", "0", "--label", "mean", "--lr-scorer", "1e-3",
                 "--auto-budget", "30", "--out", str(out)]) == 0
    rec = json.loads((out / "selection.json").read_text())
    assert [t["stage"] for t in rec["trials"]][:6] == ["lm_weight"] * 3 + ["fixed_decay"] * 2 + ["fixed_mask"]
    assert rec["trials"][5]["settings"]["mask_source"] == "streaming"
    (d,) = [d for d in rec["decisions"] if d["stage"] == "fixed_mask"]
    assert d["adopted"]
    status = {s["stage"]: s["status"] for s in rec["stages"]}
    assert status["target_source"] == status["decay"] == status["warm_start"] == "not applicable"
    assert status["head_budgets"] == "not applicable"  # the fixed mask serves uniform slots (--lr-scorer is given)
    assert status["lm_weight"] == status["train_budget"] == "ran"  # they change the fine-tune
    assert rec["chosen"]["served_as"] == "fixed-finetune" and rec["chosen"]["settings"]["mask_source"] == "streaming"
    printed = capsys.readouterr()
    assert "stages not run, as they could change nothing served under the choice (the fixed mask, or a fixed " \
        "decay for the decay range): head_budgets, target_source, decay, warm_start" in printed.out
    assert '"kvpop_policy": "streaming"' in printed.err  # the search's log, beside its trials'
    assert "no learned eviction beat the same fine-tune under the fixed StreamingLLM mask" in printed.err
    assert read_run(str(out)).policy == "fixed-finetune"
    assert main(["eval", "--run", str(out), "--train-len", "96", "--lengths", "96", "--budgets", "32",
                 "--n-sequences", "1", "--policies", "fixed-finetune", "--no-plot", "--no-progress",
                 "--out", str(tmp_path / "ev")]) == 0


def test_auto_on_valid_data_splits_the_records_and_allocates_on_the_fit_part(tmp_path):
    """--valid-data: its sequences split by a seeded hash into disjoint fit and select parts; the trials that
    allocate measure their head budgets on the fit part alone (OUT/auto/fit.jsonl), every trial is scored per
    select sequence, and the budget too small for the confirmation is said."""
    import random

    from kvpop.demo import task as T

    rng = random.Random(0)
    for name, n in (("train", 6), ("valid", 6)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"input_ids": [rng.randrange(640) for _ in range(96)]}) + "\n" for _ in range(n)))
    out = tmp_path / "run"
    assert main(["train", "--auto", "--model", str(T.SHIPPED_MODEL), "--data", str(tmp_path / "train.jsonl"),
                 "--valid-data", str(tmp_path / "valid.jsonl"), "--valid-sequences", "3", "--seq-len", "96",
                 "--budget", "32", "--sinks", "2", "--window", "8", "--label", "mean", "--lr-scorer", "1e-3",
                 "--allocate", "ablation", "--decay-nats", "8", "--no-train-model", "--steps", "1",
                 "--auto-budget", "2", "--auto-patience", "0", "--no-progress", "--out", str(out)]) == 0
    rec = json.loads((out / "selection.json").read_text())
    fit, sel = rec["split"]["fit"], rec["split"]["select"]
    assert sorted(fit + sel) == list(range(6)) and len(sel) == 3 and not set(fit) & set(sel)
    valid = [json.loads(x)["input_ids"] for x in (tmp_path / "valid.jsonl").read_text().splitlines()]
    fitted = [json.loads(x)["input_ids"] for x in (out / "auto" / "fit.jsonl").read_text().splitlines()]
    assert fitted == [valid[i] for i in fit]  # the allocation's file holds the fit part, in order, and only it
    for t in rec["trials"]:
        assert len(t["per_sequence"]) == 3 and t["score"] == pytest.approx(sum(t["per_sequence"]) / 3)
        args = json.loads((out / t["dir"] / "args.json").read_text())
        assert Path(args["valid_data"]).resolve() == (out / "auto" / "fit.jsonl").resolve()
    assert not rec["confirmation"]["ran"] and "--auto-budget" in rec["confirmation"]["why"]
