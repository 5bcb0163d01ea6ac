"""L_score terms against a literal loop over docs/DESIGN.md's decisions (the KL: tests/core/test_distill.py)."""
import math

import pytest
import torch

from kvpop import score_loss_terms
from kvpop_kernels import reference


def _brute_loss(r_hat, r_tgt, log_gamma, sinks, window, k, tau, tie_margin, balance):
    """Literal statement: decisions from the reference, omega = tie * class balance, mean over decisions."""
    S = r_hat.shape[-1]
    t = torch.arange(S, dtype=torch.float64)
    lg = log_gamma.double()
    p_tgt = r_tgt.double() - t * lg[:, None]
    y, bnd = reference.eviction_decisions(p_tgt, sinks=sinks, window=window, k=k)
    items = []
    for b in range(r_hat.shape[0]):
        for h in range(r_hat.shape[1]):
            for tt in range(S):
                yy = int(y[b, h, tt])
                if yy == 0:
                    continue
                u = int(bnd[b, h, tt])
                delta = (r_hat[b, h, tt] - r_hat[b, h, u]).double() + (u - tt) * lg[h]
                margin = abs(float(p_tgt[b, h, tt] - p_tgt[b, h, u]))
                tie = 1 - math.exp(-margin / tie_margin) if tie_margin > 0 else 1.0
                items.append((yy, tie, torch.nn.functional.softplus(-yy * delta / tau)))
    n = len(items)
    n_keep = sum(1 for it in items if it[0] > 0)
    n_drop = n - n_keep
    total = 0.0
    for yy, tie, sp in items:
        bal = 1.0
        if balance and n_keep and n_drop:
            bal = n / (2 * n_keep) if yy > 0 else n / (2 * n_drop)
        total = total + tie * bal * sp
    return total, n, n_keep


@pytest.mark.parametrize("balance,tie_margin", [(True, 0.5), (False, 0.0), (True, 0.0)])
@pytest.mark.parametrize("S,sinks,window,k", [(40, 2, 5, 3), (17, 0, 4, 1), (9, 4, 8, 2)])
def test_score_loss_terms_matches_brute_force(S, sinks, window, k, balance, tie_margin):
    B, H = 2, 3
    r_hat = torch.randn(B, H, S, requires_grad=True)
    r_tgt = torch.randn(B, H, S)
    log_gamma = torch.log(torch.tensor([0.999, 0.9995, 0.99999])).requires_grad_(True)
    out = score_loss_terms(r_hat, r_tgt, log_gamma, sinks=sinks, window=window, k=k, tau=0.7,
                           tie_margin=tie_margin, balance=balance)
    exp_sum, n, n_keep = _brute_loss(r_hat.detach(), r_tgt, log_gamma.detach(), sinks, window, k, 0.7,
                                     tie_margin, balance)
    assert int(out["n"]) == n and int(out["n_keep"]) == n_keep
    assert n == B * H * max(0, S - window - sinks - k)  # one decision per token t in [s+k, S-1-w]
    torch.testing.assert_close(out["loss_sum"].double(), torch.as_tensor(exp_sum, dtype=torch.float64),
                               atol=1e-5, rtol=1e-5)
    if n:
        out["loss_sum"].backward()
        assert r_hat.grad.abs().sum() > 0
        assert log_gamma.grad is not None and torch.isfinite(log_gamma.grad).all()


def test_balance_gives_each_class_half_the_weight():
    torch.manual_seed(1)
    r_hat, r_tgt = torch.zeros(1, 2, 60), torch.randn(1, 2, 60)
    lg = torch.full((2,), math.log(0.9999))
    out = score_loss_terms(r_hat, r_tgt, lg, sinks=1, window=4, k=3, tie_margin=0.0, balance=True)
    n, n_keep = int(out["n"]), int(out["n_keep"])
    assert 0 < n_keep < n
    torch.testing.assert_close(out["weight_sum"], torch.tensor(float(n)))


def test_near_ties_get_no_weight():
    # the teacher sees exact ties (constant target, no decay): every decision has margin 0
    r_hat = torch.randn(1, 1, 30, requires_grad=True)
    out = score_loss_terms(r_hat, torch.zeros(1, 1, 30), torch.zeros(1), sinks=0, window=3, k=2, tie_margin=0.5)
    assert int(out["n"]) > 0
    assert float(out["weight_sum"]) == 0.0 and float(out["loss_sum"].detach()) == 0.0


def test_loss_pushes_delta_the_teacher_way():
    # one step of gradient descent on r_hat moves every decided delta towards y
    torch.manual_seed(2)
    r_hat = torch.randn(1, 2, 50, requires_grad=True)
    r_tgt = torch.randn(1, 2, 50)
    lg = torch.zeros(2)
    out = score_loss_terms(r_hat, r_tgt, lg, sinks=2, window=4, k=5, tie_margin=0.0, balance=False)
    out["loss_sum"].backward()
    loss0 = float(out["loss_sum"].detach())
    with torch.no_grad():
        r2 = r_hat - 0.1 * r_hat.grad
    loss1 = float(score_loss_terms(r2, r_tgt, lg, sinks=2, window=4, k=5, tie_margin=0.0, balance=False)["loss_sum"])
    assert loss1 < loss0
