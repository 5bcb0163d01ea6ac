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
