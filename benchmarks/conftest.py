"""Benchmark harness.

Run on a GPU as ``pytest benchmarks/ --benchmark-only`` (Qwen3-8B shapes, bf16).  Without CUDA
the same files run small shapes through the PyTorch CPU path (the Triton interpreter is a
correctness tool, not something to time); CI runs them once with ``--benchmark-disable``.
The ``gpu`` marker and the interpreter switch live in the repository's root ``conftest.py``.
Every session ends with the verdict table of ``benchmarks/tools/targets.py`` (``benchmarks/tools/recorder.py``).
"""
import pytest
import torch

import kvpop_kernels._utils as kutils

from .tools.recorder import register

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    register(config, table=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cpu_takes_the_pytorch_path(monkeypatch):
    """Without CUDA every op times its PyTorch CPU path, also when the root conftest switched Triton's
    interpreter on in this process (the interpreter is a correctness tool: at S = 64K it takes hours)."""
    if not HAS_CUDA:
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
