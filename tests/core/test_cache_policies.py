"""The cache's policies as objects (``kvpop.core.cache_policy``): what each keeps, and ``nbytes`` counting
exactly what a layer holds, for every policy and storage (16-bit, int8, fp8)."""
import pytest
import torch
from tiny import randomize_scorers, tiny_model

import kvpop
from kvpop.core.cache_policy import CachePolicy, HookedPolicy, cache_policy, register_policy, registered_policies
from kvpop.models import cache_kwarg_name
from kvpop_kernels.layout import SlotState

CACHE = cache_kwarg_name()
FP8 = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 in this torch")
NOT_STATE = ("_seen_t", "_head_offs", "pending")  # the step counter, the layout's head offsets, the call's inputs


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _held(x, seen) -> list[torch.Tensor]:
    """Every tensor reachable from ``x`` through attributes, dataclass fields, tuples and lists."""
    if isinstance(x, torch.Tensor):
        return [] if id(x) in seen or seen.add(id(x)) else [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _held(y, seen)]
    if isinstance(x, SlotState):
        return _held(list(vars(x).values()), seen)
    return []


@pytest.mark.parametrize("policy,kv_dtype,scorer", [
    ("kvpop", None, "mlp"), ("kvpop", None, "mlstm"), ("streaming", None, "mlp"), ("tova", None, "mlp"),
    ("h2o", None, "mlp"), ("kvpop", "int8", "mlp"), ("streaming", "int8", "mlp"),
    pytest.param("kvpop", "fp8", "mlp", marks=FP8), pytest.param("streaming", "fp8", "mlp", marks=FP8),
])
def test_nbytes_is_every_held_tensor(policy, kv_dtype, scorer):
    m = randomize_scorers(kvpop.patch(tiny_model(seed=1).to(torch.bfloat16), sinks=2, window=4, budget=12,
                                      scorer=scorer, mlstm_dim=8))
    cache = kvpop.KVpopCache(m, policy=policy, kv_dtype=kv_dtype)
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(ids[:, :14], use_cache=True, **{CACHE: cache})
        m(ids[:, 14:15], use_cache=True, **{CACHE: cache})  # a decode step
    for layer in cache.layers:
        held = _held([v for k, v in vars(layer).items() if k not in NOT_STATE], set())
        assert all(t.shape[0] == 2 for t in held)  # per-row state only: one row per sequence
        assert layer.nbytes() == sum(t.numel() * t.element_size() for t in held) > 0
        # the attention scores only where the policy ranks by them, the window's priorities only where static
        assert hasattr(layer, "score") == (policy in ("tova", "h2o"))
        assert hasattr(layer, "ring_prio") == (policy in ("kvpop", "streaming"))
        assert (layer.k_scale is not None) == (kv_dtype is not None)
        store = {None: torch.bfloat16, "int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}[kv_dtype]
        assert layer.keys.dtype == store
    assert cache.nbytes() == sum(layer.nbytes() for layer in cache.layers)


def test_policy_registry():
    assert registered_policies()[:4] == ("kvpop", "streaming", "tova", "h2o")
    assert registered_policies(static=True) == ("kvpop", "streaming")
    assert not cache_policy("tova").static and cache_policy("h2o").buffers == {"score": ("slots", 0.0)}
    with pytest.raises(ValueError, match=r"policy must be one of \('kvpop', 'streaming', 'tova', 'h2o'.*'lru'"):
        kvpop.KVpopCache(config=kvpop.KVpopConfig(sinks=2, window=4, budget=12), num_layers=1, policy="lru")
    with pytest.raises(ValueError, match="named 'tova' is registered already"):
        register_policy(HookedPolicy("tova"))
    with pytest.raises(TypeError, match="takes a named CachePolicy"):
        register_policy(CachePolicy())
    with pytest.raises(RuntimeError, match="the kvpop policy needs the model's scorer"):
        cache_policy("kvpop").hooks(None)
