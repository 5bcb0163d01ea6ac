"""One priority computation for every path (docs/DESIGN.md 2.4, 7): decoding keeps exactly what the
schedule of the teacher-forced forward keeps, bit for bit, also on near-ties."""
import pytest
import torch
from tiny import tiny_model

import kvpop
from kvpop import kvpop_layers
from kvpop.core.priority import ROW_BLOCK, head_linear, priority, to_rows
from kvpop.core.scorers import MLPScorer, MLSTMScorer
from kvpop.models import cache_kwarg_name
from kvpop_kernels import eviction_schedule

CACHE = cache_kwarg_name()


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch, request):
    """The PyTorch CPU path of kvpop_kernels, except in the tests that name the interpreter."""
    if "interpreter" not in request.node.name:
        monkeypatch.setenv("TRITON_INTERPRET", "0")


# ----------------------------------------------------------------------------- the formula
def test_priority_formula_shapes_and_errors():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    lg = -torch.rand(3, generator=g) * 1e-3
    t = torch.arange(5)
    want = r.float() - t.float()[None, None] * lg[None, :, None]
    assert torch.equal(priority(r, t, lg), want) and priority(r, t, lg).dtype == torch.float32
    per_row = torch.stack([t, t + 7])  # [N, S]: per-row positions (a padded batch)
    assert torch.equal(priority(r, per_row, lg)[1], r[1].float() - (t + 7).float()[None] * lg[:, None])
    pos = torch.tensor([4, 9])  # decode: one token per row
    assert torch.equal(priority(r[..., 0], pos, lg), r[..., 0].float() - pos.float()[:, None] * lg[None])
    # a priority does not depend on how many tokens are priced together
    assert torch.equal(priority(r, t, lg)[:, :, 3], priority(r[:, :, 3], torch.tensor([3, 3]), lg))
    with pytest.raises(ValueError, match="log_gamma"):
        priority(r, t, lg[:2])
    with pytest.raises(ValueError, match="t must have shape"):
        priority(r, torch.arange(4), lg)


def test_age_term_at_long_contexts():
    """At t ~ 131K the age term is one float32 product, exact in its inputs (t < 2**24), so every path
    that calls the function gets the same bits; rounding is monotone, so it never reverses an order."""
    lg = torch.tensor([-1.0005e-3])
    t = torch.arange(131_000, 131_072)
    p = priority(torch.zeros(1, 1, 72), t, lg)[0, 0]
    assert torch.equal(p, -(t.float() * lg))
    assert bool((p[1:] >= p[:-1]).all())  # older tokens never rank above newer ones with the same score
    exact = -(t.double() * lg.double())
    assert float((p.double() - exact).abs().max()) <= 131_072 * 1.0005e-3 * 2 ** -24


# ----------------------------------------------------------------------------- scoring in row blocks
def test_rows_roundtrip_and_padding():
    x = torch.randn(3, 2, 5, 7, 4)
    rows, back = to_rows(x)
    assert rows.shape == (2, 112, 4) and rows.shape[1] % ROW_BLOCK == 0
    assert torch.equal(rows[:, 105:], torch.zeros(2, 7, 4))
    assert torch.equal(back(rows), x)
    assert torch.equal(back(rows[..., 0]), x[..., 0])
    one, back1 = to_rows(x[:1, :, 0, 0])  # one token: still a whole block
    assert one.shape == (2, ROW_BLOCK, 4) and torch.equal(back1(one), x[:1, :, 0, 0])
    with pytest.raises(ValueError, match="multiple of"):
        head_linear(torch.zeros(2, 5, 4), torch.zeros(2, 4, 3))


def _skewed_mlp(sc, g, s1=1e-3, b1=20.0, s2=50.0):
    """The review's scorer: tiny first-layer weights, a large bias, large output weights, so that the
    scores of all tokens sit within a few ulps of a large common value (near-ties everywhere)."""
    with torch.no_grad():
        sc.w1.copy_(torch.randn(sc.w1.shape, generator=g) * s1 / sc.w1.shape[1] ** 0.5)
        sc.b1.fill_(b1)
        sc.w2.copy_(torch.randn(sc.w2.shape, generator=g) * s2 / sc.w2.shape[1] ** 0.5)


@pytest.mark.parametrize("heads,dim,hidden", [(2, 32, 128), (3, 20, 20), (1, 7, 5)])
def test_a_tokens_score_does_not_depend_on_how_many_are_scored(heads, dim, hidden):
    """Bitwise: all tokens of all rows at once == each row alone == one token at a time (the decode
    hook's call), for the MLP scorer and the mLSTM scorer's output network."""
    g = torch.Generator().manual_seed(heads * 100 + dim)
    sc = MLPScorer(heads, dim, hidden)
    _skewed_mlp(sc.mlp, g)
    B, S = 3, 37
    k, v = torch.randn(B, heads, S, dim, generator=g), torch.randn(B, heads, S, dim, generator=g)
    with torch.no_grad():
        full = sc(k, v)
        assert torch.equal(torch.cat([sc(k[b:b + 1], v[b:b + 1]) for b in range(B)]), full)
        assert torch.equal(torch.stack([sc(k[:, :, s], v[:, :, s]) for s in range(S)], 2), full)
        assert torch.equal(sc(k[1:2, :, 5], v[1:2, :, 5])[0], full[1, :, 5])
    m = MLSTMScorer(heads, dim, window=4, dim=8, hidden=hidden)
    x = torch.randn(B, heads, S, 2 * dim + 8, generator=g)
    with torch.no_grad():
        full = m.out(x)
        assert torch.equal(torch.stack([m.out(x[:, :, s]) for s in range(S)], 2), full)


# ----------------------------------------------------------------------------- the review's counterexample
SINKS, WINDOW, BUDGET = 2, 8, 14


def _model(scorer="mlp", seed=0, s1=1e-3, b1=20.0, s2=50.0):
    m = kvpop.patch(tiny_model(seed=0), scorer=scorer, sinks=SINKS, window=WINDOW, budget=BUDGET)
    g = torch.Generator().manual_seed(seed)
    for layer in kvpop_layers(m):
        _skewed_mlp(layer.scorer.mlp if scorer == "mlp" else layer.scorer.out, g, s1, b1, s2)
    return m


def _kept(evict_at, q, sinks, window):
    """Per KV head, the long-range tokens the schedule keeps at query ``q`` (docs/DESIGN.md 2.6-2.7)."""
    return [{t for t in range(sinks, q - window + 1) if int(ev[t]) > q} for ev in evict_at]


class _Recorder:
    """Records what the cache's scorer hooks are given (the pre-RoPE keys and values of every prompt
    group and decode step, per layer) and what they return, to re-score each row's whole sequence."""

    def __init__(self, monkeypatch):
        from kvpop.core.hooks import ScorerHooks

        self.prompts, self.steps = [], []
        rows, prompt, leaving, token = ScorerHooks.rows, ScorerHooks.prompt, ScorerHooks._leaving, ScorerHooks._token
        rec = self

        def rows_(hooks, idx, start):
            sub = rows(hooks, idx, start)
            sub.rec_idx = idx.tolist()
            return sub

        def prompt_(hooks, module, layer, key, value):
            rec.prompts.append((hooks.layer.layer_idx, getattr(hooks, "rec_idx", None), hooks.k_pre.clone(),
                                value.clone()))
            return prompt(hooks, module, layer, key, value)

        def step(fn):
            def f(hooks, module, layer, key_new, value_new, pos, i):
                out = fn(hooks, module, layer, key_new, value_new, pos, i)
                rec.steps.append((hooks.layer.layer_idx, hooks._k_pre_at(i).clone(), value_new.clone(), pos.clone(),
                                  out.clone()))
                return out
            return f

        monkeypatch.setattr(ScorerHooks, "rows", rows_)
        monkeypatch.setattr(ScorerHooks, "prompt", prompt_)
        monkeypatch.setattr(ScorerHooks, "_leaving", step(leaving))
        monkeypatch.setattr(ScorerHooks, "_token", step(token))

    def check(self, m, n_rows, kept_steps, prompt_lens):
        """Per row and layer: the scorer over the row's whole sequence, as the cache saw it, gives the
        bits of every priority the decode hooks returned, and the schedule of those priorities keeps,
        at every step, the tokens the cache's long-range slots hold.  Returns the priorities checked."""
        cfg = m.kvpop_config
        s, w = cfg.sinks, cfg.window
        checked = 0
        for li, layer in enumerate(kvpop_layers(m)):
            recurrent = getattr(layer.scorer, "lookahead_uses_window", False)
            for n in range(n_rows):
                k_parts, v_parts = [], []
                for lj, idx, kp, v in self.prompts:
                    if lj == layer.layer_idx and (idx is None or n in idx):
                        j = n if idx is None else idx.index(n)
                        L = prompt_lens[n]
                        k_parts.append(kp[j:j + 1, :, kp.shape[2] - L:])
                        v_parts.append(v[j:j + 1, :, v.shape[2] - L:])
                steps = [st for st in self.steps if st[0] == layer.layer_idx]
                k_all = torch.cat(k_parts + [kp[n:n + 1, :, None] for _, kp, _, _, _ in steps], 2)
                v_all = torch.cat(v_parts + [v[n:n + 1, :, None] for _, _, v, _, _ in steps], 2)
                with torch.no_grad():
                    r = layer.scorer(k_all, v_all)
                p = priority(r, torch.arange(r.shape[-1]), layer.log_gamma())
                for _, _, _, pos, out in steps:
                    t = int(pos[n]) - (w if recurrent else 0)
                    if t >= s:
                        assert torch.equal(out[n], p[0, :, t]), f"row {n} layer {li} token {t}"
                        checked += 1
                ev = eviction_schedule(p, sinks=s, window=w, k=cfg.k)[0]
                for j, per_layer in enumerate(kept_steps):
                    q = prompt_lens[n] + j
                    assert per_layer[li][n] == _kept(ev, q, s, w), (
                        f"row {n} layer {li} q={q}: the cache keeps {per_layer[li][n]}, the schedule of its own "
                        f"keys and values {_kept(ev, q, s, w)}")
        return checked


def _generate_checked(m, prompts, new, cfg, teacher_forced=True):
    """Greedy decoding of left-padded ``prompts`` through one KVpopCache.  With ``teacher_forced``,
    after every step each row's long-range slots must hold exactly what the schedule of that row's
    teacher-forced forward keeps.  Returns (generated rows, cache logits per row, teacher-forced logits
    per row, the cache's long-range sets after every step [step][layer][row][head])."""
    s, w = cfg.sinks, cfg.window
    N, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(N, L, dtype=torch.long)
    mask = torch.zeros(N, L, dtype=torch.long)
    for n, p in enumerate(prompts):
        ids[n, L - len(p):], mask[n, L - len(p):] = p, 1
    cache = kvpop.KVpopCache(m)
    seqs = [list(p.tolist()) for p in prompts]
    steps = []  # per step: the cache's long-range sets of every layer, row, head
    logits = [[] for _ in range(N)]
    with torch.no_grad():
        pid = (mask.cumsum(-1) - 1).clamp_min(0)
        out = m(ids, attention_mask=mask, position_ids=pid, **{CACHE: cache}, use_cache=True).logits
        for n, p in enumerate(prompts):
            logits[n].append(out[n, L - len(p):])
        for _ in range(new):
            nxt = out[:, -1].argmax(-1)
            for n in range(N):
                seqs[n].append(int(nxt[n]))
            mask = torch.cat([mask, torch.ones(N, 1, dtype=torch.long)], 1)
            pid = torch.tensor([[len(sq) - 1] for sq in seqs])
            out = m(nxt[:, None], attention_mask=mask, position_ids=pid, **{CACHE: cache}, use_cache=True).logits
            for n in range(N):
                logits[n].append(out[n])
            steps.append([[layer.long_range_positions(n) for n in range(N)] for layer in cache.layers])
        full = []
        for n in range(N):
            full.append(m(torch.tensor([seqs[n]])).logits[0])
            if not teacher_forced:
                continue
            evs = [layer.last_evict_at[0] for layer in kvpop_layers(m)]
            for j, per_layer in enumerate(steps):
                q = len(prompts[n]) + j
                for li, ev in enumerate(evs):
                    assert per_layer[li][n] == _kept(ev, q, s, w), (f"row {n} layer {li} step q={q}: the cache keeps "
                                                                    f"{per_layer[li][n]}, the schedule "
                                                                    f"{_kept(ev, q, s, w)}")
    return seqs, [torch.cat(x) for x in logits], full, steps


def test_review_counterexample_decode_keeps_what_the_schedule_keeps():
    """The review's case: 50-token prompt, then 40 greedy steps, sinks 2, window 8, budget 14; the old
    per-token scorer call (a matrix-vector product) rounded differently from the full-sequence call, and
    the cache kept other tokens than the mask from step 62 on.  Now every step keeps the same tokens
    and the logits are those of the teacher-forced forward."""
    m = _model()
    prompt = torch.randint(1, 128, (50,), generator=torch.Generator().manual_seed(1))
    cfg = m.kvpop_config
    # a near-tie case: the priorities of a head span a few thousand ulps of their magnitude
    with torch.no_grad():
        m(prompt[None])
    p = kvpop_layers(m)[0].last_priority[0, 0]
    assert float(p.abs().max()) > 100 and float((p.max() - p.min()) / p.abs().max()) < 1e-3
    seqs, dec, full, _ = _generate_checked(m, [prompt], 40, cfg)
    torch.testing.assert_close(dec[0], full[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(dec[0].argmax(-1), full[0].argmax(-1))


# ----------------------------------------------------------------------------- randomised near-tie search
def _near_tie_cases(n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield dict(s1=float(10 ** -torch.empty(()).uniform_(2, 6, generator=g)),
                   b1=float(torch.empty(()).uniform_(-30, 30, generator=g)),
                   s2=float(10 ** torch.empty(()).uniform_(0, 3, generator=g)),
                   seed=int(torch.randint(0, 2 ** 31, (), generator=g)))


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
@pytest.mark.parametrize("case", list(_near_tie_cases(4, seed=21)))
def test_near_tie_search_batched_and_single_rows(case, scorer):
    """Seeded search over skewed scorers (the MLP, or the mLSTM's output network, with chunks of 8:
    near-ties at every rounding level): a left-padded batch of mixed lengths and each row alone keep,
    at every step, what each row's schedule keeps."""
    m = _model(scorer, **case)
    if scorer == "mlstm":
        for layer in kvpop_layers(m):
            layer.scorer.chunk = 8
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(1, 128, (L,), generator=g) for L in (30, 11, 23)]
    cfg = m.kvpop_config
    batched, dec_b, full, _ = _generate_checked(m, prompts, 25, cfg)
    for n, p in enumerate(prompts):
        alone, dec_1, _, _ = _generate_checked(m, [p], 25, cfg)
        assert alone[0] == batched[n]
        torch.testing.assert_close(dec_b[n], full[n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dec_1[0], full[n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_near_tie_search_through_the_interpreter(scorer, monkeypatch):
    """The same checks with the package's default dispatch (the Triton schedule, sparse attention and
    fixed-budget decode kernels, interpreted on a CPU-only machine): the cache keeps what the schedule
    of its own keys and values keeps, and (MLP, near-tie scorer) what the teacher-forced forward keeps."""
    case = next(_near_tie_cases(1, seed=4))
    if scorer == "mlstm":
        case = dict(s1=1.0, b1=0.0, s2=1.0, seed=case["seed"])
    m = _model(scorer, **case)
    if scorer == "mlstm":
        for layer in kvpop_layers(m):
            layer.scorer.chunk = 8
    rec = _Recorder(monkeypatch)
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(1, 128, (L,), generator=g) for L in (20, 13)]
    batched, dec_b, full, steps = _generate_checked(m, prompts, 12, m.kvpop_config, teacher_forced=scorer == "mlp")
    assert rec.check(m, len(prompts), steps, [len(p) for p in prompts]) > 30
    for n in range(len(prompts)):
        torch.testing.assert_close(dec_b[n], full[n], atol=1e-4, rtol=1e-4)


def test_vllm_layout_gives_the_cache_priorities():
    """kvpop.vllm's model prices the ``T`` tokens of a step from ``k_pre, v [T, Hkv, D]`` and their
    positions (``KVpopQwen3Attention.forward``: the scorer on ``[1, Hkv, T, D]``, then ``priority``,
    then ``[T, Hkv]``); the same expression on CPU tensors gives the bits of a full-sequence forward's
    priorities, and of one token at a time (a decode step of vLLM)."""
    m = _model()
    layer = kvpop_layers(m)[0]
    g = torch.Generator().manual_seed(3)
    T, H, D = 37, layer.num_kv_heads, layer.head_dim
    k_pre, v = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    positions = torch.arange(T)

    def vllm_prio(k_pre, v, positions):  # kvpop/vllm/model.py, KVpopQwen3Attention.forward
        r = layer.scorer(k_pre.transpose(0, 1)[None], v.transpose(0, 1)[None])[0]  # [Hkv, T]
        return priority(r[None], positions, layer.log_gamma())[0].transpose(0, 1)

    with torch.no_grad():
        got = vllm_prio(k_pre, v, positions)
        want = layer.priority(layer.scorer(k_pre.transpose(0, 1)[None], v.transpose(0, 1)[None]))[0].T
        assert torch.equal(got, want)
        one = torch.cat([vllm_prio(k_pre[t:t + 1], v[t:t + 1], positions[t:t + 1]) for t in range(T)])
        assert torch.equal(one, got)


# ----------------------------------------------------------------------------- the mLSTM scorer
@pytest.mark.parametrize("chunk,dim", [(128, 64), (16, 64), (10, 16), (5, 64), (7, 8)])
def test_mlstm_decoding_gives_the_bits_of_the_full_sequence_forward(chunk, dim):
    """The mLSTM decodes through the training's chunk function (not the recurrent step, which agrees
    only to rounding): rows prefilled with different prompts (or none) and decoded together at their
    own positions; each token's score when it leaves the window has the bits the chunkwise forward of
    its row alone gives it, across chunk boundaries."""
    g = torch.Generator().manual_seed(chunk * 1000 + dim)
    H, D, w, S = 2, 24, 8, 60
    prefixes = [21, 0, 33, 9]
    B = len(prefixes)
    torch.manual_seed(chunk)
    sc = MLSTMScorer(H, D, w, dim=dim, hidden=24, chunk=chunk)
    k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    with torch.no_grad():
        full = torch.cat([sc(k[b:b + 1], v[b:b + 1]) for b in range(B)])
        states = [sc(k[b:b + 1, :, :P], v[b:b + 1, :, :P], return_state=True)[1] if P else sc.decode_state(1, "cpu")
                  for b, P in enumerate(prefixes)]
        st = tuple(torch.cat(x) for x in zip(*states))
        pos, rows, checked = torch.tensor(prefixes), torch.arange(B), 0
        for _ in range(S - max(prefixes)):
            t = (pos - w).clamp_min(0)
            r = sc.decode_leaving(st, k[rows, :, pos], v[rows, :, pos], pos, k[rows, :, t], v[rows, :, t])
            for b in range(B):
                if pos[b] >= w:
                    assert torch.equal(r[b], full[b, :, t[b]]), (b, int(t[b]))
                    checked += 1
            pos = pos + 1
    assert checked > 80


@pytest.mark.parametrize("scorer", ["mlstm", "mlp"])
@pytest.mark.parametrize("case", [dict(s1=1.0, b1=0.0, s2=1.0, seed=1), dict(s1=0.1, b1=5.0, s2=10.0, seed=2)])
def test_cache_decoding_keeps_what_the_schedule_of_its_own_keys_keeps(scorer, case, monkeypatch):
    """Any scorer (the mLSTM with chunks of 8, so decoding crosses chunk boundaries), a left-padded
    batch: every priority the cache's hooks return has the bits the full-sequence scorer call gives
    the same token, and the long-range slots hold, at every step, what the schedule keeps.  The
    reference is the row's sequence of pre-RoPE keys and values as the cache saw them: the model's own
    layers round differently with a prompt's shapes than with one token's (its logits agree to ~1e-7),
    which is outside the priority computation."""
    m = _model(scorer, **case)
    if scorer == "mlstm":
        for layer in kvpop_layers(m):
            layer.scorer.chunk = 8
    rec = _Recorder(monkeypatch)
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(1, 128, (L,), generator=g) for L in (21, 9, 30, 9)]
    seqs, dec, full, steps = _generate_checked(m, prompts, 20, m.kvpop_config, teacher_forced=False)
    assert rec.check(m, len(prompts), steps, [len(p) for p in prompts]) > 120
    for n in range(len(prompts)):
        torch.testing.assert_close(dec[n], full[n], atol=1e-4, rtol=1e-4)
