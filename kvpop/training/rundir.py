"""The run directory of ``kvpop train`` (``--out DIR``): what is checked before a run starts or resumes, and the
record of its arguments.

What ``--out DIR`` receives: ``last.pt`` (the full training state, written atomically every
``--checkpoint-every`` steps and at the end), ``scorers.safetensors`` (``kvpop.save_scorers``; load with
``kvpop.load_scorers``), ``model/`` (the fine-tuned model, ``save_pretrained`` without the scorer
tensors; not with ``--no-train-model``), with ``--method dms`` ``gates.safetensors`` instead of the scorers
(``kvpop.baselines.dms.load_dms``), ``args.json`` (the arguments) and ``history.jsonl`` (one line
of losses per step, appended as each step finishes).  The scorers (or gates) and ``model/`` are stamped with
the step of their weights (the file's ``step`` metadata, ``model/kvpop_step.json``;
:func:`kvpop.training.runstate.output_step`); a ``--resume`` with no step left writes both anew from
``last.pt`` (a crash between the writes leaves outputs of two steps).  Head-adaptive budgets (docs/DESIGN.md section 7):
``--head-budgets FILE.json`` trains with the given per-layer, per-KV-head budgets, ``--allocate ablation``
chooses them before training from each head's importance on validation sequences (``--valid-data``,
with ``--task`` the task's own), and both write ``head_budgets.json`` (the rows, and the importance that
``kvpop eval`` shares another budget by).  ``--resume`` continues from ``last.pt`` exactly (a
resumed run repeats the steps of an uninterrupted one, and its ``history.jsonl`` is the uninterrupted
run's); every argument but ``--steps``, ``--checkpoint-every``, ``--no-progress``, ``--device`` and the
spelling of ``--out`` must be the same as in the first run (checked against ``args.json``; file paths
are compared resolved).  SIGINT or SIGTERM (Ctrl-C, a scheduler's stop) ends the run after the step in
flight with a checkpoint of it (a second signal aborts at once); the exit status is then 128 + the
signal number.

* :func:`check_outputs`: nothing in the way of what the run writes; :func:`check_model`: the model directory.
* ``args.json`` (:func:`write_args`): the run's arguments, file paths resolved (:func:`comparable`); a
  ``--resume`` must give the same ones (:func:`check_resume_args`) but for :data:`RESUMABLE`.
  ``head_budgets.json`` (:func:`write_head_budgets`): the per-head budgets the run trains with.
* :func:`data_print`, :func:`model_print`: the data file's and the model directory's fingerprints
  (:func:`kvpop.training.data.data_fingerprint`), kept in the checkpoint, so that a resume after either was
  edited in place is refused (:func:`mismatch_message` names the option or file).
* :func:`closing_report`: the run's last line, and with DMS a warning when its keep fraction missed its target
  (:func:`keep_miss`).

Every refusal is a ``ValueError`` naming the option or file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpop.core.files import atomic_write

from .data import data_fingerprint, model_fingerprint

__all__ = ["RESUMABLE", "PATHS", "arg_dict", "comparable", "check_outputs", "check_model", "check_resume_args",
           "write_args", "write_head_budgets", "data_print", "model_print", "mismatch_message", "KEEP_MARGIN",
           "KEEP_STEPS", "keep_miss", "closing_report"]

RESUMABLE = {"steps", "checkpoint_every", "no_progress", "resume", "out", "device", "threads"}
"""Arguments that may change between a run and its ``--resume`` (``--out`` is where the run is)."""
PATHS = ("data", "model", "head_budgets", "valid_data", "init_scorers")
"""Arguments that name files: compared resolved."""

KEEP_MARGIN = 0.25
"""A DMS run warns when the mean keep fraction of its last :data:`KEEP_STEPS` steps is further than this
fraction of the target from the target (e.g. outside 0.094-0.156 for --target-keep 0.125)."""
KEEP_STEPS = 10


def arg_dict(args: Any) -> dict:
    """The arguments of a parsed command line that the run records (not the command, not ``_``-names)."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}


def comparable(d: dict) -> dict:
    """The arguments with file paths resolved (``./data.jsonl``, ``data.jsonl`` and its absolute path agree)."""
    return {k: (str(Path(v).resolve()) if k in PATHS and isinstance(v, str) else v) for k, v in d.items()}


def check_outputs(out: Path, *, layer_file: str, train_model: bool) -> None:
    """Nothing in the way of what the run writes (a file where the model folder goes, a folder where a file goes);
    ``layer_file``: the method's scorer or gate file."""
    for name in ["last.pt", "history.jsonl", "args.json", "head_budgets.json", layer_file]:
        if (out / name).is_dir():
            raise ValueError(f"--out {out}: {out / name} is a directory, where the run writes a file; move it away")
    model = out / "model"
    if train_model and model.exists() and not model.is_dir():
        raise ValueError(f"--out {out}: {model} exists and is not a directory, where the fine-tuned model goes; move "
                         f"it away (or train with --no-train-model)")


def check_model(model_dir: str) -> None:
    """The ``--model`` directory checked before any work (:func:`kvpop.models.check_model_dir`: the family, the
    config and the weight files' headers)."""
    from kvpop.models import check_model_dir

    try:
        check_model_dir(model_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model_dir}: {e}") from None


def check_resume_args(out: Path, args: dict) -> None:
    """A ``--resume`` of the run in ``out`` with the arguments ``args`` (:func:`arg_dict`): ``last.pt`` must be
    there, and every argument but :data:`RESUMABLE` the one ``args.json`` recorded (none recorded: not compared)."""
    saved_path = out / "args.json"
    if not (out / "last.pt").exists():
        raise ValueError(f"--resume: {out / 'last.pt'} does not exist (nothing to resume; drop --resume to start)")
    if not saved_path.exists():
        return
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"--resume: cannot read {saved_path} ({type(e).__name__}: {str(e)[:200]}); it records the "
                         f"first run's arguments: restore it, or delete it to resume without the comparison") from None
    if not isinstance(saved, dict):
        raise ValueError(f"--resume: {saved_path} holds a JSON {type(saved).__name__}, not the arguments of a run")
    saved = comparable(saved)
    now = comparable(args)
    diff = [k for k in sorted(set(saved) | set(now)) if k not in RESUMABLE and saved.get(k) != now.get(k)]
    if diff:
        raise ValueError("--resume needs the arguments of the first run; these differ: "
                         + ", ".join(f"--{k.replace('_', '-')} (was {saved.get(k)!r}, now {now.get(k)!r})"
                                     for k in diff))


def write_args(out: Path, args: dict) -> None:
    """``out/args.json``: the arguments (:func:`arg_dict`), paths resolved, ``out`` absolute (atomically)."""
    saved = {**comparable(args), "out": str(out.resolve())}
    text = json.dumps(saved, indent=2, sort_keys=True) + "\n"
    atomic_write(out / "args.json", lambda f: f.write(text), binary=False)


def write_head_budgets(out: Path, rows: Any, doc: dict) -> Path:
    """``out/head_budgets.json``: the run's per-head budgets ``rows`` and ``doc`` (their rule, source or
    importance; :mod:`kvpop.training.allocation`); returns its path."""
    from kvpop.core.budgets import HEAD_BUDGETS_FILE
    from kvpop.core.budgets import write_head_budgets as write

    write(out / HEAD_BUDGETS_FILE, rows, **doc)
    return out / HEAD_BUDGETS_FILE


def data_print(data: str | None) -> str | None:
    """The ``--data`` file's fingerprint, kept in the checkpoint (None: no file, the synthetic task)."""
    if not data:
        return None
    try:
        return data_fingerprint(data)
    except OSError as e:
        raise ValueError(f"--data {data}: cannot read it ({e.strerror or e})") from None


def model_print(model_dir: Path | None) -> dict[str, str] | None:
    """The model directory's fingerprint (its config and weight files), kept in the checkpoint (None: ``--tiny``)."""
    if model_dir is None:
        return None
    try:
        return model_fingerprint(model_dir)
    except OSError as e:
        raise ValueError(f"--model {model_dir}: cannot read {e.filename or 'it'} ({e.strerror or e})") from None


def mismatch_message(e: Any, *, model_dir: Path | None, head_budgets: str | None, out: Path) -> str:
    """A resume's :class:`~kvpop.training.runstate.RunMismatch` with the option or file it comes from."""
    if e.what == "model":
        return f"--model {model_dir}: {e}"
    if e.what == "config" and "head_budgets" in e.fields:
        from kvpop.core.budgets import HEAD_BUDGETS_FILE

        where = head_budgets if head_budgets is not None else out / HEAD_BUDGETS_FILE
        return (f"{e} (the per-head budgets are read from {where}: its \"head_budgets\" rows were edited since "
                f"the first run; restore them)")
    return str(e)


def keep_miss(history: list[dict]) -> tuple[float, float] | None:
    """``(keep, target)``: the mean keep fraction and mean target over the last :data:`KEEP_STEPS` steps of a
    DMS run's history when they differ by more than :data:`KEEP_MARGIN` of the target, else ``None``."""
    last = [h for h in history[-KEEP_STEPS:] if "keep_frac" in h and "target_keep" in h]
    if not last:
        return None
    keep = sum(h["keep_frac"] for h in last) / len(last)
    target = sum(h["target_keep"] for h in last) / len(last)
    return (keep, target) if abs(keep - target) > KEEP_MARGIN * target else None


def closing_report(out: Path, history: list[dict], *, method: str, steps: int, step: int | None, train_model: bool,
                   lr_scorer: float, priority_source: str | None = None) -> tuple[str, str | None]:
    """What a finished run says: its last line (the last step's losses, or with no step left what was rewritten
    from ``last.pt``) and a warning or None (a DMS run whose keep fraction missed its target, :func:`keep_miss`,
    over ``out/history.jsonl``: a resumed run's steps before this call too).  ``history``: the steps of this
    call; ``step``: the step of the outputs; ``lr_scorer``: the gates' learning rate in effect; ``priority_source``:
    a KVpop run's (one other than ``scorer`` trains no scorer: no L_score and no ranking accuracy to report)."""
    if not history:
        layer = "gates.safetensors" if method == "dms" else "scorers.safetensors"
        return (f"kvpop train: no step left, {out / 'last.pt'} is at step {step} >= --steps {steps}; "
                f"rewrote {layer}{' and model/' if train_model else ''} from it (step {step})"), None
    h = history[-1]
    if method != "dms" and priority_source not in (None, "scorer"):
        return (f"kvpop train: step {h['step']}: kl {h['kl']:.4f} (--priority-source {priority_source} trains no "
                f"scorer: no L_score, no ranking accuracy); wrote {out}"), None
    if method != "dms":
        acc = ("- (no token was ranked in this step: nothing competed for a long-range slot)"
               if h.get("decisions") == 0 else f"{h.get('accuracy', float('nan')):.3f}")
        return (f"kvpop train: step {h['step']}: kl {h['kl']:.4f}, score {h['score']:.4f}, "
                f"accuracy {acc}; wrote {out}"), None
    line = (f"kvpop train: step {h['step']}: kl {h['kl']:.4f}, compression loss {h['score']:.4f}, "
            f"keep {h['keep_frac']:.3f} (target {h['target_keep']:.3f}); wrote {out}")
    whole = out / "history.jsonl"
    miss = keep_miss([json.loads(x) for x in whole.read_text().splitlines()] if whole.exists() else history)
    if miss is None:
        return line, None
    return line, (f"kvpop train: warning: DMS's keep fraction {miss[0]:.3f} (mean of the last {KEEP_STEPS} steps) "
                  f"missed its target {miss[1]:.3f} by more than {KEEP_MARGIN:.0%}: train longer (--steps; the "
                  f"schedule ends at --schedule-steps) or raise the gates' learning rate (--lr-scorer, now "
                  f"{lr_scorer:g})")
