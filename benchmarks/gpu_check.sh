#!/usr/bin/env bash
# Every GPU check of kvpop in one command (gpu tests, then the benchmarks at the target shapes) under a
# hard time cap, ending in a verdict table; writes $OUT/gpu.json and $OUT/gpu.md.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh     # on a CUDA machine with the package installed (<= 8 min)
#   bash benchmarks/gpu_check.sh --dry            # CPU: check that every target is collected and reported
#
# Options go to benchmarks/tools/gpu_check.py (--help).  The driver stops each stage at its share of the cap
# (--time-cap, 450 s by default) and still writes its report; `timeout` here is only the backstop.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
exec timeout --kill-after=15 "${KVPOP_GPU_BACKSTOP_S:-540}" "$PY" benchmarks/tools/gpu_check.py "$@"
