"""TOVA and H2O: baselines that rank each cached token by the attention it receives while decoding, served by
``kvpop.KVpopCache(policy="tova" | "h2o")`` through the core's policy interface
(``kvpop.core.cache_policy.CachePolicy``).

Each layer keeps ``score [N, Hkv, B]`` float32, one per slot: the attention the slot's token received at the
last step (TOVA) or summed over every step since it entered (H2O), averaged over the query heads of its KV
head.  Before a step the long-range slots' priorities are their scores and the token leaving the window
carries its own; a new token starts at 0.  Neither is static (the prompt is decoded token by token), so both
keep uniform budgets and full-precision slots.
"""
from __future__ import annotations

import torch

from kvpop.core.cache_policy import CachePolicy, register_policy

__all__ = ["AttentionScoredPolicy", "TOVA", "H2O"]


class AttentionScoredPolicy(CachePolicy):
    """A token's priority is the attention it has received (``accumulate``: False keeps the last step's, TOVA;
    True sums every step's, H2O)."""

    static = False
    buffers = {"score": ("slots", 0.0)}

    def __init__(self, name: str, accumulate: bool):
        self.name, self.accumulate = name, accumulate

    def leaving(self, layer, step):
        s, w = layer.sinks, layer.window
        leaving = layer.score.gather(2, step.ring + s).squeeze(2)
        layer.slot_prio.copy_(layer.score[..., s + w:])
        return leaving

    def after(self, layer, step, lse):
        s, w = layer.sinks, layer.window
        N, hkv = step.k.shape[:2]
        score = layer.score
        score[..., s + w:] = layer.slot_prio  # the long-range slots as the step left them
        score.scatter_(2, layer.slot_of(layer.pos)[:, None, None].expand(N, hkv, 1), 0.0)  # the new token's slot
        g = step.q.shape[1] // hkv
        logits = torch.matmul(step.q.float().view(N, hkv, g, -1), layer.keys.float().transpose(-1, -2)) * step.scaling
        prob = torch.exp(logits - lse.view(N, hkv, g, 1)).mean(2)  # [N, Hkv, B], averaged over the group
        prob = torch.where(layer.slot_pos >= 0, prob, torch.zeros_like(prob))
        if self.accumulate:
            score.add_(prob)
        else:
            score.copy_(prob)


TOVA = register_policy(AttentionScoredPolicy("tova", accumulate=False))
H2O = register_policy(AttentionScoredPolicy("h2o", accumulate=True))
