"""``KVpopCache``: a transformers ``Cache`` of exactly ``B = s + w + k`` entries per layer and KV head.

Layout of one layer (batch 1, see ``kvpop_kernels.reference.fixed_budget_decode``): per KV
head ``B`` slots: ``[0, s)`` sinks, ``[s, s+w)`` a ring for the window (token ``t`` in slot
``s + (t - s) % w``), ``[s+w, B)`` the ``k`` long-range slots with their static
priorities.  Beside the keys and values it holds ``slot_pos`` (int32 ``[Hkv, B]``, the
position of each slot's token, ``-1`` when empty), ``slot_prio`` (``[Hkv, k]``), the
priorities of the tokens in the window (``ring_prio``, ``[Hkv, w]``) and, for the baseline
policies, an attention score per slot.  Nothing grows with the number of tokens seen;
``get_seq_length`` counts every token seen so that positions (RoPE) stay right.

How it plugs into transformers
------------------------------
A Qwen3 attention layer calls ``cache.update(k, v, layer_idx)`` and then the attention
function.  ``update`` cannot attend (it has no query), so it only stashes the new keys and
values and marks the layer as pending; the ``kvpop`` attention function (which received the
cache through a forward pre-hook on the attention module, see ``kvpop.core.layer``) then calls
:func:`cache_attention`, which does the real work:

* **prefill** (the first call, several tokens, a static-priority policy): priorities of the
  prompt -> ``eviction_schedule`` -> ``sparse_attention`` over the prompt, then the layer keeps
  exactly what the schedule keeps at the prompt's last position;
* **decode** (one token, or any later chunk token by token, and every token of the
  attention-scored baselines): the fused ``fixed_budget_decode`` step.

So prefill + decoding gives the same outputs as one teacher-forced ``sparse_attention``
forward with the same priorities (tested in ``tests/core/test_cache.py``).

Policies (``KVpopConfig.policy``)
---------------------------------
* ``"kvpop"``: the learned scorer's static priorities ``p = r_hat - t log(gamma)``;
* ``"streaming"``: one constant priority, so ties keep the newest: sinks + a sliding
  window of ``w + k`` tokens (StreamingLLM);
* ``"tova"``: a token's score is the attention it received from the latest query, averaged
  over the query heads of its group; the token leaving the window replaces the long-range
  slot of lowest score if its own score is higher (the decision at step ``q`` uses the scores
  of query ``q - 1``, the last one computed);
* ``"h2o"``: as ``tova`` with the attention accumulated over all queries so far.

The sinks and the window are protected under every policy, so all of them hold the same
``B`` entries.  Batch size 1 only: a larger batch raises ``NotImplementedError``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop_kernels import eviction_schedule, fixed_budget_decode, sparse_attention
from kvpop_kernels.decode import slot_of

POLICIES = ("kvpop", "streaming", "tova", "h2o")
_STATIC = ("kvpop", "streaming")


class KVpopCacheLayer(CacheLayerMixin):
    """One layer's fixed-budget cache (batch 1).  Built by :class:`KVpopCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, *, sinks: int, window: int, budget: int, policy: str = "kvpop"):
        super().__init__()
        if budget < sinks + window:
            raise ValueError(f"budget ({budget}) must be >= sinks + window ({sinks + window})")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.sinks, self.window, self.budget, self.policy = sinks, window, budget, policy
        self.k = budget - sinks - window
        self.seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scorer_state: Any = None  # recurrent scorer state (mLSTM), owned by the scorer

    # -- transformers' layer protocol ------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, hkv, _, d = key_states.shape
        dev = key_states.device
        self.device = dev
        self.dtype = key_states.dtype
        self.keys = torch.zeros(hkv, self.budget, d, dtype=key_states.dtype, device=dev)
        self.values = torch.zeros(hkv, self.budget, value_states.shape[-1], dtype=value_states.dtype, device=dev)
        self.slot_pos = torch.full((hkv, self.budget), -1, dtype=torch.int32, device=dev)
        self.slot_prio = torch.full((hkv, self.k), float("-inf"), dtype=torch.float32, device=dev)
        self.ring_prio = torch.full((hkv, self.window), float("-inf"), dtype=torch.float32, device=dev)
        self.score = torch.zeros(hkv, self.budget, dtype=torch.float32, device=dev)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise NotImplementedError(
                f"KVpopCache decodes one sequence at a time (batch size 1); got batch size {key_states.shape[0]}. "
                "Run the sequences one by one."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.slot_pos.fill_(-1)
            self.slot_prio.fill_(float("-inf"))
            self.ring_prio.fill_(float("-inf"))
            self.score.zero_()
        self.seen = 0
        self.pending = None
        self.scorer_state = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KVpopCache does not support beam search (batch size 1 only)")

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "KVpopCache cannot be cropped: it holds a fixed budget of entries and the tokens it evicted are gone. "
            "Start again from a fresh kvpop.KVpopCache(model), or call cache.reset() to empty this one."
        )

    # -- helpers -----------------------------------------------------------------------
    def slot_of(self, pos: int) -> int:
        """Slot of the token at ``pos`` while it is a sink or in the window."""
        return slot_of(pos, sinks=self.sinks, window=self.window)

    def nbytes(self) -> int:
        """Bytes held by this layer (constant once initialised)."""
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.slot_pos, self.slot_prio, self.ring_prio, self.score]
        total = sum(t.numel() * t.element_size() for t in tensors)
        state = self.scorer_state
        if isinstance(state, torch.Tensor):
            total += state.numel() * state.element_size()
        elif isinstance(state, (tuple, list)):
            total += sum(t.numel() * t.element_size() for t in state if isinstance(t, torch.Tensor))
        return total

    def long_range_positions(self) -> list[set[int]]:
        """Per KV head, the positions held in the long-range slots (for tests and inspection)."""
        pos = self.slot_pos[:, self.sinks + self.window:].tolist()
        return [{p for p in row if p >= 0} for row in pos]


class KVpopCache(Cache):
    """Fixed-budget cache for batch-1 decoding with a ``kvpop``-patched Qwen3 model.

    Args:
        model: a model patched by :func:`kvpop.patch` (its ``KVpopConfig`` is used), or None.
        config: a ``KVpopConfig`` (overrides the model's).
        num_layers: number of decoder layers (taken from the model when given).
        policy: override ``config.policy`` ("kvpop", "streaming", "tova", "h2o").

    Example::

        cache = kvpop.KVpopCache(model)
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)
    """

    def __init__(self, model: Any = None, *, config: Any = None, num_layers: int | None = None,
                 policy: str | None = None):
        if config is None and model is not None:
            config = getattr(model, "kvpop_config", None)
        if config is None:
            raise ValueError("KVpopCache needs a kvpop-patched model (kvpop.patch(model)) or config=KVpopConfig(...)")
        if num_layers is None:
            if model is None:
                raise ValueError("KVpopCache(config=...) also needs num_layers=")
            num_layers = model.config.get_text_config().num_hidden_layers
        policy = policy or getattr(config, "policy", "kvpop")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.kvpop_config = config
        self.policy = policy
        layers = [KVpopCacheLayer(sinks=config.sinks, window=config.window, budget=config.budget, policy=policy)
                  for _ in range(num_layers)]
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        """Bytes held by all layers: constant however many tokens were generated."""
        return sum(layer.nbytes() for layer in self.layers)


# ------------------------------------------------------------------------------------ attention
class PriorityHooks:
    """How a policy prices tokens.  ``kvpop.patch`` supplies the learned scorer's hooks.

    * ``prompt(module, layer, key, value) -> [1, Hkv, S]``: static priorities of a prompt (only those
      of ``t <= S - 1 - w`` matter; a recurrent scorer also leaves its state in ``layer.scorer_state``);
    * ``token(module, layer, key_new, value_new, pos) -> [Hkv]``: priority of a new token
      known at entry (stored until it leaves the window), or None;
    * ``leaving(module, layer, key_new, value_new, pos) -> [Hkv]``: priority of the token
      ``pos - w`` leaving the window now, computed at that moment (mLSTM), or None.  It is called
      at every decode step (None or anything is fine while ``pos - w < s``), before the step, so
      the leaving token's key/value are still in ``layer.keys/values`` at ``layer.slot_of(pos - w)``.
    """

    def __init__(self, prompt: Callable | None = None, token: Callable | None = None,
                 leaving: Callable | None = None):
        self.prompt, self.token, self.leaving = prompt, token, leaving


def _constant_prompt(module, layer, key, value):
    return torch.zeros(key.shape[0], key.shape[1], key.shape[2], dtype=torch.float32, device=key.device)


def _constant_token(module, layer, key_new, value_new, pos):
    return torch.zeros(key_new.shape[0], dtype=torch.float32, device=key_new.device)


STREAMING_HOOKS = PriorityHooks(prompt=_constant_prompt, token=_constant_token)


def cache_attention(cache: KVpopCache, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, *, scaling: float, hooks: PriorityHooks | None = None) -> torch.Tensor | None:
    """Attention of layer ``module.layer_idx`` through ``cache``; None when that layer has no update pending
    (``cache.update`` stashes the new keys/values, this call attends and writes them).

    ``query [1, Hq, S, D]``, ``key/value [1, Hkv, S, D]`` (rotated, as transformers passes them).
    Returns the attention output ``[1, S, Hq, D]`` in transformers' layout.
    """
    if module.layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[module.layer_idx]
    pending, layer.pending = layer.pending, None
    if pending is None or pending[0] is not key:  # stale: left by a forward that failed in between
        return None
    if layer.policy == "streaming":
        hooks = STREAMING_HOOKS
    elif layer.policy == "kvpop" and hooks is None:
        raise RuntimeError("the kvpop policy needs the model's scorer: patch the model with kvpop.patch(model)")
    _check_continues(layer, hooks)
    S = query.shape[2]
    if layer.seen == 0 and S > 1 and layer.policy in _STATIC:
        return _prefill(layer, module, query, key, value, scaling, hooks)
    outs = [_decode(layer, module, query[:, :, i], key[:, :, i], value[:, :, i], scaling, hooks) for i in range(S)]
    return torch.stack(outs, dim=0).unsqueeze(0)  # [1, S, Hq, D]


def _check_continues(layer: KVpopCacheLayer, hooks: Any) -> None:
    """Refuse a call whose first position is not the next one of this cache (e.g. a second ``generate``
    with the same prompt on a used cache): a fixed-budget cache cannot go back."""
    position_ids = getattr(hooks, "position_ids", None)
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() == 0:
        return
    first = int(position_ids.reshape(-1)[0])
    if first != layer.seen:
        raise ValueError(
            f"this KVpopCache has seen {layer.seen} tokens, so the next call must start at position {layer.seen}, "
            f"but it starts at position {first}. A fixed-budget cache cannot go back (evicted tokens are gone): "
            "use a fresh kvpop.KVpopCache(model) for a new prompt, or call cache.reset() first."
        )


def _prefill(layer: KVpopCacheLayer, module, query, key, value, scaling, hooks: PriorityHooks) -> torch.Tensor:
    s, w, k = layer.sinks, layer.window, layer.k
    S = key.shape[2]
    prio = hooks.prompt(module, layer, key, value).float()  # [1, Hkv, S]
    evict_at = eviction_schedule(prio, sinks=s, window=w, k=k)
    out, _ = sparse_attention(query, key, value, evict_at, sinks=s, window=w, scale=scaling)
    # keep exactly what the schedule keeps at the prompt's last position q = S - 1
    q = S - 1
    kk, vv, ev, pr = key[0], value[0], evict_at[0], prio[0]
    n_sink = min(s, S)
    layer.keys[:, :n_sink] = kk[:, :n_sink]
    layer.values[:, :n_sink] = vv[:, :n_sink]
    layer.slot_pos[:, :n_sink] = torch.arange(n_sink, dtype=torch.int32, device=kk.device)
    win = torch.arange(max(s, S - w), max(s, S), device=kk.device)  # empty while the prompt is all sinks
    if win.numel():
        slots = s + (win - s) % w
        layer.keys[:, slots] = kk[:, win]
        layer.values[:, slots] = vv[:, win]
        layer.slot_pos[:, slots] = win.to(torch.int32)
        layer.ring_prio[:, slots - s] = pr[:, win]
    if k > 0 and S - w > s:
        elig = torch.arange(s, q - w + 1, device=kk.device)
        kept = ev[:, elig] > q  # [Hkv, |E|], at most k per head
        n_kept = kept.sum(-1)
        # stable order: kept tokens first, by position
        order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)[:, :k]  # [Hkv, min(k,|E|)]
        toks = elig[order]  # positions
        valid = torch.arange(order.shape[1], device=kk.device).unsqueeze(0) < n_kept.unsqueeze(1)
        lr = s + w + torch.arange(order.shape[1], device=kk.device)
        hidx = torch.arange(kk.shape[0], device=kk.device).unsqueeze(1)
        layer.keys[hidx, lr] = torch.where(valid[..., None], kk[hidx, toks], layer.keys[hidx, lr])
        layer.values[hidx, lr] = torch.where(valid[..., None], vv[hidx, toks], layer.values[hidx, lr])
        layer.slot_pos[hidx, lr] = torch.where(valid, toks.to(torch.int32), layer.slot_pos[hidx, lr])
        layer.slot_prio[:, : order.shape[1]] = torch.where(valid, pr[hidx, toks], layer.slot_prio[:, : order.shape[1]])
    layer.seen = S
    return out.transpose(1, 2)


def _decode(layer: KVpopCacheLayer, module, q1, k1, v1, scaling, hooks: PriorityHooks) -> torch.Tensor:
    """One token: ``q1 [1, Hq, D]``, ``k1/v1 [1, Hkv, D]`` -> ``[Hq, D]``."""
    s, w = layer.sinks, layer.window
    pos = layer.seen
    q, kn, vn = q1[0], k1[0], v1[0]
    hkv = kn.shape[0]
    leaving_slot = layer.slot_of(max(pos, s))  # the ring slot token pos - w leaves (and pos takes)
    attention_scored = layer.policy in ("tova", "h2o")
    if attention_scored:
        leaving = layer.score[:, leaving_slot].clone()
        layer.slot_prio.copy_(layer.score[:, s + w:])
    elif hooks.leaving is not None:  # called at every step: a recurrent scorer absorbs the new token
        leaving = hooks.leaving(module, layer, kn, vn, pos)
        leaving = torch.zeros(hkv, device=kn.device) if leaving is None else leaving.float()
    else:
        leaving = layer.ring_prio[:, leaving_slot - s].clone() if pos >= s else torch.zeros(hkv, device=kn.device)
    out, lse = fixed_budget_decode(q, kn, vn, layer.keys, layer.values, layer.slot_pos, layer.slot_prio,
                                   leaving, pos=pos, sinks=s, window=w, scale=scaling)
    if pos >= s and hooks is not None and hooks.token is not None and not attention_scored:
        layer.ring_prio[:, leaving_slot - s] = hooks.token(module, layer, kn, vn, pos).float()
    if attention_scored:
        new_slot = layer.slot_of(pos)
        layer.score[:, s + w:] = layer.slot_prio
        layer.score[:, new_slot] = 0.0
        g = q.shape[0] // hkv
        logits = torch.einsum("hgd,hbd->hgb", q.float().view(hkv, g, -1), layer.keys.float()) * scaling
        prob = torch.exp(logits - lse.view(hkv, g, 1)).mean(1)  # [Hkv, B], averaged over the group
        prob = torch.where(layer.slot_pos >= 0, prob, torch.zeros_like(prob))
        if layer.policy == "tova":
            layer.score.copy_(prob)
        else:
            layer.score.add_(prob)
    layer.seen = pos + 1
    return out
