"""``kvpop train --auto``'s choice on real text against the best single runs of the studies' recipes, each scored
once on a test split that nothing scored before (issue 62)::

    python -m studies.realtext_corpus --out CORPUS --splits train
    python -m studies.realtext_corpus --out CORPUS3 --splits test --max-records 48 --test-frac 0.05 \\
        --packages sympy,scipy,flask,requests,tomlkit,trio,anyio,botocore,yaml,attr
    kvpop train --auto ... --out AUTO                 # the search (studies/results/auto.md gives the command)
    kvpop train ... --out BASE/streaming_lm0.1        # the recipes (studies.mlstm_realtext / decay_realtext)
    python -m studies.auto_realtext test --out OUT --split CORPUS3/test.jsonl --run auto=AUTO \\
        --run streaming_lm0.1=BASE/streaming_lm0.1 --run mlp_g0.995_lm0.1=BASE/mlp_g0.995_lm0.1
    python -m studies.auto_realtext record --out OUT --split CORPUS3/test.jsonl --write RECORD.json

The test split: the shipped corpus's own test bucket is spent (docs/DESIGN.md, "Test once"), so the split is drawn
from the code of 10 installed packages that neither the shipped corpus nor the second corpus read (the model
never saw them), by the same rules (files by hash, 2 records of 1,024 byte tokens a file).  ``test`` scores each
run once (:class:`studies.ledger.TestLog`: a run named again is read back, never rescored) with ``kvpop eval
--data`` at B = 64 / 128 / 256 (sinks 4, window 32, positions past 256, NLL over the original dense model), as
what it is (``kvpop-mlp-joint`` or, for a run under the fixed mask, ``fixed-finetune``; an ``--auto`` run as its
``selection.json``'s ``chosen.served_as`` says); ``record`` gives each row's mean and the paired 95 % interval of
the first run minus every other (bootstrap over source files, :func:`studies.paired.paired_interval`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .controls_realtext import EVAL_BUDGETS, SINKS, WINDOW, clusters_of, per_sequence
from .ledger import TestLog, run_logged, write_json
from .paths import DATA, parse

MODEL = DATA / "tiny_qwen3_code"
SEQ_LEN = 1024


def policy_of(run: Path) -> str:
    """What ``kvpop eval`` serves the run in ``run`` as: an ``--auto`` run by its record's ``chosen.served_as``,
    a plain run by its ``args.json`` (``--mask-source streaming``: the fixed-mask fine-tune)."""
    sel = run / "selection.json"
    if sel.exists():
        fixed = json.loads(sel.read_text())["chosen"]["served_as"] == "fixed-finetune"
    else:
        fixed = json.loads((run / "args.json").read_text()).get("mask_source") == "streaming"
    if fixed:
        return "fixed-finetune"
    args = json.loads((run / "args.json").read_text())
    return f"kvpop-{args.get('scorer', 'mlp')}-joint"


def n_records(split: Path) -> int:
    return sum(1 for x in Path(split).read_text().splitlines() if x.strip())


def eval_command(run: Path, policy: str, split: Path, n: int, out: Path, model: Path = MODEL) -> list[str]:
    return ["kvpop", "eval", "--model", str(model), "--data", str(split), "--seq-len", str(SEQ_LEN),
            "--budgets", ",".join(map(str, EVAL_BUDGETS)), "--sinks", str(SINKS), "--window", str(WINDOW),
            "--n-sequences", str(n), "--no-plot", "--no-progress", "--threads", "1", "--run", str(run),
            "--policies", f"dense,{policy}", "--out", str(out)]


def test_stage(out: Path, split: Path, runs: dict[str, Path]) -> dict:
    """Each run of ``runs`` (name -> directory) scored once on ``split``; returns ``{name: result}``."""
    tl = TestLog(out)
    n = n_records(split)
    res = {}
    for name, d in runs.items():
        def evaluate(name=name, d=d) -> dict:
            pol = policy_of(d)
            o = out / "test" / name
            cmd = eval_command(d, pol, split, n, o)
            if not (o / "results.json").exists():
                run_logged(cmd, out / "commands.log", name=f"test {name}")
            r = json.loads((o / "results.json").read_text())
            return {"dir": str(d), "policy": pol, "command": " ".join(cmd),
                    "per_sequence": {str(b): v for b, v in per_sequence(r, pol).items()}}

        res[name] = tl.once(f"{name}|{split.name}", evaluate)
    return res


def record(out: Path, split: Path, *, first: str = "auto", n_boot: int = 10_000) -> dict:
    """The test log's rows on ``split``: each row's mean per budget and the paired interval of the row ``first``
    (the ``--auto`` run; the first logged when it is absent) minus each other row, clustered by source file."""
    from .paired import paired_interval, verdict

    tl = TestLog(out)
    rows = {e["key"].split("|")[0]: e["result"] for e in tl.entries.values() if e["key"].endswith(f"|{split.name}")}
    if not rows:
        raise ValueError(f"{out}: no row scored on {split.name}")
    n = n_records(split)
    cl = clusters_of(split, n)
    first = first if first in rows else next(iter(rows))
    names = [first, *(k for k in rows if k != first)]
    rec: dict = {"split": str(split), "n_sequences": n, "clusters": len(set(cl)), "budgets": list(EVAL_BUDGETS),
                 "rows": {k: {"policy": v["policy"], "dir": v["dir"], "command": v["command"],
                              "mean": {b: sum(x) / len(x) for b, x in v["per_sequence"].items()}}
                          for k, v in rows.items()},
                 "comparisons": []}
    for other in names[1:]:
        for b in EVAL_BUDGETS:
            a, c = rows[first]["per_sequence"][str(b)], rows[other]["per_sequence"][str(b)]
            iv = paired_interval(a, c, clusters=cl, n_boot=n_boot)
            rec["comparisons"].append({"a": first, "b": other, "budget": b, "mean_diff": iv.mean_diff,
                                       "ci95": list(iv.ci95), "verdict": verdict(iv, lower_is_better=True)})
    return rec


def markdown(rec: dict) -> str:
    bs = rec["budgets"]
    lines = ["| row | served as | " + " | ".join(f"B={b}" for b in bs) + " |", "|---|---|" + "---|" * len(bs)]
    for k, v in rec["rows"].items():
        lines.append(f"| {k} | {v['policy']} | " + " | ".join(f"{v['mean'][str(b)]:+.4f}" for b in bs) + " |")
    lines += ["", "| a minus b | " + " | ".join(f"B={b}" for b in bs) + " |", "|---|" + "---|" * len(bs)]
    pairs = dict.fromkeys((c["a"], c["b"]) for c in rec["comparisons"])
    for a, b in pairs:
        cells = [next(c for c in rec["comparisons"] if (c["a"], c["b"], c["budget"]) == (a, b, x)) for x in bs]
        lines.append(f"| {a} - {b} | " + " | ".join(f"{c['mean_diff']:+.4f} [{c['ci95'][0]:+.4f}, "
                                                       f"{c['ci95'][1]:+.4f}]" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.auto_realtext", description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=("test", "record"))
    p.add_argument("--out", required=True, help="the test log's directory")
    p.add_argument("--split", required=True, help="the test split (JSONL of 1,024-token records)")
    p.add_argument("--run", action="append", default=[], metavar="NAME=DIR",
                   help="test: a run to score once; the row named auto is compared with the others")
    p.add_argument("--write", default=None, help="record: the JSON to write (a .md beside it)")
    a = parse(p, argv)  # the one write rule: --write into studies/results needs --write-shipped
    try:
        out, split = Path(a.out), Path(a.split)
        if a.stage == "test":
            runs = {}
            for r in a.run:
                name, sep, d = r.partition("=")
                if not sep or not name or not Path(d).is_dir():
                    p.error(f"--run {r!r}: give NAME=DIR of a trained run")
                runs[name] = Path(d)
            test_stage(out, split, runs)
        rec = record(out, split)
        text = markdown(rec)
        if a.write:  # the record and its table beside it
            write_json(Path(a.write), rec)
            Path(a.write).with_suffix(".md").write_text(text)
        print(text)
    except ValueError as e:  # no row scored yet, a run not trained: one line, not a traceback
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
