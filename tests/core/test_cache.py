"""KVpopCache: prefill + fixed-budget decoding against teacher-forced sparse attention, baseline rules."""
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM
from transformers.masking_utils import AttentionMaskInterface

import kvpop
from kvpop.core.cache import KVpopCache, PriorityHooks, cache_attention
from kvpop_kernels import eviction_schedule, sparse_attention

LOG_GAMMA = -0.01


def _key_priority(key: torch.Tensor) -> torch.Tensor:
    """A stand-in scorer: a fixed function of each token's key, with the age term of docs/DESIGN.md."""
    S = key.shape[2]
    t = torch.arange(S, dtype=torch.float32, device=key.device)
    return 3.0 * key[..., 0].float() - t * LOG_GAMMA


HOOKS = PriorityHooks(
    prompt=lambda module, layer, key, value: _key_priority(key),
    token=lambda module, layer, k1, v1, pos, i: 3.0 * k1[..., 0].float() - pos[:, None].float() * LOG_GAMMA,
)
STATE = SimpleNamespace(cfg=None)


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    cfg = STATE.cfg
    cache = getattr(module, "test_cache", None)
    out = cache_attention(cache, module, query, key, value, scaling=scaling, hooks=HOOKS) \
        if isinstance(cache, KVpopCache) else None
    if out is not None:
        return out, None
    # teacher-forced: one sparse attention over the whole sequence with the same priorities
    prio = _key_priority(key) if cfg.policy == "kvpop" else torch.zeros(key.shape[:3])
    ev = _schedule(prio, cfg, module.layer_idx)
    o, _ = sparse_attention(query, key, value, ev, sinks=cfg.sinks, window=cfg.window, scale=scaling)
    return o.transpose(1, 2), None


def _schedule(prio, cfg, layer_idx):
    """The teacher-forced schedule: uniform ``k``, or with ``cfg.head_budgets`` (test_cache_head_budgets.py)
    ``k[l][h]`` long-range slots per head, scheduled head by head (not through the per-head ``k`` of
    ``eviction_schedule``, so that the cache is checked against an independent path)."""
    hb = getattr(cfg, "head_budgets", None)
    if hb is None:
        return eviction_schedule(prio, sinks=cfg.sinks, window=cfg.window, k=cfg.budget - cfg.sinks - cfg.window)
    ev = [eviction_schedule(prio[:, h:h + 1].contiguous(), sinks=cfg.sinks, window=cfg.window,
                            k=b - cfg.sinks - cfg.window) for h, b in enumerate(hb[layer_idx])]
    return torch.cat(ev, dim=1)


AttentionInterface.register("kvpop_cache_test", _attention)
AttentionMaskInterface.register("kvpop_cache_test", lambda *args, **kwargs: None)


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch, request):
    """The model-level tests take the PyTorch CPU path (the kernels have their own tests, and the
    interpreter would make these take minutes), except one case of the central invariant that runs
    the package's default dispatch (the Triton kernels, interpreted on a CPU-only machine)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    default = (request.node.originalname == "test_prefill_plus_decode_equals_teacher_forced"
               and params.get("policy") == "kvpop" and params.get("prompt") == 7 and params.get("budget") == 10)
    if not default:
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    m = Qwen3ForCausalLM(cfg).eval()
    m.set_attn_implementation("kvpop_cache_test")

    def remember_cache(module, args, kwargs):  # what kvpop.patch's pre-hook does for the kvpop attention
        module.test_cache = cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, KVpopCache):  # ... and its claim: this model serves the cache
            cache.claim(module.layer_idx, "kvpop", STATE.cfg, True)

    for layer in m.model.layers:
        layer.self_attn.register_forward_pre_hook(remember_cache, with_kwargs=True)
    return m


def _cfg(sinks, window, budget, policy):
    return SimpleNamespace(sinks=sinks, window=window, budget=budget, policy=policy)


@pytest.mark.parametrize("policy", ["kvpop", "streaming"])
@pytest.mark.parametrize("sinks,window,budget", [(2, 4, 10), (4, 8, 12), (1, 3, 4), (2, 4, 200)])
@pytest.mark.parametrize("prompt", [1, 7, 30])
def test_prefill_plus_decode_equals_teacher_forced(model, policy, sinks, window, budget, prompt):
    """The central invariant: prefill + fixed-budget decoding == one sparse_attention forward."""
    STATE.cfg = _cfg(sinks, window, budget, policy)
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(prompt))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVpopCache(config=STATE.cfg, num_layers=2)
        outs = [model(ids[:, :prompt], **kvpop.cache_kwargs(cache)).logits]
        for i in range(prompt, 48):
            outs.append(model(ids[:, i:i + 1], **kvpop.cache_kwargs(cache)).logits)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-4, rtol=1e-5)
    assert cache.get_seq_length() == 48


def test_long_range_slots_hold_the_schedule(model):
    """After decoding, each head's long-range slots hold exactly the schedule's kept set."""
    STATE.cfg = cfg = _cfg(2, 4, 11, "kvpop")
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = KVpopCache(config=cfg, num_layers=2)
    with torch.no_grad():
        model(ids[:, :9], **kvpop.cache_kwargs(cache))
        for i in range(9, 40):
            model(ids[:, i:i + 1], **kvpop.cache_kwargs(cache))
    # recompute the full keys of layer 0 from a teacher-forced pass
    captured = {}

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured.setdefault(module.layer_idx, key)
        return _attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("kvpop_cache_capture", capture)
    AttentionMaskInterface.register("kvpop_cache_capture", lambda *a, **k: None)
    model.set_attn_implementation("kvpop_cache_capture")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.set_attn_implementation("kvpop_cache_test")
    for layer_idx in (0, 1):
        ev = eviction_schedule(_key_priority(captured[layer_idx]), sinks=2, window=4, k=5)[0]
        q = 39
        for h in range(2):
            expect = {t for t in range(2, q - 4 + 1) if ev[h, t] > q}
            assert cache.layers[layer_idx].long_range_positions()[h] == expect


def test_memory_is_flat(model):
    STATE.cfg = cfg = _cfg(2, 4, 10, "kvpop")
    cache = KVpopCache(config=cfg, num_layers=2)
    ids = torch.randint(0, 64, (1, 6 * 10 + 1))
    sizes = {}
    with torch.no_grad():
        model(ids[:, :1], **kvpop.cache_kwargs(cache))
        for i in range(1, ids.shape[1]):
            model(ids[:, i:i + 1], **kvpop.cache_kwargs(cache))
            if i + 1 in (3 * 10, 6 * 10):
                sizes[i + 1] = cache.nbytes()
    assert sizes[30] == sizes[60] > 0
    for layer in cache.layers:
        assert layer.keys.shape[2] == 10 and int((layer.slot_pos >= 0).sum(-1).max()) <= 10


def test_generate_with_explicit_cache(model):
    STATE.cfg = cfg = _cfg(2, 4, 10, "streaming")
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        out = model.generate(ids, **kvpop.cache_kwargs(KVpopCache(config=cfg, num_layers=2)), max_new_tokens=25,
                             do_sample=False)
    assert out.shape == (1, 37)


@pytest.mark.parametrize("policy", ["kvpop", "streaming", "tova", "h2o"])
def test_batch_rows_equal_rows_alone(model, policy):
    """Three rows decoded together give each row's logits decoded alone, and the same cache rows."""
    STATE.cfg = cfg = _cfg(2, 4, 10, policy)
    ids = torch.randint(0, 64, (3, 30), generator=torch.Generator().manual_seed(4))

    def run(x):
        cache = KVpopCache(config=cfg, num_layers=2)
        with torch.no_grad():
            outs = [model(x[:, :9], **kvpop.cache_kwargs(cache)).logits]
            outs += [model(x[:, i:i + 1], **kvpop.cache_kwargs(cache)).logits for i in range(9, 30)]
        return torch.cat(outs, 1), cache

    together, cache = run(ids)
    for n in range(3):
        alone, c1 = run(ids[n:n + 1])
        torch.testing.assert_close(together[n:n + 1], alone, atol=1e-5, rtol=1e-5)
        for a, b in zip(cache.layers, c1.layers):
            assert torch.equal(a.slot_pos[n:n + 1], b.slot_pos) and torch.equal(a.pos[n:n + 1], b.pos)


def test_batch_size_cannot_change_mid_sequence(model):
    STATE.cfg = cfg = _cfg(2, 4, 10, "streaming")
    cache = KVpopCache(config=cfg, num_layers=2)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)), **kvpop.cache_kwargs(cache))
        with pytest.raises(ValueError, match="holds 2 sequences but the call has batch size 3"):
            model(torch.randint(0, 64, (3, 1)), **kvpop.cache_kwargs(cache))


def test_bad_config():
    with pytest.raises(ValueError, match="policy"):
        KVpopCache(config=_cfg(2, 4, 10, "lru"), num_layers=1)
    with pytest.raises(ValueError, match="budget"):
        KVpopCache(config=_cfg(2, 4, 5, "streaming"), num_layers=1)
    with pytest.raises(ValueError, match="patched model"):
        KVpopCache()


# ---------------------------------------------------------------------------- TOVA and H2O
def _brute_force_scored(policy, qs, ks, vs, sinks, window, k, scale):
    """Plain-Python simulation of the attention-scored policies on one layer (lists, no slots)."""
    hkv = ks.shape[1]
    G = qs.shape[1] // hkv
    outs, kept_sets = [], []
    score = [dict() for _ in range(hkv)]  # per head: position -> score
    longrange = [[] for _ in range(hkv)]
    for pos in range(qs.shape[0]):
        out_h = []
        for h in range(hkv):
            t_new = pos - window
            if t_new >= sinks and k > 0:
                lr = longrange[h]
                if len(lr) < k:
                    lr.append(t_new)
                else:
                    low = min(lr, key=lambda t: (score[h][t], t))
                    if (score[h][t_new], t_new) > (score[h][low], low):
                        lr[lr.index(low)] = t_new
            visible = sorted(set(range(min(sinks, pos + 1))) | set(range(max(0, pos - window + 1), pos + 1))
                             | set(longrange[h]))
            kk = ks[visible, h].double()
            vv = vs[visible, h].double()
            qq = qs[pos, h * G:(h + 1) * G].double()
            prob = torch.softmax(qq @ kk.T * scale, dim=-1)  # [G, n]
            out_h.append(prob @ vv)
            mean = prob.mean(0)
            for j, t in enumerate(visible):
                score[h][t] = float(mean[j]) if policy == "tova" else score[h].get(t, 0.0) + float(mean[j])
        outs.append(torch.cat(out_h, 0))
        kept_sets.append([set(lr) for lr in longrange])
    return torch.stack(outs), kept_sets


@pytest.mark.parametrize("policy", ["tova", "h2o"])
@pytest.mark.parametrize("sinks,window,budget", [(2, 3, 9), (1, 4, 5), (3, 2, 5)])
def test_attention_scored_policies_follow_their_rule(policy, sinks, window, budget):
    torch.manual_seed(1)
    S, hq, hkv, d = 40, 4, 2, 8
    qs, ks, vs = torch.randn(S, hq, d), torch.randn(S, hkv, d), torch.randn(S, hkv, d)
    scale = d ** -0.5
    cfg = _cfg(sinks, window, budget, policy)
    cache = KVpopCache(config=cfg, num_layers=1)
    module = SimpleNamespace(layer_idx=0)
    got, kept = [], []
    for pos in range(S):
        k1, v1 = ks[pos].view(1, hkv, 1, d), vs[pos].view(1, hkv, 1, d)
        cache.claim(0, "kvpop", cfg, True)
        cache.update(k1, v1, 0)
        out = cache_attention(cache, module, qs[pos].view(1, hq, 1, d), k1, v1, scaling=scale)
        got.append(out[0, 0])
        kept.append(cache.layers[0].long_range_positions())
    want, want_kept = _brute_force_scored(policy, qs, ks, vs, sinks, window, budget - sinks - window, scale)
    torch.testing.assert_close(torch.stack(got).double(), want, atol=1e-5, rtol=1e-5)
    assert kept == want_kept


@pytest.mark.parametrize("policy", ["kvpop", "streaming"])
def test_later_chunks_are_decoded_token_by_token(model, policy):
    STATE.cfg = cfg = _cfg(2, 4, 10, policy)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVpopCache(config=cfg, num_layers=2)
        parts = [model(ids[:, a:b], **kvpop.cache_kwargs(cache)).logits
                 for a, b in [(0, 7), (7, 19), (19, 20), (20, 40)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------- through kvpop.patch + generate
def _patched_tiny(**overrides):
    import kvpop

    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    m = Qwen3ForCausalLM(cfg).eval()
    dense = m.generate(torch.arange(3, 15).view(1, 12), max_new_tokens=30, do_sample=False)
    return kvpop.patch(m, **overrides), dense


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_patched_generate_uses_the_cache(scorer):
    import kvpop

    ids = torch.arange(3, 15).view(1, 12)
    m, dense = _patched_tiny(scorer=scorer, sinks=2, window=8, budget=64)
    # budget >= every length: exactly the unpatched model's greedy generation
    assert torch.equal(m.generate(ids, max_new_tokens=30, do_sample=False), dense)
    kvpop.patch(m, budget=14)
    plain = m.generate(ids, max_new_tokens=30, do_sample=False)  # a KVpopCache is made by default
    explicit = m.generate(ids, **kvpop.cache_kwargs(kvpop.KVpopCache(m)), max_new_tokens=30, do_sample=False)
    assert torch.equal(plain, explicit) and plain.shape == (1, 42)
    kvpop.unpatch(m)
    assert torch.equal(m.generate(ids, max_new_tokens=30, do_sample=False), dense)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_both_cache_keywords():
    import inspect

    import kvpop

    m, _ = _patched_tiny(sinks=2, window=8, budget=14)
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        ref = m(ids, **kvpop.cache_kwargs(kvpop.KVpopCache(m))).logits
        if "cache" in inspect.signature(type(m).forward).parameters:  # transformers >= 5.24
            torch.testing.assert_close(m(ids, cache=kvpop.KVpopCache(m)).logits, ref, atol=0, rtol=0)
        torch.testing.assert_close(m(ids).logits, ref, atol=1e-5, rtol=1e-5)  # prefill == full forward


def test_stale_pending_update_is_not_taken():
    """keys stashed by a forward that failed before its attention call never feed a later call"""
    cache = KVpopCache(config=_cfg(2, 4, 10, "streaming"), num_layers=1)
    module = SimpleNamespace(layer_idx=0)
    stale = torch.randn(1, 2, 3, 8)
    cache.claim(0, "kvpop", cache.kvpop_config, True)
    cache.update(stale, stale, 0)  # ... and the forward raised here
    fresh = torch.randn(1, 2, 3, 8)
    assert cache_attention(cache, module, torch.randn(1, 4, 3, 8), fresh, fresh, scaling=1.0) is None
    assert cache.get_seq_length() == 0
    cache.claim(0, "kvpop", cache.kvpop_config, True)
    cache.update(fresh, fresh, 0)
    out = cache_attention(cache, module, torch.randn(1, 4, 3, 8), fresh, fresh, scaling=1.0)
    assert out.shape == (1, 3, 4, 8) and cache.get_seq_length() == 3
