"""The real-text instrument's same-structure controls (issue 43 item 1): the slots, eviction rule and fine-tune
of the best KVpop row with a priority that is not learned.

Helpers used by the evidence runner's ``controls`` stage.
"""
from __future__ import annotations

from pathlib import Path


def untrained_run(train_args: list[str], out: Path) -> Path:
    """``out/scorers.safetensors`` (and ``args.json``) of the run ``kvpop train *train_args`` would start from:
    the options checked as ``kvpop train`` checks them, the scorers attached after ``torch.manual_seed(--seed)``
    exactly as ``kvpop train`` attaches them, no step trained (the files' step 0), and ``out/model`` the base
    model's weights unchanged (a joint run's layout: ``kvpop eval --run OUT`` serves it as ``kvpop-mlp-joint``,
    the scorers with their ``priority_source``, on weights equal to the base model's).
    ``train_args`` must not hold ``--out``; ``--method dms`` is refused (its gates are no priority)."""
    import torch

    from kvpop.cli import build_parser
    from kvpop.models import load_model_dir
    from kvpop.training import rundir
    from kvpop.training.methods import KVpopMethod
    from kvpop.training.options import check_options, method_config
    from kvpop.training.train import save_model

    if any(a == "--out" or a.startswith("--out=") for a in train_args):
        raise ValueError(f"untrained_run: give the directory as out, not --out in train_args ({train_args})")
    args = build_parser().parse_args(["train", *train_args, "--out", str(out)])
    if args.method != "kvpop":
        raise ValueError(f"untrained_run: --method {args.method} has no priority to serve untrained; use kvpop")
    if args.model is None:
        raise ValueError("untrained_run: give --model (the base model the scorers are served on)")
    check_options(args)
    cfg = method_config(args)
    model = load_model_dir(args.model, dtype=torch.float32)
    torch.manual_seed(args.seed)  # the scorers' initialisation, as kvpop train seeds it before attaching
    method = KVpopMethod(cfg)
    method.attach(model)
    out.mkdir(parents=True, exist_ok=True)
    rundir.write_args(out, rundir.arg_dict(args))
    path = method.save(model, out, step=0)
    save_model(model, out / "model", step=0)
    return path


def auto_trial(trial_args: Path, seed: int, out: Path, fit_file: Path, *, served: int, patience: int | None = None,
               every: int | None = None) -> dict:
    """One more seed of a ``kvpop train --auto`` trial, trained as the search trains its trials
    (:func:`kvpop.training.auto.search`'s ``validated``): the trial's recorded arguments (``trial_args``, its
    ``args.json``) with ``--seed seed`` and ``--out out``, trained in segments of ``every`` steps (default the
    search's: a quarter of ``--steps``, rounded up), each followed by its fit score (the mean of the per-sequence
    NLL over dense at ``served`` of ``fit_file``'s sequences, scored as the search scores them), stopped after
    ``patience`` (default :data:`kvpop.training.auto.PATIENCE`) validations without a better or equal score; the
    best fit state's served files are ``out``'s (a tie goes to the later state).  Resumable: the validations are
    appended to ``out/validation.jsonl``.  Returns ``{"steps", "best_step", "validations"}``."""
    import argparse
    import json
    import math

    import torch

    from kvpop.cli.auto import _scorer
    from kvpop.cli.train import run as train_run
    from kvpop.training.auto import PATIENCE, early_stopped

    saved = json.loads(Path(trial_args).read_text())
    if not isinstance(saved, dict) or "steps" not in saved:
        raise ValueError(f"{trial_args}: not the args.json of a kvpop train run")
    total = int(json.loads((Path(trial_args).parent / "trial.json").read_text())["steps"]) \
        if (Path(trial_args).parent / "trial.json").exists() else int(saved["steps"])
    every = every or math.ceil(total / 4)
    patience = PATIENCE if patience is None else patience
    seqs = [torch.tensor(json.loads(x)["input_ids"]) for x in Path(fit_file).read_text().splitlines() if x.strip()]
    score = _scorer(Path(saved["model"]), {"fit": seqs}, served)

    from kvpop.core.config import KVpopConfig
    from kvpop.training.options import DMS_ONLY, KVPOP_ONLY

    default = KVpopConfig()
    # args.json records every option filled in; what the search left to its default goes back to "not given"
    # (None), so that kvpop train's checks of the options given see what they saw in the search's own trial
    ungiven = {**{n: None for n in DMS_ONLY}, **{n: None for n in KVPOP_ONLY if n not in ("no_balance",)
                                                 and hasattr(default, n) and saved.get(n) == getattr(default, n)}}

    def train_to(target: int) -> None:
        ns = argparse.Namespace(**{**saved, **ungiven, "seed": seed, "out": str(out), "steps": target,
                                   "resume": (out / "last.pt").exists()})
        ns._auto_trial, ns._progress_total = True, total
        rc = train_run(ns)
        if rc != 0:
            raise RuntimeError(f"kvpop train stopped with exit status {rc} (run again to resume)")

    def fit_score() -> float:
        each = score(out, "fit")
        return sum(each) / len(each)

    best, vals = early_stopped(out, total=total, every=every, patience=patience, train_to=train_to,
                               fit_score=fit_score)
    return {"steps": vals[-1]["step"], "best_step": best["step"], "validations": vals}


# ---------------------------------------------------------------------------------------------------------------
# The stage: untrained controls, the fine-tuned controls' learning rate chosen on validation, their seeds, the
# best KVpop row's seeds, every (row, seed) scored on the validation sequences, the paired intervals.
# ---------------------------------------------------------------------------------------------------------------

SEQ_LEN, SINKS, WINDOW, BUDGET = 1024, 4, 32, 128
EVAL_BUDGETS = (64, 128, 256)
STEPS = 250
VALID_SEQUENCES = 16
SELECT = (0, 1, 3, 10, 11, 12, 13, 15)
FIT = (2, 4, 5, 6, 7, 8, 9, 14)
"""The best KVpop row's selection split of the first 16 validation sequences (``kvpop train --auto``'s record
``auto/realtext_v4/selection.json``): the controls' choices are made on the same select part."""
LR_MODEL = (1e-4, 3e-4, 1e-3)
"""The controls' model learning rates, in order: the default 1e-4, then 3e-4; 1e-3 only when 3e-4 was adopted."""
UNTRAINED = ("random", "keynorm+", "keynorm-", "window-attention", "oracle-label")
KEYNORM = ("keynorm+", "keynorm-")
"""The key-norm sign: keynorm+ the incumbent (the default: a tie keeps it), keynorm- the challenger, chosen on the
untrained runs at the training budget."""
CONTROL_ARGS = {
    "fixed-finetune[streaming]": ["--mask-source", "streaming"],
    "fixed-finetune[random]": ["--priority-source", "random"],
    "fixed-finetune[keynorm]": None,  # the sign chosen on validation (KEYNORM)
    "fixed-finetune[window-attention]": ["--priority-source", "window-attention"],
    "oracle[label]": ["--priority-source", "oracle-label"],
}
"""The fine-tuned controls: ``kvpop train`` options beside :func:`train_args`'s."""
AUTO_ROW = "kvpop-mlp-joint[auto]"
ORACLE, STREAMING_CONTROL = "oracle[label]", "fixed-finetune[streaming]"
"""The exact label as priority after the fine-tune, and the fixed-mask fine-tune: their intervals are the learning
issue's diagnosis (does the label beat the control?)."""
AUTO_TRIALS = 6
"""Trials of the best KVpop row's search (``selection.json``: 2 label oracles, 3 scorer lrs, 1 head-budget; 2
more seeds in its confirmation)."""
AUTO_DIRS = {0: "allocate-ablation_decaynats-none_label-mean_lrscorer-0.001_targetsource-student_trainbudget-none",
             1: "allocate-ablation_decaynats-none_label-mean_lrscorer-0.001_seed-1_targetsource-student_trainbudget-"
                "none"}
"""The search's own trials of the chosen settings (seed 0 and its confirmation's seed 1), under ``AUTO/auto``."""


def train_args(model: Path, data: Path, extra: list[str], lr: float, seed: int) -> list[str]:
    """``kvpop train``'s arguments (no ``--out``) of a control: the best KVpop row's slots (sinks 4, window 32,
    B=128), data and steps, the mean label (what ``oracle-label`` serves), ``extra`` (its priority)."""
    return ["--model", str(model), "--data", str(data), "--seq-len", str(SEQ_LEN), "--sinks", str(SINKS),
            "--window", str(WINDOW), "--checkpoint-every", "25", "--no-progress", "--threads", "1",
            "--budget", str(BUDGET), "--label", "mean", "--lr-scorer", "1e-3", *extra, "--lr-model", f"{lr:g}",
            "--steps", str(STEPS), "--seed", str(seed)]


def eval_args(model: Path, valid: Path, run: str, policies: str, out: Path) -> list[str]:
    """``kvpop eval`` on the first :data:`VALID_SEQUENCES` validation sequences at :data:`EVAL_BUDGETS` (the
    positions >= 256 in every column)."""
    return ["kvpop", "eval", "--model", str(model), "--data", str(valid), "--seq-len", str(SEQ_LEN),
            "--budgets", ",".join(map(str, EVAL_BUDGETS)), "--sinks", str(SINKS), "--window", str(WINDOW),
            "--n-sequences", str(VALID_SEQUENCES), "--no-plot", "--no-progress", "--threads", "1", *run.split("\0"),
            "--policies", policies, "--out", str(out)]


def per_sequence(results: dict, policy: str) -> dict[int, list[float]]:
    """``{budget: each sequence's delta NLL}`` of ``policy`` in a ``kvpop eval --data`` ``results.json``;
    ValueError naming the policy when its rows are missing or a sequence was not scored."""
    out = {}
    for b in EVAL_BUDGETS:
        row = next((r for r in results["rows"] if r["policy"] == policy and r["budget"] == b), None)
        if row is None or row.get("per_sequence") is None:
            raise ValueError(f"no per-sequence row of {policy} at B={b} in the results "
                             f"(policies: {sorted({r['policy'] for r in results['rows']})})")
        if any(x is None for x in row["per_sequence"]):
            raise ValueError(f"{policy} at B={b}: a sequence was not scored")
        out[b] = [float(x) for x in row["per_sequence"]]
    return out


def clusters_of(valid: Path, n: int = VALID_SEQUENCES) -> list[int]:
    """The source file of each of the first ``n`` records of a corpus split, as an index: a record that starts
    with the BOS token (256) is its file's first (``realtext_corpus.file_records``), the others continue the
    file before them.  ValueError when the first record does not start a file."""
    import json

    ids, k = [], -1
    for i, line in enumerate(Path(valid).read_text().splitlines()[:n]):
        first = json.loads(line)["input_ids"][0]
        if first == 256:
            k += 1
        elif i == 0:
            raise ValueError(f"{valid}: its first record does not start with BOS (256): not a corpus split")
        ids.append(k)
    return ids


def same_weights_eval(run: Path, valid: Path, out: Path, *, n: int = VALID_SEQUENCES, budgets=EVAL_BUDGETS,
                      seq_len: int = SEQ_LEN) -> dict:
    """``out/results.json`` of the run in ``run`` served as ``kvpop eval --data valid --run run`` serves it, but
    against the run's own weights served densely (``run/model`` as the dense row) instead of the base model
    (``kvpop eval`` refuses a ``--model`` other than the run's base, as the comparison with its dense row would
    mix two models: here that is the point, issue 43 item 5).  The same code scores it (``policy_models``,
    ``evaluate_traces``, ``trace_results``) on the first ``n`` records cut at ``seq_len``; returns the
    results."""
    import json
    import time

    import torch

    from kvpop.cli.trained import policy_models, read_run
    from kvpop.evaluation import evaluate as E
    from kvpop.evaluation import trace_eval as TE
    from kvpop.training import data as data_io

    from .ledger import write_json

    t0 = time.time()
    t = read_run(str(run))
    if t.model is None:
        raise ValueError(f"{run}: no model/ to serve densely (an untrained or scorer-only run is the base model)")
    base = TE.load_model(t.model)
    records = data_io.read_jsonl(str(valid), vocab_size=base.config.vocab_size)
    traces = data_io.chunk(records, seq_len, source=f"--data {valid}")[:n]  # as kvpop eval --seq-len cuts them
    cfg = TE.TraceEvalConfig(budgets=list(budgets), sinks=t.config.sinks if t.config else SINKS,
                             window=t.config.window if t.config else WINDOW, policies=["dense", t.policy],
                             progress=False)
    lengths = [int(x.numel()) for x in traces]
    cfg.resolve(lengths)
    models = policy_models(E, base, cfg.policies, [t.policy], {t.policy: t}, sinks=cfg.sinks, window=cfg.window,
                           budget=cfg.budgets[0], load=TE.load_model, budgets=cfg.budgets)
    rows = TE.evaluate_traces(models, traces, cfg)
    res = TE.trace_results(rows, cfg, lengths=lengths, extra={
        "model": str(t.model), "data": str(valid), "seq_len": seq_len, "run": str(run),
        "reference": "the run's own weights served densely", "threads": torch.get_num_threads(),
        "eval_seconds": round(time.time() - t0, 1)})
    write_json(Path(out) / "results.json", json.loads(json.dumps(res)))
    return res


def pick(values: list[float], idx=SELECT) -> list[float]:
    return [values[i] for i in idx]


def lr_choice(trials: list[dict], *, stage: str) -> tuple[dict, list[dict], bool]:
    """:func:`kvpop.training.search.prefer` over ``trials`` (in :data:`LR_MODEL` order, each with
    ``per_sequence`` on the select part): the chosen trial, the decisions, and whether another (larger) rate is
    to be tried (the last trial was adopted)."""
    from kvpop.training.search import prefer

    best, decisions = trials[0], []
    adopted = False
    for t in trials[1:]:
        d = prefer(best, t, higher_is_better=False, stage=stage)
        decisions.append(d)
        adopted = d["adopted"]
        if adopted:
            best = t
    return best, decisions, adopted and len(trials) < len(LR_MODEL)


def figures(runs: dict, *, select=SELECT) -> list[dict]:
    """One row per (row, budget): the per-seed means over the 16 sequences against the original dense model and
    against the same weights served densely, their mean, and the dense shift (the row's weights served densely
    minus the original's)."""
    out = []
    for name, seeds in runs.items():
        for b in EVAL_BUDGETS:
            vo = {s: sum(r["vs_original"][str(b)]) / VALID_SEQUENCES for s, r in seeds.items()}
            vs = {s: sum(r["vs_same_weights"][str(b)]) / VALID_SEQUENCES for s, r in seeds.items()}
            sh = {s: sum(r["dense_shift"]) / VALID_SEQUENCES for s, r in seeds.items()}
            out.append({"row": name, "budget": b, "seeds": sorted(seeds, key=int), "vs_original": vo,
                        "vs_original_mean": sum(vo.values()) / len(vo),
                        "vs_same_weights": vs, "vs_same_weights_mean": sum(vs.values()) / len(vs),
                        "dense_shift_mean": sum(sh.values()) / len(sh)})
    return out


def comparisons(runs: dict, a: str, clusters: list[int] | None, *, against=None, n_boot: int = 10_000) -> list[dict]:
    """The paired intervals of row ``a`` against every other row of ``runs`` (or those of ``against``) at every
    budget, on all 16 validation sequences, clustered by source file, over the seeds each row has; both against
    the original dense model (``reference``: "original") and against each row's own weights served densely
    ("same weights")."""
    from .paired import comparison

    out = []
    for b in EVAL_BUDGETS:
        for other in runs:
            if other == a or (against is not None and other not in against):
                continue
            for ref, key in (("original", "vs_original"), ("same weights", "vs_same_weights")):
                va = [runs[a][s][key][str(b)] for s in sorted(runs[a], key=int)]
                vb = [runs[other][s][key][str(b)] for s in sorted(runs[other], key=int)]
                c = comparison(instrument="realtext", budget=b, a=a, b=other, values_a=va, values_b=vb,
                               lower_is_better=True, clusters=clusters, n_boot=n_boot)
                out.append({**c, "reference": ref, "split": "validation (the 16 sequences the selections used: "
                                                            "not a test)"})
    return out


LR_TAG = {1e-4: "1e-4", 3e-4: "3e-4", 1e-3: "1e-3"}


class Stage:
    """The ``controls`` stage's runs under ``out`` (every command resumable: a finished run or evaluation is
    never redone).  Layout: ``untrained/<source>/seed0``, ``controls/<row>/lr<lr>/seed<s>``,
    ``controls/kvpop-mlp-joint[auto]/seed2``, ``evals/...``; the record ``controls.json``."""

    def __init__(self, out: Path, *, model: Path, data: Path, valid: Path, auto: Path, train: bool = True):
        self.out, self.model, self.data, self.valid, self.auto = Path(out), Path(model), Path(data), Path(valid), \
            Path(auto)
        self.log = self.out / "commands.log"
        self.train = train
        self.commands: list[str] = []
        self.missing: list[str] = []

    def _run(self, cmd: list[str], name: str) -> None:
        from .ledger import run_logged

        self.commands.append(" ".join(cmd))
        if self.train:
            run_logged(cmd, self.log, name=name)

    def _results(self, o: Path, cmd: list[str], name: str) -> dict | None:
        import json

        if not (o / "results.json").exists():
            self._run(cmd, name)
        else:
            self.commands.append(" ".join(cmd))
        if not (o / "results.json").exists():
            self.missing.append(name)
            return None
        return json.loads((o / "results.json").read_text())

    # 1. untrained -------------------------------------------------------------------------------------------
    def untrained(self) -> dict:
        for src in UNTRAINED:
            d = self.out / "untrained" / src / "seed0"
            targs = train_args(self.model, self.data, ["--priority-source", src], 1e-4, 0)
            self.commands.append(f"untrained_run({' '.join(targs)}, out={d})")
            if not (d / "model").exists():
                untrained_run(targs, d)
        u = self.out / "untrained"

        def runs(srcs):
            return "\0".join(f"--run\0kvpop-mlp-joint[{s}]={u / s / 'seed0'}" for s in srcs)

        k = self._results(self.out / "evals" / "untrained_keynorm", eval_args(
            self.model, self.valid, runs(KEYNORM), "dense,streaming," + ",".join(
                f"kvpop-mlp-joint[{s}]" for s in KEYNORM), self.out / "evals" / "untrained_keynorm"),
            "untrained keynorm")
        others = [s for s in UNTRAINED if s not in KEYNORM]
        o = self._results(self.out / "evals" / "untrained_other", eval_args(
            self.model, self.valid, runs(others), "dense," + ",".join(f"kvpop-mlp-joint[{s}]" for s in others),
            self.out / "evals" / "untrained_other"), "untrained others")
        rows = {}
        if k is not None:
            rows["streaming"] = per_sequence(k, "streaming")
            for s in KEYNORM:
                rows[s] = per_sequence(k, f"kvpop-mlp-joint[{s}]")
        if o is not None:
            for s in others:
                rows[s] = per_sequence(o, f"kvpop-mlp-joint[{s}]")
        sign = None
        if all(s in rows for s in KEYNORM):
            from kvpop.training.search import prefer

            sign = prefer({"settings": KEYNORM[0], "per_sequence": pick(rows[KEYNORM[0]][BUDGET])},
                          {"settings": KEYNORM[1], "per_sequence": pick(rows[KEYNORM[1]][BUDGET])},
                          higher_is_better=False, stage=f"keynorm sign (untrained, B={BUDGET}, select part)")
        return {"per_sequence": rows, "keynorm_sign": sign,
                "keynorm_chosen": None if sign is None else KEYNORM[1] if sign["adopted"] else KEYNORM[0]}

    # 2-3. the fine-tuned controls -----------------------------------------------------------------------------
    def _evals(self, tag: str, d: Path, policy: str) -> dict | None:
        o = self.out / "evals" / tag
        base = self._results(o / "base", eval_args(self.model, self.valid, f"--run\0{d}", f"dense,{policy}",
                                                   o / "base"), f"eval {tag} base")
        same = None
        self.commands.append(f"same_weights_eval({d}, {self.valid}, {o / 'self'})")
        if not (o / "self" / "results.json").exists() and self.train:
            same_weights_eval(d, self.valid, o / "self")
        if (o / "self" / "results.json").exists():
            import json

            same = json.loads((o / "self" / "results.json").read_text())
        else:
            self.missing.append(f"eval {tag} self")
        if base is None or same is None:
            return None
        vo, vs = per_sequence(base, policy), per_sequence(same, policy)
        shift = [x - y for x, y in zip(vo[BUDGET], vs[BUDGET])]
        return {"dir": str(d), "vs_original": {str(b): v for b, v in vo.items()},
                "vs_same_weights": {str(b): v for b, v in vs.items()}, "dense_shift": shift,
                "dense_nll_original": next(r["dense_nll"] for r in base["rows"] if "dense_nll" in r),
                "dense_nll_same_weights": next(r["dense_nll"] for r in same["rows"] if "dense_nll" in r)}

    def control(self, row: str, extra: list[str], lr: float, seed: int) -> dict | None:
        d = self.out / "controls" / row / f"lr{LR_TAG[lr]}" / f"seed{seed}"
        if (d / "done").exists():  # recorded, not rerun
            self.commands.append(" ".join(["kvpop", "train", *train_args(self.model, self.data, extra, lr, seed),
                                           "--out", str(d)]))
        else:
            cmd = ["kvpop", "train", *train_args(self.model, self.data, extra, lr, seed), "--out", str(d),
                   *(["--resume"] if (d / "last.pt").exists() else [])]
            self._run(cmd, f"{row} lr {LR_TAG[lr]} seed {seed}")
            if self.train:
                (d / "done").write_text("")
            elif not (d / "done").exists():
                self.missing.append(f"{row} lr {LR_TAG[lr]} seed {seed} (not trained)")
                return None
        policy = "fixed-finetune" if "--mask-source" in extra else "kvpop-mlp-joint"
        r = self._evals(f"{row}/lr{LR_TAG[lr]}/seed{seed}", d, policy)
        args = " ".join(train_args(self.model, self.data, extra, lr, seed))
        return None if r is None else {**r, "lr_model": lr, "seed": seed, "command": f"kvpop train {args} --out {d}"}

    def choose_lr(self, row: str, extra: list[str]) -> dict:
        trials, decisions = [], []
        for lr in LR_MODEL:
            r = self.control(row, extra, lr, 0)
            if r is None:
                break
            trials.append({"settings": {"lr_model": lr}, "per_sequence": pick(r["vs_original"][str(BUDGET)]),
                           "score": sum(pick(r["vs_original"][str(BUDGET)])) / len(SELECT), "run": r})
            best, decisions, more = lr_choice(trials, stage=f"{row} lr_model")
            if len(trials) >= 2 and not more:
                break
        done = len(trials) >= 2 and not lr_choice(trials, stage="")[2]
        best = lr_choice(trials, stage="")[0] if trials else None
        return {"trials": [{k: v for k, v in t.items() if k != "run"} for t in trials], "decisions": decisions,
                "chosen": None if best is None or not done else best["settings"]["lr_model"], "complete": done,
                "runs": {LR_TAG[t["settings"]["lr_model"]]: t["run"] for t in trials}}

    # the best KVpop row ---------------------------------------------------------------------------------------
    def auto_row(self, seeds) -> dict:
        out = {}
        for s in seeds:
            if s in AUTO_DIRS:
                d = self.auto / "auto" / AUTO_DIRS[s]
            else:
                d = self.out / "controls" / AUTO_ROW / f"seed{s}"
                self.commands.append(f"auto_trial({self.auto / 'auto' / AUTO_DIRS[0] / 'args.json'}, seed={s}, "
                                     f"out={d}, fit={self.auto / 'auto' / 'fit.jsonl'}, served={BUDGET})")
                if not (d / "trial_ev43.json").exists():
                    if not self.train:
                        self.missing.append(f"{AUTO_ROW} seed {s} (not trained)")
                        continue
                    import json

                    r = auto_trial(self.auto / "auto" / AUTO_DIRS[0] / "args.json", s, d,
                                   self.auto / "auto" / "fit.jsonl", served=BUDGET)
                    (d / "trial_ev43.json").write_text(json.dumps(r, indent=1))
            r = self._evals(f"{AUTO_ROW}/seed{s}", d, "kvpop-mlp-joint")
            if r is not None:
                import json

                t = d / ("trial.json" if s in AUTO_DIRS else "trial_ev43.json")
                trial = json.loads(t.read_text()) if t.exists() else {}
                out[s] = {**r, "best_step": trial.get("best_step"), "validations": trial.get("validations"),
                          "trained_by": "kvpop train --auto's search (its trial)" if s in AUTO_DIRS else
                          "auto_trial: the search's trial procedure, another seed"}
        return out


def run_stage(out: Path, *, model: Path, data: Path, valid: Path, auto: Path, seeds=(0, 1, 2), jobs: int = 2,
              train: bool = True) -> dict:
    """The ``controls`` stage (module docstring): runs or resumes every command (``train`` false: none, the record
    of what exists, the rest named in ``missing``), then writes ``out/controls.json``."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from .ledger import write_json

    st = Stage(out, model=model, data=data, valid=valid, auto=auto, train=train)
    un = st.untrained()
    args = dict(CONTROL_ARGS)
    if un["keynorm_chosen"] is None:
        args.pop("fixed-finetune[keynorm]")
        st.missing.append("fixed-finetune[keynorm] (its sign is not chosen yet)")
    else:
        args["fixed-finetune[keynorm]"] = ["--priority-source", un["keynorm_chosen"]]

    def row(name: str) -> tuple[dict, dict]:
        sel = st.choose_lr(name, args[name])
        runs = {}
        if sel["chosen"] is not None:
            for s in seeds:
                r = sel["runs"].get(LR_TAG[sel["chosen"]]) if s == 0 else st.control(name, args[name], sel["chosen"], s)
                if r is not None:
                    runs[str(s)] = r
        return sel, runs

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        auto_f = pool.submit(st.auto_row, seeds)
        done = dict(zip(args, pool.map(row, args)))
        auto_runs = auto_f.result()
    runs: dict[str, dict] = {AUTO_ROW: {str(s): r for s, r in auto_runs.items()}}
    for name, (_, rs) in done.items():
        if rs:
            runs[name] = rs
    for src, each in un["per_sequence"].items():  # the untrained rows: the base weights, one evaluation each
        name = "streaming" if src == "streaming" else f"untrained[{src}]"
        runs[name] = {"0": {"vs_original": {str(b): v for b, v in each.items()},
                            "vs_same_weights": {str(b): v for b, v in each.items()},
                            "dense_shift": [0.0] * VALID_SEQUENCES}}
    runs = {k: v for k, v in runs.items() if v}  # a row with no scored seed yet: named in "missing"
    clusters = clusters_of(valid)
    record = {
        "instrument": "realtext", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "split": {"of": f"the first {VALID_SEQUENCES} sequences of {valid.name} (validation: the selections below "
                        f"used them; not a test)", "fit": list(FIT), "select": list(SELECT),
                  "clusters": clusters, "clusters_rule": clusters_of.__doc__.split(":")[0]},
        "settings": {"seq_len": SEQ_LEN, "sinks": SINKS, "window": WINDOW, "trained_at": BUDGET,
                     "served_at": list(EVAL_BUDGETS), "steps": STEPS, "scored_from": max(EVAL_BUDGETS),
                     "metric": "NLL increase over dense (nats/token), lower is better"},
        "rule": "kvpop.training.search.prefer (2 paired standard errors on the 8 select sequences at B=128; a tie "
                "keeps the incumbent: keynorm+ for the sign, lr 1e-4 for the model lr)",
        "trials_of": {AUTO_ROW: AUTO_TRIALS, **{n: len(sel["trials"]) for n, (sel, _) in done.items()}},
        "untrained": {"keynorm_sign": un["keynorm_sign"], "keynorm_chosen": un["keynorm_chosen"]},
        "lr_selection": {n: {k: v for k, v in sel.items() if k != "runs"} for n, (sel, _) in done.items()},
        "runs": runs,
        "figures": figures(runs),
        "comparisons": comparisons(runs, AUTO_ROW, clusters) if runs.get(AUTO_ROW) else [],
        "oracle_against_control": comparisons(runs, ORACLE, clusters, against=(STREAMING_CONTROL,))
        if runs.get(ORACLE) and runs.get(STREAMING_CONTROL) else [],
        "commands": st.commands, "missing": st.missing,
    }
    write_json(Path(out) / "controls.json", record)
    return record


def markdown(record: dict) -> str:
    """The record's tables for evidence.md: every row's figures, the selection decisions and the paired
    intervals (generated from ``controls.json``, never typed)."""
    figs = record["figures"]
    rows = list(dict.fromkeys(f["row"] for f in figs))
    sel = record["lr_selection"]

    def fig(row, b):
        return next(f for f in figs if f["row"] == row and f["budget"] == b)

    out = ["| row | trials | lr | seeds | " + " | ".join(f"B={b}" for b in EVAL_BUDGETS)
           + f" | B={BUDGET} vs same weights | dense shift |", "|---" * (6 + len(EVAL_BUDGETS)) + "|"]
    for r in rows:
        cells = []
        for b in EVAL_BUDGETS:
            f = fig(r, b)
            v = list(f["vs_original"].values())
            cells.append(f"{f['vs_original_mean']:+.4f}" + (f" ({min(v):+.4f}..{max(v):+.4f})" if len(v) > 1 else ""))
        f = fig(r, BUDGET)
        trials = record["trials_of"].get(r, 0 if r == "streaming" or r.startswith("untrained") else "")
        lr = (LR_TAG.get(sel[r]["chosen"], f"{sel[r]['chosen']:g}") if sel[r]["chosen"] else "not chosen") \
            if r in sel else \
            ("1e-4" if r == AUTO_ROW else "-")
        out.append(f"| {r} | {trials} | {lr} | {len(f['seeds'])} | " + " | ".join(cells)
                   + f" | {f['vs_same_weights_mean']:+.4f} | {f['dense_shift_mean']:+.4f} |")
    out += ["", "| decision | incumbent | challenger | mean_diff | SE | adopted |", "|---|---|---|---|---|---|"]
    decisions = [record["untrained"]["keynorm_sign"]] if record["untrained"].get("keynorm_sign") else []
    for s in sel.values():
        decisions += s["decisions"]
    for d in decisions:
        out.append(f"| {d['stage']} | {d['incumbent']} | {d['challenger']} | {d['mean_diff']:+.4f} | "
                   f"{d['se']:.4f} | {'yes' if d['adopted'] else 'no'} |")
    out += ["", "| budget | reference | a | b | mean_diff (a - b) | 95 % interval | seeds a / b | verdict |",
            "|---|---|---|---|---|---|---|---|"]
    for c in [*record["comparisons"], *record.get("oracle_against_control", [])]:
        out.append(f"| {c['budget']} | {c['reference']} | {c['a']} | {c['b']} | {c['mean_diff']:+.4f} | "
                   f"[{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}] | {c['seeds_a']} / {c['seeds_b']} | {c['verdict']} |")
    return "\n".join(out) + "\n"
