"""``KVpopCache(kv_dtype="int8" | "fp8")`` and ``kvpop.patch(model, kv_dtype=...)``: quantised slots.

The same teacher-forced decode of a tiny patched model with a float32 cache and a quantised one: the
scorer prices tokens from full-precision keys, so the first layer (whose inputs quantisation does not
touch) makes every eviction of the float cache (slot positions and priorities equal) and stores its keys
and values to within half a code step; the logits are close, and the bytes are what the layout says.
Uniform and packed (head-adaptive) layouts, two rows; ``kvpop.patch(kv_dtype=...)``; the refusals.
"""
import pytest
import torch
from tiny import randomize_scorers, tiny_model

import kvpop
from kvpop.models import cache_kwarg_name
from kvpop_kernels.layout import dequantize

SINKS, WINDOW, BUDGET = 2, 4, 12  # k = 6: the prompt and the decode run well past the budget
HB = ((8, 16), (14, 10))  # head-adaptive rows of the same total (2 layers x 2 KV heads x 12)
CACHE = cache_kwarg_name()
DTYPES = ["int8", pytest.param("fp8", marks=pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"),
                                                                reason="no float8 in this torch"))]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    """The PyTorch CPU path of kvpop_kernels (the kernels have their own quantised tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(**kw):
    return randomize_scorers(kvpop.patch(tiny_model(seed=1), sinks=SINKS, window=WINDOW, budget=BUDGET, **kw))


def _decode(m, ids, prompt, **cache_kw):
    cache = kvpop.KVpopCache(m, **cache_kw)
    with torch.no_grad():
        outs = [m(ids[:, :prompt], use_cache=True, **{CACHE: cache}).logits[:, -1]]
        outs += [m(ids[:, i:i + 1], use_cache=True, **{CACHE: cache}).logits[:, -1]
                 for i in range(prompt, ids.shape[1])]
    return torch.stack(outs, 1), cache


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("head_budgets", [None, HB], ids=["uniform", "packed"])
def test_quantized_cache_follows_the_float_cache(kv_dtype, head_budgets):
    m = _model(head_budgets=head_budgets)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    ref, fc = _decode(m, ids, 17)
    got, qc = _decode(m, ids, 17, kv_dtype=kv_dtype)
    rel = float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert 0 < rel < (0.02 if kv_dtype == "int8" else 0.06), rel
    for i, (fl, ql) in enumerate(zip(fc.layers, qc.layers)):
        assert ql.keys.dtype == (torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn)
        # bytes: 1 per element of keys and values, plus a float32 scale per slot for each
        extra = 2 * 4 * ql.slot_pos.numel() - 3 * (fl.keys.numel() + fl.values.numel())
        assert ql.nbytes() == fl.nbytes() + extra
        if i > 0:  # later layers read the quantised attention of the layers before
            continue
        assert torch.equal(fl.slot_pos, ql.slot_pos) and torch.equal(fl.slot_prio, ql.slot_prio)
        valid = fl.slot_pos >= 0
        for name, scale in (("keys", ql.k_scale), ("values", ql.v_scale)):
            f, q = getattr(fl, name), dequantize(getattr(ql, name), scale)
            step = scale[..., None] * (0.5 if kv_dtype == "int8" else 448 * 2.0 ** -4)
            assert bool(((f - q).abs() <= step + 1e-6)[valid].all()), name


@pytest.mark.parametrize("kv_dtype", ["int8"])
def test_patch_kv_dtype_reaches_generate(kv_dtype):
    """``kvpop.patch(model, kv_dtype=...)``: the cache ``generate`` builds is quantised; re-patching with another
    ``kv_dtype`` keeps the scorers."""
    m = _model()
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = m.generate(ids, max_new_tokens=6, do_sample=False)
        weights = {k: v.clone() for k, v in m.state_dict().items()}
        kvpop.patch(m, kv_dtype=kv_dtype)
        assert kvpop.get_config(m).kv_dtype == kv_dtype
        assert all(torch.equal(v, m.state_dict()[k]) for k, v in weights.items())
        assert kvpop.KVpopCache(m).kv_dtype == kv_dtype
        assert kvpop.KVpopCache(m, kv_dtype=None).kv_dtype is None  # the model's dtype, whatever the config says
        quant = m.generate(ids, max_new_tokens=6, do_sample=False)
    assert quant.shape == plain.shape  # (tokens may differ: int8 moves the logits)


def test_refusals():
    m = _model()
    with pytest.raises(ValueError, match=r"kv_dtype must be 'auto' .*None .*\['int8', 'fp8'\], got 'int4'"):
        kvpop.KVpopCache(m, kv_dtype="int4")
    with pytest.raises(ValueError, match=r"kv_dtype must be None .*got 'bf16'"):
        kvpop.patch(m, kv_dtype="bf16")
    with pytest.raises(ValueError, match="kv_dtype='int8' works with the policies"):
        kvpop.KVpopCache(m, policy="tova", kv_dtype="int8")
    with pytest.raises(ValueError, match=r"kv_dtype='fp8' works with the policies \('kvpop', 'streaming'\)"):
        kvpop.patch(m, policy="h2o", kv_dtype="fp8")
