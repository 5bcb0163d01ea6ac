"""The project's speed and memory targets, and how each is read from a benchmark run.

Every target is one figure that one benchmark writes into its ``extra_info`` under ``key``; its row in
the verdict table says *met*, *not met*, *not run* (with the reason) or *measured* (a figure the
issues ask for without a goal).  The table is printed at the end of every benchmark session
(``benchmarks/conftest.py``) and written by ``benchmarks/tools/gpu_check.py``.

To add a figure to the table, write it into ``benchmark.extra_info`` under the key of its row below.
A target with ``file=None`` is matched by its key in any benchmark (the rows of the batched-decoding and
training-at-scale figures, whose CI runs do not record them): once a benchmark writes that key in every run,
pin its ``file`` and ``test`` here so that a later rename is caught.
``check_registry`` fails CI when a pinned benchmark or its key disappears.

This module is plain Python (no torch, no pytest) so the driver and the tests can use it anywhere.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MET, NOT_MET, NOT_RUN, MEASURED = "met", "not met", "not run", "measured"
# the extra_info key of a record's roofline line (benchmarks/tools/roofline.py), shown beside its figure
ROOFLINE_KEY = "roofline"
DEVICES = ("cuda", "cpu", "any")


@dataclass(frozen=True)
class Target:
    """One row of the verdict table.

    ``key``: the ``extra_info`` key holding the figure.  ``op``/``goal``: the figure must be ``<=`` or
    ``>=`` the goal (``op=None``: reported without a goal).  ``device``: where the figure counts
    (``"cuda"``: only in a run with a GPU, the shapes of the issues; ``"cpu"``: only without one;
    ``"any"``).  ``file``/``test``: the benchmark that records it (``test=None``: any test of the file;
    ``file=None``: any benchmark).  ``where``: parameters (pytest parametrisation or ``extra_info``
    values) a record must have.  ``also``: ``extra_info`` keys shown beside the figure.
    """

    id: str
    issue: int
    what: str
    key: str
    op: str | None
    goal: float | None
    device: str
    file: str | None = None
    test: str | None = None
    where: Mapping[str, Any] = field(default_factory=dict)
    also: tuple[str, ...] = ()
    unit: str = "x"

    def __post_init__(self):
        if self.op not in ("<=", ">=", None):
            raise ValueError(f"target {self.id}: op must be '<=', '>=' or None, got {self.op!r}")
        if (self.op is None) != (self.goal is None):
            raise ValueError(f"target {self.id}: op and goal go together (op={self.op!r}, goal={self.goal!r})")
        if self.device not in DEVICES:
            raise ValueError(f"target {self.id}: device must be one of {DEVICES}, got {self.device!r}")
        if self.test is not None and self.file is None:
            raise ValueError(f"target {self.id}: a test name needs its file")

    @property
    def goal_text(self) -> str:
        return "report" if self.op is None else f"{self.op} {self.goal:g}{self.unit}"


TARGETS: tuple[Target, ...] = (
    Target("schedule-vs-sdpa", 2, "eviction schedule + decisions of one layer vs its dense causal SDPA forward, "
           "S=16K, 8 KV heads", key="ratio_schedule_over_sdpa", op="<=", goal=0.2, device="cuda",
           file="benchmarks/test_schedule.py", test="test_schedule_gpu", where={"S": 16384, "provider": "kvpop"},
           also=("t_schedule_s", "t_sdpa_fwd_s")),
    Target("schedule-cpu-scaling", 2, "schedule CPU path: time(S=64K) / time(S=8K)", key="ratio_64k_over_8k",
           op="<=", goal=12, device="any", file="benchmarks/test_schedule.py", test="test_schedule_cpu_scaling"),
    Target("target-flop-rate", 3, "future_attention_target FLOP rate / dense causal SDPA forward's, S=16K, 32/8 heads",
           key="ratio_tflops_over_sdpa", op=">=", goal=0.7, device="cuda", file="benchmarks/test_target.py",
           test="test_future_target_vs_sdpa", also=("kvpop_tflops", "sdpa_tflops")),
    Target("sparse-vs-sdpa", 4, "sparse_attention fwd+bwd time / dense causal SDPA's, S=16K, B=2048",
           key="ratio_kvpop_over_sdpa", op="<=", goal=0.5, device="cuda", file="benchmarks/test_sparse_attention.py",
           test="test_sparse_attention_target", also=("kvpop_s", "sdpa_s")),
    Target("sparse-vs-flex", 4, "FlexAttention fwd+bwd time (same mask) / sparse_attention's, S=16K, B=2048",
           key="speedup_over_flex", op=">=", goal=2, device="cuda", file="benchmarks/test_sparse_attention.py",
           test="test_sparse_attention_target", also=("flex_s",)),
    Target("decode-step-B2048", 6, "decode step of one layer at 131K, dense SDPA time / kvpop's (B=2048)",
           key="speedup", op=">=", goal=20, device="cuda", file="benchmarks/test_decode.py",
           test="test_decode_step_speedup", where={"budget": 2048}, also=("speedup_source", "speedup_eager")),
    Target("decode-step-B4096", 6, "decode step of one layer at 131K, dense SDPA time / kvpop's (B=4096)",
           key="speedup", op=">=", goal=20, device="cuda", file="benchmarks/test_decode.py",
           test="test_decode_step_speedup", where={"budget": 4096}, also=("speedup_source", "speedup_eager")),
    Target("decode-step-cpu-flat", 6, "decode step CPU path: time at 32K context / at 1K",
           key="ratio_longest_over_first_ctx", op="<=", goal=1.3, device="cpu", file="benchmarks/test_decode.py",
           test="test_decode_step_speedup"),
    Target("generation-memory-flat", 6, "generation 8K -> 131K: growth of kvpop's decode-time peak memory / "
           "dense's growth", key="kvpop_growth_over_dense_growth", op="<=", goal=0.05, device="cuda",
           file="benchmarks/test_decode.py", test="test_decode_generate_memory",
           also=("kvpop_decode_peak_gb_longest", "dense_decode_peak_gb_longest")),
    # head-adaptive budgets: the packed layout's decode step against uniform budgets of the
    # same total, side by side in one run (one KV head ~4x the others)
    Target("decode-head-adaptive-cpu", 22, "decode step CPU path, head-adaptive budgets (one head ~4x) / uniform, "
           "same total (mean 512), 32K context", key="ratio_adaptive_over_uniform", op="<=", goal=1.3, device="cpu",
           file="benchmarks/test_decode.py", test="test_decode_step_head_adaptive",
           also=("adaptive_s", "uniform_s")),
    Target("decode-head-adaptive-gpu", 22, "decode step, Qwen3-8B shapes (32/8 heads, D=128, bf16), head-adaptive "
           "budgets (one head ~4x, mean 2048) / uniform B=2048", key="ratio_adaptive_over_uniform", op="<=",
           goal=1.3, device="cuda", file="benchmarks/test_decode.py", test="test_decode_step_head_adaptive",
           also=("ratio_source", "ratio_adaptive_over_uniform_eager")),
    Target("decode-head-adaptive-bytes", 22, "decode cache bytes, head-adaptive budgets / uniform of the same total",
           key="bytes_adaptive_over_uniform", op="<=", goal=1.0, device="any", file="benchmarks/test_decode.py",
           test="test_decode_step_head_adaptive", also=("adaptive_bytes", "uniform_bytes")),
    Target("decode-quantized-gpu", 34, "decode step, Qwen3-8B shapes (32/8 heads, D=128), 32K context, B=2048: "
           "int8 slots (dequantised on load) / bf16 slots", key="int8_time_over_float", op="<=", goal=1.1,
           device="cuda", file="benchmarks/test_decode_quantized.py", test="test_decode_step_quantized",
           also=("int8_s", "float_s", "fp8_time_over_float")),
    Target("decode-quantized-bytes-gpu", 34, "decode state bytes per sequence, Qwen3-8B shapes, B=2048: int8 slots "
           "with their float32 scales / bf16 slots", key="int8_bytes_over_float", op="<=", goal=0.55, device="cuda",
           file="benchmarks/test_decode_quantized.py", test="test_decode_step_quantized",
           also=("int8_bytes_per_sequence", "float_bytes_per_sequence")),
    Target("decode-quantized-cpu", 34, "decode step CPU path (4/2 heads, D=64, B=512, 32K context): int8 slots / "
           "float32 slots", key="int8_time_over_float", op=None, goal=None, device="cpu",
           file="benchmarks/test_decode_quantized.py", test="test_decode_step_quantized",
           also=("int8_bytes_over_float", "bf16_time_over_float")),
    # batched decoding.  Under --benchmark-disable (CI) its benchmark runs smoke sizes without the
    # CPU figures, so the CPU rows are matched by key, not pinned: a pinned row on the dry run's device must
    # record its number there, and these cannot (the dry check then fails; it did once)
    Target("batched-decode-gpu", 12, "decode tokens/s, kvpop / dense, context 32K, batch 32",
           key="kvpop_over_dense_b32_ctx32k", op=">=", goal=3, device="cuda",
           file="benchmarks/test_batched_decode.py", test="test_batched_decode"),
    Target("batched-decode-cpu-scaling", 12, "CPU, tiny model, 4K context: kvpop tokens/s at batch 32 / batch 1",
           key="kvpop_b32_over_b1", op=">=", goal=10, device="cpu"),
    Target("batched-decode-cpu-vs-dense", 12, "CPU, tiny model, 4K context: kvpop tokens/s / dense's at batch 32",
           key="kvpop_over_dense_b32", op=">=", goal=1, device="cpu"),
    Target("batched-fit-131k-kvpop", 12, "Qwen3-8B, 131K tokens: sequences whose kvpop cache (B=2048) fits beside "
           "the weights on this GPU", key="kvpop_max_batch_ctx131k", op=None, goal=None, device="cuda",
           file="benchmarks/test_batched_decode.py", test="test_batch_that_fits_131k", unit=" seqs"),
    Target("batched-fit-131k-dense", 12, "Qwen3-8B, 131K tokens: sequences whose dense cache fits beside the "
           "weights on this GPU", key="dense_max_batch_ctx131k", op=None, goal=None, device="cuda",
           file="benchmarks/test_batched_decode.py", test="test_batch_that_fits_131k", unit=" seqs"),
    # training at scale.  The loss-memory figure comes from a CPU run of ~20 GB outside CI (under
    # --benchmark-disable its benchmark runs a small case without the figure): matched by key
    Target("train-loss-memory", 13, "training step, V=151936, S=8192: memory the fused chunked loss adds over "
           "the model's activations", key="loss_extra_gb_s8192", op="<=", goal=0.5, device="any", unit=" GB"),
    Target("train-step-throughput", 13, "training step at S=16384, kvpop tokens/s / dense + plain CE's",
           key="train_tokens_per_s_ratio", op=None, goal=None, device="cuda", file="benchmarks/test_train_step.py",
           test="test_train_step_gpu", also=("kvpop_tokens_per_s", "dense_tokens_per_s")),
    Target("train-step-memory", 13, "training step at S=16384, kvpop peak memory / dense + plain CE's",
           key="train_peak_mem_ratio", op=None, goal=None, device="cuda", file="benchmarks/test_train_step.py",
           test="test_train_step_gpu", also=("kvpop_peak_mem_gb", "dense_peak_mem_gb")),
    # end to end (issue 60): what a user reads first.  A Qwen3-8B-shaped model with random weights (fewer layers
    # where the dense cache asks, recorded as layers_ctx*), the cache filled synthetically to the context, HF
    # generate timed over the decoded tokens.  Last in the registry: the most expensive, run while time remains
    # (benchmarks/test_e2e.py skips a case that would pass the GPU check's cap, with the reason)
    Target("e2e-decode-b1", 60, "HF generate, Qwen3-8B shape, 32K context, batch 1: kvpop (B=2048) tokens/s / dense "
           "SDPA's", key="kvpop_over_dense_ctx32k", op=None, goal=None, device="cuda", file="benchmarks/test_e2e.py",
           test="test_e2e_decode", where={"batch": 1},
           also=("kvpop_tokens_per_s_ctx32k", "dense_tokens_per_s_ctx32k", "kvpop_over_dense_ctx131k",
                 "layers_ctx32k")),
    Target("e2e-decode-b32", 60, "HF generate, Qwen3-8B shape, 32K context, batch 32: kvpop (B=2048) tokens/s / "
           "dense SDPA's", key="kvpop_over_dense_ctx32k", op=">=", goal=3, device="cuda",
           file="benchmarks/test_e2e.py", test="test_e2e_decode", where={"batch": 32},
           also=("kvpop_tokens_per_s_ctx32k", "dense_tokens_per_s_ctx32k", "kvpop_over_dense_ctx131k",
                 "layers_ctx32k")),
    Target("e2e-decode-b32-memory", 60, "HF generate, Qwen3-8B (all 36 layers), batch 32: kvpop's peak memory above "
           "the weights, longest context (131K) / shortest (8K): flat", key="kvpop_mem_longest_over_shortest",
           op="<=", goal=1.1, device="cuda", file="benchmarks/test_e2e.py", test="test_e2e_decode",
           where={"batch": 32}, also=("kvpop_mem_gb_all_layers_ctx131k", "dense_mem_longest_over_shortest",
                                      "kvpop_tokens_per_s_all_layers_ctx131k")),
    Target("train-step-16k", 60, "retrofit training step, Qwen3-8B shape (fewer layers), S=16384: kvpop's time / the "
           "dense fine-tune's", key="train_time_kvpop_over_dense", op="<=", goal=1.3, device="cuda",
           file="benchmarks/test_e2e.py", test="test_train_step_16k",
           also=("kvpop_step_s", "dense_step_s", "kvpop_peak_mem_gb", "dense_peak_mem_gb", "layers")),
)


# ----------------------------------------------------------------------------- matching records
def _same(a: Any, b: Any) -> bool:
    return a == b or str(a) == str(b)


def _file_of(nodeid_or_path: str) -> str:
    return nodeid_or_path.split("::", 1)[0].replace("\\", "/")


def matches(target: Target, record: Mapping[str, Any], use_where: bool = True) -> bool:
    """Whether ``record`` (one benchmark test's outcome, see ``benchmarks/tools/recorder.py``) is the target's.

    A target pinned to a file/test matches that test's records; an unpinned one matches every record that
    carries its key.  ``where`` is checked (unless ``use_where`` is false) against the test's parameters,
    then its ``extra_info``.
    """
    info = record.get("extra_info") or {}
    if target.file is not None:
        rfile = _file_of(record.get("file") or record.get("nodeid", ""))
        # node ids are relative to pytest's rootdir, which may lie above or below the repository root
        if not (rfile == target.file or rfile.endswith("/" + target.file) or target.file.endswith("/" + rfile)):
            return False
        if target.test is not None and record.get("test") != target.test:
            return False
    elif target.key not in info:
        return False
    params = record.get("params") or {}
    for name, want in (target.where.items() if use_where else ()):
        have = params[name] if name in params else info.get(name, None)
        if have is None or not _same(have, want):
            return False
    return True


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _fmt(v: Any, unit: str = "") -> str:
    n = _number(v)
    if n is None:
        return str(v)
    return f"{n:.3g}{unit}"


def verdict(target: Target, records: Sequence[Mapping[str, Any]], device: str,
            root: str | Path | None = None) -> dict:
    """The table row of ``target`` from the ``records`` of a run on ``device`` (``"cuda"`` or ``"cpu"``).

    Several matching records (a parametrised test): the worst figure against the goal counts.  A row is
    *not run* when the target belongs to the other device (the figure of this run is shown in the note),
    when no test recorded it (the note says whether the benchmark was skipped, failed, was not collected
    or is not written yet), or when the figure is missing or not a number.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    row = {"id": target.id, "issue": target.issue, "what": target.what, "goal": target.goal_text,
           "key": target.key, "value": None, "status": NOT_RUN, "note": "", "nodeid": None, "roofline": ""}
    mine = [r for r in records if matches(target, r)]
    with_value = [r for r in mine if _number((r.get("extra_info") or {}).get(target.key)) is not None]
    if with_value:
        vals = [(_number(r["extra_info"][target.key]), r) for r in with_value]
        pick = max if target.op == "<=" else min
        value, rec = pick(vals, key=lambda vr: vr[0]) if target.op else vals[-1]
        info = rec["extra_info"]
        extras = ", ".join(f"{k}={_fmt(info[k])}" for k in target.also if k in info)
        row["nodeid"] = rec.get("nodeid")
        row["roofline"] = str(info.get(ROOFLINE_KEY) or "")
        if target.device not in ("any", device):  # a figure at this device's shapes: shown, not judged
            row["note"] = (f"{'GPU' if target.device == 'cuda' else 'CPU'} target; this {device} run "
                           f"measured {_fmt(value, target.unit)} at its own shapes")
            return row
        row["value"] = value
        if target.op is None:
            row["status"] = MEASURED
        else:
            ok = value <= target.goal if target.op == "<=" else value >= target.goal
            row["status"] = MET if ok else NOT_MET
        row["note"] = extras
        return row
    if target.device not in ("any", device):
        row["note"] = f"{'GPU' if target.device == 'cuda' else 'CPU'} target; this run is on {device}"
    elif not mine:
        row["note"] = _why_absent(target, root)
    else:
        outcomes = {r.get("outcome") for r in mine}
        rec = mine[-1]
        if "failed" in outcomes:
            rec = next(r for r in mine if r.get("outcome") == "failed")
            row["note"] = f"benchmark failed: {rec.get('reason') or rec.get('nodeid')}"
        elif outcomes == {"skipped"}:
            row["note"] = f"skipped: {rec.get('reason') or '?'}"
        else:
            given = (rec.get("extra_info") or {}).get(target.key)
            row["note"] = (f"extra_info has no {target.key!r}" if given is None
                           else f"{target.key}={given!r} is not a number")
            why = (rec.get("extra_info") or {}).get("not_run")  # a benchmark's cases it did not start, and why
            if why:
                row["note"] += f" (not run: {why})"
        row["nodeid"] = rec.get("nodeid")
    return row


def _why_absent(target: Target, root: str | Path | None) -> str:
    if target.file is None:
        if root is not None:
            writers = [p.name for p in sorted((Path(root) / "benchmarks").glob("test_*.py"))
                       if _key_written(target.key, p.read_text())]
            if writers:
                return f"{target.key!r} not recorded in this run (written by {', '.join(writers)})"
            return f"no benchmark writes {target.key!r} yet"
        return f"no benchmark recorded {target.key!r} (its benchmark is not written yet or did not run)"
    if root is not None and not (Path(root) / target.file).exists():
        return f"{target.file} does not exist"
    sel = target.file + (f"::{target.test}" if target.test else "")
    cond = " with " + ", ".join(f"{k}={v}" for k, v in target.where.items()) if target.where else ""
    return f"{sel}{cond} did not run in this session"


def verdicts(records: Sequence[Mapping[str, Any]], device: str, root: str | Path | None = None,
             targets: Iterable[Target] = TARGETS) -> list[dict]:
    """One row per target, in registry order."""
    return [verdict(t, records, device, root) for t in targets]


def counts(rows: Sequence[Mapping[str, Any]]) -> dict:
    out = {MET: 0, NOT_MET: 0, NOT_RUN: 0, MEASURED: 0}
    for r in rows:
        out[r["status"]] += 1
    return out


def markdown(rows: Sequence[Mapping[str, Any]], targets: Iterable[Target] = TARGETS) -> str:
    """The verdict table as Markdown (also readable in a terminal)."""
    unit = {t.id: t.unit for t in targets}
    lines = ["| target | issue | measured | goal | verdict | roofline | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        value = "-" if r["value"] is None else _fmt(r["value"], unit.get(r["id"], ""))
        status = r["status"].upper() if r["status"] == NOT_MET else r["status"]
        note, roof = (str(r.get(k) or "").replace("|", "\\|").replace("\n", " ") for k in ("note", "roofline"))
        lines.append(f"| {r['id']}: {r['what']} | {r['issue']} | {value} | {r['goal']} | {status} | {roof or '-'} "
                     f"| {note} |")
    c = counts(rows)
    lines.append("")
    lines.append(f"{c[MET]} met, {c[NOT_MET]} not met, {c[MEASURED]} measured without a goal, {c[NOT_RUN]} not run")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- static checks
def _key_written(key: str, text: str) -> bool:
    """Whether ``text`` (a benchmark file) writes ``key``: as a string literal or a keyword argument."""
    k = re.escape(key)
    return re.search(rf"""(['"]){k}\1|\b{k}\s*=(?!=)""", text) is not None


def check_registry(collected: Iterable[str], root: str | Path,
                   targets: Iterable[Target] = TARGETS) -> tuple[list[str], list[str]]:
    """Check the registry against the benchmarks as they are: returns ``(problems, pending)``.

    ``collected``: the node ids pytest collects under ``benchmarks/``.  A problem: a pinned target whose
    file is gone, whose test is not collected, or whose key no longer appears in its file; two targets
    with one id.  Pending (not a problem): an unpinned target whose key no benchmark writes yet.
    """
    root = Path(root)
    collected = list(collected)
    tests = {(_file_of(n), n.split("::", 1)[1].split("[", 1)[0]) for n in collected if "::" in n}
    problems, pending, seen = [], [], set()
    texts = {p.relative_to(root).as_posix(): p.read_text() for p in sorted((root / "benchmarks").glob("test_*.py"))}
    for t in targets:
        if t.id in seen:
            problems.append(f"{t.id}: two targets have this id")
        seen.add(t.id)
        if t.file is None:
            if not any(_key_written(t.key, s) for s in texts.values()):
                pending.append(f"{t.id} (issue {t.issue}): no benchmark writes extra_info[{t.key!r}] yet")
            continue
        if t.file not in texts:
            problems.append(f"{t.id}: {t.file} does not exist (fix the registry in benchmarks/tools/targets.py)")
            continue
        if not any(f == t.file and (t.test is None or name == t.test) for f, name in tests):
            problems.append(f"{t.id}: pytest collects no {t.file}::{t.test or '*'}")
        if not _key_written(t.key, texts[t.file]):
            problems.append(f"{t.id}: {t.file} never writes extra_info[{t.key!r}]")
    return problems, pending


def check_reported(records: Sequence[Mapping[str, Any]], device: str,
                   targets: Iterable[Target] = TARGETS) -> list[str]:
    """After a dry run: every pinned target produced a record (passed or skipped), and every one that
    counts on this device and ran recorded a number under its key.  (A GPU target's key, which a CPU run
    may legitimately leave out, is checked statically by ``check_registry``.)"""
    problems = []
    for t in targets:
        if t.file is None:
            continue
        # on the other device a parametrised benchmark has other shapes: the test itself must report
        mine = [r for r in records if matches(t, r, use_where=t.device in ("any", device))]
        if not mine:
            problems.append(f"{t.id}: no record from {t.file}::{t.test or '*'} (not collected, or deselected)")
            continue
        ran = [r for r in mine if r.get("outcome") == "passed"]
        if any(r.get("outcome") == "failed" for r in mine):
            problems.append(f"{t.id}: its benchmark failed")
        elif t.device in ("any", device) and ran and not any(
                _number((r.get("extra_info") or {}).get(t.key)) is not None for r in ran):
            problems.append(f"{t.id}: {ran[0].get('nodeid')} ran but recorded no number under {t.key!r}")
    return problems
