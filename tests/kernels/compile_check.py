"""Compiling kernels for a GPU target in a process without Triton's interpreter (no GPU needed)."""
import pytest

PREAMBLE = r"""
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as exc:
    print(json.dumps({"skip": repr(exc)})); sys.exit(0)
"""
"""The start of a compile script: Triton's compiler API, or a ``{"skip": ...}`` line when it is not reachable."""


def run_without_interpreter(script: str, *args: str, timeout: float = 900) -> dict:
    """Run ``script`` (Python source that prints one JSON line last) in a fresh process without
    ``TRITON_INTERPRET``, with the repository on ``PYTHONPATH``; return the parsed line.  Skips the test
    when the script reports ``{"skip": ...}`` (Triton's compiler API not reachable)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(f"Triton's compiler API is not reachable: {res['skip']}")
    return res
