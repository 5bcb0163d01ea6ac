"""``kvpop eval --problems --engine vllm``: the same problems through vLLM with kvpop's plugin give the hf engine's
greedy answers (dense, streaming, a kvpop MLP scorer file, an mLSTM scorer file).  Runs only where vLLM is installed."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints.llm")

import torch  # noqa: E402
from test_vllm_engine import _cpu_engine_env  # noqa: E402, F401  (vLLM's CPU settings, autouse)

import kvpop  # noqa: E402
from kvpop import answers as P  # noqa: E402
from kvpop.demo.problems import task_problems  # noqa: E402
from kvpop.evaluation import evaluate as E  # noqa: E402

SINKS, WINDOW, BUDGET, BLOCK = 4, 32, 64, 32


def test_vllm_and_hf_engines_give_the_same_greedy_answers(tmp_path):
    torch.manual_seed(0)
    base = E.load_base_model()
    files = {}
    for scorer in ("mlp", "mlstm"):
        m = E.load_base_model()
        kvpop.patch(m, sinks=SINKS, window=WINDOW, budget=BUDGET, scorer=scorer)
        files[scorer] = tmp_path / f"{scorer}.safetensors"
        kvpop.save_scorers(m, files[scorer])
    scorers = files["mlp"]
    recs = task_problems("kvtrace", 256, 1, reads=4)
    problems = [P.Problem(i, r["id"], r["prompt_ids"], None, r["answer_ids"]) for i, r in enumerate(recs)]
    cfg = P.ProblemsConfig(budgets=[BUDGET], policies=["dense", "streaming", "kvpop-mlp", "kvpop-mlstm"],
                           max_new_tokens=40,
                           batch_size=4, sinks=SINKS, window=WINDOW, progress=False)
    hf_models = {"dense": base,
                 "streaming": E.policy_model(base, "streaming", sinks=SINKS, window=WINDOW, budget=BUDGET),
                 "kvpop-mlp": E.policy_model(base, "kvpop-mlp", scorers=scorers, sinks=SINKS, window=WINDOW,
                                             budget=BUDGET),
                 "kvpop-mlstm": E.policy_model(base, "kvpop-mlstm", scorers=files["mlstm"], sinks=SINKS, window=WINDOW,
                                               budget=BUDGET)}
    hf = P.evaluate_problems(hf_models, problems, cfg, eos_token_id=None, out=tmp_path / "hf")
    ship = str(E.SHIPPED_MODEL)
    vmodels = {"dense": P.VLLMModel(ship), "streaming": P.VLLMModel(ship, "streaming"),
               "kvpop-mlp": P.VLLMModel(ship, "kvpop", str(scorers)),
               "kvpop-mlstm": P.VLLMModel(ship, "kvpop", str(files["mlstm"]))}
    engine = P.VLLMEngine(sinks=SINKS, window=WINDOW, dtype="float32", block_size=BLOCK, max_model_len=1024,
                          seed=0, max_num_seqs=4)
    try:
        vl = P.evaluate_problems(vmodels, problems, cfg, eos_token_id=None, out=tmp_path / "vllm", engine=engine)
    finally:
        engine.close()
    toks = {}
    for name in ("hf", "vllm"):
        rows = P.load_log(tmp_path / name / P.RESULTS_LOG)
        toks[name] = {k: [s["tokens"] for s in r["samples"]] for k, r in rows.items()}
    assert toks["hf"] == toks["vllm"]
    assert [r["pass@1"] for r in hf["rows"]] == [r["pass@1"] for r in vl["rows"]]
