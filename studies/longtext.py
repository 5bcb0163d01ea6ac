"""Round five (issue 61 items 1-2): is there headroom for a learned priority on real text with long-range
structure?  Whole Python source files of the standard library, records of 4,096 byte tokens, a 256-token window
and a 12.5 % budget (B = 512), the seed's proportions.

::

    python -m studies.longtext corpus --out runs/long/corpus                     # stdlib files -> JSONL splits
    python -m studies.longtext context --model studies/models/code_3m --data runs/long/corpus/test.jsonl \\
        --out runs/long/context.json                                             # does the model use > 1K context?
    python -m studies.longtext headroom --model studies/models/code_3m --data runs/long/corpus/test.jsonl \\
        --out runs/long/headroom.json                                            # the exact label vs recency

* **Corpus** (:func:`stdlib_files`, :func:`build_corpus`).  The standard library's ``.py`` files (never read by
  :mod:`studies.realtext_corpus`, which drops any file byte-identical to one of them, so neither shipped code
  model saw them), without ``site-packages``, test directories and ``__pycache__``.  Each file goes to
  ``train`` / ``validation`` / ``test`` by :func:`studies.realtext_corpus.split_of` of ``"stdlib/<path>"``, so no
  two splits share a file; a file gives one record, its first ``--seq-len`` tokens of ``[BOS] + bytes + [EOS]``
  (:func:`studies.realtext_corpus.file_records`), so each record is its own cluster (a file) and a name defined
  near its top is used thousands of tokens later.  Files shorter than ``--seq-len`` tokens are skipped.
* **Context use** (:func:`context_use`).  Per record, the dense NLL at positions ``>= --from`` (1,024) with the full
  context minus the NLL with the context cut to the last ``--keep`` (1,024) tokens and the 4 sinks (StreamingLLM
  at budget ``--keep``): negative where the model reads further back than ``--keep``.
* **Headroom** (:func:`headroom`).  Per record, at budget ``B`` (window ``--window``, 4 sinks), the NLL increase
  over dense of the exact label (the frozen dense model's own attention, pooled by ``--label``, at a fixed decay
  ``gamma``: :func:`studies.realtext.oracle_logits`) and of recency (StreamingLLM), at positions ``>= B``; the
  paired interval of their difference over files (:func:`studies.paired.paired_interval`).  The issue's bar is
  the exact label beating the recency *fine-tune* with an upper bound below -0.02 nats/token; untrained recency
  is what this module scores (a fine-tune narrows the gap, never widens it in any record so far).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .paths import check_out_dir, parse

__all__ = ["stdlib_files", "build_corpus", "read_records", "context_use", "headroom", "main", "SEQ_LEN", "WINDOW",
           "SINKS", "BUDGET", "BAR", "LEDGER_SPLIT", "continue_pretraining", "ledger_rows"]

SEQ_LEN = 4096
WINDOW = 256
SINKS = 4
BUDGET = 512
"""12.5 % of :data:`SEQ_LEN`."""
LEDGER_SPLIT = "stdlib_test4k"
"""The ledger's name of the long records' test split (the first 48 of ``test.jsonl``)."""
BAR = -0.02
"""The issue's bar: the exact label minus the recency fine-tune, the interval's upper end below this."""
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_files(stdlib: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """``("stdlib/<relative path>", path)`` of every ``.py`` file under ``stdlib`` (default this interpreter's),
    sorted, without the directories of :data:`SKIP_DIRS`."""
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"]).resolve()
    if not root.is_dir():
        raise ValueError(f"stdlib {root} is not a directory")
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for f in sorted(files):
            p = Path(dirpath) / f
            if f.endswith(".py") and p.is_file():
                out.append((f"stdlib/{p.relative_to(root).as_posix()}", p))
    return sorted(out)


def build_corpus(out: str | os.PathLike, files: Sequence[tuple[str, Path]], *, seq_len: int = SEQ_LEN,
                 seed: int = 0, valid_frac: float = 0.1, test_frac: float = 0.2,
                 max_records: dict[str, int] | None = None, train_records_per_file: int = 3) -> dict:
    """``OUT/<split>.jsonl`` (``{"input_ids": [...], "file": key}`` per record, files in the order of their seeded
    hash: one record per file, the first ``train_records_per_file`` in ``train``) and ``OUT/manifest.json``;
    returns the manifest."""
    from .realtext_corpus import SPLITS, _text_bytes, _unit, file_hash, file_records, split_of

    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    by: dict[str, list[tuple[float, int, str, list[int]]]] = {s: [] for s in SPLITS}
    for key, p in files:
        data = _text_bytes(Path(p))
        if data is None:
            continue
        split = split_of(key, seed, valid_frac, test_frac)
        recs = file_records(data, seq_len, train_records_per_file if split == "train" else 1)
        by[split] += [(_unit(seed, key), i, key, r) for i, r in enumerate(recs)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"source": "the Python standard library's .py files (studies.longtext)",
                                "python": sys.version.split()[0], "seq_len": seq_len, "seed": seed,
                                "valid_frac": valid_frac, "test_frac": test_frac, "splits": {}}
    for s in SPLITS:
        chosen = sorted(by[s])[:(max_records or {}).get(s)]
        f = out / f"{s}.jsonl"
        with open(f, "w") as fh:
            for _, _, key, ids in chosen:
                fh.write(json.dumps({"input_ids": ids, "file": key}) + "\n")
        manifest["splits"][s] = {"records": len(chosen), "files": sorted({k for _, _, k, _ in chosen}),
                                 "blake2b": file_hash(f)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_records(path: str | os.PathLike, n: int | None = None) -> tuple[list, list[str]]:
    """The first ``n`` records of a corpus split (int64 tensors) and their files (the clusters)."""
    import torch

    ids, files = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            ids.append(torch.tensor(r["input_ids"], dtype=torch.long))
            files.append(r.get("file", str(len(files))))
    if n is not None:
        ids, files = ids[:n], files[:n]
    if not ids:
        raise ValueError(f"{path} holds no record")
    return ids, files


def _streaming(base, budget: int, window: int, sinks: int = SINKS):
    from kvpop.evaluation.evaluate import policy_model

    return policy_model(base, "streaming", sinks=sinks, window=window, budget=budget).eval()


def context_use(base, traces: Sequence, *, start: int = 1024, keep: int = 1024, sinks: int = SINKS,
                progress: bool = True) -> dict[str, list[float]]:
    """Per trace, the dense NLL (nats/token) at positions ``>= start`` with the full context (``full``) and with
    StreamingLLM at budget ``keep`` (the last ``keep - sinks`` tokens and the sinks: ``cut``)."""
    import torch

    from kvpop.evaluation.evaluate import policy_logits
    from kvpop.evaluation.trace_eval import sequence_scores

    cut_model = _streaming(base, keep, keep - sinks - 1, sinks)
    full, cut = [], []
    with torch.no_grad():
        for i, t in enumerate(traces):
            t0 = time.time()
            full.append(float(sequence_scores(base(t[None], use_cache=False).logits, t, start)[0].mean()))
            cut.append(float(sequence_scores(policy_logits(cut_model, t, "streaming"), t, start)[0].mean()))
            if progress:
                print(f"context {i}: full {full[-1]:.4f} cut {cut[-1]:.4f} ({time.time() - t0:.1f}s)", flush=True)
    return {"full": full, "cut": cut}


def headroom(base, traces: Sequence, *, budget: int = BUDGET, window: int = WINDOW, sinks: int = SINKS,
             label: str = "mean", power: float = 1.0, gammas: Sequence[float] = (0.9995,),
             progress: bool = True) -> dict[str, list[float]]:
    """Per trace, the NLL increase over dense at positions ``>= budget`` of ``streaming`` and of
    ``oracle[gamma]`` for each of ``gammas`` (the exact label at that fixed decay)."""
    import torch

    from kvpop.core.patching import patch
    from kvpop.evaluation.evaluate import policy_logits
    from kvpop.evaluation.trace_eval import sequence_scores

    from .label_study import oracle_config
    from .realtext import oracle_logits

    stream = _streaming(base, budget, window, sinks)
    oracles = {g: patch(copy.deepcopy(base), oracle_config(label, power, g, budget=budget, sinks=sinks,
                                                           window=window)).eval() for g in gammas}
    out: dict[str, list[float]] = {"streaming": [], **{f"oracle[{g:g}]": [] for g in gammas}}
    with torch.no_grad():
        for i, t in enumerate(traces):
            t0 = time.time()
            dense = sequence_scores(base(t[None], use_cache=False).logits, t, budget)[0]
            s = sequence_scores(policy_logits(stream, t, "streaming"), t, budget)[0]
            out["streaming"].append(float((s - dense).mean()))
            for g, m in oracles.items():
                o = sequence_scores(oracle_logits(base, m, t), t, budget)[0]
                out[f"oracle[{g:g}]"].append(float((o - dense).mean()))
            if progress:
                print(f"headroom {i}: " + ", ".join(f"{k} {v[-1]:+.4f}" for k, v in out.items())
                      + f" ({time.time() - t0:.1f}s)", flush=True)
    return out


def continue_pretraining(model_dir: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike, *,
                         steps: int, lr: float = 3e-4, warmup: int = 20, seed: int = 0, clip: float = 1.0,
                         valid: str | os.PathLike | None = None, eval_n: int = 8, eval_every: int = 50,
                         eval_from: int = 1024, max_minutes: float | None = None, log=print) -> dict:
    """Dense next-token training of the model at ``model_dir`` on ``data``'s records (their full length), one
    record a step in a seeded order, AdamW at ``lr`` (linear warm-up over ``warmup`` steps, then linear decay to
    0 at ``steps``), gradients clipped to ``clip``; every ``eval_every`` steps (and at the end) the dense NLL at
    positions ``>= eval_from`` of ``valid``'s first ``eval_n`` records is logged and the model saved to
    ``OUT/model`` (``OUT/log.jsonl`` holds every line).  Stops early, saved, after ``max_minutes``.  Returns the
    last evaluation."""
    import torch

    from kvpop.evaluation.trace_eval import load_model, sequence_scores

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    torch.manual_seed(seed)
    model = load_model(str(model_dir))
    traces, _ = read_records(data)
    vtraces = read_records(valid, eval_n)[0] if valid is not None else []
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, max(len(t) for t in traces))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, warmup)) * max(0.0, 1 - i / steps))
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "log.jsonl", "a")

    def emit(e: dict) -> None:
        logf.write(json.dumps(e) + "\n")
        logf.flush()
        log(json.dumps(e))

    def evaluate(step: int) -> dict:
        model.eval()
        with torch.no_grad():
            v = [float(sequence_scores(model(t[None], use_cache=False).logits, t, eval_from)[0].mean())
                 for t in vtraces]
        model.train()
        model.save_pretrained(out / "model")
        e = {"step": step, "valid_nll_from": eval_from, "valid_nll": sum(v) / len(v) if v else None,
             "per_sequence": v}
        emit(e)
        return e

    t0 = time.time()
    last = evaluate(0)
    model.train()
    for step in range(1, steps + 1):
        if not order:
            order = torch.randperm(len(traces), generator=g).tolist()
        t = traces[order.pop()]
        loss = model(t[None], labels=t[None], use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        if step % 10 == 0:
            emit({"step": step, "loss": float(loss.detach()), "lr": sched.get_last_lr()[0],
                  "s_per_step": round((time.time() - t0) / step, 2)})
        timeout = max_minutes is not None and time.time() - t0 > 60 * max_minutes
        if step % eval_every == 0 or step == steps or timeout:
            last = evaluate(step)
        if timeout:
            emit({"stopped": f"after {max_minutes} minutes", "step": step})
            break
    logf.close()
    return last


def ledger_rows(rec: dict, *, split: str, model: str) -> dict:
    """A headroom record (``python -m studies.longtext headroom``) as ledger rows of the real-text instrument on
    ``split`` (one per policy, one seed each: neither row is trained, both deterministic; budget ``rec["budget"]`` of
    ``SEQ_LEN``-token records, not headline) and the paired comparison of each oracle against recency
    (:func:`studies.paired.comparison`, clustered by file)."""
    from .ledger import summarize
    from .paired import comparison

    per = rec["per_sequence"]
    length = rec.get("seq_len", SEQ_LEN)
    rows = []
    for policy, vals in per.items():
        name = "streaming[long]" if policy == "streaming" else f"oracle[label {rec['label']}, gamma " \
            f"{policy.split('[')[1].rstrip(']')}, long]"
        v = sum(vals) / len(vals)
        rows.append({"instrument": "realtext", "policy": name, "budget": rec["budget"],
                     "budget_fraction": rec["budget"] / length, "length": length, "split": split,
                     "recipe": {"model": model, "window": rec["window"], "sinks": rec["sinks"],
                                "label": rec["label"] if policy != "streaming" else None},
                     "steps": None, "seeds": [v], **summarize([v]), "value": v, "metric": "delta_nll", "trials": 0,
                     "test_evaluations": 1, "per_sequence": [vals], "headline": False,
                     "not_causal": policy != "streaming",
                     "legend": ("StreamingLLM, no training" if policy == "streaming" else
                                "the exact label (the frozen dense model's attention, pooled by the label, at a fixed "
                                "decay): not causal, an upper bound")
                     + f"; {model}, {length}-token records of the standard library (studies.longtext)"})
    base = next(r for r in rows if r["policy"] == "streaming[long]")
    comps = []
    for r in rows:
        if r is base:
            continue
        c = comparison(instrument="realtext", budget=rec["budget"], a=r["policy"], b=base["policy"],
                       values_a=r["per_sequence"][0], values_b=base["per_sequence"][0], lower_is_better=True,
                       clusters=rec["files"])
        comps.append({**c, "seeds": {"a": 1, "b": 1}, "split": split})
    return {"rows": rows, "comparisons": comps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.longtext", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="the standard library's files as JSONL splits of long records")
    c.add_argument("--out", required=True)
    c.add_argument("--seq-len", type=int, default=SEQ_LEN)
    c.add_argument("--stdlib", default=None)
    t = sub.add_parser("pretrain", help="continue a model's dense training on long records")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--valid-data", default=None)
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-n", type=int, default=8)
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--max-minutes", type=float, default=None)
    t.add_argument("--threads", type=int, default=1)
    g = sub.add_parser("ledger", help="a headroom record as the ledger's rows of one split (then python -m "
                                      "studies.evidence ledger --runs RUNS --write-shipped)")
    g.add_argument("--record", required=True)
    g.add_argument("--split", required=True, help="the split's name in the ledger")
    g.add_argument("--model-name", required=True)
    g.add_argument("--runs", required=True, help="where RUNS/realtext/evidence_rows.json is written")
    g.add_argument("--write-shipped", action="store_true",
                   help="allow --runs in what the project ships (studies/results/...); refused without it")
    for name, help_ in (("context", "dense NLL with the full context against the context cut to --keep"),
                        ("headroom", "the exact label against recency at one budget")):
        q = sub.add_parser(name, help=help_)
        q.add_argument("--model", required=True)
        q.add_argument("--data", required=True)
        q.add_argument("--out", required=True, help="the JSON file written")
        q.add_argument("--n", type=int, default=None, help="the first N records (default all)")
        q.add_argument("--threads", type=int, default=1)
        if name == "context":
            q.add_argument("--from", dest="start", type=int, default=1024)
            q.add_argument("--keep", type=int, default=1024)
        else:
            q.add_argument("--budget", type=int, default=BUDGET)
            q.add_argument("--window", type=int, default=WINDOW)
            q.add_argument("--label", default="mean")
            q.add_argument("--gammas", default="0.9995")
    a = parse(p, argv)  # the one write rule: --write-shipped for a path the project ships
    shipped = getattr(a, "write_shipped", False)
    try:
        if a.cmd == "corpus":
            check_out_dir(a.out, write_shipped=shipped)
            m = build_corpus(a.out, stdlib_files(a.stdlib), seq_len=a.seq_len)
            print(json.dumps({s: v["records"] for s, v in m["splits"].items()}))
            return 0
        if a.cmd == "ledger":
            from .ledger import write_split_rows

            check_out_dir(a.runs, "--runs", write_shipped=shipped)
            new = ledger_rows(json.loads(Path(a.record).read_text()), split=a.split, model=a.model_name)
            print(write_split_rows(a.runs, "realtext", a.split, new))
            return 0
        import torch

        from kvpop.evaluation.trace_eval import load_model

        from .paired import paired_interval

        if a.cmd == "pretrain":
            check_out_dir(a.out, write_shipped=shipped)
            torch.set_num_threads(a.threads)
            continue_pretraining(a.model, a.data, a.out, steps=a.steps, lr=a.lr, warmup=a.warmup, seed=a.seed,
                                 valid=a.valid_data, eval_n=a.eval_n, eval_every=a.eval_every,
                                 max_minutes=a.max_minutes)
            return 0

        check_out_dir(a.out, "--out", write_shipped=shipped, file=True)
        torch.set_num_threads(a.threads)
        base = load_model(a.model).eval()
        traces, files = read_records(a.data, a.n)
        t0 = time.time()
        if a.cmd == "context":
            vals = context_use(base, traces, start=a.start, keep=a.keep)
            diff = paired_interval(vals["full"], vals["cut"], clusters=files)
            rec = {"study": "context use", "model": a.model, "data": a.data, "from": a.start, "keep": a.keep,
                   "files": files, "per_sequence": vals, "full_minus_cut": diff.to_dict()}
        else:
            gammas = [float(x) for x in a.gammas.split(",")]
            vals = headroom(base, traces, budget=a.budget, window=a.window, label=a.label, gammas=gammas)
            comps = {k: paired_interval(v, vals["streaming"], clusters=files).to_dict()
                     for k, v in vals.items() if k != "streaming"}
            rec = {"study": "headroom", "model": a.model, "data": a.data, "budget": a.budget, "window": a.window,
                   "seq_len": len(traces[0]),
                   "sinks": SINKS, "label": a.label, "files": files, "per_sequence": vals,
                   "means": {k: sum(v) / len(v) for k, v in vals.items()},
                   "oracle_minus_streaming": comps, "bar": BAR}
        rec["wall_s"] = round(time.time() - t0, 1)
        rec["command"] = "python -m studies.longtext " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps({k: v for k, v in rec.items() if k not in ("per_sequence", "files")}, indent=1))
        return 0
    except (ValueError, OSError) as e:
        print(f"python -m studies.longtext: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
