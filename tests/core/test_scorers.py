"""KVpopConfig validation and the two scorers (MLP; mLSTM chunkwise == recurrent, lookahead rule)."""
import pytest
import torch

from kvpop import KVpopConfig, MLPScorer, MLSTMScorer, build_scorer


# ----------------------------------------------------------------------------- config
def test_config_defaults_and_k():
    c = KVpopConfig()
    assert (c.sinks, c.window, c.budget, c.scorer) == (4, 256, 2048, "mlp")
    assert c.k == 2048 - 4 - 256
    assert KVpopConfig(sinks=2, window=8, budget=11).k == 1


@pytest.mark.parametrize("budget", [0, 5, 10])
def test_config_budget_too_small(budget):
    with pytest.raises(ValueError, match=r"sinks \+ window \+ 1"):
        KVpopConfig(sinks=2, window=8, budget=budget)


def test_config_bad_values():
    with pytest.raises(ValueError, match=r"\['mlp', 'mlstm'\]"):
        KVpopConfig(scorer="lstm")
    with pytest.raises(ValueError, match="mask_source"):
        KVpopConfig(mask_source="oracle")
    with pytest.raises(ValueError, match="target_lse"):
        KVpopConfig(target_lse="exact")
    with pytest.raises(ValueError, match="gamma_init"):
        KVpopConfig(gamma_init=0.5)
    with pytest.raises(ValueError, match="tau"):
        KVpopConfig(tau=0)
    with pytest.raises(TypeError, match="window"):
        KVpopConfig(window=8.0)
    with pytest.raises(TypeError, match="unknown KVpopConfig field"):
        KVpopConfig().replace(bugdet=4096)


def test_config_json_roundtrip_and_structure():
    c = KVpopConfig(sinks=2, window=8, budget=24, scorer="mlstm", tau=0.5)
    assert KVpopConfig.from_json(c.to_json()) == c
    assert c.structural_mismatch(c.replace(budget=100, tau=2.0)) == []
    assert c.structural_mismatch(c.replace(window=4)) == ["window"]
    assert "scorer" in c.structural_mismatch(c.replace(scorer="mlp"))
    with pytest.raises(ValueError, match="unknown"):
        KVpopConfig.from_dict({**c.to_dict(), "nope": 1})


# ----------------------------------------------------------------------------- MLP
def test_mlp_scorer_shapes_and_tokenwise():
    sc = MLPScorer(3, 16, hidden=32)
    k, v = torch.randn(2, 3, 11, 16), torch.randn(2, 3, 11, 16)
    r = sc(k, v)
    assert r.shape == (2, 3, 11) and r.dtype == torch.float32
    r5 = sc.score_token(None, k[:, :, 5], v[:, :, 5])
    torch.testing.assert_close(r5, r[:, :, 5], atol=1e-6, rtol=1e-6)
    # heads are independent: changing head 1's input changes only head 1's scores
    k2 = k.clone()
    k2[:, 1] += 1.0
    r2 = sc(k2, v)
    assert torch.equal(r2[:, 0], r[:, 0]) and torch.equal(r2[:, 2], r[:, 2])
    assert not torch.allclose(r2[:, 1], r[:, 1])
    # bf16 inputs are scored in float32
    assert sc(k.bfloat16(), v.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="Hkv=3"):
        sc(torch.randn(2, 4, 11, 16), torch.randn(2, 4, 11, 16))


# ----------------------------------------------------------------------------- mLSTM
def _lively(sc):
    # make the gates matter (default init keeps them nearly constant)
    with torch.no_grad():
        sc.wi.normal_(0, 0.5)
        sc.wf.normal_(0, 0.5)
        sc.bf.uniform_(0.0, 3.0)
    return sc


def _recurrent_scores(sc, k, v):
    B, H, S, D = k.shape
    w = sc.window
    st = sc.init_state(B, k.device)
    out = torch.full((B, H, S), float("nan"))
    for a in range(S):
        st = sc.step(st, k[:, :, a], v[:, :, a])
        t = a - w  # t leaves the window at a = t + w: score it now
        if t >= 0:
            out[:, :, t] = sc.score_token(st, k[:, :, t], v[:, :, t])
    for t in range(max(0, S - w), S):  # still in the window at the end: read the last state
        out[:, :, t] = sc.score_token(st, k[:, :, t], v[:, :, t])
    return out


@pytest.mark.parametrize("S,w,chunk", [(1, 3, 4), (5, 8, 4), (17, 4, 4), (37, 8, 16), (63, 16, 128), (40, 40, 7)])
def test_mlstm_chunkwise_equals_recurrent(S, w, chunk):
    sc = _lively(MLSTMScorer(2, 16, w, dim=8, hidden=16, chunk=chunk))
    k, v = torch.randn(2, 2, S, 16), torch.randn(2, 2, S, 16)
    r_par = sc(k, v)
    r_rec = _recurrent_scores(sc, k, v)
    assert not torch.isnan(r_par).any()
    torch.testing.assert_close(r_par, r_rec, atol=1e-4, rtol=1e-4)


def test_mlstm_chunk_invariance_and_gradients():
    S, w = 50, 6
    k, v = torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    a = _lively(MLSTMScorer(2, 16, w, dim=8, hidden=16, chunk=7))
    b = MLSTMScorer(2, 16, w, dim=8, hidden=16, chunk=128)
    b.load_state_dict(a.state_dict())
    ra, rb = a(k, v), b(k, v)
    torch.testing.assert_close(ra, rb, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(ra)
    (ra * g).sum().backward()
    (rb * g).sum().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pa.grad is not None and torch.isfinite(pa.grad).all(), n
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-3, rtol=1e-3)
    assert a.wf.grad.abs().sum() > 0 and a.wi.grad.abs().sum() > 0


def test_mlstm_reads_exactly_up_to_t_plus_w():
    S, w, t = 30, 5, 7
    sc = _lively(MLSTMScorer(1, 8, w, dim=8, hidden=16, chunk=8))
    k, v = torch.randn(1, 1, S, 8), torch.randn(1, 1, S, 8)
    r = sc(k, v)
    k2 = k.clone()
    k2[:, :, t + w + 1] += 3.0  # after the read-out position of t: no effect on r[t]
    assert torch.equal(sc(k2, v)[..., : t + 1], r[..., : t + 1])
    k3 = k.clone()
    k3[:, :, t + w] += 3.0  # the read-out position itself: r[t] changes
    assert not torch.allclose(sc(k3, v)[..., t], r[..., t])


def test_build_scorer():
    assert isinstance(build_scorer(KVpopConfig(sinks=1, window=4, budget=8), 2, 8), MLPScorer)
    m = build_scorer(KVpopConfig(sinks=1, window=4, budget=8, scorer="mlstm", mlstm_dim=4), 2, 8)
    assert isinstance(m, MLSTMScorer) and m.window == 4 and m.dim == 4


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_scorers_and_score_loss_run_in_float32_under_autocast(scorer):
    """Under bf16 autocast (CPU autocast here, the same switch as CUDA's) the scorer's matmuls stay float32:
    the output is float32 and equals the output without autocast; so is L_score."""
    from kvpop import score_loss_terms

    torch.manual_seed(0)
    sc = build_scorer(KVpopConfig(scorer=scorer, window=4, budget=16, scorer_hidden=32, mlstm_dim=16), 2, 32)
    if scorer == "mlstm":
        _lively(sc)
    k, v = torch.randn(1, 2, 23, 32), torch.randn(1, 2, 23, 32)
    ref = sc(k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = sc(k, v)
        bf16_matmul = (k @ v.transpose(-1, -2)).dtype  # autocast is really on here
    assert bf16_matmul == torch.bfloat16
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    if scorer == "mlstm":
        st = sc.init_state(1, "cpu")
        st_ref = sc.step(st, k[:, :, 0], v[:, :, 0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            st_ac = sc.step(st, k[:, :, 0], v[:, :, 0])
            tok = sc.score_token(st_ac, k[:, :, 0], v[:, :, 0])
        for a, b in zip(st_ac, st_ref):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(tok, sc.score_token(st_ref, k[:, :, 0], v[:, :, 0]), atol=0, rtol=0)
    r_tgt, lg = torch.randn(1, 2, 23), torch.log(torch.tensor([0.999, 0.9999]))
    args = dict(sinks=1, window=4, k=3)
    want = score_loss_terms(ref, r_tgt, lg, **args)["loss_sum"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        have = score_loss_terms(got, r_tgt, lg, **args)["loss_sum"]
    assert have.dtype == torch.float32
    torch.testing.assert_close(have, want, atol=0, rtol=0)
