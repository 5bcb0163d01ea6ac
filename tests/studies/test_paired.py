"""studies.paired: the paired bootstrap interval against cases with a known answer and against a
brute-force computation of the same replicates by explicit loops."""
import numpy as np
import pytest

from studies.paired import bootstrap_draws, comparison, paired_interval, verdict


def test_identical_rows_give_zero():
    rng = np.random.default_rng(0)
    a = rng.normal(size=17)
    r = paired_interval(a, a.copy(), clusters=[i % 4 for i in range(17)], n_boot=500)
    assert r.mean_diff == 0.0 and r.ci95 == (0.0, 0.0) and not r.excludes_zero
    seeds = rng.normal(size=(3, 17))
    r = paired_interval(seeds, seeds.copy(), n_boot=500, pair_seeds=True)
    assert r.mean_diff == 0.0 and r.ci95 == (0.0, 0.0)


@pytest.mark.parametrize("seeds", [1, 3])
def test_a_constant_shift_gives_that_shift(seeds):
    rng = np.random.default_rng(1)
    b = rng.normal(size=(seeds, 23)) * 5
    r = paired_interval(b - 0.25, b, clusters=[f"file{i % 6}" for i in range(23)], n_boot=400, pair_seeds=True)
    assert r.mean_diff == pytest.approx(-0.25, abs=1e-12)
    assert r.ci95 == pytest.approx((-0.25, -0.25), abs=1e-12) and r.excludes_zero
    assert (r.n_sequences, r.n_clusters, r.seeds_a, r.seeds_b) == (23, 6, seeds, seeds)


def test_two_clusters_known_distribution():
    """One seed, clusters x = {0, 1} and y = {2}: a replicate draws (x, x), (y, y) or a mix, each of the
    first two with probability 1/4, so the 2.5 / 97.5 percentiles are those two outcomes exactly."""
    d = np.array([1.0, 3.0, -5.0])
    r = paired_interval(d, np.zeros(3), clusters=["x", "x", "y"], n_boot=4000, seed=3)
    assert r.mean_diff == pytest.approx(-1 / 3)
    assert r.ci95 == (-5.0, 2.0)


def test_against_brute_force_loops():
    rng = np.random.default_rng(2)
    n = 11
    clusters = ["c", "a", "a", "b", "e", "c", "c", "d", "b", "a", "e"]
    a = rng.normal(size=(3, n))
    b = rng.normal(size=(2, n)) + 0.3
    r = paired_interval(a, b, clusters=clusters, n_boot=300, seed=9)
    names = sorted(set(clusters))  # the function's cluster order: sorted ids
    members = {c: [i for i, x in enumerate(clusters) if x == c] for c in names}
    cl, sa, sb = bootstrap_draws(len(names), 3, 2, n_boot=300, seed=9, pair_seeds=False)
    reps = []
    for rep in range(300):
        seqs = [i for c in cl[rep] for i in members[names[c]]]
        ma = sum(sum(a[s, i] for i in seqs) / len(seqs) for s in sa[rep]) / 3
        mb = sum(sum(b[s, i] for i in seqs) / len(seqs) for s in sb[rep]) / 2
        reps.append(ma - mb)
    lo, hi = np.quantile(reps, [0.025, 0.975])
    assert r.ci95 == pytest.approx((lo, hi), abs=1e-12)
    assert r.mean_diff == pytest.approx(a.mean() - b.mean())
    assert paired_interval(a, b, clusters=clusters, n_boot=300, seed=9) == r  # seeded: reproducible
    assert paired_interval(a, b, clusters=clusters, n_boot=300, seed=10).ci95 != r.ci95


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="same sequences"):
        paired_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="not finite"):
        paired_interval([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="one id per sequence"):
        paired_interval([1.0, 2.0], [1.0, 2.0], clusters=["x"])
    with pytest.raises(ValueError, match="pair_seeds needs"):
        paired_interval([[1.0], [2.0]], [1.0], pair_seeds=True)
    with pytest.raises(ValueError, match="n_boot"):
        paired_interval([1.0], [1.0], n_boot=0)
    assert paired_interval([1.0, 2.0], [0.0, 0.0]).to_dict()["ci95"][0] >= 1.0


def test_comparison_entry_and_verdict():
    b = np.linspace(0.0, 1.0, 12)
    c = comparison(instrument="realtext", budget=128, a="kvpop", b="control", values_a=b - 0.1, values_b=b,
                   lower_is_better=True, clusters=[i // 3 for i in range(12)], n_boot=200)
    assert (c["instrument"], c["budget"], c["a"], c["b"]) == ("realtext", 128, "kvpop", "control")
    assert c["mean_diff"] == pytest.approx(-0.1) and c["verdict"] == "a better" and c["n_clusters"] == 4
    assert verdict({"ci95": [-0.2, -0.1]}, lower_is_better=False) == "b better"
    assert verdict({"ci95": [0.1, 0.2]}, lower_is_better=False) == "a better"
    assert verdict({"ci95": [-0.1, 0.2]}, lower_is_better=True) == "no difference shown"
