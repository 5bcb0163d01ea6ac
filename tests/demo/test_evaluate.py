"""kvpop.evaluation.evaluate and ``kvpop eval`` on tiny random Qwen3 models (PyTorch CPU path)."""
import copy
import json

import pytest
import torch
from tiny import kvtrace_model

import kvpop
from kvpop.baselines import dms as D
from kvpop.cli import main
from kvpop.demo import retrofit as R
from kvpop.demo import task as T
from kvpop.evaluation import evaluate as E
from kvpop.models import cache_kwarg_name

L = 128  # task minimum is 64; 8 graded reads at 128


@pytest.fixture(scope="module")
def base():
    return kvtrace_model()


@pytest.fixture(scope="module")
def models(base, tmp_path_factory):
    """A model for every policy: random scorers saved to files, a 'fine-tuned' model = a perturbed copy."""
    d = tmp_path_factory.mktemp("scorers")
    files = {}
    for p, sc in E.SCORER_OF.items():
        m = copy.deepcopy(base)
        torch.manual_seed(1)
        kvpop.patch(m, sinks=2, window=4, budget=24, scorer=sc)
        files[p] = d / f"{sc}.safetensors"
        kvpop.save_scorers(m, files[p])
    ft = copy.deepcopy(base)
    with torch.no_grad():
        for prm in ft.parameters():
            prm.add_(0.01 * torch.randn_like(prm))
    m = copy.deepcopy(base)
    D.patch_dms(m, sinks=2, window=4)
    files["dms"] = d / "gates.safetensors"
    D.save_dms(m, files["dms"])
    kw = dict(sinks=2, window=4, budget=24)
    out = {"dense": base}
    for p in E.POLICIES[1:]:
        fine = ft if p == "fixed-finetune" else base if p in E.DMS_POLICIES else None
        out[p] = E.policy_model(base, p, scorers=files.get("dms" if p in E.DMS_POLICIES else p), finetuned=fine, **kw)
    return out


def _cfg(**kw):
    args = dict(train_len=L, lengths=[L], budgets=[24, 48], n_sequences=2, sinks=2, window=4, progress=False)
    args.update(kw)
    return E.EvalConfig(**args)


def test_every_policy_runs_and_schema(models, tmp_path):
    res = E.evaluate(models, _cfg(lengths=[L, 2 * L]), task=T)
    rows = res["rows"]
    assert {r["policy"] for r in rows} == set(E.POLICIES)
    assert len(rows) == 2 * (1 + (len(E.POLICIES) - 1) * 2)
    for r in rows:
        assert set(r) >= {"policy", "budget", "length", "accuracy"}
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["graded"] == 2 * T.DEFAULT.n_reads_for(r["length"])
        assert r["correct"] == round(r["accuracy"] * r["graded"])
    E.write_results(res, tmp_path / "results.json")
    back = json.loads((tmp_path / "results.json").read_text())
    assert isinstance(back["task"], str) and back["train_len"] == L
    assert isinstance(back["dense_accuracy"], float)
    for r in back["rows"]:
        assert isinstance(r["policy"], str) and isinstance(r["budget"], int)
        assert isinstance(r["length"], int) and isinstance(r["accuracy"], float)
    table = E.format_table(back)
    assert table.count("\n") == 1 + len(E.POLICIES)
    E.plot_results(back, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dense_equals_plain_forward(base):
    res = E.evaluate({"dense": base}, _cfg(n_sequences=3), task=T)
    batch = T.make_batch([T.test_seed(i) for i in range(3)], L)
    with torch.no_grad():
        acc = T.accuracy(base(batch["input_ids"]).logits, batch)
    assert res["dense_accuracy"] == pytest.approx(acc, abs=1e-12)
    (row,) = res["rows"]
    assert row["policy"] == "dense" and row["budget"] == L


@pytest.mark.parametrize("policy", E.POLICIES[1:])
def test_full_budget_equals_dense(models, base, policy):
    """With budget >= length nothing is evicted: every policy predicts what the model predicts densely
    (the fine-tuned policy compared with its own weights densely)."""
    ex = T.make_example(T.test_seed(5), L)
    ref_model = base
    if policy == "fixed-finetune":
        ref_model = copy.deepcopy(models[policy])
        kvpop.unpatch(ref_model)
    dense = E.sequence_predictions(ref_model, ex, "dense")
    for b in (L, L + 37):
        got = E.sequence_predictions(models[policy], ex, policy, budget=b)
        assert torch.equal(got, dense), (policy, b)


def test_small_budget_changes_something(models, base):
    """The check above can fail: at a small budget the cache does evict, and the logits move."""
    ex = T.make_example(T.test_seed(5), L)
    ids = ex["input_ids"][None]
    with torch.no_grad():
        dense = base(ids).logits
        m = models["streaming"]
        kvpop.patch(m, budget=8)
        kw = {cache_kwarg_name(): kvpop.KVpopCache(m, policy="streaming")}  # cache= or past_key_values=
        sparse = m(ids, **kw).logits
    assert (dense - sparse).abs().max() > 1e-3


@pytest.mark.parametrize("policy", E.BATCHED)
def test_batched_decoding_counts_what_one_by_one_counts(models, policy):
    """evaluate() decodes TOVA/H2O sequences of one length as one batch: the same logits (within float
    noise) and the same counts as one sequence at a time, at a budget that evicts."""
    exs = [T.make_example(T.test_seed(i), L) for i in range(3)]
    ids = torch.stack([e["input_ids"] for e in exs])
    together = E.policy_logits(models[policy], ids, policy, 24)
    for i, e in enumerate(exs):
        alone = E.policy_logits(models[policy], e["input_ids"], policy, 24)
        torch.testing.assert_close(together[i:i + 1], alone, rtol=1e-4, atol=1e-4)
    one_by_one = [E.sequence_correct(models[policy], e, policy, 24) for e in exs]
    assert E.batch_correct(models[policy], exs, policy, 24) == (sum(c for c, _ in one_by_one),
                                                               sum(g for _, g in one_by_one))
    # and the batch is not a no-op: at this budget the cache changes the logits
    assert (together - E.policy_logits(models["dense"], ids, "dense")).abs().max() > 1e-3


def test_only_the_batched_policies_take_a_batch(models):
    ids = torch.stack([T.make_example(T.test_seed(i), L)["input_ids"] for i in range(2)])
    with pytest.raises(ValueError, match="one sequence at a time"):
        E.policy_logits(models["streaming"], ids, "streaming", 24)


def test_rows_are_reused(models):
    first = E.evaluate({"dense": models["dense"], "streaming": models["streaming"]}, _cfg(), task=T)
    seen = []
    done = {f"{r['policy']}|{r['budget']}|{r['length']}": r for r in first["rows"]}
    again = E.evaluate({"dense": models["dense"], "streaming": models["streaming"]}, _cfg(), task=T,
                       done=done, on_row=seen.append)
    assert seen == [] and again["rows"] == first["rows"]


def test_bad_inputs(models, base):
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        _cfg(policies=["dense", "lru"])
    with pytest.raises(ValueError, match="too small"):
        _cfg(budgets=[6])
    with pytest.raises(ValueError, match="dense model"):
        E.evaluate({"streaming": models["streaming"]}, _cfg(), task=T)
    with pytest.raises(ValueError, match="unknown policy"):
        E.sequence_predictions(models["streaming"], T.make_example(T.test_seed(0), L), "lru")
    with pytest.raises(ValueError, match="fine-tuned"):
        E.policy_model(base, "fixed-finetune")
    with pytest.raises(ValueError, match="scorer"):
        E.policy_model(base, "kvpop-mlp")


def test_cli_eval(base, tmp_path, capsys):
    d = tmp_path / "model"
    base.save_pretrained(d)
    rc = main(["eval", "--model", str(d), "--train-len", str(L), "--lengths", str(L), "--budgets", "24",
               "--n-sequences", "1", "--sinks", "2", "--window", "4", "--threads", "1", "--no-progress",
               "--out", str(tmp_path / "out")])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {r["policy"] for r in res["rows"]} == {"dense", "streaming", "tova", "h2o"}  # no scorers given
    assert (tmp_path / "out" / "accuracy_vs_budget.png").exists()
    assert "| streaming |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--policies", "dense,lru"], "unknown policy 'lru'"),
    (["--budgets", "10"], "too small"),
    (["--policies", "kvpop-mlp"], "needs its scorers: --run kvpop-mlp=DIR or --scorers kvpop-mlp=FILE"),
    (["--scorers", "lru=x.safetensors"], "unknown policy 'lru'"),
])
def test_cli_eval_bad_inputs(argv, msg, capsys):
    assert main(["eval", "--no-progress", "--threads", "1"] + argv) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["kvpop-mlp", "kvpop-mlstm"])
def test_a_retrofit_does_not_depend_on_what_ran_before_it(base, tmp_path, policy):
    """The scorers' initialisation is seeded: two retrofits with the same settings give the same scorers,
    however much of the global random stream ran in between (the demo trains several in one process)."""
    from safetensors.torch import load_file

    cfg = R.RetrofitConfig(steps=2, length=L, budget=24, sinks=2, window=4, checkpoint_every=2)
    a = R.retrofit(base, policy, tmp_path / "a", cfg, progress=False)
    torch.randn(12345)  # move the global random stream
    b = R.retrofit(base, policy, tmp_path / "b", cfg, progress=False)
    sa, sb = load_file(a / "scorers.safetensors"), load_file(b / "scorers.safetensors")
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_the_evaluation_names_the_shipped_model_of_the_kvtrace_task():
    assert E.SHIPPED_MODEL == T.SHIPPED_MODEL and (E.SHIPPED_MODEL / "config.json").is_file()
