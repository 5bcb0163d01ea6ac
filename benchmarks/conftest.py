"""Benchmark harness.

Run on a GPU as ``pytest benchmarks/ --benchmark-only`` (Qwen3-8B shapes, bf16).  Without CUDA
the same files run small shapes through the PyTorch CPU path (the Triton interpreter is a
correctness tool, not something to time); CI runs them once with ``--benchmark-disable``.
"""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
