"""EXPERIMENT RECORD, not part of the benchmark suite: pytest does not collect it, CI does not run it,
nothing imports it.  It is kept so that the figures benchmarks/RESULTS.md quotes for the DMS store
("the paged store against the per-head lists it replaced") can be re-measured; it reads an old class
out of git history, so it runs only in a full clone and may stop running once that code is gone.

A/B of DMS's decode step: the paged store (``kvpop.baselines.dms``, now) against the per-head lists it
replaced (``kvpop/core/dms.py`` at commit fb1bb9f, read from git), timed side by side in one process.

``OMP_NUM_THREADS=1 python benchmarks/records/ab_dms_store.py`` (CPU, the PyTorch paths; needs the git history).
Shapes and per-head lengths are those of ``benchmarks/test_decode_dms.py`` (32K context, 8 / 4 heads,
D 64, fp32); every ring token is marked for eviction, so the lengths stay put while timing.  Prints
the best of 5 x 60 steps for each, and new / old.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import test_decode_dms as T  # noqa: E402

OLD_COMMIT = "fb1bb9f"


def _old_module():
    src = subprocess.run(["git", "show", f"{OLD_COMMIT}:kvpop/core/dms.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "dms_lists.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kvpop.core.dms_lists", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _best(f, n: int = 300) -> float:
    for _ in range(10):
        f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 5):
            f()
        best = min(best, (time.perf_counter() - t0) / (n // 5))
    return best


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    old = _old_module()
    for budget in T.BUDGETS:
        for provider in ("dms-uniform", "dms-measured"):
            lengths = T.head_lengths(budget, provider)
            gen = torch.Generator().manual_seed(0)
            q, kn, vn = (torch.randn(h, T.HD, generator=gen) for h in (T.HQ, T.HKV, T.HKV))
            lo = old.DMSCacheLayer(sinks=T.SINKS, window=T.WINDOW, threshold=0.0)
            kv = torch.randn(1, T.HKV, 1, T.HD, generator=gen)
            lo.lazy_initialization(kv, kv)
            lo.ring_evict.fill_(True)
            for h, n in enumerate(lengths):
                m = n - T.SINKS - T.WINDOW
                lo._append(h, torch.randn(m, T.HD, generator=gen), torch.randn(m, T.HD, generator=gen),
                           list(range(T.SINKS, T.SINKS + m)))
            lo.seen = T.CTX
            new_step, _ = T._dms_step(lengths, q, kn, vn, gen)
            evict = torch.ones(T.HKV, dtype=torch.bool)
            t_old = _best(lambda lo=lo, q=q, kn=kn, vn=vn, ev=evict: old._decode(lo, q, kn, vn, ev, T.HD ** -0.5))
            t_new = _best(new_step)
            print(f"B={budget} {provider} heads {lengths}: lists {t_old * 1e6:.0f} us, paged {t_new * 1e6:.0f} us, "
                  f"paged / lists {t_new / t_old:.2f}")


if __name__ == "__main__":
    main()
