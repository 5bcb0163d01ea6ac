"""freshness on a machine of other arithmetic (issue 59): the training sentinels (``demo/*``, ``code/*``) cannot be
compared bit for bit there, so the training code each file was stamped with stands in for them, and a change to the
training loss shows in ``python -m freshness check`` on any machine."""
import freshness as F


def _today_as_recorded(man: dict) -> F.Sentinels:
    """Today's sentinels equal to what the manifest recorded (nothing moved but what a test changes)."""
    digests = {s: d for rec in man["files"].values() for s, d in rec["sentinels"].items()}
    values = {k: [x for x in v for _ in range(F.VALUE_STRIDE)] for k, v in man.get("values", {}).items()}
    return F.Sentinels(digests=digests, values=values)


def _training_findings(today, man) -> list:
    found, how = F.check(today, man, machine="another machine's arithmetic")
    assert "by the source of the training code" in how
    return [f for f in found if "training code" in f.problem]


def test_a_training_code_change_shows_on_a_machine_of_other_arithmetic(monkeypatch):
    man = F.load_manifest()
    today = _today_as_recorded(man)
    stamped = man["files"]["kvpop/data/demo_results/kvtrace/results.json"]["training_code"]
    monkeypatch.setattr(F, "training_digest", lambda: stamped)
    assert _training_findings(today, man) == []  # the training code the files were stamped with
    trained = {f for g in F.GROUPS if F._trained(g.sentinels) for f in g.files}
    assert "kvpop/data/demo_results/kvtrace/results.json" in trained
    monkeypatch.setattr(F, "training_digest", lambda: "a changed loss")
    stale = {f.file for f in _training_findings(today, man)}
    assert stale == {f for f in trained if not man["files"].get(f, {}).get("known_stale") and f in man["files"]}
    assert "kvpop/data/demo_results/kvtrace/results.json" in stale


def test_the_training_digest_follows_the_loss_code_not_its_comments(monkeypatch, tmp_path):
    src = tmp_path / "kvpop" / "training"
    src.mkdir(parents=True)
    for m in F.TRAINING_CODE:
        (tmp_path / m).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / m).write_text((F.ROOT / m).read_text())
    monkeypatch.setattr(F, "ROOT", tmp_path)
    before = F.training_digest()
    train = tmp_path / "kvpop" / "training" / "train.py"
    train.write_text(train.read_text() + "\n# a comment only\n")
    assert F.training_digest() == before
    train.write_text(train.read_text() + "\nLOSS_SCALE = 2.0\n")
    assert F.training_digest() != before
