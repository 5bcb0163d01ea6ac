"""Batched generation through ``KVpopCache``: left padding, every policy and scorer, beam search,
``num_return_sequences``."""
import pytest
import torch
from tiny import randomize_scorers, tiny_model

import kvpop
from kvpop.models import cache_kwarg_name

SINKS, WINDOW, BUDGET = 2, 4, 12  # k = 6: prompts and generations run well past the budget
CACHE = cache_kwarg_name()
LENGTHS = (5, 23, 1, 14)  # mixed prompt lengths (left-padded to 23), one shorter than the sinks
NEW = 20
VARIANTS = [("kvpop", "mlp"), ("kvpop", "mlstm"), ("streaming", "mlp"), ("tova", "mlp"), ("h2o", "mlp")]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    """The PyTorch CPU path of kvpop_kernels (the kernels have their own batched tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(policy, scorer):
    return randomize_scorers(kvpop.patch(tiny_model(seed=1), scorer=scorer, policy=policy, sinks=SINKS,
                                         window=WINDOW, budget=BUDGET))


def _left_padded(prompts, pad=0):
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), S, dtype=torch.long)
    for n, p in enumerate(prompts):
        ids[n, S - len(p):] = p
        mask[n, S - len(p):] = 1
    return ids, mask


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (L,), generator=g) for L in LENGTHS]


@pytest.mark.parametrize("policy,scorer", VARIANTS)
def test_batched_greedy_rows_equal_prompts_alone(policy, scorer):
    m = _model(policy, scorer)
    prompts = _prompts()
    ids, mask = _left_padded(prompts)
    cache = kvpop.KVpopCache(m)
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, **{CACHE: cache})
        size = cache.nbytes()
        for n, p in enumerate(prompts):
            alone = m.generate(p[None], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            assert torch.equal(out[n, ids.shape[1]:], alone[0, len(p):]), f"row {n} (prompt of {len(p)} tokens)"
    layer = cache.layers[0]
    assert layer.keys.shape[:3] == (len(prompts), 2, BUDGET) and cache.nbytes() == size
    # each row's positions count its real tokens only; its sinks are its own first tokens
    assert layer.pos.tolist() == [L + NEW - 1 for L in LENGTHS]  # the last token is never fed back
    assert (layer.slot_pos[:, :, :SINKS] == torch.arange(SINKS, dtype=torch.int32)).all()


def test_rows_finish_independently():
    """A row that emits EOS early is padded while the others keep generating their own tokens."""
    m = _model("kvpop", "mlp")
    prompts = _prompts(1)[:2]
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        free = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        eos = int(free[0, ids.shape[1] + 3])  # row 0 emits this token at step 3
        out = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=eos)
        alone = m.generate(prompts[1][None], max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos)
    S = ids.shape[1]
    assert (out[0, S + 4:] == 0).all()  # row 0 finished (padding after EOS)
    row1 = out[1, S:S + alone.shape[1] - len(prompts[1])]
    assert torch.equal(row1, alone[0, len(prompts[1]):])


def test_num_return_sequences_and_sampling():
    m = _model("kvpop", "mlp")
    ids, mask = _left_padded(_prompts(2)[:2])
    cache = kvpop.KVpopCache(m)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, num_return_sequences=3,
              pad_token_id=0)
    with torch.no_grad():
        greedy = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                            pad_token_id=0)
        top1 = m.generate(ids, top_k=1, **kw, **{CACHE: cache})  # sampling from one token: greedy, 3 copies each
        torch.manual_seed(0)
        sampled = m.generate(ids, top_k=20, **kw)
    assert top1.shape == sampled.shape == (6, ids.shape[1] + NEW)
    assert cache.layers[0].keys.shape[0] == 6
    assert torch.equal(top1, greedy.repeat_interleave(3, dim=0))
    assert not torch.equal(sampled[0], sampled[1])


def _teacher_forced_logprob(m, prompt, tokens):
    """Brute force: a single-sequence cache fed the prompt, then ``tokens`` one by one; the sum of the
    log-probabilities of ``tokens``."""
    cache = kvpop.KVpopCache(m)
    with torch.no_grad():
        logits = m(prompt[None], use_cache=True, **{CACHE: cache}).logits[0, -1]
        total = 0.0
        for t in tokens.tolist():
            total += float(torch.log_softmax(logits.double(), -1)[t])
            logits = m(torch.tensor([[t]]), use_cache=True, **{CACHE: cache}).logits[0, -1]
    return total


@pytest.mark.parametrize("policy,scorer", [("kvpop", "mlp"), ("kvpop", "mlstm"), ("h2o", "mlp")])
def test_beam_search_cache_rows_follow_the_beams(policy, scorer):
    """num_beams=2: the winning beam's score (sum of log-probabilities, length_penalty 0) equals that
    of its tokens re-run through a fresh single-sequence cache; it would not if the cache rows had not
    followed the beams through every reordering."""
    m = _model(policy, scorer)
    prompt = _prompts(3)[1]
    with torch.no_grad():
        res = m.generate(prompt[None], num_beams=2, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         length_penalty=0.0, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = res.sequences[0, len(prompt):]
    assert tokens.numel() == NEW
    want = _teacher_forced_logprob(m, prompt, tokens)
    assert abs(float(res.sequences_scores[0]) - want) < 1e-3


def test_reorder_cache_moves_every_row_state():
    m = _model("kvpop", "mlstm")
    ids = torch.randint(1, 128, (3, 20), generator=torch.Generator().manual_seed(4))
    cache = kvpop.KVpopCache(m)
    with torch.no_grad():
        m(ids, use_cache=True, **{CACHE: cache})
    before = [(layer.keys.clone(), layer.slot_pos.clone(), layer.pos.clone(), [t.clone() for t in layer.scorer_state])
              for layer in cache.layers]
    ptrs = [layer.keys.data_ptr() for layer in cache.layers]
    idx = torch.tensor([2, 2, 0])
    cache.reorder_cache(idx)
    for layer, (k, sp, pos, st), ptr in zip(cache.layers, before, ptrs):
        assert torch.equal(layer.keys, k[idx]) and torch.equal(layer.slot_pos, sp[idx])
        assert torch.equal(layer.pos, pos[idx]) and layer.keys.data_ptr() == ptr  # in place
        for a, b in zip(layer.scorer_state, st):
            assert torch.equal(a, b[idx])
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.layers[0].keys.shape[0] == 1 and cache.layers[0].scorer_state[0].shape[0] == 1


def test_padding_errors():
    m = _model("kvpop", "mlp")
    ids = torch.randint(1, 128, (2, 6))
    with torch.no_grad(), pytest.raises(ValueError, match="only left padding"):
        m.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]), max_new_tokens=2,
                   pad_token_id=0)
    padded = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad(), pytest.raises(ValueError, match="row 0 has position id 2.*attention_mask.cumsum"):
        m(ids, attention_mask=padded, use_cache=True, **{CACHE: kvpop.KVpopCache(m)})  # default position ids
    with torch.no_grad(), pytest.raises(ValueError, match="no padding or custom masks in a full-sequence"):
        m(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]), use_cache=False)
