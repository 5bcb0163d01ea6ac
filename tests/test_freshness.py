"""Every shipped figure is true to today's code (freshness/__init__.py): the sentinels each shipped result file
was made with are today's, and the mechanism names exactly the files a numerics change makes stale."""
import json

import pytest

import freshness as fr


@pytest.fixture(scope="module")
def today():
    return fr.compute()


def test_every_shipped_file_is_fresh(today):
    """A failure names each stale file and the command that regenerates it."""
    found, how = fr.check(today)
    assert not found, f"sentinels compared {how}\n" + "\n".join(map(str, found))


def test_every_file_a_group_lists_exists_and_is_listed_once():
    files = [f for g in fr.GROUPS for f in g.files]
    assert len(files) == len(set(files))
    for f in files:
        assert fr.file_bytes(f), f
    man = fr.load_manifest()
    assert set(man["files"]) == set(files), "stamp every listed file (python -m freshness stamp PATH)"


def test_known_stale_files_say_so_themselves():
    """A file recorded as not regenerated carries the reason in its own text, so its reader is told."""
    for f, why in fr.known_stale():
        assert "not regenerated" in fr.file_bytes(f).decode("utf-8"), (f, why)


def _moved(today, *names):
    digests = dict(today.digests)
    values = dict(today.values)
    for n in names:
        digests[n] = "0" * 64
        if n in values:
            values[n] = [v + 1.0 for v in values[n]]
    return fr.Sentinels(digests, values)


def _fresh_manifest(today):
    """A manifest stamped with today's sentinels for every file (as after regenerating them all)."""
    man = {"machine": fr.machine_digest(), "values": {k: v[::fr.VALUE_STRIDE] for k, v in today.values.items()},
           "files": {}}
    for g in fr.GROUPS:
        for f in g.files:
            man["files"][f] = {"sha256": fr.sha(fr.file_bytes(f)), "sentinels": {s: today.digests[s]
                                                                                 for s in g.sentinels},
                               **({"training_code": fr.training_digest()} if fr._trained(g.sentinels) else {})}
    return man


def test_a_moved_sentinel_names_exactly_the_files_that_depend_on_it(today):
    man = _fresh_manifest(today)
    assert fr.check(today, man)[0] == []
    found, _ = fr.check(_moved(today, "forward/kvpop-mlstm"), man)
    expect = {f for g in fr.GROUPS if "forward/kvpop-mlstm" in g.sentinels for f in g.files}
    assert {x.file for x in found} == expect
    assert "README.md#walkthrough" in expect and f"{fr.RESULTS}/kvtrace/results.json" in expect
    assert f"{fr.STUDY_RESULTS}/evidence.json" not in expect  # no mLSTM row in the ledger
    for x in found:
        assert "forward/kvpop-mlstm" in x.problem and x.command == fr.group_of(x.file).command
    # on a machine of other arithmetic, the forward values are compared by value
    found, how = fr.check(_moved(today, "forward/kvpop-mlstm"), man, machine="another")
    assert {x.file for x in found} == expect and "by value" in how
    found, _ = fr.check(_moved(today, "demo/kvtrace/dms"), man, machine="another")
    assert found == []  # training digests are not comparable there (said in `how`)


def test_an_edited_or_unstamped_file_is_named(today):
    man = _fresh_manifest(today)
    man["files"]["benchmarks/RESULTS.md"]["sha256"] = "0" * 64
    del man["files"][f"{fr.STUDY_RESULTS}/quantized.md"]
    found = {x.file: x.problem for x in fr.check(today, man)[0]}
    assert found == {"benchmarks/RESULTS.md": "changed since it was stamped (regenerated? then stamp it)",
                     f"{fr.STUDY_RESULTS}/quantized.md": "never stamped"}


def test_stamp_refuses_a_file_whose_sentinels_moved_but_bytes_did_not(today, monkeypatch):
    man = _fresh_manifest(today)
    monkeypatch.setattr(fr, "machine_digest", lambda: man["machine"])
    f = f"{fr.STUDY_RESULTS}/quantized.md"
    with pytest.raises(ValueError, match="sentinels moved but its bytes did not: regenerate it"):
        fr.stamp([f], _moved(today, "forward/kvpop-mlp-int8"), man=json.loads(json.dumps(man)))
    again = fr.stamp([f], _moved(today, "forward/kvpop-mlp-int8"), man=json.loads(json.dumps(man)), unchanged=True)
    assert again["files"][f]["sentinels"]["forward/kvpop-mlp-int8"] == "0" * 64
    with pytest.raises(ValueError, match="not a shipped result file"):
        fr.stamp(["README.md"], today, man=man)
    monkeypatch.setattr(fr, "machine_digest", lambda: "another")
    with pytest.raises(ValueError, match="arithmetic differs"):
        fr.stamp([f], today, man=man)


def test_a_change_of_an_mlstm_constant_by_1e_6_moves_its_sentinel_only(monkeypatch):
    """The forward sentinels see a numerics change of 1e-6 in one scorer's constant, and only its own."""
    import torch

    from kvpop.core import scorers

    base = fr.forward_values()
    init = scorers.MLSTMScorer.__init__

    def nudged(self, *a, **k):
        init(self, *a, **k)
        with torch.no_grad():
            self.bf.add_(1e-6)

    monkeypatch.setattr(scorers.MLSTMScorer, "__init__", nudged)
    after = fr.forward_values()
    assert [k for k in base if base[k] != after[k]] == ["forward/kvpop-mlstm"]
