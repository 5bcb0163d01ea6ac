"""Issue 61 item 3: the seed-level check (a t-interval over the per-seed mean differences) against a hand
computation, "borderline" where a bound lies within 0.0005 of 0, a split's scoring history from its test logs, and
the claims table read from records (a tiny synthetic set of them)."""
import json
import math

import pytest

from studies import claims as C
from studies.paired import BORDERLINE, seed_t_interval, strength, t_quantile


@pytest.mark.parametrize("df,want", [(1, 12.706204736), (2, 4.302652730), (4, 2.776445105), (30, 2.042272456)])
def test_t_quantile_is_students(df, want):
    """The 97.5 % quantiles of Student's t (the printed tables' values)."""
    assert t_quantile(0.975, df) == pytest.approx(want, abs=2e-6)


def test_seed_t_interval_by_hand():
    """Per-seed means a = (0.10, 0.14, 0.12), b = (0.11, 0.11, 0.11): differences (-0.01, +0.03, +0.01), mean
    0.01, sample sd 0.02, half width 4.302653 * 0.02 / sqrt(3) = 0.049683."""
    r = seed_t_interval([0.10, 0.14, 0.12], [0.11, 0.11, 0.11])
    assert r["mean_diff"] == pytest.approx(0.01) and r["sd"] == pytest.approx(0.02) and r["n_seeds"] == 3
    half = 4.302652730 * 0.02 / math.sqrt(3)
    assert r["ci95"] == pytest.approx([0.01 - half, 0.01 + half], abs=1e-8)
    # a deterministic row (one seed) is subtracted from every seed of the other; paired seeds go seed by seed
    assert seed_t_interval([0.10, 0.14, 0.12], [0.11])["ci95"] == pytest.approx(r["ci95"])
    assert seed_t_interval([0.11], [0.10, 0.14, 0.12])["mean_diff"] == pytest.approx(-0.01)
    assert seed_t_interval([0.1], [0.2]) is None  # one difference: no spread to read
    with pytest.raises(ValueError, match="do not pair"):
        seed_t_interval([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="finite"):
        seed_t_interval([1, float("nan")], [1, 2])


def test_strength_says_borderline_within_the_margin():
    assert strength([0.0001, 0.014], lower_is_better=True) == "b better (borderline)"
    assert strength([-0.0140, -0.0005], lower_is_better=True) == "a better (borderline)"
    assert strength([-0.0140, -0.0006], lower_is_better=True) == "a better"
    assert strength([-0.0002, 0.01], lower_is_better=True) == "no difference shown (borderline)"
    assert strength([-0.01, 0.01], lower_is_better=False) == "no difference shown"
    assert strength([0.002, 0.01], lower_is_better=False) == "a better" and BORDERLINE == 0.0005


def _record(tmp_path, name, split, date, figures, comparisons):
    (tmp_path / f"{name}.json").write_text(json.dumps({"split": split, "figures": figures,
                                                       "comparisons": comparisons}))
    (tmp_path / f"{name}_log.jsonl").write_text(json.dumps({"key": "x", "result": 0, "date": date}) + "\n")
    return C.Source(name, f"{name}.json", (), f"{name}_log.jsonl")


def _fig(row, budget, seeds):
    return {"row": row, "budget": budget, "vs_original": {str(i): v for i, v in enumerate(seeds)},
            "vs_same_weights": {str(i): v for i, v in enumerate(seeds)}}


def _comp(a, b, budget, lo, hi, mean):
    return {"a": a, "b": b, "budget": budget, "mean_diff": mean, "ci95": [lo, hi], "reference": "original",
            "lower_is_better": True}


def test_claims_from_records(tmp_path):
    """Two studies on split s1 (the later one is "scored again"), one on s2; a comparison's seed check is the
    t-interval of the two rows' per-seed figures; the table names the history and every budget."""
    figs = [_fig("k", b, [0.10, 0.14, 0.12]) for b in (64, 128)] + [_fig("r", b, [0.11, 0.11, 0.11])
                                                                   for b in (64, 128)]
    first = _record(tmp_path, "first", "s1", "2026-01-01 00:00:00 UTC", figs,
                    [_comp("k", "r", 64, 0.0001, 0.02, 0.01), _comp("k", "r", 128, -0.03, -0.01, -0.02)])
    later = _record(tmp_path, "later", "s1", "2026-01-02 00:00:00 UTC", figs, [_comp("r", "k", 64, -0.02, 0.0, -0.01)])
    other = _record(tmp_path, "other", "s2", "2026-01-03 00:00:00 UTC", figs, [_comp("k", "r", 64, -0.1, 0.1, 0.0)])
    loaded = C.load_sources(tmp_path, (later, first, other))
    assert C.split_history(loaded)["s1"] == [("2026-01-01 00:00:00 UTC", "first"), ("2026-01-02 00:00:00 UTC", "later")]
    cl = {(c["study"], c["a"], c["budget"]): c for c in C.claims(loaded)}
    c = cl[("first", "k", 64)]
    assert c["history"] == "scored first; scored again by later" and c["strength"] == "b better (borderline)"
    assert c["seeds"]["ci95"] == pytest.approx(seed_t_interval([0.10, 0.14, 0.12], [0.11] * 3)["ci95"])
    assert cl[("later", "r", 64)]["history"] == "scored again, after first"
    assert cl[("other", "k", 64)]["history"] == "scored once"
    assert cl[("first", "k", 128)]["strength"] == "a better"
    table = C.render(C.claims(loaded), [("s1", "k", "r", "k - r")])
    line = table.splitlines()[2]
    assert line.startswith("| `s1` (scored first; scored again by later) | k - r | +0.0100 [+0.0001, +0.0200] b better "
                           "(borderline); seeds [")
    assert "-0.0200 [-0.0300, -0.0100] a better; seeds" in line
    with pytest.raises(ValueError, match="no comparison"):
        C.render(C.claims(loaded), [("s9", "k", "r", "x")])


def test_shipped_readme_pairs_are_in_the_records():
    """Every line the README's claims block shows exists at every budget in the shipped records, with its seed
    check (3 seeds on each side)."""
    cl = {(c["split"], c["a"], c["b"], c["budget"]): c for c in C.claims(C.load_sources())}
    for split, a, b, _ in C.README_PAIRS:
        for bud in (64, 128, 256):
            assert cl[(split, a, b, bud)]["seeds"]["n_seeds"] == 3, (split, a, b, bud)


def test_update_claims_replaces_only_the_block(tmp_path):
    readme = tmp_path / "R.md"
    readme.write_text(f"before\n{C.CLAIMS_START}\nold\n{C.CLAIMS_END}\nafter\n")
    assert C.update_claims(readme)
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith(f"{C.CLAIMS_END}\nafter\n") and "\nold\n" not in text
    assert not C.update_claims(readme)
    readme.write_text("no block\n")
    with pytest.raises(ValueError, match="no claims block"):
        C.update_claims(readme)


def test_cli_refuses_the_shipped_readme_without_write_shipped(capsys):
    assert C.main(["readme"]) == 2 and "--write-shipped" in capsys.readouterr().err
    from studies.paths import README_FILE

    assert C.main(["readme", "--readme", str(README_FILE)]) == 2
    assert "add --write-shipped" in capsys.readouterr().err


def test_evidence_readme_command_regenerates_the_claims_block(tmp_path, capsys):
    """``python -m studies.evidence readme`` rewrites a README's claims block beside its ledger block."""
    from studies import evidence as E
    from studies import ledger as V

    readme = tmp_path / "R.md"
    readme.write_text(f"{V.README_START}\nold\n{V.README_END}\nx\n{C.CLAIMS_START}\nold\n{C.CLAIMS_END}\n")
    assert E.main(["readme", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "\nold\n" not in text and C.readme_block() in text


def test_headline_table_shows_kvtraces_key_norm_row():
    """Issue 61 item 3: kvtrace's table in the README shows the key-norm fine-tune of the fresh split beside KVpop's
    row of that split; every other row of that split stays out of the headline table."""
    from studies import ledger as V

    ev = {"rows": V.read_ledger(V.EVIDENCE_FILE)}
    table = V.render_headline(ev).split("**lookahead**")[0]
    assert "| fixed-finetune[keynorm] on test_fresh2 | 1.000 (1.000 .. 1.000) |" in table
    assert "| kvpop-mlp-joint[paper, trained at B=40, lr 1e-2] on test_fresh2 |" in table
    assert "fixed-finetune[random] on test_fresh2" not in table


def test_results_document_holds_every_pair():
    """evidence.md's round-five block is every comparison of every real-text study, as the records give them."""
    from studies.paths import RESULTS_DIR

    text = (RESULTS_DIR / "evidence.md").read_text(encoding="utf-8")
    block = text.split(C.CLAIMS_ALL_START, 1)[1].split(C.CLAIMS_ALL_END, 1)[0]
    assert block == "\n" + C.render(C.claims(C.load_sources())), (
        "regenerate: python -m studies.claims readme --readme studies/results/evidence.md --write-shipped")


def test_update_claims_fills_both_blocks(tmp_path):
    f = tmp_path / "E.md"
    f.write_text(f"{C.CLAIMS_ALL_START}\nold\n{C.CLAIMS_ALL_END}\nmid\n{C.CLAIMS_START}\nold\n{C.CLAIMS_END}\n")
    assert C.update_claims(f)
    text = f.read_text()
    assert C.render(C.claims(C.load_sources())) in text and C.readme_block() in text and "\nold\n" not in text
