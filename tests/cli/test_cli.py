"""The ``kvpop`` console command."""
import json

import pytest
import torch

from kvpop.cli import main
from kvpop_kernels import NEVER, eviction_schedule


def test_schedule_picture_matches_the_schedule(capsys):
    assert main(["schedule", "--length", "48", "--sinks", "2", "--window", "8", "--budget", "16",
                 "--heads", "2", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("head ")]
    g = torch.Generator().manual_seed(3)
    ev = eviction_schedule(torch.randn(1, 2, 48, generator=g), sinks=2, window=8, k=6)[0]
    assert len(rows) == 2
    for h, row in enumerate(rows):
        assert len(row) == 48 and row[:2] == "SS" and row[-8:] == "W" * 8
        kept = [t for t, c in enumerate(row) if c == "#"]
        assert len(kept) == 6
        assert kept == [t for t in range(2, 40) if ev[h, t] > 47]


def test_schedule_json(capsys):
    assert main(["schedule", "--priorities", "5,1,4,2,3,0,9,9", "--sinks", "1", "--window", "2",
                 "--budget", "5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ev = eviction_schedule(torch.tensor([[[5, 1, 4, 2, 3, 0, 9, 9.0]]]), sinks=1, window=2, k=2)[0, 0]
    assert data["evict_at"][0] == [None if e == NEVER else e for e in ev.tolist()]
    assert data["k"] == 2


def test_schedule_bad_budget():
    with pytest.raises(SystemExit, match="--budget"):
        main(["schedule", "--budget", "3", "--window", "8"])


def test_pretrain_is_a_command_of_the_cli_package(capsys):
    with pytest.raises(SystemExit) as e:
        main(["pretrain", "--help"])
    assert e.value.code == 0
    assert "--curriculum" in capsys.readouterr().out
    import kvpop.demo.pretrain as demo_pretrain

    # the training module holds no command: the CLI imports it, never the other way round
    assert not hasattr(demo_pretrain, "main") and not hasattr(demo_pretrain, "build_parser")
