"""studies.longtext (issue 61 items 1-2): the long-record corpus split by file, the context-use and headroom
measurements and the continued pre-training, on a tiny synthetic tree of source files and a tiny random Qwen3."""
import json

import pytest
import torch

from studies import longtext as L
from studies.realtext_corpus import BOS_ID, EOS_ID, split_of


def _tree(root):
    """Python files of several lengths, one in a test directory and one under site-packages (both skipped)."""
    for i in range(40):
        d = root / ("pkg" if i % 2 else "other")
        d.mkdir(parents=True, exist_ok=True)
        body = f"# file {i}\n" + "\n".join(f"name_{i}_{j} = {j} * {i}" for j in range(10 + 6 * i)) + "\n"
        (d / f"m{i}.py").write_text(body)
    for skip in ("test", "site-packages", "__pycache__"):
        (root / skip).mkdir()
        (root / skip / "x.py").write_text("y = 1\n" * 200)
    (root / "notes.txt").write_text("not python\n" * 100)
    return root


def test_stdlib_files_skip_tests_and_site_packages(tmp_path):
    files = L.stdlib_files(_tree(tmp_path / "lib"))
    keys = [k for k, _ in files]
    assert len(keys) == 40 and keys == sorted(keys) and all(k.startswith("stdlib/") and k.endswith(".py")
                                                            for k in keys)
    assert not any("/test/" in k or "site-packages" in k or "__pycache__" in k for k in keys)
    with pytest.raises(ValueError, match="not a directory"):
        L.stdlib_files(tmp_path / "missing")


def test_corpus_splits_by_file_one_record_per_test_file(tmp_path):
    files = L.stdlib_files(_tree(tmp_path / "lib"))
    m = L.build_corpus(tmp_path / "c", files, seq_len=256, valid_frac=0.2, test_frac=0.3, train_records_per_file=2)
    by = {s: [json.loads(x) for x in (tmp_path / "c" / f"{s}.jsonl").read_text().splitlines()]
          for s in ("train", "validation", "test")}
    sets = {s: {r["file"] for r in recs} for s, recs in by.items()}
    assert not (sets["train"] & sets["test"]) and not (sets["train"] & sets["validation"]) \
        and not (sets["validation"] & sets["test"])
    long_enough = {k for k, p in files if len(p.read_bytes()) + 2 >= 256}
    for s, recs in by.items():
        assert sets[s] == {k for k in long_enough if split_of(k, 0, 0.2, 0.3) == s}
        assert all(len(r["input_ids"]) == 256 for r in recs)
        assert m["splits"][s]["records"] == len(recs)
    for s in ("validation", "test"):  # one record per file: each record its own cluster
        assert len(by[s]) == len(sets[s])
    # a record is the file's first 256 tokens of [BOS] + bytes (+ EOS)
    r = by["test"][0]
    data = dict(files)[r["file"]].read_bytes()
    assert r["input_ids"] == ([BOS_ID, *data, EOS_ID])[:256]
    assert len(by["train"]) > len(sets["train"])  # files longer than 2 records give 2
    ids, clusters = L.read_records(tmp_path / "c" / "test.jsonl", 2)
    assert len(ids) == 2 and clusters == [x["file"] for x in by["test"][:2]] and ids[0].dtype == torch.long


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
    d = tmp_path_factory.mktemp("tiny") / "model"
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    return d


def _traces(n, length=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g) for _ in range(n)]


def test_context_use_and_headroom_on_a_tiny_model(tiny_model):
    from kvpop.evaluation.trace_eval import load_model

    base = load_model(str(tiny_model)).eval()
    t = _traces(2)
    # a context cut to more than the record is no cut: the two NLLs agree
    same = L.context_use(base, t, start=40, keep=120, progress=False)
    assert same["full"] == pytest.approx(same["cut"], abs=1e-5)
    cut = L.context_use(base, t, start=40, keep=24, progress=False)
    assert len(cut["full"]) == 2 and cut["full"] == pytest.approx(same["full"])
    h = L.headroom(base, t, budget=32, window=8, gammas=(0.99, 0.999), progress=False)
    assert set(h) == {"streaming", "oracle[0.99]", "oracle[0.999]"} and all(len(v) == 2 for v in h.values())
    assert all(abs(x) < 5 for v in h.values() for x in v)


def test_cli_context_headroom_and_pretrain(tiny_model, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": x.tolist(), "file": f"f{i}"}) + "\n"
                            for i, x in enumerate(_traces(3))))
    assert L.main(["headroom", "--model", str(tiny_model), "--data", str(data), "--out", str(tmp_path / "h.json"),
                   "--budget", "32", "--window", "8", "--gammas", "0.99"]) == 0
    rec = json.loads((tmp_path / "h.json").read_text())
    assert rec["files"] == ["f0", "f1", "f2"] and set(rec["oracle_minus_streaming"]) == {"oracle[0.99]"}
    d = rec["oracle_minus_streaming"]["oracle[0.99]"]
    per = rec["per_sequence"]
    assert d["mean_diff"] == pytest.approx(sum(per["oracle[0.99]"]) / 3 - sum(per["streaming"]) / 3)
    assert L.main(["context", "--model", str(tiny_model), "--data", str(data), "--out", str(tmp_path / "c.json"),
                   "--from", "40", "--keep", "24"]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["full_minus_cut"]["n_clusters"] == 3
    out = tmp_path / "pre"
    assert L.main(["pretrain", "--model", str(tiny_model), "--data", str(data), "--valid-data", str(data),
                   "--out", str(out), "--steps", "3", "--eval-every", "2", "--eval-n", "2"]) == 0
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    evals = [e for e in log if "valid_nll" in e]
    assert [e["step"] for e in evals] == [0, 2, 3] and (out / "model" / "config.json").is_file()
    assert all(len(e["per_sequence"]) == 2 for e in evals)
    assert L.main(["corpus", "--out", str(data)]) == 2 and "not a directory" in capsys.readouterr().err


def test_ledger_rows_of_a_headroom_record(tmp_path):
    """The record's rows pass the ledger's checks (one seed each, per-sequence values, not headline) and the
    comparison is the paired interval of the oracle against recency over the files."""
    from studies.ledger import check_ledger
    from studies.paired import paired_interval

    per = {"streaming": [0.30, 0.20, 0.25], "oracle[0.9995]": [0.10, 0.15, 0.05]}
    rec = {"budget": 512, "window": 256, "sinks": 4, "label": "mean", "seq_len": 4096, "files": ["a", "b", "b"],
           "per_sequence": per}
    new = L.ledger_rows(rec, split="long_test", model="m")
    assert [r["policy"] for r in new["rows"]] == ["streaming[long]", "oracle[label mean, gamma 0.9995, long]"]
    assert all(r["budget_fraction"] == 0.125 and r["length"] == 4096 and not r["headline"] for r in new["rows"])
    c = new["comparisons"][0]
    want = paired_interval(per["oracle[0.9995]"], per["streaming"], clusters=rec["files"])
    assert c["ci95"] == list(want.ci95) and c["n_clusters"] == 2 and c["verdict"] == "a better"
    check_ledger(new, "test")
    out = tmp_path / "runs"
    (tmp_path / "r.json").write_text(json.dumps(rec))
    assert L.main(["ledger", "--record", str(tmp_path / "r.json"), "--split", "long_test", "--model-name", "m",
                   "--runs", str(out)]) == 0
    rows = json.loads((out / "realtext" / "evidence_rows.json").read_text())
    assert {r["policy"] for r in rows["rows"] if r.get("split") == "long_test"} == {r["policy"] for r in new["rows"]}
    assert len(rows["rows"]) > 2  # the archive's rows stay beside them


def test_shipped_long_records_are_their_intervals():
    """Round five's records (issue 61 items 1-2): each interval is the paired interval of the record's own
    per-file values, and the ledger holds the headroom split's rows and comparison as the record gives them."""
    from studies.ledger import read_ledger
    from studies.paired import paired_interval
    from studies.paths import RESULTS_DIR

    ev = RESULTS_DIR / "evidence" / "realtext"
    for name in ("long_context_3m.json", "long_context_4k.json"):
        rec = json.loads((ev / name).read_text())
        r = paired_interval(rec["per_sequence"]["full"], rec["per_sequence"]["cut"], clusters=rec["files"])
        assert rec["full_minus_cut"]["ci95"] == list(r.ci95)
        assert rec["full_minus_cut"]["n_clusters"] == len(rec["files"]) == len(set(rec["files"])) >= 20
    head = json.loads((ev / "long_headroom_4k.json").read_text())
    per = head["per_sequence"]
    (name, got), = head["oracle_minus_streaming"].items()
    r = paired_interval(per[name], per["streaming"], clusters=head["files"])
    assert got["ci95"] == list(r.ci95) and (head["budget"], head["window"], head["seq_len"]) == (512, 256, 4096)
    rows = [x for x in read_ledger(RESULTS_DIR / "evidence.json") if x.get("split") == L.LEDGER_SPLIT]
    assert {x["policy"]: x["per_sequence"][0] for x in rows} == {
        "streaming[long]": per["streaming"], f"oracle[label mean, gamma {name[7:-1]}, long]": per[name]}
    comps = [c for c in json.loads((RESULTS_DIR / "evidence.json").read_text())["comparisons"]
             if c["split"] == L.LEDGER_SPLIT]
    assert len(comps) == 1 and comps[0]["ci95"] == got["ci95"]


def test_every_subcommand_takes_the_write_rules_option_it_names(capsys, monkeypatch, tmp_path):
    """A shipped path is refused with the advice to add --write-shipped, and that option exists (before: argparse
    answered "unrecognized arguments" to the advice)."""
    from studies import longtext

    monkeypatch.setattr(longtext, "build_corpus", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no work")))
    for argv in (["headroom", "--model", "m", "--data", "d", "--out", "studies/results/x.json"],
                 ["corpus", "--out", "studies/results/x", "--stdlib", "no-such-dir"],
                 ["ledger", "--record", "r", "--split", "s", "--model-name", "m", "--runs", "studies/results/x"]):
        try:
            rc = longtext.main(argv)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and "--write-shipped" in err and "unrecognized" not in err, (argv, err)
        try:  # accepted by the parser: it fails later, on the missing inputs (a one-line error, exit 2)
            rc = longtext.main([*argv, "--write-shipped"])
        except (RuntimeError, SystemExit) as e:
            rc = getattr(e, "code", 1)
        err = capsys.readouterr().err
        assert rc != 0 and "unrecognized arguments" not in err and "--write-shipped" not in err, (argv, err)
