"""Test fixtures: NaN-poisoned outputs, fixed seeds, the device.  (The interpreter switch and the
``gpu`` marker are in the repository's root ``conftest.py``, shared with ``benchmarks/``.)"""
import random

import numpy as np
import pytest
import torch

import kvpop_kernels._utils as _kutils

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
