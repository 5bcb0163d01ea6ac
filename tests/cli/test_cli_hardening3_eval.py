"""``kvpop eval`` on bad and edge input, round three (issue 30): runs whose parts do not belong together,
fine-tuned models named under the wrong row, generation bounds, and the obscure errors.  The table is
docs/HARDENING.md, "Round three (issue 30)", "kvpop eval"."""
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from test_cli_train import _write_ids  # noqa: E402  (tests/cli/test_cli_train.py)

from kvpop.cli import main  # noqa: E402

TRAIN = ["--seq-len", "48", "--sinks", "2", "--window", "8", "--no-progress"]
SYNTH = ["--lengths", "64", "--budgets", "24", "--n-sequences", "1", "--no-progress", "--no-plot"]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A joint KVpop run (scorers + model/, two steps) and a DMS run (gates + model/) on the shipped model."""
    root = tmp_path_factory.mktemp("runs3")
    data = _write_ids(root / "d.jsonl")
    assert main(["train", "--data", str(data), *TRAIN, "--budget", "24", "--steps", "2", "--checkpoint-every", "1",
                 "--out", str(root / "joint")]) == 0
    assert main(["train", "--data", str(data), *TRAIN, "--method", "dms", "--target-keep", "0.25", "--steps", "1",
                 "--out", str(root / "dms")]) == 0
    return root


def _copy(runs, name, tmp_path, new=None):
    dst = tmp_path / (new or name)
    shutil.copytree(runs / name, dst)
    return dst


def _err(capsys, *argv):
    """``kvpop eval ARGV``'s stderr, once it exits 2 with one ``kvpop eval: error:`` line."""
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvpop eval: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- item 10: a code-carrying .bin
class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo ran > /dev/null",))


def test_a_code_carrying_pytorch_model_bin_in_a_runs_model_is_refused(runs, tmp_path, capsys):
    run = _copy(runs, "joint", tmp_path)
    model = run / "model"
    from safetensors.torch import load_file

    sd = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save({**sd, "extra": _RunsCode()}, model / "pytorch_model.bin")
    err = _err(capsys, "--run", str(run), *SYNTH)
    assert "pytorch_model.bin) were refused because loading them could run code" in err
    assert "posix.system" in err and "weights_only" not in err
    (model / "pytorch_model.bin").write_bytes(b"not a torch file")
    err = _err(capsys, "--run", str(run), *SYNTH)
    assert "pytorch_model.bin is not a file written by torch.save" in err and "weights_only" not in err
