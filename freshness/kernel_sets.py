"""The CPU kernel sets one machine can run, and the bands of the figures that move with them.

PyTorch picks its vectorised CPU kernels by ``ATEN_CPU_CAPABILITY`` (``default``: none, ``avx2``,
``avx512``; the machine's best when unset) and MKL its matrix kernels by ``MKL_CBWR`` (``COMPATIBLE``: the
portable path).  Both are read when torch loads, so each kernel set is a fresh process.  Another CPU kind
(another vendor, another vector width) sums in yet another order; running the same figure under every kernel
set of one machine measures how far that order moves it (docs/DESIGN.md section 14).

``python -m freshness.kernel_sets walkthrough`` runs the README's walkthrough block under each set and prints
the per-row band the README states (1.5 x the largest move from the default set's table, rounded up);
``python -m freshness.kernel_sets demo --out DIR`` runs ``kvpop demo --task all`` under each set other than the
machine's default and writes the demo's ``bands.json`` (``kvpop.demo.reproduce``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KERNEL_SETS: tuple[tuple[str, dict[str, str]], ...] = (
    ("avx512", {"ATEN_CPU_CAPABILITY": "avx512"}),
    ("avx2", {"ATEN_CPU_CAPABILITY": "avx2"}),
    ("default", {"ATEN_CPU_CAPABILITY": "default"}),
    ("avx512+mkl-compatible", {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "COMPATIBLE"}),
    ("avx2+mkl-compatible", {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}),
)
"""Every kernel set measured: ATen's three vector widths, and MKL's portable path under two of them."""
MARGIN = 1.5
"""A stated band is this many times the largest move measured (another CPU kind is not one of these sets)."""


def kernel_set() -> dict[str, str]:
    """The kernel set this process runs: ATen's capability, MKL's ``MKL_CBWR``, the CPU's model name, torch's
    version (what ``freshness`` records beside a shipped figure)."""
    import platform

    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"aten_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "mkl_cbwr": os.environ.get("MKL_CBWR", ""), "cpu": cpu, "torch": torch.__version__}


def env_of(name: str) -> dict[str, str]:
    """The environment of the kernel set ``name`` (this process's, with its variables set)."""
    sets = dict(KERNEL_SETS)
    if name not in sets:
        raise ValueError(f"unknown kernel set {name!r}; the sets are {', '.join(sets)}")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    return {**env, **sets[name], "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------ the README walkthrough's tables
_NUM = re.compile(r"[-+]?\d+(?:\.\d+)?")


def table_numbers(table: str) -> dict[str, list[float]]:
    """The walkthrough's tables as ``{row label: [numbers]}``: the NLL table's rows by policy, the DMS table's by
    budget (prefixed ``entries ``); header and separator rows dropped."""
    out: dict[str, list[float]] = {}
    for line in table.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("policy", "budget"):
            continue
        label = cells[0] if not cells[0].startswith("B=") else f"entries {cells[0]}"
        start = 2 if not label.startswith("entries") else 1
        out[label] = [float(x) for c in cells[start:] for x in _NUM.findall(c)]
    return out


def walkthrough_bands(tables: Mapping[str, str], reference: str = "avx512") -> dict[str, float]:
    """Per row label, ``MARGIN`` x the largest ``|number - reference's|`` over the kernel sets' tables, rounded
    up (NLL rows to 0.01, agreement folded in: one band per row; the DMS table to whole entries)."""
    ref = table_numbers(tables[reference])
    moves: dict[str, float] = {}
    for name, table in tables.items():
        for label, nums in table_numbers(table).items():
            if label not in ref or len(nums) != len(ref[label]):
                raise ValueError(f"kernel set {name}: row {label!r} has another shape than {reference}'s")
            d = max((abs(a - b) for a, b in zip(nums, ref[label])), default=0.0)
            moves[label] = max(moves.get(label, 0.0), d)
    step = {True: 1.0, False: 0.01}
    return {k: math.ceil(MARGIN * v / step[k.startswith("entries")] - 1e-9) * step[k.startswith("entries")]
            for k, v in moves.items()}


def _walkthrough(name: str, out: Path) -> str:
    code = ("import sys; sys.path[:0] = [sys.argv[2], sys.argv[2] + '/tests']; import os, pathlib, re, torch; "
            "os.environ['TRITON_INTERPRET'] = '0'; from test_readme import _run_walkthrough, README, WALKTHROUGH; "
            "from kvpop.cli import main; tmp = pathlib.Path(sys.argv[1]); tmp.mkdir(parents=True, exist_ok=True); "
            "os.chdir(tmp); torch.set_num_threads(1); "
            "block = [b for b in re.findall(r'```bash\\n(.*?)```', README.read_text(), flags=re.S) "
            "if b.startswith(WALKTHROUGH)][0]; _run_walkthrough(block, main, tmp)")
    subprocess.run([sys.executable, "-c", code, str(out), str(ROOT)], env=env_of(name), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return (out / "eval-out" / "table.md").read_text(encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m freshness.kernel_sets", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    w = sub.add_parser("walkthrough", help="the README walkthrough under every kernel set; prints its bands")
    w.add_argument("--out", type=Path, default=Path("kernel-sets-walkthrough"))
    d = sub.add_parser("demo", help="kvpop demo under every non-default kernel set; writes bands.json")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--reference", type=Path, default=None,
                   help="the runs to measure moves from (default: the shipped results)")
    d.add_argument("--write", type=Path, default=None, help="where to write bands.json (default: print it)")
    d.add_argument("--sets", default=",".join(n for n, _ in KERNEL_SETS[1:]),
                   help="the kernel sets to run, comma-separated (default: every set but avx512, the reference)")
    args = ap.parse_args(argv)
    if args.what == "walkthrough":
        tables = {}
        for name, _ in KERNEL_SETS:
            tables[name] = _walkthrough(name, args.out / name)
            print(f"{name}:\n{tables[name]}", flush=True)
        print(json.dumps(walkthrough_bands(tables), indent=1))
        return 0
    from kvpop.demo.reproduce import SHIPPED, exact_moves, measure_bands, measured_moves

    ref_dir = args.reference or SHIPPED
    runs: dict[str, dict] = {}
    names = [n.strip() for n in args.sets.split(",") if n.strip()]
    for name in names:
        env_of(name)  # an unknown name is refused before any run
        out = args.out / name
        if not all((out / t / "results.json").is_file() for t in ("kvtrace", "lookahead")):
            subprocess.run([sys.executable, "-m", "kvpop", "demo", "--task", "all", "--out", str(out), "--threads",
                            "1", "--no-progress", *(["--resume"] if out.exists() else [])], env=env_of(name),
                           check=True)
        runs[name] = {t: json.loads((out / t / "results.json").read_text()) for t in ("kvtrace", "lookahead")}
    bands, moves, moved = {}, {}, {}
    for t in ("kvtrace", "lookahead"):
        shipped = json.loads((ref_dir / t / "results.json").read_text())
        bands[t] = measure_bands([r[t] for r in runs.values()], shipped)
        moves[t] = {n: {p: round(d, 4) for p, d in measured_moves([r[t]], shipped).items()} for n, r in runs.items()}
        moved[t] = exact_moves([r[t] for r in runs.values()], shipped)
    command = (f"python -m freshness.kernel_sets demo --out DIR --sets {','.join(names)} --write "
               "kvpop/data/demo_results/bands.json")
    record = {"rule": "docs/DESIGN.md section 14", "kernel_sets": names, "reference": kernel_set(),
              "command": command, "bands": bands, "moves": moves, "exact_rows_moved": moved}
    text = json.dumps(record, indent=1) + "\n"
    if args.write:
        args.write.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
