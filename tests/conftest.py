"""Test harness: interpreter switch, the ``gpu`` marker, NaN-poisoned outputs, fixed seeds."""
import os

# TRITON_INTERPRET is read when a @triton.jit function runs, so decide before any kernel
# module is imported: without CUDA the Triton kernels run in the CPU interpreter.
try:
    import torch as _torch

    _HAS_CUDA = _torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import kvpop_kernels._utils as _kutils  # noqa: E402

DEVICE = "cuda" if _HAS_CUDA else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on 2 CPU cores")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _poison_outputs_and_seed():
    """Fill every output the package allocates with NaN (ints with -7) and fix the seeds."""
    _kutils.NAN_FILL = True
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    yield
    _kutils.NAN_FILL = False


@pytest.fixture
def device():
    return DEVICE
