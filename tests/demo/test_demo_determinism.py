"""A ``kvpop demo`` run is determined by its seeds and settings: re-running it writes the same results.json bytes.

Reduced demo: both tasks, every retrofit (scorer-only, joint, fixed-finetune, DMS), a few steps each (``--quick``).
The second run starts with the global random streams left elsewhere, and a third retrains two retrofits (the
joint mLSTM and DMS) alone, in a process where no other retrofit ran before them (``--resume`` after deleting
them): neither may change a byte.
"""
import json
import random
import shutil

import numpy as np
import torch

from kvpop.cli import main
from kvpop.demo.search import TASKS


def _demo(out, *extra):
    assert main(["demo", "--quick", "--task", "all", "--out", str(out), "--threads", "1", "--no-progress",
                 "--no-plot", *extra]) == 0


def _results(out):
    return {t: (out / t / "results.json").read_bytes() for t in TASKS}


def test_two_runs_of_a_reduced_demo_write_identical_results(tmp_path):
    _demo(tmp_path / "a")
    first = _results(tmp_path / "a")
    for t in TASKS:
        res = json.loads(first[t])
        assert {r["policy"] for r in res["rows"]} >= {"kvpop-mlstm-joint", "kvpop-mlp-joint", "dms"}
        assert "timings" not in res["demo"] and json.loads((tmp_path / "a" / t / "run.json").read_text())["timings"]

    torch.manual_seed(12345)  # whatever ran before must not matter: move every global stream
    torch.rand(17)
    np.random.seed(7)
    random.seed(7)
    _demo(tmp_path / "b")
    assert _results(tmp_path / "b") == first

    # the joint mLSTM and DMS trained and measured alone (the other retrofits and rows reused)
    c = tmp_path / "c"
    shutil.copytree(tmp_path / "b", c)
    redo = ("kvpop-mlstm-joint", "dms")
    for t in TASKS:
        for p in redo:
            shutil.rmtree(c / t / p)
        rows = (c / t / "rows.jsonl").read_text().splitlines()
        (c / t / "rows.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r)["policy"] not in redo))
    _demo(c, "--resume")
    assert _results(c) == first
