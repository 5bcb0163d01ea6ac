"""``-p benchmarks.gpu_plugin``: the recorder of ``benchmarks/_recorder.py`` in a session outside
``benchmarks/`` (``benchmarks/gpu_check.py`` loads it into ``pytest -m gpu tests/``), without the table."""
from ._recorder import register


def pytest_configure(config):
    register(config, table=False)
