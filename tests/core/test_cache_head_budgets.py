"""``KVpopCache`` with head-adaptive budgets (``KVpopConfig.head_budgets``): each layer holds the packed layout
(``sum_h B[l][h]`` slots per row), prefills with a schedule of ``k[l][h]`` slots per head and decodes through
``fixed_budget_decode(head_budgets=...)``.

Oracles: a teacher-forced sparse forward whose schedule keeps ``k[l][h]`` tokens per head, head by head (the
stand-in attention of ``test_cache.py``), and the patched model's own teacher-forced forward (which
schedules each head with its own ``k``)."""
from types import SimpleNamespace

import pytest
import torch
from test_cache import STATE  # the stand-in scorer and attention of the uniform cache's tests
from tiny import randomize_scorers, tiny_model
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvpop
from kvpop.core.cache import KVpopCache
from kvpop.models import cache_kwarg_name

S_, W_, B_ = 2, 4, 11  # k = 5 on average
HB = ((6, 16), (14, 8))  # per layer, per KV head: k = (0, 10), (8, 2); the uniform total 2 x 2 x 11


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch, request):
    """The PyTorch CPU path, except one case of the central invariant through the default dispatch (the Triton
    kernels, interpreted on a CPU-only machine)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if not (request.node.originalname == "test_prefill_plus_decode_equals_teacher_forced"
            and params.get("policy") == "kvpop" and params.get("prompt") == 13):
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    m = Qwen3ForCausalLM(cfg).eval()
    m.set_attn_implementation("kvpop_cache_test")

    def remember_cache(module, args, kwargs):  # what kvpop.patch's pre-hook does
        module.test_cache = cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, KVpopCache):
            cache.claim(module.layer_idx, "kvpop", STATE.cfg, True)

    for layer in m.model.layers:
        layer.self_attn.register_forward_pre_hook(remember_cache, with_kwargs=True)
    return m


def _cfg(policy="kvpop", head_budgets=HB):
    return SimpleNamespace(sinks=S_, window=W_, budget=B_, policy=policy, head_budgets=head_budgets)


def _run(model, ids, prompt, cfg):
    cache = KVpopCache(config=cfg, num_layers=2)
    with torch.no_grad():
        outs = [model(ids[:, :prompt], **kvpop.cache_kwargs(cache)).logits]
        outs += [model(ids[:, i:i + 1], **kvpop.cache_kwargs(cache)).logits for i in range(prompt, ids.shape[1])]
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("policy", ["kvpop", "streaming"])
@pytest.mark.parametrize("prompt", [1, 13, 30])
def test_prefill_plus_decode_equals_teacher_forced(model, policy, prompt):
    STATE.cfg = cfg = _cfg(policy)
    ids = torch.randint(0, 64, (1, 44), generator=torch.Generator().manual_seed(prompt))
    with torch.no_grad():
        full = model(ids).logits
    got, cache = _run(model, ids, prompt, cfg)
    torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-5)
    # each head's long-range slots hold what its own schedule keeps at the last position
    q = ids.shape[1] - 1
    for li, layer in enumerate(cache.layers):
        assert layer.keys.shape[1] == sum(HB[li])
        held = layer.long_range_positions()
        for h, b in enumerate(HB[li]):
            assert len(held[h]) == (b - S_ - W_)
            if policy == "streaming":  # a constant priority keeps the newest k_h
                assert held[h] == set(range(q - W_ - (b - S_ - W_) + 1, q - W_ + 1))


def test_the_schedule_differs_from_uniform(model):
    """The oracle above is not the uniform one: with these budgets the logits differ from a uniform cache's."""
    ids = torch.randint(0, 64, (1, 44), generator=torch.Generator().manual_seed(2))
    STATE.cfg = cfg = _cfg()
    adaptive, _ = _run(model, ids, 9, cfg)
    STATE.cfg = cfg = _cfg(head_budgets=None)
    uniform, _ = _run(model, ids, 9, cfg)
    assert (adaptive - uniform).abs().max() > 1e-3


def test_equal_budgets_equal_the_uniform_cache(model):
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(6))
    STATE.cfg = cfg = _cfg(head_budgets=((B_, B_), (B_, B_)))
    packed, pc = _run(model, ids, 9, cfg)
    STATE.cfg = cfg = _cfg(head_budgets=None)
    uniform, uc = _run(model, ids, 9, cfg)
    torch.testing.assert_close(packed, uniform, atol=1e-5, rtol=1e-5)
    for a, b in zip(pc.layers, uc.layers):  # (layer 1's keys follow layer 0's outputs: equal to rounding)
        assert torch.equal(a.slot_pos.view(b.slot_pos.shape), b.slot_pos)
        torch.testing.assert_close(a.keys.view(b.keys.shape), b.keys, atol=1e-5, rtol=1e-5)
    assert torch.equal(pc.layers[0].keys.view(uc.layers[0].keys.shape), uc.layers[0].keys)


def test_memory_equals_the_uniform_cache_of_the_same_total(model):
    ids = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(1))
    sizes = {}
    for name, hb in (("adaptive", HB), ("uniform", None)):
        STATE.cfg = cfg = _cfg(head_budgets=hb)
        _, cache = _run(model, ids, 9, cfg)
        sizes[name] = cache.nbytes()
        if hb is not None:
            for li, layer in enumerate(cache.layers):
                assert layer.keys.shape == (3, sum(hb[li]), 16) and layer.slot_prio.shape == (3, sum(hb[li]) - 12)
    assert sizes["adaptive"] == sizes["uniform"] > 0


@pytest.mark.parametrize("policy", ["kvpop", "streaming"])
def test_batch_rows_equal_rows_alone(model, policy):
    STATE.cfg = cfg = _cfg(policy)
    ids = torch.randint(0, 64, (3, 30), generator=torch.Generator().manual_seed(4))
    together, cache = _run(model, ids, 9, cfg)
    for n in range(3):
        alone, c1 = _run(model, ids[n:n + 1], 9, cfg)
        torch.testing.assert_close(together[n:n + 1], alone, atol=1e-5, rtol=1e-5)
        for a, b in zip(cache.layers, c1.layers):  # the same tokens kept; keys equal to the model's rounding
            assert torch.equal(a.slot_pos[n:n + 1], b.slot_pos) and torch.equal(a.pos[n:n + 1], b.pos)
            torch.testing.assert_close(a.keys[n:n + 1], b.keys, atol=1e-5, rtol=1e-5)


def test_rows_set_rows_and_reorder(model):
    STATE.cfg = cfg = _cfg()
    ids = torch.randint(0, 64, (3, 25), generator=torch.Generator().manual_seed(8))
    _, cache = _run(model, ids, 9, cfg)
    layer = cache.layers[1]
    before = {n: getattr(layer, n).clone() for n in ("keys", "values", "slot_pos", "slot_prio", "pos")}
    idx = torch.tensor([2, 0])
    sub = layer.rows(idx)
    assert sub.head_budgets == HB[1] and sub.keys.shape == (2, sum(HB[1]), 16)
    assert sub.long_range_positions(0) == layer.long_range_positions(2)
    sub.slot_pos.fill_(-1)
    layer.set_rows(idx, sub)
    assert (layer.slot_pos[[0, 2]] == -1).all() and torch.equal(layer.slot_pos[1], before["slot_pos"][1])
    for name, t in before.items():
        getattr(layer, name).copy_(t)
    storage = layer.keys.data_ptr()
    cache.reorder_cache(torch.tensor([1, 2, 0]))
    assert layer.keys.data_ptr() == storage
    for name, t in before.items():
        assert torch.equal(getattr(layer, name), t[[1, 2, 0]]), name


def test_attention_scored_policies_refuse_head_budgets():
    for policy in ("tova", "h2o"):
        with pytest.raises(ValueError, match=rf"policy='{policy}' keeps uniform budgets.*head_budgets"):
            KVpopCache(config=_cfg(policy), num_layers=2)
    with pytest.raises(ValueError, match="head_budgets has 2 layers but the cache is built for 3"):
        KVpopCache(config=_cfg(), num_layers=3)


def test_cache_for_other_budgets_is_refused(model):
    STATE.cfg = _cfg()
    cache = KVpopCache(config=_cfg(head_budgets=((16, 6), (14, 8))), num_layers=2)
    with pytest.raises(ValueError, match="head_budgets"):
        with torch.no_grad():
            model(torch.arange(5)[None], **kvpop.cache_kwargs(cache))


# ------------------------------------------------------------------- through kvpop.patch + generate
SMALL_HB = ((10, 38), (30, 18))  # sinks 2, window 8, budget 24: k = (0, 28), (20, 8)
CACHE = cache_kwarg_name()


def _patched(scorer="mlp", policy="kvpop"):
    return randomize_scorers(kvpop.patch(tiny_model(seed=1), scorer=scorer, policy=policy, sinks=2, window=8,
                                         budget=24, head_budgets=SMALL_HB))


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_patched_model_cache_equals_its_teacher_forced_forward(scorer):
    m = _patched(scorer)
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = m(ids).logits
        cache = kvpop.KVpopCache(m)
        outs = [m(ids[:, :20], **{CACHE: cache}).logits]
        outs += [m(ids[:, i:i + 1], **{CACHE: cache}).logits for i in range(20, 70)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_patched_batched_generate_rows_equal_prompts_alone(scorer):
    """Left-padded prompts through ``generate`` with head budgets: each row as its prompt alone."""
    m = _patched(scorer)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (L,), generator=g) for L in (5, 31, 1, 17)]
    S = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), S, dtype=torch.long)
    mask = torch.zeros(len(prompts), S, dtype=torch.long)
    for n, p in enumerate(prompts):
        ids[n, S - len(p):] = p
        mask[n, S - len(p):] = 1
    cache = kvpop.KVpopCache(m)
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                         pad_token_id=0, **{CACHE: cache})
        assert cache.nbytes() == sum(layer.nbytes() for layer in cache.layers)
        assert cache.layers[0].keys.shape[:2] == (4, sum(SMALL_HB[0]))
        for n, p in enumerate(prompts):
            alone = m.generate(p[None], max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
            assert torch.equal(out[n, S:], alone[0, len(p):]), f"row {n} (prompt of {len(p)} tokens)"
