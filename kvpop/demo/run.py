"""One run of ``kvpop demo`` for one task: the retrofits (reusing a ``--select`` trial of exactly the chosen
settings), DMS, every policy evaluated at the task's budgets and lengths on test sequences, the decode check,
and the files (``results.json``, ``table.md``, the plot, ``dms.md``, ``decode.md``, ``run.json``).  The command
``kvpop demo`` (:mod:`kvpop.cli.demo`) parses its arguments and calls :func:`run_task`; the settings are
:func:`kvpop.demo.search.settings`'s.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kvpop.core.files import replace_files
from kvpop.demo.search import (
    DemoOptions,
    base_model_dir,
    eval_config,
    init_file,
    policy_model,
    retrofit_config,
    task_module,
    trial_dir,
    validator,
)


def _policy_stamp(stamp: dict, policy: str) -> dict:
    """The settings a measured row of ``policy`` depends on (``--resume`` reuses a row when they are unchanged)."""
    own = {k: v for k, v in stamp.items() if k not in ("retrofits", "decode_check") and not k.startswith("dms_")}
    if policy in stamp.get("retrofits", {}):
        own["retrofit"] = stamp["retrofits"][policy]
    if policy in ("dms", "dms-test-calibrated"):
        own["dms"] = {k: v for k, v in stamp.items() if k.startswith("dms_")}
    return own


def _read_rows(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[f"{r['policy']}|{r['budget']}|{r['length']}"] = r
    return done


def _append_row(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_task(args: DemoOptions, task: str, out: Path, s: dict) -> dict:
    """Retrofit, evaluate and write the results of one task into ``out``; returns results.json's dict."""
    import torch

    from kvpop.demo import retrofit as R
    from kvpop.evaluation import evaluate as E

    t_start = time.time()
    mod = task_module(task)
    cfg = eval_config(E, s, args)
    rcs = {p: None if c.get("joint_init") == "scorer-only" else retrofit_config(s, p, c)
           for p, c in s["retrofits"].items()}  # a warm start's config once its scorer file exists
    base = E.load_base_model(base_model_dir(args, task))
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    settings_file = out / "demo_settings.json"
    stamp = {**s, "model": str(Path(args.model).resolve()) if args.model else "shipped"}
    old = json.loads(settings_file.read_text()) if args.resume and settings_file.exists() else None
    kept = {key: r for key, r in _read_rows(rows_file).items()
            if old is not None and _policy_stamp(old, r["policy"]) == _policy_stamp(stamp, r["policy"])}
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in kept.values()))
    settings_file.write_text(json.dumps(stamp, indent=1))
    progress = not args.no_progress

    timings = {}
    dense_done: dict = {}
    for p, c in s["retrofits"].items():
        t0 = time.time()
        rc = rcs[p] = rcs[p] or retrofit_config(s, p, c, init_file(out, p, c))
        adopted = adopt_trial(out, p, c)
        print(f"[kvpop demo] {task}: retrofit {p}: {rc.steps} steps at length {rc.length}, budget {rc.budget}"
              f"{', model and scorers' if rc.train_model and p != 'fixed-finetune' else ''}"
              f"{', label ' + rc.label if p != 'fixed-finetune' else ''}"
              f"{', validated every ' + str(rc.eval_every) if rc.eval_every else ''}"
              f"{', from the --select trial' if adopted else ''}", flush=True)
        R.retrofit(base, p, out / p, rc, resume=args.resume or adopted, progress=progress, task=mod,
                   validate=validator(E, mod, base, s, args, p, out / p, dense_done) if rc.eval_every else None)
        timings[f"retrofit_{p}_s"] = round(time.time() - t0, 1)

    if s["dms_steps"] > 0:  # the learned baseline: gates and model together (kvpop.demo.retrofit)

        t0 = time.time()
        rc = R.RetrofitConfig(steps=s["dms_steps"], length=s["train_length"], batch=1, sinks=s["sinks"],
                              window=s["window"], lr_scorer=s["dms_lr"], lr_model=s["dms_lr_model"], train_model=True,
                              checkpoint_every=max(1, min(50, s["dms_steps"] // 4)))
        print(f"[kvpop demo] {task}: retrofit dms: {rc.steps} steps at length {rc.length}, target keep "
              f"{s['dms_target_keep']}", flush=True)
        R.retrofit_dms(base, out / "dms", rc, target_keep=s["dms_target_keep"], resume=args.resume, progress=progress,
                     task=mod)
        timings["retrofit_dms_s"] = round(time.time() - t0, 1)

    pm = dict(sinks=cfg.sinks, window=cfg.window, budget=cfg.budgets[0])
    shared = E.policy_model(base, "streaming", **pm)
    models = {"dense": base, "streaming": shared, "tova": shared, "h2o": shared}
    for p in rcs:
        models[p] = policy_model(E, base, p, out / p, pm)
    if s["dms_steps"] > 0:
        models["dms"] = E.policy_model(base, "dms", scorers=out / "dms" / "gates.safetensors",
                                       finetuned=E.load_base_model(out / "dms" / "model"), **pm)
        models["dms-test-calibrated"] = models["dms"]  # the same model, its threshold set on each test sequence

    print(f"[kvpop demo] {task}: evaluating {len(cfg.policies)} policies, budgets {cfg.budgets}, lengths "
          f"{cfg.lengths}, {cfg.n_sequences} test sequences each", flush=True)
    t0 = time.time()
    results = E.evaluate(models, cfg, done=kept, on_row=lambda r: _append_row(rows_file, r),
                         task=mod)
    timings["eval_s"] = round(time.time() - t0, 1)
    if s["decode_check"]:
        t0 = time.time()
        results["decode"] = _decode_rows(E, mod, models, s, cfg, out, old, stamp, results["rows"])
        timings["decode_s"] = round(time.time() - t0, 1)
    timings["total_s"] = round(time.time() - t_start, 1)
    # results.json holds only what the seeds and settings determine (a re-run on the same machine and thread
    # count writes the same bytes); the run's wall times and command line go to run.json beside it
    results["demo"] = {"task": task, "settings": stamp, "threads": torch.get_num_threads(),
                       "retrofit": {p: json.loads((out / p / "done.json").read_text())
                                    for p in (*rcs, *(("dms",) if s["dms_steps"] > 0 else ()))}}
    print(f"[kvpop demo] {task}:")
    E.write_outputs(results, out, not args.no_plot)
    verdict = reproduction_verdict(results, task)
    if verdict is not None:
        print(f"[kvpop demo] {verdict}", flush=True)
    for name, fmt in (("decode", format_decode_table), ("dms", format_dms_table)):
        table = fmt(results.get("decode") or [] if name == "decode" else results["rows"])
        if table:
            print(table)
            (out / f"{name}.md").write_text(table + "\n")
    E.write_results({"task": task, "timings": timings, "threads": torch.get_num_threads(),
                     "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t_start)),
                     "args": dict(args.recorded)}, out / "run.json")
    return results


def reproduction_verdict(results: dict, task: str) -> str | None:
    """The line comparing ``results`` with the shipped ones (:mod:`kvpop.demo.reproduce`), or None when this run's
    settings are not the shipped run's (another budget, length, sequence count or retrofit setting: nothing to
    compare with)."""
    from kvpop.demo import reproduce

    path = reproduce.SHIPPED / task / "results.json"
    if not path.is_file() or not reproduce.BANDS.is_file():
        return None
    shipped = json.loads(path.read_text())
    same = all(results.get(k) == shipped.get(k) for k in ("budgets", "lengths", "n_sequences", "task_config"))
    if not same or not _agrees(results["demo"]["settings"], shipped.get("demo", {}).get("settings", {})):
        return None
    v = reproduce.compare(results, shipped, reproduce.load_bands().get(task, {}), task=task)
    return v.line() + ("" if v.ok else ": see python -m kvpop.demo.reproduce OUT for each cell")


def _agrees(mine: Any, theirs: Any) -> bool:
    """``mine`` equals ``theirs`` but for keys ``theirs`` lacks (a setting added since the shipped run, at its
    default), in nested dicts too."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return all(k not in theirs or _agrees(v, theirs[k]) for k, v in mine.items())
    return mine == theirs


def adopt_trial(out: Path, policy: str, c: dict) -> bool:
    """Copy a finished ``--select`` trial of ``policy`` with exactly the settings ``c`` (same ``--out``) into
    ``out/<policy>`` unless that holds the same finished retrofit (a finished one with other settings is
    replaced); :func:`kvpop.demo.retrofit.retrofit` then checks its settings and reuses it, or trains anew
    when they differ.  Returns whether ``out/<policy>`` now holds the trial."""
    import shutil

    src, dst = trial_dir(out, policy, c), out / policy
    if not (src / "done.json").exists():
        return False
    if (dst / "done.json").exists() and (json.loads((dst / "done.json").read_text())["settings"]
                                         == json.loads((src / "done.json").read_text())["settings"]):
        return True  # adopted before
    (dst / "done.json").unlink(missing_ok=True)  # the marker first: nothing half-replaced reads as finished
    replace_files(src, dst, ("scorers.safetensors", "model", "head_budgets.json"))
    shutil.copy2(src / "done.json", dst / "done.json")
    return True


def _decode_rows(E, mod, models: dict, s: dict, cfg, out: Path, old: dict | None, stamp: dict,
                 measured: list[dict]) -> list[dict]:
    """The reads of every learned policy of ``models`` by token-by-token decoding beside the prefill's
    (:func:`kvpop.evaluation.decode_eval.decode_check`) at the middle budget and L_train, on the test sequences (DMS
    at the threshold its row of ``measured`` was chosen on validation); rows kept in ``out/decode.jsonl`` for
    ``--resume``."""
    from kvpop.evaluation.decode_eval import DECODE_POLICIES, decode_check

    f = out / "decode.jsonl"
    done = {r["policy"]: r for r in (json.loads(x) for x in (f.read_text().splitlines() if f.exists() else []) if x)
            if old is not None and _policy_stamp(old, r["policy"]) == _policy_stamp(stamp, r["policy"])}
    f.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    L, b = s["train_len"], cfg.budgets[len(cfg.budgets) // 2]
    exs = [mod.make_example(mod.test_seed(i), L, mod.DEFAULT) for i in range(cfg.n_sequences)]
    rows = []
    for p in [p for p in E.POLICIES if p in models and p in DECODE_POLICIES]:
        if p not in done:
            print(f"[kvpop demo] {s['task']}: decoding {p} token by token at B={b}, L={L}", flush=True)
            thr = next((r["dms_threshold"] for r in measured if r["policy"] == p and r["budget"] == b
                        and r["length"] == L), None) if p == "dms" else None
            done[p] = decode_check(models[p], exs, p, b, threshold=thr)
            _append_row(f, done[p])
        rows.append(done[p])
    return rows


def format_dms_table(rows: list[dict]) -> str:
    """Markdown: DMS's memory at each budget and length (``""`` without dms rows): the threshold chosen on
    validation, the validation sequences' mean entries per layer and KV head, and the test sequences' mean
    and per-head spread (min / max over heads, averaged over the sequences), beside KVpop's uniform ``B``."""
    rows = [r for r in rows if r["policy"] in ("dms", "dms-test-calibrated") and "dms_entries_mean" in r]
    if not rows:
        return ""
    lines = ["| policy | L | B (KVpop: every head) | threshold | validation mean entries | test mean entries | "
             "test min / max over heads | accuracy |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["policy"] != "dms", r["length"], r["budget"])):
        val = f"{r['dms_valid_entries_mean']:.1f}" if "dms_valid_entries_mean" in r else "- (set on each test sequence)"
        lines.append(f"| {r['policy']} | {r['length']} | {r['budget']} | {r['dms_threshold']:.3f} | {val} | "
                     f"{r['dms_entries_mean']:.1f} | {r['dms_entries_min']:.1f} / {r['dms_entries_max']:.1f} | "
                     f"{r['accuracy']:.3f} |")
    return "\n".join(lines)


def format_decode_table(rows: list[dict]) -> str:
    """Markdown: each policy's reads from the one-call prefill and from token-by-token decoding."""
    if not rows:
        return ""
    lines = ["| policy | B | L | prefill accuracy | decode accuracy | reads that differ |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['budget']} | {r['length']} | {r['prefill_accuracy']:.3f} | "
                     f"{r['decode_accuracy']:.3f} | {r['differ']} of {r['graded']} |")
    return "\n".join(lines)


