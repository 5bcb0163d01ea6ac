"""``kvpop eval --data``: teacher-forced NLL / top-1 agreement of eviction policies on a model's own traces."""
import json

import pytest
import torch
from test_cli_train import _tokenizer_model_dir

from kvpop.cli import main
from kvpop.demo import task as T
from kvpop.evaluation import evaluate as E
from kvpop.evaluation import trace_eval as TE

SINKS, WINDOW = 4, 32


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(1)
    return E.load_base_model()


def _traces(n=3, length=160):
    return [T.make_example(T.test_seed(i), length)["input_ids"] for i in range(n)]


def _write(path, traces):
    with open(path, "w") as f:
        for t in traces:
            f.write(json.dumps({"input_ids": t.tolist()}) + "\n")
    return path


def _streaming_reference(model, ids, budget):
    """Brute force: the unpatched model with an explicit mask that shows each query the sinks and the
    most recent ``budget - sinks`` tokens (StreamingLLM at a fixed budget)."""
    L = ids.numel()
    q = torch.arange(L)[:, None]
    t = torch.arange(L)[None, :]
    vis = (t <= q) & ((t < SINKS) | (t > q - (budget - SINKS)))
    mask = torch.zeros(1, 1, L, L)
    mask[0, 0][~vis] = float("-inf")
    with torch.no_grad():
        return model(ids[None], attention_mask=mask, use_cache=False).logits


def test_scores_match_a_brute_force_streaming_reference(shipped):
    traces = _traces(2)
    budgets = [40, 64]
    models = {"dense": shipped, "streaming": E.policy_model(shipped, "streaming", sinks=SINKS, window=WINDOW,
                                                            budget=budgets[0])}
    cfg = TE.TraceEvalConfig(budgets=budgets, sinks=SINKS, window=WINDOW, policies=["dense", "streaming"],
                             progress=False)
    rows = TE.evaluate_traces(models, traces, cfg)
    assert [(r["policy"], r["budget"]) for r in rows] == [("streaming", 40), ("streaming", 64)]
    start = max(budgets)  # every budget is scored over the positions past the largest one
    for r in rows:
        b = r["budget"]
        nll = dnll = agree = n = 0
        for t in traces:
            ref = _streaming_reference(shipped, t, b)[0]
            dense = shipped(t[None], use_cache=False).logits[0].detach()
            lp = torch.log_softmax(ref[start:-1].double(), -1)
            tgt = t[start + 1:]
            nll += float(-lp.gather(1, tgt[:, None]).sum())
            dnll += float(-torch.log_softmax(dense[start:-1].double(), -1).gather(1, tgt[:, None]).sum())
            agree += int((ref[start:-1].argmax(-1) == dense[start:-1].argmax(-1)).sum())
            n += len(tgt)
        assert r["positions"] == n == 2 * (160 - 1 - start) and r["scored_from"] == start
        assert r["nll"] == pytest.approx(nll / n, rel=1e-4)
        assert r["dense_nll"] == pytest.approx(dnll / n, rel=1e-4)
        assert r["delta_nll"] == pytest.approx((nll - dnll) / n, rel=1e-3, abs=1e-5)
        assert r["top1_agreement"] == pytest.approx(agree / n)
        # it really evicts: the recent window alone loses the facts the reads need
        assert r["delta_nll"] > 0.05 and r["top1_agreement"] < 1.0


def test_cli_on_token_ids_with_the_shipped_model(tmp_path, capsys):
    data = _write(tmp_path / "traces.jsonl", _traces(3))
    out = tmp_path / "out"
    rc = main(["eval", "--model", str(E.SHIPPED_MODEL), "--data", str(data), "--budgets", "40,80",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["kind"] == "traces" and res["budgets"] == [40, 80] and res["n_traces"] == 3
    got = {(r["policy"], r["budget"]) for r in res["rows"]}
    assert got == {(p, b) for p in ("streaming", "tova", "h2o") for b in (40, 80)}
    assert res["scored_from"] == 80  # the same positions for every budget: the dense reference is one number
    assert len({r["dense_nll"] for r in res["rows"]}) == 1
    for r in res["rows"]:
        assert r["positions"] == 3 * (160 - 1 - 80) and r["n_sequences"] == 3
        assert 0.0 <= r["top1_agreement"] <= 1.0
        assert r["delta_nll"] == pytest.approx(r["nll"] - r["dense_nll"], abs=1e-9)
    assert (out / "nll_vs_budget.png").stat().st_size > 1000
    table = (out / "table.md").read_text()
    assert "| streaming |" in table and "B=40" in table and table in capsys.readouterr().out
    assert "at every position >= 80 (the largest budget; the same positions in every column)" in table


def test_cli_text_records_use_the_models_tokenizer(tmp_path):
    mdir = _tokenizer_model_dir(tmp_path / "model")
    data = tmp_path / "text.jsonl"
    with open(data, "w") as f:
        for r in range(2):
            f.write(json.dumps({"text": " ".join(f"w{(7 * r + 3 * i) % 200}" for i in range(90))}) + "\n")
    out = tmp_path / "out"
    assert main(["eval", "--model", str(mdir), "--data", str(data), "--budgets", "40", "--seq-len", "80",
                 "--policies", "dense,streaming", "--out", str(out), "--no-progress", "--no-plot"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["n_traces"] == 2 and res["trace_lengths"]["max"] == 80
    assert [r["positions"] for r in res["rows"]] == [2 * (80 - 1 - 40)]


def test_user_errors(tmp_path, capsys):
    data = _write(tmp_path / "t.jsonl", _traces(1, 100))
    ship = str(E.SHIPPED_MODEL)
    cases = [
        (["--data", str(data)], "--data needs --model"),
        (["--model", ship, "--data", str(data), "--budgets", "20"], "below sinks + window + 1"),
        (["--model", ship, "--data", str(data)], "default"),  # 6.25% of 100 tokens is too small
        (["--model", ship, "--data", str(data), "--budgets", "99"], "no position past the budget"),
        (["--model", ship, "--data", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--model", ship, "--data", str(data), "--budgets", "40", "--policies", "kvpop-mlp"], "needs its scorers"),
        (["--model", ship, "--data", str(data), "--lengths", "64"], "for the synthetic task"),
        (["--seq-len", "64"], "--seq-len is for --data"),
    ]
    for extra, msg in cases:
        assert main(["eval", "--no-progress", *extra]) == 2, extra
        assert msg in capsys.readouterr().err, extra
