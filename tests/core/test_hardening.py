"""Ordinary and bad inputs to the cache and the patched model: each case here once crashed
or gave a silent wrong result.  The table of handled inputs is docs/HARDENING.md."""
import pytest
import torch
from tiny import tiny_model

import kvpop
from kvpop.models import cache_kwarg_name

SINKS, WINDOW, BUDGET = 4, 4, 14
CACHE = cache_kwarg_name()  # `cache` (transformers >= 5.24) or `past_key_values`


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    """The PyTorch CPU path of kvpop_kernels (the kernels have their own tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _randomise_scorers(m):
    with torch.no_grad():  # make the scores matter
        for n, p in m.named_parameters():
            if ".kvpop." in n and not n.endswith("decay_logit"):
                p.copy_(torch.randn_like(p))
    return m


def _greedy(m, ids, n, **kw):
    return m.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, **kw)


# ----------------------------------------------------------------------------- point 2: short prompts
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
@pytest.mark.parametrize("policy", ["kvpop", "streaming", "tova", "h2o"])
def test_every_prompt_length_from_one_generates(scorer, policy):
    """Prompts of 1 .. sinks + 2 tokens: while nothing is evicted the generation is the unpatched
    model's; past the budget, prefill + decoding of the static policies equals one full forward."""
    torch.manual_seed(0)
    dense = tiny_model()
    m = _randomise_scorers(kvpop.patch(tiny_model(), scorer=scorer, policy=policy, sinks=SINKS, window=WINDOW,
                                       budget=BUDGET))
    g = torch.Generator().manual_seed(1)
    for n in range(1, SINKS + 3):
        ids = torch.randint(0, 128, (1, n), generator=g)
        new = BUDGET - n  # total length == budget: nothing evicted
        assert torch.equal(_greedy(m, ids, new), _greedy(dense, ids, new)), n
        if policy in ("kvpop", "streaming"):
            seq = torch.randint(0, 128, (1, 28), generator=g)
            seq[:, :n] = ids
            cache = kvpop.KVpopCache(m)
            with torch.no_grad():
                full = m(seq).logits
                outs = [m(seq[:, :n], **{CACHE: cache}, use_cache=True).logits]
                outs += [m(seq[:, t:t + 1], **{CACHE: cache}, use_cache=True).logits for t in range(n, 28)]
            torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-4, rtol=2e-4)
        else:
            assert _greedy(m, ids, 28 - n).shape == (1, 28)  # past the budget too


# ----------------------------------------------------------------------------- point 5: reusing a cache
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_reusing_a_cache_says_what_to_do_and_reset_makes_it_fresh(scorer):
    m = _randomise_scorers(kvpop.patch(tiny_model(), scorer=scorer, sinks=SINKS, window=WINDOW, budget=BUDGET))
    prompt = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = kvpop.KVpopCache(m)
    first = _greedy(m, prompt, 12, **{CACHE: cache})
    assert torch.equal(first, _greedy(m, prompt, 12))  # same as the default fresh cache
    with pytest.raises(ValueError, match=r"has seen 41 tokens.*fresh kvpop.KVpopCache\(model\).*cache.reset\(\)"):
        _greedy(m, prompt, 12, **{CACHE: cache})
    cache.reset()
    assert torch.equal(_greedy(m, prompt, 12, **{CACHE: cache}), first)
    # continuing (the whole sequence so far as input) is what a used cache is for
    cont = _greedy(m, first, 5, **{CACHE: cache})
    assert torch.equal(cont, _greedy(m, prompt, 17))


def test_crop_raises_a_clear_error():
    m = kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET)
    cache = kvpop.KVpopCache(m)
    _greedy(m, torch.randint(0, 128, (1, 10)), 3, **{CACHE: cache})
    with pytest.raises(NotImplementedError, match=r"cannot be cropped.*cache.reset\(\)"):
        cache.crop(5)


# ----------------------------------------------------------------------------- point 4: a failed load_scorers
def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}, m.config._attn_implementation


def _unchanged(m, before):
    sd, attn = before
    now = m.state_dict()
    return (not kvpop.is_patched(m) and m.config._attn_implementation == attn and now.keys() == sd.keys()
            and all(torch.equal(now[k], sd[k]) for k in sd)
            and not any(h for mod in m.modules() for h in (mod._forward_hooks, mod._forward_pre_hooks)))


def test_a_failed_load_scorers_leaves_the_model_as_it_was(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    path = tmp_path / "scorers.safetensors"
    kvpop.save_scorers(kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET), path)
    tensors = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    key = next(iter(tensors))
    cases = {  # file -> what the error says
        "nan": ({**tensors, key: tensors[key].clone().fill_(float("nan"))}, meta, "non-finite"),
        "inf": ({**tensors, key: tensors[key].clone().fill_(float("inf"))}, meta, "non-finite"),
        "json": (tensors, {**meta, "kvpop_config": "{not json"}, "not a valid KVpopConfig"),
        "config": (tensors, {**meta, "kvpop_config": json.dumps({"budget": 3})}, "not a valid KVpopConfig"),
    }
    for name, (ts, md, msg) in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        save_file(ts, str(bad), metadata=md)
        m = tiny_model()
        before = _state(m)
        with pytest.raises(ValueError, match=msg):
            kvpop.load_scorers(m, bad)
        assert _unchanged(m, before), name
    # a file that fits another model (4 KV heads): the patch the load needed is undone
    m = tiny_model(num_key_value_heads=4)
    before = _state(m)
    with pytest.raises(ValueError, match="shape"):
        kvpop.load_scorers(m, path)
    assert _unchanged(m, before)
    # a patched model keeps its scorers when a file does not fit
    p = kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET)
    sd = _state(p)[0]
    with pytest.raises(ValueError, match="non-finite"):
        kvpop.load_scorers(p, tmp_path / "nan.safetensors")
    assert all(torch.equal(p.state_dict()[k], v) for k, v in sd.items())
    # a directory, a missing file and a file that is not safetensors
    with pytest.raises(ValueError, match=r"is a directory.*scorers.safetensors"):
        kvpop.load_scorers(tiny_model(), tmp_path)
    with pytest.raises(FileNotFoundError, match="no scorer file"):
        kvpop.load_scorers(tiny_model(), tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a kvpop scorer file"):
        kvpop.load_scorers(tiny_model(), tmp_path / "junk.safetensors")


# ----------------------------------------------------------------------------- point 7: output_attentions
def test_output_attentions_is_refused_not_answered_with_nothing():
    m = kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET)
    ids = torch.randint(0, 128, (1, 20))
    with pytest.raises(ValueError, match="output_attentions=True.*kvpop.disabled"):
        m(ids, output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions=True"):
        _greedy(m, ids, 2, output_attentions=True, return_dict_in_generate=True)
    with kvpop.disabled(m):  # the dense weights, as the message says
        m.config._attn_implementation = "eager"
        out = m(ids, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 20, 20)


# ============================================================================ round two (docs/HARDENING.md)
# ----------------------------------------------------------------------------- item 1: kvpop.disabled + generate
@pytest.mark.parametrize("policy", ["kvpop", "tova"])
def test_disabled_generate_equals_the_unpatched_model(policy):
    """Under kvpop.disabled, plain generate builds no KVpopCache (the mode switch owns the default cache):
    token for token the unpatched model, while the patched model outside the block differs from it."""
    dense = tiny_model()
    m = _randomise_scorers(kvpop.patch(tiny_model(), policy=policy, sinks=SINKS, window=WINDOW, budget=BUDGET))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    want = _greedy(dense, ids, 20)
    assert not torch.equal(_greedy(m, ids, 20), want)  # the budget (14) evicts: the repro can fail
    with kvpop.disabled(m):
        assert torch.equal(_greedy(m, ids, 20), want)
        with pytest.raises(ValueError, match=r"runs densely now \(kvpop.disabled"):
            _greedy(m, ids, 2, **{CACHE: kvpop.KVpopCache(m)})
    assert torch.equal(_greedy(m, ids, 20), _greedy(m, ids, 20, **{CACHE: kvpop.KVpopCache(m)}))


# ----------------------------------------------------------------------------- item 2: a cache in the wrong model
def test_a_kvpop_cache_refuses_a_model_not_patched_for_it():
    m = kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET)
    ids = torch.randint(0, 128, (1, 12))
    with pytest.raises(ValueError, match=r"not patched for it .*kvpop.patch\(model\)"):
        _greedy(tiny_model(), ids, 3, **{CACHE: kvpop.KVpopCache(m)})
    with pytest.raises(ValueError, match="not patched for it"):  # a forward pass too, after unpatch
        cache = kvpop.KVpopCache(m)
        kvpop.unpatch(kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET))(ids, **{CACHE: cache})
    # built for another config than the model's current one
    cache = kvpop.KVpopCache(m)
    kvpop.patch(m, budget=BUDGET + 6)
    with pytest.raises(ValueError, match=r"built for budget=14 but the model is patched with budget=20"):
        _greedy(m, ids, 3, **{CACHE: cache})
    assert _greedy(m, ids, 3, **{CACHE: kvpop.KVpopCache(m)}).shape == (1, 15)
    # claimed by another patch (what a DMS-patched model's pre-hook reports)
    cache = kvpop.KVpopCache(m)
    cache.claim(0, "dms", None, True)
    with pytest.raises(ValueError, match="patched for dms, not kvpop"):
        cache.update(torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 3, 32), 0)


def test_a_used_cache_in_another_model_or_with_a_shorter_prompt_says_so():
    m = kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET)
    cache = kvpop.KVpopCache(m)
    _greedy(m, torch.randint(0, 128, (1, 12)), 5, **{CACHE: cache})
    with pytest.raises(ValueError, match=r"has seen 16 tokens and the call brings no new one.*cache.reset\(\)"):
        _greedy(m, torch.randint(0, 128, (1, 3)), 2, **{CACHE: cache})
    other = kvpop.patch(tiny_model(num_key_value_heads=1), sinks=SINKS, window=WINDOW, budget=BUDGET)
    with pytest.raises(ValueError, match="holds 2 KV heads of size 32 but the call brings 1"):
        _greedy(other, torch.randint(0, 128, (1, 30)), 2, **{CACHE: cache})
    deeper = kvpop.patch(tiny_model(num_hidden_layers=3), sinks=SINKS, window=WINDOW, budget=BUDGET)
    with pytest.raises(ValueError, match=r"built for 2 layers .*layer 2"):
        _greedy(deeper, torch.randint(0, 128, (1, 12)), 2, **{CACHE: kvpop.KVpopCache(m)})


# ----------------------------------------------------------------------------- item 14: budgets bounded at construction
def _scorer_file_with(tmp_path, name, *, config_json=None, scale=None):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    good = tmp_path / "good.safetensors"
    if not good.exists():
        kvpop.save_scorers(kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET), good)
    tensors = load_file(str(good))
    with safe_open(str(good), framework="pt") as f:
        meta = f.metadata()
    if config_json is not None:
        meta = {**meta, "kvpop_config": config_json}
    if scale is not None:
        key = next(k for k in tensors if "scorer" in k)
        tensors = {**tensors, key: tensors[key].clone().fill_(scale)}
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def test_budgets_are_bounded_when_a_config_a_patch_or_a_cache_is_made(tmp_path):
    import json

    for budget, shown in [(2**40, "1099511627776"), (2**62, "4611686018427387904"),
                          (10**400, "an integer of about 400 digits")]:
        with pytest.raises(ValueError, match=f"budget must be <= 2147483647, got {shown}"):
            kvpop.KVpopConfig(budget=budget)
    with pytest.raises(ValueError, match="window must be <= 2147483647"):
        kvpop.KVpopConfig(window=2**31)
    with pytest.raises(ValueError, match="scorer_hidden must be <= 65536"):
        kvpop.KVpopConfig(scorer_hidden=2**20)
    # against the model: tiny_model has max_position_embeddings = 256
    with pytest.raises(ValueError, match=r"budget=4096 is more than 8 x the model's max_position_embeddings \(256\)"):
        kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=4096)
    m = kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=2048)  # 8 x 256: still allowed
    with pytest.raises(ValueError, match="more than 8 x"):
        kvpop.patch(m, budget=2049)
    with pytest.raises(ValueError, match="more than 8 x"):
        kvpop.KVpopCache(m, config=kvpop.KVpopConfig(sinks=SINKS, window=WINDOW, budget=10**6))
    # a scorer file whose metadata claims such a budget: refused by load_scorers, the model untouched
    for name, budget in [("b62", 2**62), ("b400", 10**400)]:
        cfg = json.loads(kvpop.KVpopConfig(sinks=SINKS, window=WINDOW, budget=BUDGET).to_json())
        path = _scorer_file_with(tmp_path, name, config_json=json.dumps({**cfg, "budget": budget}))
        t = tiny_model()
        before = _state(t)
        with pytest.raises(ValueError, match=r"not a valid KVpopConfig .*budget must be <= 2147483647"):
            kvpop.load_scorers(t, path)
        assert _unchanged(t, before)


# ----------------------------------------------------------------------------- item 5 (scorers): huge finite weights
def test_huge_finite_scorer_weights_are_refused_not_loaded_into_a_nan_loss(tmp_path):
    path = _scorer_file_with(tmp_path, "huge", scale=3e38)
    t = tiny_model()
    before = _state(t)
    with pytest.raises(ValueError, match=r"holds a value of magnitude 3e\+38, above 1e\+06"):
        kvpop.load_scorers(t, path)
    assert _unchanged(t, before)
    kvpop.load_scorers(tiny_model(), _scorer_file_with(tmp_path, "large", scale=1e3))  # large but sane loads


# ----------------------------------------------------------------------------- obscure errors: scorer metadata
def test_scorer_metadata_nested_too_deep_is_a_clear_error(tmp_path):
    path = _scorer_file_with(tmp_path, "deep", config_json="[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"deep.safetensors: its kvpop_config metadata is not a valid KVpopConfig "
                                         r"as JSON \(nested too deep to read\)"):
        kvpop.read_scorer_config(path)


# ----------------------------------------------------------------------------- DMS: items 2, 3, 4, 5, 10
def _dms_model(threshold=0.0):
    from kvpop.baselines import dms as D

    m = D.patch_dms(tiny_model(), sinks=SINKS, window=WINDOW, threshold=threshold)
    with torch.no_grad():  # gates that evict about half the tokens
        for layer in D.dms_layers(m):
            layer.gate.weight.copy_(torch.randn_like(layer.gate.weight))
            layer.gate.bias.zero_()
    return m


def test_a_dms_cache_refuses_a_model_not_patched_for_it_and_a_kvpop_cache_a_dms_model():
    from kvpop.baselines import dms as D

    m = _dms_model()
    ids = torch.randint(0, 128, (1, 12))
    with pytest.raises(ValueError, match=r"DMSCache was passed to a model that is not patched for it"):
        _greedy(tiny_model(), ids, 3, **{CACHE: D.DMSCache(m)})
    k = kvpop.patch(tiny_model(), sinks=SINKS, window=WINDOW, budget=BUDGET)
    with pytest.raises(ValueError, match="DMSCache was passed to a model patched for kvpop, not dms"):
        _greedy(k, ids, 3, **{CACHE: D.DMSCache(m)})
    with pytest.raises(ValueError, match="KVpopCache was passed to a model patched for dms, not kvpop"):
        _greedy(m, ids, 3, **{CACHE: kvpop.KVpopCache(k)})
    other = D.DMSCache(config=D.DMSConfig(sinks=SINKS, window=WINDOW + 2), num_layers=2)
    with pytest.raises(ValueError, match=r"built for window=6 but the model is patched with window=4"):
        _greedy(m, ids, 3, **{CACHE: other})
    assert torch.equal(_greedy(m, ids, 8, **{CACHE: D.DMSCache(m)}), _greedy(m, ids, 8))


def test_one_method_per_model_whatever_the_order():
    from kvpop.baselines import dms as D

    m = _dms_model()
    with pytest.raises(ValueError, match="a model carries one method"):
        kvpop.patch(m)
    assert D.is_dms_patched(m) and not kvpop.is_patched(m)
    kvpop.unpatch(m)  # not KVpop-patched: leaves DMS's hooks and default cache alone
    assert D.is_dms_patched(m) and "_prepare_cache_for_generation" in m.__dict__
    with pytest.raises(ValueError, match="a model carries one method"):
        D.patch_dms(kvpop.patch(tiny_model()))


def test_a_used_dms_cache_refuses_a_second_prompt_and_reset_makes_it_fresh():
    from kvpop.baselines import dms as D

    m = _dms_model()
    prompt = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = D.DMSCache(m)
    first = _greedy(m, prompt, 10, **{CACHE: cache})
    assert torch.equal(first, _greedy(m, prompt, 10))
    with pytest.raises(ValueError, match=r"DMSCache has seen 39 tokens, so the next call must start at position 39, "
                                         r"but it starts at position \d+.*cache.reset\(\)"):
        _greedy(m, prompt, 10, **{CACHE: cache})
    cache.reset()
    assert torch.equal(_greedy(m, prompt, 10, **{CACHE: cache}), first)


def test_nan_thresholds_and_nan_or_huge_gates_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from kvpop.baselines import dms as D

    m = _dms_model()
    with pytest.raises(ValueError, match="threshold must be a finite number, got nan"):
        D.DMSCache(m, threshold=float("nan"))
    with pytest.raises(ValueError, match="threshold must be a finite number"):
        D.patch_dms(m, threshold=float("nan"))
    D.save_dms(m, tmp_path / "gates.safetensors")
    tensors = load_file(str(tmp_path / "gates.safetensors"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "gates.safetensors"), framework="pt") as f:
        meta = f.metadata()
    key = next(iter(tensors))
    for name, value, msg in [("nan", float("nan"), "non-finite"), ("huge", 3e38, "magnitude 3e\\+38")]:
        save_file({**tensors, key: tensors[key].clone().fill_(value)}, str(tmp_path / f"{name}.safetensors"),
                  metadata=meta)
        t = tiny_model()
        before = _state(t)
        with pytest.raises(ValueError, match=msg):
            D.load_dms(t, tmp_path / f"{name}.safetensors")
        assert _unchanged(t, before)


def test_a_failed_load_dms_leaves_the_model_as_it_was(tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kvpop.baselines import dms as D

    good = tmp_path / "gates.safetensors"
    D.save_dms(_dms_model(), good)
    tensors = load_file(str(good))
    with safe_open(str(good), framework="pt") as f:
        meta = f.metadata()
    save_file({**tensors, "layers.9.gate.bias": torch.zeros(2)}, str(tmp_path / "extra.safetensors"), metadata=meta)
    # another shape: a model of 3 layers, one of 4 KV heads, one of hidden size 128
    for model, path, msg in [(tiny_model(num_hidden_layers=3), good, "does not fit the model: missing"),
                             (tiny_model(num_key_value_heads=4), good, "has shape"),
                             (tiny_model(hidden_size=128), good, "has shape"),
                             (tiny_model(), tmp_path / "extra.safetensors", "unexpected")]:
        before = _state(model)
        with pytest.raises(ValueError, match=msg):
            D.load_dms(model, path)
        assert _unchanged(model, before) and not D.is_dms_patched(model)
    # a DMS-patched model keeps its gates and config
    p = _dms_model(threshold=0.5)
    sd = {k: v.clone() for k, v in p.state_dict().items()}
    with pytest.raises(ValueError, match="unexpected"):
        D.load_dms(p, tmp_path / "extra.safetensors")
    assert D.get_dms_config(p).threshold == 0.5 and all(torch.equal(p.state_dict()[k], v) for k, v in sd.items())
    # obscure files: each named, the model untouched
    cases = {
        "badjson": (tensors, {**meta, "dms_config": "{not json"}, "not a valid DMSConfig"),
        "list": (tensors, {**meta, "dms_config": json.dumps([1, 2])}, "not a valid DMSConfig"),
        "deep": (tensors, {**meta, "dms_config": "[" * 100_000 + "]" * 100_000}, "nested too deep"),
        "noconfig": (tensors, {k: v for k, v in meta.items() if k != "dms_config"}, "is not a DMS gate file"),
    }
    for name, (ts, md, msg) in cases.items():
        save_file(ts, str(tmp_path / f"{name}.safetensors"), metadata=md)
    raw = good.read_bytes()
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "truncated.safetensors").write_bytes(raw[: len(raw) - 40])
    (tmp_path / "zip.safetensors").write_bytes(b"PK\x03\x04 not a zip")
    torch.save({"x": 1}, tmp_path / "pickle.safetensors")
    files = {**{n: c[2] for n, c in cases.items()}, "empty": "not a DMS gate file", "truncated": "DMS gate file",
             "zip": "not a DMS gate file", "pickle": "not a DMS gate file"}
    for name, msg in files.items():
        t = tiny_model()
        before = _state(t)
        with pytest.raises(ValueError, match=msg) as e:
            D.load_dms(t, tmp_path / f"{name}.safetensors")
        assert f"{name}.safetensors" in str(e.value) and _unchanged(t, before), name
    with pytest.raises(ValueError, match=r"is a directory.*gates.safetensors"):
        D.load_dms(tiny_model(), tmp_path)
