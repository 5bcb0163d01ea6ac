"""kvpop.core.budgets: allocate (exact totals, proportional shares, min_k, granularity, errors) and
ablation_importance (shape, sign, determinism, and a head whose slots cannot matter)."""
from fractions import Fraction

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvpop  # noqa: E402
from kvpop import KVpopConfig  # noqa: E402
from kvpop.core.budgets import ablation_importance, allocate, uniform  # noqa: E402


# ------------------------------------------------------------------------------------------ allocate
def _ks(hb, s, w):
    return [[b - s - w for b in row] for row in hb]


def test_exact_proportional_shares():
    # K = 4 * (24 - 10) = 56 slots, scores summing to 7: 8 per unit of score
    hb = allocate(torch.tensor([[1.0, 3.0], [2.0, 1.0]]), total=4 * 24, sinks=2, window=8)
    assert hb == ((18, 34), (26, 18))
    KVpopConfig(sinks=2, window=8, budget=24, head_budgets=hb)  # a valid config


def test_largest_remainder_and_tie_break_by_index():
    # 12 slots, scores 1, 1, 1.5: shares 3.43, 3.43, 5.14 -> floors 3, 3, 5 and the one left to the larger
    # remainder, tied between heads 0 and 1: the lower index
    assert _ks(allocate([[1, 1, 1.5]], total=3 * 5, sinks=0, window=1), 0, 1) == [[4, 3, 5]]
    # 6 slots, scores 1 x 5 and 4: shares 0.67 x 5 and 2.67 -> floors 0 x 5 and 2; the four left go to four of
    # the six equal remainders (0.67), in (layer, head) order
    assert _ks(allocate([[1, 1], [1, 1], [1, 4]], total=6 * 3, sinks=1, window=1), 1, 1) == [[1, 1], [1, 1], [0, 2]]
    # 8 slots, scores 2, 1, 1, 1: shares 3.2, 1.6, 1.6, 1.6 -> 3, 1, 1, 1 and two left: heads 1 and 2
    assert _ks(allocate([[2.0, 1.0, 1.0, 1.0]], total=4 * 3, sinks=0, window=1), 0, 1) == [[3, 2, 2, 1]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("L,H,budget,s,w,min_k,g", [(3, 5, 40, 4, 16, 0, 1), (4, 2, 300, 4, 256, 8, 4),
                                                    (1, 7, 33, 0, 1, 3, 1), (5, 3, 100, 2, 10, 0, 8)])
def test_totals_floor_granularity_and_proportionality(seed, L, H, budget, s, w, min_k, g):
    rng = np.random.default_rng(seed)
    scores = rng.exponential(size=(L, H)) * (rng.random((L, H)) > 0.3)  # some zeros
    hb = allocate(scores, total=L * H * budget, sinks=s, window=w, min_k=min_k, granularity=g)
    ks = np.array(_ks(hb, s, w))
    assert len(hb) == L and all(len(r) == H and all(isinstance(b, int) for b in r) for r in hb)
    assert sum(map(sum, hb)) == L * H * budget
    assert (ks >= min_k).all() and (ks % g == 0).all()
    # against the exact water-filled shares x = max(min_k, c * score): each k within one unit of its share
    K = L * H * (budget - s - w)
    free = np.ones((L, H), bool)
    while True:
        c = (K - min_k * (~free).sum()) / scores[free].sum() if scores[free].sum() > 0 else 0.0
        x = np.where(free, c * scores, min_k)
        newly = free & (x < min_k)
        if not newly.any():
            break
        free &= ~newly
    assert np.all(np.abs(ks - x) < g + 1e-9)
    # proportional above the floor: a larger score never gets fewer slots
    order = np.argsort(scores, axis=None, kind="stable")
    assert np.all(np.diff(ks.flat[order]) >= -g)
    KVpopConfig(sinks=s, window=w, budget=budget, head_budgets=hb)


def test_min_k_floors_the_small_heads_and_keeps_the_rest_proportional():
    # 40 slots, min_k = 4: head scores 0, 1, 1, 8 -> 4, 4, 4 and 28 (c = 3.5 above the floor)
    hb = allocate([[0.0, 1.0], [1.0, 8.0]], total=4 * 10 + 40, sinks=0, window=10, min_k=4)
    assert _ks(hb, 0, 10) == [[4, 4], [4, 28]]
    assert _ks(allocate([[0.0, 1.0], [1.0, 8.0]], total=80, sinks=0, window=10), 0, 10) == [[0, 4], [4, 32]]


def test_all_zero_and_uniform():
    assert allocate(torch.zeros(2, 3), total=6 * 20, sinks=2, window=8) == uniform(2, 3, 20) == ((20,) * 3,) * 2
    assert allocate(torch.full((2, 3), 0.7), total=6 * 20, sinks=2, window=8) == uniform(2, 3, 20)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        uniform(2, 3, 0)
    with pytest.raises(TypeError, match="H must be an int"):
        uniform(2, 3.0, 20)


def test_deterministic_and_exact_with_awkward_floats():
    scores = torch.tensor([[0.1, 0.2, 0.3], [1 / 3, 2 / 3, 1e-30]], dtype=torch.float64)
    a = allocate(scores, total=6 * 50, sinks=4, window=16)
    assert a == allocate(scores.numpy(), total=6 * 50, sinks=4, window=16) == allocate(scores.tolist(), total=300,
                                                                                        sinks=4, window=16)
    assert sum(map(sum, a)) == 300
    # exactness: the shares are rational; a float computation of 0.1 + 0.2 rounds, this one does not
    assert Fraction(0.1) + Fraction(0.2) != Fraction(0.3)


@pytest.mark.parametrize(
    "scores,kw,err,match",
    [
        ([1.0, 2.0], {}, ValueError, r"\[L, H\].*got shape \(2,\)"),
        (np.ones((1, 2, 2)), {}, ValueError, r"\[L, H\].*got shape \(1, 2, 2\)"),
        (np.ones((0, 2)), {}, ValueError, r"got shape \(0, 2\)"),
        ([[1.0, -0.5]], {}, ValueError, r"finite and >= 0, got -0.5 at layer 0, head 1"),
        ([[1.0, float("nan")]], {}, ValueError, r"finite and >= 0, got nan"),
        ([[1.0, float("inf")]], {}, ValueError, r"finite and >= 0, got inf"),
        ([["a", "b"]], {}, TypeError, r"real numbers"),
        (torch.ones(1, 2, dtype=torch.bool), {}, TypeError, r"real \[L, H\] tensor"),
        ([[1.0, 1.0]], {"total": 41}, ValueError, r"multiple of L \* H = 1 \* 2 = 2"),
        ([[1.0, 1.0]], {"total": 2 * 10, "min_k": 1}, ValueError, r"leaves 0 long-range slots .* min_k=1 needs 2"),
        ([[1.0, 1.0]], {"granularity": 3}, ValueError, r"granularity=3 must divide"),
        ([[1.0, 1.0]], {"min_k": 2, "granularity": 4}, ValueError, r"granularity=4 must divide min_k=2"),
        ([[1.0, 1.0]], {"min_k": -1}, ValueError, r"min_k must be >= 0"),
        ([[1.0, 1.0]], {"granularity": 0}, ValueError, r"granularity must be >= 1"),
        ([[1.0, 1.0]], {"total": 40.0}, TypeError, r"total must be an int"),
    ],
)
def test_allocate_bad_input(scores, kw, err, match):
    args = dict(total=2 * 20, sinks=2, window=8)  # 20 long-range slots for two heads
    args.update(kw)
    with pytest.raises(err, match=match):
        allocate(scores, **args)


# ------------------------------------------------------------------------------------- ablation
@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path of the kernels: model-level test


@pytest.fixture(scope="module")
def shipped():
    """The shipped tiny Qwen3 trained on the kvtrace task (reading facts far back), and validation batches."""
    from transformers import AutoModelForCausalLM

    from kvpop.demo import task

    model = AutoModelForCausalLM.from_pretrained(str(task.SHIPPED_MODEL)).eval()
    ids = task.make_batch([task.valid_seed(i) for i in range(2)], 160)["input_ids"]
    return model, [ids[:1], ids[1:]]


CFG = KVpopConfig(sinks=4, window=16, budget=40, mask_source="teacher")


@pytest.fixture(scope="module")
def importance(shipped):
    model, batches = shipped
    model.train()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        imp = ablation_importance(model, batches, config=CFG)
    assert model.training and not kvpop.is_patched(model)  # mode restored, patch removed
    model.eval()
    return imp


def test_ablation_shape_sign_determinism_and_restore(shipped, importance):
    model, batches = shipped
    imp = importance
    assert imp.shape == (2, 2) and imp.dtype == torch.float64
    assert (imp >= 0).all() and torch.isfinite(imp).all()
    assert float(imp.max()) > 0.01  # some head's long-range slots hold the facts this model reads
    # a patched model keeps its own config and scorers; head_budgets in the config are not used
    kvpop.patch(model, sinks=4, window=16, budget=40, head_budgets=((20, 60), (40, 40)))
    try:
        before = {n: p.clone() for n, p in model.state_dict().items() if ".kvpop." in n}
        got = ablation_importance(model, batches, config=CFG.replace(head_budgets=((20, 60), (40, 40))))
        assert torch.equal(got, imp)  # deterministic; with the teacher mask the scorers play no part
        assert kvpop.get_config(model).head_budgets == ((20, 60), (40, 40))
        assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items() if ".kvpop." in n)
        assert all(layer.k_override is None for layer in kvpop.kvpop_layers(model))
    finally:
        kvpop.unpatch(model)
    hb = allocate(imp, total=4 * 40, sinks=4, window=16)
    assert sum(map(sum, hb)) == 160


def test_ablation_budgets_measure_the_exact_label_and_share_the_uniform_total(shipped, importance):
    """``ablation_budgets`` (what ``kvpop train --allocate`` and the demo's retrofits use): the importance under
    the config's label computed exactly (whatever its ``mask_source``), allocated at ``L x H x budget``."""
    from kvpop.core.budgets import ablation_budgets

    model, batches = shipped
    rows, imp = ablation_budgets(model, batches, config=CFG.replace(mask_source="scorer"), min_k=2)
    exact = ablation_importance(model, batches, config=CFG.replace(target_source="teacher"), teacher=model)
    assert torch.equal(imp, exact)
    assert rows == allocate(exact, total=4 * 40, sinks=4, window=16, min_k=2)
    assert not kvpop.is_patched(model)


def test_a_head_with_zero_values_has_no_importance(shipped, importance):
    """Constructed case: with its value projection zeroed, the most important head's output is 0 whatever it
    attends to, so taking its long-range slots away changes nothing."""
    import copy

    model, batches = shipped
    imp = importance
    li, h = divmod(int(imp.argmax()), imp.shape[1])
    m2 = copy.deepcopy(model)
    attn = m2.model.layers[li].self_attn
    D = attn.head_dim
    with torch.no_grad():
        attn.v_proj.weight[h * D:(h + 1) * D] = 0
    imp2 = ablation_importance(m2, batches, config=CFG)
    assert float(imp[li, h]) > 0.01
    assert float(imp2[li, h]) < 1e-6
    assert float(imp2.max()) > 0.0  # the other heads' slots still matter somewhere


def test_ablation_bad_input(shipped):
    model, batches = shipped
    with pytest.raises(TypeError, match="config must be a kvpop.KVpopConfig"):
        ablation_importance(model, batches, config=dict(budget=40))
    with pytest.raises(ValueError, match="batches is empty"):
        ablation_importance(model, [], config=CFG)
    with pytest.raises(ValueError, match=r"token ids \[B, S\].*torch.float32"):
        ablation_importance(model, [batches[0].float()], config=CFG)
    with pytest.raises(TypeError, match="must be a tensor of token ids"):
        ablation_importance(model, [[1, 2, 3]], config=CFG)
    assert not kvpop.is_patched(model)
