"""One ``kvpop eval --problems`` run (:func:`evaluate_problems`): every problem answered ``samples`` times under
every policy and budget, scored, logged as it finishes (:mod:`kvpop.answers.resume`) and summed up into the
``results.json`` object (:func:`results_dict`).

Per policy and budget the table gives the means over problems of pass@1, maj@N and pass@N
(:mod:`kvpop.answers.scoring`), the mean generated length (tokens up to and including EOS) and the peak cache
bytes per sequence (:mod:`kvpop.answers.generation`).  ``temperature=0`` is greedy decoding: one generation
per problem, counted ``samples`` times.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from kvpop.policies import policy_of, row_order

from . import generation
from .records import Problem
from .resume import append_row, open_log, row_key
from .scoring import check_rule, extract, is_correct, sample_metrics

__all__ = ["ProblemsConfig", "evaluate_problems", "results_dict"]


@dataclass
class ProblemsConfig:
    """What :func:`evaluate_problems` measures (:mod:`kvpop.answers`)."""

    budgets: Sequence[int] = (128, 256, 512)
    policies: Sequence[str] = ("dense",)
    samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 256
    extract: str = "last-number"
    batch_size: int = 8
    sinks: int = 4
    window: int = 32
    progress: bool = True
    problems_file: str = ""
    problems_sha256: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, low in (("samples", 1), ("max_new_tokens", 1), ("batch_size", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= {low}, got {v!r}")
        t = self.temperature
        if not (isinstance(t, (int, float)) and t >= 0 and math.isfinite(t)):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p!r}")
        check_rule(self.extract)
        self.budgets = [int(b) for b in self.budgets]
        least = self.sinks + self.window + 1
        small = [b for b in self.budgets if b < least]
        if small:
            raise ValueError(f"budget(s) {small} too small: every budget must be >= sinks + window + 1 = "
                             f"{self.sinks} + {self.window} + 1 = {least}; raise --budgets or lower --window/--sinks")
        if not self.budgets and any(p != "dense" for p in self.policies):
            raise ValueError("--budgets lists no budget")

    def settings(self) -> dict:
        """What a resumed run must share with the run it continues."""
        d = asdict(self)
        d.pop("progress")
        return d


def _problem_row(pr: Problem, policy: str, budget: int | None, gens: list[tuple[list[int], int]], decode, rule: str
                 ) -> dict:
    samples, extracted, correct = [], [], []
    for toks, nbytes in gens:
        if pr.answer_ids is not None:
            ans = toks[:len(pr.answer_ids)]
            ok = ans == pr.answer_ids
            ex: Any = tuple(ans)
            text = None
        else:
            text = decode(toks)
            ex = extract(text, rule)
            ok = is_correct(ex, pr.answers, rule)
        extracted.append(ex)
        correct.append(ok)
        samples.append({"tokens": toks, "text": text, "extracted": list(ex) if isinstance(ex, tuple) else ex,
                        "correct": ok, "length": len(toks), "cache_bytes": nbytes})
    m = sample_metrics(extracted, correct)
    return {"policy": policy, "budget": budget, "index": pr.index, "id": pr.id, "pass@1": m["pass@1"],
            "pass@N": m[f"pass@{len(gens)}"], "maj@N": m[f"maj@{len(gens)}"],
            "mean_length": sum(s["length"] for s in samples) / len(samples),
            "peak_cache_bytes": max(s["cache_bytes"] for s in samples), "samples": samples}


def evaluate_problems(models: Mapping[str, nn.Module], problems: Sequence[Problem], cfg: ProblemsConfig, *,
                      decode: Callable[[list[int]], str] | None = None, eos_token_id: Any = None,
                      pad_token_id: int = 0, out: str | os.PathLike | None = None, resume: bool = False,
                      on_problem: Callable[[dict], None] | None = None, engine: Callable | None = None) -> dict:
    """Answer every problem ``cfg.samples`` times under every policy of ``models`` (policy -> model, as
    :func:`kvpop.cli.trained.policy_models` builds them) and budget; returns the ``results.json`` object.

    ``decode``: token ids -> text (the tokenizer's; needed for text answers).  ``out``: the directory of the
    results log (appended per problem, module docstring); ``resume``: continue the log there (settings must
    match), else an existing log is refused.  ``on_problem``: called with each problem's row once logged."""
    if "dense" not in models:
        raise ValueError("evaluate_problems needs the dense model (models['dense'])")
    if decode is None and any(p.answers is not None for p in problems):
        raise ValueError("text answers need decode= (the tokenizer's decode)")
    log = None
    done: dict[str, dict] = {}
    if out is not None:
        log, done = open_log(Path(out), cfg.settings(), resume)
    policies = [p for p in cfg.policies if p in models]
    combos = [(p, b) for p in policies for b in ([None] if p == "dense" else cfg.budgets)]
    greedy = cfg.temperature == 0
    n_gen = 1 if greedy else cfg.samples
    todo = [(p, b, pr) for p, b in combos for pr in problems if row_key(p, b, pr.index) not in done]
    bar = None
    if cfg.progress and todo:
        from kvpop.progress import progress

        bar = progress(len(todo) * cfg.samples, desc="kvpop eval --problems")
    rows = dict(done)
    try:
        for p, b in combos:
            pending = [pr for pr in problems if row_key(p, b, pr.index) not in done]
            items = [(pr, s) for pr in pending for s in range(n_gen)]
            got: dict[int, list] = {}
            for start in range(0, len(items), cfg.batch_size):
                chunk = items[start:start + cfg.batch_size]
                if bar is not None:
                    bar.set_postfix_str(f"{p}" + ("" if b is None else f" B={b}"))
                gens = (engine or generation.generate_rows)(
                    models[p], policy_of(p), b, [pr.prompt_ids for pr, _ in chunk],
                    [generation.row_seed(cfg.seed, pr.index, s) for pr, s in chunk], max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature, top_p=cfg.top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
                for (pr, _), g in zip(chunk, gens):
                    got.setdefault(pr.index, []).append(g)
                    if len(got[pr.index]) == n_gen:
                        row = _problem_row(pr, p, b, got.pop(pr.index) * (cfg.samples if greedy else 1), decode,
                                           cfg.extract)
                        rows[row_key(p, b, pr.index)] = row
                        if log is not None:
                            append_row(log, row)
                        if bar is not None:
                            bar.update(cfg.samples)
                        if on_problem is not None:
                            on_problem(row)
    finally:
        if bar is not None:
            bar.close()
    return results_dict(rows, problems, combos, cfg)


def results_dict(rows: Mapping[str, dict], problems: Sequence[Problem], combos, cfg: ProblemsConfig) -> dict:
    """The ``results.json`` object of the run's per-problem ``rows``: one table row per policy and budget (the
    means over problems), in :data:`kvpop.policies.POLICIES` order, and the per-problem rows without samples."""
    table = []
    for p, b in combos:
        rs = [rows[row_key(p, b, pr.index)] for pr in problems]
        n = len(rs)
        table.append({"policy": p, "budget": b, "problems": n, "samples": cfg.samples,
                      "pass@1": sum(r["pass@1"] for r in rs) / n,
                      f"maj@{cfg.samples}": sum(r["maj@N"] for r in rs) / n,
                      f"pass@{cfg.samples}": sum(r["pass@N"] for r in rs) / n,
                      "mean_length": sum(r["mean_length"] for r in rs) / n,
                      "peak_cache_bytes_per_sequence": max(r["peak_cache_bytes"] for r in rs)})
    table.sort(key=lambda r: (row_order(r["policy"]), r["budget"] or 0))
    dense = next((r["pass@1"] for r in table if r["policy"] == "dense"), None)
    for r in table:
        r["relative_pass@1"] = (r["pass@1"] / dense) if dense else None
    return {"settings": cfg.settings(), "n_problems": len(problems), "dense_pass@1": dense, "rows": table,
            "per_problem": [{k: v for k, v in rows[row_key(p, b, pr.index)].items() if k != "samples"}
                            for p, b in combos for pr in problems]}
