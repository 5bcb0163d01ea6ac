"""``-p benchmarks.tools.gpu_plugin``: the recorder of ``benchmarks/tools/recorder.py`` in a session outside
``benchmarks/`` (``benchmarks/tools/gpu_check.py`` loads it into ``pytest -m gpu tests/``), without the table."""
from .recorder import register


def pytest_configure(config):
    register(config, table=False)
