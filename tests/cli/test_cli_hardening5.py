"""Round five (issue 59): one write rule for every command that writes, options that would do nothing refused, and
the obscure messages made clear.  The table is docs/HARDENING.md, "Round five (issue 59)"."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from kvpop.cli import main  # noqa: E402
from kvpop.cli.writes import PACKAGE_DIR  # noqa: E402

TRAIN_FAST = ["--task", "--seq-len", "64", "--budget", "24", "--sinks", "2", "--window", "8", "--steps", "1",
              "--no-progress", "--checkpoint-every", "0"]
SHIPPED_PROBE = PACKAGE_DIR / "data" / "_hardening5_probe"


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.set_num_threads(1)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    assert "Traceback" not in text, text
    return text


def _train_refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    return _one_line(str(e.value.code) + capsys.readouterr().err)


# ------------------------------------------------------------------ one write rule (kvpop/cli/writes.py)
def test_no_command_writes_into_the_package_without_write_shipped(capsys, tmp_path):
    assert not SHIPPED_PROBE.exists()
    err = _train_refused(capsys, *TRAIN_FAST, "--out", str(SHIPPED_PROBE))
    assert "--out" in err and "what the project ships" in err and "--write-shipped" in err
    for argv in (["eval", "--policies", "dense", "--out", str(SHIPPED_PROBE)],
                 ["demo", "--quick", "--out", str(SHIPPED_PROBE)],
                 ["eval", "--policies", "dense", "--out", str(PACKAGE_DIR.parent / "studies" / "results" / "_p")]):
        assert main(argv) == 2
        err = _one_line(capsys.readouterr().err)
        assert "lies in what the project ships" in err and "add --write-shipped" in err, err
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    assert main(["pretrain", "--out", str(run), "--export", str(PACKAGE_DIR / "data" / "tiny_qwen3")]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "--export" in err and "add --write-shipped" in err
    assert not SHIPPED_PROBE.exists() and not (PACKAGE_DIR.parent / "studies" / "results" / "_p").exists()


def test_a_finished_eval_demo_or_export_is_replaced_only_when_asked(capsys, tmp_path):
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "results.json").write_text('{"mine": 1}')
    assert main(["eval", "--policies", "dense", "--out", str(ev)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "holds a finished kvpop eval (results.json)" in err and "--overwrite" in err
    demo = tmp_path / "demo"
    (demo / "kvtrace").mkdir(parents=True)
    for name in ("results.json", "demo_settings.json"):
        (demo / "kvtrace" / name).write_text('{"other": "settings"}')
    assert main(["demo", "--quick", "--out", str(demo), "--no-plot", "--no-progress"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "holds a kvpop demo's output" in err and "--resume" in err and "--overwrite" in err
    assert (demo / "kvtrace" / "results.json").read_text() == '{"other": "settings"}'
    run, dst = tmp_path / "run", tmp_path / "exported"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"weights")
    assert main(["pretrain", "--out", str(run), "--export", str(dst)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "--export" in err and "an exported model (model.safetensors)" in err and "--overwrite" in err
    assert (dst / "model.safetensors").read_bytes() == b"weights"
    assert (ev / "results.json").read_text() == '{"mine": 1}'


# ------------------------------------------------------------------ options that would do nothing
@pytest.mark.parametrize("extra, named, why", [
    (["--priority-source", "keynorm+", "--scorer", "mlstm"], "--scorer", "builds no scorer"),
    (["--priority-source", "keynorm+", "--scorer-hidden", "64"], "--scorer-hidden", "builds no scorer"),
    (["--priority-source", "oracle-label", "--tau", "2"], "--tau", "trains no scorer"),
    (["--priority-source", "keynorm+", "--lr-scorer", "0.5", "--label", "max"], "--lr-scorer, --label",
     "reads no label"),
    (["--priority-source", "random", "--lr-scorer", "0.5"], "--lr-scorer", "trains no scorer"),
    (["--mask-source", "streaming", "--no-train-model"], "--no-train-model", "fine-tune-only control"),
    (["--priority-source", "keynorm+", "--allocate", "ablation"], "--allocate ablation", "--head-budgets"),
])
def test_options_without_effect_are_refused_naming_them(capsys, tmp_path, extra, named, why):
    err = _train_refused(capsys, *TRAIN_FAST, "--out", str(tmp_path / "r"), *extra)
    assert named in err and why in err, err
    assert "mask_source=" not in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize("extra, said", [
    (["--gamma-min", "0.999999991", "--gamma-max", "0.999999999", "--gamma-init", "0.999999995"],
     "--gamma-max 0.999999999 is 1.0 in float32"),
    (["--gamma-min", "1e-30"], "--gamma-min 1e-30 gives gamma_min 1e-30, below 0.5"),
    (["--lm-weight", "1e30"], "--lm-weight must be at most 1000, got 1e+30"),
    (["--decay-nats", "-5"], "--decay-nats must be a positive finite number"),
    (["--decay-nats", "1e9"], "--decay-nats 1e+09 over --seq-len 64"),
])
def test_decay_and_weights_out_of_range_name_their_option(capsys, tmp_path, extra, said):
    err = _train_refused(capsys, *TRAIN_FAST, "--out", str(tmp_path / "r"), *extra)
    assert said in err and "span_nats" not in err and "learning rates" not in err, err


def test_a_priority_source_run_ends_without_the_nothing_ranked_noise(capsys, tmp_path):
    # the studies' recipes spell out the defaults for every row (--label mean --lr-scorer 1e-3): no effect either way
    assert main(["train", *TRAIN_FAST, "--out", str(tmp_path / "r"), "--priority-source", "keynorm+", "--label",
                 "mean", "--lr-scorer", "1e-3"]) == 0
    out = capsys.readouterr()
    assert "no token was ranked" not in out.out + out.err
    assert "--priority-source keynorm+ trains no scorer" in out.out


def test_data_mostly_shorter_than_seq_len_says_what_was_dropped(capsys, tmp_path):
    mostly_short = tmp_path / "d.jsonl"
    rows = [list(range(1, 131))] + [[(j * 7 + i) % 200 + 1 for j in range(127)] for i in range(99)]
    mostly_short.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    base = ["--data", str(mostly_short), "--seq-len", "128", "--budget", "48", "--sinks", "2", "--window", "8",
            "--steps", "1", "--no-progress", "--no-train-model"]
    err = _train_refused(capsys, *base, "--out", str(tmp_path / "r"))
    assert "99 of its 100 records (99%) are shorter than --seq-len 128" in err and "--pack" in err
    half = tmp_path / "h.jsonl"
    rows = [[(j * 7 + i) % 200 + 1 for j in range(300)] for i in range(3)] + [[5] * 100] * 3
    half.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    assert main(["train", *base[2:], "--data", str(half), "--out", str(tmp_path / "h")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: --data" in err and "3 of its 6 records (50%) are shorter than --seq-len 128 and were dropped" \
        in err


# ------------------------------------------------------------------ kvpop eval with runs
@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs5")
    for name, seed in (("r1", "0"), ("r2", "1")):
        assert main(["train", *TRAIN_FAST, "--no-train-model", "--seed", seed, "--out", str(root / name)]) == 0
    return root


def test_eval_refuses_one_name_twice_and_runs_left_out_and_measures_at_the_runs_window(two_runs, tmp_path, capsys):
    r1, r2 = two_runs / "r1", two_runs / "r2"
    synth = ["--train-len", "64", "--lengths", "64", "--budgets", "24", "--n-sequences", "1", "--no-progress",
             "--no-plot"]
    assert main(["eval", *synth, "--policies", "dense,streaming", "--run", f"x={r1}", "--run", f"x={r2}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "policy 'kvpop-mlp[x]' is given twice" in err or "the name 'x' is given to two runs" in err
    assert main(["eval", *synth, "--policies", "dense,streaming", "--run", f"a={r1}", "--run", f"b={r2}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "--policies dense,streaming leaves out the row of" in err and "kvpop-mlp[a], kvpop-mlp[b]" in err
    out = tmp_path / "e"
    assert main(["eval", *synth, "--policies", "dense,streaming,kvpop-mlp", "--run", str(r1), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert (res["sinks"], res["window"]) == (2, 8)  # the runs' own, not the defaults 4 / 32


def test_eval_names_each_run_once_whatever_its_policy(monkeypatch):
    """Two runs of two policies under one name (two rows, kvpop-mlp[x] and dms[x]) are refused too."""
    import kvpop.cli.trained as tr
    from kvpop.cli.eval import _trained

    runs = iter([tr.Trained("kvpop-mlp", "--run x=R1", name="x"), tr.Trained("dms", "--run x=R2", name="x")])
    monkeypatch.setattr(tr, "read_run", lambda spec: next(runs))
    ns = type("Args", (), {"run": ["x=R1", "x=R2"], "scorers": None, "dms": None, "finetuned": None})()
    with pytest.raises(ValueError, match="the name 'x' is given to two runs: --run x=R1 and --run x=R2"):
        _trained(ns)


def test_eval_run_on_short_traces_measures_the_budgets_that_fit_without_budgets(two_runs, tmp_path, capsys):
    """Issue 58: the README's ``kvpop eval --model M --data traces.jsonl --run R --out eval-out`` on short traces
    (6.25 % of 64 tokens is below sinks + window + 1) ran only with --budgets; now the defaults that fit and the
    run's trained budget are measured, and the command says so."""
    from kvpop.evaluation.evaluate import SHIPPED_MODEL

    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps({"input_ids": [(j * 5 + i) % 90 + 3 for j in range(64)]}) + "\n"
                              for i in range(2)))
    out = tmp_path / "eval-out"
    assert main(["eval", "--model", str(SHIPPED_MODEL), "--data", str(traces), "--run", str(two_runs / "r1"),
                 "--out", str(out), "--no-progress", "--no-plot"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "--budgets not given" in err and "measured at [16, 24]" in err
    assert json.loads((out / "results.json").read_text())["budgets"] == [16, 24]
