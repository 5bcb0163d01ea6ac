"""The instruments' tests run the PyTorch CPU path, as the demo's do (the kernels are tested elsewhere; the
interpreter would be slow)."""
import pytest


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
