"""studies.equal_bytes: the budget search at equal bytes, a whole run on a small instrument (the shipped tiny
code model under StreamingLLM, short random sequences), its resumption without a second scoring, the byte check and
the refusals."""
import copy
import json

import pytest
import torch

from studies import equal_bytes as Q


def test_largest_budget_is_the_last_that_fits():
    seen = []

    def at(b):
        seen.append(b)
        return 100.0 + 10 * b

    assert Q.largest_budget(at, 100.0 + 10 * 37 + 5, 10, 64) == (37, 470.0)
    assert len(seen) < 12  # a binary search, not a scan of 55 budgets
    assert Q.largest_budget(at, 100.0 + 10 * 64, 10, 64) == (64, 740.0)  # the whole range fits
    assert Q.largest_budget(at, 200.0, 10, 64) == (10, 200.0)  # only the smallest fits
    with pytest.raises(ValueError, match="even the smallest budget 10"):
        Q.largest_budget(at, 199.0, 10, 64)
    with pytest.raises(ValueError, match="empty range"):
        Q.largest_budget(at, 1e9, 5, 4)


class Tiny(Q.Instrument):
    """The shipped tiny code model under StreamingLLM at a small budget, short random sequences; lower mean NLL
    from position 8 is better."""

    name, budget, higher_is_better, metric = "tiny", 40, False, "NLL from position 8"
    seeds = ("0", "1")

    def __init__(self):
        from kvpop.evaluation.evaluate import load_base_model
        from studies.paths import DATA

        self.base = load_base_model(DATA / "tiny_qwen3_code")
        self.vocab = int(self.base.config.vocab_size)
        g = torch.Generator().manual_seed(0)
        self._ids = {"select": torch.randint(0, 256, (3, 56), generator=g),
                     "test": torch.randint(0, 256, (4, 56), generator=g)}
        self.models = 0

    def model(self, seed, budget, window):
        import kvpop

        self.models += 1
        m = copy.deepcopy(self.base)
        kvpop.patch(m, sinks=Q.SINKS, window=window, budget=budget, policy="streaming")
        return m.to(torch.bfloat16)

    def ids(self, part):
        return self._ids[part]

    def values(self, part, dec):
        return [float(-dec["log_probs"][i, 8:].mean()) for i in range(dec["log_probs"].shape[0])]

    def clusters(self, part):
        return [0, 0, 1, 2] if part == "test" else None

    def describe(self):
        return {"row": "streaming", "split": {"select": "3 random sequences", "test": "4 random sequences"}}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eqbytes")
    with pytest.MonkeyPatch.context() as mp:  # the CPU path (the module fixture runs outside conftest's)
        mp.setenv("TRITON_INTERPRET", "0")
        inst = Tiny()
        rec = Q.run(inst, out, "all", "test")
    return inst, out, rec


def test_bytes_at_equal_budget_and_the_16_bit_side(tiny_run):
    inst, out, rec = tiny_run
    p = rec["bytes"]
    at = {d: v["bytes_per_sequence"] for d, v in p["at_B"].items()}
    assert p["int8_equals_fp8"] and at["int8"] == at["fp8"] == p["target"]
    assert at["int8"] < at["bf16"]
    cands = {c["window"]: c for c in p["candidates"]}
    assert list(cands) == list(Q.WINDOWS)
    for w, c in cands.items():
        if c["budget"] is None:  # window 32 leaves no long-range slot below B = 40 at 8-bit bytes? then said why
            assert c["why_out"]
            continue
        assert c["long_range"] == c["budget"] - Q.SINKS - w >= 1
        assert c["bytes_per_sequence"] <= p["target"] < c["next_budget_bytes"]
        # counted again, independently of the plan: the served model's cache at B16 and B16 + 1
        assert Q.cache_bytes(inst.model("0", c["budget"], w), None, inst.vocab) == c["bytes_per_sequence"]
        assert Q.cache_bytes(inst.model("0", c["budget"] + 1, w), None, inst.vocab) > p["target"]


def test_selection_trials_rows_and_intervals(tiny_run):
    inst, out, rec = tiny_run
    sel = rec["selection"]
    tried = [t["settings"]["window"] for t in sel["trials"]]
    assert tried == [c["window"] for c in rec["bytes"]["candidates"] if c["budget"] is not None]
    assert len(sel["decisions"]) == len(tried) - 1
    assert all(len(t["per_sequence"]) == 3 for t in sel["trials"])
    ch = sel["chosen"]
    assert ch["window"] in tried
    test = rec["test"]
    names = [r["row"] for r in test["rows"]]
    assert names == ["int8@B=40,w=32", "fp8@B=40,w=32", "bf16@B=40,w=32",
                     f"bf16@B={ch['budget']},w={ch['window']}"]
    assert not test["missing"] and set(test["scorings"].values()) == {1} and len(test["scorings"]) == 8
    for f in test["figures"]:
        assert set(f["per_seed"]) == {"0", "1"} and all(v > 0 for v in f["per_seed"].values())
    comps = test["comparisons"]
    assert [(c["a"], c["at"]) for c in comps] == [("int8@B=40,w=32", "equal bytes"), ("int8@B=40,w=32", "equal slots"),
                                                 ("fp8@B=40,w=32", "equal bytes"), ("fp8@B=40,w=32", "equal slots")]
    for c in comps:
        assert c["n_clusters"] == 3 and c["seeds_a"] == 2 and c["lower_is_better"]
        lo, hi = c["ci95"]
        assert lo <= c["mean_diff"] <= hi
        assert c["verdict"] == ("no difference shown" if lo <= 0 <= hi else "a better" if hi < 0 else "b better")
        ps = c["seeds_paired"]  # one seed draw for both rows: the same point, an interval of its own
        assert ps["mean_diff"] == pytest.approx(c["mean_diff"]) and ps["ci95"][0] <= ps["mean_diff"] <= ps["ci95"][1]
    # the 8-bit rows keep the same slots as the 16-bit row at B (streaming): close, but not the same bits
    fig = {f["row"]: f for f in test["figures"]}
    assert abs(fig["int8@B=40,w=32"]["mean"] - fig["bf16@B=40,w=32"]["mean"]) < 0.05
    md = (out / "equal_bytes.md").read_text()
    assert md == Q.markdown(json.loads((out / "equal_bytes.json").read_text()))
    assert f"{fig['fp8@B=40,w=32']['mean']:+.4f}" in md and "equal bytes" in md


def test_a_second_run_scores_nothing_again(tiny_run, monkeypatch):
    inst, out, rec = tiny_run

    def boom(*a, **k):
        raise AssertionError("decoded again")

    monkeypatch.setattr(Q, "decode", boom)
    monkeypatch.setattr(Q, "cache_bytes", boom)
    again = Q.run(inst, out, "test", "again")
    assert again["test"]["figures"] == rec["test"]["figures"]
    assert again["selection"]["chosen"] == rec["selection"]["chosen"]
    assert len(again["commands"]) == 2 and again["commands"][-1].endswith("again")
    assert len((out / "test" / "test_log.jsonl").read_text().splitlines()) == 8


def test_paired_seeds_remove_what_the_rows_share():
    """Rows served by the same seed's scorer share that seed's offset: the seeds-paired interval removes it, the
    house's (seeds drawn independently) keeps it; both have the same point."""
    g = torch.Generator().manual_seed(1)
    base = torch.rand(40, generator=g)
    offset = {"0": -0.3, "1": 0.0, "2": 0.3}
    plan = {"budget": 64}
    chosen = {"budget": 37, "window": 16}
    names = {"int8": 0.02, "fp8": 0.02, "bf16": 0.0}
    runs = {Q.row_name(d, 64, 32): {s: {"per_sequence": (base + o + x).tolist()} for s, o in offset.items()}
            for d, x in names.items()}
    runs[Q.row_name("bf16", 37, 16)] = {s: {"per_sequence": (base + o - 0.1).tolist()} for s, o in offset.items()}
    comps = Q.comparisons("t", 64, runs, plan, chosen, lower_is_better=False, n_boot=2000)
    for c in comps:
        ps = c["seeds_paired"]
        assert ps["mean_diff"] == pytest.approx(c["mean_diff"])
        assert ps["ci95"][1] - ps["ci95"][0] < 1e-6 < c["ci95"][1] - c["ci95"][0]
        assert ps["verdict"] == "a better"
    assert {c["verdict"] for c in comps} == {"no difference shown"}


def test_check_bytes_refuses_a_count_that_moved(tiny_run):
    inst, out, rec = tiny_run
    runs = copy.deepcopy(rec["test"]["runs"])
    Q.check_bytes(runs, rec["bytes"], rec["selection"]["chosen"])
    row = next(iter(runs))
    runs[row]["1"]["bytes_per_sequence"] += 1
    with pytest.raises(ValueError, match=f"{row} seed 1 held"):
        Q.check_bytes(runs, rec["bytes"], rec["selection"]["chosen"])
    plan = copy.deepcopy(rec["bytes"])
    plan["target"] = 1.0
    with pytest.raises(ValueError, match="more than the 8-bit rows'"):
        Q.check_bytes(rec["test"]["runs"], plan, rec["selection"]["chosen"])


def test_decode_equals_a_full_forward_while_nothing_is_evicted():
    """Before the first eviction the cache holds every token: the decode's log-probabilities and predictions are
    the plain forward's (bfloat16 both)."""
    inst = Tiny()
    m = inst.model("0", 40, 32)
    ids = inst.ids("select")[:, :40]
    d = Q.decode(m, ids, None)
    with torch.no_grad():
        import kvpop

        kvpop.unpatch(m)
        lg = m(ids).logits.float()
    lp = torch.log_softmax(lg[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0].double()
    assert torch.allclose(d["log_probs"], lp, rtol=0.02, atol=0.05)  # bfloat16 arithmetic both ways
    assert (d["log_probs"] - lp).abs().mean() < 0.02
    assert (d["pred"] == lg.argmax(-1)).float().mean() > 0.9
    with pytest.raises(ValueError, match="prompt 40 must be in 1..39"):
        Q.decode(m, ids, None, prompt=40)


@pytest.mark.parametrize("argv,msg", [
    (["--instrument", "kvcache"], "--instrument 'kvcache': allowed kvtrace, lookahead, realtext"),
    (["--instrument", "kvtrace", "--stage", "both"], "--stage 'both': allowed select, test, all"),
    (["--instrument", "kvtrace", "--n-test", "1"], "--n-test must be >= 2"),
    (["--instrument", "realtext", "--n-valid", "8"], "real text's select part is fixed"),
    (["--instrument", "realtext", "--n-test", "49"], "holds 48 records"),
])
def test_refusals(tmp_path, capsys, argv, msg):
    assert Q.main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert msg in capsys.readouterr().err


def test_refuses_a_file_as_out(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("")
    assert Q.main(["--instrument", "kvtrace", "--out", str(f)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("instrument", Q.INSTRUMENTS)
def test_shipped_records_agree_with_their_logs(instrument):
    """The shipped record of each instrument: its tables are the JSON's, every (row, seed) is its test log's one
    scoring, the bytes hold (equal-bytes row no more than the 8-bit rows, one slot more would be), and the
    intervals are those its per-sequence values give."""
    from studies.paths import RESULTS_DIR

    d = RESULTS_DIR / "evidence" / instrument
    rec = json.loads((d / "equal_bytes.json").read_text())
    assert (d / "equal_bytes.md").read_text() == Q.markdown(rec)
    log = [json.loads(x) for x in (d / "equal_bytes_test_log.jsonl").read_text().splitlines()]
    assert len({e["key"] for e in log}) == len(log) == 12
    test, plan, chosen = rec["test"], rec["bytes"], rec["selection"]["chosen"]
    for e in log:
        row, seed = e["key"].split("|seed")
        assert test["runs"][row][seed]["per_sequence"] == e["result"]["per_sequence"]
    Q.check_bytes(test["runs"], plan, chosen)
    c = next(c for c in plan["candidates"] if c["window"] == chosen["window"])
    assert c["bytes_per_sequence"] <= plan["target"] < c["next_budget_bytes"]
    again = Q.comparisons(instrument, rec["budget"], test["runs"], plan, chosen, clusters=test["clusters"],
                          lower_is_better=not rec["higher_is_better"])
    for a, b in zip(again, test["comparisons"]):
        assert a["ci95"] == pytest.approx(b["ci95"]) and a["verdict"] == b["verdict"]
        assert a["seeds_paired"]["ci95"] == pytest.approx(b["seeds_paired"]["ci95"])
