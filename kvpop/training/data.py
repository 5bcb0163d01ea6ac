"""Training data for ``kvpop train``: JSONL files of token ids or texts, and the synthetic task.

A JSONL data set has one JSON object per line, either ``{"input_ids": [int, ...]}`` or
``{"text": "..."}`` (both kinds may be mixed; blank lines are skipped).  Texts are tokenised with the
model's own tokenizer (:func:`load_tokenizer`, local files only).  :func:`chunk` cuts every record into
sequences of exactly ``seq_len`` tokens (a shorter tail is dropped; with ``pack=True`` the records are
first concatenated, separated by ``sep_id`` when given), and :func:`make_batches` stacks them into
``[B, seq_len]`` batches (kvpop attention takes no padding, so every row has the full length).

(The synthetic task's endless batches are in :mod:`kvpop.demo.task`: training never imports the demo.)

Every user mistake raises ``ValueError`` naming the file and line.
"""
from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["jsonl_values", "read_jsonl", "load_tokenizer", "chunk", "make_batches", "cut_file", "digests",
           "data_fingerprint", "model_fingerprint"]


FULL_HASH_BYTES = 256 * 2**20
"""Data files up to this size are hashed whole by :func:`data_fingerprint`; larger ones by samples."""


def data_fingerprint(path: str | os.PathLike) -> str:
    """What identifies the content of a data file, stored in a run's checkpoint so that ``--resume`` after
    the file was edited in place is refused: its size and a BLAKE2 hash of the whole file up to
    :data:`FULL_HASH_BYTES`, of its first and last 16 MiB and 64 evenly spaced 64 KiB blocks beyond that
    (an edit of a larger file that keeps its size and misses every sample is not seen).  The modification
    time is left out: a copy or ``touch`` of the same content keeps its fingerprint."""
    import hashlib

    p = Path(path)
    size = p.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with p.open("rb") as f:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(2**20), b""):
                h.update(block)
        else:
            edge, blk = 16 * 2**20, 64 * 2**10
            starts = [0, size - edge] + [edge + i * (size - 2 * edge - blk) // 63 for i in range(64)]
            for start in starts:
                f.seek(start)
                h.update(f.read(edge if start in (0, size - edge) else blk))
    return f"size={size} blake2b={h.hexdigest()}" + ("" if size <= FULL_HASH_BYTES else " sampled")


def model_fingerprint(directory: str | os.PathLike) -> dict[str, str]:
    """What identifies a model directory's content: ``{file name: data_fingerprint(file)}`` of its
    ``config.json`` and every weight file ``from_pretrained`` reads (``model.safetensors``, the
    ``*.index.json`` files and every shard they name, ``pytorch_model.bin``), stored in a run's checkpoint so
    that ``--resume`` after the weights were replaced in place (the teacher is the model as loaded) is
    refused, naming the file that changed.  Files of the other names (the tokenizer, a README) are left
    out; a shard named by an index but missing is left to the loader."""
    from kvpop.models.directory import WEIGHT_FILES

    d = Path(directory)
    names = ["config.json", *(f for f in WEIGHT_FILES if (d / f).is_file())]
    for index in [f for f in names if f.endswith(".index.json")]:
        try:
            wmap = json.loads((d / index).read_text(encoding="utf-8")).get("weight_map", {})
            names += sorted({str(v) for v in wmap.values()} if isinstance(wmap, dict) else ())
        except (OSError, ValueError, AttributeError, RecursionError):
            pass  # not an index: the loader says so
    return {n: data_fingerprint(d / n) for n in dict.fromkeys(names) if (d / n).is_file()}


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """The tokenizer saved in ``model_dir`` (``AutoTokenizer``, local files only); ValueError if there is none."""
    from transformers import AutoTokenizer

    d = Path(model_dir)
    if not any((d / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                            "tokenizer.model")):
        raise ValueError(f"the data has text records but the model directory {d} holds no tokenizer "
                         f"(no tokenizer.json / tokenizer_config.json): give token ids "
                         f'({{"input_ids": [...]}}) or a model directory with its tokenizer files')
    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a broken tokenizer
        raise ValueError(f"cannot load the tokenizer of {d}: {type(e).__name__}: {e}") from e


def jsonl_values(path: Path, *, utf8_error: Callable[[int, bytes, UnicodeDecodeError], str] | None = None
                 ) -> Iterator[tuple[int, Any]]:
    """``(line number, JSON value)`` of every non-blank line of the JSONL file ``path``, read line by line as
    bytes: the reader of :func:`read_jsonl` and of ``kvpop eval --problems``
    (:func:`kvpop.answers.records.read_problems`), which check the values.

    A line that is not UTF-8, not JSON or nested too deep raises ``ValueError`` naming ``path:line``;
    ``utf8_error(lineno, raw, error)`` words the first (default: the byte and its offset in the line)."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                msg = (utf8_error(lineno, raw, e) if utf8_error is not None else
                       f"{where}: not UTF-8 text (byte {e.start} of the line is {raw[e.start]:#04x}); JSONL files "
                       f"are UTF-8")
                raise ValueError(msg) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise ValueError(f"{where}: not a record (JSON nested too deep to read)") from None
            except ValueError as e:  # e.g. an integer of more digits than Python converts
                raise ValueError(f"{where}: not valid JSON ({str(e)[:200]})") from None
            yield lineno, obj


def read_jsonl(path: str | os.PathLike, *, vocab_size: int | None = None, tokenizer: Any = None,
               tokenizer_source: str | None = None) -> list[list[int]]:
    """Token-id lists of the records of a JSONL file (see the module docstring).

    Args:
        path: the JSONL file.
        vocab_size: when given, every token id must lie in ``[0, vocab_size)``.
        tokenizer: a tokenizer for ``text`` records, or a zero-argument callable returning one (called at
            the first text record); without one a text record raises ValueError.
        tokenizer_source: named in the error raised for a text record without a tokenizer.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {p} does not exist" if not p.exists() else f"data path {p} is not a file")
    records: list[list[int]] = []
    tok = tokenizer
    for lineno, obj in jsonl_values(p):
        where = f"{p}:{lineno}"
        if not isinstance(obj, dict) or ("input_ids" in obj) == ("text" in obj):
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f'{where}: expected an object with exactly one of "input_ids" (a list of ints) '
                             f'or "text" (a string), got {got}')
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f'{where}: "input_ids" must be a list of ints, got '
                                 f"{type(ids).__name__} {str(ids)[:60]}")
        else:
            text = obj["text"]
            if not isinstance(text, str):
                raise ValueError(f'{where}: "text" must be a string, got {type(text).__name__}')
            if tok is None:
                raise ValueError(f"{where}: a text record needs a tokenizer, and "
                                 f"{tokenizer_source or 'the model'} has none; give token ids instead")
            if callable(tok) and not hasattr(tok, "encode"):
                tok = tok()
            ids = list(tok(text)["input_ids"])
        if vocab_size is not None and ids:
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{where}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
        records.append(ids)
    if not records:
        raise ValueError(f"data file {p} holds no records")
    return records


def chunk(records: list[list[int]], seq_len: int, *, pack: bool = False, sep_id: int | None = None,
          source: str = "the data", warn: Callable[[str], None] | None = None) -> list[torch.Tensor]:
    """Cut records into int64 ``[seq_len]`` sequences (shorter tails are dropped; see the module docstring).
    Records shorter than ``seq_len`` give nothing: when they are at least half of them, ``warn`` (if given) is told
    how many were dropped, and fewer than 2 sequences left from them is a ValueError (a run on one sequence of a
    file that is mostly dropped is not what was asked)."""
    short = 0 if pack else sum(len(r) < seq_len for r in records)
    if pack:
        stream: list[int] = []
        for r in records:
            stream.extend(r)
            if sep_id is not None:
                stream.append(sep_id)
        records = [stream]
    out = []
    for r in records:
        for start in range(0, len(r) - seq_len + 1, seq_len):
            out.append(torch.tensor(r[start:start + seq_len], dtype=torch.int64))
    if not out:
        longest = max(len(r) for r in records)
        hint = "" if pack else ", or --pack to concatenate the records"
        raise ValueError(f"no sequence of --seq-len {seq_len} tokens can be cut from {source}: its longest "
                         f"{'stream' if pack else 'record'} has {longest} tokens; lower --seq-len{hint}")
    if short and 2 * short >= len(records):
        what = (f"{short} of its {len(records)} records ({short / len(records):.0%}) are shorter than --seq-len "
                f"{seq_len} and were dropped, leaving {len(out)} sequence(s)")
        if len(out) < 2:
            median = sorted(len(r) for r in records)[len(records) // 2]
            raise ValueError(f"{source}: {what}: too little to train or evaluate on; lower --seq-len (to at most "
                             f"{median}, the median record's length), or --pack to concatenate the records")
        if warn is not None:
            warn(f"{source}: {what}")
    return out


def make_batches(seqs: list[torch.Tensor], batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 source: str = "the data") -> list[torch.Tensor]:
    """``[batch_size, L]`` batches of the sequences (shuffled once with ``seed``; an incomplete last batch
    is dropped).  ValueError when there are fewer sequences than ``batch_size``."""
    if len(seqs) < batch_size:
        raise ValueError(f"{source} gives {len(seqs)} sequence(s), fewer than --batch-size {batch_size}")
    order = list(range(len(seqs)))
    if shuffle:
        random.Random(seed).shuffle(order)
    n = len(order) // batch_size * batch_size
    return [torch.stack([seqs[j] for j in order[i:i + batch_size]]) for i in range(0, n, batch_size)]


def cut_file(path: str, seq_len: int, *, vocab_size: int, model_dir: Path | None, pack: bool = False,
             eos_token_id: int | list[int] | None = None, warn: Callable[[str], None] | None = None
             ) -> list[torch.Tensor]:
    """The records of the JSONL file ``path`` (:func:`read_jsonl`; texts tokenised with ``model_dir``'s tokenizer,
    ``None``: the ``--tiny`` model, which has none) cut into ``seq_len`` sequences (:func:`chunk`); with ``pack``
    the records are separated by the tokenizer's EOS, else ``eos_token_id`` (the model config's)."""
    tok_holder: dict = {}

    def tokenizer():
        if model_dir is None:
            raise ValueError(f"{path} has text records but --tiny has no tokenizer; give token ids or --model DIR")
        tok_holder["tok"] = load_tokenizer(model_dir)
        return tok_holder["tok"]

    records = read_jsonl(path, vocab_size=vocab_size, tokenizer=tokenizer, tokenizer_source=str(model_dir))
    sep = None
    if pack:
        tok = tok_holder.get("tok")
        sep = getattr(tok, "eos_token_id", None) if tok is not None else eos_token_id
        if isinstance(sep, list):
            sep = sep[0] if sep else None
    return chunk(records, seq_len, pack=pack, sep_id=sep, source=path, warn=warn)


def digests(seqs: list[torch.Tensor]) -> set[bytes]:
    """A 16-byte BLAKE2 digest of each token sequence: which sequences two sets share, in little memory."""
    import hashlib

    return {hashlib.blake2b(s.numpy().tobytes(), digest_size=16).digest() for s in seqs}
