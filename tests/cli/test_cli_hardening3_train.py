"""``kvpop train`` on bad and edge input, round three: outputs of one step after a crash, resumes
that refuse changed model weights or head budgets, labels and options that would do nothing, and one-line
errors.  The table is docs/HARDENING.md, "Round three", "kvpop train"."""
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from test_cli_train import FAST, _scorer_tensors, _write_ids  # noqa: E402  (tests/cli/test_cli_train.py)

from kvpop.cli import main  # noqa: E402
from kvpop.training.runstate import load_checkpoint  # noqa: E402


def output_step(path):
    from kvpop.training.runstate import output_step

    return output_step(path)


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _usage_error(*argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    msg = str(e.value.code)
    assert msg.startswith("kvpop train: ") and "\n" not in msg, msg
    return msg


def _checkpoint_scorers(out):
    """The scorer tensors of OUT/last.pt, keyed as in scorers.safetensors."""
    sd = load_checkpoint(out / "last.pt")["model"]
    found = {}
    for k, v in sd.items():
        if ".self_attn.kvpop." in k:
            layer = k.split(".layers.")[1].split(".")[0]
            found[f"layers.{layer}.{k.split('.self_attn.kvpop.')[1]}"] = v
    return found


# ----------------------------------------------------------------------------- item 2: one step in every output
def test_a_resume_with_no_step_left_rewrites_every_output_from_last_pt(tmp_path, monkeypatch, capsys):
    """A crash after last.pt of step 2 but before its scorers left step-1 scorers and a step-1 model/; the
    resume with nothing left to train writes both anew from last.pt, each stamped with its step."""
    from kvpop.training.methods import KVpopMethod

    data = _write_ids(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    argv = ["train", "--tiny", "--data", str(data), "--out", str(out), "--checkpoint-every", "1", *FAST]
    assert main([*argv, "--steps", "1"]) == 0
    step1 = _scorer_tensors(out / "scorers.safetensors")
    real = KVpopMethod.save

    def crash(self, model, directory, **kw):  # step 2's scorers: the first write of the resumed run
        raise OSError("the machine lost power")

    monkeypatch.setattr(KVpopMethod, "save", crash)
    with pytest.raises(OSError, match="lost power"):
        main([*argv, "--steps", "2", "--resume"])
    monkeypatch.setattr(KVpopMethod, "save", real)
    assert load_checkpoint(out / "last.pt")["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(step1.values(), _scorer_tensors(out / "scorers.safetensors").values()))
    capsys.readouterr()
    assert main([*argv, "--steps", "2", "--resume"]) == 0
    want, got = _checkpoint_scorers(out), _scorer_tensors(out / "scorers.safetensors")
    assert set(want) == set(got) and all(torch.equal(want[k].float(), got[k]) for k in want)
    assert not all(torch.equal(step1[k], got[k]) for k in got)
    assert "no step left" in capsys.readouterr().out
    assert output_step(out / "scorers.safetensors") == 2 and output_step(out / "model") == 2
    from safetensors.torch import load_file

    model_sd = load_file(str(out / "model" / "model.safetensors"))
    ck = load_checkpoint(out / "last.pt")["model"]
    assert all(torch.equal(model_sd[k], ck[k]) for k in model_sd if k in ck)


def test_dms_gates_and_model_are_stamped_with_their_step(tmp_path):
    out = tmp_path / "dms"
    assert main(["train", "--method", "dms", "--tiny", "--task", "--seq-len", "64", "--sinks", "2", "--window", "8",
                 "--steps", "2", "--checkpoint-every", "1", "--no-progress", "--out", str(out)]) == 0
    assert output_step(out / "gates.safetensors") == 2 and output_step(out / "model") == 2
    (out / "model" / "kvpop_step.json").write_text("[1]")
    with pytest.raises(ValueError, match="kvpop_step.json"):
        output_step(out / "model")


# ----------------------------------------------------------------------------- item 3a: weights replaced in place
def test_train_resume_refuses_model_weights_replaced_in_place(tmp_path):
    from safetensors.torch import load_file, save_file

    from kvpop.demo.task import SHIPPED_MODEL

    model = tmp_path / "m"
    shutil.copytree(SHIPPED_MODEL, model)
    data = _write_ids(tmp_path / "d.jsonl")
    argv = ["train", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "run"),
            "--checkpoint-every", "1", *FAST]
    assert main([*argv, "--steps", "1"]) == 0
    (model / "model.safetensors").touch()  # the same content: still the same model
    assert main([*argv, "--steps", "2", "--resume"]) == 0
    sd = load_file(str(model / "model.safetensors"))  # new weights under the same name: a new teacher
    k = sorted(sd)[0]
    sd[k] = sd[k] * 1.01
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    msg = _usage_error(*argv, "--steps", "3", "--resume")
    assert msg.startswith(f"kvpop train: --model {model}: ") and "model.safetensors changed" in msg, msg
    assert load_checkpoint(tmp_path / "run" / "last.pt")["step"] == 2


# ----------------------------------------------------------------------------- item 4: the power label's exponent
def test_train_bounds_the_power_labels_exponent(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    base = ["train", "--tiny", "--data", str(data), "--steps", "1", "--label", "power", *FAST]
    for a in ("1e-300", "1e-10", "1e30"):
        msg = _usage_error(*base, "--label-power", a, "--out", str(tmp_path / a))
        assert "--label-power must lie in [0.01, 10000]" in msg and "Lower the learning rates" not in msg, msg
        assert not (tmp_path / a / "last.pt").exists()
    assert main([*base, "--label-power", "0.01", "--out", str(tmp_path / "ok")]) == 0


# ----------------------------------------------------------------------------- item 6b: validation = training data
def test_allocate_refuses_validation_data_with_the_training_content(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(data, copy)
    base = ["train", "--tiny", "--data", str(data), "--steps", "1", "--allocate", "ablation", *FAST]
    msg = _usage_error(*base, "--valid-data", str(copy), "--out", str(tmp_path / "a"))
    assert "has the same content as the training file --data" in msg, msg
    lines = data.read_text().splitlines()
    shuffled = tmp_path / "shuffled.jsonl"  # the same records in another order: other bytes, the same data
    shuffled.write_text("\n".join(lines[::-1]) + "\n\n")
    msg = _usage_error(*base, "--valid-data", str(shuffled), "--out", str(tmp_path / "b"))
    assert "sequences measured are training sequences of --data" in msg, msg
    assert not (tmp_path / "a" / "head_budgets.json").exists() and not (tmp_path / "b" / "head_budgets.json").exists()


# ----------------------------------------------------------------------------- item 7: options that would do nothing
def test_options_that_would_do_nothing_are_refused_naming_them(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    base = ["train", "--tiny", "--data", str(data), "--steps", "1", "--seq-len", "48", "--sinks", "2", "--window", "8",
            "--no-progress"]
    out = ["--out", str(tmp_path / "x")]
    msg = _usage_error(*base, "--method", "dms", "--label", "mean", "--decay-nats", "5", *out)
    assert msg.startswith("kvpop train: --label, --decay-nats: options of --method kvpop"), msg  # mean: the default
    msg = _usage_error(*base, "--budget", "24", "--target-keep", "0.25", *out)
    assert msg.startswith("kvpop train: --target-keep: an option of --method dms"), msg
    msg = _usage_error(*base, "--budget", "24", "--label-power", "2", *out)
    assert "--label-power 2 is the exponent of --label power; with --label mean it does nothing" in msg, msg
    msg = _usage_error(*base, "--budget", "24", "--label-power", "0", *out)  # a falsy value is given too
    assert "--label-power 0 is the exponent of --label power" in msg, msg
    msg = _usage_error(*base, "--budget", "24", "--decay-nats", "5", "--gamma-init", "0.5", *out)
    assert "--gamma-init 0.5 lies outside the decay range that --decay-nats 5 gives over --seq-len 48" in msg, msg
    msg = _usage_error(*base, "--budget", "24", "--decay-nats", "5", "--gamma-min", "0.999", *out)
    assert "leave out --gamma-min" in msg, msg  # the default value, but typed
    # what is typed and used is honoured; what is not typed is never refused
    import kvpop

    run = tmp_path / "ok"
    assert main([*base, "--budget", "24", "--decay-nats", "5", "--gamma-init", "0.95", "--out", str(run)]) == 0
    cfg = kvpop.read_scorer_config(run / "scorers.safetensors")
    assert cfg.gamma_init == 0.95 and abs(cfg.gamma_min - torch.exp(torch.tensor(-5 / 48)).item()) < 1e-6
    assert json.loads((run / "args.json").read_text())["label_power"] == 4.0  # defaults still recorded
    dms = tmp_path / "dms"
    assert main([*base, "--method", "dms", "--out", str(dms)]) == 0
    assert main([*base, "--method", "dms", "--out", str(dms), "--resume"]) == 0  # args.json: the same run


# ----------------------------------------------------------------------------- item 10: one-line errors
def test_train_obscure_errors_are_one_line_messages(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    base = ["train", "--tiny", "--data", str(data), "--steps", "1", *FAST]
    out = ["--out", str(tmp_path / "x")]
    hb = tmp_path / "hb.json"
    for imp in ("high", [[1.0, 2.0], [3.0]], [["a", "b"], ["c", "d"]]):
        hb.write_text(json.dumps({"head_budgets": [[24, 24], [24, 24]], "importance": imp}))
        msg = _usage_error(*base, "--head-budgets", str(hb), *out)
        assert f"--head-budgets {hb}: {hb}: \"importance\" must be a list of 2 lists of 2 numbers" in msg, msg
    for opt in ("--lr-model", "--lr-scorer"):
        for v in ("nan", "inf"):
            no_lr = [a for a in base if a not in ("--lr-model", "--lr-scorer", "1e-3", "1e-2")]
            msg = _usage_error(*no_lr, opt, v, *out)
            assert f"{opt} must be a finite number > 0, got {v}" in msg, msg
    for eps in ("1e300", "1e-300", "10"):
        msg = _usage_error(*base, "--eps", eps, *out)
        assert msg.startswith("kvpop train: --eps must lie in [1e-30, 1]") and "learning rate" not in msg, msg
    assert not (tmp_path / "x" / "last.pt").exists()


def test_a_resume_after_the_head_budgets_were_edited_names_the_field_and_the_file(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl")
    hb = tmp_path / "hb.json"
    hb.write_text(json.dumps([[20, 28], [24, 24]]))
    run = tmp_path / "run"
    argv = ["train", "--tiny", "--data", str(data), "--out", str(run), "--checkpoint-every", "1", *FAST]
    assert main([*argv, "--steps", "1", "--head-budgets", str(hb)]) == 0
    copy = json.loads((run / "head_budgets.json").read_text())
    hb.write_text(json.dumps([[28, 20], [24, 24]]))
    msg = _usage_error(*argv, "--steps", "2", "--head-budgets", str(hb), "--resume")
    assert f"--head-budgets {hb} --resume: its \"head_budgets\" differs from the first run's copy " in msg, msg
    assert str(run / "head_budgets.json") in msg
    assert json.loads((run / "head_budgets.json").read_text()) == copy  # the run's copy is kept
    # the run's own copy edited (what --allocate --resume reads): the checkpoint's rows differ, named with the file
    hb.write_text(json.dumps([[20, 28], [24, 24]]))
    copy["head_budgets"] = [[28, 20], [24, 24]]
    (run / "head_budgets.json").write_text(json.dumps(copy))
    shutil.copyfile(run / "head_budgets.json", hb)
    msg = _usage_error(*argv, "--steps", "2", "--head-budgets", str(hb), "--resume")
    assert "head_budgets was [[20, 28], [24, 24]], now [[28, 20], [24, 24]]" in msg, msg
    assert f"the per-head budgets are read from {hb}" in msg and "{" not in msg.split("KVpopConfig")[1], msg


def test_train_refuses_a_code_carrying_bin_model_and_an_out_that_is_a_file_before_any_work(tmp_path):
    """Already one line before this round; held here for kvpop train (nothing runs, nothing is written)."""
    from kvpop.demo.task import SHIPPED_MODEL

    data = _write_ids(tmp_path / "d.jsonl")
    model = tmp_path / "m"
    shutil.copytree(SHIPPED_MODEL, model)
    (model / "model.safetensors").unlink()
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    torch.save({"model.embed_tokens.weight": Payload()}, model / "pytorch_model.bin")
    msg = _usage_error("train", "--model", str(model), "--data", str(data), "--steps", "1", "--out",
                       str(tmp_path / "run"), *FAST)
    assert f"--model {model}: the weights in {model} (pytorch_model.bin) were refused because loading them could " \
           f"run code" in msg and "weights_only" not in msg, msg
    assert not marker.exists() and not (tmp_path / "run" / "last.pt").exists()
    (tmp_path / "file").write_text("x")
    for out, said in ((tmp_path / "file", "exists and is not a directory"),
                      (tmp_path / "file" / "run", "cannot create or write in it")):
        msg = _usage_error("train", "--tiny", "--data", str(data), "--steps", "1", "--out", str(out), *FAST)
        assert msg.startswith(f"kvpop train: --out {out}") and said in msg, msg
