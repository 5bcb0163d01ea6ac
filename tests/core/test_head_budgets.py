"""Head-adaptive budgets on the training side: a tiny Qwen3 patched with ``head_budgets`` (per-layer,
per-KV-head ``B[l][h]``; docs/DESIGN.md section 7): the training mask, the score loss's decisions, the
patch checks and scorer checkpoints."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny import SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
from kvpop import KVpopConfig  # noqa: E402
from kvpop_kernels import NEVER, reference  # noqa: E402

S = 64
s, w = SMALL["sinks"], SMALL["window"]  # 2, 8; uniform budget 24 (k = 14)
# per layer, per KV head: budgets 10 (k = 0), 38 (k = 28), 30 (k = 20), 18 (k = 8); total 96 = 2 * 2 * 24
HB = ((10, 38), (30, 18))
KS = tuple(tuple(b - s - w for b in row) for row in HB)


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 128, (2, S), generator=g)


DEFAULT_DISPATCH = ("test_training_mask_through_default_kernels",)


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch, request):
    """The PyTorch CPU path of kvpop_kernels (the kernels' own tests cover the interpreter), except for
    the tests listed in DEFAULT_DISPATCH."""
    if not request.node.name.startswith(DEFAULT_DISPATCH):
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def _record_decisions(monkeypatch):
    """Record every (priority, k, y, bnd) the score loss asks ``eviction_decisions`` for."""
    import kvpop.core.loss as loss_mod

    calls = []
    real = loss_mod.kvpop_kernels.eviction_decisions

    def spy(priority, **kw):
        y, bnd = real(priority, **kw)
        calls.append((priority.detach().clone(), kw["k"], y, bnd))
        return y, bnd

    monkeypatch.setattr(loss_mod.kvpop_kernels, "eviction_decisions", spy)
    return calls


def _check_training_forward(m, ids, monkeypatch):
    calls = _record_decisions(monkeypatch)
    m.train()
    m(ids)
    layers = kvpop.kvpop_layers(m)
    assert len(calls) == len(layers) == 2
    t = torch.arange(S)
    for layer, (p_tgt, k_arg, y, bnd) in zip(layers, calls, strict=True):
        ks = KS[layer.layer_idx]
        assert tuple(k_arg) == ks
        prio, ev = layer.last_priority, layer.last_evict_at
        for h, kh in enumerate(ks):
            # the mask: per head, the uniform schedule with that head's k
            want = reference.eviction_schedule(prio[:, h:h + 1], sinks=s, window=w, k=kh)
            assert torch.equal(ev[:, h:h + 1], want), (layer.layer_idx, h)
            # the loss's decisions: per head, the uniform decisions with that head's k
            y_h, bnd_h = reference.eviction_decisions(p_tgt[:, h:h + 1], sinks=s, window=w, k=kh)
            assert torch.equal(y[:, h:h + 1].cpu(), y_h) and torch.equal(bnd[:, h:h + 1].cpu(), bnd_h)
            if kh == 0:  # sinks + window only: every eligible token leaves at t + w, no decision
                elig = (t >= s) & (t + w <= S - 1)
                assert (ev[:, h, elig] == (t + w)[elig].int()).all() and (ev[:, h, ~elig] == NEVER).all()
                vis = reference.visible_mask(ev[:, h], sinks=s, window=w)
                assert int(vis.sum(-1).max()) == s + w
                assert int((y[:, h] != 0).sum()) == 0
            else:
                assert int((y[:, h] != 0).sum()) == 2 * max(0, S - w - s - kh)
        terms = layer.loss_terms
        assert int(terms["n"]) == 2 * sum(max(0, S - w - s - kh) for kh in ks if kh > 0) > 0
        assert int(terms["n_keep"]) == int((y > 0).sum())
        assert all(torch.isfinite(v).all() for v in terms.values())
    loss = kvpop.score_loss(m)
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    grads = [p.grad for n, p in m.named_parameters() if ".kvpop." in n]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_training_mask_and_decisions_per_head(ids, monkeypatch, scorer):
    m = kvpop.patch(tiny_model(), scorer=scorer, head_budgets=HB, **SMALL)
    _check_training_forward(m, ids, monkeypatch)


def test_training_mask_through_default_kernels(ids, monkeypatch):
    """The same through the package's default dispatch (the Triton interpreter without a GPU)."""
    m = kvpop.patch(tiny_model(), head_budgets=HB, **SMALL)
    _check_training_forward(m, ids, monkeypatch)


def test_streaming_mask_per_head(ids):
    """A constant priority: each head a sink + sliding window of w + k[l][h] tokens."""
    m = kvpop.patch(tiny_model(), mask_source="streaming", head_budgets=HB, **SMALL)
    with torch.no_grad():
        m(ids)
    qq, tt = torch.arange(S).view(S, 1), torch.arange(S).view(1, S)
    for layer in kvpop.kvpop_layers(m):
        vis = reference.visible_mask(layer.last_evict_at, sinks=s, window=w)
        for h, kh in enumerate(KS[layer.layer_idx]):
            assert torch.equal(vis[:, h], ((tt <= qq) & ((tt < s) | (tt > qq - (w + kh)))).expand(2, S, S))


def test_a_sequence_between_the_budgets_still_evicts_on_the_small_heads(monkeypatch):
    """S = 36: above the budgets 10, 30, 18, within 38.  The heads with smaller budgets evict and decide;
    the shortcut "nothing can be evicted" must not take the layer's largest budget."""
    ids = torch.randint(0, 128, (1, 36), generator=torch.Generator().manual_seed(3))
    m = kvpop.patch(tiny_model(), head_budgets=HB, **SMALL).train()
    m(ids)
    l0, l1 = kvpop.kvpop_layers(m)
    assert (l0.last_evict_at[:, 1] == NEVER).all()  # budget 38 >= 36
    assert (l0.last_evict_at[:, 0] < NEVER).any()  # budget 10
    assert (l1.last_evict_at < NEVER).any(-1).all()  # budgets 30, 18
    assert int(l0.loss_terms["n"]) == 0  # k = 0 and k = 28 >= 36 - s - w: no decision in layer 0
    assert int(l1.loss_terms["n"]) == (36 - w - s - 20) + (36 - w - s - 8)


def test_equal_head_budgets_are_the_uniform_model(ids):
    a = kvpop.patch(tiny_model(), **SMALL)
    b = kvpop.patch(tiny_model(), head_budgets=((24, 24), (24, 24)), **SMALL)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert torch.equal(la, lb)
    for x, y in zip(kvpop.kvpop_layers(a), kvpop.kvpop_layers(b), strict=True):
        assert torch.equal(x.last_evict_at, y.last_evict_at)


def test_head_budgets_change_the_mask(ids):
    """Sanity: the per-head budgets reach the mask (against the uniform model with the same scorers)."""
    a = kvpop.patch(tiny_model(), **SMALL)
    b = kvpop.patch(tiny_model(), head_budgets=HB, **SMALL)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        a(ids)
        b(ids)
    (a0, a1), (b0, b1) = kvpop.kvpop_layers(a), kvpop.kvpop_layers(b)
    assert torch.equal(a0.last_priority, b0.last_priority)  # layer 0 sees the same input
    assert not torch.equal(a0.last_evict_at, b0.last_evict_at)
    assert not torch.equal(a1.last_evict_at, b1.last_evict_at)


# ------------------------------------------------------------------------------------- patch checks
def test_patch_rejects_head_budgets_of_another_shape():
    bad_layers = ((24, 24), (24, 24), (24, 24))
    with pytest.raises(ValueError, match=r"head_budgets has 3 rows .* the model has 2 decoder layers"):
        kvpop.patch(tiny_model(), head_budgets=bad_layers, **SMALL)
    bad_heads = ((24, 24, 24), (24, 24, 24))
    with pytest.raises(ValueError, match=r"head_budgets has 2 rows \(layers\) of \[3\] KV heads.*\[2\] KV heads"):
        kvpop.patch(tiny_model(), head_budgets=bad_heads, **SMALL)
    m = tiny_model()
    with pytest.raises(ValueError, match="KV heads"):
        kvpop.patch(m, head_budgets=((24,) * 4, (24,) * 4), **SMALL)
    assert not kvpop.is_patched(m)
    # re-patching a patched model with rows of the wrong shape is refused too, the model unchanged
    m = kvpop.patch(tiny_model(), **SMALL)
    with pytest.raises(ValueError, match="decoder layers"):
        kvpop.patch(m, head_budgets=bad_layers)
    assert kvpop.get_config(m).head_budgets is None


def test_new_budget_needs_new_head_budgets():
    m = kvpop.patch(tiny_model(), head_budgets=HB, **SMALL)
    with pytest.raises(ValueError, match=r"budget=30: the config has head_budgets .*head_budgets=None"):
        kvpop.patch(m, budget=30)
    with pytest.raises(ValueError, match="budget=30: the config has head_budgets"):
        with kvpop.patched(m, budget=30):
            pass
    assert kvpop.get_config(m).head_budgets == HB
    kvpop.patch(m, budget=24)  # the same budget: nothing changes
    assert kvpop.get_config(m).head_budgets == HB
    kvpop.patch(m, budget=30, head_budgets=((30, 30), (20, 40)))
    assert kvpop.get_config(m).layer_budgets(1, 2) == (20, 40)
    kvpop.patch(m, budget=26, head_budgets=None)
    assert kvpop.get_config(m).head_budgets is None and kvpop.get_config(m).budget == 26
    with pytest.raises(ValueError, match="budget=30: the config has head_budgets"):
        kvpop.patch(tiny_model(), KVpopConfig(head_budgets=HB, **SMALL), budget=30)


# ------------------------------------------------------------------------------------- checkpoints
def test_config_json_round_trip_keeps_head_budgets():
    cfg = KVpopConfig(head_budgets=[list(r) for r in HB], **SMALL)  # lists (as JSON gives them) -> tuples
    assert cfg.head_budgets == HB and isinstance(cfg.head_budgets[1], tuple)
    back = KVpopConfig.from_json(cfg.to_json())
    assert back == cfg and back.head_budgets == HB and isinstance(back.head_budgets[0], tuple)
    assert hash(back) == hash(cfg)
    assert back.layer_k(0, 2) == KS[0] and back.layer_k(1, 2) == KS[1]


def test_save_load_round_trip_keeps_head_budgets(tmp_path, ids):
    a = kvpop.patch(tiny_model(), head_budgets=HB, **SMALL)
    scorer_params = [p for n, p in a.named_parameters() if ".kvpop." in n]
    with torch.no_grad():
        torch._foreach_add_(scorer_params, [torch.randn_like(p) for p in scorer_params])  # trained-looking
    path = tmp_path / "scorers.safetensors"
    kvpop.save_scorers(a, path)
    saved = kvpop.read_scorer_config(path)
    assert saved == kvpop.get_config(a) and saved.head_budgets == HB
    b = kvpop.load_scorers(tiny_model(), path)  # unpatched: patched with the file's config
    assert kvpop.get_config(b).head_budgets == HB
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert torch.equal(la, lb)
    for x, y in zip(kvpop.kvpop_layers(a), kvpop.kvpop_layers(b), strict=True):
        assert torch.equal(x.last_evict_at, y.last_evict_at)
    # a model of another shape: refused before anything is attached
    c = tiny_model(num_key_value_heads=4)
    with pytest.raises(ValueError, match="head_budgets has 2 rows"):
        kvpop.load_scorers(c, path)
    assert not kvpop.is_patched(c)


# ------------------------------------------------------------------------------------- the training loop
def test_train_with_head_budgets_checkpoints_and_resumes(tmp_path):
    """kvpop.training.train on a model with head_budgets: the score loss falls, the checkpoint's scorer file
    carries the rows, and a resumed run (the same rows) repeats the uninterrupted one's last step."""
    from kvpop.training.train import TrainConfig, train

    data = [torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    cfg = TrainConfig(steps=3, lr_model=1e-3, lr_scorer=3e-2, progress=False)

    def fresh():
        m = tiny_model()
        t = kvpop.make_teacher(m)
        torch.manual_seed(11)
        return kvpop.patch(m, head_budgets=HB, **SMALL), t

    m_full, t_full = fresh()
    full = train(m_full, data, cfg, teacher=t_full)
    # decisions per row: layer 0 heads k = 0, 28 -> 0, 48-10-28; layer 1 k = 20, 8 -> 48-10-20, 48-10-8
    assert all(h["decisions"] == 2 * (10 + 18 + 30) and h["score"] == h["score"] for h in full)
    m_a, t_a = fresh()
    train(m_a, data, cfg, teacher=t_a, steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    assert kvpop.read_scorer_config(tmp_path / "scorers.safetensors").head_budgets == HB
    m_b, t_b = fresh()
    rest = train(m_b, data, cfg, teacher=t_b, checkpoint_dir=str(tmp_path), resume=True)
    assert [h["step"] for h in rest] == [3]
    assert rest[0]["score"] == pytest.approx(full[2]["score"], rel=1e-5, abs=1e-7)
