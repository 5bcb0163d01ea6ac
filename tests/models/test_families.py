"""The model-family seam: the same model-level tests on tiny random Qwen3, Qwen2 and Llama models.

Each family: budget >= S equals the unpatched model (logits and greedy tokens); a training forward
and backward reaches the scorers; fixed-budget generation (prefill + decode == one teacher-forced
sparse forward with the same scorer, memory flat); save/load of scorers; copies and pickles of a
patched model; the context-manager form.
"""
import copy
import io
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tiny import FAMILIES, SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
from kvpop.models import SUPPORTED_MODEL_TYPES  # noqa: E402

S = 48


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    """Model-level tests take the PyTorch CPU path (the kernels have their own interpreter tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _ids(n=S, batch=1, seed=7):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _logits(m, ids, **kw):
    with torch.no_grad():
        return m(ids, **kw).logits


def test_supported_families_are_the_tested_ones():
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILIES)


class _Captured(Exception):
    pass


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_taps_the_pre_rope_key(family):
    """The key the scorers read is the key before RoPE: ``[B, Hkv, S, D]``, position-free (in layer 0 the
    same token at two positions has the same key) while the rotated key the attention gets is not."""
    m = tiny_model(family=family)
    kvpop.patch(m, **SMALL)
    layer = kvpop.kvpop_layers(m)[0]
    got = {}

    def grab(module, query, key, value, attention_mask, *, k_pre, **kw):
        got["k_pre"], got["key"] = k_pre, key
        raise _Captured

    layer.decode_fn = grab
    with pytest.raises(_Captured):
        _logits(m, torch.tensor([[5, 9, 5, 11]]))
    layer.decode_fn = None
    k_pre, key = got["k_pre"], got["key"]
    assert k_pre.shape == key.shape == (1, layer.num_kv_heads, 4, layer.head_dim)
    torch.testing.assert_close(k_pre[:, :, 0], k_pre[:, :, 2])
    assert not torch.allclose(key[:, :, 0], key[:, :, 2], atol=1e-4)
    torch.testing.assert_close(key[:, :, 0], k_pre[:, :, 0])  # position 0: RoPE is the identity


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_budget_at_least_S_equals_the_unpatched_model(family, scorer):
    m = tiny_model(family=family)
    ids = _ids()
    ref = _logits(m, ids)
    dense_gen = m.generate(ids[:, :10], max_new_tokens=20, do_sample=False)
    kvpop.patch(m, sinks=2, window=8, budget=S + 20, scorer=scorer)
    torch.testing.assert_close(_logits(m, ids), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(m.generate(ids[:, :10], max_new_tokens=20, do_sample=False), dense_gen)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_backward(family):
    m = tiny_model(family=family)
    kvpop.patch(m, **SMALL)
    teacher = kvpop.make_teacher(m)
    m.train()
    ids = _ids(64, batch=2)
    out = m(ids)
    kl = kvpop.distill_loss(out.logits, teacher(ids).logits)
    ls = kvpop.score_loss(m)
    assert ls.requires_grad and torch.isfinite(ls) and float(ls) > 0
    (kl + ls).backward()
    layers = kvpop.kvpop_layers(m)
    assert len(layers) == m.config.num_hidden_layers
    for layer in layers:
        grads = [p.grad for p in layer.scorer.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)
        assert layer.decay_logit.grad is not None
    # the model itself learns from the KL only (scorer inputs are detached)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in m.named_parameters() if ".kvpop." not in n)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fixed_budget_generation(family, scorer):
    """Prefill + decoding through KVpopCache == one teacher-forced sparse forward; memory stays flat."""
    m = tiny_model(family=family)
    kvpop.patch(m, sinks=2, window=8, budget=16, scorer=scorer)
    ids = _ids()
    full = _logits(m, ids)  # teacher-forced, the same scorer's mask
    cache = kvpop.KVpopCache(m)
    outs = [_logits(m, ids[:, :20], **kvpop.cache_kwargs(cache))]
    sizes = []
    for i in range(20, S):
        outs.append(_logits(m, ids[:, i:i + 1], **kvpop.cache_kwargs(cache)))
        sizes.append(cache.nbytes())
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-4, rtol=1e-4)
    assert len(set(sizes)) == 1
    gen = m.generate(ids[:, :20], max_new_tokens=40, do_sample=False)
    assert gen.shape == (1, 60)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_scorers(family, tmp_path):
    m = tiny_model(family=family)
    kvpop.patch(m, **SMALL)
    for p in kvpop.kvpop_layers(m)[0].parameters():
        torch.nn.init.normal_(p, std=0.3)
    ids = _ids(64)
    out = _logits(m, ids)
    kvpop.save_scorers(m, tmp_path / "s.safetensors")
    fresh = tiny_model(family=family)
    kvpop.load_scorers(fresh, tmp_path / "s.safetensors")
    assert kvpop.get_config(fresh) == kvpop.get_config(m)
    torch.testing.assert_close(_logits(fresh, ids), out, atol=0, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_copies_and_pickles_decode_with_their_own_config(family):
    """A deep copy re-patched with another budget generates with that budget; the original keeps its
    own; ``torch.save`` of a patched model works and the loaded model generates like the original."""
    m = tiny_model(family=family)
    kvpop.patch(m, sinks=2, window=8, budget=14)
    ids = _ids(12)
    c = copy.deepcopy(m)
    kvpop.patch(c, budget=40)
    seen = []
    orig_init = kvpop.KVpopCache.__init__

    def spy(self, model=None, **kw):
        orig_init(self, model, **kw)
        seen.append((model, self.kvpop_config.budget))

    kvpop.KVpopCache.__init__ = spy
    try:
        c.generate(ids, max_new_tokens=5, do_sample=False)
        m.generate(ids, max_new_tokens=5, do_sample=False)
    finally:
        kvpop.KVpopCache.__init__ = orig_init
    assert seen[0][0] is c and seen[0][1] == 40
    assert seen[1][0] is m and seen[1][1] == 14
    # the copy's hooks feed the copy's layers, not the original's
    kvpop.unpatch(m)
    assert kvpop.is_patched(c)
    assert torch.equal(c.generate(ids, max_new_tokens=30, do_sample=False)[:, :12], ids)
    kvpop.patch(m, sinks=2, window=8, budget=14)
    buf = io.BytesIO()
    c2 = copy.deepcopy(c)
    kvpop.patch(c2, budget=14)
    torch.save(c2, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert kvpop.get_config(loaded).budget == 14
    assert torch.equal(loaded.generate(ids, max_new_tokens=30, do_sample=False), c2.generate(
        ids, max_new_tokens=30, do_sample=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_context_manager(family):
    m = tiny_model(family=family)
    ids = _ids(64)
    ref = _logits(m, ids)
    keys = list(m.state_dict())
    hooks_before = {n: len(mod._forward_hooks) + len(mod._forward_pre_hooks) for n, mod in m.named_modules()}
    with kvpop.patched(m, **SMALL) as pm:
        assert pm is m and kvpop.is_patched(m)
        assert not torch.allclose(_logits(m, ids), ref, atol=1e-3)
    assert not kvpop.is_patched(m) and list(m.state_dict()) == keys
    assert {n: len(mod._forward_hooks) + len(mod._forward_pre_hooks) for n, mod in m.named_modules()} == hooks_before
    assert torch.equal(_logits(m, ids), ref)
    # on an already patched model the block changes the config and gives the old one back
    kvpop.patch(m, **SMALL)
    with kvpop.patched(m, budget=64):
        assert kvpop.get_config(m).budget == 64
    assert kvpop.get_config(m).budget == SMALL["budget"]


def test_core_imports_no_training_demo_or_cli():
    """The layering: importing the library core (and the public package) loads no training, demo or
    CLI module, and kvpop_kernels loads no transformers."""
    code = ("import sys, kvpop, kvpop.core; bad = [m for m in sys.modules if m.startswith(('kvpop.training', "
            "'kvpop.demo', 'kvpop.cli'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    code = "import sys, kvpop_kernels; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
