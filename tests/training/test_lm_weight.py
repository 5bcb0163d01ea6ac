"""The next-token NLL beside the KL (``TrainConfig.lm_weight``, ``kvpop train --lm-weight``): the fused NLL equals
the dense cross-entropy forward and backward, the loop records both terms, lowers the NLL, and refuses what would
not use it."""
import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from tiny import SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
from kvpop.cli import main  # noqa: E402
from kvpop.core.distill import next_token_nll  # noqa: E402
from kvpop.training.train import TrainConfig, train  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("B,S,H,V,chunk", [(1, 7, 5, 11, None), (2, 13, 6, 37, 4), (3, 2, 3, 5, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_next_token_nll_is_the_dense_cross_entropy(B, S, H, V, chunk, bias):
    g = torch.Generator().manual_seed(B * 100 + S)
    h = torch.randn(B, S, H, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    ids = torch.randint(0, V, (B, S), generator=g)
    got = next_token_nll(h, w, ids, bias=b, chunk_size=chunk)
    logits = h @ w.t() + (b if bias else 0)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    gg = torch.autograd.grad(got, [h, w] + ([b] if bias else []))
    gw = torch.autograd.grad(want, [h, w] + ([b] if bias else []))
    for x, y in zip(gg, gw):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_next_token_nll_refuses_mismatched_ids():
    with pytest.raises(ValueError, match="positions"):
        next_token_nll(torch.zeros(2, 5, 3), torch.zeros(7, 3), torch.zeros(2, 4, dtype=torch.long))


def _data(n=1, B=2, S=48):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (B, S), generator=g) for _ in range(n)]


def test_lm_weight_records_both_terms_and_lowers_the_nll():
    torch.manual_seed(0)
    m = tiny_model()
    teacher = kvpop.make_teacher(m)
    kvpop.patch(m, **SMALL)
    hist = train(m, _data(), TrainConfig(steps=10, lr_model=3e-3, lr_scorer=1e-2, lm_weight=1.0, progress=False),
                 teacher=teacher)
    assert all({"kl", "nll"} <= set(h) for h in hist)
    assert all(h["kl"] >= 0 and h["nll"] > 0 for h in hist)
    # the tiny model starts near log(V) on random ids; 10 steps on one batch lower its NLL
    assert hist[-1]["nll"] < hist[0]["nll"] - 0.05, [h["nll"] for h in hist]


def test_lm_weight_zero_is_the_kl_alone():
    """lm_weight 0 takes exactly the steps it took before the option existed (no second head pass, no nll)."""
    runs = []
    for lm in (0.0, None):
        torch.manual_seed(0)
        m = tiny_model()
        teacher = kvpop.make_teacher(m)
        kvpop.patch(m, **SMALL)
        cfg = TrainConfig(steps=2, lr_model=3e-3, lr_scorer=1e-2, progress=False,
                          **({} if lm is None else {"lm_weight": lm}))
        runs.append(train(m, _data(), cfg, teacher=teacher))
    assert "nll" not in runs[0][0]
    assert [h["kl"] for h in runs[0]] == [h["kl"] for h in runs[1]]


def test_lm_weight_changes_the_step():
    kls = []
    for lm in (0.0, 5.0):
        torch.manual_seed(0)
        m = tiny_model()
        teacher = kvpop.make_teacher(m)
        kvpop.patch(m, **SMALL)
        kls.append([h["kl"] for h in train(m, _data(), TrainConfig(steps=3, lr_model=3e-3, lr_scorer=1e-2,
                                                                   lm_weight=lm, progress=False), teacher=teacher)])
    assert kls[0][0] == pytest.approx(kls[1][0])  # the first step's KL is measured before any update
    assert kls[0][-1] != pytest.approx(kls[1][-1])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_train_config_refuses_bad_lm_weight(bad):
    with pytest.raises(ValueError, match="lm_weight"):
        TrainConfig(lm_weight=bad)


def test_train_config_refuses_lm_weight_without_model_training():
    with pytest.raises(ValueError, match="lm_weight .* needs train_model=True"):
        TrainConfig(lm_weight=0.5, train_model=False)


def test_cli_lm_weight(tmp_path):
    out = tmp_path / "run"
    base = ["train", "--tiny", "--task", "--seq-len", "64", "--sinks", "2", "--window", "8", "--budget", "24",
            "--no-progress"]
    assert main(base + ["--steps", "2", "--lm-weight", "0.5", "--out", str(out)]) == 0
    hist = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist] == [1, 2] and all(h["nll"] > 0 for h in hist)
    assert json.loads((out / "args.json").read_text())["lm_weight"] == 0.5
    with pytest.raises(SystemExit, match="--lm-weight must be a finite number >= 0, got -1"):
        main(base + ["--steps", "1", "--lm-weight", "-1", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="--no-train-model"):
        main(base + ["--steps", "1", "--lm-weight", "1", "--no-train-model", "--out", str(tmp_path / "b")])
