"""The problems of ``kvpop eval --problems``: reading and checking a problem file, and fitting it to a model.

A *problem* is a JSONL record ``{"prompt": "..."}`` or ``{"prompt_ids": [...]}`` with ``"answer"`` (a string
or a list of accepted strings) or ``"answer_ids"`` (token ids, for a model without a tokenizer), and an
optional ``"id"``.  :func:`read_problems` reads them (every error names the line and field; the lines are
read by :func:`kvpop.training.data.jsonl_values`, as training data is); :func:`check_lengths` refuses, before
anything is generated, problems that cannot fit the model's context (:func:`model_context`).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpop.training.data import jsonl_values

__all__ = ["Problem", "read_problems", "model_context", "check_lengths"]


@dataclass
class Problem:
    """One problem: ``prompt_ids`` (the tokens fed to the model) and the accepted ``answers`` (strings) or
    ``answer_ids``; ``index`` is its line's order among the records, ``id`` the record's (or ``index``)."""

    index: int
    id: str
    prompt_ids: list[int]
    answers: list[str] | None = None
    answer_ids: list[int] | None = None
    where: str | None = None  # the record's file and line (and id), for messages


def _where(path: Path, lineno: int, rec: Any = None) -> str:
    rid = rec.get("id") if isinstance(rec, dict) else None
    return f"{path}:{lineno}" + (f" (id {rid!r})" if rid is not None else "")


def _check_vocab(ids: list[int], where: str, what: str, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: {what} holds token id {bad[0]}, outside the model's vocabulary [0, {vocab_size})")


def _ids_field(rec: dict, name: str, where: str, vocab_size: int) -> list[int]:
    v = rec[name]
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ValueError(f'{where}: "{name}" must be a list of ints, got {type(v).__name__} {str(v)[:60]}')
    if not v:
        raise ValueError(f'{where}: "{name}" is empty')
    _check_vocab(v, where, f'"{name}"', vocab_size)
    return v


def read_problems(path: str | os.PathLike, *, vocab_size: int, tokenizer: Callable[[], Any] | None = None,
                  tokenizer_source: str = "the model", chat_template: bool = False) -> list[Problem]:
    """The problems of a JSONL file (module docstring), every error naming the line and field.

    ``tokenizer``: a zero-argument callable returning the model's tokenizer (called at the first text
    record; None when the model has none); ``chat_template``: wrap text prompts in it as one user turn."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--problems {p}: " + ("no such file" if not p.exists() else "not a file"))
    tok = None
    out: list[Problem] = []
    ids_seen: dict[str, int] = {}
    for lineno, rec in jsonl_values(p, utf8_error=lambda lineno, raw, e: (
            f"{p}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})")):
        if not isinstance(rec, dict):
            raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        where = _where(p, lineno, rec)
        if ("prompt" in rec) == ("prompt_ids" in rec):
            raise ValueError(f'{where}: expected exactly one of "prompt" (a string) or "prompt_ids" (token ids), '
                             f"got fields {sorted(rec)}")
        if ("answer" in rec) == ("answer_ids" in rec):
            raise ValueError(f'{where}: expected exactly one of "answer" (a string or a list of strings) or '
                             f'"answer_ids" (token ids), got fields {sorted(rec)}')

        if "prompt_ids" in rec:
            prompt = _ids_field(rec, "prompt_ids", where, vocab_size)
        else:
            text = rec["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError(f'{where}: "prompt" must be a non-empty string, got {str(text)[:60]!r}')
            if tok is None:
                tok = tokenizer() if tokenizer is not None else None
                if tok is None:
                    raise ValueError(f'{where}: a text "prompt" needs a tokenizer and {tokenizer_source} has none; '
                                     f'give "prompt_ids" and "answer_ids" instead')
            if chat_template:
                text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
            prompt = list(tok(text, add_special_tokens=not chat_template)["input_ids"])
            if not prompt:
                raise ValueError(f'{where}: "prompt" tokenizes to no token')
            _check_vocab(prompt, where, "the tokenized \"prompt\"", vocab_size)
        answers = answer_ids = None
        if "answer_ids" in rec:
            answer_ids = _ids_field(rec, "answer_ids", where, vocab_size)
        else:
            a = rec["answer"]
            answers = [a] if isinstance(a, str) else a
            if (not isinstance(answers, list) or not answers
                    or not all(isinstance(x, str) and x.strip() for x in answers)):
                raise ValueError(f'{where}: "answer" must be a non-empty string or a non-empty list of non-empty '
                                 f"strings, got {str(a)[:60]!r}")
            if tok is None and tokenizer is not None:
                tok = tokenizer()
            if tok is None:
                raise ValueError(f'{where}: a text "answer" is read from decoded text, and {tokenizer_source} has '
                                 f'no tokenizer; give "answer_ids"')
        rid = rec.get("id", len(out))
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise ValueError(f'{where}: "id" must be a string or an int, got {type(rid).__name__}')
        rid = str(rid)
        if rid in ids_seen:
            if "id" not in rec:
                raise ValueError(f'{where}: the record has no "id", so its id is its index {rid}, which the record '
                                 f'on line {ids_seen[rid]} gives as its "id": give this record an "id" (or none '
                                 f'of them one)')
            raise ValueError(f'{where}: "id" {rid!r} is also the id of the record on line {ids_seen[rid]}')
        ids_seen[rid] = lineno
        out.append(Problem(len(out), rid, prompt, answers, answer_ids, where))
    if not out:
        raise ValueError(f"--problems {p} holds no record")
    return out


def model_context(config: Any) -> int | None:
    """The positions a model takes (a transformers config's ``max_position_embeddings``; with RoPE scaling, at
    least ``factor`` times the ``original_max_position_embeddings``); None when the config gives none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    mp = getattr(text, "max_position_embeddings", None)
    if isinstance(mp, bool) or not isinstance(mp, int) or mp < 1:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        factor, orig = rope.get("factor"), rope.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and isinstance(orig, int) and math.isfinite(factor):
            mp = max(mp, int(factor * orig))
    return mp


def check_lengths(problems: Sequence[Problem], max_new_tokens: int, context: int | None, *,
                  model: str = "the model") -> None:
    """``ValueError`` before anything is generated when a prompt, or a prompt and ``max_new_tokens`` new tokens,
    would run past the model's ``context`` (:func:`model_context`), or when an ``answer_ids`` answer is longer
    than ``max_new_tokens`` (it could never be generated: it would score 0 under every policy)."""
    short = [p for p in problems if p.answer_ids is not None and len(p.answer_ids) > max_new_tokens]
    if short:
        p = max(short, key=lambda q: len(q.answer_ids))
        raise ValueError(f"{p.where or f'problem {p.id}'}: \"answer_ids\" has {len(p.answer_ids)} tokens, more than "
                         f"--max-new-tokens {max_new_tokens} generates ({len(short)} problem(s) like it would score 0 "
                         f"under every policy): give --max-new-tokens {len(p.answer_ids)} or more")
    if context is None:
        return
    if max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {max_new_tokens} is not below the context of {model}, {context} "
                         f"positions (max_position_embeddings), which holds the prompt and the answer: give at most "
                         f"{context - 1}")
    p = max(problems, key=lambda q: len(q.prompt_ids))
    n = len(p.prompt_ids)
    where = p.where or f"problem {p.id}"
    if n >= context:
        raise ValueError(f"{where}: the prompt is {n} tokens, not shorter than the context of {model}, {context} "
                         f"positions (max_position_embeddings): shorten it")
    if n + max_new_tokens > context:
        raise ValueError(f"{where}: the prompt's {n} tokens and --max-new-tokens {max_new_tokens} pass the context of "
                         f"{model}, {context} positions (max_position_embeddings): give --max-new-tokens "
                         f"{context - n} or less, or shorten the prompt")
