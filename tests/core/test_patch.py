"""kvpop.patch / unpatch on a tiny Qwen3, the training forward, gradients, and scorer checkpoints."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny import SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
from kvpop import KVpopConfig  # noqa: E402
from kvpop.models import adapter_for  # noqa: E402
from kvpop_kernels import NEVER, reference  # noqa: E402

S = 64


def _attention_modules(m):
    return adapter_for(m).attention_modules(m)


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, 128, (2, S), generator=g)


# Tests that run kvpop_kernels with the package's default dispatch (the Triton interpreter on a
# CPU-only box, the Triton kernels on a GPU box).  The others take the PyTorch CPU path: the op tests
# check the kernels themselves, these tests check the model layer, and the interpreter would make
# them take minutes.
DEFAULT_DISPATCH = ("test_training_forward_through_default_kernels",
                    "test_budget_at_least_S_gives_unpatched_logits[mlp]")


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch, request):
    """Route kvpop_kernels to the PyTorch CPU path unless the test is listed in DEFAULT_DISPATCH."""
    if not request.node.name.startswith(DEFAULT_DISPATCH):
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


# ----------------------------------------------------------------------------- patch / unpatch
def test_patch_unpatch_restores_exactly(ids):
    m = tiny_model()
    ref = logits(m, ids)
    keys = list(m.state_dict())
    orig_impl = m.config._attn_implementation
    assert kvpop.patch(m, **SMALL) is m
    assert kvpop.is_patched(m) and m.config._attn_implementation == "kvpop"
    sd = m.state_dict()
    assert any(".self_attn.kvpop.scorer." in k for k in sd) and any(k.endswith("kvpop.decay_logit") for k in sd)
    n_sc = sum(p.numel() for n, p in m.named_parameters() if ".kvpop." in n)
    assert n_sc > 0
    assert not torch.allclose(logits(m, ids), ref, atol=1e-3)  # S > budget: something is evicted
    kvpop.unpatch(m)
    assert not kvpop.is_patched(m)
    assert m.config._attn_implementation == orig_impl
    assert list(m.state_dict()) == keys
    assert all(len(a.k_norm._forward_hooks) == 0 for a in _attention_modules(m))
    assert torch.equal(logits(m, ids), ref)
    kvpop.unpatch(m)  # unpatching an unpatched model is a no-op
    assert torch.equal(logits(m, ids), ref)


def test_patch_is_idempotent_and_repatch_rules(ids):
    m = kvpop.patch(tiny_model(), **SMALL)
    params = {n: p for n, p in m.named_parameters() if ".kvpop." in n}
    out = logits(m, ids)
    kvpop.patch(m)
    kvpop.patch(m, KVpopConfig(**SMALL))
    kvpop.patch(m, **SMALL)
    assert {n: p for n, p in m.named_parameters() if ".kvpop." in n}.keys() == params.keys()
    assert all(p is params[n] for n, p in m.named_parameters() if ".kvpop." in n)
    for a in _attention_modules(m):
        assert len(a.k_norm._forward_hooks) == 1
    assert torch.equal(logits(m, ids), out)
    # a non-structural change keeps the scorers and takes effect
    kvpop.patch(m, budget=S)
    assert kvpop.get_config(m).budget == S
    assert all(layer.config.budget == S for layer in kvpop.kvpop_layers(m))
    assert all(p is params[n] for n, p in m.named_parameters() if ".kvpop." in n)
    # a structural change needs unpatch first
    with pytest.raises(ValueError, match="unpatch"):
        kvpop.patch(m, scorer="mlstm")
    with pytest.raises(ValueError, match="sinks \\+ window \\+ 1"):
        kvpop.patch(m, budget=5)
    assert kvpop.get_config(m).budget == S  # a failed re-patch changes nothing


def test_patch_rejects_other_models_and_bad_args():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(TypeError, match="'qwen3', 'qwen2', 'llama'.*'gpt2'"):
        kvpop.patch(gpt2)
    with pytest.raises(TypeError, match="qwen3.*Linear"):
        kvpop.patch(torch.nn.Linear(2, 2))
    m = tiny_model()
    with pytest.raises(ValueError, match="sinks \\+ window \\+ 1"):
        kvpop.patch(m, sinks=4, window=8, budget=12)
    with pytest.raises(ValueError, match="scorer must be one of"):
        kvpop.patch(m, scorer="gru")
    with pytest.raises(TypeError, match="unknown KVpopConfig field"):
        kvpop.patch(m, windw=8)
    with pytest.raises(TypeError, match="KVpopConfig"):
        kvpop.patch(m, {"budget": 24})
    assert not kvpop.is_patched(m)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_budget_at_least_S_gives_unpatched_logits(ids, scorer):
    m = tiny_model()
    ref = logits(m, ids)
    kvpop.patch(m, sinks=2, window=8, budget=S, scorer=scorer)
    torch.testing.assert_close(logits(m, ids), ref, atol=1e-5, rtol=1e-5)
    for layer in kvpop.kvpop_layers(m):
        assert (layer.last_evict_at == NEVER).all()
    m.train()  # a training forward: same output, no decisions, zero loss
    out = m(ids).logits
    torch.testing.assert_close(out.detach(), ref, atol=1e-5, rtol=1e-5)
    assert float(kvpop.score_loss(m)) == 0.0
    with kvpop.disabled(m):
        torch.testing.assert_close(logits(m, ids), ref, atol=0, rtol=0)


def test_streaming_mask_matches_eager_with_explicit_mask(ids):
    """The streaming mask (constant priority) is sinks + a window of w + k: check the whole model
    against the original eager attention given that mask explicitly."""
    m = tiny_model()
    cfg = KVpopConfig(**SMALL, mask_source="streaming")
    kvpop.patch(m, cfg)
    out = logits(m, ids)
    ev = kvpop.kvpop_layers(m)[0].last_evict_at
    vis = reference.visible_mask(ev, sinks=cfg.sinks, window=cfg.window)  # [B, Hkv, S, S]
    q = torch.arange(S).view(S, 1)
    t = torch.arange(S).view(1, S)
    expect = (t <= q) & ((t < cfg.sinks) | (t > q - (cfg.window + cfg.k)))
    assert torch.equal(vis, expect.expand_as(vis))
    kvpop.unpatch(m)
    m.config._attn_implementation = "eager"
    add = torch.zeros(2, 4, S, S).masked_fill(~expect, float("-inf"))
    torch.testing.assert_close(logits(m, ids, attention_mask=add), out, atol=1e-5, rtol=1e-5)


def test_scorer_mask_uses_scorer_priorities(ids):
    m = kvpop.patch(tiny_model(), **SMALL)
    logits(m, ids)
    for layer in kvpop.kvpop_layers(m):
        p = layer.last_priority
        assert p.shape == (2, 2, S)
        ev = reference.eviction_schedule(p, sinks=2, window=8, k=14)
        assert torch.equal(layer.last_evict_at.cpu(), ev)
        vis = reference.visible_mask(ev, sinks=2, window=8)
        assert int(vis.sum(-1).max()) <= 24  # at most B keys per query


@pytest.mark.filterwarnings("ignore::FutureWarning")  # past_key_values= is deprecated in 5.24, the only name in 5.17
def test_padding_and_decode_paths_are_refused(ids):
    m = kvpop.patch(tiny_model(), **SMALL)
    ones = torch.ones_like(ids)
    torch.testing.assert_close(logits(m, ids, attention_mask=ones), logits(m, ids))
    pad = ones.clone()
    pad[0, :3] = 0
    with pytest.raises(ValueError, match="padding"):
        logits(m, ids, attention_mask=pad)
    with torch.no_grad():
        out = m(ids[:, :10], use_cache=True)
        with pytest.raises(NotImplementedError, match="KVpopCache"):
            m(ids[:, 10:11], past_key_values=out.past_key_values)
    with pytest.raises(NotImplementedError, match="decoding"):
        kvpop.patch(m, policy="tova")
        logits(m, ids)


def test_decode_fn_hook_gets_pre_rope_keys(ids):
    """A cache's decode_fn receives every call with the pre-RoPE keys; sequence_attention reproduces the
    plain forward (what a prefill would reuse)."""
    from kvpop.core.attention import sequence_attention

    m = kvpop.patch(tiny_model(), **SMALL)
    ref = logits(m, ids)
    seen = []

    def decode_fn(module, query, key, value, attention_mask, *, scaling, k_pre, **kw):
        seen.append((module.layer_idx, tuple(k_pre.shape)))
        # the pre-RoPE key is k_norm(k_proj(x)); RoPE at position 0 is the identity
        assert torch.allclose(k_pre[:, :, 0], key[:, :, 0], atol=1e-6)
        out, lse = sequence_attention(module.kvpop, query, key, value, k_pre, scaling=scaling)
        return out.transpose(1, 2), None

    for layer in kvpop.kvpop_layers(m):
        layer.decode_fn = decode_fn
    torch.testing.assert_close(logits(m, ids), ref, atol=0, rtol=0)
    assert seen == [(0, (2, 2, S, 32)), (1, (2, 2, S, 32))]
    for layer in kvpop.kvpop_layers(m):
        layer.decode_fn = None


@pytest.mark.parametrize("mask_source,target_lse", [("scorer", "sparse"), ("scorer", "dense"), ("teacher", "sparse"),
                                                    ("streaming", "dense")])
def test_training_forward_follows_the_definitions(ids, mask_source, target_lse):
    """Each layer's mask priorities and L_score terms against the references, from the layer's own q, k, v."""
    from kvpop.core.attention import sequence_attention

    m = kvpop.patch(tiny_model(), mask_source=mask_source, target_lse=target_lse, **SMALL).train()
    cfg = kvpop.get_config(m)
    checked = []

    def decode_fn(module, query, key, value, attention_mask, *, scaling, k_pre, **kw):
        layer = module.kvpop
        out, lse = sequence_attention(layer, query, key, value, k_pre, scaling=scaling, training=True)
        with torch.no_grad():
            t = torch.arange(S, dtype=torch.float32)
            lg = layer.log_gamma()
            r_hat = layer.scorer(k_pre, value)
            _, lse_dense = reference.dense_causal_attention(query, key, value, scale=scaling)
            r_dense = reference.future_attention_target(query, key, lse_dense, window=8, eps=cfg.eps, scale=scaling)
            if mask_source == "scorer":
                prio = r_hat - t * lg[:, None]
            elif mask_source == "teacher":
                prio = r_dense - t * lg[:, None]
            else:
                prio = torch.zeros_like(r_hat)
            torch.testing.assert_close(layer.last_priority, prio, atol=1e-5, rtol=1e-5)
            ev = reference.eviction_schedule(prio, sinks=2, window=8, k=14)
            assert torch.equal(layer.last_evict_at, ev)
            o_ref, lse_ref = reference.sparse_attention(query, key, value, ev, sinks=2, window=8, scale=scaling)
            torch.testing.assert_close(out, o_ref, atol=1e-5, rtol=1e-5)
            if mask_source == "teacher" or target_lse == "dense":
                r_tgt = r_dense
            else:
                r_tgt = reference.future_attention_target(query, key, lse_ref, window=8, eps=cfg.eps, scale=scaling)
            exp = kvpop.score_loss_terms(r_hat, r_tgt, lg, sinks=2, window=8, k=14, tau=cfg.tau,
                                         tie_margin=cfg.tie_margin, balance=cfg.balance)
            got = layer.loss_terms
            assert int(got["n"]) == int(exp["n"]) > 0 and int(got["n_keep"]) == int(exp["n_keep"])
            torch.testing.assert_close(got["loss_sum"].detach(), exp["loss_sum"], atol=1e-5, rtol=1e-5)
        checked.append(module.layer_idx)
        return out.transpose(1, 2), None

    for layer in kvpop.kvpop_layers(m):
        layer.decode_fn = decode_fn
    m(ids)
    assert checked == [0, 1]


def test_deepcopy_and_make_teacher(ids):
    m = kvpop.patch(tiny_model(), **SMALL)
    ref_dense = None
    with kvpop.disabled(m):
        ref_dense = logits(m, ids)
    c = copy.deepcopy(m)
    torch.testing.assert_close(logits(c, ids), logits(m, ids), atol=0, rtol=0)
    teacher = kvpop.make_teacher(m)
    assert kvpop.is_patched(m) and not kvpop.is_patched(teacher)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert not any(".kvpop." in n for n in teacher.state_dict())
    assert all(len(mod.k_norm._forward_hooks) == 0 for mod in teacher.modules() if hasattr(mod, "k_norm"))
    assert all(len(mod.k_norm._forward_hooks) == 1 for mod in c.modules() if hasattr(mod, "k_norm"))
    wrapper = torch.nn.Sequential(c)  # a wrapper (as DDP) still reports the patch
    assert kvpop.is_patched(wrapper) and kvpop.get_config(wrapper) == kvpop.get_config(m)
    torch.testing.assert_close(logits(teacher, ids), ref_dense, atol=0, rtol=0)
    with torch.no_grad():  # changing the student leaves the teacher alone
        m.lm_head.weight.add_(1.0)
    torch.testing.assert_close(logits(teacher, ids), ref_dense, atol=0, rtol=0)


# ----------------------------------------------------------------------------- training forward
def _train_forward(m, ids, teacher_logits):
    out = m(ids)
    kl = kvpop.distill_loss(out.logits, teacher_logits)
    ls = kvpop.score_loss(m)
    return kl, ls


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_gradient_separation(ids, scorer):
    m = kvpop.patch(tiny_model(), scorer=scorer, **SMALL).train()
    teacher = logits(kvpop.make_teacher(m), ids)
    with torch.no_grad():  # perturb the student so that the KL has a gradient
        for n, p in m.named_parameters():
            if ".kvpop." not in n:
                p.add_(0.02 * torch.randn_like(p))
    kl, ls = _train_forward(m, ids, teacher)
    assert ls.requires_grad and float(ls.detach()) > 0
    sc = [p for n, p in m.named_parameters() if ".kvpop." in n]
    model_p = [p for n, p in m.named_parameters() if ".kvpop." not in n]
    g_kl = torch.autograd.grad(kl, sc + model_p, allow_unused=True, retain_graph=True)
    assert all(g is None or float(g.abs().sum()) == 0 for g in g_kl[: len(sc)])  # scorer: nothing from KL
    assert sum(float(g.abs().sum()) for g in g_kl[len(sc):] if g is not None) > 0
    g_ls = torch.autograd.grad(ls, sc + model_p, allow_unused=True)
    assert all(g is None or float(g.abs().sum()) == 0 for g in g_ls[len(sc):])  # model: nothing from L_score
    assert all(g is not None for g in g_ls[: len(sc)])
    decay_grads = [g for (n, _), g in zip([(n, p) for n, p in m.named_parameters() if ".kvpop." in n], g_ls)
                   if n.endswith("decay_logit")]
    assert decay_grads and all(float(g.abs().sum()) > 0 for g in decay_grads)


def test_gamma_stays_in_range_under_huge_steps(ids):
    m = kvpop.patch(tiny_model(), **SMALL).train()
    decay = [p for n, p in m.named_parameters() if n.endswith("decay_logit")]
    opt = torch.optim.SGD(decay, lr=1e7)
    for _ in range(3):
        m(ids)
        ls = kvpop.score_loss(m)
        opt.zero_grad()
        ls.backward()
        opt.step()
        for layer in kvpop.kvpop_layers(m):
            g, lg = layer.gamma(), layer.log_gamma()
            assert (g >= 0.999).all() and (g <= 0.999999).all()
            assert torch.isfinite(lg).all() and (lg < 0).all()
    # the log is accurate near gamma_max (1 - gamma ~ 1e-6 keeps its digits)
    layer = kvpop.kvpop_layers(m)[0]
    with torch.no_grad():
        layer.decay_logit.fill_(40.0)
    torch.testing.assert_close(layer.log_gamma(), torch.full((2,), -1.0000005e-6), rtol=1e-5, atol=0)


@pytest.mark.parametrize("mask_source,target_lse", [("scorer", "sparse"), ("scorer", "dense"),
                                                    ("teacher", "sparse"), ("streaming", "sparse")])
def test_training_lowers_score_loss(ids, mask_source, target_lse):
    m = kvpop.patch(tiny_model(), mask_source=mask_source, target_lse=target_lse, **SMALL).train()
    m.requires_grad_(False)
    sc = [p for n, p in m.named_parameters() if ".kvpop." in n]
    for p in sc:
        p.requires_grad_(True)
    opt = torch.optim.Adam(sc, lr=3e-2)
    losses = []
    for _ in range(25):
        m(ids)
        ls = kvpop.score_loss(m)
        opt.zero_grad()
        ls.backward()
        opt.step()
        losses.append(float(ls.detach()))
    assert losses[-1] < 0.7 * losses[0], losses


def test_mlstm_training_lowers_score_loss(ids):
    m = kvpop.patch(tiny_model(), scorer="mlstm", mlstm_dim=16, scorer_hidden=32, **SMALL).train()
    sc = [p for n, p in m.named_parameters() if ".kvpop." in n]
    opt = torch.optim.Adam(sc, lr=1e-2)
    losses = []
    for i in range(20):
        m(ids)
        ls = kvpop.score_loss(m)
        opt.zero_grad()
        ls.backward()
        opt.step()
        losses.append(float(ls.detach()))
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses


def test_training_lowers_kl_of_perturbed_student(ids):
    m = tiny_model()
    teacher_model = kvpop.make_teacher(m)
    teacher = logits(teacher_model, ids)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    kvpop.patch(m, **SMALL).train()
    model_p = [p for n, p in m.named_parameters() if ".kvpop." not in n]
    sc = [p for n, p in m.named_parameters() if ".kvpop." in n]
    opt = torch.optim.AdamW([{"params": model_p, "lr": 3e-3}, {"params": sc, "lr": 1e-2}])
    kls, lss = [], []
    for _ in range(15):
        kl, ls = _train_forward(m, ids, teacher)
        opt.zero_grad()
        (kl + ls).backward()
        opt.step()
        kls.append(float(kl.detach()))
        lss.append(float(ls.detach()))
    assert kls[-1] < 0.8 * kls[0], kls
    assert lss[-1] < lss[0], lss


def test_training_forward_through_default_kernels(ids):
    """One training step with the package's default dispatch (the Triton interpreter on a CPU-only box)."""
    m = kvpop.patch(tiny_model(), **SMALL).train()
    out = m(ids)
    stats = kvpop.score_stats(m)
    ls = kvpop.score_loss(m)
    assert stats["decisions"] == 2 * 2 * 2 * (S - 2 - 8 - 14)  # layers * batch * heads * decisions
    assert 0 < stats["keep_frac"] < 1
    (ls + out.logits.float().pow(2).mean()).backward()
    assert all(p.grad is not None for n, p in m.named_parameters() if n.endswith("decay_logit"))


def test_nonreentrant_checkpointing_gives_the_same_loss_and_grads(ids):
    res = []
    for ckpt in (False, True):
        m = kvpop.patch(tiny_model(), **SMALL).train()
        if ckpt:
            if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.2x
                m.activation_checkpointing_enable({"use_reentrant": False})
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out = m(ids, use_cache=False)
        ls = kvpop.score_loss(m)
        (ls + out.logits.float().pow(2).mean()).backward()
        res.append((float(ls.detach()), [p.grad.clone() for p in m.parameters()]))
    assert res[0][0] == res[1][0] > 0
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_eval_forward_does_no_loss_work(ids):
    m = kvpop.patch(tiny_model(), **SMALL).eval()
    with torch.no_grad():
        m(ids)
    assert all(layer.loss_terms is None for layer in kvpop.kvpop_layers(m))
    m.train()
    with torch.no_grad():
        m(ids)
    assert all(layer.loss_terms is None for layer in kvpop.kvpop_layers(m))
    assert float(kvpop.score_loss(m)) == 0.0


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_save_load_roundtrip(tmp_path, ids, scorer):
    a = kvpop.patch(tiny_model(), scorer=scorer, **SMALL)
    with torch.no_grad():
        for n, p in a.named_parameters():
            if ".kvpop." in n:
                p.add_(torch.randn_like(p))
    path = tmp_path / "scorers.safetensors"
    kvpop.save_scorers(a, path)
    assert kvpop.read_scorer_config(path) == kvpop.get_config(a)
    b = tiny_model()  # same base weights, not patched: load patches it with the saved config
    kvpop.load_scorers(b, path)
    assert kvpop.get_config(b) == kvpop.get_config(a)
    sa = {n: p for n, p in a.state_dict().items() if ".kvpop." in n}
    sb = {n: p for n, p in b.state_dict().items() if ".kvpop." in n}
    assert sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)
    torch.testing.assert_close(logits(b, ids), logits(a, ids), atol=0, rtol=0)
    # a patched model with another budget loads too (non-structural), keeping its budget
    c = kvpop.patch(tiny_model(), scorer=scorer, sinks=2, window=8, budget=30)
    kvpop.load_scorers(c, path)
    assert kvpop.get_config(c).budget == 30


def test_load_mismatches_raise(tmp_path):
    a = kvpop.patch(tiny_model(), **SMALL)
    path = tmp_path / "s.safetensors"
    kvpop.save_scorers(a, path)
    with pytest.raises(ValueError, match="scorer"):
        kvpop.load_scorers(kvpop.patch(tiny_model(), scorer="mlstm", **SMALL), path)
    with pytest.raises(ValueError, match="scorer_hidden"):
        kvpop.load_scorers(kvpop.patch(tiny_model(), scorer_hidden=16, **SMALL), path)
    with pytest.raises(ValueError, match="shape"):  # other number of KV heads
        kvpop.load_scorers(tiny_model(num_key_value_heads=4), path)
    with pytest.raises(ValueError, match="missing|unexpected"):  # other number of layers
        kvpop.load_scorers(tiny_model(num_hidden_layers=3), path)
    from safetensors.torch import save_file
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not a kvpop scorer file"):
        kvpop.load_scorers(tiny_model(), other)


# ----------------------------------------------------------------------------- with the decoding cache
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
@pytest.mark.parametrize("prompt_len", [20, 5])
def test_cache_prefill_and_decode_match_the_full_forward(scorer, prompt_len):
    """Prefill + fixed-budget decoding through kvpop.KVpopCache with the learned scorer gives the
    logits of one full-sequence forward (the scorer's pre-RoPE inputs and, for the mLSTM, its
    recurrent state and key ring carried through the cache)."""
    torch.manual_seed(5)
    m = kvpop.patch(tiny_model(), scorer=scorer, **SMALL)
    with torch.no_grad():  # make the scores matter
        for n, p in m.named_parameters():
            if ".kvpop." in n and not n.endswith("decay_logit"):
                p.copy_(torch.randn_like(p))
    ids = torch.randint(0, 128, (1, 48))
    full = logits(m, ids)
    cache = kvpop.KVpopCache(m)
    outs = []
    with torch.no_grad():
        outs.append(m(ids[:, :prompt_len], **kvpop.cache_kwargs(cache), use_cache=True).logits)
        for t in range(prompt_len, 48):
            outs.append(m(ids[:, t:t + 1], **kvpop.cache_kwargs(cache), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=2e-4, rtol=2e-4)
