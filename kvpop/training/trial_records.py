"""The trial records of a staged search (:class:`kvpop.training.search.Search`): ``OUT/<subdir>/<tag>/trial.json``
read back only after it is checked, and what ``kvpop train --auto`` ran its trials under.

A finished trial's record is reused, never run again (an interrupted search continues where it stopped), so what
it says is checked before anything follows it (:func:`read_trial`):

* it is a JSON object of the record's schema (:func:`check_record`): ``settings`` an object, ``score`` a finite
  number (a NaN is never beaten by a comparison, so it would be chosen), ``steps`` a whole number >= 0,
  ``seconds`` a number >= 0 or null, ``stage`` a string, ``dir`` the trial's own directory relative to ``OUT``
  (the chosen trial's files are copied from ``OUT/<dir>``: a record cannot send the search outside ``OUT``);
  ``validations`` (early stopping) a list of ``{"step", "score"}`` and ``scorer_only`` (the warm start's first run)
  a record of its own, when present.  Any other entry is kept as it is (records carry more than this module
  reads);
* with ``inputs`` (``kvpop train --auto``: :func:`search_inputs`, the resolved options and the fingerprints of
  the files the search reads), it was run under the same ones (:data:`INPUTS_KEY` in the record, and in
  :data:`STARTED_FILE`, written when a trial starts, so that a trial interrupted before its record also is);
  only :data:`AUTO_RESUMABLE` options may differ.

Every refusal is a ``ValueError`` naming the file.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["INPUTS_KEY", "STARTED_FILE", "AUTO_RESUMABLE", "read_trial", "check_record", "check_score",
           "file_record", "start_trial", "check_inputs", "effective_options", "check_trial_dirs", "search_inputs",
           "read_validations"]

INPUTS_KEY = "search_inputs"
"""The entry of a trial record (and of :data:`STARTED_FILE`) holding what the search ran under:
``{"options": {...}, "files": {...}}`` (:func:`search_inputs`)."""
STARTED_FILE = "search.json"
"""Written in a trial's directory when it starts (``{INPUTS_KEY: ...}``): what its partial state (``last.pt``,
``validation.jsonl``) was made under."""
AUTO_RESUMABLE = frozenset({"checkpoint_every", "no_progress", "resume", "out", "device", "auto_budget", "threads"})
"""Options of ``kvpop train --auto`` that may differ between a search and its ``--resume``: those of a plain run's
resume (:data:`kvpop.training.rundir.RESUMABLE`) but ``--steps`` (each trial's length), and the search's own
budget ``--auto-budget``."""

_ADVICE = ("give the options of the first search (its OUT/selection.json records them under \"search_inputs\"), "
           "restore the file, or choose another --out")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fail(where: Path | str, what: str) -> None:
    raise ValueError(f"{where}: {what}")


def check_score(score: Any, where: Path | str, what: str = '"score"') -> float:
    """``score`` as a float: a finite number, else ValueError naming ``where`` and ``what`` (a NaN would never be
    beaten)."""
    if not _number(score):
        _fail(where, f"{what} must be a number, got {type(score).__name__} {str(score)[:60]!r}")
    if not math.isfinite(score):
        _fail(where, f"{what} is {score}, not a finite number: a trial scored so cannot be compared (a NaN is never "
                     f"beaten, so it would be chosen)")
    return float(score)


def _check_validation(v: Any, where: Path | str, label: str) -> None:
    if not isinstance(v, dict):
        _fail(where, f'{label} must be an object with "step" and "fit_score", got {type(v).__name__}')
    step = v.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        _fail(where, f'{label}["step"] must be a whole number >= 1, got {step!r}')
    key = "fit_score" if "fit_score" in v else "score"  # the fit part's score; "score" before the fit/select split
    check_score(v.get(key), where, f'{label}["{key}"]')


def _check_validations(vals: Any, where: Path | str) -> None:
    if not isinstance(vals, list):
        _fail(where, f'"validations" must be a list, got {type(vals).__name__}')
    for i, v in enumerate(vals):
        _check_validation(v, where, f'"validations"[{i}]')


def check_record(r: Any, where: Path | str, *, rel: str | None = None, nested: bool = False) -> dict:
    """``r`` checked against the trial record's schema (the module docstring), ``rel`` its expected ``dir``
    (``None``: not checked); ``nested``: a record inside another (``scorer_only``: no ``dir``, ``stage`` or
    ``settings``).  Returns ``r``; ValueError naming ``where``."""
    if not isinstance(r, dict):
        _fail(where, f"a trial record is a JSON object, got {type(r).__name__}")
    if not nested:
        if not isinstance(r.get("settings"), dict):
            _fail(where, f'"settings" must be an object, got {type(r.get("settings")).__name__}')
        if not isinstance(r.get("stage"), str):
            _fail(where, f'"stage" must be a string, got {r.get("stage")!r}')
    check_score(r.get("score"), where)
    steps = r.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        _fail(where, f'"steps" must be a whole number >= 0, got {steps!r}')
    sec = r.get("seconds")
    if sec is not None and not (_number(sec) and math.isfinite(sec) and sec >= 0):
        _fail(where, f'"seconds" must be a number >= 0 or null, got {sec!r}')
    if "best_step" in r and not (isinstance(r["best_step"], int) and not isinstance(r["best_step"], bool)):
        _fail(where, f'"best_step" must be a whole number, got {r["best_step"]!r}')
    if "validations" in r:
        _check_validations(r["validations"], where)
    ps = r.get("per_sequence")
    if ps is not None:  # what the selection rule pairs: finite numbers, one per select sequence
        if not isinstance(ps, list) or not ps:
            _fail(where, f'"per_sequence" must be a non-empty list of numbers or null, got {str(ps)[:60]!r}')
        for i, x in enumerate(ps):
            check_score(x, where, f'"per_sequence"[{i}]')
        mean = sum(float(x) for x in ps) / len(ps)
        if not math.isclose(float(r["score"]), mean, rel_tol=1e-9, abs_tol=1e-12):
            _fail(where, f'"score" {r["score"]!r} is not the mean of its {len(ps)} "per_sequence" values '
                         f"({mean!r}): the record was edited or is not this trial's; restore it, or delete the file "
                         f"to run the trial again")
    if "scorer_only" in r:
        check_record(r["scorer_only"], where, nested=True)
    if rel is not None and r.get("dir") != rel:
        _fail(where, f'"dir" is {r.get("dir")!r}, not the directory the record lies in ({rel!r}, relative to the '
                     f"search's OUT): a record never points elsewhere (the chosen trial's files are copied from its "
                     f"dir); restore it, or delete the file to run the trial again")
    return r


def _load(f: Path) -> Any:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{f}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # truncated, not UTF-8, not JSON, nested too deep
        raise ValueError(f"{f}: not a readable JSON record ({type(e).__name__}: {str(e)[:200]}); it is a finished "
                         f"trial's record: restore it, or delete it to run the trial again") from None


def read_trial(f: Path, *, out: Path, settings: Mapping[str, Any] | None = None,
               inputs: Mapping[str, Any] | None = None) -> dict | None:
    """The finished trial's record ``f`` (``OUT/<subdir>/<tag>/trial.json``) checked (the module docstring), with
    :data:`INPUTS_KEY` left out; ``None`` when it holds other ``settings`` than those given (another trial under
    the same tag: run anew).  ``inputs``: what this search runs under (:func:`search_inputs`), which the record's
    must equal.  ValueError naming ``f``."""
    f = Path(f)
    r = _load(f)
    if not isinstance(r, dict):
        _fail(f, f"a trial record is a JSON object, got {type(r).__name__}")
    if settings is not None and r.get("settings") != dict(settings):
        return None
    check_record(r, f, rel=f.parent.relative_to(out).as_posix())
    if inputs is not None:
        check_inputs(r.get(INPUTS_KEY), inputs, f)
    return {k: v for k, v in r.items() if k != INPUTS_KEY}


def file_record(r: Mapping[str, Any], inputs: Mapping[str, Any] | None) -> dict:
    """What ``trial.json`` holds: the record ``r`` with ``inputs`` (when given) under :data:`INPUTS_KEY`."""
    return dict(r) if inputs is None else {**r, INPUTS_KEY: inputs}


def start_trial(d: Path, inputs: Mapping[str, Any]) -> None:
    """A trial starting (or continuing) in ``d`` under ``inputs``: ``d/`` :data:`STARTED_FILE` written, or, when a
    run started there before, checked to hold the same (a partial trial's checkpoint and validations were made
    under it)."""
    from kvpop.core.files import write_json

    f = Path(d) / STARTED_FILE
    if f.exists():
        doc = _load(f)
        check_inputs(doc.get(INPUTS_KEY) if isinstance(doc, dict) else None, inputs, f)
        return
    write_json(f, {INPUTS_KEY: inputs})


def _describe(kind: str, key: str, was: Any, now: Any) -> str:
    if kind == "options":
        return f"--{key.replace('_', '-')} (was {was!r}, now {now!r})"
    name = {"data": "--data", "valid_data": "--valid-data", "init_scorers": "--init-scorers",
            "model": "the model directory (--model)"}.get(key, key)
    if was is None or now is None:
        return f"{name} (was {'none' if was is None else 'given'}, now {'none' if now is None else 'given'})"
    if isinstance(was, dict) and isinstance(now, dict):
        files = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
        return f"the content of {name} ({', '.join(files)} changed since the trial ran)"
    return f"the content of {name} (edited since the trial ran: was {was}, now {now})"


def check_inputs(found: Any, expected: Mapping[str, Any], where: Path | str) -> None:
    """The inputs a trial ran under (``found``, from its record) against this search's (``expected``,
    :func:`search_inputs`): ValueError naming ``where`` and every option or file that differs (options of
    :data:`AUTO_RESUMABLE` are not compared)."""
    if found is None:
        _fail(where, f"the record does not say which options and data the trial ran under (\"{INPUTS_KEY}\"; a "
                     f"record of an earlier kvpop, or edited), so --resume cannot check that it belongs to this "
                     f"search: delete its directory to run the trial again, or choose another --out")
    if not isinstance(found, dict) or not all(isinstance(found.get(k), dict) for k in ("options", "files")):
        _fail(where, f'"{INPUTS_KEY}" must be an object with "options" and "files"')
    diff = []
    for kind in ("options", "files"):
        was, now = found[kind], expected[kind]
        if kind == "options":  # --auto-patience / --auto-eval-every compared as the values they stand for
            was, now = effective_options(was), effective_options(now)
        for k in sorted(set(was) | set(now)):
            if kind == "options" and k in AUTO_RESUMABLE:
                continue
            if was.get(k) != now.get(k):
                diff.append(_describe(kind, k, was.get(k), now.get(k)))
    if diff:
        raise ValueError(f"--auto --resume: {where} is a trial of a search with other options or data, and its score "
                         f"cannot be compared with this one's; these differ: {'; '.join(diff)}. Only --auto-budget "
                         f"(and --checkpoint-every, --device, --no-progress) may change on --resume: {_ADVICE}")


def effective_options(options: Mapping[str, Any]) -> dict:
    """``options`` (a record's ``search_inputs["options"]``) with ``auto_patience`` and ``auto_eval_every`` as the
    values the search uses (:func:`early_stopping`: ``None``, not given, is the default), so
    that giving a default explicitly on ``--resume`` is the same search; values it refuses are left as they are
    (the search refuses them itself)."""
    out = dict(options)
    steps = out.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return out
    try:
        every, patience = early_stopping(steps, out.get("auto_patience"), out.get("auto_eval_every"))
    except (TypeError, ValueError):
        return out
    out["auto_patience"], out["auto_eval_every"] = patience, (every if patience else None)
    return out


def check_trial_dirs(out: Path, subdir: str, inputs: Mapping[str, Any]) -> int:
    """Every trial directory under ``out/subdir`` checked before a search resumes (:func:`read_trial` of its
    ``trial.json``, :data:`STARTED_FILE` against ``inputs``), so that a search of other options or data is refused
    before any work; returns how many trial directories there are."""
    root = Path(out) / subdir
    if not root.is_dir():
        return 0
    n = 0
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        n += 1
        if (d / "trial.json").exists():
            read_trial(d / "trial.json", out=Path(out), inputs=inputs)
        if (d / STARTED_FILE).exists():
            start_trial(d, inputs)
    return n


def read_validations(f: Path) -> list[dict]:
    """The validations of an early-stopped trial recorded so far (``validation.jsonl``: one ``{"step", "score"}``
    per line, each appended with its newline), checked; ValueError naming ``f`` and the line.  A last line without
    its newline (a process killed while appending it) is not a record: it is cut from the file (that validation
    runs again)."""
    from kvpop.core.files import atomic_write

    out = []
    try:
        text = Path(f).read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise ValueError(f"{f}: cannot read it ({type(e).__name__}: {str(e)[:200]}); delete it to validate the trial "
                         f"again") from None
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        atomic_write(f, lambda fh: fh.write(text), binary=False)
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{f}:{i}: not a JSON record ({str(e)[:200]}); delete the file to validate the trial "
                             f"again") from None
        _check_validation(rec, f"{f}:{i}", "a validation")
        out.append(rec)
    return out


def search_inputs(args: Any, *, model_dir: Path | None, overrides: dict | None = None) -> dict:
    """What ``kvpop train --auto`` runs its trials under: ``{"options": the resolved options (file paths resolved,
    :func:`kvpop.training.rundir.comparable`), "files": the fingerprints of --data, --valid-data, --init-scorers
    and the model directory}``.  ``args``: the options with their defaults filled in
    (:func:`kvpop.training.options.check_options`), ``overrides`` (option name -> value) recorded in their place;
    ``model_dir``: the model directory the search loads.  ValueError naming a file that cannot be read."""
    from .data import data_fingerprint
    from .rundir import arg_dict, comparable, data_print, model_print

    given = {**arg_dict(args), **(overrides or {})}
    options = {k: v for k, v in comparable(given).items() if k not in AUTO_RESUMABLE}
    files: dict[str, Any] = {"data": data_print(args.data), "model": model_print(model_dir)}
    for key, flag in (("valid_data", "--valid-data"), ("init_scorers", "--init-scorers")):
        path = getattr(args, key, None)
        try:
            files[key] = data_fingerprint(path) if path else None
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    return json.loads(json.dumps({"options": options, "files": files}))  # as a record holds it


PATIENCE = 2
"""``--auto-patience``'s default: a trial stops after two validations (of four along its ``--steps``) without a
better or equal score (a tie goes to the later state)."""

def early_stopping(steps: int, patience: int | None = None, every: int | None = None) -> tuple[int, int]:
    """``(every, patience)`` of ``--auto-eval-every`` / ``--auto-patience`` (``None``: not given) for trials of
    ``steps`` (``--steps``): each trial validated every ``every`` steps (default a quarter of ``steps``, rounded
    up: at most four validations) and stopped after ``patience`` (default :data:`PATIENCE`) validations without
    a better score on the fit sequences, its best state kept; ``patience`` 0: no early stopping, one validation
    after ``steps``.  ValueError naming a bad value."""
    patience = PATIENCE if patience is None else patience
    if patience < 0:
        raise ValueError(f"--auto-patience must be >= 0, got {patience}")
    if every is not None and not 1 <= every <= steps:
        raise ValueError(f"--auto-eval-every must lie in [1, --steps {steps}], got {every}")
    if every is not None and not patience:
        raise ValueError(f"--auto-eval-every {every} is the validation interval of early stopping, which "
                         f"--auto-patience 0 switches off: leave one of them out")
    return (every or math.ceil(steps / 4)), patience
