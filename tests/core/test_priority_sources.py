"""Priorities that are not learned (docs/DESIGN.md section 12): each source against a brute force of its
definition on odd shapes, and decoding through KVpopCache keeps what the teacher-forced schedule keeps."""
import math
import re

import pytest
import torch
from tiny import tiny_model

import kvpop
from kvpop import kvpop_layers
from kvpop.core.config import PRIORITY_SOURCES, KVpopConfig
from kvpop.core.priority_sources import keynorm_scores, oracle_scores, window_attention_sums
from kvpop.models import cache_kwarg_name
from kvpop_kernels import reference

CACHE = cache_kwarg_name()
SINKS, WINDOW, BUDGET = 2, 8, 14


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_config_records_and_checks_the_source():
    for src in PRIORITY_SOURCES:
        c = KVpopConfig(sinks=2, window=8, budget=14, priority_source=src)
        assert KVpopConfig.from_json(c.to_json()).priority_source == src
    assert KVpopConfig.from_dict({k: v for k, v in KVpopConfig().to_dict().items()
                                  if k != "priority_source"}).priority_source == "scorer"  # older files
    with pytest.raises(ValueError, match="priority_source must be one of"):
        KVpopConfig(priority_source="keynorm")
    with pytest.raises(ValueError, match="would do nothing"):
        KVpopConfig(priority_source="keynorm+", mask_source="streaming")


def test_keynorm_against_brute_force():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 13, 7, generator=g)
    for sign in (1.0, -1.0):
        r = keynorm_scores(k, sign)
        assert r.shape == (2, 3, 13) and r.dtype == torch.float32
        for b in range(2):
            for h in range(3):
                for t in range(13):
                    want = sign * math.sqrt(sum(float(x) ** 2 for x in k[b, h, t].double()))
                    assert abs(float(r[b, h, t]) - want) <= 1e-6 * abs(want)
    assert torch.equal(keynorm_scores(k[:, :, 5], 1.0), keynorm_scores(k, 1.0)[:, :, 5])  # one token: same bits


@pytest.mark.parametrize("shape", [(2, 6, 3, 23, 5, 3, 5, 4), (1, 2, 1, 17, 3, 0, 4, 128), (1, 4, 2, 9, 8, 4, 16, 2)])
def test_window_attention_against_brute_force(shape):
    """``(B, Hq, Hkv, S, D, sinks, window, block)``: the sum, over the queries whose window holds ``t``, of
    the group-mean of each query's softmax over its sinks and window, by explicit loops."""
    B, Hq, Hkv, S, D, s, w, block = shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, S, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    got = window_attention_sums(q, k, sinks=s, window=w, scale=0.7, block=block)
    G = Hq // Hkv
    for b in range(B):
        for h in range(Hkv):
            want = [0.0] * S
            for u in range(S):
                seen = [c for c in range(u + 1) if c < s or c > u - w]
                for gi in range(G):
                    qq = q[b, h * G + gi, u].double()
                    z = [0.7 * float(qq @ k[b, h, c].double()) for c in seen]
                    m = max(z)
                    tot = sum(math.exp(x - m) for x in z)
                    for c, x in zip(seen, z):
                        if u - w < c:  # in u's window (a sink's own sum is never read)
                            want[c] += math.exp(x - m) / tot / G
            for t in range(s, S):
                assert abs(float(got[b, h, t]) - want[t]) <= 1e-12, (b, h, t)


def test_oracle_is_the_exact_label():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 19, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    cfg = KVpopConfig(sinks=2, window=5, budget=10)
    _, lse = reference.dense_causal_attention(q.double(), k.double(), v.double(), scale=0.5)
    want = reference.future_attention_target(q.double(), k.double(), lse, window=5, eps=cfg.eps, scale=0.5)
    torch.testing.assert_close(oracle_scores(q, k, v, cfg, 0.5).double(), want.double(), atol=1e-5, rtol=1e-5)


def _model(source):
    m = kvpop.patch(tiny_model(seed=0), sinks=SINKS, window=WINDOW, budget=BUDGET, priority_source=source)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a scorer whose scores matter (the random source serves it as it is)
        for n, p in m.named_parameters():
            if ".kvpop." in n and not n.endswith("decay_logit"):
                p.copy_(torch.randn(p.shape, generator=g))
    return m.eval()


def _kept(evict_at, q):
    return [{t for t in range(SINKS, q - WINDOW + 1) if int(ev[t]) > q} for ev in evict_at]


@pytest.mark.parametrize("source", ["random", "keynorm+", "keynorm-", "window-attention"])
@pytest.mark.parametrize("prompt_len", [30, 1])
def test_decoding_keeps_what_the_training_schedule_keeps(source, prompt_len):
    """A prompt prefilled through KVpopCache, then greedy steps: after every step the long-range slots of
    every layer and head hold what the schedule of the teacher-forced forward of the whole sequence keeps
    (the training mask of the same priorities), and the logits are that forward's."""
    m = _model(source)
    seq = torch.randint(1, 128, (prompt_len,), generator=torch.Generator().manual_seed(4)).tolist()
    cache = kvpop.KVpopCache(m)
    steps, logits = [], []
    with torch.no_grad():
        out = m(torch.tensor([seq]), **{CACHE: cache}, use_cache=True).logits
        logits.append(out[0])
        for _ in range(36 - prompt_len + 5):
            nxt = int(out[0, -1].argmax())
            seq.append(nxt)
            out = m(torch.tensor([[nxt]]), position_ids=torch.tensor([[len(seq) - 1]]), **{CACHE: cache},
                    use_cache=True).logits
            logits.append(out[0])
            steps.append([layer.long_range_positions(0) for layer in cache.layers])
        full = m(torch.tensor([seq])).logits[0]
    evs = [layer.last_evict_at[0] for layer in kvpop_layers(m)]
    n_long = 0
    for j, per_layer in enumerate(steps):
        q = prompt_len + j
        for li, ev in enumerate(evs):
            assert per_layer[li] == _kept(ev, q), f"{source} layer {li} q={q}"
            n_long += sum(len(x) for x in per_layer[li])
    assert n_long > 0
    torch.testing.assert_close(torch.cat(logits), full, atol=1e-4, rtol=1e-4)


def test_window_attention_decode_matches_its_sums():
    """The cache's score of a leaving token is log(eps + its window-attention sum) over the whole sequence."""
    m = _model("window-attention")
    seq = torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        m(seq[None])
    prios = [layer.last_priority[0] for layer in kvpop_layers(m)]
    cache = kvpop.KVpopCache(m)
    got = {}
    from kvpop.core import priority_sources as ps
    orig = ps.WindowAttentionHooks.leaving

    def rec(self, module, cache_layer, key_new, value_new, pos, i):
        out = orig(self, module, cache_layer, key_new, value_new, pos, i)
        got.setdefault(self.layer.layer_idx, {})[int(pos[0]) - WINDOW] = out[0].clone()
        return out

    ps.WindowAttentionHooks.leaving = rec
    try:
        with torch.no_grad():
            m(seq[None, :12], **{CACHE: cache}, use_cache=True)
            for t in range(12, 40):
                m(seq[None, t:t + 1], position_ids=torch.tensor([[t]]), **{CACHE: cache}, use_cache=True)
    finally:
        ps.WindowAttentionHooks.leaving = orig
    for li, p in enumerate(prios):
        for t in range(12 - WINDOW, 40 - WINDOW):
            if t >= SINKS:
                torch.testing.assert_close(got[li][t], p[:, t], atol=1e-5, rtol=1e-6)


def test_oracle_serves_a_whole_sequence_and_refuses_decoding():
    m = _model("oracle-label")
    seq = torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(6))
    cache = kvpop.KVpopCache(m)
    with torch.no_grad():
        full = m(seq[None]).logits
        evs = [layer.last_evict_at.clone() for layer in kvpop_layers(m)]
        pre = m(seq[None], **{CACHE: cache}, use_cache=True).logits
        torch.testing.assert_close(pre, full, atol=1e-5, rtol=1e-5)
        assert all(layer.long_range_positions(0) == _kept(ev[0], 39) for layer, ev in zip(cache.layers, evs))
        with pytest.raises(ValueError, match="oracle-label.*not for decoding"):
            m(seq[None, :1], position_ids=torch.tensor([[40]]), **{CACHE: cache}, use_cache=True)


def test_controls_train_no_scorer():
    """A training forward under a non-learned source leaves no L_score terms (nothing reaches the scorer)."""
    for source in ("random", "keynorm-", "window-attention", "oracle-label"):
        m = _model(source).train()
        ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(7))
        m(ids).logits.sum().backward()
        assert all(layer.loss_terms is None for layer in kvpop_layers(m))
        assert all(p.grad is None for n, p in m.named_parameters() if ".kvpop." in n), source


@pytest.mark.parametrize("source", ["keynorm+", "window-attention"])
def test_left_padded_batch_keeps_what_each_rows_schedule_keeps(source):
    """Rows of different prompt lengths, left-padded, decoded together: each row's long-range slots follow
    the schedule of that row's own teacher-forced sequence (the hooks' ``rows`` take each group's columns)."""
    m = _model(source)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 128, (L,), generator=g) for L in (21, 9, 30)]
    N, L = len(prompts), 30
    ids = torch.zeros(N, L, dtype=torch.long)
    mask = torch.zeros(N, L, dtype=torch.long)
    for n, p in enumerate(prompts):
        ids[n, L - len(p):], mask[n, L - len(p):] = p, 1
    seqs = [p.tolist() for p in prompts]
    cache = kvpop.KVpopCache(m)
    steps = []
    with torch.no_grad():
        out = m(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), **{CACHE: cache},
                use_cache=True).logits
        for _ in range(15):
            nxt = out[:, -1].argmax(-1)
            for n in range(N):
                seqs[n].append(int(nxt[n]))
            mask = torch.cat([mask, torch.ones(N, 1, dtype=torch.long)], 1)
            out = m(nxt[:, None], attention_mask=mask, position_ids=torch.tensor([[len(s) - 1] for s in seqs]),
                    **{CACHE: cache}, use_cache=True).logits
            steps.append([[layer.long_range_positions(n) for n in range(N)] for layer in cache.layers])
        for n in range(N):
            m(torch.tensor([seqs[n]]))
            evs = [layer.last_evict_at[0] for layer in kvpop_layers(m)]
            for j, per_layer in enumerate(steps):
                q = len(prompts[n]) + j
                for li, ev in enumerate(evs):
                    assert per_layer[li][n] == _kept(ev, q), f"{source} row {n} layer {li} q={q}"


def test_oracle_with_the_teachers_label_trains_the_model_only():
    """``oracle-label`` with ``target_source="teacher"``: the training loop runs the teacher for the mask's label
    (no L_score), the model moves, the scorer and the decay do not."""
    from kvpop.training.methods import KVpopMethod
    from kvpop.training.train import TrainConfig, train

    m = kvpop.patch(tiny_model(seed=0), sinks=SINKS, window=WINDOW, budget=BUDGET, priority_source="oracle-label",
                    target_source="teacher")
    assert KVpopMethod(m.kvpop_config).needs_targets()
    assert not KVpopMethod(m.kvpop_config.replace(priority_source="keynorm+")).needs_targets()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    g = torch.Generator().manual_seed(9)
    train(m, [torch.randint(0, 128, (1, 40), generator=g) for _ in range(2)],
          TrainConfig(steps=2, progress=False, lr_model=1e-2))
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any(".kvpop." in n for n in moved)


def test_vllm_plugin_refuses_a_source_it_cannot_serve(tmp_path):
    from kvpop.vllm.settings import resolve

    for src, ok in (("random", True), ("keynorm+", False), ("window-attention", False), ("oracle-label", False)):
        path = tmp_path / f"{src}.safetensors"
        kvpop.save_scorers(_model(src), path)
        if ok:
            assert resolve({"kvpop_scorers": str(path)}).config.priority_source == src
        else:
            with pytest.raises(ValueError, match=re.escape(f"priority_source='{src}'") + ".*KVpopCache"):
                resolve({"kvpop_scorers": str(path)})
