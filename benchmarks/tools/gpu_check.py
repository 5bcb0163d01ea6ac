"""Every GPU check of kvpop in one command, under a hard time cap, ending in a verdict table.

    OUT=/tmp/gpu bash benchmarks/gpu_check.sh            # on a CUDA machine, the package installed
    bash benchmarks/gpu_check.sh --dry                    # anywhere: checks that every target is wired

A run has two stages, each a pytest process stopped at its share of the time cap (SIGINT, then SIGKILL):

1. ``pytest -m gpu tests/``: bf16/fp16 correctness of every kernel against ``reference.py``, the sm_90
   paths, decoding with ``KVpopCache``;
2. ``pytest benchmarks/ --benchmark-only``: the target shapes, the benchmarks of ``benchmarks/tools/targets.py``
   first, the others while time remains.

Autotuning is bounded (``KVPOP_AUTOTUNE_MAX_CONFIGS``: 1 config per kernel in the tests, 3 in the
benchmarks) and Triton's and inductor's caches live in ``--cache-dir`` (default
``/tmp/kvpop-gpu-cache``), so the benchmarks reuse what the tests compiled and a second run on the same
machine compiles nothing.  Every finished test is appended to ``$OUT/*.jsonl`` at once, and
``$OUT/gpu.json`` / ``$OUT/gpu.md`` are rewritten after each stage: a run cut short keeps what it did.

``--dry`` (CI, on the CPU, seconds): collects the ``gpu`` tests, runs the target benchmarks once with
``--benchmark-disable`` at their CPU shapes and fails when a target is not collected, not reported or no
longer written by its benchmark (``targets.check_registry`` / ``check_reported``); the GPU rows read
"not run".

Exit status: 0 when every stage finished without a failed test (and, dry, the registry is sound); 1
otherwise.  A target that is *not met* does not change it: read the table.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

tg = importlib.import_module("benchmarks.tools.targets")

GRACE_S = 20  # after SIGINT, what pytest gets to write its summary before SIGKILL
REPORT_S = 10  # kept at the end of the cap to write the report
BENCH_MIN_S = 60  # the tests' cap leaves at least this to the benchmarks
DEADLINE_ENV = "KVPOP_BENCH_DEADLINE"  # unix time at which the benchmarks stage is stopped (set for it)


# ----------------------------------------------------------------------------- environment
def environment() -> dict:
    """Machine, GPU, driver and library versions (run in a child process: no CUDA context here)."""
    import importlib.metadata as md

    env = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
           "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    versions = {}
    for dist in ("torch", "triton", "transformers", "pytest", "pytest-benchmark", "kvpop"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    env["versions"] = versions
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
        env["git_commit"] = git.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
        env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    import torch

    env["torch_cuda"] = torch.version.cuda
    env["cuda"] = torch.cuda.is_available()
    env["gpus"] = []
    if env["cuda"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                                "memory_gib": round(p.total_memory / 2**30, 1)})
    return env


def child_environment(timeout: float = 120) -> dict:
    try:
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--print-env"], capture_output=True,
                             text=True, timeout=timeout, cwd=ROOT, check=False)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"error": f"environment not read: {e!r}"[:300], "cuda": False, "gpus": []}


# ----------------------------------------------------------------------------- stages
def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGINT to the process group (pytest then prints its summary), SIGKILL if it is still there."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_stage(name: str, cmd: list[str], *, timeout: float, env: dict | None = None,
              log: Path | None = None, cwd: Path = ROOT, grace: float = GRACE_S) -> dict:
    """Run ``cmd`` in its own process group, its output streamed here and into ``log``; stop it at
    ``timeout`` seconds (SIGINT to the group, SIGKILL ``grace`` seconds later)."""
    t0 = time.monotonic()
    print(f"\n=== {name}: {' '.join(cmd)}  (cap {timeout:.0f} s)", flush=True)
    with contextlib.ExitStack() as stack:
        logf = stack.enter_context(open(log, "w")) if log is not None else None
        proc = stack.enter_context(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, text=True, bufsize=1,
                                                    start_new_session=True))
        lines: list[str] = []

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                lines.append(line)
                if logf is not None:
                    logf.write(line)
                    logf.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            print(f"\n=== {name}: time cap of {timeout:.0f} s reached, stopping it", flush=True)
            _stop(proc, grace)
        reader.join(timeout=10)
    return {"name": name, "cmd": cmd, "rc": proc.returncode, "timed_out": timed_out,
            "wall_s": round(time.monotonic() - t0, 1), "output": lines}


def read_records(path: Path) -> list[dict]:
    """The JSON lines a stage wrote (a line cut by a kill is dropped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def outcome_counts(records: list[dict]) -> dict:
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for r in records:
        c[r.get("outcome", "failed")] = c.get(r.get("outcome", "failed"), 0) + 1
    return c


def collected_ids(lines: list[str]) -> list[str]:
    """Node ids in the output of ``pytest --collect-only -q``."""
    return [ln.strip() for ln in lines if "::" in ln and not ln.startswith(("ERROR", "FAILED", "=", " "))]


def target_nodes(ids: list[str] | None = None) -> list[str]:
    """The pinned target benchmarks as pytest node ids (``file::test``), each once, in registry order (only those of
    the target ``ids`` when given; ``ValueError`` naming the known ids for one that is not a target)."""
    known = [t.id for t in tg.TARGETS]
    unknown = [i for i in ids or () if i not in known]
    if unknown:
        raise ValueError(f"not a target id: {', '.join(unknown)} (the targets: {', '.join(known)})")
    nodes = []
    for t in tg.TARGETS:
        if ids is not None and t.id not in ids:
            continue
        if t.file is not None and (ROOT / t.file).exists():
            node = t.file + (f"::{t.test}" if t.test else "")
            if node not in nodes:
                nodes.append(node)
    return nodes


# ----------------------------------------------------------------------------- report
def _stage_text(s: dict) -> str:
    if s.get("skipped"):
        return f"not started: {s['skipped']}"
    c = s.get("counts")
    res = ", ".join(f"{v} {k}" for k, v in c.items()) if c else f"{s.get('collected', 0)} collected"
    cap = ", STOPPED AT ITS TIME CAP" if s.get("timed_out") else ""
    return f"{res} (pytest exit {s.get('rc')}{cap})"


def markdown_report(report: dict) -> str:
    env = report["env"]
    gpus = ", ".join(f"{g['name']} (sm_{g['capability'].replace('.', '')}, {g['memory_gib']} GiB)"
                     for g in env.get("gpus", [])) or "none"
    v = env.get("versions", {})
    versions = (f"torch {v.get('torch')}, triton {v.get('triton')}, transformers {v.get('transformers')}, "
                f"pytest-benchmark {v.get('pytest-benchmark')}; python {env.get('python')}; "
                f"commit {env.get('git_commit') or '?'}")
    caps = (f"time cap {report['time_cap_s']} s, used {report['wall_s']} s; autotune configs per kernel: "
            f"tests {report['max_configs']['tests']}, benchmarks {report['max_configs']['benchmarks']}")
    lines = [f"# kvpop GPU check{' (dry run)' if report['dry'] else ''}: {env.get('date_utc', '?')}", "",
             f"- GPU: {gpus}; driver {env.get('driver') or '-'}; CUDA (torch) {env.get('torch_cuda') or '-'}",
             f"- {versions}", f"- command: `{report['command']}`; {caps}", "",
             "| stage | result | time |", "|---|---|---|"]
    for s in report["stages"]:
        lines.append(f"| {s['name']} | {_stage_text(s)} | {s.get('wall_s', 0)} s |")
    lines += ["", "## Verdicts", "", tg.markdown(report["verdicts"])]
    if report.get("failures"):
        lines += ["", "## Failed tests", ""] + [f"- `{f['nodeid']}`: {f['reason']}" for f in report["failures"]]
    if report.get("problems"):
        lines += ["", "## Registry problems", ""] + [f"- {p}" for p in report["problems"]]
    if report.get("pending"):
        lines += ["", "## Pending targets (no benchmark writes their key yet)", ""]
        lines += [f"- {p}" for p in report["pending"]]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    (out / "gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu.md").write_text(markdown_report(report))


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/kvpop-gpu-check",
                    help="folder for gpu.json, gpu.md, logs and records (default: $OUT, else /tmp/kvpop-gpu-check)")
    ap.add_argument("--dry", action="store_true", help="CPU check that every target is collected and reported")
    ap.add_argument("--time-cap", type=float, default=450, help="seconds for the whole run (default 450)")
    ap.add_argument("--tests-cap", type=float, default=150, help="seconds for the gpu tests (default 150)")
    ap.add_argument("--max-configs", type=int, default=3, help="autotune configs per kernel in the benchmarks")
    ap.add_argument("--max-configs-tests", type=int, default=1, help="autotune configs per kernel in the tests")
    ap.add_argument("--cache-dir", default=os.environ.get("KVPOP_GPU_CACHE", "/tmp/kvpop-gpu-cache"),
                    help="Triton and inductor caches (default /tmp/kvpop-gpu-cache)")
    ap.add_argument("--benchmark-max-time", type=float, default=0.5, help="pytest-benchmark's --benchmark-max-time")
    ap.add_argument("--targets-only", action="store_true", help="run only the target benchmarks")
    ap.add_argument("--targets", default=None, metavar="ID[,ID...]",
                    help="run only the benchmarks of these targets (ids of benchmarks/tools/targets.py, e.g. "
                         "e2e-decode-b1,e2e-decode-b32,train-step-16k); implies --targets-only")
    ap.add_argument("--skip-tests", action="store_true", help="no gpu tests, benchmarks only")
    ap.add_argument("--cpu-ok", action="store_true", help="allow a full (not dry) run without CUDA")
    ap.add_argument("--print-env", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.print_env:
        print(json.dumps(environment()))
        return 0
    for name in ("time_cap", "tests_cap", "benchmark_max_time"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("max_configs", "max_configs_tests"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    only = None
    if args.targets is not None:
        only = [i.strip() for i in args.targets.split(",") if i.strip()]
        try:
            if not target_nodes(only):
                raise ValueError(f"the targets {', '.join(only)} have no benchmark file")
        except ValueError as e:
            ap.error(f"--targets: {e}")
        args.targets_only = True

    t_start = time.monotonic()
    deadline = t_start + args.time_cap
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir)
    env = child_environment()
    device = "cuda" if env.get("cuda") else "cpu"
    if device == "cpu" and not (args.dry or args.cpu_ok):
        print("gpu_check: no CUDA device here. Run it on a GPU machine, or `--dry` to check the wiring on the CPU "
              "(`--cpu-ok` runs everything on the CPU).", file=sys.stderr)
        return 2
    report = {"dry": args.dry, "command": " ".join(["benchmarks/gpu_check.sh"] + (argv if argv is not None
                                                                                  else sys.argv[1:])),
              "env": env, "device": device, "time_cap_s": args.time_cap, "wall_s": 0,
              "max_configs": {"tests": args.max_configs_tests, "benchmarks": args.max_configs},
              "cache_dir": str(cache), "stages": [], "verdicts": tg.verdicts([], device, ROOT),
              "failures": [], "problems": [], "pending": []}
    write_report(out, report)

    base_env = dict(os.environ)
    base_env.update(TRITON_CACHE_DIR=str(cache / "triton"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
                    TRITON_CACHE_AUTOTUNING="1", PYTHONUNBUFFERED="1")
    base_env.pop("KVPOP_RECORDS", None)
    # the checkout is importable even where the package is not installed (a device image with its deps)
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # a module that cannot be imported (a missing test dependency) costs its own tests, not the stage
    py = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    failed = False

    def left() -> float:
        return deadline - time.monotonic()

    # ---- stage 1: the gpu tests
    t_rec = out / "tests.jsonl"
    t_rec.unlink(missing_ok=True)
    st_env = dict(base_env, KVPOP_RECORDS=str(t_rec), KVPOP_AUTOTUNE_MAX_CONFIGS=str(args.max_configs_tests))
    cmd = py + ["-m", "gpu", "tests/", "-p", "benchmarks.tools.gpu_plugin"] + (["--collect-only"] if args.dry else [])
    if args.skip_tests:
        stage = {"name": "gpu tests", "skipped": "--skip-tests"}
    elif min(args.tests_cap, left() - REPORT_S - 2 * GRACE_S - BENCH_MIN_S) < 10:
        stage = {"name": "gpu tests", "skipped": "time cap"}
    else:
        cap = min(args.tests_cap, left() - REPORT_S - 2 * GRACE_S - BENCH_MIN_S)
        stage = run_stage("gpu tests", cmd, timeout=cap, env=st_env, log=out / "tests.log")
        recs = read_records(t_rec)
        if args.dry:
            stage["collected"] = len(collected_ids(stage["output"]))
            if stage["rc"] != 0 or stage["collected"] == 0:
                report["problems"].append(f"`pytest -m gpu tests/ --collect-only` collected {stage['collected']} "
                                          f"tests (exit {stage['rc']})")
        else:
            stage["counts"] = outcome_counts(recs)
            report["failures"] += [{"nodeid": r["nodeid"], "reason": r.get("reason", "")}
                                   for r in recs if r.get("outcome") == "failed"]
            failed |= stage["rc"] not in (0, 5) or stage["timed_out"]
    stage.pop("output", None)
    report["stages"].append(stage)
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    write_report(out, report)

    # ---- stage 2: the benchmarks (the targets first)
    b_rec = out / "benchmarks.jsonl"
    b_rec.unlink(missing_ok=True)
    sb_env = dict(base_env, KVPOP_RECORDS=str(b_rec), KVPOP_AUTOTUNE_MAX_CONFIGS=str(args.max_configs),
                  KVPOP_TARGETS_FIRST="1")
    where = target_nodes(only) if (args.dry or args.targets_only) else ["benchmarks/"]
    if args.dry:
        cmd = py + where + ["--benchmark-disable"]
    else:
        cmd = py + where + ["--benchmark-only", f"--benchmark-max-time={args.benchmark_max_time}",
                            f"--benchmark-json={out / 'benchmarks.json'}"]
    if not args.dry and not env.get("versions", {}).get("pytest-benchmark"):
        stage = {"name": "benchmarks", "skipped": "pytest-benchmark is not installed (pip install pytest-benchmark)"}
        recs, failed = [], True
    elif left() - REPORT_S - GRACE_S < 20:
        stage = {"name": "benchmarks", "skipped": "time cap"}
        recs = []
    else:
        # the benchmarks that budget themselves (benchmarks/test_e2e.py) read when this stage will be stopped and
        # do not start a case that would pass it (the row then reads "not run" with the reason)
        sb_env[DEADLINE_ENV] = f"{time.time() + left() - REPORT_S - GRACE_S:.1f}"
        stage = run_stage("benchmarks", cmd, timeout=left() - REPORT_S - GRACE_S, env=sb_env,
                          log=out / "benchmarks.log")
        stage.pop("output", None)
        recs = read_records(b_rec)
        stage["counts"] = outcome_counts(recs)
        report["failures"] += [{"nodeid": r["nodeid"], "reason": r.get("reason", "")}
                               for r in recs if r.get("outcome") == "failed"]
        failed |= stage["rc"] not in (0, 5) or stage["timed_out"]
    report["stages"].append(stage)

    # ---- verdicts and checks
    report["verdicts"] = tg.verdicts(recs, device, ROOT)
    problems, report["pending"] = tg.check_registry([r["nodeid"] for r in recs], ROOT)
    if args.dry:
        # with --targets only the chosen targets' benchmarks ran: only theirs must be collected and have reported
        chosen = [t for t in tg.TARGETS if only is None or t.id in only]
        problems = [p for p in problems if "collects no" not in p or p.split(":", 1)[0] in {t.id for t in chosen}]
        problems += tg.check_reported(recs, device, chosen)
    elif args.targets_only or stage.get("timed_out"):
        problems = [p for p in problems if "collects no" not in p]  # not everything was meant to run
    report["problems"] += problems
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    write_report(out, report)
    print("\n" + markdown_report(report), flush=True)
    print(f"written: {out / 'gpu.json'}, {out / 'gpu.md'}", flush=True)
    return 1 if failed or (args.dry and report["problems"]) else 0


if __name__ == "__main__":
    sys.exit(main())
