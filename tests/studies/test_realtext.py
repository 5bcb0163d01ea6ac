"""The real-text instrument: the corpus builder (studies.realtext_corpus), ``kvpop pretrain --data``
(kvpop.demo.pretrain_data), the shipped corpus splits and model, and the oracle rows (studies.realtext)."""
import copy
import json
import os
from pathlib import Path

import pytest
import torch

from kvpop.cli import main
from kvpop.demo import pretrain_data as PD
from studies import realtext as RT
from studies import realtext_corpus as C


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.set_num_threads(1)


def _fake_tree(tmp_path: Path) -> tuple[Path, Path]:
    """site-packages with packages alpha and beta (files of several sizes, a binary, a __pycache__, a copy of a
    standard-library file and a link into the standard library), and a fake standard library."""
    std = tmp_path / "lib" / "python3.x"
    site = std / "site-packages"  # inside the standard library's directory, as on a real install
    (std / "json").mkdir(parents=True)
    std_text = ("# standard library text\n" + "def stdlib_function(x):\n    return x\n" * 40).encode()
    (std / "json" / "decoder.py").write_bytes(std_text)
    for pkg in ("alpha", "beta"):
        for i in range(30):
            d = site / pkg / ("sub" if i % 3 else "")
            d.mkdir(parents=True, exist_ok=True)
            lines = "".join(f"value_{pkg}_{i}_{j} = {j} * {i}\n" for j in range(40 + 25 * i))
            body = f'"""{pkg} module {i}"""\n' + lines
            (d / f"mod{i}.py").write_text(body)
        (site / pkg / "README.md").write_text(f"# {pkg}\n" + "documentation line\n" * 120)
        (site / pkg / "__pycache__").mkdir()
        (site / pkg / "__pycache__" / "mod0.py").write_text("x = 1\n" * 200)
        (site / pkg / "blob.txt").write_bytes(b"\0\1\2" * 400)
        (site / pkg / "tiny.py").write_text("x = 1\n")
    (site / "alpha" / "vendored_decoder.py").write_bytes(std_text)  # byte-identical to a stdlib file
    os.symlink(std / "json" / "decoder.py", site / "alpha" / "linked_decoder.py")
    return site, std


def _build(tmp_path, site, std, out="out", **kw):
    args = dict(site=site, stdlib=std, packages=("alpha", "beta"), splits=("train", "validation", "test"),
                seq_len=128, max_records=40, max_train_records=400, max_records_per_file=3, valid_frac=0.2,
                test_frac=0.2)
    args.update(kw)
    return C.build(tmp_path / out, **args)


def _records(path: Path) -> list[list[int]]:
    return [json.loads(x)["input_ids"] for x in path.read_text().splitlines()]


def test_corpus_splits_by_file_deterministic_no_stdlib(tmp_path):
    site, std = _fake_tree(tmp_path)
    man = _build(tmp_path, site, std)
    files = {s: set(man["splits"][s].get("files", [])) for s in ("validation", "test")}
    assert files["validation"] and files["test"] and not files["validation"] & files["test"]
    listed = C.list_files(site, ("alpha", "beta"), stdlib=std)
    keys = [k for k, _ in listed]
    # no standard-library content: neither the byte-identical copy nor the link into it; no __pycache__
    assert "alpha/vendored_decoder.py" not in keys and "alpha/linked_decoder.py" not in keys
    assert not any("__pycache__" in k for k in keys)
    std_bytes = list((std / "json" / "decoder.py").read_bytes()[:64])
    for split in ("train", "validation", "test"):
        for r in _records(tmp_path / "out" / f"{split}.jsonl"):
            assert len(r) == 128 and all(0 <= t < C.VOCAB_SIZE for t in r) and C.PAD_ID not in r
            assert bytes(t for t in r if t < 256).find(bytes(std_bytes)) < 0
    # every file's split is the hash's, and each record comes from files of its own split
    for k in keys:
        s = C.split_of(k, 0, 0.2, 0.2)
        for other in ("validation", "test"):
            if other != s:
                assert k not in files[other]
    # a record is a piece of [BOS] + bytes of one file: the first ones start with BOS and the file's text
    first = _records(tmp_path / "out" / "validation.jsonl")[0]
    assert first[0] == C.BOS_ID
    assert bytes(first[1:20]).decode().startswith('"""') or bytes(first[1:20]).decode().startswith("#")
    # deterministic: a second build gives the same bytes; another seed another split
    man2 = _build(tmp_path, site, std, out="out2")
    for split in ("train", "validation", "test"):
        assert (tmp_path / "out" / f"{split}.jsonl").read_bytes() == (tmp_path / "out2" / f"{split}.jsonl").read_bytes()
        assert man["splits"][split] == man2["splits"][split]
    man3 = _build(tmp_path, site, std, out="out3", seed=1)
    assert man3["splits"]["validation"]["files"] != man["splits"]["validation"]["files"]
    # the manifest checks the files it describes
    assert C.check_split(tmp_path / "out", "test") == tmp_path / "out" / "test.jsonl"
    with open(tmp_path / "out" / "test.jsonl", "a") as f:
        f.write("\n")
    with pytest.raises(ValueError, match="hash"):
        C.check_split(tmp_path / "out", "test")


def test_versions_are_read_from_the_site_the_files_came_from(tmp_path):
    """A corpus built from another site-packages records that site's versions (its ``*.dist-info``), not this
    interpreter's, and "unknown" for a package the site has no metadata of."""
    site, std = _fake_tree(tmp_path)
    info = site / "alpha-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: alpha\nVersion: 1.2.3\n")
    man = _build(tmp_path, site, std)
    assert man["package_versions"] == {"alpha": "1.2.3", "beta": "unknown"}
    assert C._versions(("pytest",)) == {"pytest": __import__("pytest").__version__}  # no site: the interpreter's


def test_corpus_caps_and_errors(tmp_path):
    site, std = _fake_tree(tmp_path)
    man = _build(tmp_path, site, std, max_records=5, max_records_per_file=1)
    assert man["splits"]["validation"]["records"] == 5 == len(_records(tmp_path / "out" / "validation.jsonl"))
    assert man["splits"]["validation"]["files_used"] == 5  # one record per file
    with pytest.raises(ValueError, match="does not exist"):
        _build(tmp_path, site, std, packages=("alpha", "missing"))
    with pytest.raises(ValueError, match="splits"):
        _build(tmp_path, site, std, splits=("dev",))
    with pytest.raises(ValueError, match="seq_len"):
        _build(tmp_path, site, std, seq_len=1)


def test_split_of_fractions():
    keys = [f"pkg/file{i}.py" for i in range(4000)]
    got = [C.split_of(k, 3, 0.1, 0.05) for k in keys]
    assert abs(got.count("validation") / 4000 - 0.1) < 0.02 and abs(got.count("test") / 4000 - 0.05) < 0.015
    assert got == [C.split_of(k, 3, 0.1, 0.05) for k in keys]
    assert got != [C.split_of(k, 4, 0.1, 0.05) for k in keys]


TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--intermediate",
        "64", "--seq-len", "64", "--batch-size", "2", "--eval-n", "2", "--eval-every", "2", "--no-progress",
        "--warmup", "1"]


def _tiny_data(d: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", 7), ("validation", 2)):
        with open(d / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps({"input_ids": torch.randint(0, 50, (64,), generator=g).tolist()}) + "\n")
    return d / "train.jsonl"


def test_pretrain_data_writes_model_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file

    data = _tiny_data(tmp_path / "data")
    assert main(["pretrain", "--data", str(data), "--out", str(tmp_path / "full"), "--steps", "4", *TINY]) == 0
    for name in ("config.json", "model.safetensors", "TRAINING.md", "training.json"):
        assert (tmp_path / "full" / "model_final" / name).is_file()
    info = json.loads((tmp_path / "full" / "model_final" / "training.json").read_text())
    assert info["step"] == 4 and info["vocab_size"] == 50 and len(info["valid"]["buckets"]) == 1
    assert "--data" in (tmp_path / "full" / "model_final" / "TRAINING.md").read_text()
    # interrupted after 2 steps, resumed to 4: the same weights as the uninterrupted run
    assert main(["pretrain", "--data", str(data), "--out", str(tmp_path / "part"), "--steps", "2", *TINY]) == 0
    assert main(["pretrain", "--data", str(data), "--out", str(tmp_path / "part"), "--steps", "4", "--resume",
                 *TINY]) == 0
    a = load_file(tmp_path / "full" / "model_final" / "model.safetensors")
    b = load_file(tmp_path / "part" / "model_final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the export adds the long-context measure
    assert main(["pretrain", "--data", str(data), "--out", str(tmp_path / "full"), "--export",
                 str(tmp_path / "exported"), "--export-from", "model_final"]) == 0
    exp = json.loads((tmp_path / "exported" / "training.json").read_text())
    assert [r["context"] for r in exp["context_curve"]["rows"]] == [32, "full"]
    assert "band mask" in (tmp_path / "exported" / "TRAINING.md").read_text()


def test_pretrain_data_refuses(tmp_path, capsys):
    data = _tiny_data(tmp_path / "data")
    assert main(["pretrain", "--data", str(data), "--out", str(tmp_path / "o"), "--curriculum", "64:2", *TINY]) == 2
    assert "--curriculum is for the synthetic task" in capsys.readouterr().err
    assert main(["pretrain", "--data", str(data), "--out", str(tmp_path / "o"), "--vocab-size", "10", *TINY]) == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err
    assert main(["pretrain", "--out", str(tmp_path / "o"), "--valid-data", str(data)]) == 2
    assert "--valid-data is for --data" in capsys.readouterr().err
    assert main(["pretrain", "--data", str(data), "--out", str(tmp_path / "o"), *TINY, "--seq-len", "65"]) == 2
    assert "no sequence of --seq-len 65" in capsys.readouterr().err


def test_sample_index_is_a_permutation_per_epoch():
    n, b = 7, 3
    seen = [PD.sample_index(s, j, b, n, seed=5) for s in range(7) for j in range(b)]
    for e in range(3):
        assert sorted(seen[e * n:(e + 1) * n]) == list(range(n))


def test_shipped_corpus_matches_its_manifest():
    for split in ("validation", "test"):
        path = C.check_split(C.SHIPPED_DIR, split)
        recs = _records(path)
        man = json.loads((C.SHIPPED_DIR / "manifest.json").read_text())
        assert len(recs) == man["splits"][split]["records"] and {len(r) for r in recs} == {man["settings"]["seq_len"]}
    assert not set(man["splits"]["validation"]["files"]) & set(man["splits"]["test"]["files"])


@pytest.mark.skipif(not (RT.SHIPPED_MODEL / "config.json").exists(), reason="the real-text model is not shipped")
def test_shipped_model_loads_and_names_the_shipped_data():
    from kvpop.models import load_model_dir

    model = load_model_dir(RT.SHIPPED_MODEL, dtype=torch.float32)
    info = json.loads((RT.SHIPPED_MODEL / "training.json").read_text())
    man = json.loads((C.SHIPPED_DIR / "manifest.json").read_text())
    assert model.config.vocab_size == man["vocab"]["vocab_size"] == info["vocab_size"]
    for split in ("validation", "test"):  # trained on the corpus whose validation and test splits are shipped
        assert info["manifest"]["splits"][split]["jsonl_blake2b"] == man["splits"][split]["jsonl_blake2b"]
    assert info["manifest"]["package_versions"] == man["package_versions"]
    ids = torch.tensor(_records(C.SHIPPED_DIR / "validation.jsonl")[0][:256])
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(ids[None]).logits[0, :-1], ids[1:])
    assert float(nll) < 3.0  # far below uniform over the vocabulary (log 260 = 5.56)


def test_oracle_rows_and_labels():
    from kvpop.evaluation.evaluate import load_base_model

    with pytest.raises(ValueError, match="unknown label"):
        RT.parse_labels("mean,mode")
    with pytest.raises(ValueError, match="exponent"):
        RT.parse_labels("power")
    assert RT.parse_labels("mean, power:2") == [("mean", 1.0), ("power", 2.0)]
    base = load_base_model()
    g = torch.Generator().manual_seed(1)
    traces = [torch.randint(3, 600, (97,), generator=g) for _ in range(2)]
    rows = RT.oracle_rows(base, traces, budgets=[41, 60], labels=[("max", 1.0)], gammas=[0.99], sinks=4, window=8,
                          progress=False)
    assert [(r["label"], r["budget"]) for r in rows] == [("max", 41), ("max", 60)]
    assert all(r["positions"] == 2 * (96 - 60) and r["scored_from"] == 60 for r in rows)
    assert rows[0]["dense_nll"] == rows[1]["dense_nll"]
    with pytest.raises(ValueError, match="sinks \\+ window \\+ 1"):
        RT.oracle_rows(base, traces, budgets=[10], labels=[("mean", 1.0)], gammas=[0.99], sinks=4, window=8)


def test_table_and_goals():
    def row(p, b, d, **kw):
        return {"policy": p, "budget": b, "scored_from": 256, "dense_nll": 1.0, "delta_nll": d, "top1_agreement": 0.9,
                **kw}

    ev = {"scored_from": 256, "rows": [row("streaming", 128, 0.04), row("h2o", 128, 0.05),
                                       row("kvpop-mlp", 128, 0.02), row("kvpop-mlp-joint", 128, 0.025),
                                       row("kvpop-mlstm", 64, 0.1)]}
    orc = {"rows": [row("oracle", 128, 0.01, label="power", power=4.0, gamma=0.99)]}
    md, goals = RT.table([ev], orc)
    assert "| oracle (power a=4, gamma 0.99) | - | +0.0100 / 0.900 |" in md
    assert goals["best_learned"] == "kvpop-mlp" and goals["best_vs_streaming"]["met"]  # 0.02 <= 0.03
    assert goals["best_vs_h2o"]["met"] and not goals["kvpop-mlp-joint_vs_scorer_only"]["met"]
    ev["rows"][0]["delta_nll"] = 0.02  # 0.02 > 0.75 * 0.02
    assert not RT.table([ev])[1]["best_vs_streaming"]["met"]
    with pytest.raises(ValueError, match="different dense"):
        RT.table([ev, {"scored_from": 256, "rows": [row("dense", 64, 0.0, dense_nll=2.0)]}])


def test_head_adaptive_rows_uniform_row_equals_kvpop_eval(tmp_path):
    """The uniform scorer row of the full-sequence path equals kvpop eval --data's (the KVpopCache prefill) on
    the same positions; the head-adaptive budgets keep the uniform total."""
    from kvpop.core.checkpoint import save_scorers
    from kvpop.core.patching import patch
    from kvpop.evaluation import evaluate as E
    from kvpop.evaluation import trace_eval as TE

    base = E.load_base_model()
    for q in base.parameters():
        q.requires_grad_(False)
    torch.manual_seed(3)
    trained = patch(copy.deepcopy(base), sinks=4, window=8, budget=41, scorer="mlp")
    save_scorers(trained, tmp_path / "s.safetensors")
    g = torch.Generator().manual_seed(2)
    traces = [torch.randint(3, 600, (97,), generator=g) for _ in range(2)]
    with torch.no_grad():
        rows = RT.head_adaptive_rows(base, str(tmp_path / "s.safetensors"), traces, traces[:1], budgets=[41],
                                     label="mean", power=1.0, gamma=0.999, sinks=4, window=8, progress=False)
    uni = rows[0]
    assert uni["policy"].startswith("kvpop-mlp (uniform")
    models = {"dense": base, "kvpop-mlp": E.policy_model(base, "kvpop-mlp", scorers=tmp_path / "s.safetensors",
                                                         sinks=4, window=8, budget=41)}
    ref = TE.evaluate_traces(models, traces, TE.TraceEvalConfig(budgets=[41], sinks=4, window=8,
                                                                policies=["dense", "kvpop-mlp"], progress=False))
    assert uni["delta_nll"] == pytest.approx(ref[0]["delta_nll"], abs=1e-6)
    hb = rows[2]["head_budgets"]
    assert rows[2]["policy"].startswith("kvpop-mlp (head-adaptive") and sum(map(sum, hb)) == 41 * len(hb) * len(hb[0])
