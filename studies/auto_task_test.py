"""Score a ``kvpop train --auto --task`` run once on its task's ledger test seeds, as the ledger scores its rows
(``studies.evidence_synthetic``: ``test_seed(FRESH_FIRST + i)``, 8 sequences per length, at the training
length and twice it, the headline budget (kvtrace 128, lookahead 64), the demo's sinks and window)::

    python -m studies.auto_task_test --run runs/auto_kvtrace --out runs/auto_kvtrace/test
    python -m studies.auto_task_test --task lookahead --run runs/auto_lookahead --out runs/auto_lookahead/test

Writes ``OUT/test_results.json``; a run's row is new, so the split's once-per-row rule holds when each run is
scored once.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .paths import parse


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvpop.evaluation import evaluate as E
    from studies.evidence_synthetic import FRESH_FIRST, HEADLINE_BUDGET, _demo

    p = argparse.ArgumentParser(prog="python -m studies.auto_task_test", description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="the kvpop train --auto --task output directory (a joint run)")
    p.add_argument("--out", required=True, help="where test_results.json goes")
    p.add_argument("--task", choices=tuple(HEADLINE_BUDGET), default="kvtrace",
                   help="the run's task (kvpop train --task NAME; default kvtrace)")
    p.add_argument("--n-test", type=int, default=8, help="test sequences per length (default 8, the ledger's)")
    a = parse(p, argv)
    budget = HEADLINE_BUDGET[a.task]
    run, out = Path(a.run), Path(a.out)
    if not (run / "scorers.safetensors").is_file() or not (run / "model").is_dir():
        raise SystemExit(f"--run {run}: needs a joint run's scorers.safetensors and model/ (kvpop train --auto "
                         f"--task --lr-model ...)")
    torch.set_num_threads(1)
    S, args, s = _demo(a.task, out, 6)
    mod = S.task_module(a.task)
    base = E.load_base_model(S.base_model_dir(args, a.task))
    m = S.policy_model(E, base, "kvpop-mlp-joint", run, dict(sinks=s["sinks"], window=s["window"], budget=budget))
    cfg = E.EvalConfig(train_len=s["train_len"], lengths=[s["train_len"], 2 * s["train_len"]], budgets=[budget],
                       n_sequences=a.n_test, sinks=s["sinks"], window=s["window"], progress=False,
                       first_seed=FRESH_FIRST, split="test")
    res = E.evaluate({"dense": base, "kvpop-mlp-joint": m}, cfg, task=mod)
    out.mkdir(parents=True, exist_ok=True)
    (out / "test_results.json").write_text(json.dumps(res, indent=1, default=str))
    for r in res["rows"]:
        print(f"{r['policy']} L={r.get('length')} B={r.get('budget')}: accuracy {r['accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
