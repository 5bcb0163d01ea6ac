"""Fixtures shared by the kernel tests."""
import pytest
import torch

import kvpop_kernels._utils as kutils
from kvpop_kernels import decode as decode_mod
from kvpop_kernels import paged_decode as paged_mod

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """Route the public ops to the Triton kernels (interpreter here) or to the PyTorch CPU path."""
    if request.param == "torch":
        monkeypatch.setattr(kutils, "interpreting", lambda: False)

        def _no_triton(*a, **k):  # the CPU path must not launch a kernel
            raise AssertionError("the PyTorch path launched the Triton kernel")

        monkeypatch.setattr(decode_mod, "_triton_decode", _no_triton)
        monkeypatch.setattr(paged_mod, "_triton_paged", _no_triton)
    elif not (HAS_CUDA or kutils.interpreting()):
        pytest.skip("no Triton backend (needs CUDA or TRITON_INTERPRET=1)")
    return request.param
