"""studies.controls_realtext: the untrained run equals kvpop train's start, the clusters of a corpus
split, the learning-rate choice by the selection rule, the figures and the paired comparisons."""
import json
from pathlib import Path

import pytest
import torch

from studies import controls_realtext as C

MODEL = Path(__file__).resolve().parents[2] / "kvpop" / "data" / "tiny_qwen3_code"


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps({"input_ids": [256, *range(i, i + 62), 257]}) + "\n" for i in range(4)))
    return f


def _args(data, source, seed=3):
    return ["--model", str(MODEL), "--data", str(data), "--seq-len", "64", "--sinks", "4", "--window", "8",
            "--budget", "24", "--priority-source", source, "--seed", str(seed)]


@pytest.mark.parametrize("source", ["random", "keynorm-"])
def test_untrained_run_is_kvpop_trains_start(tmp_path, data, source):
    """A source other than the scorer trains no scorer, so a one-step kvpop train run of the same options keeps
    its scorers at their seeded init: the untrained run's file must equal them; its model is the base model."""
    from safetensors.torch import load_file

    from kvpop.cli import main

    out, trained = tmp_path / "u", tmp_path / "t"
    path = C.untrained_run(_args(data, source), out)
    assert main(["train", *_args(data, source), "--steps", "1", "--checkpoint-every", "0", "--no-progress",
                 "--threads", "1", "--out", str(trained)]) == 0
    saved, ref = load_file(str(path)), load_file(str(trained / "scorers.safetensors"))
    assert saved and set(saved) == set(ref) and all(torch.equal(saved[k], ref[k]) for k in saved)
    base, kept = load_file(str(MODEL / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert set(base) == set(kept) and all(torch.equal(base[k].float(), kept[k].float()) for k in base)
    assert json.loads((out / "args.json").read_text())["priority_source"] == source
    if source == "random":  # the seed draws the frozen scorer
        other = load_file(str(C.untrained_run(_args(data, source, seed=4), tmp_path / "u4")))
        assert any(not torch.equal(saved[k], other[k]) for k in saved)


def test_untrained_run_refusals(tmp_path, data):
    with pytest.raises(ValueError, match="--out"):
        C.untrained_run([*_args(data, "random"), "--out", str(tmp_path / "x")], tmp_path / "y")
    with pytest.raises(ValueError, match="dms"):
        C.untrained_run(["--method", "dms", "--model", str(MODEL), "--data", str(data), "--seq-len", "64"],
                        tmp_path / "z")


def test_clusters_of(tmp_path):
    f = tmp_path / "v.jsonl"
    firsts = [256, 10, 256, 256, 7, 256]
    f.write_text("".join(json.dumps({"input_ids": [x, 1, 2]}) + "\n" for x in firsts))
    assert C.clusters_of(f, 6) == [0, 0, 1, 2, 2, 3]
    assert C.clusters_of(f, 3) == [0, 0, 1]
    f.write_text(json.dumps({"input_ids": [5, 1]}) + "\n")
    with pytest.raises(ValueError, match="BOS"):
        C.clusters_of(f, 1)


def test_per_sequence_names_a_missing_row():
    res = {"rows": [{"policy": "p", "budget": b, "per_sequence": [0.1, 0.2]} for b in C.EVAL_BUDGETS]}
    assert C.per_sequence(res, "p")[128] == [0.1, 0.2]
    with pytest.raises(ValueError, match="no per-sequence row of q"):
        C.per_sequence(res, "q")
    res["rows"][0]["per_sequence"] = [0.1, None]
    with pytest.raises(ValueError, match="not scored"):
        C.per_sequence(res, "p")


def _trial(lr, xs):
    return {"settings": {"lr_model": lr}, "per_sequence": xs, "score": sum(xs) / len(xs)}


def test_lr_choice_by_the_rule():
    base = [0.10, 0.12, 0.08, 0.11, 0.09, 0.10, 0.13, 0.07]
    clearly = [x - 0.02 + 0.001 * (i % 3) for i, x in enumerate(base)]  # better by ~0.02, tiny spread
    noisy = [x + (0.03 if i % 2 else -0.031) for i, x in enumerate(base)]  # mean ~0, large spread: a tie
    best, dec, more = C.lr_choice([_trial(1e-4, base), _trial(3e-4, clearly)], stage="s")
    assert best["settings"]["lr_model"] == 3e-4 and dec[0]["adopted"] and more  # 3e-4 adopted: try 1e-3
    best, dec, more = C.lr_choice([_trial(1e-4, base), _trial(3e-4, noisy)], stage="s")
    assert best["settings"]["lr_model"] == 1e-4 and not dec[0]["adopted"] and not more  # a tie: the default
    best, dec, more = C.lr_choice([_trial(1e-4, base), _trial(3e-4, clearly), _trial(1e-3, clearly)], stage="s")
    assert best["settings"]["lr_model"] == 3e-4 and not more  # equal: the earlier stays; no rate left anyway


def _run(shift, seed_noise=0.0):
    b = {str(B): [0.01 * (i % 5) + shift + seed_noise + 0.001 * B / 64 for i in range(C.VALID_SEQUENCES)]
         for B in C.EVAL_BUDGETS}
    return {"vs_original": b, "vs_same_weights": {k: [x - shift for x in v] for k, v in b.items()},
            "dense_shift": [shift] * C.VALID_SEQUENCES}


def test_figures_and_comparisons():
    runs = {"a": {"0": _run(0.0), "1": _run(0.0, 0.002)}, "b": {"0": _run(0.01)}}
    figs = C.figures(runs)
    f = next(x for x in figs if x["row"] == "b" and x["budget"] == 128)
    assert f["vs_original_mean"] == pytest.approx(sum(_run(0.01)["vs_original"]["128"]) / 16)
    assert f["dense_shift_mean"] == pytest.approx(0.01) and f["vs_same_weights_mean"] < f["vs_original_mean"]
    cs = C.comparisons(runs, "a", list(range(8)) * 2, n_boot=200)
    assert {(c["budget"], c["reference"]) for c in cs} == {(b, r) for b in C.EVAL_BUDGETS
                                                          for r in ("original", "same weights")}
    c = next(x for x in cs if x["budget"] == 128 and x["reference"] == "original")
    assert c["a"] == "a" and c["b"] == "b" and c["mean_diff"] == pytest.approx(-0.009)
    assert c["ci95"][1] < 0 and c["verdict"] == "a better" and c["n_clusters"] == 8
    same = next(x for x in cs if x["budget"] == 128 and x["reference"] == "same weights")
    assert same["mean_diff"] == pytest.approx(0.001) and same["verdict"] == "b better"


def test_same_weights_eval_is_kvpop_eval_when_the_weights_are_the_base(tmp_path, data):
    """On an untrained run (its model/ the base weights) the dense row of its own weights is the base model's,
    so the figures must be kvpop eval's exactly; a run without model/ is refused."""
    from kvpop.cli import main

    d = tmp_path / "u"
    C.untrained_run(_args(data, "random"), d)
    assert main(["eval", "--model", str(MODEL), "--data", str(data), "--seq-len", "64", "--budgets", "16,24",
                 "--sinks", "4", "--window", "8", "--no-plot", "--no-progress", "--run", str(d), "--policies",
                 "dense,kvpop-mlp-joint", "--out", str(tmp_path / "e")]) == 0
    ref = json.loads((tmp_path / "e" / "results.json").read_text())
    mine = C.same_weights_eval(d, data, tmp_path / "s", n=4, budgets=(16, 24), seq_len=64)
    assert json.loads((tmp_path / "s" / "results.json").read_text())["rows"] == mine["rows"]
    for b in (16, 24):
        r = next(x for x in ref["rows"] if x["budget"] == b)
        m = next(x for x in mine["rows"] if x["budget"] == b)
        assert m["per_sequence"] == r["per_sequence"] and m["dense_nll"] == r["dense_nll"]
    (d / "model").rename(tmp_path / "gone")
    with pytest.raises(ValueError):
        C.same_weights_eval(d, data, tmp_path / "s2", n=4, budgets=(16, 24), seq_len=64)


def test_markdown_renders_the_record():
    runs = {C.AUTO_ROW: {"0": _run(0.0), "1": _run(0.0, 0.002)}, "oracle[label]": {"0": _run(0.01)}}
    dec = {"stage": "oracle[label] lr_model", "incumbent": {"lr_model": 1e-4}, "challenger": {"lr_model": 3e-4},
           "mean_diff": -0.001, "se": 0.002, "adopted": False}
    record = {"figures": C.figures(runs), "trials_of": {C.AUTO_ROW: 6, "oracle[label]": 2},
              "lr_selection": {"oracle[label]": {"chosen": 1e-4, "decisions": [dec]}},
              "untrained": {"keynorm_sign": None}, "comparisons": C.comparisons(runs, C.AUTO_ROW, None, n_boot=100)}
    text = C.markdown(record)
    assert "| oracle[label] | 2 | 1e-4 | 1 |" in text and "| kvpop-mlp-joint[auto] | 6 | 1e-4 | 2 |" in text
    assert "| oracle[label] lr_model |" in text and "| no |" in text
    assert text.count("| original | kvpop-mlp-joint[auto] | oracle[label] |") == len(C.EVAL_BUDGETS)


def test_auto_trial_trains_in_validated_segments_as_one_run(tmp_path, data):
    """One more seed of a trial: trained in segments with a fit validation after each, it follows, step by step,
    the run kvpop train makes of the same options in one go (the history's losses), keeps its best fit state's
    served files, and records its validations."""
    from kvpop.cli import main

    common = ["--model", str(MODEL), "--data", str(data), "--seq-len", "64", "--sinks", "4", "--window", "8",
              "--budget", "24", "--steps", "4", "--checkpoint-every", "1", "--no-progress", "--threads", "1"]
    assert main(["train", *common, "--seed", "0", "--out", str(tmp_path / "trial")]) == 0
    assert main(["train", *common, "--seed", "1", "--out", str(tmp_path / "straight")]) == 0
    out = tmp_path / "seed1"
    r = C.auto_trial(tmp_path / "trial" / "args.json", 1, out, data, served=24, every=2, patience=2)
    assert [v["step"] for v in r["validations"]] == [2, 4] and r["steps"] == 4
    assert [json.loads(x)["step"] for x in (out / "validation.jsonl").read_text().splitlines()] == [2, 4]

    def losses(d):
        return [(h["step"], h["kl"]) for h in map(json.loads, (d / "history.jsonl").read_text().splitlines())]

    assert losses(out) == losses(tmp_path / "straight")
    assert (out / "scorers.safetensors").read_bytes() == (out / "best" / "scorers.safetensors").read_bytes()
    assert json.loads((out / "args.json").read_text())["seed"] == 1


def test_comparisons_against_named_rows_only():
    runs = {"o": {"0": _run(0.0)}, "c": {"0": _run(0.01)}, "x": {"0": _run(0.02)}}
    cs = C.comparisons(runs, "o", None, against=("c",), n_boot=100)
    assert {c["b"] for c in cs} == {"c"} and len(cs) == 2 * len(C.EVAL_BUDGETS)
