"""Every shipped figure true to today's code.

Each shipped result file (or marked block of one, such as the README's walkthrough tables) is listed in
:data:`GROUPS` with the *sentinels* its figures depend on and the command that regenerates it. A sentinel is
a cheap canonical computation through the same code the file was made with:

- ``demo/<task>/<policy>``: the rows of one policy in a ``kvpop demo --quick`` run (every retrofit trained a
  few steps, every policy evaluated): a change anywhere in that policy's training or evaluation numerics,
  down to the summation order of one op, changes its bytes;
- ``code/<method>``: two training steps of ``kvpop train`` on the real-text code model and its evaluation
  with ``kvpop eval --data`` (the real-text instrument's path);
- ``forward/<policy>``: logits of a seeded tiny Qwen3 decoding through ``KVpopCache`` or ``DMSCache``
  (prefill past the budget, then token by token), for every policy, scorer and slot storage.

``freshness/manifest.json`` records, per file, the bytes it held (sha256) and the digest of every sentinel
it depends on at the time it was made. ``python -m freshness check`` (and the fast test
``tests/test_freshness.py``) recomputes the sentinels and names every file whose sentinels moved, with
the command that regenerates it. After regenerating, ``python -m freshness stamp PATH...`` records
the new state; it refuses a file whose sentinels moved but whose bytes did not (it was not regenerated)
unless ``--unchanged`` says that the new code gives the same bytes (checked by regenerating, by hand).

Digests are of float32 bits, which depend on the machine's arithmetic (its BLAS kernels and vector
width): the manifest records a digest of a fixed set of plain torch ops on the machine that stamped it.
On a machine whose digest differs, the sentinels are compared by value instead (``forward/*`` only, to a
relative 1e-4: a numerics change that moves logits by less is not seen there), and the check says so; the
``demo/*`` and ``code/*`` sentinels (training runs, whose bits differ there) are then stood in for by the digest
of the training code (:data:`TRAINING_CODE`, comments and docstrings dropped) each file was stamped with
(``"training_code"`` in its record), so that a change to the training loss shows on any machine.

Timings (``benchmarks/RESULTS.md``'s CPU figures) cannot be recomputed: their sentinel is ``source/...``,
a digest of the timed modules' code (comments and docstrings dropped), so a change of the code they time
marks them stale.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "freshness" / "manifest.json"
RESULTS = "kvpop/data/demo_results"
"""The demo's results (installed with the package)."""
STUDY_RESULTS = "studies/results"
"""The research instruments' results, beside them (not installed)."""
TASKS = ("kvtrace", "lookahead")
FORWARD_POLICIES = ("kvpop-mlp", "kvpop-mlstm", "streaming", "tova", "h2o", "kvpop-mlp-int8", "kvpop-mlp-fp8",
                    "dms")
DEMO_POLICIES = ("dense", "streaming", "tova", "h2o", "kvpop-mlp", "kvpop-mlstm", "kvpop-mlp-joint",
                 "kvpop-mlstm-joint", "fixed-finetune", "dms", "dms-test-calibrated", "mlp-other-label",
                 "mlstm-other-label", "decode")
CODE_METHODS = ("kvpop-mlp-joint", "fixed-finetune", "dms", "dense")
CODE_MLSTM = "kvpop-mlstm-joint"
"""The mLSTM scorer's ``code/`` sentinel: only the files made with it depend on it (not in :data:`CODE_METHODS`,
whose every method most real-text files depend on)."""
VALUE_RTOL = 1e-4
TRAINING_CODE = ("kvpop/training/train.py", "kvpop/training/methods.py", "kvpop/core/loss.py", "kvpop/core/distill.py")
"""The modules of the training loss and step: on a machine of other arithmetic, a file made by training
(``demo/*`` or ``code/*`` sentinels) is stale when their code differs from the code it was stamped with."""
VALUE_STRIDE = 7
"""The manifest keeps every 7th forward value (logits and slot priorities) for the by-value comparison."""


# ------------------------------------------------------------------ what each shipped file depends on
@dataclass(frozen=True)
class Group:
    """Shipped files (``path`` or ``path#block``: the text between ``<!-- block:start`` and
    ``<!-- block:end -->``) made by one command, and the sentinels their figures depend on."""

    name: str
    files: tuple[str, ...]
    sentinels: tuple[str, ...]
    command: str
    note: str = ""


def _under(rel: str) -> tuple[str, ...]:
    """Every file under a shipped directory (its records), as repository paths."""
    return tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / rel).rglob("*") if p.is_file()))


def _demo(task: str, policies: Iterable[str] = DEMO_POLICIES) -> tuple[str, ...]:
    return tuple(f"demo/{task}/{p}" for p in policies)


_FWD_ALL = tuple(f"forward/{p}" for p in FORWARD_POLICIES)
_DEMO_FILES = ("results.json", "table.md", "dms.md", "decode.md", "accuracy_vs_budget.png")
_SYNTH_LEDGER = ("dense", "streaming", "kvpop-mlp-joint", "mlp-other-label", "fixed-finetune", "dms")

GROUPS: tuple[Group, ...] = (
    *(Group(f"demo {t}", tuple(f"{RESULTS}/{t}/{f}" for f in _DEMO_FILES), (*_demo(t), *_FWD_ALL),
            f"kvpop demo --task {t} --out OUT --threads 1 --no-progress; cp OUT/{t}/{{{','.join(_DEMO_FILES)}}} "
            f"{RESULTS}/{t}/; python -m freshness stamp {RESULTS}/{t}") for t in TASKS),
    Group("README walkthrough", ("README.md#walkthrough",),
          (*_demo("kvtrace", ("dense", "streaming", "kvpop-mlp", "kvpop-mlstm-joint", "dms")),
           "forward/kvpop-mlp", "forward/kvpop-mlstm", "forward/streaming", "forward/dms"),
          "python -m pytest -q tests/test_readme.py -k walkthrough (it prints the tables the block makes; paste "
          "them between the README's walkthrough markers, then the bands after them from python -m "
          "freshness.kernel_sets walkthrough); python -m freshness stamp README.md#walkthrough"),
    Group("evidence ledger", (f"{STUDY_RESULTS}/evidence.json", f"{STUDY_RESULTS}/evidence.md", "README.md#evidence",
                              *(f"{STUDY_RESULTS}/evidence/{i}/evidence_rows.json" for i in ("kvtrace", "lookahead",
                                                                                       "realtext")),
                              f"{STUDY_RESULTS}/evidence/realtext/fresh2.json",
                              f"{STUDY_RESULTS}/evidence/realtext/fresh2.md",
                              f"{STUDY_RESULTS}/evidence/realtext/fresh3.json",
                              f"{STUDY_RESULTS}/evidence/realtext/fresh3.md",
                              f"{STUDY_RESULTS}/evidence/realtext2/fresh_corpus2.json",
                              f"{STUDY_RESULTS}/evidence/realtext2/fresh_corpus2.md",
                              f"{STUDY_RESULTS}/evidence/realtext/fresh3_3m.json",
                              f"{STUDY_RESULTS}/evidence/realtext/fresh3_3m.md",
                              f"{STUDY_RESULTS}/evidence/realtext2/fresh_corpus2_3m.json",
                              f"{STUDY_RESULTS}/evidence/realtext2/fresh_corpus2_3m.md",
                              *(f"{STUDY_RESULTS}/evidence/{t}/fresh_test.{x}" for t in TASKS for x in ("json", "md"))),
          (*_demo("kvtrace", _SYNTH_LEDGER), *_demo("lookahead", _SYNTH_LEDGER),
           *(f"code/{m}" for m in CODE_METHODS), "forward/kvpop-mlp", "forward/streaming", "forward/dms"),
          "python -m studies.evidence synthetic / realtext (hours: see evidence.md), then "
          "python -m studies.evidence ledger and readme (the fresh splits: python -m studies.fresh_realtext and "
          "python -m studies.fresh_synthetic, see evidence.md); python -m freshness stamp the files"),
    Group("synthetic same-structure controls",
          tuple(f"{STUDY_RESULTS}/evidence/{t}/controls.json" for t in ("kvtrace", "lookahead")),
          (*_demo("kvtrace", ("kvpop-mlp-joint", "fixed-finetune")),
           *_demo("lookahead", ("kvpop-mlp-joint", "fixed-finetune")), "forward/kvpop-mlp", "forward/streaming"),
          "python -m studies.controls_synthetic --task kvtrace|lookahead --out OUT (about 20 minutes each on one "
          "core: see evidence.md); cp OUT/controls.json studies/results/evidence/<task>/; python -m freshness stamp "
          "the files"),
    Group("real-text same-structure controls", (f"{STUDY_RESULTS}/evidence/realtext/controls.json",
                                                f"{STUDY_RESULTS}/evidence/realtext/issue44_trials.json",
                                                f"{STUDY_RESULTS}/evidence/realtext/issue44_lm.json",
                                                f"{STUDY_RESULTS}/evidence/realtext/issue44_twostage.json"),
          (*(f"code/{m}" for m in CODE_METHODS), "forward/kvpop-mlp", "forward/streaming"),
          "python -m studies.evidence realtext --stage controls --out OUT --corpus CORPUS --auto-run AUTO (hours: "
          "see evidence.md); cp OUT/controls.json studies/results/evidence/realtext/; python -m freshness stamp "
          "the file"),
    Group("the paper's method exactly", tuple(f"{STUDY_RESULTS}/evidence/{t}/paper_exact.{x}"
                                               for t in ("kvtrace", "lookahead", "realtext") for x in ("json", "md")),
          (*_demo("kvtrace", ("kvpop-mlp-joint", "fixed-finetune")),
           *_demo("lookahead", ("kvpop-mlp-joint", "fixed-finetune")), *(f"code/{m}" for m in CODE_METHODS),
           "forward/kvpop-mlp", "forward/streaming"),
          "python -m studies.paper_exact synthetic --task kvtrace|lookahead --out OUT --test and python -m "
          "studies.paper_exact realtext --out OUT --data CORPUS/train.jsonl --test (about 10 minutes per synthetic "
          "task and 40 for real text on one core: see evidence.md); cp OUT/paper_exact.* "
          "studies/results/evidence/<instrument>/; python -m freshness stamp the files"),
    Group("--auto records", (f"{STUDY_RESULTS}/auto.md", *_under(f"{STUDY_RESULTS}/auto")),
          (*_demo("kvtrace", ("kvpop-mlp-joint", "mlp-other-label")), *_demo("lookahead", ("kvpop-mlp-joint",)),
           "code/kvpop-mlp-joint", "code/dense", "forward/kvpop-mlp"),
          "the kvpop train --auto commands auto.md lists (hours); python -m freshness stamp "
          f"{STUDY_RESULTS}/auto.md"),
    Group("quantised slots", (f"{STUDY_RESULTS}/quantized.md", *_under(f"{STUDY_RESULTS}/quantized")),
          ("code/kvpop-mlp-joint", "code/dense", "forward/kvpop-mlp", "forward/kvpop-mlp-int8",
           "forward/kvpop-mlp-fp8", "forward/streaming", *_demo("lookahead", ("kvpop-mlp-joint",))),
          "python -m studies.quantized (see quantized.md); python -m freshness stamp "
          f"{STUDY_RESULTS}/quantized.md"),
    Group("quantised slots at equal bytes",
          tuple(f"{STUDY_RESULTS}/evidence/{t}/equal_bytes.{x}" for t in ("kvtrace", "lookahead", "realtext")
                for x in ("json", "md")),
          ("code/kvpop-mlp-joint", "forward/kvpop-mlp", "forward/kvpop-mlp-int8", "forward/kvpop-mlp-fp8",
           *_demo("kvtrace", ("kvpop-mlp-joint",)), *_demo("lookahead", ("kvpop-mlp-joint",))),
          "python -m studies.equal_bytes --instrument realtext|kvtrace|lookahead --out OUT --stage all (about 6, 13 "
          "and 2 minutes on one core: see evidence.md); cp OUT/equal_bytes.* studies/results/evidence/<instrument>/; "
          "python -m freshness stamp the files"),
    Group("the 16-bit side at equal bytes trained at its budget",
          tuple(f"{STUDY_RESULTS}/evidence/realtext/equal_bytes_trained{x}" for x in (".json", ".md",
                                                                                        "_test_log.jsonl")),
          ("code/kvpop-mlp-joint", "forward/kvpop-mlp", "forward/kvpop-mlp-int8"),
          "python -m studies.equal_bytes_trained train (six runs, about 2 minutes each on one core) and test (about 3 "
          "minutes; see evidence.md); python -m freshness stamp the files"),
    Group("lookahead's controls with head-adaptive budgets",
          tuple(f"{STUDY_RESULTS}/evidence/lookahead/controls_adaptive.{x}" for x in ("json", "md")),
          (*_demo("lookahead", ("kvpop-mlp-joint",)),),
          "python -m studies.controls_adaptive --out OUT --seeds 0,1,2 --n-valid 16 --n-test 128 (about 6 minutes "
          "on one core; see evidence.md), then the same with --record-only --record "
          "studies/results/evidence/lookahead/controls_adaptive.json --write-shipped; python -m freshness stamp "
          "the files"),
    Group("the mLSTM scorer on real text",
          tuple(f"{STUDY_RESULTS}/evidence/realtext/mlstm.{x}" for x in ("json", "md")),
          (f"code/{CODE_MLSTM}", "code/kvpop-mlp-joint", "code/fixed-finetune", "code/dense", "forward/kvpop-mlstm",
           "forward/kvpop-mlp", "forward/streaming"),
          "python -m studies.mlstm_realtext valid / test / record (about 25 minutes on two cores: see evidence.md); "
          "python -m freshness stamp the files"),
    Group("a fixed age penalty on real text",
          tuple(f"{STUDY_RESULTS}/evidence/realtext/decay.{x}" for x in ("json", "md")),
          ("code/kvpop-mlp-joint", "code/fixed-finetune", "code/dense", "forward/kvpop-mlp", "forward/streaming"),
          "python -m studies.decay_realtext select / seeds / test / record (about 15 minutes on two cores, after "
          "studies.mlstm_realtext: see evidence.md); python -m freshness stamp the files"),
    Group("real-text study", (f"{STUDY_RESULTS}/realtext.md",),
          (*(f"code/{m}" for m in CODE_METHODS), *_FWD_ALL),
          "python -m studies.realtext (hours: see realtext.md); python -m freshness stamp "
          f"{STUDY_RESULTS}/realtext.md"),
    Group("CPU benchmark figures", ("benchmarks/RESULTS.md",),
          ("source/kvpop_kernels", "source/kvpop/core/cache.py", "source/kvpop/vllm"),
          "python -m pytest benchmarks/ --benchmark-only (CPU), then update the CPU figures of "
          "benchmarks/RESULTS.md; python -m freshness stamp benchmarks/RESULTS.md"),
)


def group_of(path: str) -> Group:
    for g in GROUPS:
        if path in g.files:
            return g
    raise ValueError(f"{path!r} is not a shipped result file listed in freshness/__init__.py's GROUPS; "
                     f"listed: {', '.join(f for g in GROUPS for f in g.files)}")


# ------------------------------------------------------------------ contents
def file_bytes(spec: str) -> bytes:
    """The bytes a file spec names: a whole file, or the block ``path#name`` between its markers."""
    path, _, block = spec.partition("#")
    data = (ROOT / path).read_bytes()
    if not block:
        return data
    m = re.search(rb"<!-- " + block.encode() + rb":start[^>]*-->(.*?)<!-- " + block.encode() + rb":end -->",
                  data, flags=re.S)
    if m is None:
        raise ValueError(f"{path} has no block between <!-- {block}:start --> and <!-- {block}:end -->")
    return m.group(1)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------ the machine's arithmetic
def machine_digest() -> str:
    """Digest of plain torch float32 ops whose bits depend on the machine's kernels (BLAS, vector width)."""
    import torch

    with _one_thread():
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(67, 129, generator=g), torch.randn(129, 45, generator=g)
        x = torch.randn(3, 5, 77, 33, generator=g)
        outs = [a @ b, torch.softmax(x, -1), torch.exp(x).sum(-1), torch.einsum("bhtk,bhsk->bhts", x, x),
                torch.nn.functional.rms_norm(x, (33,), eps=1e-6), torch.logsumexp(x, -1), torch.sigmoid(a).cumsum(0)]
    return sha(b"".join(o.contiguous().numpy().tobytes() for o in outs))


@contextlib.contextmanager
def _pytorch_path():
    """CPU tensors take the PyTorch path a user's run takes, not Triton's interpreter (which the tests switch on:
    the kernels read ``TRITON_INTERPRET`` at each call)."""
    was = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if was is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = was


@contextlib.contextmanager
def _one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# ------------------------------------------------------------------ sentinels
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU tensors: the PyTorch path
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _kvpop(*argv: str, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvpop", *argv], cwd=cwd, env=_env(), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"kvpop {' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")


def _canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def _rows_digest(rows: list, command: str, what: str) -> str:
    """The digest of a sentinel's rows; RuntimeError when the command wrote none (the registry is out of date)."""
    if not rows:
        raise RuntimeError(f"{command} wrote no row of {what!r}: update freshness's sentinel lists")
    return sha(_canon(rows))


def demo_sentinels(work: Path) -> dict[str, str]:
    """``demo/<task>/<policy>``: each policy's rows (and the decode check's) of ``kvpop demo --quick``."""
    _kvpop("demo", "--quick", "--task", "all", "--out", str(work / "demo"), "--threads", "1", "--no-progress",
           "--no-plot", cwd=work)
    out = {}
    for task in TASKS:
        res = json.loads((work / "demo" / task / "results.json").read_text())
        for p in DEMO_POLICIES:
            if p == "decode":
                rows = res["decode"]
            elif p.endswith("-other-label"):  # the joint retrofit on the other label source
                scorer = p.split("-")[0]
                rows = [r for r in res["rows"] if r["policy"].startswith(f"kvpop-{scorer}-joint-")
                        and r["policy"].endswith("-label")]
            else:
                rows = [r for r in res["rows"] if r["policy"] == p]
            out[f"demo/{task}/{p}"] = _rows_digest(rows, f"kvpop demo --quick --task {task}", p)
    return out


def code_sentinels(work: Path) -> dict[str, str]:
    """``code/<method>``: 2 steps of ``kvpop train`` on the code model (the real-text instrument's path),
    evaluated by ``kvpop eval --data`` on one test record."""
    model = ROOT / "kvpop" / "data" / "tiny_qwen3_code"
    data = ROOT / "kvpop" / "data" / "realtext"
    train = work / "train.jsonl"
    train.write_text("".join((data / "validation.jsonl").read_text().splitlines(keepends=True)[:4]))
    test = work / "test.jsonl"
    test.write_text((data / "test.jsonl").read_text().splitlines(keepends=True)[0])
    common = ("--model", str(model), "--data", str(train), "--seq-len", "256", "--sinks", "4", "--window", "32",
              "--steps", "2", "--no-progress", "--seed", "0")
    runs = {"kvpop-mlp-joint": ("--budget", "64", "--scorer", "mlp"),
            "fixed-finetune": ("--budget", "64", "--mask-source", "streaming"),
            "dms": ("--method", "dms", "--target-keep", "0.25"),
            CODE_MLSTM: ("--budget", "64", "--scorer", "mlstm")}
    for name, extra in runs.items():
        _kvpop("train", *common, *extra, "--out", str(work / name), cwd=work)
    _kvpop("eval", "--model", str(model), "--data", str(test), "--seq-len", "256", "--budgets", "64",
           "--sinks", "4", "--window", "32", "--n-sequences", "1", "--no-plot", "--no-progress",
           *(a for name in runs for a in ("--run", str(work / name))), "--out", str(work / "eval"), cwd=work)
    res = json.loads((work / "eval" / "results.json").read_text())
    out = {}
    for m in (*CODE_METHODS, CODE_MLSTM):
        if m == "dense":  # the dense NLL every row is measured against, and the untrained policies
            rows = [r for r in res["rows"] if r["policy"] in ("streaming", "tova", "h2o")]
        else:
            rows = [r for r in res["rows"] if r["policy"] == m]
        out[f"code/{m}"] = _rows_digest(rows, "kvpop eval --data", m)
    return out


def forward_values() -> dict[str, list[float]]:
    """``forward/<policy>``: logits of a seeded tiny Qwen3 (float32) through the policy's cache: a 70-token
    prefill past the budget of 40 (sinks 4, window 16), then 24 tokens one by one."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvpop
    from kvpop.baselines import dms
    from kvpop.models import cache_kwarg_name

    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    key = cache_kwarg_name()  # cache= where transformers takes it, past_key_values= before
    out = {}
    with _one_thread(), _pytorch_path(), torch.no_grad():
        for policy in FORWARD_POLICIES:
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(cfg).eval()
            ids = torch.randint(0, cfg.vocab_size, (1, 94), generator=torch.Generator().manual_seed(1))
            if policy == "dms":
                dms.patch_dms(model, sinks=4, window=16)
                with torch.no_grad():  # gates open on some heads, closed on others: evictions happen
                    for p in model.parameters():
                        if p.dim() == 1 and p.numel() <= 8:
                            p.normal_(0, 2, generator=torch.Generator().manual_seed(2))
                cache = dms.DMSCache(model)
            else:
                scorer = "mlstm" if policy == "kvpop-mlstm" else "mlp"
                kv = {"kvpop-mlp-int8": "int8", "kvpop-mlp-fp8": "fp8"}.get(policy)
                kvpop.patch(model, sinks=4, window=16, budget=40, scorer=scorer, kv_dtype=kv)
                base = policy if policy in ("streaming", "tova", "h2o") else None
                cache = kvpop.KVpopCache(model, policy=base) if base else kvpop.KVpopCache(model)
            logits = [model(ids[:, :70], **{key: cache}).logits[0, -1]]
            for t in range(70, ids.shape[1]):
                logits.append(model(ids[:, t:t + 1], **{key: cache}).logits[0, -1])
            # the slots' priorities too: a change of a scorer's numerics that flips no eviction moves them
            prio = [layer.slot_prio.flatten() for layer in getattr(cache, "layers", ())
                    if isinstance(getattr(layer, "slot_prio", None), torch.Tensor)]
            out[f"forward/{policy}"] = torch.cat([torch.stack(logits).flatten(), *prio]).tolist()
    return out


def _source_digest(rel: str) -> str:
    """Digest of the code of every module under ``rel`` (its AST, docstrings dropped)."""
    h = hashlib.sha256()
    base = ROOT / rel
    for f in [base] if base.is_file() else sorted(base.rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + ast.dump(tree).encode() + b"\0")
    return h.hexdigest()


@dataclass
class Sentinels:
    """Today's sentinel digests (and the forward values, for a machine of other arithmetic)."""

    digests: dict[str, str]
    values: dict[str, list[float]] = field(default_factory=dict)


def training_digest() -> str:
    """The digest of :data:`TRAINING_CODE` (:func:`_source_digest` of each)."""
    return sha("\0".join(_source_digest(m) for m in TRAINING_CODE).encode())


def _trained(sentinels: Iterable[str]) -> bool:
    """Whether a file of these sentinels was made by training (its figures move with the training code)."""
    return any(s.startswith(("demo/", "code/")) for s in sentinels)


def compute(names: Iterable[str] | None = None, progress: Callable[[str], None] = lambda s: None) -> Sentinels:
    names = set(names) if names is not None else {s for g in GROUPS for s in g.sentinels}
    digests: dict[str, str] = {}
    values: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvpop-freshness-") as tmp:
        work = Path(tmp)
        if any(n.startswith("demo/") for n in names):
            progress("kvpop demo --quick --task all")
            digests.update(demo_sentinels(work))
        if any(n.startswith("code/") for n in names):
            progress("kvpop train / eval on the code model")
            digests.update(code_sentinels(work))
    if any(n.startswith("forward/") for n in names):
        progress("forward through every cache")
        values = forward_values()
        import numpy as np

        digests.update({k: sha(np.asarray(v, dtype=np.float32).tobytes()) for k, v in values.items()})
    for n in names:
        if n.startswith("source/"):
            digests[n] = _source_digest(n.removeprefix("source/"))
    missing = names - digests.keys()
    if missing:
        raise ValueError(f"unknown sentinels {sorted(missing)}")
    return Sentinels({k: digests[k] for k in sorted(names)}, values)


# ------------------------------------------------------------------ the manifest
def load_manifest() -> dict:
    if not MANIFEST.exists():
        return {"machine": None, "values": {}, "files": {}}
    return json.loads(MANIFEST.read_text(encoding="utf-8"))


def save_manifest(man: dict) -> None:
    """The manifest, readable: the files' records indented, each forward sentinel's values on one line (to 7
    significant digits: they are compared to a relative 1e-4)."""
    values = {k: "[" + ", ".join(f"{x:.7g}" for x in v) + "]" for k, v in sorted(man.get("values", {}).items())}
    head = json.dumps({k: v for k, v in man.items() if k != "values"}, indent=1, sort_keys=True)
    body = ",\n".join(f"  {json.dumps(k)}: {v}" for k, v in values.items())
    MANIFEST.write_text(head[:-2] + ',\n "values": {\n' + body + "\n }\n}\n", encoding="utf-8")


@dataclass
class Finding:
    file: str
    problem: str
    command: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}\n    regenerate: {self.command}"


def check(today: Sentinels, man: dict | None = None, machine: str | None = None) -> tuple[list[Finding], str]:
    """Every shipped file whose recorded sentinels differ from today's, whose bytes changed since it was
    stamped, or that was never stamped; and a line saying how the sentinels were compared."""
    man = load_manifest() if man is None else man
    machine = machine_digest() if machine is None else machine
    same_machine = machine == man.get("machine")
    how = ("bit for bit (this machine's arithmetic is the stamping machine's)" if same_machine else
           f"by value to a relative {VALUE_RTOL:g} for forward/*, source/* exactly, demo/* and code/* by the source "
           f"of the training code: this machine's arithmetic differs from the stamping machine's")
    found = []
    training = None if same_machine else training_digest()
    for g in GROUPS:
        for f in g.files:
            rec = man.get("files", {}).get(f)
            if rec is None:
                found.append(Finding(f, "never stamped", g.command))
                continue
            if rec.get("known_stale"):
                continue  # listed by known_stale(): the file says so itself
            if sha(file_bytes(f)) != rec["sha256"]:
                found.append(Finding(f, "changed since it was stamped (regenerated? then stamp it)", g.command))
            moved = [s for s in g.sentinels if _moved(s, rec["sentinels"].get(s), today, man, same_machine)]
            if moved:
                found.append(Finding(f, f"the code it was computed with changed: sentinels {', '.join(moved)} "
                                        "differ from the ones it was made with", g.command))
            if training is not None and _trained(g.sentinels) and rec.get("training_code") != training:
                found.append(Finding(f, f"the training code it was made with changed ({', '.join(TRAINING_CODE)}; "
                                        "compared by source here: this machine's arithmetic differs, so its "
                                        "training sentinels cannot be)", g.command))
    return found, how


def _moved(name: str, recorded: str | None, today: Sentinels, man: dict, same_machine: bool) -> bool:
    if recorded is None:
        return True
    if same_machine or name.startswith("source/"):
        return today.digests[name] != recorded
    if name.startswith("forward/"):
        import numpy as np

        then = man.get("values", {}).get(name)
        now = today.values[name][::VALUE_STRIDE]
        return then is None or len(then) != len(now) or not np.allclose(now, then, rtol=VALUE_RTOL, atol=1e-5)
    return False


def known_stale(man: dict | None = None) -> list[tuple[str, str]]:
    man = load_manifest() if man is None else man
    return [(f, r["known_stale"]) for f, r in sorted(man.get("files", {}).items()) if r.get("known_stale")]


def stamp(specs: Iterable[str], today: Sentinels, *, unchanged: bool = False, known_stale_reason: str | None = None,
          man: dict | None = None) -> dict:
    """Record the files' bytes and today's sentinels (the files were just regenerated with today's code)."""
    man = load_manifest() if man is None else man
    machine = machine_digest()
    if man.get("machine") not in (None, machine):
        raise ValueError("this machine's arithmetic differs from the machine that stamped freshness/manifest.json "
                         f"({man['machine'][:12]} against {machine[:12]} here): stamp from that machine, or "
                         "regenerate every file here and stamp them all with --new-machine")
    man["machine"] = machine
    from .kernel_sets import kernel_set

    ks = kernel_set()  # the kernel set these files were made with (docs/DESIGN.md section 14)
    man["kernel_set"] = ks
    for spec in _expand(specs):
        g = group_of(spec)
        rec = man.setdefault("files", {}).get(spec)
        now = sha(file_bytes(spec))
        digests = {s: today.digests[s] for s in g.sentinels}
        if (rec is not None and not unchanged and known_stale_reason is None and rec["sha256"] == now
                and rec["sentinels"] != digests):
            raise ValueError(f"{spec}: its sentinels moved but its bytes did not: regenerate it ({g.command}), "
                             "or pass --unchanged if regenerating it gave the same bytes")
        man["files"][spec] = {"sha256": now, "sentinels": digests, "kernel_set": ks,
                              **({"training_code": training_digest()} if _trained(g.sentinels) else {}),
                              **({"known_stale": known_stale_reason} if known_stale_reason else {})}
        for s in g.sentinels:
            if s in today.values:
                man.setdefault("values", {})[s] = today.values[s][::VALUE_STRIDE]
    return man


def _expand(specs: Iterable[str]) -> list[str]:
    out = []
    for s in specs:
        p = s.rstrip("/")
        listed = [f for g in GROUPS for f in g.files if f == p or f.startswith(p + "/")]
        if not listed:
            group_of(p)  # raises, naming the listed files
        out += listed
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m freshness", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="name every stale shipped file and the command that regenerates it")
    sub.add_parser("list", help="every shipped file, its sentinels and its command")
    st = sub.add_parser("stamp", help="record regenerated files (paths, directories or path#block)")
    st.add_argument("paths", nargs="+")
    st.add_argument("--unchanged", action="store_true",
                    help="the file's bytes did not change although its sentinels did (regenerated and compared)")
    st.add_argument("--known-stale", metavar="REASON", default=None,
                    help="record a file that is not regenerated and says so itself, with why")
    a = ap.parse_args(argv)
    say = lambda s: print(f"[freshness] {s}", file=sys.stderr, flush=True)  # noqa: E731
    if a.cmd == "list":
        for g in GROUPS:
            print(f"{g.name}: {', '.join(g.files)}\n  sentinels: {', '.join(g.sentinels)}\n  command: {g.command}")
        return 0
    if a.cmd == "stamp":
        names = {s for spec in _expand(a.paths) for s in group_of(spec).sentinels}
        try:
            save_manifest(stamp(a.paths, compute(names, say), unchanged=a.unchanged,
                                known_stale_reason=a.known_stale))
        except ValueError as e:
            ap.exit(2, f"python -m freshness stamp: {e}\n")
        return 0
    found, how = check(compute(progress=say))
    print(f"sentinels compared {how}")
    for f, why in known_stale():
        print(f"known stale (says so itself): {f}: {why}")
    for f in found:
        print(f"STALE {f}")
    print("every shipped file is fresh" if not found else f"{len(found)} stale")
    return 1 if found else 0
