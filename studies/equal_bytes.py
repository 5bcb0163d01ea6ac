"""Quantised slots at exactly equal bytes (issue 43 item 6): 8-bit slots at ``B`` against 16-bit slots at the
largest budget that holds no more bytes, on all three instruments, with KVpop's best row.

::

    python -m studies.equal_bytes --instrument realtext --out runs/eqbytes/realtext          # select, then test
    python -m studies.equal_bytes --instrument kvtrace --out runs/eqbytes/kvtrace --stage select
    python -m studies.equal_bytes --instrument kvtrace --out runs/eqbytes/kvtrace --stage test --n-test 128

What it does, per instrument (every scoring is kept under ``--out`` and never redone):

1. **The scorers**: KVpop's best row with its three trained seeds, from the run directories of the instrument's
   controls record (``studies/results/evidence/<instrument>/controls.json``): kvtrace ``kvpop-mlp-joint[paper]``,
   lookahead ``kvpop-mlp-joint[max,paper-decay,adaptive,teacher]`` (head-adaptive budgets, shared anew at every
   budget served from the run's measured importance, as the controls serve it), real text
   ``kvpop-mlp-joint[auto]`` (its model and scorers, served as ``kvpop eval --run DIR`` serves them).  Each row is
   decoded token by token through :class:`kvpop.core.cache.KVpopCache` (the prompt is the sinks, so every slot is
   written by a decode step), every sequence of a scoring in one batch, the model in bfloat16 so that the
   unquantised slots are 16-bit.
2. **Bytes, counted exactly**: ``KVpopCache.nbytes()`` per sequence (keys, values, scales, slot positions,
   priorities, the policy's buffers: everything the cache holds) of each (slot dtype, budget, window) on the
   served model.  The 8-bit rows (``kv_dtype="int8"`` / ``"fp8"``) at the headline budget ``B`` (kvtrace 128,
   lookahead 64, real text 128; sinks 4, window 32); the 16-bit side at ``B16(w)``, the largest budget whose
   bytes at window ``w`` are at most the 8-bit rows' (the smaller of the two, should they differ); the 16-bit row
   at ``B`` as the reference (more bytes).  Every test scoring also records its own cache's count.
3. **The 16-bit side's split chosen on validation**: the window ``w`` from :data:`WINDOWS` in order (32 first: the
   trained window and the incumbent), each at ``B16(w)`` with ``k = B16(w) - sinks - w >= 1`` long-range slots,
   by :func:`kvpop.training.search.choose` (2 paired standard errors; higher accuracy better on the tasks, lower
   NLL increase on real text) on the select part of validation with seed 0's scorer: synthetic
   ``valid_seed(1000..1000+n-1)`` (:data:`kvpop.demo.search.SELECT_FIRST`), real text the select indices of the
   first 16 records of ``kvpop/data/realtext/validation.jsonl`` (:data:`studies.controls_realtext.SELECT`).
4. **The test**: each (row, seed) scored once through this study's own :class:`studies.ledger.TestLog`
   (``OUT/test/test_log.jsonl``) on the fresh split the evidence's final rows use: synthetic
   ``test_seed(20000 + i)`` at the task's L_train (:data:`studies.fresh_synthetic.FRESH2_FIRST`), real text
   ``kvpop/data/realtext/test_fresh2.jsonl`` (48 records, positions >= 256, clustered by source file).  Rows
   ``int8@B``, ``fp8@B``, ``bf16@B`` (window 32) and ``bf16@B16`` at the chosen window; seeds 0, 1, 2.  The
   figure per sequence: accuracy at the graded positions (greedy prediction, teacher-forced decode) on the tasks;
   on real text the NLL increase over the original dense model (float32, the evidence's reference: its
   per-sequence NLL is checked against ``fresh2.json``'s) on positions >= 256.
5. **Paired intervals** (:func:`studies.paired.comparison`, over sequences (clusters: source files on real
   text) and seeds): each 8-bit row against ``bf16@B16`` (equal bytes) and against ``bf16@B`` (equal slots: what
   quantisation costs); "better" only where the interval excludes 0.

The record ``OUT/equal_bytes.json`` (every figure, per-sequence values, bytes, trials, decisions, comparisons,
commands, dates) and its tables ``OUT/equal_bytes.md`` (generated from the JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .ledger import TestLog, write_json
from .paths import parse

INSTRUMENTS = ("kvtrace", "lookahead", "realtext")
STAGES = ("select", "test", "all")
HEADLINE = {"kvtrace": 128, "lookahead": 64, "realtext": 128}
"""Each instrument's headline budget ``B`` (the ledger's)."""
SINKS, WINDOW = 4, 32
WINDOWS = (32, 16, 8)
"""The 16-bit side's window candidates, in order: 32 (the window every scorer was trained with, the incumbent),
then 16 and 8, which give the window's slots to long-range ones (the lever a smaller budget has: the trained
scorers decide which tokens stay, and a learned policy is only as good as the slots it may keep)."""
QUANTISED = ("int8", "fp8")
SEEDS = ("0", "1", "2")
N_TEST = {"kvtrace": 128, "lookahead": 128, "realtext": 48}
"""Default test sequences: the synthetic tasks' fresh split holds 128 per row in the evidence (one row-seed's
decode of 128 sequences took about 1 min on kvtrace and 8 s on lookahead on this CPU, batched); real text's
split holds 48 records."""
N_VALID = 16
"""Synthetic select sequences (the controls' select part); real text's select part is fixed (8 of 16)."""
BF16 = "bf16"


def row_name(dtype: str, budget: int, window: int) -> str:
    """``int8@B=128,w=32``."""
    return f"{dtype}@B={budget},w={window}"


# ---------------------------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------------------------

def largest_budget(bytes_at, target: float, lo: int, hi: int) -> tuple[int, float]:
    """The largest budget ``b`` in ``lo..hi`` with ``bytes_at(b) <= target`` and its bytes (``bytes_at`` must not
    decrease with ``b``: a binary search; the caller records ``bytes_at(b + 1)``).  ValueError when even ``lo``
    holds more than ``target``."""
    if lo > hi:
        raise ValueError(f"largest_budget: empty range {lo}..{hi}")
    first = bytes_at(lo)
    if first > target:
        raise ValueError(f"even the smallest budget {lo} holds {first:,.0f} bytes, more than {target:,.0f}")
    a, b = lo, hi  # invariant: bytes_at(a) <= target
    while a < b:
        m = (a + b + 1) // 2
        if bytes_at(m) <= target:
            a = m
        else:
            b = m - 1
    return a, bytes_at(a)


def cache_bytes(model, kv_dtype: str | None, vocab: int) -> float:
    """``KVpopCache.nbytes()`` of one sequence on ``model`` (patched at the row's budget and window): constant once
    the cache is built (its first call), whatever the tokens; the sinks are prefilled and one token decoded."""
    import torch

    from kvpop.core.cache import KVpopCache
    from kvpop.models import cache_kwarg_name

    cache = KVpopCache(model, kv_dtype=kv_dtype)
    kw = {cache_kwarg_name(): cache, "use_cache": True}
    ids = torch.arange(SINKS + 1).remainder(vocab)[None]
    with torch.no_grad():
        model(ids[:, :SINKS], **kw)
        model(ids[:, SINKS:], **kw)
    return float(cache.nbytes())


# ---------------------------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------------------------

def decode(model, ids, kv_dtype: str | None, *, prompt: int = SINKS, label: str = "") -> dict:
    """Decode ``ids [n, L]`` token by token through ``KVpopCache(model, kv_dtype=...)`` (the first ``prompt``
    tokens prefilled): ``log_probs [n, L - 1]`` (float64: of token ``t + 1`` at ``t``), ``pred [n, L]`` (greedy
    prediction of token ``t + 1`` at ``t``), ``bytes_per_sequence`` (``nbytes()`` over the batch), ``seconds``."""
    import torch

    from kvpop.core.cache import KVpopCache
    from kvpop.models import cache_kwarg_name

    n, L = ids.shape
    if not 0 < prompt < L:
        raise ValueError(f"decode: prompt {prompt} must be in 1..{L - 1} (L = {L})")
    cache = KVpopCache(model, kv_dtype=kv_dtype)
    kw = {cache_kwarg_name(): cache, "use_cache": True}
    lp = torch.empty(n, L - 1, dtype=torch.float64)
    pred = torch.empty(n, L, dtype=torch.long)

    def take(logits, t0):
        lg = logits.float()
        pred[:, t0:t0 + lg.shape[1]] = lg.argmax(-1)
        t1 = min(t0 + lg.shape[1], L - 1)
        if t1 > t0:
            ls = torch.log_softmax(lg[:, :t1 - t0], -1)
            lp[:, t0:t1] = ls.gather(2, ids[:, t0 + 1:t1 + 1, None])[..., 0].double()

    t_start = time.perf_counter()
    every = max(1, L // 4)
    with torch.no_grad():
        take(model(ids[:, :prompt], **kw).logits, 0)
        for t in range(prompt, L):
            take(model(ids[:, t:t + 1], **kw).logits, t)
            if label and (t + 1) % every == 0:
                print(f"[equal_bytes] {label}: {t + 1}/{L} tokens, {time.perf_counter() - t_start:.0f} s",
                      file=sys.stderr, flush=True)
    return {"log_probs": lp, "pred": pred, "bytes_per_sequence": cache.nbytes() / n,
            "seconds": round(time.perf_counter() - t_start, 1)}


# ---------------------------------------------------------------------------------------------------------------
# the instruments
# ---------------------------------------------------------------------------------------------------------------

class Instrument:
    """What the study needs of an instrument: ``name``, ``budget`` (``B``), ``higher_is_better``, ``metric``,
    ``seeds``, ``vocab``; :meth:`model` (bfloat16, the row served at a budget and window), :meth:`ids` and
    :meth:`values` of a part (``"select"`` / ``"test"``), :meth:`clusters` and :meth:`describe`."""

    name: str
    budget: int
    higher_is_better: bool
    metric: str
    seeds: tuple[str, ...] = SEEDS
    vocab: int

    def model(self, seed: str, budget: int, window: int):
        raise NotImplementedError

    def ids(self, part: str):
        raise NotImplementedError

    def values(self, part: str, dec: dict) -> list[float]:
        raise NotImplementedError

    def clusters(self, part: str) -> list | None:
        return None

    def describe(self) -> dict:
        return {}


def _controls(instrument: str) -> dict:
    from .paths import RESULTS_DIR

    return json.loads((RESULTS_DIR / "evidence" / instrument / "controls.json").read_text())


class Synthetic(Instrument):
    """kvtrace or lookahead: the controls' KVpop row served by :func:`kvpop.demo.search.policy_model`."""

    higher_is_better = True
    metric = "accuracy at the graded positions per sequence (greedy, teacher-forced decode), higher is better"

    def __init__(self, task: str, out: Path, *, n_valid: int, n_test: int):
        from kvpop.demo import search as S
        from kvpop.evaluation import evaluate as E

        from .evidence_synthetic import _demo
        from .fresh_synthetic import FRESH2_FIRST, check_disjoint, earlier_ranges, test_seeds

        self.name, self.S, self.E = task, S, E
        ctl = _controls(task)
        _, args, s = _demo(task, Path(out) / "demo", n_valid)
        self.row = ctl["kvpop_row"]["name"]
        st = ctl["settings"]
        have = (st["budget"], st["sinks"], st["window"], st["length"])
        want = (HEADLINE[task], SINKS, WINDOW, s["train_len"])
        if have != want or (s["sinks"], s["window"]) != (SINKS, WINDOW):
            raise ValueError(f"{task}'s controls.json (budget, sinks, window, length {have}) is not this study's "
                             f"{want}")
        self.budget, self.length = HEADLINE[task], s["train_len"]
        self.runs = {k: {"dir": r["dir"], "policy": r["policy"]} for k, r in ctl["runs"][self.row].items()}
        self.mod = S.task_module(task)
        self.base = E.load_base_model(S.base_model_dir(args, task))
        self.vocab = int(self.base.config.vocab_size)
        check_disjoint(FRESH2_FIRST, n_test, earlier_ranges())
        self.seed_lists = {"select": [self.mod.valid_seed(S.SELECT_FIRST + i) for i in range(n_valid)],
                           "test": test_seeds(self.mod, n_test)}
        if set(self.seed_lists["select"]) & set(self.seed_lists["test"]):
            raise ValueError("the select and test seeds meet")
        self.examples = {p: [self.mod.make_example(v, self.length) for v in seeds]
                         for p, seeds in self.seed_lists.items()}
        self.split = {"select": f"valid_seed({S.SELECT_FIRST}..{S.SELECT_FIRST + n_valid - 1}) at {self.length} "
                                f"tokens (kvpop.demo.search.SELECT_FIRST: the controls' select part)",
                      "test": f"test_seed({FRESH2_FIRST}..{FRESH2_FIRST + n_test - 1}) at {self.length} tokens "
                              f"(studies.fresh_synthetic's test_fresh2)"}

    def model(self, seed: str, budget: int, window: int):
        import torch

        r = self.runs[seed]
        m = self.S.policy_model(self.E, self.base, r["policy"], Path(r["dir"]),
                                dict(sinks=SINKS, window=window, budget=budget))
        return m.to(torch.bfloat16)

    def ids(self, part: str):
        import torch

        return torch.stack([ex["input_ids"].reshape(-1) for ex in self.examples[part]])

    def values(self, part: str, dec: dict) -> list[float]:
        out = []
        for i, ex in enumerate(self.examples[part]):
            pos = ex["answer_positions"].reshape(-1)
            out.append(float((dec["pred"][i, pos] == ex["answers"].reshape(-1)).float().mean()))
        return out

    def describe(self) -> dict:
        return {"row": self.row, "runs": self.runs, "length": self.length, "split": self.split,
                "served_by": "kvpop.demo.search.policy_model(E, base, policy, dir, dict(sinks=4, window=w, "
                             "budget=b)), then .to(torch.bfloat16)"}


class RealText(Instrument):
    """Real text: ``kvpop-mlp-joint[auto]``'s runs served as ``kvpop eval --run DIR`` serves them (their model and
    scorers, the head budgets shared anew at each budget from the run's importance)."""

    higher_is_better = False
    metric = ("NLL increase over the original dense model (float32) on positions >= 256, nats/token per sequence, "
              "lower is better")
    START = 256

    def __init__(self, out: Path, *, n_test: int):
        from kvpop.evaluation.trace_eval import load_model
        from kvpop.training import data as data_io

        from .controls_realtext import AUTO_ROW, SELECT, SEQ_LEN, VALID_SEQUENCES, clusters_of
        from .fresh_realtext import MODEL, N_RECORDS, SPLIT, dense_per_sequence
        from .paths import DATA, RESULTS_DIR

        if not 2 <= n_test <= N_RECORDS:
            raise ValueError(f"--n-test {n_test}: real text's split {SPLIT.name} holds {N_RECORDS} records "
                             f"(allowed 2..{N_RECORDS})")
        self.name, self.budget, self.row = "realtext", HEADLINE["realtext"], AUTO_ROW
        ctl = _controls("realtext")
        self.runs = {k: {"dir": r["dir"]} for k, r in ctl["runs"][AUTO_ROW].items()}
        self.base = load_model(MODEL)
        self.vocab = int(self.base.config.vocab_size)
        self._load = load_model
        self._ft: dict[str, object] = {}
        self._trained: dict[str, object] = {}
        valid = DATA / "realtext" / "validation.jsonl"
        files = {"select": valid, "test": SPLIT}
        counts = {"select": VALID_SEQUENCES, "test": n_test}
        self.tokens, self.dense, self._clusters = {}, {}, {}
        for part, f in files.items():
            recs = data_io.read_jsonl(str(f), vocab_size=self.vocab)
            seqs = data_io.chunk(recs, SEQ_LEN, source=f"--data {f}")[:counts[part]]
            dense = dense_per_sequence(MODEL, f, counts[part])
            cl = clusters_of(f, counts[part])
            if part == "select":
                seqs, dense, cl = ([x[i] for i in SELECT] for x in (seqs, dense, cl))
            self.tokens[part], self.dense[part], self._clusters[part] = seqs, dense, cl
        fr = json.loads((RESULTS_DIR / "evidence" / "realtext" / "fresh2.json").read_text())
        want = fr["original_dense_nll"]["per_sequence"][:n_test]
        if [round(x, 6) for x in self.dense["test"]] != [round(x, 6) for x in want]:
            raise ValueError(f"the original dense NLL on {SPLIT} is not fresh2.json's")
        self.split = {"select": f"records {list(SELECT)} of the first {VALID_SEQUENCES} of {valid.name} "
                                f"(studies.controls_realtext.SELECT; validation)",
                      "test": f"the first {n_test} records of {SPLIT.name} (studies.fresh_realtext's test_fresh2), "
                              f"positions >= {self.START}, clustered by source file"}

    def _run(self, seed: str):
        from kvpop.cli.trained import read_run

        if seed not in self._trained:
            self._trained[seed] = read_run(self.runs[seed]["dir"])
            t = self._trained[seed]
            self._ft[seed] = self._load(t.model) if t.model is not None else None
        return self._trained[seed], self._ft[seed]

    def model(self, seed: str, budget: int, window: int):
        import torch

        from kvpop.evaluation import evaluate as E

        t, ft = self._run(seed)
        m = E.policy_model(self.base, t.policy, scorers=t.scorers, finetuned=ft, sinks=SINKS, window=window,
                           budget=budget, head_plan=t.head_plan)
        return m.to(torch.bfloat16)

    def ids(self, part: str):
        import torch

        return torch.stack([t.reshape(-1).long() for t in self.tokens[part]])

    def values(self, part: str, dec: dict) -> list[float]:
        nll = -dec["log_probs"][:, self.START:]
        return [float(nll[i].mean()) - self.dense[part][i] for i in range(nll.shape[0])]

    def clusters(self, part: str) -> list:
        return self._clusters[part]

    def describe(self) -> dict:
        return {"row": self.row, "runs": self.runs, "split": self.split,
                "dense_nll_original": {p: {"mean": sum(v) / len(v), "per_sequence": v} for p, v in self.dense.items()},
                "served_by": "kvpop.cli.trained.read_run(DIR) and kvpop.evaluation.evaluate.policy_model(base, "
                             "policy, scorers=, finetuned=DIR/model, sinks=4, window=w, budget=b, head_plan=), "
                             "then .to(torch.bfloat16)"}


def instrument(name: str, out: Path, *, n_valid: int | None, n_test: int | None) -> Instrument:
    """The instrument ``name`` (ValueError naming what is allowed)."""
    if name not in INSTRUMENTS:
        raise ValueError(f"--instrument {name!r}: allowed {', '.join(INSTRUMENTS)}")
    n_test = N_TEST[name] if n_test is None else n_test
    if n_test < 2:
        raise ValueError(f"--n-test must be >= 2 (one sequence has no interval), got {n_test}")
    if name == "realtext":
        if n_valid not in (None, N_VALID):
            raise ValueError(f"--n-valid {n_valid}: real text's select part is fixed (studies.controls_realtext"
                             f".SELECT of the first {N_VALID} validation records); leave --n-valid out")
        return RealText(out, n_test=n_test)
    n_valid = N_VALID if n_valid is None else n_valid
    if n_valid < 2:
        raise ValueError(f"--n-valid must be >= 2 (one sequence has no standard error), got {n_valid}")
    return Synthetic(name, out, n_valid=n_valid, n_test=n_test)


# ---------------------------------------------------------------------------------------------------------------
# the stages
# ---------------------------------------------------------------------------------------------------------------

def _kept(path: Path, make) -> dict:
    """``path``'s JSON, else ``make()`` written there (a scoring is never redone)."""
    if path.exists():
        return json.loads(path.read_text())
    r = make()
    write_json(path, r)
    return r


def byte_plan(inst: Instrument, out: Path, windows=WINDOWS) -> dict:
    """The bytes of every row (``OUT/bytes.json``, counted once): the 8-bit rows and the 16-bit row at ``B``
    (window 32), and per candidate window ``w`` the 16-bit side's budget ``B16(w)`` (:func:`largest_budget` with
    seed 0's served model) with its bytes, or why the window is out (no long-range slot)."""
    def make() -> dict:
        memo: dict = {}

        def nbytes(dtype: str, budget: int, window: int) -> float:
            key = (dtype, budget, window)
            if key not in memo:
                memo[key] = cache_bytes(inst.model(inst.seeds[0], budget, window),
                                        None if dtype == BF16 else dtype, inst.vocab)
            return memo[key]

        B = inst.budget
        at_b = {d: nbytes(d, B, WINDOW) for d in (*QUANTISED, BF16)}
        target = min(at_b[d] for d in QUANTISED)
        cands = []
        for w in windows:
            lo = SINKS + w + 1
            if lo > B:
                cands.append({"window": w, "budget": None, "why_out": f"B={B} leaves no long-range slot"})
                continue
            try:
                b16, got = largest_budget(lambda b, w=w: nbytes(BF16, b, w), target, lo, B)
            except ValueError as e:
                cands.append({"window": w, "budget": None, "why_out": f"at least {lo} slots: {e}"})
                continue
            cands.append({"window": w, "budget": b16, "long_range": b16 - SINKS - w, "bytes_per_sequence": got,
                          "next_budget_bytes": nbytes(BF16, b16 + 1, w) if b16 < B else None,
                          "ratio_to_8bit": got / target})
            print(f"[equal_bytes] {inst.name}: window {w}: B16 = {b16} ({got:,.0f} bytes <= {target:,.0f})",
                  flush=True)
        return {"budget": B, "sinks": SINKS, "window": WINDOW,
                "at_B": {d: {"budget": B, "window": WINDOW, "bytes_per_sequence": v} for d, v in at_b.items()},
                "target": target, "int8_equals_fp8": at_b["int8"] == at_b["fp8"],
                "ratio_8bit_to_16bit_at_B": {d: at_b[d] / at_b[BF16] for d in QUANTISED},
                "candidates": cands, "counted_with": f"seed {inst.seeds[0]}'s served model, one sequence: "
                                                    f"KVpopCache.nbytes() after the sinks and one decoded token",
                "counted": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

    return _kept(out / "bytes.json", make)


def select(inst: Instrument, out: Path, plan: dict) -> dict:
    """The 16-bit side's window on the select part (seed 0), each trial scored once (``OUT/select/*.json``)."""
    from kvpop.training.search import choose

    trials = []
    ids = None
    for c in plan["candidates"]:
        if c["budget"] is None:
            continue
        w, b = c["window"], c["budget"]
        tag = f"{BF16}_B{b}_w{w}_seed{inst.seeds[0]}"

        def make(w=w, b=b, tag=tag) -> dict:
            nonlocal ids
            ids = inst.ids("select") if ids is None else ids
            d = decode(inst.model(inst.seeds[0], b, w), ids, None, label=f"{inst.name} select {tag}")
            per = inst.values("select", d)
            print(f"[equal_bytes] {inst.name} select {tag}: {sum(per) / len(per):.4f} ({d['seconds']} s)", flush=True)
            return {"per_sequence": per, "bytes_per_sequence": d["bytes_per_sequence"], "seconds": d["seconds"],
                    "scored": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

        r = _kept(out / "select" / f"{tag}.json", make)
        trials.append({"settings": {"window": w, "budget": b, "long_range": b - SINKS - w},
                       "per_sequence": r["per_sequence"], "score": sum(r["per_sequence"]) / len(r["per_sequence"]),
                       "bytes_per_sequence": r["bytes_per_sequence"], "seconds": r["seconds"], "scored": r["scored"]})
    decisions: list = []
    best = choose(trials, higher_is_better=inst.higher_is_better, decisions=decisions,
                  stage=f"{inst.name} 16-bit window at equal bytes (seed {inst.seeds[0]}, select part)")
    return {"trials": trials, "decisions": decisions, "chosen": dict(best["settings"]),
            "rule": "kvpop.training.search.choose (2 paired standard errors, "
                    + ("higher accuracy" if inst.higher_is_better else "lower NLL increase")
                    + " better; a tie keeps the incumbent, window 32)"}


def test_rows(plan: dict, chosen: dict) -> list[dict]:
    """The test rows: the 8-bit ones and the 16-bit one at ``B`` (window 32), the 16-bit one at the chosen split."""
    B = plan["budget"]
    rows = [{"row": row_name(d, B, WINDOW), "dtype": d, "budget": B, "window": WINDOW} for d in (*QUANTISED, BF16)]
    rows.append({"row": row_name(BF16, chosen["budget"], chosen["window"]), "dtype": BF16,
                 "budget": chosen["budget"], "window": chosen["window"]})
    return rows


def run_test(inst: Instrument, out: Path, plan: dict, chosen: dict) -> dict:
    """Each (row, seed) scored once through ``OUT/test/test_log.jsonl``; the rows of one seed share its loaded
    weights, each row's sequences one batched decode."""
    tl = TestLog(out / "test")
    rows = test_rows(plan, chosen)
    ids = None
    for s in inst.seeds:
        for r in rows:
            key = f"{r['row']}|seed{s}"

            def score(r=r, s=s) -> dict:
                nonlocal ids
                ids = inst.ids("test") if ids is None else ids
                d = decode(inst.model(s, r["budget"], r["window"]), ids, None if r["dtype"] == BF16 else r["dtype"],
                           label=f"{inst.name} test {r['row']} seed {s}")
                per = inst.values("test", d)
                print(f"[equal_bytes] {inst.name} test {r['row']} seed {s}: {sum(per) / len(per):.4f} "
                      f"({d['seconds']} s)", flush=True)
                return {**r, "seed": s, "per_sequence": per, "bytes_per_sequence": d["bytes_per_sequence"],
                        "decode_seconds": d["seconds"], "n": len(per)}

            tl.once(key, score)
    return {"log": tl, "rows": rows}


def comparisons(inst_name: str, budget: int, runs: dict, plan: dict, chosen: dict, *, clusters=None,
                lower_is_better: bool, n_boot: int = 10_000) -> list[dict]:
    """The paired intervals: each 8-bit row against the 16-bit row at equal bytes and against the 16-bit row at
    ``B`` (equal slots).  Each also carries ``seeds_paired``: the same bootstrap with one seed draw for both rows
    (``pair_seeds``: every row of a seed serves that seed's scorer and weights, so the rows' seeds are paired by
    design); the verdict the record states is the house's (seeds drawn independently), the wider one."""
    from .paired import comparison, paired_interval, verdict

    B = plan["budget"]
    eq = row_name(BF16, chosen["budget"], chosen["window"])
    full = row_name(BF16, B, WINDOW)
    out = []
    for d in QUANTISED:
        a = row_name(d, B, WINDOW)
        for b, what in ((eq, "equal bytes"), (full, "equal slots")):
            va = [runs[a][s]["per_sequence"] for s in sorted(runs[a], key=int)]
            vb = [runs[b][s]["per_sequence"] for s in sorted(runs[b], key=int)]
            c = comparison(instrument=inst_name, budget=budget, a=a, b=b, values_a=va, values_b=vb,
                           lower_is_better=lower_is_better, clusters=clusters, n_boot=n_boot)
            ps = paired_interval(va, vb, clusters=clusters, n_boot=n_boot, pair_seeds=True)
            out.append({**c, "at": what, "seeds_paired": {"mean_diff": ps.mean_diff, "ci95": list(ps.ci95),
                                                          "verdict": verdict(ps, lower_is_better=lower_is_better)}})
    return out


def figures(runs: dict) -> list[dict]:
    out = []
    for name, seeds in runs.items():
        per = {s: sum(r["per_sequence"]) / len(r["per_sequence"]) for s, r in sorted(seeds.items(),
                                                                                      key=lambda x: int(x[0]))}
        any_r = next(iter(seeds.values()))
        out.append({"row": name, "dtype": any_r["dtype"], "budget": any_r["budget"], "window": any_r["window"],
                    "bytes_per_sequence": {s: r["bytes_per_sequence"] for s, r in seeds.items()},
                    "per_seed": per, "mean": sum(per.values()) / len(per), "min": min(per.values()),
                    "max": max(per.values()),
                    "decode_seconds": {s: r["decode_seconds"] for s, r in seeds.items()}})
    return out


def check_bytes(runs: dict, plan: dict, chosen: dict) -> None:
    """ValueError when a test scoring's own cache held other bytes than the plan counted (the 16-bit side at equal
    bytes must hold no more than the 8-bit rows)."""
    eq = row_name(BF16, chosen["budget"], chosen["window"])
    want = {row_name(d, plan["budget"], WINDOW): v["bytes_per_sequence"] for d, v in plan["at_B"].items()}
    want[eq] = next(c["bytes_per_sequence"] for c in plan["candidates"] if c["window"] == chosen["window"])
    for row, seeds in runs.items():
        for s, r in seeds.items():
            if r["bytes_per_sequence"] != want[row]:
                raise ValueError(f"{row} seed {s} held {r['bytes_per_sequence']:,.0f} bytes per sequence, the plan "
                                 f"counted {want[row]:,.0f}")
    if want[eq] > plan["target"]:
        raise ValueError(f"{eq} holds {want[eq]:,.0f} bytes, more than the 8-bit rows' {plan['target']:,.0f}")


def build_record(inst: Instrument, plan: dict, sel: dict | None, test: dict | None, commands: list[str],
                 n_boot: int = 10_000) -> dict:
    rec = {"instrument": inst.name, "study": "quantised slots at exactly equal bytes (issue 43 item 6)",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "metric": inst.metric,
           "higher_is_better": inst.higher_is_better, "sinks": SINKS, "window": WINDOW, "budget": inst.budget,
           "windows_tried": list(WINDOWS), "decode": "token by token through KVpopCache, the sinks prefilled, "
                                                     "every sequence of a scoring in one batch, model in bfloat16",
           **inst.describe(), "bytes": plan, "selection": sel, "test": None, "commands": commands}
    if test is not None:
        tl = test["log"]
        runs: dict = {}
        for r in test["rows"]:
            for s in inst.seeds:
                e = tl.entries.get(f"{r['row']}|seed{s}")
                if e is not None:
                    runs.setdefault(r["row"], {})[s] = {**e["result"], "scored": e["date"]}
        missing = [f"{r['row']}|seed{s}" for r in test["rows"] for s in inst.seeds
                   if f"{r['row']}|seed{s}" not in tl.entries]
        comps = []
        if not missing:
            check_bytes(runs, plan, sel["chosen"])
            comps = comparisons(inst.name, inst.budget, runs, plan, sel["chosen"], clusters=inst.clusters("test"),
                                lower_is_better=not inst.higher_is_better, n_boot=n_boot)
        dates = sorted(e["date"] for e in tl.entries.values())
        rec["test"] = {"rows": test["rows"], "runs": runs, "figures": figures(runs) if runs else [],
                       "comparisons": comps, "missing": missing, "scorings": {k: 1 for k in tl.entries},
                       "scored": [dates[0], dates[-1]] if dates else [],
                       "clusters": inst.clusters("test")}
    return rec


# ---------------------------------------------------------------------------------------------------------------
# the tables
# ---------------------------------------------------------------------------------------------------------------

def markdown(rec: dict) -> str:
    """The record's tables (never typed): bytes, the window trials and decisions, the test figures, the
    intervals."""
    acc = rec["higher_is_better"]
    fmt = (lambda x: f"{x:.4f}") if acc else (lambda x: f"{x:+.4f}")
    p = rec["bytes"]
    t = p["target"]
    out = [f"**{rec['instrument']}** ({rec.get('row', '-')}): bytes per sequence (KVpopCache.nbytes()), "
           f"B = {p['budget']}, sinks {p['sinks']}", "",
           "| row | slots | window | long-range | bytes / sequence | vs 8-bit |", "|---|---|---|---|---|---|"]
    for d, v in p["at_B"].items():
        out.append(f"| {row_name(d, v['budget'], v['window'])} | {v['budget']} | {v['window']} | "
                   f"{v['budget'] - p['sinks'] - v['window']} | {v['bytes_per_sequence']:,.0f} | "
                   f"{v['bytes_per_sequence'] / t:.4f} |")
    for c in p["candidates"]:
        if c["budget"] is None:
            out.append(f"| bf16, window {c['window']} | - | {c['window']} | - | {c['why_out']} | - |")
        else:
            nxt = "" if c["next_budget_bytes"] is None else f" (B={c['budget'] + 1}: {c['next_budget_bytes']:,.0f})"
            out.append(f"| {row_name(BF16, c['budget'], c['window'])} | {c['budget']} | {c['window']} | "
                       f"{c['long_range']} | {c['bytes_per_sequence']:,.0f}{nxt} | {c['ratio_to_8bit']:.4f} |")
    out.append("")
    out.append(f"int8 and fp8 bytes {'equal' if p['int8_equals_fp8'] else 'differ'}.")
    sel = rec.get("selection")
    if sel:
        out += ["", f"window of the 16-bit side (select part, seed 0): chosen {sel['chosen']}", "",
                "| trial | mean (select part) | decode s |", "|---|---|---|"]
        for tr in sel["trials"]:
            st = tr["settings"]
            out.append(f"| {row_name(BF16, st['budget'], st['window'])} | {fmt(tr['score'])} | {tr['seconds']} |")
        out += ["", "| decision | incumbent | challenger | mean_diff | SE | adopted |", "|---|---|---|---|---|---|"]
        for d in sel["decisions"]:
            se = "-" if d["se"] is None else f"{d['se']:.4f}"
            out.append(f"| {d['stage']} | {d['incumbent']} | {d['challenger']} | {d['mean_diff']:+.4f} | {se} | "
                       f"{'yes' if d['adopted'] else 'no'} |")
    test = rec.get("test")
    if test and test["figures"]:
        out += ["", f"test ({rec.get('split', {}).get('test', '-')}):", "",
                "| row | bytes / sequence | seeds | mean | min .. max | per seed | decode s (per seed) |",
                "|---|---|---|---|---|---|---|"]
        for f in test["figures"]:
            bts = sorted(set(f["bytes_per_sequence"].values()))
            out.append(f"| {f['row']} | {', '.join(f'{b:,.0f}' for b in bts)} | {len(f['per_seed'])} | "
                       f"{fmt(f['mean'])} | {fmt(f['min'])} .. {fmt(f['max'])} | "
                       + ", ".join(fmt(v) for v in f["per_seed"].values()) + " | "
                       + ", ".join(str(v) for v in f["decode_seconds"].values()) + " |")
    if test and test["comparisons"]:
        out += ["", "| a | b | at | a - b | 95 % interval | seeds a / b | clusters | verdict | interval, seeds "
                    "paired | verdict, seeds paired |", "|---|---|---|---|---|---|---|---|---|---|"]
        for c in test["comparisons"]:
            ps = c["seeds_paired"]
            out.append(f"| {c['a']} | {c['b']} | {c['at']} | {c['mean_diff']:+.4f} | [{c['ci95'][0]:+.4f}, "
                       f"{c['ci95'][1]:+.4f}] | {c['seeds_a']} / {c['seeds_b']} | {c['n_clusters']} | "
                       f"{c['verdict']} | [{ps['ci95'][0]:+.4f}, {ps['ci95'][1]:+.4f}] | {ps['verdict']} |")
    if test and test["missing"]:
        out += ["", f"not scored yet: {', '.join(test['missing'])}"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------------

def run(inst: Instrument, out: Path, stage: str, command: str) -> dict:
    """The stages on ``inst`` under ``out``; writes and returns the record."""
    if stage not in STAGES:
        raise ValueError(f"--stage {stage!r}: allowed {', '.join(STAGES)}")
    out.mkdir(parents=True, exist_ok=True)
    cpath = out / "commands.json"
    commands = json.loads(cpath.read_text()) if cpath.exists() else []
    commands.append(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  {command}")
    write_json(cpath, commands)
    plan = byte_plan(inst, out)
    sel = select(inst, out, plan)
    test = None
    if stage in ("test", "all"):
        test = run_test(inst, out, plan, sel["chosen"])
    elif (out / "test" / "test_log.jsonl").exists():
        test = {"log": TestLog(out / "test"), "rows": test_rows(plan, sel["chosen"])}
    rec = build_record(inst, plan, sel, test, commands)
    write_json(out / "equal_bytes.json", rec)
    (out / "equal_bytes.md").write_text(markdown(rec))
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.equal_bytes", description=__doc__.split("\n\n")[0])
    p.add_argument("--instrument", required=True, help=f"one of {', '.join(INSTRUMENTS)}")
    p.add_argument("--out", required=True, help="run directory (resumable: every scoring kept, never redone)")
    p.add_argument("--stage", default="all", help="select (bytes and the window), test (then the test, once), all "
                                                  "(the same as test)")
    p.add_argument("--n-valid", type=int, default=None, help=f"synthetic select sequences (default {N_VALID})")
    p.add_argument("--n-test", type=int, default=None,
                   help="test sequences (default " + ", ".join(f"{k} {v}" for k, v in N_TEST.items()) + ")")
    a = parse(p, argv)
    try:
        import torch

        from .paths import check_out_dir

        if a.stage not in STAGES:
            raise ValueError(f"--stage {a.stage!r}: allowed {', '.join(STAGES)}")
        if a.instrument not in INSTRUMENTS:
            raise ValueError(f"--instrument {a.instrument!r}: allowed {', '.join(INSTRUMENTS)}")
        out = check_out_dir(a.out)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        inst = instrument(a.instrument, out, n_valid=a.n_valid, n_test=a.n_test)
        cmd = " ".join(["python -m studies.equal_bytes", *(argv if argv is not None else sys.argv[1:])])
        rec = run(inst, out, a.stage, cmd)
    except (ValueError, OSError) as e:
        print(f"python -m studies.equal_bytes: error: {e}", file=sys.stderr)
        return 2
    print(markdown(rec), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
