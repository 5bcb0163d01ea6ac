"""A stronger, fixed age penalty for KVpop's learned priority on real text, chosen on validation, scored once.

The mLSTM study (:mod:`studies.mlstm_realtext`) found the learned scorers tie recency at 12.5 % memory and beat
it at 6.25 %; their decay ``gamma`` (the priority falls by ``-log(gamma)`` per token of age) stays where the
paper's range starts it, about 0.9999: an age penalty of 0.1 nats over the whole 1,024-token record, so the
priority is nearly all the scorer's. A stronger penalty blends the learned priority with recency (a token must
outscore a younger one by its age difference times ``-log(gamma)``); at the extreme it is recency. This study
asks whether a blend beats both ends, with the house rules:

* **trials on validation** (seed 0, the mLSTM study's MLP row with ``--gamma-min G --gamma-max G + 2e-6
  --gamma-init G + 1e-6``: the decay fixed at ``G`` for the teacher's ranking and the scorer's alike), in order
  :data:`GAMMAS`, each against the incumbent by :func:`kvpop.training.search.prefer` (2 paired standard errors)
  on the select part of the 16 validation sequences (``studies.controls_realtext.SELECT``) at the training
  budget B = 128; the incumbent starts as the row with the learned decay (the mLSTM study's run);
  ``selection.json`` is written, final, before any test;
* **seeds** 1 and 2 of the chosen setting, scored on validation;
* **test**: the chosen row, the MLP row with the learned decay and the recency fine-tune (the mLSTM study's
  runs), 3 seeds each, scored once on a fresh split no earlier run scored (``--split-name``);
* **record**: figures and paired intervals (bootstrap over files and seeds) on validation and the test split.

Then the question the decay raises: is it the blend with recency that wins, or the learned part of it?
``control`` trains the same fine-tune at the chosen decay with an untrained priority (``--priority-source random``:
the scorer at its seeded init, never trained; the ``fixed-finetune[random]`` control of the earlier sections), 3
seeds; ``test --split-name test_fresh6 --with-control`` scores it beside the other rows once on a sixth fresh split
(36 records: the test bucket's files that no earlier split used hold 37).

::

    python -m studies.decay_realtext select --out OUT --corpus CORPUS --base MLSTM_OUT
    python -m studies.decay_realtext seeds --out OUT --corpus CORPUS --base MLSTM_OUT
    python -m studies.decay_realtext test --out OUT --corpus CORPUS --base MLSTM_OUT --split-name test_fresh5 \\
        --hash-seed 6 --site-packages SITE
    python -m studies.decay_realtext control --out OUT --corpus CORPUS --base MLSTM_OUT
    python -m studies.decay_realtext test --out OUT --corpus CORPUS --base MLSTM_OUT --split-name test_fresh6 \\
        --hash-seed 7 --test-records 36 --site-packages SITE --with-control
    python -m studies.decay_realtext record --out OUT --base MLSTM_OUT --split-name test_fresh5,test_fresh6 \\
        --write studies/results/evidence/realtext/decay.json

``MLSTM_OUT``: the :mod:`studies.mlstm_realtext` directory whose MLP and recency runs are the incumbent and the
control.  Every stage resumes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import mlstm_realtext as M
from .controls_realtext import EVAL_BUDGETS, SELECT, VALID_SEQUENCES, per_sequence
from .ledger import TestLog, run_logged, write_json
from .paths import parse

GAMMAS = (0.995, 0.98)
"""The fixed decays tried, in order (an age penalty of about 5 and 20 nats over 1,024 tokens)."""
MLP = "kvpop-mlp-joint[lm 0.1]"
CONTROL = "fixed-finetune[streaming,lm 0.1]"
SEEDS = (0, 1, 2)


def tag(gamma: float) -> str:
    return f"mlp-g{gamma:g}"


def row_name(gamma: float) -> str:
    return f"kvpop-mlp-joint[lm 0.1,decay {gamma:g}]"


def train_command(corpus: Path, gamma: float, seed: int, out: Path) -> list[str]:
    """The mLSTM study's MLP command with the decay fixed at ``gamma``."""
    cmd = M.train_command(M.MODEL, corpus, MLP, seed, out)
    i = cmd.index("--out")
    return [*cmd[:i], "--gamma-min", f"{gamma:.8g}", "--gamma-max", f"{gamma + 2e-6:.8g}", "--gamma-init",
            f"{gamma + 1e-6:.8g}", *cmd[i:]]


def control_command(corpus: Path, gamma: float, seed: int, out: Path) -> list[str]:
    """:func:`train_command` with an untrained priority (``--priority-source random``)."""
    cmd = train_command(corpus, gamma, seed, out)
    i = cmd.index("--out")
    return [*cmd[:i], "--priority-source", "random", *cmd[i:]]


def control_name(gamma: float) -> str:
    return f"fixed-finetune[random,lm 0.1,decay {gamma:g}]"


def run_dir(out: Path, gamma: float, seed: int, *, control: bool = False) -> Path:
    return out / "runs" / (("random-g" + f"{gamma:g}") if control else tag(gamma)) / f"seed{seed}"


def _valid(out: Path, corpus: Path, gamma: float, seed: int, *, control: bool = False) -> dict[int, list[float]]:
    d = run_dir(out, gamma, seed, control=control)
    ev = out / "valid" / d.parent.name / f"seed{seed}"
    if not M.trained(d):
        d.mkdir(parents=True, exist_ok=True)
        cmd = (control_command if control else train_command)(corpus, gamma, seed, d)
        run_logged(cmd, out / "commands.log", name=f"train {d.parent.name} seed {seed}")
    if not (ev / "results.json").exists():
        run_logged(M.eval_command(M.MODEL, d, MLP, M.VALID, VALID_SEQUENCES, ev), out / "commands.log",
                   name=f"valid {d.parent.name} seed {seed}")
    return per_sequence(json.loads((ev / "results.json").read_text()), "kvpop-mlp-joint")


def _base_valid(base: Path, row: str, seed: int) -> dict[int, list[float]]:
    d, _, pol = M.ROWS[row]
    f = base / "valid" / d / f"seed{seed}" / "results.json"
    if not f.exists():
        raise ValueError(f"{f} is missing: run python -m studies.mlstm_realtext valid --out {base} first")
    return per_sequence(json.loads(f.read_text()), pol)


def select_stage(out: Path, corpus: Path, base: Path, *, budget: int = M.TRAIN_BUDGET) -> dict:
    """The trials and the choice (``OUT/selection.json``, final); a finished selection is returned as it is."""
    from kvpop.training.search import prefer

    sel_file = out / "selection.json"
    if sel_file.exists() and json.loads(sel_file.read_text()).get("final"):
        return json.loads(sel_file.read_text())
    pick = [int(i) for i in SELECT]
    inc = {"settings": {"gamma": "learned"}, "per_sequence": [_base_valid(base, MLP, 0)[budget][i] for i in pick]}
    trials, decisions = [inc], []
    for g in GAMMAS:
        v = _valid(out, corpus, g, 0)
        ch = {"settings": {"gamma": g}, "per_sequence": [v[budget][i] for i in pick]}
        trials.append(ch)
        dec = prefer(inc, ch, stage=f"fixed decay (seed 0, B={budget}, select part)")
        decisions.append(dec)
        if dec["adopted"]:
            inc = ch
    sel = {"final": True, "rule": "kvpop.training.search.prefer (2 paired standard errors) on the select part of the "
                                  f"16 validation sequences at B={budget}, seed 0, in order {list(GAMMAS)}",
           "select": pick, "trials": trials, "decisions": decisions, "chosen": inc["settings"]}
    write_json(sel_file, sel)
    return sel


def chosen_gamma(out: Path) -> float | None:
    """The chosen fixed decay, or None where the learned one stayed (ValueError before the selection)."""
    f = out / "selection.json"
    if not (f.exists() and json.loads(f.read_text()).get("final")):
        raise ValueError(f"{f}: no final selection yet (run the select stage first)")
    g = json.loads(f.read_text())["chosen"]["gamma"]
    return None if g == "learned" else float(g)


def _rows(out: Path, base: Path, gamma: float | None, *, control: bool = False
          ) -> dict[str, tuple[Path, str, Path]]:
    """``{row: (the directory of its seed directories, policy, its validation directory)}`` of the compared rows
    (``control``: with the untrained priority at the chosen decay)."""
    rows = {}
    if gamma is not None:
        rows[row_name(gamma)] = (out / "runs" / tag(gamma), "kvpop-mlp-joint", out / "valid" / tag(gamma))
        if control:
            d = run_dir(out, gamma, 0, control=True).parent
            rows[control_name(gamma)] = (d, "kvpop-mlp-joint", out / "valid" / d.name)
    for r in (MLP, CONTROL):
        rows[r] = (base / "runs" / M.ROWS[r][0], M.ROWS[r][2], base / "valid" / M.ROWS[r][0])
    return rows


def seeds_stage(out: Path, corpus: Path, *, control: bool = False) -> None:
    """The chosen setting's seeds (``control``: the untrained priority's at the chosen decay), each scored on
    validation; two at once."""
    from concurrent.futures import ThreadPoolExecutor

    g = chosen_gamma(out)
    if g is None:
        return
    with ThreadPoolExecutor(max_workers=2) as ex:
        for f in [ex.submit(_valid, out, corpus, g, s, control=control) for s in SEEDS]:
            f.result()


def n_records(split: Path) -> int:
    """The records of a split file (every one is scored)."""
    return sum(1 for x in split.read_text().splitlines() if x.strip())


def check_trained(out: Path, base: Path, *, control: bool = False) -> dict:
    """The compared rows of :func:`test_stage` (:func:`_rows`), once every seed of each is trained (ValueError naming
    those that are not)."""
    rows = _rows(out, base, chosen_gamma(out), control=control)
    missing = [f"{r} seed {s}" for r, (d, _, _) in rows.items() for s in SEEDS if not M.trained(d / f"seed{s}")]
    if missing:
        raise ValueError(f"not trained yet: {', '.join(missing)}")
    return rows


def test_stage(out: Path, base: Path, split: Path, *, jobs: int = 2, control: bool = False) -> None:
    """Every compared (row, seed) scored once on ``split`` (``control``: the untrained priority's too)."""
    from concurrent.futures import ThreadPoolExecutor

    rows = check_trained(out, base, control=control)
    log = TestLog(out)

    def one(row: str, seed: int) -> None:
        d, pol, _ = rows[row]
        ev = out / "test" / split.stem / d.name / f"seed{seed}"

        def score() -> dict:
            served = row if row in M.ROWS else MLP  # the fixed-decay row is served as the MLP row is
            run_logged(M.eval_command(M.MODEL, d / f"seed{seed}", served, split, n_records(split), ev),
                       out / "commands.log", name=f"test {split.stem} {row} seed {seed}")
            return {"dir": str(ev), **{str(b): v for b, v in
                                       per_sequence(json.loads((ev / "results.json").read_text()), pol).items()}}

        log.once(f"{split.stem}|{row}|{seed}", score)

    with ThreadPoolExecutor(max_workers=jobs) as ex:
        for f in [ex.submit(one, r, s) for s in SEEDS for r in rows]:
            f.result()


def record(out: Path, base: Path, *, split: str | None, n_boot: int = 10_000) -> dict:
    """The selection, then figures and paired intervals on validation and the test splits (``split``: names,
    comma-separated); the untrained-priority control where its runs (validation) or its scores (a test split) are
    there."""
    g = chosen_gamma(out)
    with_control = g is not None and all((out / "valid" / run_dir(out, g, s, control=True).parent.name / f"seed{s}"
                                          / "results.json").exists() for s in SEEDS)
    all_rows = _rows(out, base, g, control=with_control)
    rec: dict = {"study": "a fixed, stronger age penalty for the learned priority on real text",
                 "selection": json.loads((out / "selection.json").read_text()),
                 "commands": {"stages": [x.strip() for x in __doc__.split("::")[1].strip().splitlines()
                                         if x.strip().startswith("python")],
                              "train": " ".join(train_command(Path("CORPUS"), GAMMAS[0], 0, Path("OUT/runs/x")))},
                 "training": {r: {str(s): M.training_summary(d / f"seed{s}") for s in SEEDS}
                              for r, (d, _, _) in all_rows.items()},
                 "validation_is": "validation: its select part (seed 0, B = 128) chose the decay; not a test",
                 "metric": "NLL increase over the original dense model (nats/token), positions >= 256; lower is "
                           "better", "seeds": list(SEEDS), "budgets": list(EVAL_BUDGETS), "splits": {}}
    log = TestLog(out)
    for name in ["validation", *(x for x in (split or "").split(",") if x)]:
        rows = {r: v for r, v in all_rows.items()
                if name == "validation" or f"{name}|{r}|{SEEDS[0]}" in log.entries}
        if name != "validation" and len(rows) < 2:
            raise ValueError(f"{name}: fewer than two rows scored in {out / 'test_log.jsonl'}")
        if name == "validation":
            data, n = M.VALID, VALID_SEQUENCES
            vals = {r: {s: per_sequence(json.loads((v / f"seed{s}" / "results.json").read_text()), pol)
                        for s in SEEDS} for r, (_, pol, v) in rows.items()}
        else:
            data = M.SHIPPED / f"{name}.jsonl"
            n = n_records(data)
            vals = {r: {s: {b: log.entries[f"{name}|{r}|{s}"]["result"][str(b)] for b in EVAL_BUDGETS}
                        for s in SEEDS} for r in rows}
        rec["splits"][name] = M.split_record(vals, list(rows), data, n, SEEDS, test=name != "validation",
                                             n_boot=n_boot)
    mine = {row_name(g): f"the MLP row with its decay fixed at {g:g} (chosen on validation)",
            control_name(g): f"the same fine-tune at the decay {g:g} with an untrained priority (the scorer at its "
                             "seeded init)"} if g is not None else {}
    rec["legend"] = {r: M.LEGEND.get(r, mine.get(r, r)) for r in all_rows}
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.decay_realtext", description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("select", "seeds", "control", "test", "record"))
    p.add_argument("--out", required=True)
    p.add_argument("--base", required=True, help="the studies.mlstm_realtext directory (its MLP and recency runs)")
    p.add_argument("--corpus", help="the corpus directory holding train.jsonl")
    p.add_argument("--split-name", default=None, help="test / record: the fresh split")
    p.add_argument("--hash-seed", type=int, default=6)
    p.add_argument("--site-packages", default=None)
    p.add_argument("--write", default=None, help="record: the JSON to write (a .md beside it)")
    p.add_argument("--with-control", action="store_true", help="test: score the untrained-priority control too")
    p.add_argument("--test-records", type=int, default=M.TEST_RECORDS, help="test: records of a new fresh split")
    a = parse(p, argv)
    try:
        _stage(p, a)
    except ValueError as e:  # a stage's refusal (no selection yet, a run not trained, too few records): one line
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _stage(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The stage ``a.stage`` of the parsed arguments ``a`` (ValueError: a refusal, said in one line by main)."""
    out, base = Path(a.out), Path(a.base)
    needs_corpus = a.stage in ("select", "seeds", "control")
    if needs_corpus and (a.corpus is None or not (Path(a.corpus) / "train.jsonl").exists()):
        p.error(f"--corpus must hold train.jsonl; got {a.corpus!r}")
    if a.stage == "select":
        print(json.dumps(select_stage(out, Path(a.corpus), base)["decisions"], indent=1))
    elif a.stage in ("seeds", "control"):
        seeds_stage(out, Path(a.corpus), control=a.stage == "control")
    elif a.stage == "test":
        if a.split_name is None:
            p.error("test needs --split-name")
        split = M.SHIPPED / f"{a.split_name}.jsonl"
        if not split.exists():
            check_trained(out, base, control=a.with_control)  # before a split is drawn: nothing written in vain
            from .evidence_realtext import fresh_test_split

            earlier = tuple(sorted(x for x in M.SHIPPED.glob("test_fresh*.json") if x.stem != a.split_name))
            fresh_test_split(Path(a.corpus) if a.corpus else out, M.SHIPPED, n_records=a.test_records,
                             hash_seed=a.hash_seed, name=a.split_name, exclude=earlier,
                             site=Path(a.site_packages) if a.site_packages else None, write_shipped=a.write_shipped,
                             command=f"python -m studies.decay_realtext test --out {a.out} --corpus {a.corpus} "
                                     f"--base {a.base} --split-name {a.split_name} --hash-seed {a.hash_seed} "
                                     f"--test-records {a.test_records}"
                                     + (f" --site-packages {a.site_packages}" if a.site_packages else ""))
        test_stage(out, base, split, control=a.with_control)
    else:
        rec = record(out, base, split=a.split_name)
        if a.write:
            write_json(Path(a.write), rec)
            Path(a.write).with_suffix(".md").write_text(M.markdown(rec))
        print(M.markdown(rec))


if __name__ == "__main__":
    sys.exit(main())
