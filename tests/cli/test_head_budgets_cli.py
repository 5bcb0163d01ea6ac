"""``kvpop train --allocate ablation`` / ``--head-budgets FILE`` and ``kvpop eval --run`` of such a run
(docs/DESIGN.md section 7, head-adaptive budgets): the importance is measured on validation sequences only,
the allocation is ``allocate`` of it, the rows reach the scorers' config and ``OUT/head_budgets.json``, eval
serves the rows at the trained budget and shares another budget by the saved importance (else refuses)."""
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

import kvpop  # noqa: E402
from kvpop.cli import main  # noqa: E402
from kvpop.core.budgets import ablation_importance, allocate, read_head_budgets, rebudget  # noqa: E402
from kvpop.demo import task as T  # noqa: E402
from kvpop.evaluation import evaluate as E  # noqa: E402

SINKS, WINDOW, BUDGET, SEQ = 2, 8, 24, 64
TRAIN = ["--seq-len", str(SEQ), "--budget", str(BUDGET), "--sinks", str(SINKS), "--window", str(WINDOW),
         "--no-progress", "--lr-scorer", "1e-2"]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def allocated(tmp_path_factory):
    """``kvpop train --task --allocate ablation`` on the shipped model, 2 steps, scorers only."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("alloc") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        assert main(["train", "--task", *TRAIN, "--steps", "2", "--no-train-model", "--allocate", "ablation",
                     "--valid-sequences", "3", "--batch-size", "2", "--out", str(out)]) == 0
    return out


def test_allocation_is_measured_on_validation_sequences_and_trained_with(allocated):
    doc = json.loads((allocated / "head_budgets.json").read_text())
    rows = [list(r) for r in doc["head_budgets"]]
    assert doc["rule"] == "ablation" and doc["budget"] == BUDGET and doc["min_k"] == 0
    assert "valid_seed(0..2)" in doc["measured_on"]
    # the importance is ablation_importance of the model as loaded, on the task's validation seeds (not the
    # training batches), under the run's exact label as the mask; batches of --batch-size 2: [2, S] and [1, S]
    base = E.load_base_model()
    ids = T.make_batch([T.valid_seed(i) for i in range(3)], SEQ)["input_ids"]
    cfg = kvpop.KVpopConfig(budget=BUDGET, sinks=SINKS, window=WINDOW, mask_source="teacher", target_source="teacher")
    imp = ablation_importance(base, [ids[:2], ids[2:]], config=cfg, teacher=base)
    assert torch.allclose(imp, torch.tensor(doc["importance"], dtype=torch.float64), rtol=0, atol=1e-12)
    assert float(imp.max()) > 0  # some head's slots matter: the allocation is not the uniform one
    assert [list(r) for r in allocate(imp, total=4 * BUDGET, sinks=SINKS, window=WINDOW)] == rows
    assert rows != [[BUDGET] * 2] * 2 and sum(map(sum, rows)) == 4 * BUDGET
    # the trained scorers carry the rows; the args are saved; a resume reads the file instead of measuring
    cfg = kvpop.read_scorer_config(allocated / "scorers.safetensors")
    assert [list(r) for r in cfg.head_budgets] == rows and cfg.budget == BUDGET
    assert json.loads((allocated / "args.json").read_text())["allocate"] == "ablation"


def test_resume_keeps_the_first_runs_budgets(allocated, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(allocated, run)
    doc = json.loads((run / "head_budgets.json").read_text())
    argv = ["train", "--task", *TRAIN, "--no-train-model", "--allocate", "ablation", "--valid-sequences", "3",
            "--batch-size", "2", "--out", str(run), "--resume"]
    args = json.loads((run / "args.json").read_text())
    args["out"] = str(run.resolve())
    (run / "args.json").write_text(json.dumps(args))
    assert main([*argv, "--steps", "3"]) == 0
    assert json.loads((run / "head_budgets.json").read_text()) == doc
    assert kvpop.read_scorer_config(run / "scorers.safetensors").head_budgets == tuple(map(tuple, doc["head_budgets"]))
    (run / "head_budgets.json").unlink()
    with pytest.raises(SystemExit, match="head_budgets.json is missing"):
        main([*argv, "--steps", "4"])


def test_eval_serves_the_rows_and_rebudgets_by_the_saved_importance(allocated, tmp_path):
    doc = read_head_budgets(allocated / "head_budgets.json")
    base = E.load_base_model()
    m = E.policy_model(base, "kvpop-mlp", scorers=allocated / "scorers.safetensors", sinks=SINKS, window=WINDOW,
                       budget=BUDGET, head_plan=doc)
    assert kvpop.get_config(m).head_budgets == doc["head_budgets"]
    rebudget(m, 40)  # another mean: allocate of the saved importance at the new total
    want = allocate(doc["importance"], total=4 * 40, sinks=SINKS, window=WINDOW)
    assert kvpop.get_config(m).head_budgets == want and kvpop.get_config(m).budget == 40
    rebudget(m, BUDGET)  # and back: the trained rows exactly
    assert kvpop.get_config(m).head_budgets == doc["head_budgets"]
    with pytest.raises(ValueError, match="needs the importance"):  # no importance: refused, naming both budgets
        E.policy_model(base, "kvpop-mlp", scorers=allocated / "scorers.safetensors", sinks=SINKS, window=WINDOW,
                       budget=40)

    out = tmp_path / "eval"
    assert main(["eval", "--run", str(allocated), "--train-len", str(SEQ), "--lengths", str(SEQ), "--budgets",
                 f"{BUDGET},40", "--n-sequences", "1", "--no-plot", "--no-progress", "--policies",
                 "dense,kvpop-mlp", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    t = res["trained"]["kvpop-mlp"]
    assert t["head_budgets"] == [list(r) for r in doc["head_budgets"]] and t["head_budgets_rule"] == "ablation"
    assert {(r["policy"], r["budget"]) for r in res["rows"]} >= {("kvpop-mlp", BUDGET), ("kvpop-mlp", 40)}
    assert "B=24 adaptive" in (out / "table.md").read_text()

    # the same run without its head_budgets.json: its own budget still evaluates, another is refused up front
    bare = tmp_path / "bare"
    shutil.copytree(allocated, bare)
    (bare / "head_budgets.json").unlink()
    assert main(["eval", "--run", str(bare), "--train-len", str(SEQ), "--lengths", str(SEQ), "--budgets",
                 str(BUDGET), "--n-sequences", "1", "--no-plot", "--no-progress", "--policies", "dense,kvpop-mlp"]) == 0
    assert main(["eval", "--run", str(bare), "--train-len", str(SEQ), "--lengths", str(SEQ), "--budgets",
                 f"{BUDGET},40", "--n-sequences", "1", "--no-plot", "--no-progress", "--policies",
                 "dense,kvpop-mlp"]) == 2
    # a head_budgets.json that is not this run's is refused
    other = json.loads((allocated / "head_budgets.json").read_text())
    other["head_budgets"] = [[BUDGET] * 2] * 2
    (bare / "head_budgets.json").write_text(json.dumps(other))
    assert main(["eval", "--run", str(bare), "--train-len", str(SEQ), "--lengths", str(SEQ), "--budgets",
                 str(BUDGET), "--n-sequences", "1", "--no-plot", "--no-progress"]) == 2


def _ids(path, n=4, length=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    path.write_text("".join(json.dumps({"input_ids": torch.randint(0, 640, (length,), generator=g).tolist()}) + "\n"
                            for _ in range(n)))
    return path


FAST = ["--seq-len", "48", "--budget", "24", "--sinks", "2", "--window", "8", "--no-progress", "--steps", "1"]


def _err(tmp_path, *args):
    with pytest.raises(SystemExit) as e:
        main(["train", "--tiny", "--out", str(tmp_path / "err"), *FAST, *args])
    return str(e.value.code)


def test_head_budgets_file_reaches_the_run(tmp_path):
    data = _ids(tmp_path / "d.jsonl")
    f = tmp_path / "hb.json"
    f.write_text(json.dumps([[10, 38], [30, 18]]))  # 96 = 2 layers x 2 KV heads x 24
    out = tmp_path / "run"
    assert main(["train", "--tiny", "--data", str(data), *FAST, "--head-budgets", str(f), "--out", str(out)]) == 0
    assert kvpop.read_scorer_config(out / "scorers.safetensors").head_budgets == ((10, 38), (30, 18))
    doc = json.loads((out / "head_budgets.json").read_text())
    assert doc["head_budgets"] == [[10, 38], [30, 18]] and doc["rule"] == "given" and doc["importance"] is None
    f2 = tmp_path / "hb2.json"  # the object form, what --allocate writes
    f2.write_text(json.dumps({"head_budgets": [[30, 18], [10, 38]], "importance": [[1, 0], [0, 2]]}))
    out2 = tmp_path / "run2"
    assert main(["train", "--tiny", "--data", str(data), *FAST, "--head-budgets", str(f2), "--out", str(out2)]) == 0
    assert kvpop.read_scorer_config(out2 / "scorers.safetensors").head_budgets == ((30, 18), (10, 38))
    assert json.loads((out2 / "head_budgets.json").read_text())["importance"] == [[1.0, 0.0], [0.0, 2.0]]


def test_user_errors(tmp_path):
    data = _ids(tmp_path / "d.jsonl")
    f = tmp_path / "hb.json"
    f.write_text(json.dumps([[10, 38], [30, 18], [24, 24]]))
    msg = _err(tmp_path, "--data", str(data), "--head-budgets", str(f))
    assert "--head-budgets" in msg and "3 rows" in msg and "the model has 2" in msg
    f.write_text(json.dumps([[10, 38, 24], [30, 18, 24]]))
    msg = _err(tmp_path, "--data", str(data), "--head-budgets", str(f))
    assert "--head-budgets" in msg and "KV heads" in msg
    f.write_text(json.dumps([[20, 40], [30, 30]]))  # mean 30
    assert "give --budget 30" in _err(tmp_path, "--data", str(data), "--head-budgets", str(f))
    f.write_text(json.dumps([[4, 44], [24, 24]]))  # a head below sinks + window
    assert "head_budgets[0][0]" in _err(tmp_path, "--data", str(data), "--head-budgets", str(f))
    f.write_text("[[10, 38], [30")
    assert "cannot read it as JSON" in _err(tmp_path, "--data", str(data), "--head-budgets", str(f))
    f.write_text(json.dumps({"budgets": [[24, 24]]}))
    assert 'needs a "head_budgets" key' in _err(tmp_path, "--data", str(data), "--head-budgets", str(f))
    f.write_text(json.dumps([[24, "24"], [24, 24]]))
    assert "lists of integers" in _err(tmp_path, "--data", str(data), "--head-budgets", str(f))
    assert "no such file" in _err(tmp_path, "--data", str(data), "--head-budgets", str(tmp_path / "none.json"))
    msg = _err(tmp_path, "--data", str(data), "--allocate", "ablation")
    assert "validation data" in msg and "--valid-data" in msg
    assert "is the training file" in _err(tmp_path, "--data", str(data), "--allocate", "ablation", "--valid-data",
                                          str(data))
    assert "--min-k is an option of --allocate" in _err(tmp_path, "--data", str(data), "--min-k", "2")
    assert "--valid-data is an option of --allocate" in _err(tmp_path, "--data", str(data), "--valid-data", str(data))
    assert "--min-k must be >= 0" in _err(tmp_path, "--data", str(data), "--allocate", "ablation", "--valid-data",
                                          str(data), "--min-k", "-1")
    valid = _ids(tmp_path / "v.jsonl", n=2, seed=1)  # held out: other records than d.jsonl's
    msg = _err(tmp_path, "--data", str(data), "--allocate", "ablation", "--valid-data", str(valid), "--min-k", "15")
    assert "--allocate ablation" in msg and "min_k=15" in msg
    assert "is for --method kvpop" in _err(tmp_path, "--data", str(data), "--method", "dms", "--allocate", "ablation",
                                           "--valid-data", str(valid))
    short = _ids(tmp_path / "s.jsonl", n=2, length=20)
    assert "--valid-data" in _err(tmp_path, "--data", str(data), "--allocate", "ablation", "--valid-data", str(short))
    with pytest.raises(SystemExit):  # argparse: one of the two
        main(["train", "--tiny", "--out", str(tmp_path / "x"), *FAST, "--data", str(data), "--allocate", "ablation",
              "--head-budgets", str(f)])


def test_allocate_on_valid_data_file(tmp_path):
    data = _ids(tmp_path / "d.jsonl")
    valid = _ids(tmp_path / "v.jsonl", n=3, seed=1)
    out = tmp_path / "run"
    assert main(["train", "--tiny", "--data", str(data), *FAST, "--allocate", "ablation", "--valid-data", str(valid),
                 "--min-k", "2", "--out", str(out)]) == 0
    doc = json.loads((out / "head_budgets.json").read_text())
    assert doc["min_k"] == 2 and "6 sequence(s) of 48 tokens" in doc["measured_on"]
    assert all(b >= SINKS + WINDOW + 2 for r in doc["head_budgets"] for b in r)
    assert sum(map(sum, doc["head_budgets"])) == 4 * 24
    assert kvpop.read_scorer_config(out / "scorers.safetensors").head_budgets == \
        tuple(map(tuple, doc["head_budgets"]))


def test_vllm_engine_serves_a_head_budgets_run(allocated):
    """A run with head_budgets goes to the vLLM plugin with its scorer file, whose rows the plugin serves (its packed
    layout); another budget shares their total by the run's head_budgets.json, as the hf engine does."""
    from kvpop import answers as P
    from kvpop.cli.problems import _vllm_models
    from kvpop.cli.trained import read_run
    from kvpop.core.budgets import rescale
    from kvpop.vllm.settings import resolve

    t = read_run(str(allocated))
    spec = _vllm_models(P, allocated, ["dense", t.policy], None, {t.policy: t})[t.policy]
    assert spec.cache_policy == "kvpop" and spec.scorers == str(t.scorers)
    c = t.config
    at = lambda b: resolve(P.vllm_overrides(spec, sinks=c.sinks, window=c.window, budget=b)).config  # noqa: E731
    assert at(c.budget).head_budgets == c.head_budgets
    plan = t.head_plan
    assert at(c.budget + 4).head_budgets == rescale(c, c.budget + 4, importance=plan["importance"],
                                                    min_k=plan["min_k"], granularity=plan["granularity"]).head_budgets
