"""``kvpop.vllm.settings.resolve`` (no vLLM import): the plugin keeps uniform budgets and refuses a config with
head-adaptive ``head_budgets`` (docs/DESIGN.md section 5)."""
import pytest

from kvpop.vllm.settings import resolve


def test_vllm_refuses_head_budgets():
    s, w, b = 4, 8, 20  # 2 layers x 2 KV heads, the uniform total 80
    hb = [[s + w, 2 * b - s - w], [b, b]]
    cfg = {"kvpop_policy": "streaming", "kvpop_config": {"sinks": s, "window": w, "budget": b, "head_budgets": hb}}
    with pytest.raises(ValueError, match="vLLM plugin keeps uniform budgets.*head_budgets"):
        resolve(cfg)
    # the uniform config is served
    ok = resolve({"kvpop_policy": "streaming", "kvpop_config": {"sinks": s, "window": w, "budget": b}})
    assert ok.config.head_budgets is None and ok.config.budget == b
