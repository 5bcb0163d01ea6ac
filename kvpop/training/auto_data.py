"""``kvpop train --auto``'s settings and inputs: :class:`AutoSettings` (what the search reads of the command's
options, typed; ``kvpop.cli.auto`` builds them), where it writes (:func:`check_out`), the validation sequences
it chooses on and their split into fit and select parts (:func:`valid_sequences`), held out from the training
data (:func:`check_valid_file`, :func:`check_held_out`), and the fit part as the file the allocating trials
read (:func:`fit_file`).  Each takes :class:`AutoSettings` or plain values; ValueError naming the option at
fault.  :mod:`kvpop.training.auto` runs the search on them."""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["AutoSettings", "SELECT_FIRST", "SPLIT_SEED", "MAX_VALID", "check_out", "check_valid_file", "check_held_out",
           "valid_sequences", "fit_file"]

SELECT_FIRST = 1_000
"""With ``--task``: the select sequences are ``valid_seed(SELECT_FIRST + i)``; the fit sequences are
``valid_seed(0..n-1)``, the ones a trial's ``--allocate`` measures (``kvpop train --task``'s own)."""
MAX_VALID = 64
"""With ``--valid-data`` and no ``--valid-sequences``: at most this many of its sequences are read; the fit part
keeps ``kvpop.training.allocation.VALID_SEQUENCES`` (8) of them and every other goes to the select part, which
alone decides between trials (more select sequences resolve smaller differences: the record's ``power``)."""
SPLIT_SEED = 0
"""The seed of the hash that splits ``--valid-data``'s sequences into fit and select
(:func:`kvpop.training.search.split_keys`); fixed, so that ``--seed`` does not move the split."""


@dataclass(frozen=True)
class AutoSettings:
    """What the search itself reads of a ``kvpop train --auto`` command (``kvpop.cli.auto`` builds it from the
    command's options): ``out`` (OUT), ``steps`` (one trial's ``--steps``), ``seed`` (the confirmation retrains
    with ``seed + 1``), ``sinks`` and ``window`` (the training budgets' floor), ``resume``, ``auto_budget``
    (``--auto-budget``, :func:`kvpop.training.auto.parse_budget`'s text), ``patience`` and ``eval_every``
    (``--auto-patience`` and ``--auto-eval-every``, ``None`` for their defaults,
    :func:`kvpop.training.auto.early_stopping`), ``allocate`` (``--allocate`` as given: a trial that does not
    allocate takes no validation data), ``progress`` (a trial's validations told); what
    :func:`kvpop.training.auto.run` reads besides: ``train_model`` (the model trained too, not
    ``--no-train-model``), ``model`` (``--model``, or ``None`` for the task's shipped model), ``task``
    (``--task``'s name, or ``None``: scored on ``--valid-data``), ``data``, ``valid_data``, ``valid_sequences``,
    ``seq_len`` and ``pack`` (the validation sequences, :func:`valid_sequences`)."""

    out: str
    steps: int
    seed: int = 0
    sinks: int = 4
    window: int = 32
    resume: bool = False
    auto_budget: str | None = None
    patience: int | None = None
    eval_every: int | None = None
    allocate: str | None = None
    progress: bool = True
    train_model: bool = True
    model: str | None = None
    task: str | None = None
    data: str | None = None
    valid_data: str | None = None
    valid_sequences: int | None = None
    seq_len: int = 4096
    pack: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "seed", "sinks", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"AutoSettings.{name} must be an int, got {v!r}")


def check_valid_file(valid: str, data: str) -> None:
    """``--valid-data`` is not the training file ``--data`` (the path, or a copy of its content): the search's
    trials must be scored on held-out records (:func:`check_held_out` compares the records themselves)."""
    from .data import data_fingerprint

    if Path(valid).resolve() == Path(data).resolve():
        raise ValueError(f"--valid-data {valid} is the training file --data: --auto's search must score its trials "
                         f"on held-out records, never on what they trained on")
    try:
        same = data_fingerprint(valid) == data_fingerprint(data)
    except OSError:
        return  # unreadable: said when the file is read
    if same:
        raise ValueError(f"--valid-data {valid} has the same content as the training file --data {data} (a copy): "
                         f"--auto's search must score its trials on held-out records")


def check_out(out: Path, resume: bool, run_files: tuple[str, ...]) -> None:
    """``--out`` holds nothing a search would replace or mix with: a plain run of ``kvpop train`` (its files,
    ``run_files``, would be replaced by the chosen trial's), or without ``--resume`` an earlier search (finished
    or interrupted)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if (out / "auto").exists() and not (out / "auto").is_dir():
        raise ValueError(f"--out {out}: {out / 'auto'} is not a directory, where the search keeps its trials; move "
                         f"it away")
    searched = (out / "selection.json").exists() or (out / "auto").is_dir()
    run = [n for n in run_files if (out / n).exists()]
    if run and not searched:
        raise ValueError(f"--out {out} holds a run of kvpop train without --auto ({', '.join(run)}), which the "
                         f"search's chosen run would replace: choose another --out")
    if not resume and (out / "selection.json").exists():
        raise ValueError(f"--out {out} already holds a search (selection.json); add --resume to continue it, or "
                         f"choose another --out")
    if not resume and (out / "auto").is_dir() and any(p.is_dir() for p in (out / "auto").iterdir()):
        raise ValueError(f"--out {out} holds the trials of an earlier --auto search ({out / 'auto'}): add --resume to "
                         f"continue it (the same options), or choose another --out")


def valid_sequences(s: AutoSettings, model: Any, source: Path, task: Any) -> tuple[dict, dict]:
    """``({"fit": seqs, "select": seqs}, the record's split)``: with ``--task`` (``task``: its module), ``n``
    (``--valid-sequences``, default 8) of each (:data:`SELECT_FIRST`); with ``--valid-data``, its first ``2 n``
    sequences split by a seeded hash of their tokens (:data:`SPLIT_SEED`), about half each; with ``--valid-data``
    and no ``--valid-sequences``, up to :data:`MAX_VALID` of its sequences, ``n`` to fit and the rest (when more
    than ``2 n``) to select."""
    from . import allocation as A
    from .search import split_keys

    n = s.valid_sequences or A.VALID_SEQUENCES
    if s.task:
        if n > SELECT_FIRST:
            raise ValueError(f"--valid-sequences {n}: at most {SELECT_FIRST} with --task (the select part starts at "
                             f"valid_seed({SELECT_FIRST}))")
        fit, sel = [task.valid_seed(i) for i in range(n)], [task.valid_seed(SELECT_FIRST + i) for i in range(n)]
        parts = {"fit": list(task.make_batch(fit, s.seq_len)["input_ids"]),
                 "select": list(task.make_batch(sel, s.seq_len)["input_ids"])}
        return parts, {"of": f"the task's validation seeds (valid_seed(0..{n - 1}) fit, valid_seed({SELECT_FIRST}.."
                             f"{SELECT_FIRST + n - 1}) select)", "fit": fit, "select": sel}
    seqs, _, _ = A.validation_file(s.valid_data, s.seq_len, 2 * n if s.valid_sequences else max(MAX_VALID, 2 * n),
                                   vocab_size=model.config.vocab_size,
                                   model_dir=source, pack=s.pack,
                                   eos_token_id=getattr(model.config, "eos_token_id", None), train_digests=None,
                                   train_path=s.data)
    if not seqs:
        raise ValueError(f"--valid-data {s.valid_data} gives no sequence of --seq-len {s.seq_len} tokens")
    check_held_out(s, model, source, seqs)
    if len(seqs) < 2:
        raise ValueError(f"--valid-data {s.valid_data} gives {len(seqs)} sequence(s) of --seq-len {s.seq_len} "
                         f"tokens; --auto needs at least 2 (one to fit, one to select), 16 or more to resolve "
                         f"small differences")
    keys = [",".join(map(str, x.tolist())) for x in seqs]
    fit, sel = split_keys(keys, SPLIT_SEED, n_fit=None if s.valid_sequences else n)
    return ({"fit": [seqs[i] for i in fit], "select": [seqs[i] for i in sel]},
            {"of": f"the first {len(seqs)} sequences of {s.seq_len} tokens of --valid-data {s.valid_data} "
                   f"(their index in the file), split by sha256 of '{SPLIT_SEED}:' and their tokens",
             "fit": fit, "select": sel})


def fit_file(out: Path, seqs: list) -> Path:
    """``out/auto/fit.jsonl``: the fit sequences as token-id records, the ``--valid-data`` of the trials that
    allocate (the allocation never sees the select sequences)."""
    f = out / "auto" / "fit.jsonl"
    f.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"input_ids": x.tolist()}) + "\n" for x in seqs)
    if not f.exists() or f.read_text() != text:
        f.write_text(text)
    return f


def check_held_out(s: AutoSettings, model: Any, source: Path, seqs: list) -> None:
    """The validation sequences the search scores on are held out from ``--data``: refused when every record of
    ``--valid-data`` is a training record (in any order, so with ``--pack`` too), or every sequence measured is a
    training sequence; a warning when some are."""
    from . import data as D

    tok: dict = {}

    def tokenizer():
        tok.setdefault("t", D.load_tokenizer(source))
        return tok["t"]

    def records(path: str) -> list[list[int]]:
        return D.read_jsonl(path, vocab_size=model.config.vocab_size, tokenizer=tokenizer,
                            tokenizer_source=str(source))

    def digest(ids: list[int]) -> bytes:
        return hashlib.blake2b(repr(ids).encode(), digest_size=16).digest()

    try:
        train = records(s.data)
    except ValueError as e:
        raise ValueError(f"--data: {e}") from None
    valid = records(s.valid_data)
    train_records = {digest(r) for r in train}
    shared = sum(digest(r) in train_records for r in valid)
    why = ("--auto's search must score its trials on held-out records, never on what they trained on: give "
           "--valid-data records that are not in --data")
    if shared == len(valid):
        raise ValueError(f"--valid-data {s.valid_data}: all {len(valid)} of its records are training records of "
                         f"--data {s.data} too (in any order): {why}")
    eos = getattr(model.config, "eos_token_id", None)
    sep = getattr(tok.get("t"), "eos_token_id", None) if tok else eos
    sep = (sep[0] if sep else None) if isinstance(sep, list) else sep
    try:
        cut = D.digests(D.chunk(train, s.seq_len, pack=s.pack, sep_id=sep, source=s.data))
    except ValueError:
        cut = set()  # no training sequence of this length: each trial says so
    both = sum(bool(D.digests([x]) & cut) for x in seqs)
    if both == len(seqs):
        raise ValueError(f"--valid-data {s.valid_data}: all {len(seqs)} of its sequences measured are training "
                         f"sequences of --data {s.data} too: {why}")
    if both or shared:
        print(f"kvpop train --auto: warning: --valid-data {s.valid_data}: {shared} of its {len(valid)} records "
              f"({both} of the {len(seqs)} sequences measured) are training records of --data {s.data} too: the "
              f"trials' scores are partly measured on training data", file=sys.stderr)
