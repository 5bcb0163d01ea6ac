"""No host synchronisation in a decode step: one layer's step (scorer + cache write + attention) traces
into a single graph under ``torch.compile(fullgraph=True)`` (a ``.item()``, ``.tolist()``, ``bool(tensor)``
or a shape read from data would break the graph, and ``fullgraph=True`` turns that into an error), and
the compiled step does exactly what the eager one does."""
import copy

import pytest
import torch
from tiny import tiny_model

import kvpop
from kvpop.core.cache import _decode
from kvpop.core.hooks import ScorerHooks
from kvpop.models import cache_kwarg_name

CACHE = cache_kwarg_name()


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


HB = ((6, 18), (14, 10))  # head-adaptive budgets (the packed layout), the uniform total 2 x 2 x 12


@pytest.mark.parametrize("policy,scorer,head_budgets", [
    ("kvpop", "mlp", None), ("kvpop", "mlstm", None), ("streaming", "mlp", None), ("tova", "mlp", None),
    ("h2o", "mlp", None), ("kvpop", "mlp", HB), ("kvpop", "mlstm", HB)])
def test_one_layer_decode_step_compiles_fullgraph(policy, scorer, head_budgets):
    torch._dynamo.reset()
    m = kvpop.patch(tiny_model(seed=2), scorer=scorer, policy=policy, sinks=2, window=4, budget=12,
                    head_budgets=head_budgets)
    N, Hkv, Hq, D = 3, 2, 4, 32
    ids = torch.randint(1, 128, (N, 15), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(N, 15, dtype=torch.long)
    mask[0, :6] = 0  # one left-padded row: rows sit at different positions
    cache = kvpop.KVpopCache(m)
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # transformers' positions of a left-padded row
        m(ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **{CACHE: cache})
    attn = m.model.layers[0].self_attn
    layer = attn.kvpop
    scaling = attn.scaling

    def step(cache_layer, q, k, v, k_pre):
        with torch.no_grad():
            return _decode(cache_layer, attn, q, k, v, scaling, ScorerHooks(layer, k_pre), 0)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    eager_layer = copy.deepcopy(cache.layers[0])
    comp_layer = cache.layers[0]
    g = torch.Generator().manual_seed(1)
    for _ in range(6):  # crosses window exits and evictions; positions advance on the device
        q, k, v, kp = (torch.randn(N, h, D, generator=g) for h in (Hq, Hkv, Hkv, Hkv))
        want = step(eager_layer, q, k, v, kp.unsqueeze(2))
        got = compiled(comp_layer, q, k, v, kp.unsqueeze(2))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for name in ("keys", "values", "slot_pos", "slot_prio", "pos", *comp_layer.cache_policy.buffers):
            torch.testing.assert_close(getattr(comp_layer, name), getattr(eager_layer, name), atol=1e-6, rtol=0)
    assert comp_layer.pos.tolist() == [9 + 6, 15 + 6, 15 + 6]


def test_compiled_generate_equals_eager_without_per_token_recompiles():
    """transformers' compiled generate (``compileable=True`` + a ``compile_config``; on the CPU with the
    "eager" backend) decodes through the cache with whole-graph steps: the same tokens as eager
    decoding of a left-padded batch, and no recompilation per token (the step count lives on the device)."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    m = kvpop.patch(tiny_model(seed=1), sinks=2, window=4, budget=12)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = m.generate(ids, **kw, **{CACHE: kvpop.KVpopCache(m)})
        cc = CompileConfig(backend="eager", fullgraph=True, mode=None)
        cc._compile_all_devices = True
        cache = kvpop.KVpopCache(m, compileable=True)
        with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
            compiled = m.generate(ids, **kw, compile_config=cc, **{CACHE: cache})
    assert hasattr(m, "_compiled_call") and cache.is_compileable
    assert torch.equal(compiled, eager)
    assert cache.get_seq_length() == 9 + 9  # the count the compiled steps kept on the device
