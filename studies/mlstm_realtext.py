"""The paper's second scorer on real text: does an mLSTM priority beat the fine-tune under recency?

The real-text ledger's KVpop rows score tokens with the MLP scorer, which sees a token's key and value only.
The paper's mLSTM scorer waits until the token leaves the window and reads the keys and values that followed it
(docs/DESIGN.md section 3), the learned counterpart of the ``window-attention`` control. It was never put beside
the fine-tune under StreamingLLM's fixed mask (``fixed-finetune[streaming]``, the control that ties or beats the
MLP at 12.5 % memory). This study does, with nothing chosen for either row:

* three rows, one recipe: the real-text controls' slots and fine-tune (sinks 4, window 32, trained at B = 128,
  250 steps, mean label, scorer lr 1e-3, model lr 1e-4, ``--lm-weight 0.1``: the next-token loss weight
  validation chose for both the MLP row and the control in issue 44), uniform budgets; only the priority
  differs: ``--scorer mlstm``, ``--scorer mlp``, ``--mask-source streaming``;
* seeds 0, 1, 2 each;
* ``valid``: each (row, seed) scored on the first 16 validation sequences at B = 64 / 128 / 256 (positions
  >= 256, NLL over the original dense model), reported as validation (nothing is chosen from it);
* ``test``: each (row, seed) scored once (:class:`studies.ledger.TestLog`) on a fresh split that no earlier
  run scored (``--split-name``, made from test-bucket files no earlier split used);
* ``record``: per-seed means, and paired 95 % intervals (bootstrap over source files and seeds,
  :func:`studies.paired.comparison`) of every pair of rows at every budget, on each split.

::

    python -m studies.realtext_corpus --out CORPUS --splits train,validation,test   # the ledger's train split
    python -m studies.mlstm_realtext valid --out OUT --corpus CORPUS
    python -m studies.mlstm_realtext test --out OUT --corpus CORPUS --split-name test_fresh4 --hash-seed 5
    python -m studies.mlstm_realtext record --out OUT --write studies/results/evidence/realtext/mlstm.json

Each stage resumes: a finished training or evaluation is never repeated (its files are its record).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .controls_realtext import EVAL_BUDGETS, SINKS, VALID_SEQUENCES, WINDOW, clusters_of, per_sequence
from .ledger import TestLog, run_logged, write_json
from .paths import DATA, parse

MODEL = DATA / "tiny_qwen3_code"
SHIPPED = DATA / "realtext"
VALID = SHIPPED / "validation.jsonl"
SEQ_LEN, TRAIN_BUDGET, STEPS = 1024, 128, 250
TEST_RECORDS = 48
SEEDS = (0, 1, 2)
RECIPE = ["--seq-len", str(SEQ_LEN), "--sinks", str(SINKS), "--window", str(WINDOW), "--budget", str(TRAIN_BUDGET),
          "--label", "mean", "--lr-scorer", "1e-3", "--lr-model", "1e-4", "--lm-weight", "0.1", "--steps",
          str(STEPS), "--checkpoint-every", "25", "--no-progress", "--threads", "1"]
"""Every row's ``kvpop train`` options but its priority (module docstring)."""
ROWS = {
    "kvpop-mlstm-joint[lm 0.1]": ("mlstm", ["--scorer", "mlstm"], "kvpop-mlstm-joint"),
    "kvpop-mlp-joint[lm 0.1]": ("mlp", ["--scorer", "mlp"], "kvpop-mlp-joint"),
    "fixed-finetune[streaming,lm 0.1]": ("streaming", ["--mask-source", "streaming"], "fixed-finetune"),
}
"""``row: (directory, its kvpop train options, the policy kvpop eval serves it as)``."""
LEGEND = {
    "kvpop-mlstm-joint[lm 0.1]": "KVpop's mLSTM scorer (reads the keys and values that followed the token) and the "
                                 "model trained together",
    "kvpop-mlp-joint[lm 0.1]": "KVpop's MLP scorer (the token's key and value) and the model trained together",
    "fixed-finetune[streaming,lm 0.1]": "the control: the model fine-tuned under StreamingLLM's fixed mask "
                                        "(the same slots: recency decides)",
}


def train_command(model: Path, corpus: Path, row: str, seed: int, out: Path) -> list[str]:
    """``kvpop train`` of one (row, seed) into ``out`` (``--resume`` when ``out`` holds a checkpoint)."""
    extra = ROWS[row][1]
    return ["kvpop", "train", "--model", str(model), "--data", str(corpus / "train.jsonl"), *RECIPE,
            "--seed", str(seed), *extra, "--out", str(out), *(["--resume"] if (out / "last.pt").exists() else [])]


def eval_command(model: Path, run: Path, row: str, data: Path, n: int, out: Path) -> list[str]:
    """``kvpop eval --data`` of one (row, seed) on the first ``n`` sequences of ``data`` at every budget."""
    return ["kvpop", "eval", "--model", str(model), "--data", str(data), "--seq-len", str(SEQ_LEN),
            "--budgets", ",".join(map(str, EVAL_BUDGETS)), "--sinks", str(SINKS), "--window", str(WINDOW),
            "--n-sequences", str(n), "--no-plot", "--no-progress", "--threads", "1", "--run", str(run),
            "--policies", f"dense,{ROWS[row][2]}", "--out", str(out)]


def run_dir(out: Path, row: str, seed: int) -> Path:
    return out / "runs" / ROWS[row][0] / f"seed{seed}"


def trained(d: Path) -> bool:
    """A run whose ``history.jsonl`` reached :data:`STEPS` with its served files written."""
    h = d / "history.jsonl"
    if not (h.exists() and (d / "scorers.safetensors").exists()):
        return False
    lines = [x for x in h.read_text().splitlines() if x.strip()]
    return bool(lines) and json.loads(lines[-1])["step"] >= STEPS


def _train(out: Path, corpus: Path, model: Path, row: str, seed: int) -> None:
    d = run_dir(out, row, seed)
    if not trained(d):
        d.mkdir(parents=True, exist_ok=True)
        run_logged(train_command(model, corpus, row, seed, d), out / "commands.log", name=f"train {row} seed {seed}")


def _parallel(jobs: int, work: list) -> None:
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        for f in [ex.submit(*w) for w in work]:
            f.result()


def valid_stage(out: Path, corpus: Path, *, model: Path = MODEL, seeds=SEEDS, jobs: int = 2) -> None:
    """Train every (row, seed) and score it on the validation sequences (each step skipped when done)."""
    def one(row: str, seed: int) -> None:
        _train(out, corpus, model, row, seed)
        ev = out / "valid" / ROWS[row][0] / f"seed{seed}"
        if not (ev / "results.json").exists():
            run_logged(eval_command(model, run_dir(out, row, seed), row, VALID, VALID_SEQUENCES, ev),
                       out / "commands.log", name=f"valid {row} seed {seed}")

    _parallel(jobs, [(one, r, s) for s in seeds for r in ROWS])


def test_stage(out: Path, corpus: Path, split: Path, *, model: Path = MODEL, seeds=SEEDS, jobs: int = 2) -> None:
    """Score every trained (row, seed) once on ``split`` (:class:`TestLog`: a logged key is never scored again).
    ValueError when a run is not trained (the test stage trains nothing)."""
    missing = [f"{r} seed {s}" for r in ROWS for s in seeds if not trained(run_dir(out, r, s))]
    if missing:
        raise ValueError(f"not trained yet: {', '.join(missing)} (run the valid stage first)")
    log = TestLog(out)
    n = TEST_RECORDS

    def one(row: str, seed: int) -> None:
        ev = out / "test" / split.stem / ROWS[row][0] / f"seed{seed}"

        def score() -> dict:
            run_logged(eval_command(model, run_dir(out, row, seed), row, split, n, ev), out / "commands.log",
                       name=f"test {split.stem} {row} seed {seed}")
            return {"dir": str(ev), **{str(b): v for b, v in per_sequence(_results(ev), ROWS[row][2]).items()}}

        log.once(f"{split.stem}|{row}|{seed}", score)

    _parallel(jobs, [(one, r, s) for s in seeds for r in ROWS])  # the log serialises its appends


def _results(ev: Path) -> dict:
    return json.loads((ev / "results.json").read_text())


def split_values(out: Path, split: str, seeds=SEEDS) -> dict[str, dict[int, dict[int, list[float]]]]:
    """``{row: {seed: {budget: per-sequence NLL over dense}}}`` on ``"validation"`` (the valid stage's results) or a
    test split's name (the test log's entries)."""
    vals: dict[str, dict[int, dict[int, list[float]]]] = {}
    if split == "validation":
        for row, (d, _, pol) in ROWS.items():
            vals[row] = {s: per_sequence(_results(out / "valid" / d / f"seed{s}"), pol) for s in seeds
                         if (out / "valid" / d / f"seed{s}" / "results.json").exists()}
    else:
        log = TestLog(out)
        for row in ROWS:
            vals[row] = {s: {b: log.entries[k]["result"][str(b)] for b in EVAL_BUDGETS}
                         for s in seeds if (k := f"{split}|{row}|{s}") in log.entries}
    return vals


def training_summary(d: Path, last: int = 25) -> dict | None:
    """A run's last ``last`` steps from its ``history.jsonl``: the mean ``accuracy`` (the scorer's keep / drop
    decisions that agree with the teacher's on the training batches) and ``keep_frac`` (the share of those
    decisions that keep the token); None when the run is not there."""
    h = d / "history.jsonl"
    if not h.exists():
        return None
    rows = [json.loads(x) for x in h.read_text().splitlines() if x.strip()][-last:]
    def finite(key: str) -> list[float]:  # a run whose scorer makes no decision (an untrained priority) logs NaN
        return [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]

    acc, keep = finite("accuracy"), finite("keep_frac")
    return {"steps": rows[-1]["step"] if rows else 0, "last_steps": len(rows),
            "decision_accuracy": sum(acc) / len(acc) if acc else None,
            "keep_frac": sum(keep) / len(keep) if keep else None}


def split_record(vals: dict, rows: list[str], data: Path, n: int, seeds=SEEDS, *, test: bool,
                 n_boot: int = 10_000) -> dict:
    """One split's part of a record: ``vals`` (``{row: {seed: {budget: per-sequence values}}}`` of ``data``'s
    first ``n`` records) as per-seed means, and the paired interval of every pair of ``rows`` at every budget,
    clustered by source file (:func:`studies.paired.comparison`)."""
    from .paired import comparison

    clusters = clusters_of(data, n)
    return {"file": str(data.relative_to(DATA.parent.parent)), "sequences": n, "clusters": len(set(clusters)),
            "test": test,
            "figures": [{"row": r, "budget": b, "per_seed": {str(s): sum(vals[r][s][b]) / n for s in seeds},
                         "mean": sum(sum(vals[r][s][b]) / n for s in seeds) / len(seeds)}
                        for r in rows for b in EVAL_BUDGETS],
            "comparisons": [comparison(instrument="realtext", budget=b, a=a, b=o,
                                       values_a=[vals[a][s][b] for s in seeds], values_b=[vals[o][s][b] for s in seeds],
                                       lower_is_better=True, clusters=clusters, n_boot=n_boot)
                            for b in EVAL_BUDGETS for i, a in enumerate(rows) for o in rows[i + 1:]],
            "per_sequence": {r: {str(s): {str(b): vals[r][s][b] for b in EVAL_BUDGETS} for s in seeds} for r in rows}}


def record(out: Path, *, splits: list[str], seeds=SEEDS, n_boot: int = 10_000) -> dict:
    """Figures and paired intervals of every split in ``splits`` (``validation`` and test split names)."""
    rows = list(ROWS)
    rec: dict = {"study": "the mLSTM scorer against the MLP scorer and the recency fine-tune on real text",
                 "recipe": {"kvpop train": RECIPE, "priority": {r: ROWS[r][1] for r in rows}},
                 "legend": LEGEND, "seeds": list(seeds), "budgets": list(EVAL_BUDGETS),
                 "metric": "NLL increase over the original dense model (nats/token), positions >= 256; lower is "
                           "better",
                 "commands": {"stages": [x.strip() for x in __doc__.split("::")[1].strip().splitlines()
                                         if x.strip().startswith("python")],
                              "train": " ".join(train_command(Path("kvpop/data/tiny_qwen3_code"), Path("CORPUS"),
                                                              rows[0], 0, Path("OUT/runs/mlstm/seed0"))),
                              "score": " ".join(eval_command(Path("kvpop/data/tiny_qwen3_code"),
                                                             Path("OUT/runs/mlstm/seed0"), rows[0],
                                                             Path("SPLIT.jsonl"), 16, Path("OUT/valid/mlstm/seed0")))},
                 "splits": {}}
    rec["training"] = {r: {str(s): training_summary(run_dir(out, r, s)) for s in seeds} for r in rows}
    for split in splits:
        data = VALID if split == "validation" else SHIPPED / f"{split}.jsonl"
        n = VALID_SEQUENCES if split == "validation" else TEST_RECORDS
        vals = split_values(out, split, seeds)
        if any(len(vals[r]) != len(seeds) for r in rows):
            have = {r: sorted(vals[r]) for r in rows}
            raise ValueError(f"{split}: not every (row, seed) is scored yet: {have}")
        rec["splits"][split] = split_record(vals, rows, data, n, seeds, test=split != "validation", n_boot=n_boot)
    return rec


def markdown(rec: dict) -> str:
    """The record's tables: figures per split, then every paired interval."""
    seeds = ", ".join(map(str, rec["seeds"]))
    lines = [f"# {rec['study']}", "", f"{rec['metric']}; mean over seeds {seeds} (min .. max).", ""]
    for split, s in rec["splits"].items():
        kind = "test split, each (row, seed) scored once" if s["test"] else rec.get("validation_is",
                                                                                "validation (nothing chosen from it)")
        lines += [f"## {split} ({s['file']}, {s['sequences']} sequences from {s['clusters']} source files; {kind})",
                  "", "| row | " + " | ".join(f"B={b}" for b in rec["budgets"]) + " |",
                  "|---|" + "---|" * len(rec["budgets"])]
        for r in (r for r in rec["legend"] if any(x["row"] == r for x in s["figures"])):  # the split's rows
            cells = []
            for b in rec["budgets"]:
                f = next(x for x in s["figures"] if x["row"] == r and x["budget"] == b)
                ps = list(f["per_seed"].values())
                cells.append(f"{f['mean']:+.4f} ({min(ps):+.4f} .. {max(ps):+.4f})")
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        lines += ["", "| B | a | b | a - b [95 % interval] | verdict |", "|---|---|---|---|---|"]
        for c in s["comparisons"]:
            lo, hi = c["ci95"]
            lines.append(f"| {c['budget']} | {c['a']} | {c['b']} | {c['mean_diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                         f"{c['verdict']} |")
        lines.append("")
    tr = {r: per for r, per in (rec.get("training") or {}).items()
          if all(v is not None and v["decision_accuracy"] is not None for v in per.values())}
    if tr:
        lines += ["Training, the last 25 steps of each run (`history.jsonl`): the scorer's keep / drop decisions that "
                  "agree with the teacher's (mean over seeds, min .. max; the control's scorer is trained but never "
                  "serves), the share of the teacher's decisions that keep the token, and what making the teacher's "
                  "more common decision every time would score.", "",
                  "| row | decision accuracy | keep share | the more common decision every time |",
                  "|---|---|---|---|"]
        for r, per in tr.items():
            a = [v["decision_accuracy"] for v in per.values()]
            k = [v["keep_frac"] for v in per.values()]
            lines.append(f"| {r} | {sum(a) / len(a):.3f} ({min(a):.3f} .. {max(a):.3f}) | "
                         f"{sum(k) / len(k):.3f} ({min(k):.3f} .. {max(k):.3f}) | "
                         f"{max(sum(k) / len(k), 1 - sum(k) / len(k)):.3f} |")
        lines.append("")
    lines += ["Rows: " + "; ".join(f"`{r}`: {t}" for r, t in rec["legend"].items()) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.mlstm_realtext", description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("valid", "test", "record"))
    p.add_argument("--out", required=True, help="the study's directory (runs, evaluations, test log)")
    p.add_argument("--corpus", help="the corpus directory holding train.jsonl (studies.realtext_corpus)")
    p.add_argument("--split-name", default="test_fresh4", help="the fresh test split (made when missing)")
    p.add_argument("--hash-seed", type=int, default=5, help="the fresh split's file order (seeded hash)")
    p.add_argument("--site-packages", default=None,
                   help="where the corpus's packages are read for a new fresh split (default: this interpreter's)")
    p.add_argument("--splits", default="validation", help="record: comma-separated: validation and test splits")
    p.add_argument("--write", default=None, help="record: the JSON to write (a .md beside it)")
    p.add_argument("--jobs", type=int, default=2)
    a = parse(p, argv)
    out = Path(a.out)
    if a.stage in ("valid", "test"):
        if a.corpus is None or not (Path(a.corpus) / "train.jsonl").exists():
            p.error(f"--corpus must hold train.jsonl (python -m studies.realtext_corpus --out DIR --splits "
                    f"train,validation,test); got {a.corpus!r}")
        corpus = Path(a.corpus)
    if a.stage == "valid":
        valid_stage(out, corpus, jobs=a.jobs)
    elif a.stage == "test":
        split = SHIPPED / f"{a.split_name}.jsonl"
        if not split.exists():
            from .evidence_realtext import fresh_test_split

            earlier = tuple(sorted(x for x in SHIPPED.glob("test_fresh*.json") if x.stem != a.split_name))
            fresh_test_split(corpus, SHIPPED, n_records=TEST_RECORDS, hash_seed=a.hash_seed, name=a.split_name,
                             exclude=earlier, site=Path(a.site_packages) if a.site_packages else None,
                             write_shipped=a.write_shipped,
                             command=f"python -m studies.mlstm_realtext test --out {a.out} --corpus {a.corpus} "
                                     f"--split-name {a.split_name} --hash-seed {a.hash_seed}"
                                     + (f" --site-packages {a.site_packages}" if a.site_packages else ""))
        test_stage(out, corpus, split, jobs=a.jobs)
    else:
        rec = record(out, splits=[s for s in a.splits.split(",") if s])
        if a.write:
            write_json(Path(a.write), rec)
            Path(a.write).with_suffix(".md").write_text(markdown(rec))
        print(markdown(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
