"""studies.decay_realtext: a fixed, stronger decay for the learned priority, chosen on validation, tested once.

The runs take minutes (studies/results/evidence/realtext/decay.md); here: the trial's command is the mLSTM study's
MLP row plus the fixed decay, the selection follows the house rule in order and is final before a test, and the
test split's rows are the chosen one, the learned-decay MLP row and the recency control."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies import decay_realtext as D
from studies import mlstm_realtext as M
from studies.controls_realtext import EVAL_BUDGETS, SELECT, VALID_SEQUENCES


def test_trial_command_is_the_mlp_row_with_the_decay_fixed(tmp_path):
    base = M.train_command(M.MODEL, tmp_path, D.MLP, 2, tmp_path / "o")
    cmd = D.train_command(tmp_path, 0.995, 2, tmp_path / "o")
    assert [x for x in cmd if x not in ("--gamma-min", "0.995", "--gamma-max", "0.995002", "--gamma-init",
                                        "0.995001")] == base
    assert cmd[cmd.index("--gamma-min") + 1] < cmd[cmd.index("--gamma-init") + 1] < cmd[cmd.index("--gamma-max") + 1]


def _results(path: Path, policy: str, v: dict[int, list[float]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({"rows": [{"policy": policy, "budget": b, "per_sequence": x}
                                                            for b, x in v.items()]}))


def test_selection_in_order_final_and_kept(tmp_path, monkeypatch):
    base = tmp_path / "base"
    flat = lambda x: {b: [x] * VALID_SEQUENCES for b in EVAL_BUDGETS}  # noqa: E731
    learned = {b: [0.010 + 0.001 * (i % 3) for i in range(VALID_SEQUENCES)] for b in EVAL_BUDGETS}
    _results(base / "valid" / "mlp" / "seed0", "kvpop-mlp-joint", learned)
    # 0.995 better by 0.005 on every sequence (adopted), 0.98 worse than 0.995 (kept out)
    scores = {0.995: {b: [x - 0.005 for x in learned[b]] for b in EVAL_BUDGETS}, 0.98: flat(0.02)}
    seen = []

    def fake_valid(out, corpus, g, seed):
        seen.append((g, seed))
        return scores[g]

    monkeypatch.setattr(D, "_valid", fake_valid)
    with pytest.raises(ValueError, match="no final selection"):
        D.chosen_gamma(tmp_path / "out")
    sel = D.select_stage(tmp_path / "out", tmp_path, base)
    assert seen == [(0.995, 0), (0.98, 0)] and sel["final"] and sel["chosen"] == {"gamma": 0.995}
    assert [d["adopted"] for d in sel["decisions"]] == [True, False] and sel["select"] == list(SELECT)
    assert sel["decisions"][1]["incumbent"] == {"gamma": 0.995}  # each challenger meets the incumbent of its time
    assert D.chosen_gamma(tmp_path / "out") == 0.995
    seen.clear()
    assert D.select_stage(tmp_path / "out", tmp_path, base) == sel and not seen  # final: never redone
    rows = D._rows(tmp_path / "out", base, 0.995)
    assert list(rows) == ["kvpop-mlp-joint[lm 0.1,decay 0.995]", D.MLP, D.CONTROL]
    with pytest.raises(ValueError, match="not trained yet"):
        D.test_stage(tmp_path / "out", base, tmp_path / "t.jsonl")


def test_the_untrained_control_is_the_chosen_row_with_a_random_priority(tmp_path):
    row = D.train_command(tmp_path, 0.995, 1, tmp_path / "o")
    ctl = D.control_command(tmp_path, 0.995, 1, tmp_path / "o")
    assert [x for x in ctl if x not in ("--priority-source", "random")] == row
    assert D.run_dir(tmp_path, 0.995, 1, control=True).parent.name == "random-g0.995"
    assert D.control_name(0.995) == "fixed-finetune[random,lm 0.1,decay 0.995]"
    (tmp_path / "s.jsonl").write_text('{"input_ids": [1]}\n\n{"input_ids": [2]}\n')
    assert D.n_records(tmp_path / "s.jsonl") == 2
