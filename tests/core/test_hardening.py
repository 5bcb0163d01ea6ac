"""Ordinary and bad inputs to the cache and the patched model (issue 10): each case here once crashed
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
