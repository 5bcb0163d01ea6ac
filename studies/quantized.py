"""Quantised slots at equal bytes: ``B`` slots of 8 bits against ``B / 2`` slots of 16 bits, measured by decoding.

::

    python -m studies.quantized --out runs/quantized            # all three instruments
    python -m studies.quantized --out runs/quantized --instruments realtext --n-sequences 8

Every row decodes the same sequences token by token through ``kvpop.KVpopCache`` (the prompt is the sinks,
so every slot a row keeps was written by a decode step, quantised when the row is), with the model in
bfloat16 so that the unquantised slots are 16-bit: per instrument, at its headline budget ``B``,

* ``bf16 B``: the cache in the model's dtype (the reference row);
* ``int8 B`` and ``fp8 B``: ``KVpopCache(kv_dtype=...)``, 8-bit codes with a float32 scale per slot and KV head;
* ``bf16 B/2``: half the slots in 16 bits, about the bytes of the 8-bit rows (at least ``sinks + window + 1``
  slots: :func:`half_budget`).

Bytes per sequence are ``KVpopCache.nbytes()`` over the batch (keys, values, scales, slot positions and
priorities: everything the cache holds), decode time per token the wall time of the decode calls over
their count (the CPU's PyTorch path here: noisy, and not a speed figure for the GPU kernels).

The instruments and their read:

* ``kvtrace`` and ``lookahead``: accuracy on the graded positions of the task's *validation* sequences
  (``valid_seed(i)``, at the task's training length; nothing is chosen from these figures, and the test
  seeds stay unspent by them), policy ``kvpop`` with an MLP scorer trained by the demo's retrofit at the demo's
  chosen settings (``kvpop.demo.search.CHOSEN``), its steps capped by ``--task-steps`` (a scorer shared by
  every row of the task, so the rows differ only in the cache);
* ``realtext``: the NLL increase over dense (nats/token, positions >= 256, as the ledger reads real text) on
  the shipped validation split's first ``--n-sequences`` records, policy ``streaming`` (no scorer: the
  slots' precision is what differs), or ``kvpop`` with ``--realtext-scorers FILE``.

The scorer decides from the full-precision key and value of each token (its priority is computed before the
token is stored), so quantisation changes what attention reads from a kept slot, never which slots are
kept.  Writes ``OUT/<instrument>.json`` after each instrument (an interrupted run keeps the finished ones and
resumes past them) and ``OUT/quantized.md``, the table.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvpop.core.files import write_json

from .paths import DATA, parse

INSTRUMENTS = ("kvtrace", "lookahead", "realtext")
ROWS = (("bf16", 1.0), ("int8", 1.0), ("fp8", 1.0), ("bf16", 0.5))
"""(slots' dtype, fraction of the headline budget's long-range slots and window kept): the rows of each instrument."""
HEADLINE = {"kvtrace": 128, "lookahead": 64, "realtext": 128}
"""Each instrument's headline budget (the ledger's)."""
REALTEXT = {"sinks": 4, "window": 32, "start": 256, "seq_len": 1024}
SHIPPED = DATA


def half_budget(budget: int, sinks: int, window: int) -> int:
    """``budget / 2`` rounded down, at least ``sinks + window + 1`` (a learned policy keeps one long-range slot at
    least; lookahead's ``B = 64`` with a window of 32 halves to 37)."""
    return max(sinks + window + 1, budget // 2)


@torch.no_grad()
def decode_rows(model, ids: torch.Tensor, kv_dtype: str | None, prompt: int) -> dict:
    """Decode ``ids [n, L]`` through a ``KVpopCache(model, kv_dtype=...)``: ``log_probs [n, L - 1]`` of each next
    token, ``pred [n, L]`` (greedy prediction of token ``t + 1`` at ``t``), ``bytes_per_sequence``, ``s_per_token``."""
    from kvpop.core.cache import KVpopCache
    from kvpop.models import cache_kwarg_name

    cache = KVpopCache(model, kv_dtype=kv_dtype)
    kw = {cache_kwarg_name(): cache, "use_cache": True}
    n, L = ids.shape
    logits = [model(ids[:, :prompt], **kw).logits.float()]
    t0 = time.perf_counter()
    for t in range(prompt, L):
        logits.append(model(ids[:, t:t + 1], **kw).logits.float())
    secs = time.perf_counter() - t0
    lg = torch.cat(logits, 1)  # [n, L, V]
    lp = torch.log_softmax(lg[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    return {"log_probs": lp, "pred": lg.argmax(-1), "bytes_per_sequence": cache.nbytes() / n,
            "s_per_token": secs / max(1, L - prompt)}


def _row_name(dtype: str, budget: int) -> str:
    return f"{dtype} B={budget}"


def _rows(model, ids, budget: int, sinks: int, window: int, read) -> list[dict]:
    """Every row of :data:`ROWS` at ``budget``: ``read(result)`` gives the row's figure."""
    from kvpop.core.budgets import rebudget

    out = []
    for dtype, frac in ROWS:
        b = budget if frac == 1.0 else half_budget(budget, sinks, window)
        rebudget(model, b)
        r = decode_rows(model, ids, None if dtype == "bf16" else dtype, prompt=sinks)
        out.append({"row": _row_name(dtype, b), "slot_dtype": dtype, "budget": b, **read(r),
                    "bytes_per_sequence": r["bytes_per_sequence"], "ms_per_token": 1e3 * r["s_per_token"]})
        print(f"[quantized] {out[-1]}", flush=True)
    return out


def _task(name: str, out: Path, n: int, steps: int) -> dict:
    from dataclasses import replace

    from kvpop.demo import retrofit as R
    from kvpop.evaluation import evaluate as E
    from studies.evidence_synthetic import _demo

    S, args, s = _demo(name, out / name, n)
    mod = S.task_module(name)
    base = E.load_base_model(S.base_model_dir(args, name))
    c = dict(s["retrofits"]["kvpop-mlp"])
    c.update(steps=min(int(c["steps"]), steps), head_budgets=None, eval_every=0, patience=0)
    d = out / name / "kvpop-mlp"
    R.retrofit(base, "kvpop-mlp", d, replace(S.retrofit_config(s, "kvpop-mlp", c), seed=0), resume=True,
               progress=True, task=mod)
    budget = HEADLINE[name]
    model = S.policy_model(E, base, "kvpop-mlp", d, dict(sinks=s["sinks"], window=s["window"], budget=budget))
    model = model.to(torch.bfloat16)
    exs = [mod.make_example(mod.valid_seed(i), s["train_len"]) for i in range(n)]
    ids = torch.stack([ex["input_ids"].reshape(-1) for ex in exs])
    pos = torch.stack([ex["answer_positions"].reshape(-1) for ex in exs])
    ans = torch.stack([ex["answers"].reshape(-1) for ex in exs])

    def read(r):
        return {"accuracy": float((r["pred"].gather(1, pos) == ans).float().mean())}

    return {"instrument": name, "metric": "accuracy", "policy": "kvpop-mlp", "scorer_steps": c["steps"],
            "sequences": f"valid_seed(0..{n - 1}) at length {s['train_len']}", "sinks": s["sinks"],
            "window": s["window"], "rows": _rows(model, ids, budget, s["sinks"], s["window"], read)}


def _realtext(n: int, scorers: str | None, length: int = REALTEXT["seq_len"]) -> dict:
    import kvpop
    from kvpop.evaluation.evaluate import load_base_model
    from kvpop.training.data import jsonl_values

    sinks, window, start = REALTEXT["sinks"], REALTEXT["window"], REALTEXT["start"]
    model = load_base_model(SHIPPED / "tiny_qwen3_code").to(torch.bfloat16)
    recs = [v["input_ids"] for _, v in jsonl_values(SHIPPED / "realtext" / "validation.jsonl")][:n]
    if len(recs) < n:
        raise ValueError(f"--n-sequences {n}: the validation split holds {len(recs)} records")
    if not start < length <= len(recs[0]):
        raise ValueError(f"--length {length}: allowed {start + 1}..{len(recs[0])} (positions >= {start} are scored)")
    ids = torch.tensor(recs, dtype=torch.long)[:, :length]
    with torch.no_grad():
        dense = torch.log_softmax(model(ids).logits.float()[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    dense_nll = float(-dense[:, start - 1:].mean())
    policy = "kvpop" if scorers else "streaming"
    kvpop.patch(model, sinks=sinks, window=window, budget=HEADLINE["realtext"], policy=policy)
    if scorers:
        kvpop.load_scorers(model, scorers)

    def read(r):
        nll = float(-r["log_probs"][:, start - 1:].mean())
        return {"nll": nll, "delta_nll": nll - dense_nll}

    return {"instrument": "realtext", "metric": "delta_nll", "policy": policy, "dense_nll": dense_nll,
            "sequences": f"the first {length} tokens of the first {n} records of kvpop/data/realtext/validation.jsonl, "
                         f"positions >= {start}",
            "sinks": sinks, "window": window, "rows": _rows(model, ids, HEADLINE["realtext"], sinks, window, read)}


def table(results: list[dict]) -> str:
    """The markdown table of every instrument's rows (the figure, bytes per sequence and their ratio to the
    16-bit row at ``B``, decode ms per token)."""
    lines = ["| instrument | row | figure | bytes / sequence | bytes vs 16-bit B | ms / token (CPU) |",
             "|---|---|---|---|---|---|"]
    for res in results:
        ref = res["rows"][0]["bytes_per_sequence"]
        for r in res["rows"]:
            fig = (f"accuracy {r['accuracy']:.3f}" if res["metric"] == "accuracy"
                   else f"NLL over dense {r['delta_nll']:+.4f}")
            lines.append(f"| {res['instrument']} ({res['policy']}) | {r['row']} | {fig} | "
                         f"{r['bytes_per_sequence']:,.0f} | {r['bytes_per_sequence'] / ref:.3f} | "
                         f"{r['ms_per_token']:.2f} |")
    return "\n".join(lines) + "\n"


MODELS = {"kvtrace": "tiny_qwen3", "lookahead": "tiny_qwen3_lookahead", "realtext": "tiny_qwen3_code"}
"""Each instrument's shipped model (under the package's data)."""


@torch.no_grad()
def cache_bytes(instrument: str, policy: str, budget: int, slot_dtype: str, sinks: int, window: int) -> float:
    """``KVpopCache.nbytes()`` per sequence of one row, with today's code: the instrument's model in bfloat16,
    patched at ``budget``, one sequence decoded past ``sinks + window + budget`` tokens.  What the cache holds
    depends on the shapes, the policy and the slot dtype only, never on the tokens or the scorer's weights."""
    import kvpop
    from kvpop.core.cache import KVpopCache
    from kvpop.evaluation.evaluate import load_base_model
    from kvpop.models import cache_kwarg_name

    model = load_base_model(SHIPPED / MODELS[instrument]).to(torch.bfloat16)
    kvpop.patch(model, sinks=sinks, window=window, budget=budget, policy="streaming" if policy == "streaming"
                else "kvpop")
    cache = KVpopCache(model, kv_dtype=None if slot_dtype == "bf16" else slot_dtype)
    kw = {cache_kwarg_name(): cache, "use_cache": True}
    ids = torch.randint(0, model.config.vocab_size, (1, sinks + window + budget + 2),
                        generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], **kw)
    model(ids[:, -1:], **kw)
    return float(cache.nbytes())


def recount_bytes(out: Path) -> list[dict]:
    """``--recount-bytes``: every ``<instrument>.json`` in ``out`` with its ``bytes_per_sequence`` recomputed by
    :func:`cache_bytes` (the figures and timings kept as measured), each row's earlier count kept as
    ``bytes_per_sequence_before``."""
    results = []
    for name in INSTRUMENTS:
        f = out / f"{name}.json"
        if not f.exists():
            continue
        res = json.loads(f.read_text())
        for r in res["rows"]:
            now = cache_bytes(name, res["policy"], r["budget"], r["slot_dtype"], res["sinks"], res["window"])
            if now != r["bytes_per_sequence"]:
                r.setdefault("bytes_per_sequence_before", r["bytes_per_sequence"])
            r["bytes_per_sequence"] = now
        write_json(f, res)
        results.append(res)
    if not results:
        raise ValueError(f"--recount-bytes: no {', '.join(f'{n}.json' for n in INSTRUMENTS)} in --out {out}")
    return results


def run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    if a.recount_bytes:
        md = table(recount_bytes(out))
        (out / "quantized.md").write_text(md)
        print(md)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    names = [x.strip() for x in a.instruments.split(",") if x.strip()]
    bad = [x for x in names if x not in INSTRUMENTS]
    if bad or not names:
        raise ValueError(f"--instruments {a.instruments!r}: allowed {', '.join(INSTRUMENTS)} (comma-separated)")
    if a.n_sequences < 1 or a.task_steps < 1:
        raise ValueError(f"--n-sequences ({a.n_sequences}) and --task-steps ({a.task_steps}) must be >= 1")
    if a.realtext_scorers and not Path(a.realtext_scorers).is_file():
        raise ValueError(f"--realtext-scorers {a.realtext_scorers!r} is not a file")
    torch.manual_seed(0)
    results = []
    for name in names:
        f = out / f"{name}.json"
        if f.exists():  # finished before an interruption
            results.append(json.loads(f.read_text()))
            continue
        res = (_realtext(a.n_sequences, a.realtext_scorers, a.length) if name == "realtext"
               else _task(name, out, a.n_sequences, a.task_steps))
        write_json(f, res)
        results.append(res)
    md = table(results)
    (out / "quantized.md").write_text(md)
    print(md)
    if any(not math.isfinite(r.get("accuracy", r.get("nll", 0.0))) for res in results for r in res["rows"]):
        raise RuntimeError("a row's figure is not finite: see the JSON files in --out")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run directory (one JSON per instrument, quantized.md)")
    p.add_argument("--instruments", default=",".join(INSTRUMENTS), help="comma-separated: kvtrace,lookahead,realtext")
    p.add_argument("--n-sequences", type=int, default=8, help="validation sequences per instrument (default 8)")
    p.add_argument("--task-steps", type=int, default=200,
                   help="cap on the steps of the tasks' MLP scorers (the demo's chosen steps otherwise; default 200)")
    p.add_argument("--length", type=int, default=REALTEXT["seq_len"],
                   help=f"realtext: tokens of each record decoded (default {REALTEXT['seq_len']}, the whole record)")
    p.add_argument("--recount-bytes", action="store_true",
                   help="recompute only the bytes per sequence of the JSON files already in --out (today's "
                        "KVpopCache.nbytes()), keeping their measured figures and timings")
    p.add_argument("--realtext-scorers", default=None,
                   help="a scorer file for the tiny code model (kvpop train --data ...): realtext decodes policy "
                        "kvpop with it instead of streaming")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.quantized", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(parse(p, argv))


if __name__ == "__main__":
    raise SystemExit(main())
