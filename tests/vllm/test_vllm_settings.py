"""``kvpop.vllm.settings.resolve`` (no vLLM import): head-adaptive ``head_budgets`` are served (the packed
layout, docs/DESIGN.md section 5); a budget that would not rescale them is refused, never served uniform."""
import pytest

from kvpop.vllm.settings import resolve

S, W, B = 4, 8, 20  # 2 layers x 2 KV heads, the uniform total 80
HB = [[S + W, 2 * B - S - W], [B, B]]


def test_vllm_serves_head_budgets():
    cfg = {"kvpop_policy": "streaming", "kvpop_config": {"sinks": S, "window": W, "budget": B, "head_budgets": HB}}
    got = resolve(cfg)
    assert got.config.head_budgets == tuple(map(tuple, HB)) and got.config.budget == B
    ok = resolve({"kvpop_policy": "streaming", "kvpop_config": {"sinks": S, "window": W, "budget": B}})
    assert ok.config.head_budgets is None and ok.config.budget == B


def test_vllm_refuses_budget_off_the_head_budgets_total():
    cfg = {"kvpop_policy": "streaming", "kvpop_config": {"sinks": S, "window": W, "budget": 2 * B, "head_budgets": HB}}
    with pytest.raises(ValueError, match="head_budgets must hold the uniform total"):
        resolve(cfg)


def _scorer_file(tmp_path, head_budgets, scorer="mlp"):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvpop

    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    kvpop.patch(m, sinks=S, window=W, budget=B, head_budgets=head_budgets, scorer=scorer)
    path = tmp_path / "scorers.safetensors"
    kvpop.save_scorers(m, path)
    return str(path)


def test_vllm_head_budgets_at_another_budget_by_their_importance(tmp_path):
    """A run's scorer file at another budget: the rows are allocated anew from head_budgets.json's importance (the
    rows kvpop eval's hf engine serves at that budget); without the importance, refused naming the file."""
    from kvpop.core.budgets import allocate, rescale, write_head_budgets

    importance = [[0.0, 3.0], [1.0, 1.0]]
    rows = allocate(importance, total=4 * B, sinks=S, window=W)
    path = _scorer_file(tmp_path, rows)
    with pytest.raises(ValueError, match="head_budgets.json with their importance"):
        resolve({"kvpop_scorers": path, "kvpop_config": {"budget": 30}})
    write_head_budgets(tmp_path / "head_budgets.json", rows, importance=importance)
    got = resolve({"kvpop_scorers": path, "kvpop_config": {"budget": 30}}).config
    want = rescale(got.replace(budget=B, head_budgets=rows), 30, importance=importance)
    assert got.budget == 30 and got.head_budgets == want.head_budgets != rows
    assert resolve({"kvpop_scorers": path, "kvpop_config": {"budget": B}}).config.head_budgets == rows


def test_vllm_serves_the_mlstm_with_uniform_budgets_only(tmp_path):
    got = resolve({"kvpop_scorers": _scorer_file(tmp_path, None, "mlstm")})
    assert got.config.scorer == "mlstm" and got.uses_scorer
    (tmp_path / "hb").mkdir()
    path = _scorer_file(tmp_path / "hb", [[S + W, 2 * B - S - W], [B, B]], "mlstm")
    with pytest.raises(ValueError, match="mLSTM scorer with uniform budgets only.*'mlstm' scorer with head_budgets"):
        resolve({"kvpop_scorers": path})
