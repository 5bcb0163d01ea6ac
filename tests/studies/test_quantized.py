"""studies.quantized: the rows of one instrument by token-by-token decoding, the table, the refusals,
and a second run that reuses the finished instrument."""
import json

import pytest

from studies import quantized as Q


def test_half_budget_keeps_sinks_and_window():
    assert Q.half_budget(128, 4, 32) == 64
    assert Q.half_budget(40, 4, 32) == 37 and Q.half_budget(64, 4, 32) == 37


def test_realtext_rows_bytes_and_figures(tmp_path, capsys):
    out = tmp_path / "q"
    args = ["--out", str(out), "--instruments", "realtext", "--n-sequences", "1", "--length", "272"]
    assert Q.main(args) == 0
    res = json.loads((out / "realtext.json").read_text())
    rows = {r["row"]: r for r in res["rows"]}
    assert list(rows) == ["bf16 B=128", "int8 B=128", "fp8 B=128", "bf16 B=64"]
    full, i8, f8, half = (rows[k] for k in rows)
    # 8-bit codes plus a float32 scale per slot and head: fewer bytes than 16 bits, more than half the slots'
    assert i8["bytes_per_sequence"] == f8["bytes_per_sequence"]
    assert half["bytes_per_sequence"] < i8["bytes_per_sequence"] < full["bytes_per_sequence"]
    assert half["bytes_per_sequence"] == pytest.approx(full["bytes_per_sequence"] / 2, rel=0.01)
    # the quantised rows read close to the 16-bit row (the same slots are kept; only their precision differs)
    for r in (i8, f8):
        assert abs(r["delta_nll"] - full["delta_nll"]) < 0.05, (r, full)
    assert all(r["nll"] > 0 and r["ms_per_token"] > 0 for r in rows.values())
    md = (out / "quantized.md").read_text()
    assert md.count("| realtext (streaming) |") == 4 and "| 1.000 |" in md
    # a second run reuses the finished instrument (nothing decoded again)
    (out / "realtext.json").write_text(json.dumps({**res, "policy": "marker"}))
    assert Q.main(args) == 0
    assert "realtext (marker)" in (out / "quantized.md").read_text()


@pytest.mark.parametrize("bad,msg", [(["--instruments", "kvtrace,nope"], "allowed kvtrace"),
                                     (["--n-sequences", "0"], "must be >= 1"),
                                     (["--realtext-scorers", "/no/such.safetensors"], "is not a file")])
def test_refusals(tmp_path, bad, msg):
    with pytest.raises(ValueError, match=msg):
        Q.main(["--out", str(tmp_path), *bad])


def test_length_outside_the_record_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--length 100: allowed 257"):
        Q.main(["--out", str(tmp_path), "--instruments", "realtext", "--n-sequences", "1", "--length", "100"])
