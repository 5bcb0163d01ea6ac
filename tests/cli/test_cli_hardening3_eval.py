"""``kvpop eval`` on bad and edge input, round three: runs whose parts do not belong together,
fine-tuned models named under the wrong row, generation bounds, and the obscure errors.  The table is
docs/HARDENING.md, "Round three", "kvpop eval"."""
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from test_cli_train import _write_ids  # noqa: E402  (tests/cli/test_cli_train.py)

from kvpop.cli import main  # noqa: E402
from kvpop.cli.trained import read_run  # noqa: E402
from kvpop.evaluation import evaluate as E  # noqa: E402

TRAIN = ["--seq-len", "48", "--sinks", "2", "--window", "8", "--no-progress"]
SYNTH = ["--lengths", "64", "--budgets", "24", "--n-sequences", "1", "--sinks", "2", "--window", "8", "--no-progress",
         "--no-plot"]


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


# ----------------------------------------------------------------------------- items 5, 10: parts of a run
def test_a_dms_run_without_its_model_is_refused_not_served_on_the_base_model(runs, tmp_path, capsys):
    run = _copy(runs, "dms", tmp_path)
    shutil.rmtree(run / "model")
    for given in (["--run", str(run)], ["--dms", str(run)], ["--run", f"dms={run}"]):
        err = _err(capsys, *given, *SYNTH)
        assert "the run trained the model together with its DMS gates" in err and f"{run / 'model'} is missing" in err
    # a run that trained its gates on the frozen base model (--no-train-model) has no model/ and needs none
    args = json.loads((run / "args.json").read_text())
    (run / "args.json").write_text(json.dumps({**args, "no_train_model": True}))
    t = read_run(str(run))
    assert t.policy == "dms" and t.model is None


def test_a_joint_run_missing_its_model_says_the_model_is_missing(runs, tmp_path, capsys):
    run = _copy(runs, "joint", tmp_path)
    shutil.rmtree(run / "model")
    for given in (["--run", str(run)], ["--run", str(run), "--policies", "dense,kvpop-mlp-joint"],
                  ["--run", f"kvpop-mlp={run}"]):
        err = _err(capsys, *given, *SYNTH)
        assert "the run trained the model together with its scorers" in err, err
        assert f"{run / 'model'} is missing" in err and "needs its scorers" not in err
    # scorers alone (kvpop train --no-train-model) are kvpop-mlp; asked for as joint, the message says what is missing
    args = json.loads((run / "args.json").read_text())
    (run / "args.json").write_text(json.dumps({**args, "no_train_model": True}))
    assert read_run(str(run)).policy == "kvpop-mlp"
    err = _err(capsys, "--run", str(run), "--policies", "dense,kvpop-mlp-joint", *SYNTH)
    assert "needs scorers and the model trained with them" in err
    assert "gives kvpop-mlp (scorers without a model/)" in err


def test_finetuned_streaming_is_the_fixed_finetune_row(runs, tmp_path, capsys):
    model = runs / "joint" / "model"
    out = tmp_path / "out"
    assert main(["eval", "--finetuned", f"streaming={model}", "--policies", "dense,streaming,fixed-finetune",
                 "--out", str(out), *SYNTH]) == 0
    assert "is evaluated as the fixed-finetune row" in capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert {r["policy"] for r in res["rows"]} == {"dense", "streaming", "fixed-finetune"}
    assert res["trained"] == {"fixed-finetune": {"source": f"--finetuned streaming={model}"}}
    # the streaming row is the base model's: the same as without --finetuned
    assert main(["eval", "--policies", "dense,streaming", "--out", str(tmp_path / "base"), *SYNTH]) == 0
    base = json.loads((tmp_path / "base" / "results.json").read_text())
    acc = {r["policy"]: r["accuracy"] for r in res["rows"] if r["policy"] != "fixed-finetune"}
    assert acc == {r["policy"]: r["accuracy"] for r in base["rows"]}
    err = _err(capsys, "--finetuned", f"streaming={model}", "--policies", "dense,streaming", *SYNTH)
    assert "is evaluated as the fixed-finetune row, which --policies dense,streaming leaves out" in err
    err = _err(capsys, "--finetuned", f"tova={model}", *SYNTH)
    assert "has no row for a fine-tuned model under it" in err and f"give --model {model}" in err
    err = _err(capsys, "--finetuned", f"dms={model}", *SYNTH)
    assert "--dms RUN or --run RUN" in err
    err = _err(capsys, "--finetuned", f"streaming={model}", "--finetuned", f"streaming={model}", *SYNTH)
    assert "--finetuned streaming= is given twice" in err


def test_a_scorer_policy_without_its_scorers_or_its_model_is_refused(runs, capsys):
    run = runs / "joint"
    err = _err(capsys, "--finetuned", f"kvpop-mlp={run / 'model'}", *SYNTH)
    assert "no scorer file (scorers.safetensors) was given for it" in err
    assert f"--scorers kvpop-mlp={run / 'scorers.safetensors'}" in err
    err = _err(capsys, "--scorers", f"kvpop-mlp-joint={run / 'scorers.safetensors'}", *SYNTH)
    assert "were trained together with a model and serve only on it, but no model was given" in err


# ----------------------------------------------------------------------------- item 8 and item 10: --problems
def _problems_file(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_problems_that_cannot_fit_the_context_are_refused_before_generating(tmp_path, capsys, monkeypatch):
    from kvpop.answers import generation as G

    def generate(*a, **k):
        raise AssertionError("generation started before the refusal")

    monkeypatch.setattr(G, "generate_rows", generate)
    ctx = json.loads((E.SHIPPED_MODEL / "config.json").read_text())["max_position_embeddings"]
    ok = {"prompt_ids": [1, 2, 3], "answer_ids": [4]}
    run = ["--problems", None, "--policies", "dense,streaming", "--budgets", "48", "--no-progress", "--no-plot"]

    def err(path, *extra):
        run[1] = str(path)
        return _err(capsys, *run, *extra)

    data = _problems_file(tmp_path / "p.jsonl", ok, {"id": "long", "prompt_ids": [1] * ctx, "answer_ids": [4]})
    assert f"p.jsonl:2 (id 'long'): the prompt is {ctx} tokens, not shorter than the context of the model" in err(data)
    data = _problems_file(tmp_path / "p.jsonl", ok, {"prompt_ids": [1] * (ctx - 8), "answer_ids": [4]})
    msg = err(data, "--max-new-tokens", "20")
    assert f"p.jsonl:2: the prompt's {ctx - 8} tokens and --max-new-tokens 20 pass the context" in msg
    assert "give --max-new-tokens 8 or less" in msg
    data = _problems_file(tmp_path / "p.jsonl", ok)
    msg = err(data, "--max-new-tokens", "1000000000")
    assert f"--max-new-tokens 1000000000 is not below the context of the model {E.SHIPPED_MODEL}, {ctx} " in msg
    data = _problems_file(tmp_path / "p.jsonl", ok, {"id": 7, "prompt_ids": [1, 2], "answer_ids": [4, 5, 6]})
    msg = err(data, "--max-new-tokens", "2")
    assert "p.jsonl:2 (id 7): \"answer_ids\" has 3 tokens, more than --max-new-tokens 2 generates" in msg
    assert "give --max-new-tokens 3 or more" in msg


def test_the_context_counts_rope_scaling():
    from transformers import Qwen3Config

    from kvpop.answers import model_context

    assert model_context(Qwen3Config(max_position_embeddings=4096)) == 4096
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    assert model_context(Qwen3Config(max_position_embeddings=4096, rope_scaling=yarn)) == 16384


def test_a_record_without_an_id_after_one_whose_id_is_its_index(tmp_path, capsys):
    data = _problems_file(tmp_path / "p.jsonl", {"id": "1", "prompt_ids": [1, 2], "answer_ids": [3]},
                          {"prompt_ids": [1, 2], "answer_ids": [3]})
    msg = _err(capsys, "--problems", str(data), "--policies", "dense", "--no-progress")
    assert ('p.jsonl:2: the record has no "id", so its id is its index 1, which the record on line 1 gives as its '
            '"id": give this record an "id"') in msg


# ----------------------------------------------------------------------------- item 2: scorers and model/ of one step
def _stamp(run, layer, *, layer_step=None, model_step=None, nudge_layer=False, nudge_model=False):
    """Set (an int) or remove (None) the step stamps of a run's layer file and model/; ``nudge_*``: change one
    weight a little (the weights of another step)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = run / layer
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.pop("step", None)
    if layer_step is not None:
        meta["step"] = str(layer_step)
    if nudge_layer:
        k = sorted(tensors)[0]
        tensors[k] = tensors[k] + 1e-3
    save_file(tensors, str(path), metadata=meta)
    stamp = run / "model" / "kvpop_step.json"
    stamp.unlink(missing_ok=True)
    if model_step is not None:
        stamp.write_text(json.dumps({"step": model_step}))
    if nudge_model:
        mpath = run / "model" / "model.safetensors"
        with safe_open(str(mpath), framework="pt") as f:
            mmeta, weights = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        weights = {k: w + 1e-3 for k, w in weights.items()}
        save_file(weights, str(mpath), metadata=mmeta)


def test_a_runs_scorers_and_model_must_come_from_one_training_step(runs, tmp_path, capsys):
    run = _copy(runs, "joint", tmp_path)
    layer = "scorers.safetensors"
    # stamped with two steps (a crash between the writes): refused, naming both
    _stamp(run, layer, layer_step=1, model_step=2)
    err = _err(capsys, "--run", str(run), *SYNTH)
    assert f"{run / layer} holds the weights of step 1 but {run / 'model'} those of step 2" in err
    assert "--resume" in err
    err = _err(capsys, "--scorers", f"kvpop-mlp-joint={run / layer}", "--finetuned", f"kvpop-mlp-joint={run / 'model'}",
               *SYNTH)  # the same parts named one by one
    assert f"{run / layer} holds the weights of step 1 but {run / 'model'} those of step 2" in err
    _stamp(run, layer, layer_step=2, model_step=2)
    assert read_run(str(run)).policy == "kvpop-mlp-joint"
    # no stamps (a run written before them): last.pt's step, when the weights are the checkpoint's
    _stamp(run, layer)
    assert read_run(str(run)).policy == "kvpop-mlp-joint"
    _stamp(run, layer, nudge_layer=True)  # the scorers of an earlier step beside the last step's model
    with pytest.raises(ValueError, match=r"model holds the weights of step 2, as last.pt does, but .*scorers"
                                         r"\.safetensors holds other weights and has no step stamp"):
        read_run(str(run))
    _stamp(run, layer, layer_step=2, nudge_model=True)  # a model/ whose write did not finish (no stamp)
    with pytest.raises(ValueError, match=r"scorers.safetensors holds the weights of step 2, as last.pt does, but "
                                         r".*model holds other weights and has no step stamp \(kvpop_step.json\)"):
        read_run(f"kvpop-mlp={run}")
    (run / "last.pt").unlink()  # nothing to tell the step by: taken as it is
    assert read_run(str(run)).policy == "kvpop-mlp-joint"


def test_a_dms_runs_gates_and_model_must_come_from_one_training_step(runs, tmp_path, capsys):
    run = _copy(runs, "dms", tmp_path)
    _stamp(run, "gates.safetensors", layer_step=3, model_step=1)
    err = _err(capsys, "--dms", str(run), *SYNTH)
    assert f"{run / 'gates.safetensors'} holds the weights of step 3 but {run / 'model'} those of step 1" in err
    _stamp(run, "gates.safetensors", nudge_layer=True)
    with pytest.raises(ValueError, match="as last.pt does, but .*gates.safetensors holds other weights"):
        read_run(str(run))
