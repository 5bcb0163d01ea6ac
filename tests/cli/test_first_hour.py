"""Issue 40, items 7, 9-12: a new user's first hour (README as written) and ``kvpop eval`` with a user's runs."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_examples_pass_the_cache_under_the_keyword_the_installed_transformers_takes():
    import kvpop
    from kvpop.models import cache_kwarg_name

    sentinel = object()
    assert kvpop.cache_kwargs(sentinel) == {cache_kwarg_name(): sentinel}
    blocks = [(p.name, code) for p in PAGES
              for code in re.findall(r"```python\n(.*?)```", p.read_text(encoding="utf-8"), flags=re.S)]
    assert blocks
    stale = [name for name, code in blocks if "past_key_values=" in code]
    assert not stale, f"examples passing past_key_values= (warns on transformers >= 5.24): {stale}"


def test_what_the_readme_commands_write_is_ignored_by_git():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    written = set(re.findall(r"--out ([\w./-]+)", text)) | set(re.findall(r"> ([\w-]+\.jsonl)", text))
    written |= set(re.findall(r"save_pretrained\('([\w-]+)'\)", text))
    written = {w.split("/")[0] for w in written if not w.startswith("/") and w != "DIR"}
    assert {"demo-out", "eval-out", "my-model", "runs", "train.jsonl", "traces.jsonl"} <= written
    if not (ROOT / ".git").exists():
        return
    paths = sorted(w if w.endswith(".jsonl") else w + "/" for w in written)  # the commands make directories
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    ignored = {x.rstrip("/") for x in r.stdout.split()}
    assert ignored == written, f"not in .gitignore: {sorted(written - ignored)}"


def test_readme_walkthrough_says_the_default_scorer_is_the_mlp():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "the method's recipe, kvpop train's default" not in text
    from kvpop.core.config import KVpopConfig

    assert KVpopConfig().scorer == "mlp" and "kvpop train's default is the MLP" in text


def test_demo_help_says_lookahead_has_a_shipped_model(capsys):
    from kvpop.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["demo"]
    help_text = " ".join(sub.format_help().split())
    assert "lookahead needs --model" not in help_text and "tiny_qwen3_lookahead" in help_text
    assert (ROOT / "kvpop" / "data" / "tiny_qwen3_lookahead" / "config.json").is_file()


def test_docs_name_model_directories_not_bare_hub_names():
    bare = [(p.name, m) for p in PAGES if p.name != "HARDENING.md"  # it quotes what users typed, hub ids too
            for m in re.findall(r"--model (Qwen[\w.-]*)", p.read_text(encoding="utf-8"))]
    assert not bare, bare


# ---------------------------------------------------------------------------- --model as a hub id, --threads
TRAIN_FAST = ["--task", "--seq-len", "64", "--budget", "24", "--sinks", "2", "--window", "8", "--steps", "1",
              "--no-progress", "--no-train-model", "--checkpoint-every", "0"]


def _fake_hub_cache(tmp_path, repo="kvpop-test/tiny-qwen3", rev="0123456789abcdef0123456789abcdef01234567"):
    import shutil

    root = tmp_path / "hub"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / rev
    shutil.copytree(ROOT / "kvpop" / "data" / "tiny_qwen3", snap)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    return root, snap


def test_train_resolves_a_hub_id_from_the_local_cache_and_says_how_to_get_one_that_is_not(
        tmp_path, monkeypatch, capsys):
    import json

    import huggingface_hub.constants as C

    from kvpop.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache, snap = _fake_hub_cache(tmp_path)
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(cache))
    out = tmp_path / "run"
    assert main(["train", "--model", "kvpop-test/tiny-qwen3", *TRAIN_FAST, "--threads", "1", "--out", str(out)]) == 0
    assert "local Hugging Face cache's snapshot" in capsys.readouterr().err
    assert json.loads((out / "args.json").read_text())["model"] == str(snap.resolve())
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", "kvpop-test/not-cached", *TRAIN_FAST, "--out", str(tmp_path / "r2")])
    err = " ".join(str(e.value.code).split())
    assert "no snapshot of the Hugging Face model 'kvpop-test/not-cached' in the local cache" in err
    assert "hf download kvpop-test/not-cached --local-dir" in err
    assert main(["eval", "--model", str(tmp_path / "nodir"), "--policies", "dense"]) == 2
    assert "no model directory there (no such directory)" in capsys.readouterr().err


def test_train_threads_option_is_checked_and_resumable(tmp_path, monkeypatch, capsys):
    import torch

    from kvpop.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit, match="--threads must be >= 1"):
        main(["train", *TRAIN_FAST, "--threads", "0", "--out", str(tmp_path / "r0")])
    before = torch.get_num_threads()
    try:
        out = tmp_path / "run"
        assert main(["train", *TRAIN_FAST, "--threads", "1", "--out", str(out)]) == 0
        assert torch.get_num_threads() == 1
        steps2 = [*TRAIN_FAST]
        steps2[steps2.index("--steps") + 1] = "2"
        assert main(["train", *steps2, "--threads", "2", "--resume", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(before)


def test_train_warns_about_the_triton_interpreter_outside_the_tests(monkeypatch):
    from kvpop.cli.train import interpreter_warning

    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    msg = interpreter_warning()
    assert msg is not None and "TRITON_INTERPRET=1" in msg and "interpreter" in msg and "unset it" in msg
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert interpreter_warning() is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "x")  # the tests set it on purpose
    assert interpreter_warning() is None


# ---------------------------------------------------------------------------- kvpop eval --policies dense alone
def _traces(path, n=2, length=160):
    import json

    import kvpop.demo.task as T

    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"input_ids": T.make_example(T.valid_seed(i), length)["input_ids"].tolist()}) + "\n")
    return path


def test_eval_dense_alone_measures_the_dense_row(tmp_path, monkeypatch, capsys):
    import json

    from kvpop.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = str(ROOT / "kvpop" / "data" / "tiny_qwen3")
    assert main(["eval", "--model", model, "--policies", "dense", "--lengths", "96", "--n-sequences", "1",
                 "--budgets", "48", "--no-progress", "--no-plot"]) == 0
    table = capsys.readouterr().out
    assert "| policy | L=96 (full cache) |" in table and re.search(r"\| dense \| \d\.\d{3} \|", table), table
    out = tmp_path / "e"
    assert main(["eval", "--model", model, "--data", str(_traces(tmp_path / "t.jsonl")), "--policies", "dense",
                 "--budgets", "48", "--no-progress", "--no-plot", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert re.search(r"\| dense \(NLL\) \| \d+\.\d{4} \|", table), table
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["dense"] and rows[0]["positions"] > 0


# ---------------------------------------------------------------------------- a run trained from another base model
def test_eval_refuses_a_run_trained_from_another_base_model_and_says_which_model_each_row_ran(
        tmp_path, monkeypatch, capsys):
    import json
    import shutil

    from kvpop.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    base = tmp_path / "base"
    shutil.copytree(ROOT / "kvpop" / "data" / "tiny_qwen3", base)
    run = tmp_path / "run"
    assert main(["train", "--model", str(base), *TRAIN_FAST, "--out", str(run)]) == 0
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"prompt_ids": [5, 6, 7], "answer_ids": [8]}) + "\n")
    other = str(ROOT / "kvpop" / "data" / "tiny_qwen3_lookahead")
    capsys.readouterr()
    assert main(["eval", "--problems", str(problems), "--run", str(run), "--model", other, "--budgets", "40"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"was trained from the base model {base.resolve()}" in err and f"give --model {base.resolve()}" in err
    # the same model at another path (a copy: same files) is the run's base
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    out = tmp_path / "e"
    assert main(["eval", "--run", str(run), "--model", str(copy), "--lengths", "96", "--n-sequences", "1",
                 "--budgets", "40", "--no-progress", "--no-plot", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    ran = json.loads((out / "results.json").read_text())["row_models"]
    assert ran["dense"] == ran["kvpop-mlp"] == str(copy) and ran["streaming"] == str(copy)
    assert f"Models run: dense, streaming, tova, h2o, kvpop-mlp: {copy}" in said, said


# ---------------------------------------------------------------------------- messages that name their option / file
def test_seeds_and_lists_of_numbers_name_their_option_and_empty_traces_name_their_file(tmp_path, monkeypatch, capsys):
    from kvpop.cli import main
    from studies import evidence

    assert evidence.main(["synthetic", "--task", "kvtrace", "--seeds", "abc", "--out", str(tmp_path / "ev")]) == 2
    assert "--seeds: expected comma-separated integers, got 'abc'" in capsys.readouterr().err
    assert main(["eval", "--budgets", "4x", "--policies", "dense"]) == 2
    assert "--budgets: expected comma-separated integers, got '4x'" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    short = tmp_path / "short.jsonl"
    short.write_text('{"input_ids": [5]}\n{"input_ids": [7]}\n')
    model = str(ROOT / "kvpop" / "data" / "tiny_qwen3")
    assert main(["eval", "--model", model, "--data", str(short), "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--data {short}: no trace to evaluate: each of its 2 record(s) has fewer than 2 tokens" in err


# ---------------------------------------------------------------------------- head-adaptive budgets on a small model
def test_allocation_holds_no_head_above_what_a_sequence_fills(monkeypatch):
    import torch

    from kvpop.core import budgets as B
    from kvpop.core.config import KVpopConfig

    scores = [[0.0, 1.0], [0.0, 0.0]]  # the case: one head holds all the importance
    assert B.allocate(scores, total=4 * 48, sinks=4, window=16) == ((20, 132), (20, 20))
    rows = B.allocate(scores, total=4 * 48, sinks=4, window=16, max_budget=128)
    assert max(map(max, rows)) == 128 and sum(map(sum, rows)) == 4 * 48, rows
    assert B.allocate([[3.0, 1.0], [0.0, 0.0]], total=4 * 48, sinks=4, window=16, max_budget=128) == (
        B.allocate([[3.0, 1.0], [0.0, 0.0]], total=4 * 48, sinks=4, window=16))  # nothing over the cap: unchanged
    # a total that does not fit under the cap (every head holds the whole sequence anyway): no cap
    assert sum(map(sum, B.allocate(scores, total=4 * 200, sinks=4, window=16, max_budget=128))) == 800
    monkeypatch.setattr(B, "ablation_importance", lambda *a, **k: torch.tensor(scores))
    rows, _ = B.ablation_budgets(None, [torch.zeros(2, 128, dtype=torch.long)],
                                 config=KVpopConfig(sinks=4, window=16, budget=48))
    assert max(map(max, rows)) <= 128


def test_a_step_with_nothing_to_rank_says_why_instead_of_printing_nan(tmp_path, monkeypatch, capsys):
    import json
    import math

    from kvpop.cli import main
    from kvpop.cli.train import _allocation_notes
    from kvpop.core.config import KVpopConfig

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hb = tmp_path / "hb.json"
    hb.write_text(json.dumps([[10, 70], [10, 10]]))  # mean 25: one head over --seq-len 64, three with no slot
    out = tmp_path / "run"
    argv = ["train", "--task", "--seq-len", "64", "--budget", "25", "--sinks", "2", "--window", "8", "--steps", "2",
            "--no-train-model", "--head-budgets", str(hb), "--out", str(out)]
    assert main(argv) == 0
    cap = capsys.readouterr()
    said = cap.out + cap.err
    assert "nan" not in said.replace("NaN in history.jsonl", ""), said
    assert "acc=-" in said and "accuracy - (no token was ranked" in said
    assert said.count("note: step 1: no token competed for a long-range slot") == 1
    assert "1 head(s) hold the whole sequence of 64 tokens" in said and "3 head(s) keep no long-range slot" in said
    assert f"warning: --head-budgets {hb}: 1 head(s) hold more than --seq-len 64 entries (up to 70)" in said
    hist = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert all(h["decisions"] == 0 and math.isnan(h["accuracy"]) for h in hist)
    import argparse

    notes = _allocation_notes(argparse.Namespace(seq_len=64), KVpopConfig(sinks=2, window=8, budget=25),
                              (((10, 64), (10, 16)), {"importance": [[0.0, 2.0], [0.001, 0.5]]}))
    assert "2 of 4 heads keep no long-range slot" in notes and "at most 0.001 nats" in notes
    assert "1 head(s) at --seq-len 64" in notes


# ---------------------------------------------------------------------------- one count per run over its segments
def test_training_in_segments_counts_the_runs_steps_on_one_scale(tmp_path, monkeypatch, capsys):
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import SMALL, tiny_model

    import kvpop
    from kvpop.training.train import TrainConfig, train

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = tiny_model()
    teacher = kvpop.make_teacher(m)
    kvpop.patch(m, **SMALL)
    data = [torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    cfg = dict(lr_model=1e-3, lr_scorer=1e-2, checkpoint_dir=str(tmp_path), progress_total=4)
    for i, target in enumerate((2, 4)):  # two validation segments of one 4-step run (as kvpop demo trains)
        train(m, data, TrainConfig(steps=target, **cfg), teacher=teacher, resume=i > 0)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kvpop train:")]
    counts = [x.split(",")[0].split(": ")[1].split(" ")[0] for x in lines]
    assert counts and all(c.endswith("/4") for c in counts), lines
    assert counts[-1] == "4/4" and "2/4" in counts and "2/2" not in counts


def test_eval_eta_weighs_jobs_by_their_cost_and_says_when_it_is_a_lower_bound(monkeypatch):
    import kvpop.progress as P
    from kvpop.evaluation.evaluate import cost_kind

    assert cost_kind("tova") == cost_kind("h2o") == "decode" and cost_kind("kvpop-mlp") == "forward"
    clock = [0.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: clock[0])
    # the run: cheap one-pass rows first, two token-by-token policies last
    eta = P.CostETA([("forward", 1000)] * 6 + [("decode", 1000)] * 2)
    eta.start()
    for _ in range(3):
        clock[0] += 1.0
        eta.done("forward", 1000)
    assert eta.text() == "ETA >= 3s (decode not timed yet)"  # not a confident 3 s
    for _ in range(3):
        clock[0] += 1.0
        eta.done("forward", 1000)
    clock[0] += 60.0
    eta.done("decode", 1000)
    assert eta.text() == "ETA 60s"  # the decode rate, not the average over kinds (about 10 s)
    line = P.LineProgress(10, desc="x", eta=False)
    line.n, line._start = 4, 0
    import io

    buf = io.StringIO()
    line.file = buf
    line._write()
    assert "ETA" not in buf.getvalue()


# ---------------------------------------------------------------------------- two runs of one policy, named
def test_eval_compares_two_named_runs_of_one_policy_in_every_mode(tmp_path, monkeypatch, capsys):
    import json

    from kvpop.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    runs = {}
    for name, seed in (("auto", "0"), ("paper", "1")):
        runs[name] = tmp_path / name
        assert main(["train", *TRAIN_FAST, "--seed", seed, "--out", str(runs[name])]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(runs["auto"]), "--run", str(runs["paper"]), "--policies", "dense,kvpop-mlp"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "policy 'kvpop-mlp' is given twice" in err and "name them: --run NAME=DIR" in err
    named = ["--run", f"auto={runs['auto']}", "--run", f"kvpop-mlp[paper]={runs['paper']}"]
    out = tmp_path / "e"
    assert main(["eval", *named, "--policies", "dense,streaming,kvpop-mlp", "--lengths", "96", "--n-sequences", "1",
                 "--budgets", "40", "--no-progress", "--no-plot", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert {r["policy"] for r in res["rows"]} == {"dense", "streaming", "kvpop-mlp[auto]", "kvpop-mlp[paper]"}
    assert "| kvpop-mlp[auto] | B=24 |" in table and "| kvpop-mlp[paper] | B=24 |" in table, table
    assert res["trained"]["kvpop-mlp[auto]"]["source"].startswith("auto=")
    traces = _traces(tmp_path / "t.jsonl")
    model = str(ROOT / "kvpop" / "data" / "tiny_qwen3")
    assert main(["eval", "--model", model, "--data", str(traces), *named, "--budgets", "40", "--no-progress",
                 "--no-plot"]) == 0
    table = capsys.readouterr().out
    assert "| kvpop-mlp[auto] | B=24 |" in table and "| kvpop-mlp[paper] | B=24 |" in table, table
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"prompt_ids": [5, 6, 7, 8, 9], "answer_ids": [8, 9]}) + "\n")
    assert main(["eval", "--problems", str(problems), *named, "--policies", "dense,kvpop-mlp", "--budgets", "40",
                 "--no-progress", "--no-plot"]) == 0
    table = capsys.readouterr().out
    assert "| kvpop-mlp[auto] | 40 |" in table and "| kvpop-mlp[paper] | 40 |" in table, table
    assert main(["eval", "--run", f"bad/name={runs['auto']}"]) == 2
    assert "neither a policy" in capsys.readouterr().err
    assert main(["eval", *named, "--policies", "kvpop-mlp[zz]", "--lengths", "96", "--n-sequences", "1"]) == 2
    assert "--policies names the row 'kvpop-mlp[zz]', but no run is named 'zz'" in capsys.readouterr().err
