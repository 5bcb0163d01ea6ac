"""Generating answers through a policy's cache with transformers (the ``hf`` engine, :func:`generate_rows`).

The prompts go as one left-padded batch to ``model.generate`` with a :class:`kvpop.KVpopCache` (dense: the
model's own cache; ``dms``: one sequence at a time through a :class:`kvpop.baselines.dms.DMSCache`, whose gate
threshold is set on the prompt so that the prompt's mean entries per head are at most the budget,
:func:`kvpop.baselines.dms.budget.calibrate_threshold`).

Sampling is seeded per problem and sample: each row draws its token from its own ``torch.Generator``
(seeded by ``seed``, the problem's index and the sample number, :func:`row_seed`), inside a logits
processor that returns a one-hot score, so ``generate`` runs greedy on it.  A row's tokens therefore do not
depend on which rows share its batch, and a resumed run draws what the uninterrupted one drew.
``temperature=0`` is greedy decoding.  The cache bytes of a row: KVpop's fixed cache's bytes per row; dense:
the bytes of the row's own tokens in the model's cache; DMS: its ragged cache after the last token.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["row_seed", "generate_rows"]


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
    from kvpop.models import cache_kwarg_name
    from kvpop.policies import CACHE_POLICY

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
