"""kvpop.demo.retrofit: the label family, early stopping on validation and warm starts (PyTorch CPU path)."""
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import kvtrace_model

from kvpop.core.checkpoint import read_scorer_config
from kvpop.core.config import decay_range_for_context
from kvpop.demo import retrofit as R

L = 128


@pytest.fixture(scope="module")
def base():
    return kvtrace_model(hidden=32, heads=2, kv_heads=1, intermediate=64)


def _cfg(**kw):
    return R.RetrofitConfig(**{"steps": 4, "length": L, "budget": 24, "sinks": 2, "window": 4,
                               "checkpoint_every": 2, **kw})


def _scorers(d):
    return load_file(d / "scorers.safetensors")


def _step_of(d):
    """The step the run in ``d`` stands at (its history has a line per step done)."""
    return len((d / "train.pt" / "history.jsonl").read_text().splitlines())


@pytest.mark.parametrize(("kw", "msg"), [({"label": "median"}, "label must be one of"),
                                         ({"eval_every": -1}, "eval_every must be an int >= 0"),
                                         ({"patience": 1.5}, "patience must be an int >= 0"),
                                         ({"decay_span": 0}, "decay_span must be None")])
def test_bad_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**kw)


def test_the_label_and_the_decay_reach_the_scorers(base, tmp_path):
    d = R.retrofit(base, "kvpop-mlp", tmp_path / "r", _cfg(steps=1, label="max", decay_span=8.0), progress=False)
    cfg = read_scorer_config(d / "scorers.safetensors")
    rng = decay_range_for_context(L, 8.0)
    assert cfg.label == "max"
    assert (cfg.gamma_min, cfg.gamma_max, cfg.gamma_init) == pytest.approx(
        (rng["gamma_min"], rng["gamma_max"], rng["gamma_init"]))
    default = read_scorer_config(R.retrofit(base, "kvpop-mlp", tmp_path / "d", _cfg(steps=1), progress=False)
                                 / "scorers.safetensors")
    assert default.label == "mean" and default.gamma_min == 0.999


def test_early_stopping_keeps_the_best_state(base, tmp_path):
    """Validations at 2, 4, 6, 8 (0.1, 0.9, 0.2, 0.3): patience 2 stops after 8 of 10 steps and keeps step 4's
    state, which equals a plain 4-step run's (the segments resume one another: the same run)."""
    scores = {2: 0.1, 4: 0.9, 6: 0.2, 8: 0.3, 10: 1.0}
    d = tmp_path / "v"
    seen = []

    def validate(model):
        seen.append(_step_of(d))
        return scores[seen[-1]]

    R.retrofit(base, "kvpop-mlstm", d, _cfg(steps=10, eval_every=2, patience=2), progress=False, validate=validate)
    done = json.loads((d / "done.json").read_text())
    assert seen == [2, 4, 6, 8]
    assert done["best_step"] == 4 and done["best_score"] == 0.9
    assert [r["step"] for r in done["validation"]] == [2, 4, 6, 8]
    plain = R.retrofit(base, "kvpop-mlstm", tmp_path / "p", _cfg(steps=4), progress=False)
    a, b = _scorers(d), _scorers(plain)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_without_patience_every_step_runs_and_the_best_is_kept(base, tmp_path):
    d = tmp_path / "v"
    scores = iter([0.5, 0.4, 0.3])
    R.retrofit(base, "kvpop-mlp", d, _cfg(steps=5, eval_every=2), progress=False, validate=lambda m: next(scores))
    done = json.loads((d / "done.json").read_text())
    assert [r["step"] for r in done["validation"]] == [2, 4, 5] and done["best_step"] == 2
    assert done["last"]["step"] == 5  # trained to the end; the state saved is step 2's
    ties = iter([1.0, 1.0, 0.9])  # a saturated validation: a tie goes to the later state (the run as asked)
    R.retrofit(base, "kvpop-mlp", tmp_path / "t", _cfg(steps=5, eval_every=2), progress=False,
               validate=lambda m: next(ties))
    assert json.loads((tmp_path / "t" / "done.json").read_text())["best_step"] == 4


def test_an_interrupted_validated_run_resumes_to_the_same_result(base, tmp_path):
    scores = {2: 0.2, 4: 0.6, 6: 0.5, 8: 0.4}
    ref = tmp_path / "ref"
    R.retrofit(base, "kvpop-mlp", ref, _cfg(steps=8, eval_every=2), progress=False,
               validate=lambda m: scores[_step_of(ref)])
    d = tmp_path / "int"
    calls = []

    def failing(model):
        calls.append(_step_of(d))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return scores[calls[-1]]

    with pytest.raises(KeyboardInterrupt):
        R.retrofit(base, "kvpop-mlp", d, _cfg(steps=8, eval_every=2), progress=False, validate=failing)
    assert not (d / "done.json").exists()
    again = []

    def validate(model):
        again.append(_step_of(d))
        return scores[again[-1]]

    R.retrofit(base, "kvpop-mlp", d, _cfg(steps=8, eval_every=2), progress=False, validate=validate, resume=True)
    assert again == [6, 8]  # steps 2 and 4 were validated before the interruption
    a, b = json.loads((d / "done.json").read_text()), json.loads((ref / "done.json").read_text())
    assert a["validation"] == b["validation"] and a["best_step"] == b["best_step"] == 4
    sa, sb = _scorers(d), _scorers(ref)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def test_a_joint_retrofit_starts_from_the_given_scorers(base, tmp_path):
    first = R.retrofit(base, "kvpop-mlp", tmp_path / "s", _cfg(steps=3), progress=False)
    init = first / "scorers.safetensors"
    d = R.retrofit(base, "kvpop-mlp-joint", tmp_path / "j",
                   _cfg(steps=1, lr_scorer=1e-12, lr_model=1e-12, init_scorers=str(init)), progress=False)
    a, b = _scorers(d), load_file(init)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-9, msg=k)
    fresh = _scorers(R.retrofit(base, "kvpop-mlp-joint", tmp_path / "f", _cfg(steps=1, lr_scorer=1e-12,
                                                                              lr_model=1e-12), progress=False))
    assert any(not torch.allclose(fresh[k], b[k]) for k in b)
    stamp = json.loads((d / "done.json").read_text())["settings"]["init_scorers"]
    assert stamp == {"sha256": R._content_sha256(init)}
    # the content, not the bytes: the same tensors and metadata written in another order hash alike
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(init), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in reversed(list(f.keys()))}
    save_file(tensors, tmp_path / "again.safetensors", metadata=dict(reversed(list(meta.items()))))
    assert R._content_sha256(tmp_path / "again.safetensors") == stamp["sha256"]
    tensors[next(iter(tensors))] = tensors[next(iter(tensors))] + 1
    save_file(tensors, tmp_path / "other.safetensors", metadata=meta)
    assert R._content_sha256(tmp_path / "other.safetensors") != stamp["sha256"]
    with pytest.raises(ValueError, match="fixed-finetune trains no scorers"):
        R.retrofit(base, "fixed-finetune", tmp_path / "x", _cfg(init_scorers=str(init)), progress=False)
    with pytest.raises(ValueError, match="retrofit_dms takes no"):
        R.retrofit_dms(base, tmp_path / "y", _cfg(eval_every=2), progress=False)


def test_head_adaptive_budgets_fixed_before_training(base, tmp_path):
    """``head_allocation="ablation"``: budgets by ablation importance on validation sequences, the uniform total,
    written beside the scorers (which carry them) and reused by a second run with the same settings."""
    from kvpop.core.budgets import read_head_budgets

    cfg = _cfg(steps=2, head_allocation="ablation")
    d = R.retrofit(base, "kvpop-mlstm", tmp_path / "h", cfg, progress=False)
    hb = read_head_budgets(d / "head_budgets.json")
    rows = hb["head_budgets"]
    assert len(rows) == 2 and len(rows[0]) == 1 and sum(map(sum, rows)) == 2 * 1 * cfg.budget
    assert all(b >= cfg.sinks + cfg.window for r in rows for b in r)
    assert hb["measured_on"]["rule"] == "ablation" and "valid_seed(0..7)" in hb["measured_on"]["sequences"]
    assert [list(r) for r in read_scorer_config(d / "scorers.safetensors").head_budgets] == [list(r) for r in rows]
    assert json.loads((d / "done.json").read_text())["settings"]["head_allocation"] == "ablation"
    mtime = (d / "head_budgets.json").stat().st_mtime_ns
    R.retrofit(base, "kvpop-mlstm", d, cfg, progress=False, resume=False)
    assert (d / "head_budgets.json").stat().st_mtime_ns == mtime  # measured once
    uniform = json.loads((R.retrofit(base, "kvpop-mlp", tmp_path / "u", _cfg(steps=1), progress=False)
                          / "done.json").read_text())
    assert "head_allocation" not in uniform["settings"]  # uniform retrofits stamp as before the option
    with pytest.raises(ValueError, match="head_allocation must be"):
        _cfg(head_allocation="mass")


@pytest.mark.parametrize(("kw", "msg"), [({"priority_source": "keynorm"}, "priority_source must be one of"),
                                         ({"priority_source": "window-attention", "head_allocation": "ablation"},
                                          "uniform budgets only")])
def test_bad_priority_sources(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**kw)


def test_a_priority_source_needs_a_joint_kvpop_retrofit():
    with pytest.raises(ValueError, match="fixed-finetune trains no scorers"):
        R.kv_config("fixed-finetune", _cfg(priority_source="random"))
    with pytest.raises(ValueError, match="would train nothing"):
        R.kv_config("kvpop-mlp", _cfg(priority_source="keynorm+"))
    assert R.kv_config("kvpop-mlp-joint", _cfg(priority_source="keynorm-")).priority_source == "keynorm-"
    assert "priority_source" not in _cfg().stamp()  # a learned retrofit stamps as before the option existed
    assert _cfg(priority_source="random").stamp()["priority_source"] == "random"


def test_a_random_control_keeps_its_seeded_start(base, tmp_path):
    """The untrained control's scorers (``initial_scorers``) are the retrofit's start, and a control's training
    (no L_score) never moves them while the model learns; another seed starts elsewhere."""
    cfg = _cfg(steps=2, priority_source="random")
    start = R.initial_scorers(base, "kvpop-mlp-joint", tmp_path / "u" / "scorers.safetensors", cfg)
    d = R.retrofit(base, "kvpop-mlp-joint", tmp_path / "r", cfg, progress=False)
    a, b = load_file(start), _scorers(d)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_scorer_config(d / "scorers.safetensors").priority_source == "random"
    moved = load_file(d / "model" / "model.safetensors")
    same = dict(base.named_parameters())
    assert any(not torch.equal(v, same[k].detach()) for k, v in moved.items() if k in same)
    other = load_file(R.initial_scorers(base, "kvpop-mlp-joint", tmp_path / "o.safetensors",
                                        _cfg(steps=2, priority_source="random", seed=1)))
    assert any(not torch.equal(a[k], other[k]) for k in a)
    with pytest.raises(ValueError, match="initial_scorers"):
        R.initial_scorers(base, "fixed-finetune", tmp_path / "f.safetensors", _cfg())
