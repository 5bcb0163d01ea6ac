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
    ([rec(outcome="passed", not_run="ctx 32k: time cap: needs ~50 s")], "(not run: ctx 32k: time cap: needs ~50 s)"),
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


# ----------------------------------------------------------------------------- roofline (issue 60)
rl = importlib.import_module("benchmarks.tools.roofline")


@pytest.mark.parametrize("name, label", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB"), ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("NVIDIA A10", "A10"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None), ("NVIDIA L40", None), ("NVIDIA A10G", None), ("Tesla T4", None),
    ("cpu", None), ("", None), (None, None),
])
def test_device_peaks_by_name(name, label):
    peak = rl.device_peak(name)
    assert (peak.label if peak else None) == label


def test_roofline_fractions_by_hand():
    r = rl.roofline(3.35e9, 0, 2e-3, "NVIDIA H100 80GB HBM3")  # 3.35 GB in 2 ms on 3350 GB/s: half the floor
    assert r["gb_per_s"] == pytest.approx(1675) and r["tflops"] == 0
    assert (r["bound"], r["peak"]) == ("memory", "H100 SXM")
    assert r["fraction"] == pytest.approx(0.5) and r["bw_fraction"] == pytest.approx(0.5) and r["flop_fraction"] == 0
    r = rl.roofline(4.8e6, 9.89e11, 2e-3, "NVIDIA H200")  # 1 ms of bf16 math, 1 us of bytes
    assert (r["bound"], r["tflops"]) == ("compute", pytest.approx(494.5))
    assert r["fraction"] == pytest.approx(0.5) and r["bw_fraction"] == pytest.approx(0.0005)
    r = rl.roofline(1e6, 1e9, 1e-3, "cpu")
    assert r["gb_per_s"] == pytest.approx(1.0) and r["tflops"] == pytest.approx(1.0)
    assert r["fraction"] == r["bound"] == r["peak"] == rl.UNKNOWN and r["peak_gb_per_s"] is None
    assert "unknown" in rl.summary(r) and "cpu" in rl.summary(r)
    line = rl.summary(rl.roofline(8.4e6, 0, 19.9e-6, "NVIDIA H200"))
    assert "8.4 MB" in line and "19.9 us" in line and "422.1 GB/s" in line
    assert "8.79% of H200 SXM's roofline (memory-bound" in line
    for bad in ((-1, 0, 1), (0, float("nan"), 1), (0, 0, 0), (True, 0, 1)):
        with pytest.raises(ValueError, match="roofline"):
            rl.roofline(*bad, "NVIDIA H200")


def test_record_puts_the_main_provider_in_the_table_line():
    info = {}
    rl.record(info, "dense", 1e6, 0, 1e-3, "NVIDIA L4")
    assert "roofline" not in info and info["roofline_detail"]["dense"]["peak"] == "L4"
    rl.record(info, "kvpop", 3e8, 0, 1e-3, "NVIDIA L4", main=True)
    assert info["roofline"].startswith("kvpop: 300 MB") and "100% of L4's roofline" in info["roofline"]
    assert set(info["roofline_detail"]) == {"dense", "kvpop"}


def test_byte_and_flop_counts_by_hand():
    # one decode step, hq=2 / hkv=1, d=8, B=8 (k=3), bf16: per slot 2*8*2 + 4 (position) bytes, 4 per priority;
    # q, k/v new, leaving priority 68; output and lse 40; the replaced slot 40
    assert rl.decode_step_cost(batch=1, hq=2, hkv=1, d=8, slots=8, k_lr=3, elt=2) == (8 * 36 + 12 + 68 + 40 + 40, 512)
    # int8 slots with two float32 scales each: 16 + 4 + 8 per slot; the new token read in bf16 (quantised in the
    # launch), its slot written as codes and scales
    assert rl.decode_step_cost(batch=1, hq=2, hkv=1, d=8, slots=8, k_lr=3, elt=2, code_elt=1,
                               scales=True) == (8 * 28 + 12 + 68 + 40 + 32, 512)
    # head-adaptive (packed) budgets of the same total move the same bytes and FLOPs as uniform ones
    packed = rl.decode_step_cost(batch=3, hq=4, hkv=2, d=8, slots=(4, 12), k_lr=(1, 9), elt=2)
    assert packed == rl.decode_step_cost(batch=3, hq=4, hkv=2, d=8, slots=8, k_lr=5, elt=2) == (3 * 912, 3 * 1024)
    with pytest.raises(ValueError, match="one budget and one k per head"):
        rl.decode_step_cost(batch=1, hq=4, hkv=2, d=8, slots=(4,), k_lr=1, elt=2)
    assert rl.dense_decode_cost(batch=2, hq=4, hkv=2, d=8, keys=10, elt=2) == (1664, 2560)
    # causal attention, hq=2 / hkv=1, S=4, d=8, bf16: 20 visible pairs
    assert rl.causal_attention_cost(batch=1, hq=2, hkv=1, s=4, d=8, elt=2) == (416, 640)
    assert rl.causal_attention_cost(batch=1, hq=2, hkv=1, s=4, d=8, elt=2, backward=True) == (1216, 2240)
    assert rl.causal_attention_cost(batch=1, hq=2, hkv=1, s=4, d=8, elt=2, pairs=6)[1] == 4 * 8 * 6
    assert rl.target_cost(batch=1, hq=2, hkv=1, s=4, d=8, elt=2, pairs=6) == (240, 96)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        rl.dense_decode_cost(batch=1, hq=4, hkv=2, d=8, keys=-1, elt=2)


def test_model_counts_match_a_real_qwen3():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=4, vocab_size=10, tie_word_embeddings=False)
    shape = rl.ModelShape.of(cfg)
    assert (shape.layer_matmul_params, shape.matmul_params, shape.params) == (576, 1232, 1368)
    model = transformers.Qwen3ForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == shape.params
    assert rl.ModelShape.of(cfg.to_dict()) == shape
    # one decode step of 2 rows, 5 keys per head, 100 cache bytes: weights once, per row the embedding row, the
    # float32 logits and 2 layers' new key/value
    assert rl.model_decode_cost(shape, batch=2, keys_per_head=5, cache_bytes=100, elt=2) == (2740, 5568)
    assert rl.train_step_cost(shape, s=4, pairs_per_head=10) == (16416, 31808)
    assert rl.train_step_cost(shape, s=4, pairs_per_head=10, teacher_elt=2) == (19152, 42304)
    torch = pytest.importorskip("torch")
    assert rl.tensor_bytes(torch.zeros(3, 4, dtype=torch.bfloat16), None, torch.zeros(5, dtype=torch.int32)) == 44


def test_the_verdict_table_shows_the_roofline_beside_the_figure():
    line = "kvpop: 8.4 MB, 0 FLOP in 19.9 us: 422 GB/s | 8.8% of H200 SXM's roofline"
    r = row(LE, [rec(ratio=0.4, roofline=line)])
    assert r["roofline"] == line
    text = tg.markdown([r], targets=[LE])
    assert "| roofline |" in text.splitlines()[0] and "19.9 us" in text and "422 GB/s \\| 8.8%" in text
    assert row(LE, [rec(ratio=0.4)])["roofline"] == "" and "| met | - |" in tg.markdown([row(LE, [rec(ratio=0.4)])],
                                                                                      targets=[LE])


def test_every_gpu_benchmark_of_a_target_records_its_roofline():
    """Each benchmark file behind a GPU target writes ``roofline`` (checked statically, as the keys are)."""
    files = {t.file for t in tg.TARGETS if t.device == "cuda" and t.file is not None}
    assert "benchmarks/test_e2e.py" in files
    missing = [f for f in sorted(files) if "rl.record(" not in (ROOT / f).read_text()]
    assert missing == []


# ----------------------------------------------------------------------------- end to end (issue 60)
def test_e2e_targets_are_registered():
    ids = {t.id: t for t in tg.TARGETS}
    for key in ("e2e-decode-b1", "e2e-decode-b32", "e2e-decode-b32-memory", "train-step-16k"):
        assert ids[key].device == "cuda" and ids[key].file == "benchmarks/test_e2e.py" and ids[key].issue == 60
    assert (ids["e2e-decode-b32"].op, ids["e2e-decode-b32"].goal, ids["e2e-decode-b32"].where) == (">=", 3,
                                                                                                   {"batch": 32})
    assert (ids["train-step-16k"].op, ids["train-step-16k"].goal) == ("<=", 1.3)
    assert "benchmarks/test_e2e.py::test_e2e_decode" in gc.target_nodes()


def test_e2e_layers_and_time_cap(monkeypatch):
    e2e = importlib.import_module("benchmarks.test_e2e")
    monkeypatch.setattr(e2e, "MEMORY_FRACTION", 1.0)
    monkeypatch.setattr(e2e, "HEADROOM_BYTES", 0)
    tiny = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=4, vocab_size=10)
    # embeddings, LM head and norms: 216 elements; a layer 576 + a dense cache of 1 x 10 tokens (2*10*4) in bf16;
    # one more layer's cache for DynamicCache's concatenation
    need2 = 2 * 216 + 160 + 2 * (2 * 576 + 160)
    assert e2e.layers_for(1, 10, need2, tiny, elt=2) == 2
    assert e2e.layers_for(1, 10, need2 - 1, tiny, elt=2) == 1
    assert e2e.layers_for(1, 10, 100, tiny, elt=2) == 0
    assert e2e.layers_for(1, 10, 10**9, tiny, elt=2) == 2  # never more than the model's
    # Qwen3-8B on an 80 GB H100 (torch's total_memory) at the GPU run's fraction and headroom: 36 layers at batch 1,
    # 36 / 11 / 2 at batch 32 (weights 0.39 GB a layer; the dense cache of 32 x 32K tokens 4.3 GB a layer)
    monkeypatch.setattr(e2e, "MEMORY_FRACTION", 0.75)
    monkeypatch.setattr(e2e, "HEADROOM_BYTES", 4 * 2**30)
    h100 = 85_031_714_816
    assert [e2e.layers_for(1, c, h100, e2e.QWEN3_8B, elt=2) for c in (8192, 32768, 131072)] == [36, 36, 36]
    assert [e2e.layers_for(32, c, h100, e2e.QWEN3_8B, elt=2) for c in (8192, 32768, 131072)] == [36, 11, 2]
    monkeypatch.delenv(e2e.DEADLINE_ENV, raising=False)
    assert e2e.time_left() is None and e2e.fits_in_time(1e9) is None
    monkeypatch.setenv(e2e.DEADLINE_ENV, str(time.time() + 100))
    assert e2e.fits_in_time(10) is None
    assert "time cap: needs ~500 s" in e2e.fits_in_time(500)
    assert e2e.DEADLINE_ENV == gc.DEADLINE_ENV  # the name the driver sets for its benchmarks stage
    monkeypatch.setenv(e2e.DEADLINE_ENV, "soon")
    with pytest.raises(ValueError, match="unix time"):
        e2e.time_left()


def test_targets_option_selects_their_benchmarks(capsys):
    assert gc.target_nodes(["train-step-16k", "e2e-decode-b1", "e2e-decode-b32"]) == [
        "benchmarks/test_e2e.py::test_e2e_decode", "benchmarks/test_e2e.py::test_train_step_16k"]
    assert gc.target_nodes() == gc.target_nodes([t.id for t in tg.TARGETS])
    with pytest.raises(ValueError, match="not a target id: e2e-decode-b64 .the targets: schedule-vs-sdpa"):
        gc.target_nodes(["e2e-decode-b64"])
    with pytest.raises(SystemExit) as e:
        gc.main(["--targets", "nope", "--dry"])
    assert e.value.code == 2 and "--targets: not a target id: nope" in capsys.readouterr().err
