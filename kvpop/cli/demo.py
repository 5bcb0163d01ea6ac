"""``kvpop demo``: retrofit the shipped tiny Qwen3 models and measure accuracy vs cache budget.

::

    kvpop demo --out demo-out                    # the kvtrace task
    kvpop demo --task lookahead --out demo-out   # the lookahead task
    kvpop demo --task all --out demo-out         # both

For each task: the retrofits (``OUT/<task>/<policy>``), every policy at the task's budgets, at L_train and
2x L_train, on test sequences through ``kvpop.KVpopCache``; then ``results.json`` (only what the seeds and
settings determine: a re-run on the same machine and thread count writes the same bytes), ``table.md``,
``accuracy_vs_budget.png``, ``dms.md`` (DMS's memory at its validation-chosen threshold), ``decode.md`` (the
learned policies' reads by token-by-token decoding beside the prefill's) and ``run.json`` (wall times, date,
arguments).  The training settings are :data:`kvpop.demo.search.CHOSEN` (``kvpop/data/demo_results/chosen.json``),
picked on validation sequences by ``--select`` (:func:`kvpop.demo.search.select`) over
:data:`~kvpop.demo.search.GRID` (``--select-stage label``: the label family, the decay range, head-adaptive
budgets and the joint retrofits' start, with early stopping on validation), the joint retrofits' label source included
(each run also trains them on the other source, the ``-<source>-label`` rows); a run in the ``--out`` of a
``--select`` reuses the trial of each chosen setting.  ``--resume`` reuses
finished retrofits (``<policy>/done.json``) and measured rows (``rows.jsonl``) and continues an unfinished
retrofit from its checkpoint; ``--quick`` is a seconds-long smoke run (meaningless figures).  What the demo
does in detail and what it measured: ``kvpop/data/demo_results/README.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvpop.demo.search import TASKS, task_module
from kvpop.demo.search import base_model_dir as _base_model_dir
from kvpop.demo.search import eval_config as _eval_config
from kvpop.demo.search import init_file as _init_file
from kvpop.demo.search import policy_model as _policy_model
from kvpop.demo.search import retrofit_config as _retrofit_config
from kvpop.demo.search import trial_dir as _trial_dir
from kvpop.demo.search import validator as _validator

from .eval import _ints, add_common, check_common, check_out, finish


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (one subdirectory per task)")
    p.add_argument("--task", default="kvtrace", choices=[*TASKS, "all"],
                   help="which task's model to retrofit and evaluate (default: kvtrace; lookahead needs --model "
                        "until a pre-trained model is shipped; all: one after the other)")
    p.add_argument("--select", action="store_true",
                   help="choose the training settings on validation sequences (the grid GRID) instead of "
                        "running the demo; writes OUT/<task>/selection.json")
    p.add_argument("--select-stage", default="all", choices=("all", "target_source", "label"),
                   help="with --select: all (every setting), target_source (only the joint retrofits' label source, "
                        "student vs teacher, the other settings as CHOSEN) or label (the label family: label, decay "
                        "and scorer lr of the scorer-only retrofits, then the joint retrofits' start; the other "
                        "settings as CHOSEN)")
    p.add_argument("--resume", action="store_true",
                   help="reuse finished parts in --out (retrofits, measured rows) and continue unfinished ones")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: L_train 128, sinks 2, window 4, 2-3 training steps, 1 sequence")
    add_common(p)
    p.add_argument("--steps", type=int, default=None, help="training steps of every retrofit (default: CHOSEN)")
    p.add_argument("--train-length", type=int, default=None,
                   help="length of the training sequences (default L_train/2)")
    p.add_argument("--train-budget", type=int, default=None,
                   help="budget of the scorer training of every kvpop retrofit (default: sinks + window + k, "
                        "k from CHOSEN; fixed-finetune always trains at 12.5%% of --train-length)")
    p.add_argument("--lr-scorer", type=float, default=None, help="scorer learning rate (default: CHOSEN)")
    p.add_argument("--lr-model", type=float, default=None,
                   help="model learning rate of the joint retrofits and fixed-finetune (default: CHOSEN)")
    p.add_argument("--no-decode-check", action="store_true",
                   help="skip measuring the learned policies' reads by token-by-token decoding (default: at the middle "
                        "budget and L_train, beside the prefill's)")
    p.add_argument("--tau", type=float, default=None, help="temperature of the score loss (default 1.0)")
    p.add_argument("--dms-steps", type=int, default=None,
                   help="training steps of the DMS baseline (gates + model; default 100; 0 leaves dms out)")
    p.add_argument("--dms-target-keep", type=float, default=None,
                   help="keep fraction DMS is trained to (default 0.04, about the long-range share of the smallest "
                        "budget at L_train; chosen over 0.1 on validation sequences; evaluated at each budget's mean)")
    p.add_argument("--dms-lr", type=float, default=None, help="learning rate of the DMS gates (default 0.05)")


def _settings(args: argparse.Namespace, task: str) -> dict:
    """The settings of this run of ``task`` (:func:`kvpop.demo.search.settings`)."""
    from kvpop.demo.search import settings

    return settings(args, task, lengths=_ints(args.lengths), budgets=_ints(args.budgets))


def _select(args: argparse.Namespace, task: str, out: Path) -> dict:
    """``--select``: :func:`kvpop.demo.search.select` for ``task`` into ``out``."""
    from kvpop.demo.search import select

    return select(args, task, out, _settings(args, task))


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


def _run_task(args: argparse.Namespace, task: str, out: Path) -> dict:
    """Retrofit, evaluate and write the results of one task into ``out``; returns results.json's dict."""
    import torch

    from kvpop.demo import evaluate as E
    from kvpop.demo import retrofit as R

    t_start = time.time()
    mod = task_module(task)
    s = _settings(args, task)
    cfg = _eval_config(E, s, args)
    rcs = {p: None if c.get("joint_init") == "scorer-only" else _retrofit_config(E, s, p, c)
           for p, c in s["retrofits"].items()}  # a warm start's config once its scorer file exists
    base = E.load_base_model(_base_model_dir(args, task))
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
        rc = rcs[p] = rcs[p] or _retrofit_config(E, s, p, c, _init_file(out, p, c))
        adopted = _adopt_trial(out, p, c)
        print(f"[kvpop demo] {task}: retrofit {p}: {rc.steps} steps at length {rc.length}, budget {rc.budget}"
              f"{', model and scorers' if rc.train_model and p != 'fixed-finetune' else ''}"
              f"{', label ' + rc.label if p != 'fixed-finetune' else ''}"
              f"{', validated every ' + str(rc.eval_every) if rc.eval_every else ''}"
              f"{', from the --select trial' if adopted else ''}", flush=True)
        R.retrofit(base, p, out / p, rc, resume=args.resume or adopted, progress=progress, task=mod,
                   validate=_validator(E, mod, base, s, args, p, out / p, dense_done) if rc.eval_every else None)
        timings[f"retrofit_{p}_s"] = round(time.time() - t0, 1)

    if s["dms_steps"] > 0:  # the learned baseline: gates and model together (kvpop.demo.retrofit)

        t0 = time.time()
        rc = E.RetrofitConfig(steps=s["dms_steps"], length=s["train_length"], batch=1, sinks=s["sinks"],
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
        models[p] = _policy_model(E, base, p, out / p, pm)
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
    finish(results, out, not args.no_plot)
    for name, fmt in (("decode", format_decode_table), ("dms", format_dms_table)):
        table = fmt(results.get("decode") or [] if name == "decode" else results["rows"])
        if table:
            print(table)
            (out / f"{name}.md").write_text(table + "\n")
    E.write_results({"task": task, "timings": timings, "threads": torch.get_num_threads(),
                     "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t_start)),
                     "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}}, out / "run.json")
    return results


def _adopt_trial(out: Path, policy: str, c: dict) -> bool:
    """Copy a finished ``--select`` trial of ``policy`` with exactly the settings ``c`` (same ``--out``) into
    ``out/<policy>`` unless that holds the same finished retrofit (a finished one with other settings is
    replaced); :func:`kvpop.demo.retrofit.retrofit` then checks its settings and reuses it, or trains anew
    when they differ.  Returns whether ``out/<policy>`` now holds the trial."""
    import shutil

    src, dst = _trial_dir(out, policy, c), out / policy
    if not (src / "done.json").exists():
        return False
    if (dst / "done.json").exists() and (json.loads((dst / "done.json").read_text())["settings"]
                                         == json.loads((src / "done.json").read_text())["settings"]):
        return True  # adopted before
    parts = ("scorers.safetensors", "model", "head_budgets.json")
    for name in ("done.json", *parts):  # nothing of another retrofit stays beside the adopted one
        if (dst / name).is_dir():
            shutil.rmtree(dst / name)
        elif (dst / name).exists():
            (dst / name).unlink()
    dst.mkdir(parents=True, exist_ok=True)
    for name in parts:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)
        elif (src / name).exists():
            shutil.copy2(src / name, dst / name)
    shutil.copy2(src / "done.json", dst / "done.json")
    return True


def _decode_rows(E, mod, models: dict, s: dict, cfg, out: Path, old: dict | None, stamp: dict,
                 measured: list[dict]) -> list[dict]:
    """The reads of every learned policy of ``models`` by token-by-token decoding beside the prefill's
    (:func:`kvpop.demo.decode_eval.decode_check`) at the middle budget and L_train, on the test sequences (DMS
    at the threshold its row of ``measured`` was chosen on validation); rows kept in ``out/decode.jsonl`` for
    ``--resume``."""
    from kvpop.demo.decode_eval import DECODE_POLICIES, decode_check

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


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: a retrofit in flight checkpointed its last step
        print(f"\nkvpop demo: interrupted; finished parts are kept in {args.out}: run the same command with "
              f"--resume to continue", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)


def _run(args: argparse.Namespace) -> int:
    import torch

    t_start = time.time()
    out = Path(args.out)
    tasks = list(TASKS) if args.task == "all" else [args.task]
    from kvpop.training.runstate import RunLock

    lock = RunLock(out, "kvpop demo")  # one demo per --out: two would overwrite each other's parts
    try:
        check_common(args)
        check_out(args.out)
        lock.acquire()
        torch.set_num_threads(args.threads)
        if args.model is not None and len(tasks) > 1:
            raise ValueError("--model belongs to one task: give --task kvtrace or --task lookahead with it")
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        for task in tasks:  # check every setting before training anything
            from kvpop.demo import evaluate as E

            _base_model_dir(args, task)
            s = _settings(args, task)
            _eval_config(E, s, args)
            for p, c in s["retrofits"].items():
                _retrofit_config(E, s, p, c)
        for task in tasks:
            (_select if args.select else _run_task)(args, task, out / task)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvpop demo: error: {e}", file=sys.stderr)
        return 2
    finally:
        lock.release()
    print(f"[kvpop demo] done in {time.time() - t_start:.0f} s", flush=True)
    return 0
