"""Every demo test runs the PyTorch CPU path (the kernels are tested elsewhere; the interpreter would be slow)."""
import pytest


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
