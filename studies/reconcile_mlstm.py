"""Reconcile the two mean-label kvpop-mlstm figures on the lookahead task.

The label study (``studies.label_study``: kvpop-mlstm on the paper's mean label 0.421 / 0.295)
and the demo (``kvpop demo --task lookahead``, its mean-label kvpop-mlstm 0.995 / 0.941) train the same scorer
on the same label name and disagree.  This driver trains the scorer-only mLSTM under either recipe and under
recipes that differ from one of them by one factor, and scores every run the same way on the same validation
sequences, so the factor that moves the figure shows.

Factors (``FACTORS``; ``DEMO`` and ``STUDY`` are the two recipes):

* ``budget``: the training budget (demo 48 = 4 + 32 + 12, study 64);
* ``source``: whose attention makes the mean label (``KVpopConfig.target_source``): ``student`` (the demo: the
  model's own forward under its sparse mask, normalised by the sparse LSE, ``target_lse="sparse"``) or
  ``teacher`` (the study: the frozen dense model's queries, keys and dense LSE, the exact label);
* ``lse``: the normaliser of the student's label (``KVpopConfig.target_lse``): ``sparse`` (both recipes; unused
  with the teacher's label, which always takes the dense LSE) or ``dense`` (the student's queries and keys over
  the dense LSE: the label source split in two);
* ``decay``: the learned decay's range and start: ``demo`` (``KVpopConfig``'s [0.999, 0.999999] from 0.9999) or
  ``study`` (``decay_range_for_context(512, 8)`` widened around 0.999999, from 0.999999);
* ``optim``: ``demo`` (``kvpop.training.train``'s AdamW, betas 0.9 / 0.95, gradient norm clipped at 1) or
  ``study`` (``label_study.train_scorer``'s Adam, betas 0.9 / 0.999, no clipping), lr 3e-3 both;
* ``seeds``: ``demo`` (initialisation from ``retrofit_seed("kvpop-mlstm", 0)``, training sequences
  ``train_seed(0..999)`` cycled) or ``study`` (``torch.manual_seed(0)``, ``train_seed(1..steps)`` fresh).

Held equal in every run: the mean label, the scorer-only mLSTM (model frozen), sinks 4, window 32, tau 1, one
training sequence of 512 tokens a step, lr 3e-3; validation every 250 steps on the *selection* sequences
(``valid_seed(0..15)``, B = 64, L = 512), the best state kept (of equals the later, ``kvpop.demo.retrofit``'s
rule when this study ran; the earlier since the one tie rule), stop after 3 validations without a better or
equal one, at most ``--max-steps`` (default 750: half the
1,500 steps the demo's own run kept, for the compute of a shared 2-core machine; the label study's mean-label run
kept step 1,000).  The kept state is then scored on the *report* sequences ``valid_seed(16..79)`` (64
sequences, disjoint from the selection ones) at L = 512 and 1,024, B = 64 (the headline) and 48, by the
teacher-forced full-sequence forward of the patched model (``label_study.accuracy``'s path, equal to a
``KVpopCache`` prefill).  Every run goes through ``kvpop.training.train`` (the demo's loop) and the demo's
segmented validation (``kvpop.demo.retrofit._train_validated``); ``--check`` shows that this loop with the
``DEMO`` recipe gives the same scorers as ``kvpop.demo.retrofit.retrofit`` and with the ``STUDY`` recipe those
of ``studies.label_study.train_scorer`` (a few steps each).

::

    python -m studies.reconcile_mlstm --check
    python -m studies.reconcile_mlstm --run L0-demo          # one run of LADDER -> OUT/L0-demo.json
    python -m studies.reconcile_mlstm --summary              # OUT/summary.json from the run files

Results: ``studies/results/reconcile/`` (one JSON per run, ``summary.json``, ``README.md``).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .paths import RESULTS_DIR, ROOT, parse

OUT = RESULTS_DIR / "reconcile"
FACTORS = ("budget", "source", "lse", "decay", "optim", "seeds")
DEMO = {"budget": 48, "source": "student", "lse": "sparse", "decay": "demo", "optim": "demo", "seeds": "demo"}
STUDY = {"budget": 64, "source": "teacher", "lse": "sparse", "decay": "study", "optim": "study", "seeds": "study"}
LADDER = {
    "L0-demo": dict(DEMO),
    "L1-budget64": {**DEMO, "budget": 64},
    "L2-budget64-teacher": {**DEMO, "budget": 64, "source": "teacher"},
    "L2b-budget48-teacher": {**DEMO, "source": "teacher"},
    "L3-budget64-teacher-studydecay": {**DEMO, "budget": 64, "source": "teacher", "decay": "study"},
    "L4-study": dict(STUDY),
    "L2c-budget48-student-denselse": {**DEMO, "lse": "dense"},
    "L5-demo-1500steps": dict(DEMO),
    "L0-demo-seed1": {**DEMO, "seed": 1},
    "L2c-budget48-student-denselse-seed1": {**DEMO, "lse": "dense", "seed": 1},
    "L1-budget64-1500steps": {**DEMO, "budget": 64},
}
"""The one-factor-at-a-time ladder from the demo's recipe to the label study's (each step changes one factor;
L2b changes the label source alone from L0, to see it without the budget; L2c keeps the student's queries and
keys and changes only the label's normaliser to the dense LSE, splitting the label source in two; L5 is L0 run
with ``--max-steps 1500``, the steps the demo's own run kept, and L1-1500steps L1 so; the ``-seed1`` runs repeat
L0 and L2c with ``RetrofitConfig.seed`` 1: another initialisation and other training sequences)."""
SINKS, WINDOW, LENGTH, LR, GAMMA0, SPAN_NATS = 4, 32, 512, 3e-3, 0.999999, 8.0
SELECT = {"seeds": "valid_seed(0..15)", "n": 16, "first": 0, "budget": 64, "length": 512}
REPORT = {"seeds": "valid_seed(16..79)", "n": 64, "first": 16, "budgets": (64, 48), "lengths": (512, 1024)}
EVAL_EVERY, PATIENCE = 250, 3
REFERENCES = {
    "demo": {"source": "kvpop/data/demo_results/lookahead/results.json (kvpop-mlstm rows, demo.retrofit)",
             "recipe": DEMO, "steps_run": 2250, "best_step": 1500,
             "selection": "valid_seed(0..5), mean over B 48/64/128 at L 512, KVpopCache",
             "selection_curve": [[250, 0.636], [500, 0.758], [750, 0.827], [1000, 0.799], [1250, 0.804],
                                 [1500, 0.866], [1750, 0.819], [2000, 0.797], [2250, 0.819]],
             "test": "test_seed(0..5)", "B64_L512": 0.995, "B64_L1024": 0.941},
    "study": {"source": "studies/results/label_study/mlstm_mean.json, test.json, test1024.json",
              "recipe": STUDY, "steps_run": 3000, "best_step": 1000,
              "selection": "valid_seed(0..63), B 64 at L 512, full forward",
              "selection_curve": [[250, 0.327], [500, 0.355], [750, 0.343], [1000, 0.432], [1250, 0.353],
                                  [1500, 0.274], [1750, 0.372], [2000, 0.377], [2250, 0.346], [2500, 0.364],
                                  [2750, 0.345], [3000, 0.301]],
              "test": "test_seed(0..63)", "B64_L512": 0.421, "B64_L1024": 0.295},
}
"""The two figures being reconciled, as their result files record them (validation curves rounded)."""


def kv_config(f: dict[str, Any]):
    """The ``KVpopConfig`` of a run with factors ``f``."""
    from kvpop.core.config import KVpopConfig, decay_range_for_context

    decay: dict[str, float] = {}
    if f["decay"] == "study":  # label_study.train_scorer's range and start
        rng = decay_range_for_context(LENGTH, SPAN_NATS)
        decay = {"gamma_min": min(rng["gamma_min"], 1.0 - 2.0 * (1.0 - GAMMA0)),
                 "gamma_max": max(rng["gamma_max"], 1.0 - 0.5 * (1.0 - GAMMA0)), "gamma_init": GAMMA0}
    return KVpopConfig(sinks=SINKS, window=WINDOW, budget=int(f["budget"]), scorer="mlstm", mask_source="scorer",
                       tau=1.0, target_source=f["source"], target_lse=f.get("lse", "sparse"), label="mean",
                       label_power=1.0, **decay)


def _data(f: dict[str, Any], steps: int) -> list[torch.Tensor]:
    from kvpop.demo import lookahead_task as T

    k = int(f.get("seed", 0)) * 1_000_003  # RetrofitConfig.seed / train_scorer's seed (0 in both recipes)
    if f["seeds"] == "demo":  # kvpop.demo.retrofit._train_data, batch 1
        seeds = [T.train_seed(k + i) for i in range(min(steps, 1000))]
    else:  # label_study.train_scorer, batch 1: step s reads train_seed(k + s)
        seeds = [T.train_seed(k + s) for s in range(1, steps + 1)]
    return [T.make_batch([s], LENGTH)["input_ids"] for s in seeds]


def _train_config(f: dict[str, Any], steps: int, ckpt: Path, rseed: int):
    from kvpop.training.train import TrainConfig

    optim = {} if f["optim"] == "demo" else {"betas": (0.9, 0.999), "max_grad_norm": None}
    return TrainConfig(steps=steps, lr_scorer=LR, lr_model=1e-4, train_model=False, checkpoint_dir=str(ckpt),
                       checkpoint_every=max(1, min(50, steps // 4)), progress=False, seed=rseed, **optim)


def _seed_of(f: dict[str, Any]) -> int:
    from kvpop.demo.retrofit import retrofit_seed

    seed = int(f.get("seed", 0))
    return retrofit_seed("kvpop-mlstm", seed) if f["seeds"] == "demo" else seed


def build(base, f: dict[str, Any]):
    """A copy of ``base`` patched with the run's scorer, initialised from the run's seed."""
    from kvpop.core.patching import patch
    from kvpop.demo.retrofit import _seeded

    model = copy.deepcopy(base)
    model.eval()
    with _seeded(_seed_of(f), model):
        patch(model, kv_config(f))
    return model


@torch.no_grad()
def accuracy(model, batch: dict, budget: int, chunk: int = 16) -> float:
    """Accuracy at the graded reads of ``batch`` with ``model``'s scorers at ``budget`` (teacher-forced
    full-sequence forward, the label study's path); ``model``'s config is given back."""
    from kvpop.core.patching import patched

    was = model.training
    model.eval()
    correct = graded = 0
    with patched(model, budget=int(budget)):
        ids = batch["input_ids"]
        for i in range(0, ids.shape[0], chunk):
            logits = model(ids[i:i + chunk], use_cache=False).logits
            pos, ans = batch["answer_positions"][i:i + chunk], batch["answers"][i:i + chunk]
            pred = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)
            correct += int((pred == ans).sum())
            graded += int(ans.numel())
    model.train(was)
    return correct / max(1, graded)


def _batch(first: int, n: int, length: int) -> dict:
    from kvpop.demo import lookahead_task as T

    return T.make_batch([T.valid_seed(first + i) for i in range(n)], length)


def _env() -> dict[str, Any]:
    root = ROOT
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # a snapshot of the tree (git archive) names its commit
        commit = os.environ.get("KVPOP_SNAPSHOT_COMMIT")
    return {"commit": commit, "kvpop": str(ROOT / "kvpop"), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "loadavg_start": os.getloadavg()[0]}


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (wall time on a shared machine says little)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return round(ru.ru_utime + ru.ru_stime, 1)


def run_one(name: str, f: dict[str, Any], max_steps: int, out: Path) -> dict[str, Any]:
    """Train run ``name`` (factors ``f``), validate, score on the report sequences; writes ``out/NAME.json``."""
    from kvpop.core.layer import kvpop_layers
    from kvpop.demo.lookahead_task import SHIPPED_MODEL
    from kvpop.demo.retrofit import RetrofitConfig, _train_validated
    from kvpop.evaluation.evaluate import load_base_model

    env = _env()
    t0 = time.time()
    k = int(f.get("seed", 0)) * 1_000_003
    base = load_base_model(SHIPPED_MODEL)
    for p in base.parameters():
        p.requires_grad_(False)
    sel = _batch(SELECT["first"], SELECT["n"], SELECT["length"])
    model = build(base, f)
    data = _data(f, max_steps)
    calls: list[dict] = []

    def validate(m) -> float:
        t = time.time()
        acc = accuracy(m, sel, SELECT["budget"])
        g = torch.cat([layer.gamma().detach() for layer in kvpop_layers(m)])
        calls.append({"valid_accuracy": acc, "gamma_min": float(g.min()), "gamma_max": float(g.max()),
                      "wall_s": round(time.time() - t, 1)})
        print(json.dumps({"run": name, **calls[-1]}), flush=True)
        return acc

    with tempfile.TemporaryDirectory(prefix=f"reconcile_{name}_") as tmp:
        ckpt = Path(tmp) / "train.pt"
        ckpt.mkdir()
        tc = _train_config(f, max_steps, ckpt, _seed_of(f))
        rc = RetrofitConfig(steps=max_steps, length=LENGTH, budget=int(f["budget"]), sinks=SINKS, window=WINDOW,
                            lr_scorer=LR, eval_every=EVAL_EVERY, patience=PATIENCE)
        t1 = time.time()
        hist, record = _train_validated(model, data, tc, None, False, rc, validate, ckpt)
        train_wall = time.time() - t1
    validations = [{**v, **c} for v, c in zip(record["validation"], calls)]
    t2 = time.time()
    report: dict[str, dict[str, float]] = {}
    for L in REPORT["lengths"]:
        batch = _batch(REPORT["first"], REPORT["n"], L)
        report[str(L)] = {str(b): accuracy(model, batch, b, chunk=16 if L <= 512 else 8) for b in REPORT["budgets"]}
        print(json.dumps({"run": name, "length": L, **report[str(L)]}), flush=True)
    res = {
        "run": name, "factors": f,
        "differs_from_demo": [k for k in FACTORS if f.get(k, "sparse") != DEMO[k]],
        "differs_from_study": [k for k in FACTORS if f.get(k, "sparse") != STUDY[k]],
        "command": "nice -n 10 python -m studies.reconcile_mlstm " + " ".join(sys.argv[1:]),
        "kvpop_config": kv_config(f).to_dict(),
        "train": {"max_steps": max_steps, "eval_every": EVAL_EVERY, "patience": PATIENCE, "lr": LR,
                  "steps_run": record["validation"][-1]["step"], "best_step": record["best_step"],
                  "seed": _seed_of(f), "data": (f"train_seed({k}..{k + min(max_steps, 1000) - 1}) cycled"
                                                if f["seeds"] == "demo" else f"train_seed({k + 1}..{k + max_steps})"),
                  "optimizer": ("AdamW betas (0.9, 0.95), clip 1.0" if f["optim"] == "demo"
                                else "AdamW (= Adam, weight decay 0) betas (0.9, 0.999), no clipping"),
                  "last_loss": hist[-1]["score"] if hist else None},
        "selection": {**SELECT, "best": record["best_score"], "validations": validations},
        "report": {"sequences": REPORT["seeds"], "n": REPORT["n"], "accuracy": report,
                   "headline": {"B64_L512": report["512"]["64"], "B64_L1024": report["1024"]["64"]}},
        "wall_s": {"train_with_selection": round(train_wall, 1), "report": round(time.time() - t2, 1),
                   "total": round(time.time() - t0, 1)},
        "cpu_s": _cpu_s(),
        "env": {**env, "loadavg_end": os.getloadavg()[0]},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def check(steps: int = 8) -> dict[str, Any]:
    """This loop against the two code paths it stands for, ``steps`` steps each, no validation: the largest
    absolute difference of any scorer tensor (0.0: the same run)."""
    from kvpop.core.checkpoint import load_scorers
    from kvpop.core.layer import kvpop_layers
    from kvpop.core.patching import patch
    from kvpop.demo import lookahead_task as T
    from kvpop.demo.retrofit import RetrofitConfig, retrofit
    from kvpop.evaluation.evaluate import load_base_model
    from kvpop.training.train import train
    from studies import label_study as LS

    base = load_base_model(T.SHIPPED_MODEL)
    for p in base.parameters():
        p.requires_grad_(False)

    def scorer_state(m) -> dict[str, torch.Tensor]:
        return {f"{i}.{k}": v for i, layer in enumerate(kvpop_layers(m)) for k, v in layer.state_dict().items()}

    def ours(f: dict[str, Any]):
        m = build(base, f)
        with tempfile.TemporaryDirectory() as tmp:
            train(m, _data(f, steps), _train_config(f, steps, Path(tmp), _seed_of(f)))
        return scorer_state(m)

    def diff(a: dict, b: dict) -> float:
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)

    out: dict[str, Any] = {"steps": steps}
    with tempfile.TemporaryDirectory() as tmp:  # the demo's retrofit at the demo's recipe
        rc = RetrofitConfig(steps=steps, length=LENGTH, budget=DEMO["budget"], sinks=SINKS, window=WINDOW,
                            lr_scorer=LR, tau=1.0, target_source="student", label="mean", label_power=1.0,
                            checkpoint_every=max(1, min(50, steps // 4)))
        d = retrofit(base, "kvpop-mlstm", Path(tmp) / "r", rc, resume=False, progress=False, task=T)
        m = copy.deepcopy(base)
        patch(m, kv_config(DEMO))
        load_scorers(m, d / "scorers.safetensors")
        out["demo_retrofit_vs_this_loop_max_abs_diff"] = diff(scorer_state(m), ours(DEMO))
    tiny = _batch(0, 2, LENGTH)
    r = LS.train_scorer(base, "mlstm", label="mean", power=1.0, gamma=GAMMA0, budget=STUDY["budget"], valid=tiny,
                        steps=steps, eval_every=steps, patience=100, lr=LR, span_nats=SPAN_NATS, batch=1, seed=0)
    out["label_study_vs_this_loop_max_abs_diff"] = diff(scorer_state(r["model"]), ours(STUDY))
    print(json.dumps(out), flush=True)
    return out


def summary(out: Path) -> dict[str, Any]:
    """``out/summary.json`` from the run files of :data:`LADDER` found in ``out``."""
    rows, not_run, commits = [], [], set()
    for name in LADDER:
        f = out / f"{name}.json"
        if not f.exists():
            not_run.append(name)
            continue
        r = json.loads(f.read_text())
        commits.add(r["env"]["commit"])
        rows.append({"run": name, "factors": {"lse": "sparse", **r["factors"]},
                     "differs_from_demo": r["differs_from_demo"],
                     "best_step": r["train"]["best_step"], "steps_run": r["train"]["steps_run"],
                     "selection_best": r["selection"]["best"],
                     "selection_curve": [(v["step"], v["score"]) for v in r["selection"]["validations"]],
                     "report": r["report"]["accuracy"], "train_wall_s": r["wall_s"]["train_with_selection"],
                     "total_wall_s": r["wall_s"]["total"], "cpu_s": r.get("cpu_s")})
    extra = {}
    chk = out / "check.json"
    if chk.exists():
        extra["check"] = json.loads(chk.read_text())
    s = {"what": "one-factor-at-a-time ladder between the demo's and the label study's mean-label "
                 "kvpop-mlstm on the lookahead task",
         "demo_recipe": DEMO, "study_recipe": STUDY, "selection": SELECT,
         "report_sequences": {k: v for k, v in REPORT.items()}, "rows": rows, "not_run": not_run,
         "commits": sorted(c for c in commits if c),
         "total_wall_s": round(sum(r["total_wall_s"] for r in rows), 1),
         "total_cpu_s": round(sum(r["cpu_s"] or 0.0 for r in rows), 1), "references": REFERENCES, **extra}
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.reconcile_mlstm", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--run", choices=sorted(LADDER), help="train and score one run of LADDER")
    g.add_argument("--check", action="store_true", help="this loop against the demo's and the study's code paths")
    g.add_argument("--summary", action="store_true", help="write OUT/summary.json from the run files")
    p.add_argument("--max-steps", type=int, default=750)
    p.add_argument("--check-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(OUT))
    args = parse(p, argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.summary:
        summary(out)
    elif args.check:
        t0 = time.time()
        res = {**check(args.check_steps), "wall_s": round(time.time() - t0, 1), "env": _env(),
               "command": "nice -n 10 python -m studies.reconcile_mlstm " + " ".join(
                   argv if argv is not None else sys.argv[1:])}
        out.mkdir(parents=True, exist_ok=True)
        (out / "check.json").write_text(json.dumps(res, indent=1) + "\n")
    else:
        run_one(args.run, LADDER[args.run], args.max_steps, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
