"""How a ``KVpopCache`` prices its tokens while decoding: one :class:`CachePolicy` object per policy name.

The cache calls a layer's policy at each decode step (:meth:`CachePolicy.leaving` before the fused step,
:meth:`CachePolicy.after` after it) and allocates, resets and counts the per-row buffers the policy declares
(:attr:`CachePolicy.buffers`), nothing more.  The core registers the static policies, whose priorities come from
:class:`PriorityHooks` (``"kvpop"``: the learned scorer's; ``"streaming"``: constants); a baseline registers its
own (``kvpop.baselines.attention_scores``: TOVA and H2O) with :func:`register_policy`.  Contract:
docs/DESIGN.md section 7.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CachePolicy", "HookedPolicy", "PriorityHooks", "STREAMING_HOOKS", "StepInput", "cache_policy",
           "register_policy", "registered_policies"]


class PriorityHooks:
    """How a policy prices tokens.  ``kvpop.patch`` supplies the learned scorer's hooks.

    Shapes: ``N`` batch rows, ``pos [N]`` int64 the position of each row's new token (on the
    device: a hook must not read it back to the host), ``i`` the new token's column in this call.

    * ``prompt(module, layer, key, value) -> [N, Hkv, S]``: static priorities of a prompt of ``S`` real
      tokens per row (only those of ``t <= S - 1 - w`` matter; a recurrent scorer also leaves its state
      in ``layer.scorer_state``);
    * ``token(module, layer, key_new, value_new, pos, i) -> [N, Hkv]``: priority of a new token
      known at entry (stored until it leaves the window), or None;
    * ``leaving(module, layer, key_new, value_new, pos, i) -> [N, Hkv]``: priority of the token
      ``pos - w`` leaving the window now, computed at that moment (mLSTM), or None.  It is called
      at every decode step (anything is fine in rows where ``pos - w < s``), before the step, so
      the leaving token's key/value are still in ``layer.keys/values`` at ``layer.slot_of(pos - w)``;
    * ``rows(idx, start) -> PriorityHooks`` (optional): the hooks of the rows ``idx`` and the columns
      ``start:`` of this call (the prefill of a group of left-padded rows).
    """

    def __init__(self, prompt: Callable | None = None, token: Callable | None = None,
                 leaving: Callable | None = None):
        self.prompt, self.token, self.leaving = prompt, token, leaving


def _constant_prompt(module, layer, key, value):
    return torch.zeros(key.shape[0], key.shape[1], key.shape[2], dtype=torch.float32, device=key.device)


def _constant_token(module, layer, key_new, value_new, pos, i):
    return torch.zeros(key_new.shape[0], key_new.shape[1], dtype=torch.float32, device=key_new.device)


STREAMING_HOOKS = PriorityHooks(prompt=_constant_prompt, token=_constant_token)


@dataclass
class StepInput:
    """One decode step of a layer as its policy sees it: the attention ``module``, the new token's query ``q [N,
    Hq, D]``, key and value ``k, v [N, Hkv, D]``, the window-ring index ``ring [N, Hkv, 1]`` of the slot it
    takes (int64), its column ``i`` in the call, the softmax ``scaling`` and the ``hooks`` the step runs with.
    The rows' positions are ``layer.pos`` (advanced after the step)."""

    module: Any
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ring: torch.Tensor
    i: int
    scaling: float
    hooks: PriorityHooks | None


class CachePolicy:
    """What a ``KVpopCache`` policy answers.

    * ``name``: the ``policy=`` string it is registered under;
    * ``static``: whether a token's priority is fixed when it enters (the prompt is then filled by the eviction
      schedule in one call, and head-adaptive budgets and quantised slots are allowed); otherwise the prompt is
      decoded token by token;
    * ``buffers``: the per-row float32 tensors the policy keeps on each layer, ``name -> (shape, initial
      value)`` with ``shape`` ``"window"`` (``[N, Hkv, w]``) or ``"slots"`` (``slot_pos``'s shape); the cache
      allocates exactly these (as attributes of the layer), resets and counts them (``nbytes``).
    """

    name = ""
    static = True
    buffers: dict[str, tuple[str, float]] = {}

    def hooks(self, given: PriorityHooks | None) -> PriorityHooks | None:
        """The hooks a step runs with, given the model's (None for an unpatched call)."""
        return given

    def leaving(self, layer: Any, step: StepInput) -> torch.Tensor:
        """Before the fused step: the priority ``[N, Hkv]`` float32 of the token ``pos - w`` leaving the window
        (ignored in rows where ``pos - w < s``); a policy may also rewrite ``layer.slot_prio`` here."""
        raise NotImplementedError

    def after(self, layer: Any, step: StepInput, lse: torch.Tensor) -> None:
        """After the fused step (``lse [N, Hq]`` its natural-log normalisers): update the policy's buffers."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class HookedPolicy(CachePolicy):
    """Static priorities from :class:`PriorityHooks`: each token's priority, known when it enters (``token``) or
    when it leaves the window (``leaving``), is kept in ``ring_prio`` while the token is in the window."""

    static = True
    buffers = {"ring_prio": ("window", float("-inf"))}

    def __init__(self, name: str, hooks: PriorityHooks | None = None):
        self.name, self._hooks = name, hooks

    def hooks(self, given):
        if self._hooks is not None:
            return self._hooks
        if given is None:
            raise RuntimeError(f"the {self.name} policy needs the model's scorer: patch the model with "
                               f"kvpop.patch(model)")
        return given

    def leaving(self, layer, step):
        hooks = step.hooks
        if hooks.leaving is not None:  # called at every step: a recurrent scorer absorbs the new token
            leaving = hooks.leaving(step.module, layer, step.k, step.v, layer.pos, step.i)
            return torch.zeros(step.k.shape[:2], device=step.k.device) if leaving is None else leaving.float()
        return layer.ring_prio.gather(2, step.ring).squeeze(2)  # ignored by the step in rows where pos - w < s

    def after(self, layer, step, lse):
        hooks = step.hooks
        if hooks is None or hooks.token is None:
            return
        pos = layer.pos
        new = hooks.token(step.module, layer, step.k, step.v, pos, step.i).float()  # [N, Hkv]
        old = layer.ring_prio.gather(2, step.ring).squeeze(2)
        layer.ring_prio.scatter_(2, step.ring, torch.where((pos >= layer.sinks)[:, None], new, old).unsqueeze(2))


_REGISTRY: dict[str, CachePolicy] = {}


def register_policy(policy: CachePolicy) -> CachePolicy:
    """Make ``policy`` what ``KVpopCache(policy=policy.name)`` decodes with.  ``ValueError`` for a name taken by
    another policy object."""
    if not isinstance(policy, CachePolicy) or not policy.name:
        raise TypeError(f"register_policy takes a named CachePolicy, got {policy!r}")
    held = _REGISTRY.get(policy.name)
    if held is not None and held is not policy:
        raise ValueError(f"a cache policy named {policy.name!r} is registered already ({held!r})")
    _REGISTRY[policy.name] = policy
    return policy


def registered_policies(static: bool | None = None) -> tuple[str, ...]:
    """The registered policy names in registration order (``static``: only those that are, or are not)."""
    return tuple(n for n, p in _REGISTRY.items() if static is None or p.static == static)


def cache_policy(name: str) -> CachePolicy:
    """The registered policy ``name``; ``ValueError`` naming the registered ones otherwise."""
    policy = _REGISTRY.get(name) if isinstance(name, str) else None
    if policy is None:
        raise ValueError(f"policy must be one of {registered_policies()}, got {name!r}")
    return policy


register_policy(HookedPolicy("kvpop"))
register_policy(HookedPolicy("streaming", STREAMING_HOOKS))
