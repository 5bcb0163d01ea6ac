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


RESULTS = README.parent / "kvpop" / "data" / "demo_results"


def test_results_document_holds_each_runs_table():
    doc = (RESULTS / "README.md").read_text(encoding="utf-8")
    for task in ("kvtrace", "lookahead"):
        for line in (RESULTS / task / "table.md").read_text(encoding="utf-8").splitlines():
            assert not line.startswith("|") or line in doc, (task, line)


WALKTHROUGH = "# your own model, end to end"


def _commands(block: str) -> list[str]:
    """The commands of a bash block: comments dropped, backslash continuations joined."""
    out, cur = [], ""
    for line in block.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        out.append(cur.strip())
        cur = ""
    return out


def test_readme_own_model_walkthrough_runs(monkeypatch, tmp_path, capsys):
    """The README's train-and-eval walkthrough, command by command (``kvpop`` in this process, ``python -c``
    with its ``> FILE``), on its stand-in model and traces; every DMS run reaches its target keep."""
    import contextlib
    import io
    import json
    import shlex

    from kvpop.cli import main

    blocks = [b for b in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
              if b.startswith(WALKTHROUGH)]
    assert len(blocks) == 1, f"README.md needs one bash block starting with {WALKTHROUGH!r}"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.chdir(tmp_path)
    ran = []
    for cmd in _commands(blocks[0]):
        argv = shlex.split(cmd)
        if argv[0] == "kvpop":
            assert main(argv[1:]) == 0, cmd
        else:
            assert argv[:2] == ["python", "-c"], f"the walkthrough runs kvpop and python -c only: {cmd}"
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(argv[2], "README walkthrough", "exec"), {"__name__": "__readme__"})
            if len(argv) == 5 and argv[3] == ">":
                (tmp_path / argv[4]).write_text(buf.getvalue())
            else:
                assert len(argv) == 3, cmd
        ran.append(argv[0])
    assert ran.count("kvpop") >= 4
    err = capsys.readouterr().err
    assert "missed its target" not in err, err
    res = json.loads((tmp_path / "eval-out" / "results.json").read_text())
    assert {"kvpop-mlp", "kvpop-mlstm-joint", "dms"} <= {r["policy"] for r in res["rows"]}
    assert res["trained"]["kvpop-mlp"]["window"] == res["window"]
