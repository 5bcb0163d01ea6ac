"""Scoring a generated answer (:func:`extract`, :func:`is_correct`, :func:`sample_metrics`).

A text answer is the generated text (up to EOS) reduced by the ``extract`` rule -- ``last-number`` (the last
number, commas dropped, compared as a number), ``boxed`` (the content of the last ``\\boxed{...}``, braces
balanced), ``regex:PATTERN`` (the last match; its first group if it has one) or ``exact`` (the whole text,
stripped) -- and is right when it equals one of the accepted answers.  Per problem: pass@1 = the fraction of
right samples, pass@N = any right, maj@N = the most frequent extracted answer (ties: the one seen first; no
answer extracted counts as wrong) is right.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["EXTRACT_RULES", "check_rule", "extract", "is_correct", "sample_metrics"]

EXTRACT_RULES = ("last-number", "boxed", "regex:PATTERN", "exact")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _number(s: str) -> str | None:
    """A number's canonical text (commas dropped, ``3.50`` -> ``3.5``, ``4.0`` -> ``4``), None if ``s`` is none."""
    s = s.strip().replace(",", "")
    if s.startswith("$"):
        s = s[1:]
    try:
        x = float(s)
    except ValueError:
        return None
    if not math.isfinite(x):
        return None
    if "." not in s and "e" not in s.lower():
        return str(int(s))
    return f"{x:.12g}" if x != int(x) else str(int(x))


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    while start >= 0:
        i, depth = start + len("\\boxed{"), 1
        j = i
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            return text[i:j - 1].strip()
        start = text.rfind("\\boxed{", 0, start)  # unclosed: the one before it
    return None


def check_rule(rule: str) -> str:
    """``rule`` if it is one of :data:`EXTRACT_RULES` (a ``regex:`` pattern must compile), else ValueError."""
    if rule in ("last-number", "boxed", "exact"):
        return rule
    if rule.startswith("regex:"):
        try:
            re.compile(rule[6:])
        except re.error as e:
            raise ValueError(f"--extract {rule!r}: the pattern does not compile ({e})") from None
        if not rule[6:]:
            raise ValueError("--extract regex: needs a pattern (regex:PATTERN)")
        return rule
    raise ValueError(f"--extract must be one of {list(EXTRACT_RULES)}, got {rule!r}")


def extract(text: str, rule: str) -> str | None:
    """The answer in generated ``text`` under ``rule`` (module docstring), None when there is none."""
    if rule == "exact":
        return text.strip()
    if rule == "last-number":
        found = _NUMBER.findall(text)
        return _number(found[-1]) if found else None
    if rule == "boxed":
        return _last_boxed(text)
    if rule.startswith("regex:"):
        matches = list(re.finditer(rule[6:], text))
        if not matches:
            return None
        m = matches[-1]
        return (m.group(1) if m.re.groups else m.group(0)).strip()
    raise ValueError(f"unknown extract rule {rule!r}; allowed: {list(EXTRACT_RULES)}")


def is_correct(extracted: str | None, answers: Sequence[str], rule: str) -> bool:
    """Whether an extracted answer equals one of ``answers`` (as numbers under ``last-number``)."""
    if extracted is None:
        return False
    if rule == "last-number":
        return any(_number(a) == extracted for a in answers) or extracted in (a.strip() for a in answers)
    if rule == "boxed":
        norm = extracted.replace(" ", "")
        return any(a.strip().replace(" ", "") == norm for a in answers)
    return any(a.strip() == extracted for a in answers)


def sample_metrics(extracted: Sequence[Any], correct: Sequence[bool]) -> dict:
    """pass@1 (the fraction right), pass@N (any right) and maj@N (the most frequent non-None extracted
    answer, ties to the first seen, is right) of one problem's ``N`` samples."""
    n = len(correct)
    if n == 0 or len(extracted) != n:
        raise ValueError(f"sample_metrics needs as many extracted answers as correct flags (>= 1), got "
                         f"{len(extracted)} and {n}")
    counts = Counter(e for e in extracted if e is not None)
    maj = False
    if counts:
        top = max(counts.values())
        winner = next(e for e in extracted if e is not None and counts[e] == top)
        maj = any(c for e, c in zip(extracted, correct) if e == winner)
    return {"pass@1": sum(map(bool, correct)) / n, f"pass@{n}": any(correct), f"maj@{n}": maj}
