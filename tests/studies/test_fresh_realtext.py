"""studies.fresh_realtext: the final real-text rows scored once on the fresh split (no model run here: the
scoring's arithmetic, the views of runs whose base is gone, the record and the refusals)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies import fresh_realtext as F
from studies import ledger


def _split(path, files=(2, 1, 3)):
    """A corpus-like split: each file's first record starts with BOS (256), its second does not."""
    lines = []
    for k in files:
        lines += [json.dumps({"input_ids": [256] + [1] * 7})] + [json.dumps({"input_ids": [2] * 8})] * (k - 1)
    path.write_text("\n".join(lines) + "\n")
    return path


def _result(vals: dict[int, list[float]], shift: list[float]) -> dict:
    return {"vs_original": {str(b): v for b, v in vals.items()},
            "vs_same_weights": {str(b): v for b, v in F.same_weights(vals, shift).items()},
            "dense_shift": shift}


def test_same_weights_subtracts_the_dense_shift_per_sequence_and_refuses_other_lengths():
    assert F.same_weights({64: [0.5, 0.25]}, [0.125, -0.25]) == {64: [0.375, 0.5]}
    with pytest.raises(ValueError, match="B=64: 2 sequences against a dense shift of 3"):
        F.same_weights({64: [0.5, 0.25]}, [0.0, 0.0, 0.0])


def test_dense_finetune_row_is_its_weights_served_densely():
    r = _result({b: [1.0, 2.0] for b in (64, 128, 256)}, [0.25, -0.5])
    assert F.row_values(r, F.DENSE_FT, 128, "original") == [0.25, -0.5]
    assert F.row_values(r, F.DENSE_FT, 64, "same weights") == [0.0, 0.0]
    assert F.row_values(r, F.AUTO_ROW, 128, "same weights") == [0.75, 2.5]


def test_view_of_keeps_a_run_whose_base_is_there_and_relinks_one_whose_base_is_gone(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "scorers.safetensors").write_text("s")
    (run / "last.pt").write_text("optimiser")
    (run / "args.json").write_text(json.dumps({"model": str(model), "seed": 1}))
    assert F.view_of(run, tmp_path / "v", model) == (run, None)
    (run / "args.json").write_text(json.dumps({"model": str(tmp_path / "gone"), "seed": 1}))
    view, old = F.view_of(run, tmp_path / "v", model)
    assert old == str(tmp_path / "gone") and view == tmp_path / "v"
    assert json.loads((view / "args.json").read_text()) == {"model": str(model), "seed": 1}
    assert (view / "scorers.safetensors").resolve() == (run / "scorers.safetensors").resolve()
    assert not (view / "last.pt").exists() and not (run / "args.json").read_text().count(str(model))
    assert F.view_of(run, view, model) == (view, old)  # made once
    with pytest.raises(ValueError, match="another base model"):
        F.view_of(run, view, tmp_path / "other")


def test_run_dirs_takes_the_controls_runs_the_finished_dense_seeds_and_streaming(tmp_path):
    ctrl = {"runs": {r: {"0": {"dir": f"/x/{r}/0"}, "2": {"dir": f"/x/{r}/2"}}
                     for r in (F.AUTO_ROW, *F.CONTROLS, F.ORACLE)}}
    for s, done in ((0, True), (1, False)):
        (tmp_path / f"seed{s}").mkdir()
        if done:
            (tmp_path / f"seed{s}" / "done").write_text("")
    d = F.run_dirs(ctrl, tmp_path)
    assert list(d) == list(F.ROWS) and d[F.DENSE_FT] == {0: tmp_path / "seed0"} and d[F.UNTRAINED] == {0: None}
    assert sorted(d[F.ORACLE]) == [0, 2]
    sub = F.run_dirs(ctrl, None, rows=(F.STREAMING_CONTROL,))
    assert list(sub) == [F.AUTO_ROW, F.STREAMING_CONTROL, F.UNTRAINED]
    with pytest.raises(ValueError, match=r"--rows \['streaming'\]: not a trained row"):
        F.run_dirs(ctrl, None, rows=("streaming",))
    del ctrl["runs"][F.ORACLE]
    with pytest.raises(ValueError, match=r"no runs of oracle\[label\]"):
        F.run_dirs(ctrl, None)
    assert F.ORACLE not in F.run_dirs(ctrl, None, rows=(F.STREAMING_CONTROL,))


def test_record_figures_and_intervals_from_the_log(tmp_path, monkeypatch):
    """The record reads the test log only: per-seed means against both references, the KVpop row's intervals
    against every row, the dense fine-tune only against the original (its same-weights value is 0), the oracle
    against the fixed-mask control, clustered by file; a clear win shows as "a better"."""
    data = _split(tmp_path / "split.jsonl")
    n = 6
    tl = ledger.TestLog(tmp_path)
    tl.once("dense|original", lambda: {"dense_nll": [1.0] * n})
    base = [0.01, 0.02, 0.03, 0.0, 0.02, 0.01]
    for row in F.ROWS:
        seeds = [0] if row == F.UNTRAINED else [0, 1, 2]
        for s in seeds:
            off = {F.AUTO_ROW: 0.0, F.UNTRAINED: 0.3}.get(row, 0.1) + 0.001 * s
            vals = {b: [x + off for x in base] for b in (64, 128, 256)}
            shift = [0.0] * n if row == F.UNTRAINED else [-0.002] * n
            tl.once(f"{row}|seed{s}", lambda vals=vals, shift=shift: {**_result(vals, shift), "dir": None,
                                                                      "command": "kvpop eval"})
    fake = {"runs": {r: {str(s): {"dir": "/x"} for s in range(3)} for r in F.ROWS}}
    scored = F.score_all(tmp_path, F.run_dirs(fake, None), data=data, n=n, only=())
    assert set(scored["rows"]) == set(F.ROWS) - {F.DENSE_FT}  # run_dirs without --dense-ft: not in the record
    scored["rows"][F.DENSE_FT] = {s: {**_result({b: [0.5] * n for b in (64, 128, 256)}, [-0.002] * n),
                                      "dir": f"/d/seed{s}", "command": "kvpop eval"} for s in (0, 1, 2)}
    rec = F.record(scored, data=data, n=n, n_boot=500)
    assert rec["clusters"] == [0, 0, 1, 2, 2, 2] and rec["n_sequences"] == n and rec["not_causal"] == [F.ORACLE]
    fig = {(f["row"], f["budget"]): f for f in rec["figures"]}
    assert fig[(F.AUTO_ROW, 128)]["vs_original_mean"] == pytest.approx(sum(base) / n + 0.001)
    assert fig[(F.AUTO_ROW, 128)]["vs_same_weights_mean"] == pytest.approx(sum(base) / n + 0.003)
    assert fig[(F.DENSE_FT, 64)]["vs_original_mean"] == pytest.approx(-0.002) and fig[(F.ORACLE, 64)]["not_causal"]
    comps = rec["comparisons"]
    auto = [c for c in comps if c["a"] == F.AUTO_ROW]
    assert {c["b"] for c in auto} == set(F.ROWS) - {F.AUTO_ROW}
    assert not [c for c in auto if c["b"] == F.DENSE_FT and c["reference"] == "same weights"]
    assert len(auto) == 3 * (2 * (len(F.ROWS) - 1) - 1)
    c = next(c for c in auto if c["b"] == F.STREAMING_CONTROL and c["budget"] == 128 and c["reference"] == "original")
    assert c["mean_diff"] == pytest.approx(-0.1) and c["verdict"] == "a better" and c["ci95"][1] < 0
    assert c["seeds"] == {"a": 3, "b": 3} and c["n_clusters"] == 3 and c["split"] == "split"
    assert [c["b"] for c in comps if c["a"] == F.ORACLE] == [F.STREAMING_CONTROL] * 6
    rec["scorings"][f"{F.DENSE_FT}|seed0"] = 1  # (injected above, not logged)
    led = F.ledger_rows(rec, {F.AUTO_ROW: 6})
    assert ledger.check_ledger(led, "fresh") == led["rows"] and len(led["rows"]) == 3 * len(F.ROWS)
    r = next(r for r in led["rows"] if r["policy"] == F.AUTO_ROW and r["budget"] == 128)
    assert r["split"] == "split" and r["trials"] == 6 and not r["headline"] and len(r["per_sequence"]) == 3
    assert r["mean"] == pytest.approx(fig[(F.AUTO_ROW, 128)]["vs_original_mean"]) and r["test_evaluations"] == 1
    assert next(r for r in led["rows"] if r["policy"] == F.ORACLE)["not_causal"]
    assert len(led["comparisons"]) == len(comps) and {"verdict", "seeds", "split"} <= set(led["comparisons"][0])
    arch = tmp_path / "results" / "evidence" / "realtext"  # the shipped archive, its earlier split's rows kept
    arch.mkdir(parents=True)
    old = {"instrument": "realtext", "policy": F.AUTO_ROW, "recipe": {}, "steps": 250, "seeds": [0.1], "mean": 0.1,
           "min": 0.1, "max": 0.1, "value": 0.1, "metric": "delta_nll", "trials": 6, "test_evaluations": 1,
           "budget": 128, "budget_fraction": 0.125, "headline": True}
    (arch / "evidence_rows.json").write_text(json.dumps({"rows": [old], "seeds": [0]}))
    (arch / "test_log.jsonl").write_text("earlier\n")
    monkeypatch.setattr(ledger, "EVIDENCE_FILE", tmp_path / "results" / "evidence.json")
    for _ in range(2):  # a second write replaces the split's rows, never repeats them
        F.write_ledger_runs(tmp_path / "L", rec, {"trials_of": {F.AUTO_ROW: 6}})
    built = ledger.build_ledger(tmp_path / "L")
    assert built["rows"] == [old, *led["rows"]] and built["comparisons"] == led["comparisons"]
    assert (tmp_path / "L" / "realtext" / "test_log.jsonl").read_text() == "earlier\n"


def test_main_refuses_an_unknown_row_and_an_incomplete_record(tmp_path, capsys):
    ctrl = tmp_path / "controls.json"
    ctrl.write_text(json.dumps({"runs": {r: {"0": {"dir": "/x"}} for r in (F.AUTO_ROW, *F.CONTROLS, F.ORACLE)}}))
    assert F.main(["--out", str(tmp_path), "--controls", str(ctrl), "--only", "nope"]) == 2
    assert "--only ['nope']: not a row" in capsys.readouterr().err
    assert F.main(["--out", str(tmp_path), "--controls", str(ctrl), "--record", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "not scored yet: kvpop-mlp-joint[auto]|seed0" in err and not (tmp_path / "r.json").exists()
    assert not (tmp_path / "test_log.jsonl").exists()  # --record scores nothing
    tl = ledger.TestLog(tmp_path)  # --partial: what is scored, the rest named
    tl.once("dense|original", lambda: {"dense_nll": [1.0] * F.N_RECORDS})
    for row, off in ((F.AUTO_ROW, 0.0), (F.STREAMING_CONTROL, 0.01)):
        tl.once(f"{row}|seed0", lambda off=off: _result({b: [off] * F.N_RECORDS for b in (64, 128, 256)},
                                                        [0.0] * F.N_RECORDS))
    assert F.main(["--out", str(tmp_path), "--controls", str(ctrl), "--record", str(tmp_path / "r.json"),
                   "--partial"]) == 0
    rec = json.loads((tmp_path / "r.json").read_text())
    assert set(rec["runs"]) == {F.AUTO_ROW, F.STREAMING_CONTROL} and "streaming|seed0" in rec["missing"]
    assert {c["b"] for c in rec["comparisons"]} == {F.STREAMING_CONTROL} and len(rec["comparisons"]) == 6
    assert len(tl.path.read_text().splitlines()) == 3  # nothing scored by --record
    md = (tmp_path / "r.md").read_text()
    assert "| kvpop-mlp-joint[auto] | 1 | +0.0000 | +0.0000 |" in md
    assert "| 128 | original | kvpop-mlp-joint[auto] | fixed-finetune[streaming] | -0.0100 |" in md


def test_tagged_names_and_a_tagged_record_on_another_split(tmp_path, capsys):
    """--split scores another file and --tag names every row but untrained StreamingLLM by its recipe's departure,
    in the figures, the intervals, the runs and the ledger rows; the test log keeps the base names."""
    assert F.tagged(F.AUTO_ROW, "lm 0.1") == "kvpop-mlp-joint[auto, lm 0.1]"
    assert F.tagged(F.UNTRAINED, "lm 0.1") == F.UNTRAINED and F.tagged(F.ORACLE, None) == F.ORACLE
    assert F.tagged(F.ORACLE, {F.ORACLE: "lm 1"}) == "oracle[label, lm 1]" and F.tagged(F.AUTO_ROW, {}) == F.AUTO_ROW
    ctrl = tmp_path / "controls.json"
    ctrl.write_text(json.dumps({"runs": {r: {"0": {"dir": "/x"}} for r in (F.AUTO_ROW, *F.CONTROLS, F.ORACLE)}}))
    assert F.main(["--out", str(tmp_path), "--controls", str(ctrl), "--split", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    tl = ledger.TestLog(tmp_path)
    tl.once("dense|original", lambda: {"dense_nll": [1.0] * F.N_RECORDS})
    for row, off in ((F.AUTO_ROW, 0.0), (F.STREAMING_CONTROL, 0.01), (F.UNTRAINED, 0.2)):
        tl.once(f"{row}|seed0", lambda off=off: {**_result({b: [off] * F.N_RECORDS for b in (64, 128, 256)},
                                                           [0.0] * F.N_RECORDS), "dir": None, "command": "c"})
    data = _split(tmp_path / "other.jsonl", files=(2,) * 24)
    assert F.main(["--out", str(tmp_path), "--controls", str(ctrl), "--record", str(tmp_path / "r.json"),
                   "--partial", "--split", str(data), "--tag", "lm 0.1"]) == 0
    rec = json.loads((tmp_path / "r.json").read_text())
    names = {"kvpop-mlp-joint[auto, lm 0.1]", "fixed-finetune[streaming, lm 0.1]", F.UNTRAINED}
    assert rec["split"] == "other" and rec["tag"] == "lm 0.1" and set(rec["runs"]) == names
    assert {f["row"] for f in rec["figures"]} == names and len(rec["clusters"]) == F.N_RECORDS
    assert {(c["a"], c["b"]) for c in rec["comparisons"]} == {
        ("kvpop-mlp-joint[auto, lm 0.1]", "fixed-finetune[streaming, lm 0.1]"),
        ("kvpop-mlp-joint[auto, lm 0.1]", F.UNTRAINED)}
    rec["scorings"] = {k: 1 for k in tl.entries}
    led = F.ledger_rows(rec, {"kvpop-mlp-joint[auto, lm 0.1]": 3})
    assert ledger.check_ledger(led, "fresh") == led["rows"]
    r = next(r for r in led["rows"] if r["policy"] == "kvpop-mlp-joint[auto, lm 0.1]" and r["budget"] == 128)
    assert r["trials"] == 3 and r["legend"].endswith("; lm 0.1") and r["test_evaluations"] == 1
    # without --tag, the record's own tags name the rows, one per row
    ctrl.write_text(json.dumps({"runs": json.loads(ctrl.read_text())["runs"], "tags": {F.AUTO_ROW: "lm 0.1",
                                                                                     F.STREAMING_CONTROL: "lm 1"}}))
    assert F.main(["--out", str(tmp_path), "--controls", str(ctrl), "--record", str(tmp_path / "t.json"),
                   "--partial", "--split", str(data)]) == 0
    assert set(json.loads((tmp_path / "t.json").read_text())["runs"]) == {
        "kvpop-mlp-joint[auto, lm 0.1]", "fixed-finetune[streaming, lm 1]", F.UNTRAINED}


def test_dms_row_and_another_base_model(tmp_path, capsys):
    """Issue 44 item 4's comparison at a larger model: ``dms[tuned]`` is scored only where ``--rows`` names it (its
    policy ``dms``, its 600 steps in the ledger), ``--model`` is the base every eval and the dense reference use
    (recorded in the settings; refused without a config.json), and a dict tag may name untrained StreamingLLM
    (the base model's size) so that its row is not the small model's on the same split."""
    assert F.policy_of(F.DMS_ROW) == "dms"
    cmd = F.eval_command(Path("/r"), "dms", Path("/d.jsonl"), 4, Path("/o"), Path("/big"))
    assert cmd[cmd.index("--model") + 1] == "/big" and cmd[cmd.index("--run") + 1] == "/r"
    assert F.tagged(F.UNTRAINED, {F.UNTRAINED: "3M"}) == "streaming[3M]"
    assert F.tagged(F.DMS_ROW, {F.DMS_ROW: "3M"}) == "dms[tuned, 3M]"
    runs = {r: {"0": {"dir": f"/x/{i}"}} for i, r in enumerate((F.AUTO_ROW, F.STREAMING_CONTROL, F.DMS_ROW))}
    assert F.DMS_ROW not in F.run_dirs({"runs": runs}, None, (F.STREAMING_CONTROL,))
    assert F.run_dirs({"runs": runs}, None, (F.STREAMING_CONTROL, F.DMS_ROW))[F.DMS_ROW] == {0: Path("/x/2")}
    ctrl = tmp_path / "controls.json"
    tags = {F.AUTO_ROW: "3M", F.STREAMING_CONTROL: "3M", F.DMS_ROW: "3M", F.UNTRAINED: "3M"}
    ctrl.write_text(json.dumps({"runs": runs, "tags": tags}))
    base = ["--out", str(tmp_path), "--controls", str(ctrl), "--rows", F.STREAMING_CONTROL, F.DMS_ROW]
    assert F.main([*base, "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    tl = ledger.TestLog(tmp_path)
    tl.once("dense|original", lambda: {"dense_nll": [1.0] * F.N_RECORDS})
    for row, off in ((F.AUTO_ROW, 0.0), (F.STREAMING_CONTROL, 0.01), (F.DMS_ROW, 0.03), (F.UNTRAINED, 0.2)):
        tl.once(f"{row}|seed0", lambda off=off: {**_result({b: [off] * F.N_RECORDS for b in (64, 128, 256)},
                                                           [0.0] * F.N_RECORDS), "dir": None, "command": "c"})
    data = _split(tmp_path / "other.jsonl", files=(2,) * 24)
    assert F.main([*base, "--record", str(tmp_path / "r.json"), "--split", str(data), "--model",
                   str(F.MODEL)]) == 0
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["settings"]["model"] == "kvpop/data/tiny_qwen3_code" and not rec["missing"]
    names = {"kvpop-mlp-joint[auto, 3M]", "fixed-finetune[streaming, 3M]", "dms[tuned, 3M]", "streaming[3M]"}
    assert set(rec["runs"]) == names
    c = next(c for c in rec["comparisons"] if c["b"] == "dms[tuned, 3M]" and c["budget"] == 128
             and c["reference"] == "original")
    assert c["a"] == "kvpop-mlp-joint[auto, 3M]" and abs(c["mean_diff"] + 0.03) < 1e-12
    rec["scorings"] = {k: 1 for k in tl.entries}
    led = F.ledger_rows(rec, {})
    assert {r["steps"] for r in led["rows"] if r["policy"] == "dms[tuned, 3M]"} == {600}
    assert {r["steps"] for r in led["rows"] if r["policy"] == "streaming[3M]"} == {None}
