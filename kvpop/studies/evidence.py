"""The evidence ledger: seeded, selection-first, test-once runs of every headline row, on every instrument.

::

    python -m kvpop.studies.evidence realtext --out runs/evidence/realtext     # train, select, test (resumable)
    python -m kvpop.studies.evidence synthetic --task lookahead --out runs/evidence/lookahead
    python -m kvpop.studies.evidence synthetic --task kvtrace --out runs/evidence/kvtrace
    python -m kvpop.studies.evidence ledger --runs runs/evidence --out kvpop/data/demo_results/evidence.json
    python -m kvpop.studies.evidence readme --evidence kvpop/data/demo_results/evidence.json --readme README.md

The rules every instrument's runner keeps (``docs/DESIGN.md``, section "Evidence"):

* **Selection first, on validation.**  Every tuned row's settings come from :func:`choose` over validation
  trials (the same function for KVpop and DMS, and for ``kvpop train --auto`` and ``kvpop demo --select``:
  :func:`kvpop.training.search.prefer`'s paired margin, then the top two confirmed with seed 1); the runner
  writes ``selection.json`` (every trial, the chosen settings, how many trials each row's selection ran)
  *before* any test evaluation, and the test stage refuses to start without it.
* **Seeds.**  Each chosen recipe is trained with every seed of ``--seeds`` (default 0, 1, 2); a seed moves
  every random draw of a run (initialisation, data order, relaxation noise).
* **Test once.**  :class:`TestLog` scores a (row, seed) on the test split at most once: a second request
  returns the logged result, and the row's ``test_evaluations`` in the ledger is the number of times its
  test split was scored (1).
* **Names say the recipe.**  Row names carry their settings (``kvpop-mlp-joint[mean,adaptive,student]``);
  ``recipe`` in the ledger holds every setting.

The ledger (``evidence.json``) is ``{"rows": [...]}``, one row per (instrument, policy, budget):
``instrument``, ``policy``, ``recipe``, ``steps``, ``seeds`` (per-seed values), ``mean``, ``min``, ``max``,
``metric``, ``trials``, ``test_evaluations``, ``budget``, ``budget_fraction``, ``value`` (the mean).
The README's headline table is :func:`render_headline` of it (``tests/test_readme.py`` keeps them equal).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .ledger import EVIDENCE_FILE, archive, build_ledger, update_readme, write_json

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpop.studies.evidence", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("realtext", help="the real-text instrument's evidence (kvpop.studies.evidence_realtext)")
    s = sub.add_parser("synthetic", help="kvtrace / lookahead evidence (kvpop.studies.evidence_synthetic)")
    from . import evidence_realtext, evidence_synthetic

    evidence_realtext.add_arguments(r)
    evidence_synthetic.add_arguments(s)
    led = sub.add_parser("ledger", help="collect every instrument's rows into evidence.json")
    led.add_argument("--runs", required=True, help="directory holding <instrument>/evidence_rows.json")
    led.add_argument("--out", default=str(EVIDENCE_FILE))
    led.add_argument("--archive", default=str(EVIDENCE_FILE.parent / "evidence"),
                     help="where each instrument's selection, test log, rows and command log are copied")
    rd = sub.add_parser("readme", help="regenerate the README's headline table from evidence.json")
    rd.add_argument("--evidence", default=str(EVIDENCE_FILE))
    rd.add_argument("--readme", default="README.md")
    rd.add_argument("--every-budget", action="store_true",
                    help="every budget's rows, not the headline's (the results document's full table)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "realtext":
            return evidence_realtext.run(a)
        if a.cmd == "synthetic":
            return evidence_synthetic.run(a)
        if a.cmd == "ledger":
            led_rows = build_ledger(a.runs)
            write_json(a.out, led_rows)
            copied = archive(a.runs, a.archive)
            print(f"{a.out}: {len(led_rows['rows'])} rows; {len(copied)} records copied to {a.archive}")
            return 0
        changed = update_readme(a.readme, json.loads(Path(a.evidence).read_text()), every_budget=a.every_budget)
        print(f"{a.readme}: {'updated' if changed else 'unchanged'}")
        return 0
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"python -m kvpop.studies.evidence: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
