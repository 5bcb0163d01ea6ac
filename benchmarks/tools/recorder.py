"""A pytest plugin: records every test's outcome and ``extra_info``, prints the verdict table.

``benchmarks/conftest.py`` registers it for every benchmark session (the table is printed at the end);
``benchmarks/tools/gpu_check.py`` also loads it into the GPU test session (``-p benchmarks.tools.gpu_plugin``) to
count outcomes.  Environment variables (set by the driver, all optional):

* ``KVPOP_RECORDS=path``: append one JSON line per test as soon as it finishes, so a run stopped by
  its time cap keeps everything it finished;
* ``KVPOP_AUTOTUNE_MAX_CONFIGS=n``: keep at most ``n`` configs of every Triton autotuner in
  ``kvpop_kernels`` (the first, which the kernel lists as its default, and others spread over the
  list), which bounds autotuning time;
* ``KVPOP_TARGETS_FIRST=1``: run the benchmarks of ``benchmarks/tools/targets.py`` first, in its order.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

from . import targets as tg

RECORDS_ENV = "KVPOP_RECORDS"
MAX_CONFIGS_ENV = "KVPOP_AUTOTUNE_MAX_CONFIGS"
TARGETS_FIRST_ENV = "KVPOP_TARGETS_FIRST"
NAME = "kvpop-recorder"


def spread(n: int, keep: int) -> list[int]:
    """Indices of ``keep`` of ``n`` configs: the first, the last, and evenly between."""
    if keep < 1:
        raise ValueError(f"{MAX_CONFIGS_ENV} must be >= 1, got {keep}")
    if keep >= n:
        return list(range(n))
    if keep == 1:
        return [0]
    return sorted({round(i * (n - 1) / (keep - 1)) for i in range(keep)})


def cap_autotuners(keep: int, modules: dict | None = None) -> list[str]:
    """Cut every Triton ``Autotuner`` found in ``kvpop_kernels.*`` to ``spread(n, keep)`` of its configs.

    Idempotent (a capped autotuner is marked).  Returns ``"module.name: n -> m"`` for the ones it cut.
    """
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # no triton: nothing to cap
        return []
    done = []
    for mname, mod in list((modules if modules is not None else sys.modules).items()):
        if not mname.startswith("kvpop_kernels") or mod is None:
            continue
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, Autotuner) and not getattr(obj, "_kvpop_capped", False):
                n = len(obj.configs)
                obj.configs = [obj.configs[i] for i in spread(n, keep)]
                obj._kvpop_capped = True
                done.append(f"{mname}.{name}: {n} -> {len(obj.configs)}")
    return done


def _jsonable(x: Any) -> Any:
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    return str(x)


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


class Recorder:
    """The plugin object (one per session, registered under ``NAME``)."""

    def __init__(self, table: bool):
        self.table = table
        self.records: list[dict] = []
        self.device = _device()
        self.path = os.environ.get(RECORDS_ENV) or None
        keep = os.environ.get(MAX_CONFIGS_ENV)
        self.keep = int(keep) if keep else None
        self.capped: list[str] = []

    # -- ordering and autotune cap
    def pytest_collection_modifyitems(self, config, items):
        if os.environ.get(TARGETS_FIRST_ENV) not in (None, "", "0"):
            pinned = [t for t in tg.TARGETS if t.file is not None]

            def rank(item) -> int:  # the registry's order, then everything else in collection order
                rec = self._base(item)
                return next((i for i, t in enumerate(pinned) if tg.matches(t, rec)), len(pinned))

            items.sort(key=rank)

    def pytest_runtest_setup(self, item):
        if self.keep is not None:
            self.capped += cap_autotuners(self.keep)

    # -- records
    @staticmethod
    def _base(item) -> dict:
        callspec = getattr(item, "callspec", None)
        return {"nodeid": item.nodeid, "file": item.nodeid.split("::", 1)[0],
                "test": getattr(item, "originalname", None) or item.name.split("[", 1)[0],
                "params": _jsonable(dict(callspec.params)) if callspec is not None else {}}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = yield
        if rep.when == "call" or (rep.when == "setup" and not rep.passed):
            self._record(item, rep)
        elif rep.when == "teardown" and rep.failed and self.records and self.records[-1]["nodeid"] == item.nodeid:
            self.records[-1].update(outcome="failed", reason="teardown: " + self._reason(rep))
            self._write(self.records[-1])
        return rep

    @staticmethod
    def _reason(rep) -> str:
        if rep.skipped and isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:
            return str(rep.longrepr[2]).removeprefix("Skipped: ")
        crash = getattr(rep.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(rep.longrepr or "")
        return text.strip().splitlines()[0][:300] if text.strip() else ""

    def _record(self, item, rep) -> None:
        rec = self._base(item)
        bench = getattr(item, "funcargs", {}).get("benchmark")
        stats = getattr(getattr(bench, "stats", None), "stats", None)
        rec.update(outcome=rep.outcome, reason="" if rep.passed else self._reason(rep),
                   duration_s=round(rep.duration, 4), device=self.device,
                   group=getattr(bench, "group", None),
                   extra_info=_jsonable(dict(getattr(bench, "extra_info", {}) or {})),
                   stats={k: getattr(stats, k) for k in ("min", "mean", "median", "rounds")} if stats else None)
        self.records.append(rec)
        self._write(rec)

    def _write(self, rec: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
                f.flush()

    # -- the table
    def pytest_terminal_summary(self, terminalreporter):
        if self.capped:
            terminalreporter.write_line(f"autotune configs capped ({MAX_CONFIGS_ENV}={self.keep}): "
                                        + "; ".join(self.capped))
        if not self.table:
            return
        rows = tg.verdicts(self.records, self.device, root=str(terminalreporter.config.rootpath))
        terminalreporter.write_sep("=", f"kvpop verdicts ({self.device})")
        terminalreporter.write_line(tg.markdown(rows))


def register(config, table: bool) -> Recorder:
    """Register the recorder once per session; a second call only switches the table on."""
    rec = config.pluginmanager.get_plugin(NAME)
    if rec is None:
        rec = Recorder(table=table)
        config.pluginmanager.register(rec, NAME)
    rec.table = rec.table or table
    return rec
