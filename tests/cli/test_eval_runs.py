"""``kvpop eval --run DIR``: a ``kvpop train --out`` directory of every method, evaluated with the sinks and window
it was trained with; the budget evaluated vs trained in the table; DMS's entries per head and position range."""
import json
import shutil

import pytest
import torch

from kvpop.baselines import dms as D
from kvpop.baselines.dms import budget as DE
from kvpop.cli import main
from kvpop.cli.trained import read_run
from kvpop.demo import task as T
from kvpop.evaluation import evaluate as E
from kvpop.models import cache_kwarg_name

SINKS, WINDOW = 2, 8  # not the eval defaults (4, 32): a run evaluated at its own settings shows them
TRAIN = ["--seq-len", "64", "--sinks", str(SINKS), "--window", str(WINDOW), "--steps", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _write(path, n, length, seed):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"input_ids": T.make_example(seed(i), length)["input_ids"].tolist()}) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One ``kvpop train --out`` directory per method and kind of run, on the shipped model."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("runs")
    data = _write(root / "train.jsonl", 4, 64, T.train_seed)
    common = ["train", "--data", str(data), *TRAIN]
    specs = {
        "mlp": ["--budget", "24", "--scorer", "mlp", "--no-train-model"],
        "mlstm-joint": ["--budget", "24", "--scorer", "mlstm"],
        "fixed": ["--budget", "24", "--mask-source", "streaming"],
        "dms": ["--method", "dms", "--target-keep", "0.25"],
    }
    for name, extra in specs.items():
        assert main([*common, *extra, "--out", str(root / name)]) == 0
    return root


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("traces") / "test.jsonl", 2, 96, T.test_seed)


def _eval(*argv):
    return main(["eval", "--model", str(E.SHIPPED_MODEL), "--no-progress", "--no-plot", *argv])


def test_the_policy_is_read_from_the_run(runs, tmp_path):
    assert {n: read_run(str(runs / n)).policy for n in ("mlp", "mlstm-joint", "fixed", "dms")} == {
        "mlp": "kvpop-mlp", "mlstm-joint": "kvpop-mlstm-joint", "fixed": "fixed-finetune", "dms": "dms"}
    r = read_run(f"kvpop-mlstm={runs / 'mlstm-joint'}")  # a joint run's scorers on its own model
    assert r.policy == "kvpop-mlstm" and r.model is not None and r.config.window == WINDOW
    with pytest.raises(ValueError, match="holds a kvpop-mlp run .no fine-tuned model in it., not kvpop-mlp-joint"):
        read_run(f"kvpop-mlp-joint={runs / 'mlp'}")
    with pytest.raises(ValueError, match="holds a dms run, not kvpop-mlp"):
        read_run(f"kvpop-mlp={runs / 'dms'}")
    named = read_run(f"lru={runs / 'dms'}")  # a name that is no policy names the run (issue 40 item 12)
    assert (named.policy, named.name, named.key) == ("dms", "lru", "dms[lru]")
    with pytest.raises(ValueError, match="unknown policy 'kvpop-mpl'; did you mean kvpop-mlp"):
        read_run(f"kvpop-mpl={runs / 'mlp'}")
    with pytest.raises(ValueError, match="neither a policy"):
        read_run(f"lru[x]={runs / 'dms'}")
    with pytest.raises(ValueError, match="holds no trained run"):
        read_run(str(tmp_path))
    shutil.copytree(runs / "fixed" / "model", tmp_path / "only" / "model")
    with pytest.raises(ValueError, match="name the policy it serves, e.g. --run fixed-finetune="):
        read_run(str(tmp_path / "only"))
    assert read_run(f"fixed-finetune={tmp_path / 'only'}").model == tmp_path / "only" / "model"


def test_every_methods_run_evaluated_at_its_own_window(runs, traces, tmp_path, capsys):
    out = tmp_path / "out"
    assert _eval("--data", str(traces), "--budgets", "16,40", "--out", str(out),
                 *[f"--run={runs / n}" for n in ("mlp", "mlstm-joint", "fixed", "dms")]) == 0
    res = json.loads((out / "results.json").read_text())
    assert (res["sinks"], res["window"]) == (SINKS, WINDOW)  # no flag: the runs' own, not the defaults 4 / 32
    got = {(r["policy"], r["budget"]) for r in res["rows"]}
    want = {"streaming", "tova", "h2o", "fixed-finetune", "kvpop-mlp", "kvpop-mlstm-joint", "dms"}
    assert got == {(p, b) for p in want for b in (16, 40)}
    assert res["trained"]["kvpop-mlp"]["budget"] == 24 and res["trained"]["dms"]["target_keep"] == 0.25
    table = (out / "table.md").read_text()
    assert table in capsys.readouterr().out
    assert "| policy | trained at | B=16 | B=40 |" in table
    assert "| kvpop-mlp | B=24 |" in table and "| dms | keep 0.25 |" in table and "| streaming | - |" in table
    # every row over the same positions: those past the largest budget
    assert {r["positions"] for r in res["rows"]} == {2 * (96 - 1 - 40)}
    assert len({r["dense_nll"] for r in res["rows"]}) == 1
    # DMS's entries per head: at the last position and per quarter of the positions
    for r in (r for r in res["rows"] if r["policy"] == "dms"):
        assert r["dms_entries_mean"] <= r["budget"] and r["dms_entries_min"] <= r["dms_entries_max"]
        by = r["dms_entries_by_range"]
        assert [(x["from"], x["to"]) for x in by] == [(0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)]
        assert all(x["min"] <= x["mean"] <= x["max"] for x in by)
        assert by[0]["mean"] < r["dms_entries_mean"]  # fewer entries early than at the matched last position
        assert f"| B={r['budget']} | {r['dms_entries_mean']:.1f} [" in table
    assert "| budget | last position | positions 0-25% |" in table


def test_the_synthetic_task_takes_the_runs_window_too(runs, tmp_path):
    out = tmp_path / "out"
    assert _eval("--run", str(runs / "mlp"), "--policies", "dense,kvpop-mlp", "--train-len", "64", "--lengths", "64",
                 "--budgets", "16", "--n-sequences", "1", "--out", str(out)) == 0
    res = json.loads((out / "results.json").read_text())
    assert (res["sinks"], res["window"]) == (SINKS, WINDOW)
    assert "| kvpop-mlp | B=24 |" in (out / "table.md").read_text()


def test_a_command_line_that_contradicts_the_run_is_refused(runs, traces, tmp_path, capsys):
    cases = [
        (["--run", str(runs / "mlp"), "--window", "32"],
         f"--window 32 differs from the window {WINDOW} that kvpop-mlp ({runs / 'mlp'}) was trained with"),
        (["--scorers", f"kvpop-mlp={runs / 'mlp' / 'scorers.safetensors'}", "--sinks", "4"],
         f"--sinks 4 differs from the sinks {SINKS} that kvpop-mlp"),
        (["--dms", str(runs / "dms"), "--window", "16"], f"--window 16 differs from the window {WINDOW} that dms"),
        (["--run", str(runs / "mlp"), "--run", f"kvpop-mlp={runs / 'mlstm-joint'}"], "holds a kvpop-mlstm-joint run"),
        (["--run", str(runs / "mlp"), "--scorers", f"kvpop-mlp={runs / 'mlp' / 'scorers.safetensors'}"],
         "policy 'kvpop-mlp' is given twice"),
        (["--run", str(tmp_path / "missing")], "is not a directory"),
    ]
    for extra, msg in cases:
        assert _eval("--data", str(traces), "--budgets", "40", *extra) == 2, extra
        assert msg in capsys.readouterr().err, extra
    # runs trained at different windows are not evaluated together
    other = tmp_path / "w4"
    data = _write(tmp_path / "d.jsonl", 2, 64, T.train_seed)
    assert main(["train", "--data", str(data), *TRAIN, "--window", "4", "--budget", "24", "--no-train-model",
                 "--out", str(other)]) == 0
    assert _eval("--data", str(traces), "--budgets", "40", "--run", str(runs / "dms"), "--run", str(other)) == 2
    err = capsys.readouterr().err
    assert "trained with different sinks / window" in err and "window=8" in err and "window=4" in err


def test_entries_by_position_equal_a_token_by_token_decode():
    """Brute force: decode a sequence token by token through a DMSCache and read each head's entries after
    every token; entries_by_position of the prefilled cache must equal them at every position."""
    torch.manual_seed(0)
    base = E.load_base_model()
    model = D.patch_dms(base, sinks=SINKS, window=WINDOW)
    with torch.no_grad():
        for la in D.dms_layers(model):
            la.gate.weight.normal_(0, 0.5)
            la.gate.bias.fill_(0.3)
    model.eval()
    ids = T.make_example(T.test_seed(3), 70)["input_ids"][None]
    L = ids.shape[1]
    with torch.no_grad():
        pre = D.DMSCache(model)
        model(ids, **{cache_kwarg_name(): pre})
        got = DE.entries_by_position(pre)
        step = D.DMSCache(model)
        want = []
        for p in range(L):
            model(ids[:, p:p + 1], **{cache_kwarg_name(): step})
            want.append(step.head_entries().reshape(-1))
    want = torch.stack(want, 1).long()
    assert got.shape == want.shape == (len(D.dms_layers(model)) * 2, L)
    assert torch.equal(got, want)
    assert torch.equal(got[:, -1], pre.head_entries().reshape(-1).long())
    assert int(got[:, -1].min()) < int(got[:, -1].max())  # the heads differ: the test sees raggedness


def test_dms_threshold_chosen_on_validation_traces(runs, traces, tmp_path, capsys):
    valid = _write(tmp_path / "valid.jsonl", 2, 96, T.valid_seed)
    out = tmp_path / "out"
    assert _eval("--data", str(traces), "--budgets", "16,40", "--out", str(out), "--policies", "dense,dms",
                 "--run", str(runs / "dms"), "--dms-valid-data", str(valid)) == 0
    res = json.loads((out / "results.json").read_text())
    # the thresholds are the validation traces' own calibration, fixed for every evaluated trace
    from kvpop.evaluation.trace_eval import load_model

    model = DE.dms_policy_model(load_model(runs / "dms" / "model"), runs / "dms" / "gates.safetensors",
                                sinks=SINKS, window=WINDOW)
    vids = torch.stack([T.make_example(T.valid_seed(i), 96)["input_ids"] for i in range(2)])
    for b in (16, 40):
        assert res["dms_thresholds"][str(b)] == pytest.approx(DE.calibrate_threshold(model, vids, b))
    rows = [r for r in res["rows"] if r["policy"] == "dms"]
    assert {r["dms_threshold_from"] for r in rows} == {"validation traces"}
    assert res["dms_valid_data"] == str(valid)
    # without it, each evaluated trace calibrates its own
    assert _eval("--data", str(traces), "--budgets", "40", "--out", str(out), "--overwrite", "--policies",
                 "dense,dms", "--run", str(runs / "dms")) == 0  # a finished --out is replaced only when asked
    res = json.loads((out / "results.json").read_text())
    assert res["dms_thresholds"] is None
    assert {r["dms_threshold_from"] for r in res["rows"] if r["policy"] == "dms"} == {"each evaluated trace"}
    # user errors
    assert _eval("--data", str(traces), "--budgets", "40", "--run", str(runs / "dms"),
                 "--dms-valid-data", str(traces)) == 2
    assert "is the evaluated --data itself" in capsys.readouterr().err
    assert _eval("--data", str(traces), "--budgets", "40", "--run", str(runs / "mlp"),
                 "--dms-valid-data", str(valid)) == 2
    assert "needs a dms run" in capsys.readouterr().err
