"""The evidence ledger: seeded, selection-first, test-once runs of every headline row, on every instrument.

::

    python -m studies.evidence realtext --out runs/evidence/realtext     # train, select, test (resumable)
    python -m studies.evidence synthetic --task lookahead --out runs/evidence/lookahead
    python -m studies.evidence synthetic --task kvtrace --out runs/evidence/kvtrace
    python -m studies.evidence ledger --runs runs/evidence --out runs/evidence/evidence.json
    python -m studies.evidence readme --evidence runs/evidence/evidence.json --readme my-notes.md
    python -m studies.evidence ledger --runs runs/evidence --write-shipped   # the shipped ledger
    python -m studies.evidence readme --write-shipped                        # the README's headline block

The files the project ships (the ledger ``studies/results/evidence.json`` and its archive beside it,
``README.md``, anything in the package or ``docs/``) are written only with ``--write-shipped``; every ledger
read is checked row by row (:func:`studies.ledger.check_ledger`) before anything is written, a ledger
rebuilt from some instruments' runs keeps the other instruments' rows of the ledger it replaces, and a table
that would be empty or drop an instrument the README block shows is refused.

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
``metric``, ``trials``, ``test_evaluations``, ``budget``, ``budget_fraction``, ``value`` (the mean); a row may
carry the ``split`` it was scored on (rows of one policy on two splits are two rows) and ``per_sequence`` (one list
per seed).  Its ``comparisons`` (optional) are paired intervals between rows: ``instrument``, ``budget``, ``a``,
``b``, ``mean_diff`` (a minus b), ``ci95``, ``n_sequences``, ``n_clusters``, ``seeds``, ``method``, ``split``
(:func:`studies.ledger.check_comparisons`).
The README's headline table is :func:`render_headline` of it (``tests/test_readme.py`` keeps them equal).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .ledger import EVIDENCE_FILE, archive, build_ledger, merge_ledger, read_ledger, update_readme, write_json
from .paths import README_FILE, check_out_dir

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.evidence", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("realtext", help="the real-text instrument's evidence (studies.evidence_realtext)")
    s = sub.add_parser("synthetic", help="kvtrace / lookahead evidence (studies.evidence_synthetic)")
    from . import evidence_realtext, evidence_synthetic

    evidence_realtext.add_arguments(r)
    evidence_synthetic.add_arguments(s)
    led = sub.add_parser("ledger", help="collect every instrument's rows into a ledger (evidence.json)")
    led.add_argument("--runs", required=True, help="directory holding <instrument>/evidence_rows.json")
    led.add_argument("--out", default=None,
                     help=f"the ledger file to write (required unless --write-shipped: then {EVIDENCE_FILE})")
    led.add_argument("--archive", default=None,
                     help="where each instrument's selection, test log, rows and command log are copied (default: "
                          "evidence/ beside --out)")
    rd = sub.add_parser("readme", help="regenerate a README's headline table from a ledger")
    rd.add_argument("--evidence", default=str(EVIDENCE_FILE), help="the ledger (default: the shipped one)")
    rd.add_argument("--readme", default=None,
                    help=f"the file whose evidence block is rewritten (required unless --write-shipped: then "
                         f"{README_FILE.name} of the checkout)")
    rd.add_argument("--every-budget", action="store_true",
                    help="every budget's rows, not the headline's (the results document's full table)")
    for q in (r, s, led, rd):
        q.add_argument("--write-shipped", action="store_true",
                       help="allow writing the files the project ships (the ledger, its archive, README.md, the "
                            "results documents); without it they are refused")
    a = p.parse_args(argv)
    try:
        if a.cmd in ("realtext", "synthetic"):
            check_out_dir(a.out, write_shipped=a.write_shipped)
            return (evidence_realtext if a.cmd == "realtext" else evidence_synthetic).run(a)
        if a.cmd == "ledger":
            return _ledger(a)
        return _readme(a)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"python -m studies.evidence: error: {e}", file=sys.stderr)
        return 2


def _target(path: str | None, shipped: Path, a: argparse.Namespace, option: str) -> Path:
    """Where ``option`` writes: ``path``, else ``shipped`` with ``--write-shipped``; a shipped file only with it."""
    if path is None:
        if not a.write_shipped:
            raise ValueError(f"{a.cmd}: give {option} FILE, or --write-shipped to rewrite the shipped {shipped}")
        return shipped
    return check_out_dir(path, option, write_shipped=a.write_shipped, file=option != "--archive")


def _ledger(a: argparse.Namespace) -> int:
    out = _target(a.out, EVIDENCE_FILE, a, "--out")
    dest = _target(a.archive if a.archive is not None else str(out.parent / "evidence"),
                   EVIDENCE_FILE.parent / "evidence", a, "--archive")
    if dest.resolve() == Path(a.runs).resolve():
        raise ValueError(f"ledger: --archive {dest} is --runs itself; the archive is a copy of the runs' records")
    led_rows = build_ledger(a.runs)  # every row checked before anything is written
    try:
        old = read_ledger(out) if out.exists() else []
    except ValueError as e:
        raise ValueError(f"{e}; the file is left as it is: move it away or give another --out") from None
    old_comps = json.loads(out.read_text(encoding="utf-8")).get("comparisons", []) if out.exists() else []
    led_rows, kept = merge_ledger(led_rows, old, old_comps)
    write_json(out, led_rows)
    copied = archive(a.runs, dest)
    print(f"{out}: {len(led_rows['rows'])} rows; {len(copied)} records copied to {dest}"
          + (f"; the rows of {', '.join(kept)} kept from the previous {out.name} (no evidence_rows.json for "
             f"{'it' if len(kept) == 1 else 'them'} under {a.runs})" if kept else ""))
    return 0


def _readme(a: argparse.Namespace) -> int:
    readme = _target(a.readme, README_FILE, a, "--readme")
    evidence = {"rows": read_ledger(a.evidence)}
    changed = update_readme(readme, evidence, every_budget=a.every_budget)
    from .claims import CLAIMS_ALL_START, CLAIMS_START, update_claims

    text = readme.read_text(encoding="utf-8")
    if CLAIMS_START in text or CLAIMS_ALL_START in text:  # the real-text claims' blocks (studies.claims)
        changed = update_claims(readme) or changed
    print(f"{readme}: {'updated' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
