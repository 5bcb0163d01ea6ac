"""Head-adaptive budgets for a ``kvpop train`` run (docs/DESIGN.md section 7): read from a file
(``--head-budgets``, or a resumed ``--allocate`` run's own ``head_budgets.json``) or measured before training
(``--allocate ablation``) on validation sequences that are not training sequences.

Each function returns what the run writes as ``OUT/head_budgets.json`` beside the config it trains with,
and raises ``ValueError`` naming the option and file at fault.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from kvpop.core.budgets import ablation_budgets, read_head_budgets
from kvpop.core.patching import check_head_budgets

from .data import cut_file, digests

__all__ = ["VALID_SEQUENCES", "validation_file", "validation_batches", "given_head_budgets", "measured_head_budgets",
           "check_same_head_budgets"]

VALID_SEQUENCES = 8
"""``--allocate``'s default number of validation sequences."""


def validation_file(path: str, seq_len: int, n: int, *, vocab_size: int, model_dir: Path | None, pack: bool,
                    eos_token_id: Any, train_digests: set[bytes] | None, train_path: str | None
                    ) -> tuple[list[torch.Tensor], str, int]:
    """The first ``n`` ``seq_len`` sequences of the validation file ``path`` (``--valid-data``), what they are in
    words, and how many of them are training sequences too (``train_digests``: :func:`kvpop.training.data.digests`
    of the training sequences of ``train_path``); ValueError when all are."""
    try:
        seqs = cut_file(path, seq_len, vocab_size=vocab_size, model_dir=model_dir, pack=pack,
                        eos_token_id=eos_token_id)[:n]
    except ValueError as e:
        raise ValueError(f"--valid-data: {e}") from None
    what = f"{len(seqs)} sequence(s) of {seq_len} tokens from {path}"
    both = sum(d in train_digests for d in digests(seqs)) if train_digests and seqs else 0
    if seqs and both == len(seqs):
        raise ValueError(f"--valid-data {path}: all {len(seqs)} of its sequences measured are training sequences "
                         f"of --data {train_path} too (its records are training records): the allocation must be "
                         f"measured on held-out records")
    return seqs, what, both


def validation_batches(seqs: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """``[batch_size, L]`` batches of the validation sequences (the last may be smaller)."""
    return [torch.stack(seqs[i:i + batch_size]) for i in range(0, len(seqs), batch_size)]


def given_head_budgets(cfg: Any, model: torch.nn.Module, path: Path | str, flag: str, *, budget: int,
                       keep_doc: bool, copy: Path | None = None) -> tuple[Any, tuple[Any, dict | None]]:
    """The run's config with the budgets of the file ``path`` (``flag``: how the user gave it, for messages) and
    ``(rows, the document to write as OUT/head_budgets.json, None: nothing new)``.  The rows must hold a mean of
    ``budget`` and fit ``model``; ``keep_doc``: the file is the user's (``--head-budgets``), copied with its
    source; ``copy``: the first run's copy in ``OUT`` that a resume's file must equal
    (:func:`check_same_head_budgets`)."""
    path = Path(path)
    if not keep_doc and not path.is_file():
        raise ValueError(f"{flag}: {path} is missing (it holds the budgets the first run chose and trained with); "
                         f"restore it")
    try:
        hb = read_head_budgets(path)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    if hb["budget"] != budget:
        rows = hb["head_budgets"]
        raise ValueError(f"{flag}: the budgets hold a mean of {hb['budget']} entries per head ({sum(map(sum, rows))} "
                         f"over {len(hb['head_budgets'])} layers x {len(hb['head_budgets'][0])} KV heads), --budget "
                         f"is {budget}: give --budget {hb['budget']}")
    try:
        cfg = cfg.replace(head_budgets=hb["head_budgets"])
        check_head_budgets(cfg, model)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{flag}: {e}") from None
    doc = None
    if copy is not None and copy.is_file():
        check_same_head_budgets(flag, hb, copy)  # before the run's copy is rewritten
    if keep_doc:
        doc = {k: v for k, v in hb.items() if k not in ("head_budgets", "budget")}
        doc.setdefault("rule", "given")
        doc["source"] = str(path.resolve())
    return cfg, (hb["head_budgets"], doc)


def measured_head_budgets(cfg: Any, model: torch.nn.Module, batches: list[torch.Tensor], what: str, *, rule: str,
                          min_k: int) -> tuple[Any, tuple[Any, dict]]:
    """The run's config with budgets allocated by ``rule`` (``ablation``: :func:`kvpop.core.budgets.ablation_budgets`
    on the validation ``batches``, the model as loaded, before training) and ``(rows, the document to write as
    OUT/head_budgets.json)``; ``what``: the validation sequences in words."""
    t0 = time.time()
    try:  # the model as loaded is the frozen original: its own exact label is the mask
        rows, imp = ablation_budgets(model, batches, config=cfg, min_k=min_k)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--allocate {rule}: {e}") from None
    doc = {"importance": imp.tolist(), "min_k": min_k, "granularity": 1, "rule": "ablation",
           "measured_on": what,
           "measure": "kvpop.core.budgets.ablation_importance: the rise of the mean next-token NLL (nats) when one "
                      "head alone keeps no long-range slot; mask: the run's label (--label, --eps, --gamma-init) "
                      "computed exactly from the model's dense attention (mask_source='teacher', "
                      "target_source='teacher'); "
                      "the model as loaded, before training",
           "wall_s": round(time.time() - t0, 1)}
    return cfg.replace(head_budgets=rows), (rows, doc)


def check_same_head_budgets(flag: str, given: dict, copy: Path) -> None:
    """A ``--head-budgets FILE --resume`` whose FILE differs from the first run's copy in ``OUT`` is refused,
    naming the field: the checkpoint was trained with the copy's rows, and ``kvpop eval`` shares other budgets
    by its importance."""
    try:
        saved = read_head_budgets(copy)
    except ValueError as e:
        raise ValueError(f"{flag} --resume: the first run's copy is unreadable: {e}; restore it from "
                         f"{given.get('source', flag)}") from None
    for key in ("head_budgets", "importance", "min_k", "granularity"):
        then, now = saved.get(key), given.get(key)
        if key == "head_budgets":
            then, now = [list(r) for r in then], [list(r) for r in now]
        if then != now:
            raise ValueError(f"{flag} --resume: its \"{key}\" differs from the first run's copy {copy}, which the "
                             f"checkpoint was trained with (was {json.dumps(then)[:120]}, now "
                             f"{json.dumps(now)[:120]}); restore the file, or start in another directory")

