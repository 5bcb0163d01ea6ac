"""``kvpop train`` on bad and edge input, round three (issue 30): outputs of one step after a crash, resumes
that refuse changed model weights or head budgets, labels and options that would do nothing, and one-line
errors.  The table is docs/HARDENING.md, "Round three (issue 30)", "kvpop train"."""

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
