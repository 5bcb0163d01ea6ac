"""Accuracy of generated answers per policy and budget (``kvpop eval --problems FILE.jsonl``).

A *problem* is a JSONL record ``{"prompt": "..."}`` or ``{"prompt_ids": [...]}`` with ``"answer"`` (a string
or a list of accepted strings) or ``"answer_ids"`` (token ids, for a model without a tokenizer), and an
optional ``"id"``.  Every problem is answered ``samples`` times under every policy and budget (dense
included) by batched generation through the policy's cache -- ``model.generate`` with a
:class:`kvpop.KVpopCache` on left-padded prompts (dense: the model's own cache; ``dms``: one sequence at a
time through a :class:`kvpop.baselines.dms.DMSCache`, whose gate threshold is set on the prompt so that the
prompt's mean entries per head are at most the budget, :func:`kvpop.baselines.dms.budget.calibrate_threshold`).

Sampling is seeded per problem and sample: each row draws its token from its own ``torch.Generator``
(seeded by ``seed``, the problem's index and the sample number, :func:`row_seed`), inside a logits
processor that returns a one-hot score, so ``generate`` runs greedy on it.  A row's tokens therefore do not
depend on which rows share its batch, and a resumed run draws what the uninterrupted one drew.
``temperature=0`` is greedy decoding (one generation per problem, counted ``samples`` times).

Scoring (:func:`extract`, :func:`is_correct`, :func:`sample_metrics`): a text answer is the generated text
(up to EOS) reduced by the ``extract`` rule -- ``last-number`` (the last number, commas dropped, compared as
a number), ``boxed`` (the content of the last ``\\boxed{...}``, braces balanced), ``regex:PATTERN`` (the last
match; its first group if it has one) or ``exact`` (the whole text, stripped) -- and is right when it
equals one of the accepted answers.  An ``answer_ids`` answer is the first ``len(answer_ids)`` generated
tokens, right when they equal ``answer_ids``.  Per problem: pass@1 = the fraction of right samples,
pass@N = any right, maj@N = the most frequent extracted answer (ties: the one seen first; no answer
extracted counts as wrong) is right.  Per policy and budget the table gives their means over problems, the
mean generated length (tokens up to and including EOS) and the peak cache bytes per sequence (KVpop: the
fixed cache's bytes per row; dense: the bytes of a row's own tokens in the model's cache; DMS: its ragged
cache after the last token).

Long runs (:func:`evaluate_problems` with ``out``): one line per (policy, budget, problem) is appended to
``OUT/problems.jsonl`` as soon as the problem's samples are done (generations included); ``resume`` reads
it back, checks that the settings match (``OUT/settings.json``) and runs only what is missing.  At the end
``results.json`` (only what the seeds and settings determine), ``table.md``, ``generations.jsonl`` and
``accuracy_vs_budget.png``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["Problem", "ProblemsConfig", "EXTRACT_RULES", "read_problems", "extract", "is_correct",
           "sample_metrics", "row_seed", "generate_rows", "evaluate_problems", "format_problems_table",
           "plot_problems", "VLLM_POLICIES", "VLLMModel", "VLLMEngine"]

EXTRACT_RULES = ("last-number", "boxed", "regex:PATTERN", "exact")
RESULTS_LOG = "problems.jsonl"
SETTINGS = "settings.json"


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
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
                                 ) from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise ValueError(f"{p}:{lineno}: not a record (JSON nested too deep to read)") from None
            except ValueError as e:  # e.g. an integer of more digits than Python converts
                raise ValueError(f"{p}:{lineno}: not valid JSON ({str(e)[:200]})") from None
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


# ------------------------------------------------------------------------------------ scoring
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


# ------------------------------------------------------------------------------------ generation
def row_seed(seed: int, problem: int, sample: int) -> int:
    """The seed of one (problem, sample) row's generator: a hash of the three, so rows are independent."""
    h = hashlib.sha256(f"{seed}/{problem}/{sample}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class _RowSampler:
    """A logits processor that samples each row's token from its own generator (temperature, top-p) and
    returns a one-hot score, so that greedy ``generate`` emits it."""

    def __init__(self, generators: list[torch.Generator], temperature: float, top_p: float):
        self.generators, self.temperature, self.top_p = generators, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            drop = sp.cumsum(-1) - sp > self.top_p  # keep the smallest prefix whose mass reaches top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        cdf = probs.cumsum(-1)
        u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in self.generators]).to(cdf.device)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[-1] - 1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, tok, 0.0)


def _dense_row_bytes(cache: Any, n_rows: int, row_tokens: Sequence[int]) -> list[int]:
    """Bytes of each row's own tokens in a dense (transformers) cache of ``n_rows`` rows."""
    total = tokens = 0
    for layer in getattr(cache, "layers", []):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(k, torch.Tensor) and k.numel():
            total += k.numel() * k.element_size() + v.numel() * v.element_size()
            tokens = k.shape[-2]
    per_token = total / max(1, n_rows * tokens)
    return [int(round(per_token * t)) for t in row_tokens]


@torch.no_grad()
def generate_rows(model: nn.Module, policy: str, budget: int | None, prompts: Sequence[Sequence[int]],
                  seeds: Sequence[int], *, max_new_tokens: int, temperature: float, top_p: float,
                  eos_token_id: int | list[int] | None, pad_token_id: int) -> list[tuple[list[int], int]]:
    """Generate one answer per prompt under ``policy`` at ``budget``: ``(tokens, cache bytes of the row)`` each.

    The prompts go as one left-padded batch (``dms``: one at a time); ``seeds[i]`` seeds row ``i``'s
    sampler (unused when ``temperature == 0``, greedy)."""
    from transformers import GenerationConfig, LogitsProcessorList

    from kvpop.core.budgets import rebudget
    from kvpop.core.cache import KVpopCache
    from kvpop.core.patching import get_config
    from kvpop.demo.evaluate import CACHE_POLICY
    from kvpop.models import cache_kwarg_name

    dev = next(model.parameters()).device
    if policy == "dms":
        from kvpop.baselines import dms as D
        from kvpop.baselines.dms.budget import calibrate_threshold

        out = []
        for prompt, seed in zip(prompts, seeds):
            ids = torch.tensor([list(prompt)], dtype=torch.int64, device=dev)
            thr = calibrate_threshold(model, ids, int(budget))
            D.patch_dms(model, threshold=thr)
            cache = D.DMSCache(model)
            (toks, _), = _generate(model, ids, torch.ones_like(ids), [seed], cache, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_p=top_p, eos_token_id=eos_token_id,
                                   pad_token_id=pad_token_id, GenerationConfig=GenerationConfig,
                                   LogitsProcessorList=LogitsProcessorList, cache_kw=cache_kwarg_name())
            out.append((toks, int(cache.nbytes())))
        return out
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), S), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, S - len(p):] = torch.tensor(list(p), dtype=torch.int64)
        mask[i, S - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    cache = None
    if policy != "dense":
        if budget is not None and get_config(model).budget != budget:
            rebudget(model, int(budget))
        cache = KVpopCache(model, policy=CACHE_POLICY[policy])
    rows = _generate(model, ids, mask, list(seeds), cache, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                     GenerationConfig=GenerationConfig, LogitsProcessorList=LogitsProcessorList,
                     cache_kw=cache_kwarg_name())
    if policy == "dense":
        used = rows[0][1]
        nbytes = _dense_row_bytes(used, len(prompts), [len(p) + len(t) - 1 for p, (t, _) in zip(prompts, rows)])
    else:
        nbytes = [int(cache.nbytes()) // len(prompts)] * len(prompts)
    return [(t, b) for (t, _), b in zip(rows, nbytes)]


def _generate(model, ids, mask, seeds, cache, *, max_new_tokens, temperature, top_p, eos_token_id, pad_token_id,
              GenerationConfig, LogitsProcessorList, cache_kw):
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                          pad_token_id=pad_token_id, return_dict_in_generate=True)
    procs = None
    if temperature > 0:
        dev = ids.device
        gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        procs = LogitsProcessorList([_RowSampler(gens, temperature, top_p)])
    kw = {} if cache is None else {cache_kw: cache}
    res = model.generate(ids, attention_mask=mask, generation_config=gc, logits_processor=procs, **kw)
    new = res.sequences[:, ids.shape[1]:].tolist()
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    out = []
    for row in new:
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append((row[:n], res.past_key_values))
    return out


# ------------------------------------------------------------------------------------ vLLM
VLLM_POLICIES = ("dense", "streaming", "fixed-finetune", "kvpop-mlp", "kvpop-mlstm", "kvpop-mlp-joint",
                 "kvpop-mlstm-joint")
"""The policies ``--engine vllm`` serves: those of the plugin (``kvpop.vllm``: the ``kvpop`` and ``streaming``
cache policies) and dense (vLLM without the plugin)."""


@dataclass
class VLLMModel:
    """What vLLM serves for one policy: the model directory, the plugin's cache policy (None: dense) and the
    scorer file (for ``kvpop``)."""

    model_dir: str
    cache_policy: str | None = None
    scorers: str | None = None


def vllm_overrides(spec: VLLMModel, *, sinks: int, window: int, budget: int) -> dict:
    """The ``hf_overrides`` that select kvpop's plugin (the ``kvpop_*`` keys of docs/DESIGN.md section 5, as
    ``kvpop.vllm.hf_overrides`` writes them; written here so that ``kvpop.vllm`` stays a leaf: the plugin checks
    them in vLLM's process)."""
    out: dict[str, Any] = {"architectures": ["KVpopQwen3ForCausalLM"], "kvpop_policy": spec.cache_policy,
                           "kvpop_config": {"sinks": sinks, "window": window, "budget": budget}}
    if spec.scorers is not None:
        out["kvpop_scorers"] = spec.scorers
    return out


class VLLMEngine:
    """Answers through vLLM (``LLM.generate``) with kvpop's plugin: one engine per policy and budget, built when
    first needed (the one before it released).  Called as :func:`generate_rows`; each request samples with its
    own seed (:func:`row_seed`; vLLM's sampler, so sampled answers differ from the hf engine's, greedy ones
    agree).  Cache bytes per sequence are those of the slots vLLM pages for the request: ``ceil(n /
    block_size)`` blocks of keys and values (``n``: the sequence's tokens, dense; the budget, kvpop)."""

    def __init__(self, *, sinks: int, window: int, dtype: str = "auto", block_size: int | None = None,
                 max_model_len: int | None = None, **llm_kwargs: Any) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise ValueError("--engine vllm needs vLLM installed (pip install vllm; kvpop's plugin is kvpop.vllm); "
                             "use --engine hf") from None
        self.sinks, self.window, self.dtype, self.block_size = sinks, window, dtype, block_size
        self.max_model_len, self.llm_kwargs = max_model_len, llm_kwargs
        self._key: Any = None
        self._llm: Any = None

    def _engine(self, spec: VLLMModel, budget: int | None) -> Any:
        key = (spec.model_dir, spec.cache_policy, spec.scorers, budget)
        if key != self._key:
            self.close()
            from vllm import LLM


            kw: dict[str, Any] = dict(model=spec.model_dir, skip_tokenizer_init=True, dtype=self.dtype,
                                      enable_prefix_caching=False, **self.llm_kwargs)
            if self.block_size is not None:
                kw["block_size"] = self.block_size
            if self.max_model_len is not None:
                kw["max_model_len"] = self.max_model_len
            if spec.cache_policy is not None:
                kw["hf_overrides"] = vllm_overrides(spec, sinks=self.sinks, window=self.window, budget=int(budget))
            self._llm, self._key = LLM(**kw), key
        return self._llm

    def close(self) -> None:
        """Release the current engine."""
        if self._llm is not None:
            import gc

            self._llm, self._key = None, None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __call__(self, spec: VLLMModel, policy: str, budget: int | None, prompts: Sequence[Sequence[int]],
                 seeds: Sequence[int], *, max_new_tokens: int, temperature: float, top_p: float,
                 eos_token_id: int | list[int] | None, pad_token_id: int) -> list[tuple[list[int], int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._engine(spec, budget)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                 seed=None if temperature == 0 else int(s) % (2**31), ignore_eos=True,
                                 stop_token_ids=eos, detokenize=False) for s in seeds]
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        cfg = llm.llm_engine.model_config
        hf = cfg.hf_text_config
        per_token = (2 * hf.num_hidden_layers * hf.num_key_value_heads * cfg.get_head_size()
                     * torch.tensor([], dtype=cfg.dtype).element_size())
        block = llm.llm_engine.vllm_config.cache_config.block_size
        rows = []
        for p, o in zip(prompts, outs):
            toks = list(o.outputs[0].token_ids)
            n = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
            held = budget if spec.cache_policy is not None else len(p) + n - 1
            rows.append((toks[:n], int(-(-held // block) * block * per_token)))
        return rows


# ------------------------------------------------------------------------------------ the run
@dataclass
class ProblemsConfig:
    """What :func:`evaluate_problems` measures (see the module docstring)."""

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


def _key(policy: str, budget: int | None, index: int) -> str:
    return f"{policy}|{budget}|{index}"


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


def _load_log(path: Path) -> dict[str, dict]:
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a line cut by the interruption: its problem runs again
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON; the results log is damaged (move it away to start "
                             f"over)") from None
        done[_key(row["policy"], row["budget"], row["index"])] = row
    # drop a torn last line so the next append starts a fresh line
    if raw and not raw.endswith(b"\n"):
        keep = raw[:raw.rfind(b"\n") + 1]
        path.write_bytes(keep)
    return done


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
    settings = cfg.settings()
    log = None
    done: dict[str, dict] = {}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        log, stamp = out / RESULTS_LOG, out / SETTINGS
        if resume and stamp.exists():
            prev = json.loads(stamp.read_text())
            if prev != json.loads(json.dumps(settings)):  # JSON round trip: tuples as lists
                now = json.loads(json.dumps(settings))
                diff = sorted(k for k in set(prev) | set(now) if prev.get(k) != now.get(k))
                raise ValueError(f"--resume: {out} holds a run with other settings ({', '.join(diff)} differ); "
                                 f"use another --out or the same settings")
            done = _load_log(log)
        elif log.exists() and log.stat().st_size:
            if not resume:
                raise ValueError(f"{log} exists (an earlier run); give --resume to continue it or another --out")
            raise ValueError(f"--resume: {out} holds {log.name} but not the {SETTINGS} of its run, so its settings "
                             f"cannot be checked; use another --out")
        stamp.write_text(json.dumps(settings, indent=1) + "\n")
    policies = [p for p in cfg.policies if p in models]
    combos = [(p, b) for p in policies for b in ([None] if p == "dense" else cfg.budgets)]
    greedy = cfg.temperature == 0
    n_gen = 1 if greedy else cfg.samples
    todo = [(p, b, pr) for p, b in combos for pr in problems if _key(p, b, pr.index) not in done]
    bar = None
    if cfg.progress and todo:
        from kvpop.progress import progress

        bar = progress(len(todo) * cfg.samples, desc="kvpop eval --problems")
    rows = dict(done)
    try:
        for p, b in combos:
            pending = [pr for pr in problems if _key(p, b, pr.index) not in done]
            items = [(pr, s) for pr in pending for s in range(n_gen)]
            got: dict[int, list] = {}
            for start in range(0, len(items), cfg.batch_size):
                chunk = items[start:start + cfg.batch_size]
                if bar is not None:
                    bar.set_postfix_str(f"{p}" + ("" if b is None else f" B={b}"))
                gens = (engine or generate_rows)(models[p], p, b, [pr.prompt_ids for pr, _ in chunk],
                                     [row_seed(cfg.seed, pr.index, s) for pr, s in chunk],
                                     max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                     eos_token_id=eos_token_id, pad_token_id=pad_token_id)
                for (pr, _), g in zip(chunk, gens):
                    got.setdefault(pr.index, []).append(g)
                    if len(got[pr.index]) == n_gen:
                        row = _problem_row(pr, p, b, got.pop(pr.index) * (cfg.samples if greedy else 1), decode,
                                           cfg.extract)
                        rows[_key(p, b, pr.index)] = row
                        if log is not None:
                            with log.open("a") as f:
                                f.write(json.dumps(row) + "\n")
                                f.flush()
                                os.fsync(f.fileno())
                        if bar is not None:
                            bar.update(cfg.samples)
                        if on_problem is not None:
                            on_problem(row)
    finally:
        if bar is not None:
            bar.close()
    return _results(rows, problems, combos, cfg)


def _results(rows: Mapping[str, dict], problems: Sequence[Problem], combos, cfg: ProblemsConfig) -> dict:
    from kvpop.demo.evaluate import POLICIES

    table = []
    for p, b in combos:
        rs = [rows[_key(p, b, pr.index)] for pr in problems]
        n = len(rs)
        table.append({"policy": p, "budget": b, "problems": n, "samples": cfg.samples,
                      "pass@1": sum(r["pass@1"] for r in rs) / n,
                      f"maj@{cfg.samples}": sum(r["maj@N"] for r in rs) / n,
                      f"pass@{cfg.samples}": sum(r["pass@N"] for r in rs) / n,
                      "mean_length": sum(r["mean_length"] for r in rs) / n,
                      "peak_cache_bytes_per_sequence": max(r["peak_cache_bytes"] for r in rs)})
    order = {p: i for i, p in enumerate(POLICIES)}
    table.sort(key=lambda r: (order.get(r["policy"], 99), r["budget"] or 0))
    dense = next((r["pass@1"] for r in table if r["policy"] == "dense"), None)
    for r in table:
        r["relative_pass@1"] = (r["pass@1"] / dense) if dense else None
    return {"settings": cfg.settings(), "n_problems": len(problems), "dense_pass@1": dense, "rows": table,
            "per_problem": [{k: v for k, v in rows[_key(p, b, pr.index)].items() if k != "samples"}
                            for p, b in combos for pr in problems]}


def generations(results_rows: Mapping[str, dict]) -> list[dict]:
    """``generations.jsonl``'s lines from the per-problem rows (one per sample)."""
    out = []
    for row in results_rows.values():
        for s, smp in enumerate(row["samples"]):
            out.append({"policy": row["policy"], "budget": row["budget"], "id": row["id"], "sample": s, **smp})
    return out


def format_problems_table(results: dict) -> str:
    """A markdown table: one row per policy and budget (maj@N and pass@N only with N > 1 samples)."""
    n = results["settings"]["samples"]
    many = [f"maj@{n}", f"pass@{n}"] if n > 1 else []
    head = ["policy", "budget", "pass@1", "rel. to dense", *many, "mean gen. length", "peak cache / seq."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        rel = r["relative_pass@1"]
        b = r["peak_cache_bytes_per_sequence"]
        size = f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"
        lines.append("| " + " | ".join([r["policy"], "-" if r["budget"] is None else str(r["budget"]),
                                        f"{r['pass@1']:.3f}", "-" if rel is None else f"{rel:.0%}",
                                        *(f"{r[k]:.3f}" for k in many), f"{r['mean_length']:.1f}",
                                        size]) + " |")
    return "\n".join(lines)


def plot_problems(results: dict, path: str | os.PathLike) -> None:
    """pass@1 vs budget, one line per policy, dense as a dashed line (PNG, matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    pols = list(dict.fromkeys(r["policy"] for r in results["rows"]))
    for p in pols:
        pts = sorted((r["budget"], r["pass@1"]) for r in results["rows"]
                     if r["policy"] == p and r["budget"] is not None)
        if p == "dense":
            d = next(r["pass@1"] for r in results["rows"] if r["policy"] == "dense")
            ax.axhline(d, color="black", linestyle="--", linewidth=1, label="dense")
        elif pts:
            ax.plot([b for b, _ in pts], [a for _, a in pts], marker="o", label=p)
    bs = sorted({r["budget"] for r in results["rows"] if r["budget"] is not None})
    if bs:
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs)
        ax.set_xticklabels([str(b) for b in bs])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("cache budget B (entries per KV head)")
    ax.set_ylabel("pass@1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def finish_problems(results: dict, out: Path | None, plot: bool) -> str:
    """Write ``results.json``, ``table.md``, ``generations.jsonl`` and the plot into ``out``; returns the table."""
    from kvpop.demo.evaluate import write_results

    table = format_problems_table(results)
    if out is not None:
        write_results(results, out / "results.json")
        (out / "table.md").write_text(table + "\n")
        log = _load_log(out / RESULTS_LOG)
        tmp = out / "generations.jsonl.tmp"
        with tmp.open("w") as f:
            for g in generations(log):
                f.write(json.dumps(g) + "\n")
        os.replace(tmp, out / "generations.jsonl")
        if plot:
            plot_problems(results, out / "accuracy_vs_budget.png")
    return table
