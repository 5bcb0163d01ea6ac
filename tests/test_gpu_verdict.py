"""The verdict table of ``benchmarks/tools/targets.py`` and the GPU check driver ``benchmarks/tools/gpu_check.py``.

Pure Python apart from two short subprocesses (the driver's time cap, the recorder plugin in a pytest
run of a generated benchmark file)."""
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest


def _root() -> Path:
    for p in Path(__file__).resolve().parents:
        if (p / "benchmarks" / "tools" / "targets.py").exists():
            return p
    raise RuntimeError("benchmarks/tools/targets.py not found above this test")


ROOT = _root()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
tg = importlib.import_module("benchmarks.tools.targets")
recorder = importlib.import_module("benchmarks.tools.recorder")
spec = importlib.util.spec_from_file_location("kvpop_gpu_check", ROOT / "benchmarks" / "tools" / "gpu_check.py")
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)

LE = tg.Target("le", 1, "time ratio", key="ratio", op="<=", goal=0.5, device="cuda",
               file="benchmarks/test_x.py", test="test_a", where={"S": 16})
GE = tg.Target("ge", 1, "speedup", key="speedup", op=">=", goal=2, device="any", file="benchmarks/test_x.py")
FREE = tg.Target("free", 2, "by key", key="only_here", op=">=", goal=10, device="cpu")
REPORT = tg.Target("rep", 3, "reported", key="mem_ratio", op=None, goal=None, device="cuda")


def rec(test="test_a", outcome="passed", params=None, reason="", file="benchmarks/test_x.py", **info):
    params = {"S": 16} if params is None else params
    return {"nodeid": f"{file}::{test}[x]", "file": file, "test": test, "params": params, "outcome": outcome,
            "reason": reason, "extra_info": info}


def row(target, records, device="cuda"):
    return tg.verdict(target, records, device)


def test_met_and_not_met_both_directions():
    assert row(LE, [rec(ratio=0.4)])["status"] == tg.MET
    assert row(LE, [rec(ratio=0.5)])["status"] == tg.MET  # the goal itself is met
    r = row(LE, [rec(ratio=0.51)])
    assert (r["status"], r["value"]) == (tg.NOT_MET, 0.51)
    assert row(GE, [rec(speedup=2.0)])["status"] == tg.MET
    assert row(GE, [rec(speedup=1.99)])["status"] == tg.NOT_MET


def test_the_worst_of_several_records_counts():
    assert row(LE, [rec(ratio=0.1), rec(ratio=0.7), rec(ratio=0.2)])["value"] == 0.7
    assert row(GE, [rec(speedup=30), rec(test="test_b", speedup=3), rec(speedup=1.5)], "cpu")["value"] == 1.5


def test_where_filters_on_params_then_extra_info():
    assert row(LE, [rec(params={"S": 8}, ratio=0.1)])["status"] == tg.NOT_RUN
    assert row(LE, [rec(params={"S": 8}, ratio=0.1), rec(params={"S": 16}, ratio=0.9)])["value"] == 0.9
    assert row(LE, [rec(params={}, S=16, ratio=0.3)])["value"] == 0.3  # S in extra_info
    assert row(LE, [rec(params={"S": "16"}, ratio=0.3)])["value"] == 0.3  # ids given as strings
    assert row(LE, [rec(test="test_b", ratio=0.1)])["status"] == tg.NOT_RUN  # another test of the file
    assert row(LE, [rec(file="test_x.py", ratio=0.2)])["value"] == 0.2  # pytest run from benchmarks/
    assert row(LE, [rec(file="kvpop/benchmarks/test_x.py", ratio=0.3)])["value"] == 0.3  # from above
    assert row(LE, [rec(file="benchmarks/test_y.py", ratio=0.1)])["status"] == tg.NOT_RUN


def test_a_target_of_the_other_device_is_not_run_but_shows_the_figure():
    r = row(LE, [rec(ratio=0.1)], device="cpu")
    assert r["status"] == tg.NOT_RUN and r["value"] is None
    assert "GPU target" in r["note"] and "0.1" in r["note"]
    r = row(FREE, [rec(only_here=50)], device="cuda")
    assert r["status"] == tg.NOT_RUN and "CPU target" in r["note"]
    assert "GPU target" in row(LE, [], device="cpu")["note"]


@pytest.mark.parametrize("records, note", [
    ([], "did not run"),
    ([rec(outcome="skipped", reason="needs CUDA")], "skipped: needs CUDA"),
    ([rec(outcome="failed", reason="OutOfMemoryError")], "benchmark failed: OutOfMemoryError"),
    ([rec(outcome="passed")], "extra_info has no 'ratio'"),
    ([rec(outcome="passed", ratio="n/a")], "is not a number"),
    ([rec(outcome="passed", ratio=float("nan"))], "is not a number"),
])
def test_not_run_says_why(records, note):
    r = row(LE, records)
    assert r["status"] == tg.NOT_RUN and r["value"] is None
    assert note in r["note"]


def test_missing_file_and_unpinned_key_are_not_run(tmp_path):
    assert "does not exist" in tg.verdict(LE, [], "cuda", root=tmp_path)["note"]
    _fake_repo(tmp_path, "def test_a(benchmark):\n    benchmark.extra_info['only_here'] = 1\n")
    assert "written by test_x.py" in tg.verdict(FREE, [], "cpu", root=tmp_path)["note"]
    assert "no benchmark writes" in tg.verdict(REPORT, [], "cuda", root=tmp_path)["note"]
    r = row(FREE, [rec(test="anything", other=1)], "cpu")
    assert r["status"] == tg.NOT_RUN and "not written yet" in r["note"]
    r = row(FREE, [rec(file="benchmarks/test_new.py", test="t", only_here=12.5)], "cpu")
    assert (r["status"], r["value"]) == (tg.MET, 12.5)


def test_a_figure_without_a_goal_is_measured():
    r = row(REPORT, [rec(file="benchmarks/test_train.py", mem_ratio=0.4)])
    assert (r["status"], r["value"], r["goal"]) == (tg.MEASURED, 0.4, "report")


def test_markdown_has_a_row_per_target_and_the_counts():
    rows = tg.verdicts([rec(ratio=0.9), rec(speedup=3)], "cuda", targets=[LE, GE, FREE, REPORT])
    text = tg.markdown(rows, targets=[LE, GE, FREE, REPORT])
    body = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| target")]
    assert len(body) == 4
    assert "NOT MET" in body[0] and "0.9x" in body[0] and "<= 0.5x" in body[0]
    assert "| met |" in body[1]
    assert "0 met" not in text and "1 met, 1 not met, 0 measured without a goal, 2 not run" in text


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="op must be"):
        tg.Target("x", 1, "", key="k", op="<", goal=1, device="cuda")
    with pytest.raises(ValueError, match="go together"):
        tg.Target("x", 1, "", key="k", op="<=", goal=None, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        tg.Target("x", 1, "", key="k", op="<=", goal=1, device="gpu")
    with pytest.raises(ValueError, match="device must be"):
        tg.verdict(LE, [], "gpu")


def _fake_repo(tmp_path, text):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "test_x.py").write_text(text)
    return tmp_path


def test_check_registry_catches_what_rots(tmp_path):
    root = _fake_repo(tmp_path, "def test_a(benchmark):\n    benchmark.extra_info.update(ratio=1)\n"
                                "def test_b(benchmark):\n    benchmark.extra_info['speedup'] = 2\n")
    collected = ["benchmarks/test_x.py::test_a[x]", "benchmarks/test_x.py::test_b"]
    assert tg.check_registry(collected, root, [LE, GE]) == ([], [])
    problems, pending = tg.check_registry(collected[1:], root, [LE, GE, FREE])
    assert problems == ["le: pytest collects no benchmarks/test_x.py::test_a"]
    assert pending and "only_here" in pending[0]
    renamed = tg.Target("le", 1, "", key="ratio_new", op="<=", goal=1, device="cuda", file="benchmarks/test_x.py")
    gone = tg.Target("g", 1, "", key="ratio", op="<=", goal=1, device="cuda", file="benchmarks/test_gone.py")
    problems, _ = tg.check_registry(collected, root, [renamed, gone, GE, GE])
    assert any("never writes extra_info['ratio_new']" in p for p in problems)
    assert any("test_gone.py does not exist" in p for p in problems)
    assert any("two targets have this id" in p for p in problems)


def test_key_written_forms():
    assert tg._key_written("ratio", "info.update(ratio=t)")
    assert tg._key_written("ratio", 'info["ratio"] = 1')
    assert tg._key_written("ratio", "{'ratio': 1}")
    assert not tg._key_written("ratio", "info.update(ratio_64k=1)")
    assert not tg._key_written("ratio", "if ratio == 1: pass")


def test_the_real_registry_points_at_real_benchmarks():
    """Every pinned target's file exists and writes its key (the collection half runs in the CI dry run)."""
    pinned = [t for t in tg.TARGETS if t.file is not None]
    collected = [f"{t.file}::{t.test}" for t in pinned]
    problems, _pending = tg.check_registry(collected, ROOT)
    assert problems == []
    assert len({t.id for t in tg.TARGETS}) == len(tg.TARGETS)
    assert {t.issue for t in tg.TARGETS} >= {2, 3, 4, 6, 12, 13}


def test_check_reported_after_a_dry_run():
    recs = [rec(ratio=0.1), rec(test="test_b", speedup=3.0)]
    assert tg.check_reported(recs, "cuda", [LE, GE, FREE]) == []
    assert tg.check_reported([rec(params={"S": 8}, outcome="skipped")], "cpu", [LE]) == []  # other shapes on cpu
    assert "no record" in tg.check_reported([], "cpu", [LE])[0]
    assert "recorded no number" in tg.check_reported([rec(test="t", other=1)], "cpu", [GE])[0]
    assert "failed" in tg.check_reported([rec(outcome="failed")], "cpu", [GE])[0]


def test_autotune_cap_keeps_the_first_and_spreads():
    assert recorder.spread(8, 3) == [0, 4, 7]
    assert recorder.spread(6, 1) == [0]
    assert recorder.spread(2, 5) == [0, 1]
    with pytest.raises(ValueError, match="KVPOP_AUTOTUNE_MAX_CONFIGS"):
        recorder.spread(4, 0)
    triton = pytest.importorskip("triton")

    @triton.jit
    def kernel(X, BLOCK: triton.language.constexpr):
        pass

    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32, 64) for w in (4, 8)]
    tuned = triton.autotune(configs=configs, key=[])(kernel)
    mod = types.ModuleType("kvpop_kernels.fake")
    mod.tuned = tuned
    done = recorder.cap_autotuners(2, {"kvpop_kernels.fake": mod, "elsewhere": types.ModuleType("elsewhere")})
    assert done == ["kvpop_kernels.fake.tuned: 6 -> 2"]
    assert tuned.configs == [configs[0], configs[-1]]
    assert recorder.cap_autotuners(1, {"kvpop_kernels.fake": mod}) == []  # once only


def test_run_stage_stops_at_its_cap(tmp_path):
    code = ("import signal, sys, time; {}print('started', flush=True); time.sleep(60)")
    for ignore_int in ("", "signal.signal(signal.SIGINT, signal.SIG_IGN); "):
        t0 = time.monotonic()
        st = gc.run_stage("sleep", [sys.executable, "-c", code.format(ignore_int)], timeout=1.5, grace=1,
                          log=tmp_path / "log")
        assert st["timed_out"] and st["rc"] != 0
        assert time.monotonic() - t0 < 20
        assert "started" in (tmp_path / "log").read_text()
    st = gc.run_stage("quick", [sys.executable, "-c", "print('x')"], timeout=60)
    assert (st["timed_out"], st["rc"], st["output"]) == (False, 0, ["x\n"])


def test_read_records_keeps_every_whole_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"nodeid": "a", "outcome": "passed"}) + "\n" + '{"nodeid": "b", "outc')
    assert [r["nodeid"] for r in gc.read_records(p)] == ["a"]
    assert gc.read_records(tmp_path / "absent.jsonl") == []
    assert gc.outcome_counts([{"outcome": "passed"}, {"outcome": "skipped"}, {}]) == \
        {"passed": 1, "failed": 1, "skipped": 1}


def test_the_recorder_writes_each_benchmark_as_it_finishes(tmp_path):
    (tmp_path / "test_fake_bench.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('S', [16, 32])\n"
        "def test_a(benchmark, S):\n"
        "    benchmark.extra_info.update(ratio=S / 64, shape=(S, 'bf16'))\n"
        "    benchmark(lambda: None)\n"
        "def test_skip(benchmark):\n"
        "    pytest.skip('needs CUDA')\n"
        "def test_fail(benchmark):\n"
        "    benchmark.extra_info['speedup'] = 1\n"
        "    raise RuntimeError('boom')\n")
    out = tmp_path / "rec.jsonl"
    env = dict(os.environ, KVPOP_RECORDS=str(out), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.tools.gpu_plugin", "-p",
                          "no:cacheprovider", "--benchmark-disable", "test_fake_bench.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 1, res.stdout + res.stderr  # the failing test
    recs = {r["nodeid"].split("::")[1]: r for r in gc.read_records(out)}
    assert set(recs) == {"test_a[16]", "test_a[32]", "test_skip", "test_fail"}
    a = recs["test_a[32]"]
    assert (a["outcome"], a["test"], a["params"], a["extra_info"]["ratio"]) == ("passed", "test_a", {"S": 32}, 0.5)
    assert a["extra_info"]["shape"] == [32, "bf16"]
    assert (recs["test_skip"]["outcome"], recs["test_skip"]["reason"]) == ("skipped", "needs CUDA")
    assert recs["test_fail"]["outcome"] == "failed" and "boom" in recs["test_fail"]["reason"]
    assert recs["test_fail"]["extra_info"] == {"speedup": 1}


def test_median_interval_brackets_the_median_and_is_seeded():
    """``benchmarks.tools.timing.median_interval``: the same draws for the same seed, an interval around the sample
    median that narrows with agreeing rounds, a point for equal rounds, and a clear error for no rounds."""
    timing = importlib.import_module("benchmarks.tools.timing")
    xs = [0.95, 0.99, 0.97, 0.80, 0.96, 1.02, 0.94, 0.98, 0.93]
    lo, hi = timing.median_interval(xs, 2000, seed=0)
    assert lo <= sorted(xs)[4] <= hi and lo >= min(xs) and hi <= max(xs)
    assert (lo, hi) == timing.median_interval(xs, 2000, seed=0)
    assert lo > 0.9  # one slow round (0.80) does not pull the median's interval below the others
    assert timing.median_interval([0.9] * 5, 100) == (0.9, 0.9)
    wide = timing.median_interval([0.5, 1.5, 0.6, 1.4, 1.0], 2000, seed=0)
    assert wide[1] - wide[0] > hi - lo
    with pytest.raises(ValueError, match="at least one value"):
        timing.median_interval([], 10)
