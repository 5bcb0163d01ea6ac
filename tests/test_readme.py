"""Every Python example of README.md runs as written (on the PyTorch CPU path)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels are tested on their own
    monkeypatch.chdir(tmp_path)  # examples may write files
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})


def test_readme_capacity_table_is_the_functions_output():
    from kvpop.core.capacity import capacity_table

    table = capacity_table()
    assert table in README.read_text(encoding="utf-8"), "paste the table of python -m kvpop.core.capacity"
