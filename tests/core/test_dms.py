"""DMS, the learned baseline: gate relaxation, delayed-eviction mask, ragged cache, patching, training."""
import copy
import math

import pytest
import torch
from tiny import tiny_model

from kvpop.baselines import dms as D
from kvpop.baselines.dms import cache as C
from kvpop.models import cache_kwarg_name
from kvpop_kernels import NEVER, reference


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    """The PyTorch CPU path of sparse_attention (the kernels are tested against it elsewhere)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# ------------------------------------------------------------------------------ relaxation
def test_gumbel_sigmoid_without_noise_is_a_tempered_sigmoid_with_straight_through_gradient():
    logits = torch.tensor([-3.0, -0.2, 0.1, 2.5], requires_grad=True)
    soft, alpha, hard = D.gumbel_sigmoid(logits, 0.5, noise=torch.zeros(4))
    torch.testing.assert_close(soft, logits.detach() / 0.5)
    torch.testing.assert_close(alpha, torch.sigmoid(logits.detach() / 0.5))
    assert hard.tolist() == [0.0, 0.0, 1.0, 1.0]
    (hard * torch.arange(1.0, 5.0)).sum().backward()
    a = torch.sigmoid(logits.detach() / 0.5)
    torch.testing.assert_close(logits.grad, torch.arange(1.0, 5.0) * a * (1 - a) / 0.5)


@pytest.mark.parametrize("tau", [0.1, 1.0])
def test_hard_decision_is_a_bernoulli_sample_of_sigmoid_logit(tau):
    # with logistic noise, P(logit + n > 0) = sigmoid(logit) whatever the temperature
    torch.manual_seed(0)
    logits = torch.tensor([-2.0, 0.0, 1.0]).repeat(40000, 1)
    _, _, hard = D.gumbel_sigmoid(logits, tau)
    freq = hard.mean(0)
    torch.testing.assert_close(freq, torch.sigmoid(torch.tensor([-2.0, 0.0, 1.0])), atol=0.01, rtol=0)
    n = D.logistic_noise((200000,))
    assert abs(float(n.mean())) < 0.03 and abs(float(n.var()) - math.pi ** 2 / 3) < 0.1


def test_dms_target_schedule_is_linear_in_the_compression_ratio():
    cfg = D.DMSConfig(target_keep=0.25, schedule_steps=10)
    assert D.dms_target(cfg, 0) == 0.0
    assert D.dms_target(cfg, 5) == pytest.approx(1 - 1 / 2.5)
    assert D.dms_target(cfg, 10) == pytest.approx(0.75) == D.dms_target(cfg, 99)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="target_keep"):
        D.DMSConfig(target_keep=0.0)
    with pytest.raises(ValueError, match="tau"):
        D.DMSConfig(tau=0)
    with pytest.raises(TypeError, match="window"):
        D.DMSConfig(window=2.5)
    with pytest.raises(TypeError, match="unknown"):
        D.DMSConfig().replace(budget=3)


# ------------------------------------------------------------------------------ delayed mask
def _brute_dms(q, k, v, log_keep, sinks, window, scale):
    """Query by query, key by key: the relaxed delayed-eviction logits, then softmax."""
    B, Hq, S, Dh = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, S, Dh, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            for u in range(S):
                row = []
                for t in range(u + 1):
                    x = scale * float(q[b, hq, u].double() @ k[b, h, t].double())
                    if t >= sinks and t <= u - window:
                        x += float(log_keep[b, h, t])
                    row.append(x)
                p = torch.softmax(torch.tensor(row, dtype=torch.float64), 0)
                out[b, hq, u] = p @ v[b, h, :u + 1].double()
    return out


@pytest.mark.parametrize("S,sinks,window,G", [(17, 2, 4, 2), (23, 0, 1, 1), (9, 3, 12, 4)])
def test_relaxed_mask_matches_brute_force(S, sinks, window, G):
    Hkv, Dh = 2, 8
    q = torch.randn(1, Hkv * G, S, Dh)
    k, v = torch.randn(1, Hkv, S, Dh), torch.randn(1, Hkv, S, Dh)
    log_keep = torch.nn.functional.logsigmoid(-3 * torch.randn(1, Hkv, S))
    out = D.dms_attention(q, k, v, log_keep, sinks=sinks, window=window, scale=0.3, chunk=5)
    torch.testing.assert_close(out.double(), _brute_dms(q, k, v, log_keep, sinks, window, 0.3), atol=1e-5, rtol=1e-5)


def test_relaxed_mask_gradient_reaches_the_gates_only_out_of_the_window():
    S, w, s = 20, 5, 2
    q, k, v = torch.randn(1, 2, S, 8), torch.randn(1, 1, S, 8), torch.randn(1, 1, S, 8)
    log_keep = torch.full((1, 1, S), -0.5, requires_grad=True)
    D.dms_attention(q, k, v, log_keep, sinks=s, window=w).square().sum().backward()
    g = log_keep.grad[0, 0]
    assert torch.all(g[:s] == 0), "sinks are never gated"
    assert torch.all(g[S - w:] == 0), "the last w tokens are in every query's window"
    assert torch.all(g[s:S - w] != 0)


@pytest.mark.parametrize("S,sinks,window", [(31, 4, 6), (40, 0, 1), (12, 2, 16)])
def test_hard_gates_give_the_sparse_kernels_mask(S, sinks, window):
    """A token evicted at t is visible to queries t .. t+w-1 (w more queries counting its own) and never
    after; a kept token to every later query; the relaxed mask with -inf equals the kernel."""
    Hkv, G, Dh = 2, 2, 16
    evict = torch.rand(1, Hkv, S) < 0.5
    ev = D.gate_evict_at(evict, sinks=sinks, window=window)
    vis = reference.visible_mask(ev, sinks=sinks, window=window)[0]  # [Hkv, q, t]
    for h in range(Hkv):
        for t in range(S):
            seen = [u for u in range(S) if vis[h, u, t]]
            if t >= sinks and evict[0, h, t]:
                assert seen == list(range(t, min(S, t + window)))
                assert int(ev[0, h, t]) == t + window
            else:
                assert seen == list(range(t, S))
                assert int(ev[0, h, t]) == NEVER
    q = torch.randn(1, Hkv * G, S, Dh)
    k, v = torch.randn(1, Hkv, S, Dh), torch.randn(1, Hkv, S, Dh)
    log_keep = torch.where(evict, torch.tensor(float("-inf")), torch.tensor(0.0))
    ref, _ = reference.sparse_attention(q, k, v, ev, sinks=sinks, window=window)
    torch.testing.assert_close(D.dms_attention(q, k, v, log_keep, sinks=sinks, window=window), ref,
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ model level
def _gated(model, seed=0, **cfg):
    """Patch with DMS and give the gates random weights, so that some tokens are evicted."""
    D.patch_dms(model, D.DMSConfig(**{"sinks": 2, "window": 6, **cfg}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for la in D.dms_layers(model):
            la.gate.weight.copy_(torch.randn(la.gate.weight.shape, generator=g) * 2.0)
            la.gate.bias.fill_(0.0)
    return model


def test_fresh_gates_keep_everything_and_unpatch_restores_the_model():
    model = tiny_model()
    ids = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        ref = model(ids).logits
        keys = set(model.state_dict())
        D.patch_dms(model, sinks=2, window=4)
        assert D.is_dms_patched(model)
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-5, rtol=1e-5)
        assert all(float(la.last_evict.sum()) == 0 for la in D.dms_layers(model))
        D.unpatch_dms(model)
        assert not D.is_dms_patched(model) and set(model.state_dict()) == keys
        torch.testing.assert_close(model(ids).logits, ref)


def test_kvpop_and_dms_exclude_each_other():
    import kvpop

    model = kvpop.patch(tiny_model(), sinks=2, window=4, budget=12)
    with pytest.raises(ValueError, match="KVpop"):
        D.patch_dms(model)


@pytest.mark.parametrize("prompt_len", [1, 5, 23])
def test_ragged_cache_prefill_and_decoding_equal_the_teacher_forced_forward(prompt_len):
    model = _gated(tiny_model())
    ids = torch.randint(0, 128, (1, 48))
    with torch.no_grad():
        ref = model(ids).logits  # teacher-forced, hard gates (sparse_attention with gate_evict_at)
        evicted = sum(float(la.last_evict.sum()) for la in D.dms_layers(model))
        assert evicted > 10
        cache = D.DMSCache(model)
        kw = {"use_cache": True, cache_kwarg_name(): cache}
        outs = [model(ids[:, :prompt_len], **kw).logits]
        for i in range(prompt_len, ids.shape[1]):
            outs.append(model(ids[:, i:i + 1], **kw).logits)
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-4, rtol=1e-4)
    # each head holds sinks + window + the long-range tokens its gates kept
    S, s, w = ids.shape[1], 2, 6
    ent = cache.head_entries()
    for li, la in enumerate(D.dms_layers(model)):
        ev = la.last_logits[0] > 0
        kept = [(~ev[h, s:S - w]).sum().item() for h in range(ev.shape[0])]
        assert ent[li].tolist() == [s + w + n for n in kept]
        want = [[t for t in range(s, S - w) if not ev[h, t]] for h in range(ev.shape[0])]
        assert cache.layers[li].long_positions() == want


@pytest.mark.parametrize("page,lookahead", [(16, 4), (4, 1), (1, 2)])
def test_ragged_cache_memory_is_what_the_heads_keep(page, lookahead):
    model = _gated(tiny_model(), seed=3)
    ids = torch.randint(0, 128, (1, 120))
    with torch.no_grad():
        cache = D.DMSCache(model, page=page, lookahead=lookahead)
        model(ids, **{cache_kwarg_name(): cache})
        for i in range(60):
            model(torch.randint(0, 128, (1, 1)), **{cache_kwarg_name(): cache})
    ent = cache.head_entries()
    assert ent.unique().numel() > 1, "the heads keep different numbers of tokens"
    per_token = 2 * 32 * 4  # key + value, head_dim 32, float32
    assert cache.kept_bytes() == int(ent.sum()) * per_token
    for la, e in zip(cache.layers, ent.tolist()):
        H, fixed = len(e), min(la.seen, la.sinks + la.window)
        kept = [n - fixed for n in e]
        # pages in use: one per started page of each head, plus the scratch page
        used = 1 + sum(-(-n // page) for n in kept)
        assert int(la.next_free) == used
        # the pool: at most `growth` x (pages in use + lookahead pages per head), + 1 for rounding up
        assert used <= la.pool_k.shape[0] <= la.growth * (used + H * lookahead) + 1
        # the table: one column per page of the longest head, grown by `growth`, + the write-off column
        assert la.table.shape[1] - 1 <= la.growth * -(-(max(kept) + lookahead * page) // page) + 1
        # each head's pages are its own: no page is listed by two heads
        owned = torch.cat([la.table[h, :-(-n // page)] for h, n in enumerate(kept)])
        assert owned.unique().numel() == owned.numel() and int(owned.min()) >= 1


def test_ragged_cache_decodes_through_the_triton_kernel(monkeypatch):
    """The same equality with the decode steps on the Triton path (``ragged_paged_decode`` through the
    interpreter: each head attends over its own pages)."""
    import kvpop_kernels.paged_decode as pd

    if torch.cuda.is_available():
        pytest.skip("the kernels are built for the GPU here, not the interpreter (tests/kernels cover them)")
    model = _gated(tiny_model())
    ids = torch.randint(0, 128, (1, 40))
    calls = []
    orig = pd._triton_paged
    monkeypatch.setattr(pd, "_triton_paged", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    with torch.no_grad():
        ref = model(ids).logits
        cache = D.DMSCache(model, page=4)
        kw = {"use_cache": True, cache_kwarg_name(): cache}
        outs = [model(ids[:, :9], **kw).logits]
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        for i in range(9, ids.shape[1]):
            outs.append(model(ids[:, i:i + 1], **kw).logits)
    assert len(calls) == 2 * (ids.shape[1] - 9)  # every layer's every step
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-4, rtol=1e-4)


def test_ragged_cache_memory_follows_the_heads_not_the_longest():
    """One head keeps every token, the other none: the cache holds about one head's worth (and the spare pool), where a
    cache padded to the longest head would hold two."""
    model = _gated(tiny_model(), seed=3)
    with torch.no_grad():
        for la in D.dms_layers(model):
            la.gate.weight.zero_()
            la.gate.bias.copy_(torch.tensor([-10.0, 10.0]))  # head 0 keeps all, head 1 evicts all
        ids = torch.randint(0, 128, (1, 600))
        cache = D.DMSCache(model)
        model(ids[:, :500], **{cache_kwarg_name(): cache})
        for i in range(500, 600):
            model(ids[:, i:i + 1], **{cache_kwarg_name(): cache})
    assert cache.head_entries().tolist() == [[600, 8], [600, 8]]
    per_token = 2 * 32 * 4
    padded = 2 * 2 * 600 * per_token
    assert cache.nbytes() < 0.75 * padded, (cache.nbytes(), padded)  # 0.69: pages + the spare pool


def test_decode_step_reads_nothing_back_between_capacity_checks(monkeypatch):
    """A decode step syncs with the host only when its capacity bounds could pass: with 16-token pages
    and room reserved for 4 pages per head, at most one read-back every 64 steps of a layer."""
    model = _gated(tiny_model(), seed=3)
    ids = torch.randint(0, 128, (1, 40))
    reads = []
    orig = D.DMSCacheLayer._read_back
    monkeypatch.setattr(D.DMSCacheLayer, "_read_back", lambda self: (reads.append(self.seen), orig(self))[1])
    with torch.no_grad():
        cache = D.DMSCache(model, page=16, lookahead=4)
        model(ids, **{cache_kwarg_name(): cache})
        n_prefill = len(reads)
        for i in range(200):
            model(torch.randint(0, 128, (1, 1)), **{cache_kwarg_name(): cache})
    decode_reads = len(reads) - n_prefill
    assert 0 < decode_reads <= 2 * -(-200 // 64), reads


def test_decode_step_never_reads_the_device_outside_its_capacity_check(monkeypatch):
    """Between capacity checks a decode step (append + attention of all heads) reads no tensor value
    back: every host read of a tensor raises here unless it comes from ``_read_back``."""
    model = _gated(tiny_model(), seed=3)
    with torch.no_grad():
        cache = D.DMSCache(model, page=4, lookahead=2)
        model(torch.randint(0, 128, (1, 30)), **{cache_kwarg_name(): cache})
    layer = cache.layers[0]
    ref = copy.deepcopy(layer)
    inside = []
    orig_read = D.DMSCacheLayer._read_back

    def read_back(self):
        inside.append(True)
        try:
            return orig_read(self)
        finally:
            inside.pop()

    def forbid(name):
        orig = getattr(torch.Tensor, name)

        def f(self, *a, **k):
            if not inside:
                raise AssertionError(f"host read Tensor.{name} in a decode step")
            return orig(self, *a, **k)
        return f

    g = torch.Generator().manual_seed(0)
    steps = [(torch.randn(4, 32, generator=g), torch.randn(2, 32, generator=g), torch.randn(2, 32, generator=g),
              torch.rand(2, generator=g) < 0.5) for _ in range(40)]
    with monkeypatch.context() as mp:
        mp.setattr(D.DMSCacheLayer, "_read_back", read_back)
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            mp.setattr(torch.Tensor, name, forbid(name))
        outs = [C._decode(layer, q, k, v, ev, 0.2) for q, k, v, ev in steps]
    # the same steps with host reads allowed give the same outputs and the same store
    for (q, k, v, ev), out in zip(steps, outs):
        torch.testing.assert_close(out, C._decode(ref, q, k, v, ev, 0.2))
    assert layer.long_positions() == ref.long_positions()


def test_dms_cache_rejects_bad_page_settings():
    with pytest.raises(ValueError, match=r"DMSCache needs a DMS-patched model"):
        D.DMSCache()
    with pytest.raises(ValueError, match=r"DMSCache\(config=...\) also needs num_layers="):
        D.DMSCache(config=D.DMSConfig())
    assert len(D.DMSCache(config=D.DMSConfig(), num_layers=3).layers) == 3
    model = _gated(tiny_model())
    with pytest.raises(ValueError, match="page must be >= 1"):
        D.DMSCache(model, page=0)
    with pytest.raises(TypeError, match="lookahead must be an int"):
        D.DMSCache(model, lookahead=1.5)


def test_dms_rejects_padding():
    model = _gated(tiny_model())
    ids = torch.randint(0, 128, (1, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="no padding"):
        model(ids, attention_mask=mask)
    with torch.no_grad(), pytest.raises(ValueError, match="no padding"):
        model(ids, attention_mask=mask, **{cache_kwarg_name(): D.DMSCache(model)})


def test_generate_decodes_through_a_dms_cache():
    model = _gated(tiny_model())
    ids = torch.randint(0, 128, (1, 30))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
        # greedy decoding equals greedy argmax of the teacher-forced forward of the generated sequence
        ref = model(out).logits[0, 29:-1].argmax(-1)
    assert out.shape == (1, 42)
    assert torch.equal(out[0, 30:], ref)


def test_dms_loss_and_save_load_roundtrip(tmp_path):
    model = _gated(tiny_model(), target_keep=0.5, schedule_steps=4)
    model.train()
    ids = torch.randint(0, 128, (2, 32))
    D.set_dms_step(model, 4)
    model(ids)
    aux, st = D.dms_loss(model)
    assert st["target_keep"] == pytest.approx(0.5)
    assert aux.requires_grad and 0 <= float(aux.detach()) <= 0.5
    aux.backward()
    assert any(la.gate.weight.grad is not None for la in D.dms_layers(model))
    path = tmp_path / "gates.safetensors"
    D.save_dms(model, path)
    other = D.load_dms(tiny_model(), path, threshold=0.5)
    assert D.get_dms_config(other).threshold == 0.5 and D.read_dms_config(path).threshold == 0.0
    for a, b in zip(D.dms_layers(model), D.dms_layers(other)):
        torch.testing.assert_close(a.gate.weight, b.gate.weight)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_other_families_decode_like_the_teacher_forced_forward(family):
    model = _gated(tiny_model(family=family))
    ids = torch.randint(0, 128, (1, 30))
    with torch.no_grad():
        ref = model(ids).logits
        assert sum(float(la.last_evict.sum()) for la in D.dms_layers(model)) > 0
        cache = D.DMSCache(model)
        kw = {"use_cache": True, cache_kwarg_name(): cache}
        outs = [model(ids[:, :9], **kw).logits] + [model(ids[:, i:i + 1], **kw).logits for i in range(9, 30)]
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-4, rtol=1e-4)
