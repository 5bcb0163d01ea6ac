"""Shared by ``tests/`` and ``benchmarks/``: the interpreter switch and the ``gpu`` marker.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function runs, so it is decided here, before any
kernel module is imported: without CUDA the Triton kernels run in Triton's CPU interpreter.  Tests
and benchmarks marked ``@pytest.mark.gpu`` are skipped without CUDA.
"""
import os

try:
    import torch as _torch

    HAS_CUDA = _torch.cuda.is_available()
except Exception:  # pragma: no cover
    HAS_CUDA = False
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on 2 CPU cores")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
