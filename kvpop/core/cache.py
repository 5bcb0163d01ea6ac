"""``KVpopCache``: a transformers ``Cache`` of exactly ``B = s + w + k`` entries per layer, batch row and KV head.

``update`` only stashes the new keys and values (it has no query); the ``kvpop`` attention function then
calls :func:`cache_attention`, which prefills (schedule + sparse attention over the prompt) or takes one
fused ``fixed_budget_decode`` step.  A layer holds its slots as one ``kvpop_kernels.layout.SlotState`` (keys,
values, positions, priorities, a quantised layout's scales) in its layout, and prices tokens through its
policy object (``kvpop.core.cache_policy``: the cache calls it, allocates and counts the buffers it declares,
and names no policy itself).  The slot layout, batches and padding, the policies and the no-host-sync rule
are the contract in docs/DESIGN.md (sections 5 and 7).

A cache checks at each layer's first call that the model it serves is patched for it with the same
``sinks``/``window``/``budget`` (:class:`ServedCache`: the patched attention's pre-hook claims it); an
unpatched, DMS-patched or ``kvpop.disabled`` model is refused with a ``ValueError`` (docs/HARDENING.md).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop_kernels import eviction_schedule, fixed_budget_decode, sparse_attention
from kvpop_kernels.layout import (
    KV_DTYPES,
    PackedLayout,
    QuantizedLayout,
    SlotLayout,
    SlotState,
    UniformLayout,
    check_kv_dtype,
    slot_of,
)

from .cache_policy import PriorityHooks, StepInput, cache_policy, registered_policies
from .config import MAX_SLOTS, check_budget_for

__all__ = ["KVpopCache", "KVpopCacheLayer", "PriorityHooks", "ServedCache", "cache_attention", "cache_settings"]


def _map_state(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor of a scorer state (None, a tensor, or a tuple/list of tensors)."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return fn(state)
    return type(state)(fn(t) if isinstance(t, torch.Tensor) else t for t in state)


def _slot_field(name: str, doc: str) -> property:
    """A layer's attribute that is the field ``name`` of its slot state (None before the first call; transformers'
    layer protocol assigns ``keys``/``values``, e.g. ``None`` at construction)."""
    def get(self):
        return None if self.slots is None else getattr(self.slots, name)

    def put(self, value):
        if self.slots is not None:
            setattr(self.slots, name, value)
        elif value is not None:
            raise AttributeError(f"{name} of a KVpopCacheLayer lives in its slot state, built at the first call")
    return property(get, put, doc=doc)


class KVpopCacheLayer(CacheLayerMixin):
    """One layer's fixed-budget cache (batch ``N >= 1``).  Built by :class:`KVpopCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    slots: SlotState | None = None  # the slot state, once the first call brings the shapes

    def __init__(self, *, sinks: int, window: int, budget: int, policy: str = "kvpop",
                 head_budgets: tuple[int, ...] | None = None, kv_dtype: str | None = None):
        super().__init__()
        if budget < sinks + window:
            raise ValueError(f"budget ({budget}) must be >= sinks + window ({sinks + window})")
        if budget > MAX_SLOTS:
            raise ValueError(f"budget ({budget}) must be <= {MAX_SLOTS} slots (cache positions are int32)")
        self.cache_policy = rule = cache_policy(policy)  # ValueError naming the registered ones
        static = registered_policies(static=True)
        if head_budgets is not None:
            head_budgets = tuple(head_budgets)
            if not rule.static:
                raise ValueError(
                    f"policy={policy!r} keeps uniform budgets (its attention scores are kept per slot of a "
                    f"[heads, budget] layout); head_budgets works with the policies {static}: pass one of them, "
                    f"or a config without head_budgets")
            if any(b < sinks + window for b in head_budgets) or sum(head_budgets) > MAX_SLOTS:
                raise ValueError(f"head_budgets {head_budgets} must each be >= sinks + window ({sinks + window}) "
                                 f"and sum to at most {MAX_SLOTS} slots")
        check_kv_dtype(kv_dtype)
        if kv_dtype is not None and not rule.static:
            raise ValueError(f"policy={policy!r} scores every slot's attention from full-precision keys; kv_dtype="
                             f"{kv_dtype!r} works with the policies {static}: pass one of them, or kv_dtype=None")
        self.sinks, self.window, self.budget, self.policy = sinks, window, budget, policy
        self.k = budget - sinks - window
        # head-adaptive budgets: one packed row of T = sum(B_h) slots per batch row (kvpop_kernels'
        # packed layout, docs/DESIGN.md section 9); ``budget`` stays the config's mean
        self.head_budgets = head_budgets
        self.layout: SlotLayout = UniformLayout(budget) if head_budgets is None else PackedLayout(head_budgets)
        # quantised slots: keys and values in 8 bits with one float32 scale per slot and KV head (k_scale,
        # v_scale: the layout's extra state), the priorities in float32
        self.kv_dtype = kv_dtype
        if kv_dtype is not None:
            self.layout = QuantizedLayout(kv_dtype, self.layout)
        # the per-row tensors beside the slots (batch dimension first): positions and the policy's buffers
        self._row_state = ("pos", *rule.buffers)
        self.seen = 0  # columns seen (padding included): transformers' view of the sequence length
        # the same count as a device tensor: what a compiled step updates (a Python int changed inside a
        # compiled graph would be a guard, i.e. one recompilation per token); ``seen`` follows it lazily
        self._seen_t = torch.zeros((), dtype=torch.int64)
        self._seen_stale = False
        self.prefilled = False
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scorer_state: Any = None  # recurrent scorer state (mLSTM), batch first, owned by the scorer

    # -- transformers' layer protocol ------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n, hkv, _, d = key_states.shape
        dev = key_states.device
        self.device = dev
        self.dtype = key_states.dtype
        self.num_kv_heads = hkv
        if self.head_budgets is not None and len(self.head_budgets) != hkv:
            raise ValueError(f"this KVpopCache's head_budgets hold {len(self.head_budgets)} KV heads per layer but "
                             f"the model's layer has {hkv}: allocate budgets for this model")
        self._head_offs = torch.tensor([sp.off for sp in self.spans()], dtype=torch.int64, device=dev)
        self.slots = self.layout.empty_state(n, hkv, self.sinks, self.window, k_dim=d, v_dim=value_states.shape[-1],
                                             dtype=key_states.dtype, device=dev)
        shapes = {"window": (n, hkv, self.window), "slots": tuple(self.slots.slot_pos.shape)}
        for name, (shape, init) in self.cache_policy.buffers.items():  # only what the policy declares
            setattr(self, name, torch.full(shapes[shape], init, dtype=torch.float32, device=dev))
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self._seen_t = self._seen_t.to(dev)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or (not self.prefilled and key_states.shape[0] != self.keys.shape[0]):
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"this KVpopCache holds {self.keys.shape[0]} sequences but the call has batch size "
                f"{key_states.shape[0]}; use a fresh kvpop.KVpopCache(model) (or cache.reset()) for a new batch"
            )
        elif key_states.shape[1] != self.num_kv_heads or key_states.shape[-1] != self.keys.shape[-1]:
            raise ValueError(
                f"this KVpopCache holds {self.num_kv_heads} KV heads of size {self.keys.shape[-1]} but the call "
                f"brings {key_states.shape[1]} of size {key_states.shape[-1]} (another model?); use a fresh "
                f"kvpop.KVpopCache(model) for each model"
            )
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if torch.compiler.is_compiling():  # the "kvpop" mask function reads no size: any constant does
            return query_length, 0
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if torch.compiler.is_compiling():
            return self._seen_t  # a tensor, as transformers' StaticLayer returns (no guard on a Python int)
        if self._seen_stale:  # compiled steps ran since: read the count once (outside the per-token path)
            self.seen, self._seen_stale = int(self._seen_t), False
        return self.seen

    def _advance(self, n: int) -> None:
        self._seen_t.add_(n)
        if torch.compiler.is_compiling():
            self._seen_stale = True
        else:
            self.get_seq_length()
            self.seen += n

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.is_initialized:
            self.slots.reset()
            for name, (_, init) in self.cache_policy.buffers.items():
                getattr(self, name).fill_(init)
            self.pos.zero_()
        self._seen_t.zero_()
        self.seen, self._seen_stale = 0, False
        self.prefilled = False
        self.pending = None
        self.scorer_state = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes the old row ``beam_idx[i]`` (in place, shapes and storage kept)."""
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.keys.device)
        for t in self.row_tensors():
            t.copy_(t.index_select(0, idx))
        _map_state(self.scorer_state, lambda t: t.copy_(t.index_select(0, idx)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (the batch shrinks)."""
        self._map_rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (e.g. to sample several continuations of one prefill)."""
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "KVpopCache cannot be cropped: it holds a fixed budget of entries and the tokens it evicted are gone. "
            "Start again from a fresh kvpop.KVpopCache(model), or call cache.reset() to empty this one."
        )

    # -- the state -----------------------------------------------------------------------
    keys = _slot_field("k_cache", "The slots' keys (a quantised layout's codes).")
    values = _slot_field("v_cache", "The slots' values (a quantised layout's codes).")
    slot_pos = _slot_field("slot_pos", "Each slot's token position, -1 when empty.")
    slot_prio = _slot_field("slot_prio", "The long-range slots' priorities.")
    k_scale = _slot_field("k_scale", "A quantised layout's key scales (None otherwise).")
    v_scale = _slot_field("v_scale", "A quantised layout's value scales (None otherwise).")

    def row_tensors(self) -> list[torch.Tensor]:
        """Every per-row tensor of the layer (batch dimension first) but the scorer's state: the slot state,
        the positions and the policy's buffers."""
        return self.slots.tensors() + [getattr(self, name) for name in self._row_state]

    # -- rows ----------------------------------------------------------------------------
    def _map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.is_initialized:
            return
        self.slots = self.slots.map(fn)
        for name in self._row_state:
            setattr(self, name, fn(getattr(self, name)))
        self.scorer_state = _map_state(self.scorer_state, fn)

    def rows(self, idx: torch.Tensor) -> KVpopCacheLayer:
        """A new layer holding copies of the rows ``idx`` (scatter it back with :meth:`set_rows`)."""
        sub = KVpopCacheLayer(sinks=self.sinks, window=self.window, budget=self.budget, policy=self.policy,
                              head_budgets=self.head_budgets, kv_dtype=self.kv_dtype)
        sub.slots = self.slots.map(lambda t: t[idx])
        for name in self._row_state:
            setattr(sub, name, getattr(self, name)[idx])
        sub.scorer_state = _map_state(self.scorer_state, lambda t: t[idx])
        sub.device, sub.dtype, sub.is_initialized = self.device, self.dtype, True
        sub.num_kv_heads = self.num_kv_heads
        sub._head_offs = self._head_offs
        sub.seen, sub.prefilled = self.seen, self.prefilled
        return sub

    def set_rows(self, idx: torch.Tensor, sub: KVpopCacheLayer) -> None:
        """Write the rows of ``sub`` (from :meth:`rows`) back to the rows ``idx``."""
        for dst, src in zip(self.row_tensors(), sub.row_tensors()):
            dst[idx] = src
        if sub.scorer_state is not None:
            if self.scorer_state is None:
                n = self.keys.shape[0]
                self.scorer_state = _map_state(sub.scorer_state, lambda t: t.new_zeros((n, *t.shape[1:])))
            for dst, src in zip(_tensors(self.scorer_state), _tensors(sub.scorer_state)):
                dst[idx] = src

    # -- helpers -----------------------------------------------------------------------
    def slot_of(self, pos):
        """Slot of the token at ``pos`` (an int or an integer tensor) while it is a sink or in the window."""
        return slot_of(pos, sinks=self.sinks, window=self.window)

    def spans(self) -> list[tuple[int, int, int, int]]:
        """``(slot offset, budget, long-range offset, k)`` of each KV head (``kvpop_kernels.layout.HeadSpan``;
        offsets 0 in the uniform layout, whose heads are a dimension of their own)."""
        return self.layout.spans(self.num_kv_heads, self.sinks, self.window)

    def window_values(self, t: torch.Tensor) -> torch.Tensor:
        """The values ``[N, Hkv, D]`` of each row's token ``t [N]`` (int64, on the device) while it is a sink or in
        the window, in either layout (no host read)."""
        return self.layout.read_slots(self.slots, "v", self.slot_of(t), self._head_offs)

    def nbytes(self) -> int:
        """Bytes held by this layer (constant once initialised): the slot state, the positions, the buffers its
        policy declares and the scorer's state."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in self.row_tensors() + _tensors(self.scorer_state))

    def long_range_positions(self, row: int = 0) -> list[set[int]]:
        """Per KV head of batch row ``row``, the positions held in the long-range slots (for tests and inspection)."""
        pos = self.layout.long_range_positions(self.slot_pos, row, self.num_kv_heads, self.sinks, self.window)
        return [{p for p in r if p >= 0} for r in pos]


def _tensors(state: Any) -> list[torch.Tensor]:
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [state]
    return [t for t in state if isinstance(t, torch.Tensor)]


class ServedCache:
    """The check, at each layer's first call, that the model a cache serves is patched for it (mixin of
    ``KVpopCache`` and ``DMSCache``).  A subclass sets ``served_by`` (the patch's name), ``served_fields``
    (the config fields that must equal the model's), ``served_how`` (how to patch a model for it) and
    keeps its config in ``served_config``."""

    served_by = ""
    served_fields: tuple[str, ...] = ()
    served_how = ""
    served_ctor = ""  # how to build one for a model, e.g. "kvpop.KVpopCache(model)"

    def claim(self, layer_idx: int, patch: str, config: Any, active: bool, n_new: int | None = None) -> None:
        """Called by a patched attention module's forward pre-hook before the module updates this cache:
        ``patch`` the patch's name (``"kvpop"``, ``"dms"``), ``config`` its config, ``active`` whether the
        model runs that patch's attention now (False under ``kvpop.disabled``), ``n_new`` the number of
        new tokens of the call.  Records the claim for the layer's first :meth:`update` (the rest of the
        calls return at once)."""
        layers = self.layers
        if not 0 <= layer_idx < len(layers):
            raise ValueError(f"this {type(self).__name__} was built for {len(layers)} layers but is given to a "
                             f"model with a layer {layer_idx}: build it from the model it serves ({self.served_ctor})")
        layer = layers[layer_idx]
        if n_new == 0 and layer.get_seq_length() > 0:
            raise ValueError(
                f"this {type(self).__name__} has seen {layer.get_seq_length()} tokens and the call brings no new "
                f"one: a prompt no longer than what the cache has seen (generate passes only the tokens past the "
                f"cache's length). Use a fresh {self.served_ctor} for a new prompt, or call cache.reset()")
        if not getattr(layer, "prefilled", False):
            self._claims[layer_idx] = (patch, config, active)

    def check_served(self, layer_idx: int) -> None:
        """Refuse, at a layer's first update, a model that is not patched for this cache (see the module
        docstring).  ``ValueError`` naming what the model runs and what to do."""
        name = type(self).__name__
        layers = self.layers
        if not 0 <= layer_idx < len(layers):
            raise ValueError(f"this {name} was built for {len(layers)} layers but is given to a model with a "
                             f"layer {layer_idx}: build it from the model it serves ({self.served_ctor})")
        claim = self._claims.pop(layer_idx, None)
        if claim is None:
            raise ValueError(
                f"this {name} was passed to a model that is not patched for it (layer {layer_idx} runs no "
                f"{self.served_by} attention: the model is unpatched, or patched for another method); it would "
                f"attend to the new tokens only. Patch the model with {self.served_how}, or pass no cache")
        patch, config, active = claim
        if patch != self.served_by:
            raise ValueError(
                f"this {name} was passed to a model patched for {patch}, not {self.served_by}: it would decode "
                f"wrong tokens. Use the cache of the model's patch (or pass none: generate builds it)")
        if not active:
            raise ValueError(
                f"this {name} was passed to a model that runs densely now (kvpop.disabled(model), or another "
                f"attention implementation set): it would attend to the new tokens only. Pass no cache (generate "
                f"then uses a DynamicCache) or a transformers DynamicCache")
        mine = self.served_config
        bad = [f for f in self.served_fields if getattr(mine, f, None) != getattr(config, f, None)]
        if bad:
            raise ValueError(
                f"this {name} was built for {', '.join(f'{f}={getattr(mine, f, None)!r}' for f in bad)} but the "
                f"model is patched with {', '.join(f'{f}={getattr(config, f, None)!r}' for f in bad)}: build the "
                f"cache from the model ({self.served_ctor}) after its last patch")


def cache_settings(name: str, model: Any, config: Any, num_layers: int | None, *, attr: str,
                   how: str) -> tuple[Any, int]:
    """``(config, num_layers)`` of a cache built for ``model`` (its ``attr`` config and layer count) or from
    an explicit ``config=`` and ``num_layers=``; ``ValueError`` naming ``how`` when neither is given."""
    if config is None and model is not None:
        config = getattr(model, attr, None)
    if config is None:
        raise ValueError(f"{name} needs {how}")
    if num_layers is None:
        if model is None:
            raise ValueError(f"{name}(config=...) also needs num_layers=")
        num_layers = model.config.get_text_config().num_hidden_layers
    return config, num_layers


class KVpopCache(ServedCache, Cache):
    """Fixed-budget cache for decoding one or many sequences with a ``kvpop``-patched model.

    Args:
        model: a model patched by :func:`kvpop.patch` (its ``KVpopConfig`` is used), or None.
        config: a ``KVpopConfig`` (overrides the model's).
        num_layers: number of decoder layers (taken from the model when given).
        policy: override ``config.policy``: a policy registered in ``kvpop.core.cache_policy`` (the core's
            "kvpop" and "streaming", and the baselines' attention-scored ones).
        compileable: mark the cache compileable, so that ``generate`` compiles its decode steps
            (with ``compile_config=``, or by default on CUDA).  Off by default: see docs/library.md
            ("Batched generation") for what was checked.
        kv_dtype: ``"auto"`` (default: ``config.kv_dtype``, what ``kvpop.patch(..., kv_dtype=)`` set), ``None``
            (keys and values in the model's dtype, whatever the config says), ``"int8"`` or ``"fp8"`` (float8
            e4m3): quantised slots, 8 bits per element plus one float32 scale per slot and KV head for keys and
            one for values (``kvpop_kernels.layout.QuantizedLayout``); the policies ``kvpop`` and ``streaming``
            only.  The prompt attends to itself in full precision; what the cache keeps of it, and every decoded
            token, is stored quantised.

    Any batch size; left-padded prompts, sampling, ``num_return_sequences`` and beam search work
    (see the module docstring).  Example::

        cache = kvpop.KVpopCache(model)
        out = model.generate(input_ids, attention_mask=mask, **kvpop.cache_kwargs(cache), max_new_tokens=32)
    """

    def __init__(self, model: Any = None, *, config: Any = None, num_layers: int | None = None,
                 policy: str | None = None, compileable: bool = False, kv_dtype: str | None = "auto"):
        config, num_layers = cache_settings("KVpopCache", model, config, num_layers, attr="kvpop_config",
                                            how="a kvpop-patched model (kvpop.patch(model)) or config=KVpopConfig(...)")
        if model is not None and hasattr(model, "config"):
            check_budget_for(config, model.config)
        policy = policy or getattr(config, "policy", "kvpop")
        cache_policy(policy)  # ValueError naming the registered policies
        self.kvpop_config = self.served_config = config
        self.policy = policy
        if not (kv_dtype is None or isinstance(kv_dtype, str) and kv_dtype in ("auto", *KV_DTYPES)):
            raise ValueError(f"kv_dtype must be 'auto' (the config's, {getattr(config, 'kv_dtype', None)!r}), None "
                             f"(the model's dtype) or one of {list(KV_DTYPES)}, got {kv_dtype!r}")
        self.kv_dtype = getattr(config, "kv_dtype", None) if kv_dtype == "auto" else kv_dtype
        check_kv_dtype(self.kv_dtype)
        self._claims: dict[int, tuple[str, Any, bool]] = {}
        rows = _head_budget_rows(config, num_layers, model)
        layers = [KVpopCacheLayer(sinks=config.sinks, window=config.window, budget=config.budget, policy=policy,
                                  head_budgets=rows[i], kv_dtype=self.kv_dtype)
                  for i in range(num_layers)]
        for layer in layers:
            layer.is_compileable = bool(compileable)
        super().__init__(layers=layers)

    served_by = "kvpop"
    served_fields = ("sinks", "window", "budget", "head_budgets")
    served_how = "kvpop.patch(model)"
    served_ctor = "kvpop.KVpopCache(model)"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer_idx < len(self.layers) or not self.layers[layer_idx].prefilled:
            self.check_served(layer_idx)  # the layer's first call: is the model patched for this cache?
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        """Bytes held by all layers: constant however many tokens were generated."""
        return sum(layer.nbytes() for layer in self.layers)


def _head_budget_rows(config: Any, num_layers: int, model: Any) -> list[tuple[int, ...] | None]:
    """Each layer's per-KV-head budgets (``None`` per layer without ``config.head_budgets``), checked against the
    layer count and, given a model, its KV heads."""
    hb = getattr(config, "head_budgets", None)
    if hb is None:
        return [None] * num_layers
    if len(hb) != num_layers:
        raise ValueError(f"head_budgets has {len(hb)} layers but the cache is built for {num_layers}: allocate "
                         f"budgets for this model (kvpop.core.budgets.allocate)")
    if model is not None and hasattr(model, "config"):
        text = model.config.get_text_config()
        hkv = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
        if isinstance(hkv, int):
            return [config.layer_budgets(i, hkv) for i in range(num_layers)]
    return [tuple(r) for r in hb]


# ------------------------------------------------------------------------------------ attention
def cache_attention(cache: KVpopCache, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, *, scaling: float, hooks: PriorityHooks | None = None,
                    attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of layer ``module.layer_idx`` through ``cache``; None when that layer has no update pending
    (``cache.update`` stashes the new keys/values, this call attends and writes them).

    ``query [N, Hq, S, D]``, ``key/value [N, Hkv, S, D]`` (rotated, as transformers passes them);
    ``attention_mask`` the 2D padding mask ``[N, >= S]`` (its last ``S`` columns are this call's; read
    only at the first call, the prompt: left padding), ``position_ids [N or 1, S]`` (checked, on
    calls of several tokens only, against the positions the cache expects).
    Returns the attention output ``[N, S, Hq, D]`` in transformers' layout (zeros at pad tokens).
    """
    if module.layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[module.layer_idx]
    pending, layer.pending = layer.pending, None
    if pending is None or pending[0] is not key:  # stale: left by a forward that failed in between
        return None
    hooks = layer.cache_policy.hooks(hooks)  # the policy's own, or the model's (refused when it needs them)
    N, S = query.shape[0], query.shape[2]
    if not layer.prefilled:
        real = _prompt_rows(attention_mask, N, S, query.device)
        _check_continues(layer, position_ids, real)
        out = _prefill_rows(layer, module, query, key, value, scaling, hooks, real)
        layer.prefilled = True
    else:
        if S > 1:  # a later chunk (never the per-token path): its positions must continue the cache's
            _check_continues(layer, position_ids, None)
        outs = [_decode(layer, module, query[:, :, i], key[:, :, i], value[:, :, i], scaling, hooks, i)
                for i in range(S)]
        out = outs[0].unsqueeze(1) if S == 1 else torch.stack(outs, dim=1)  # [N, S, Hq, D]
    layer._advance(S)
    return out


def _prompt_rows(attention_mask: torch.Tensor | None, N: int, S: int, device) -> torch.Tensor | None:
    """The real tokens ``[N, S]`` (bool) of a left-padded prompt, or None when no row is padded."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != N or attention_mask.shape[1] < S:
        raise ValueError(f"kvpop: the attention mask must be the 2D padding mask [batch, >= {S}] = [{N}, ...]; "
                         f"got shape {tuple(attention_mask.shape)}")
    real = attention_mask[:, -S:].to(device=device, dtype=torch.bool)
    if bool(real.all()):
        return None
    n_real = real.sum(1)
    left = torch.arange(S, device=device)[None, :] >= (S - n_real)[:, None]
    if not torch.equal(real, left):
        raise ValueError("kvpop: only left padding is supported (each row's pad tokens first, then its real "
                         "tokens); pad with tokenizer.padding_side = 'left'")
    if not bool((n_real > 0).all()):
        raise ValueError(f"kvpop: rows {(n_real == 0).nonzero().flatten().tolist()} of the prompt have no real "
                         f"token (all padding)")
    return real


def _check_continues(layer: KVpopCacheLayer, position_ids: torch.Tensor | None, real: torch.Tensor | None) -> None:
    """Refuse a call whose first position is not the next one of this cache (e.g. a second ``generate``
    with the same prompt on a used cache): a fixed-budget cache cannot go back.  Reads the position
    ids on the host: called for prompts and multi-token chunks only, never per decoded token."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() == 0 or position_ids.dim() != 2:
        return
    N = layer.keys.shape[0]
    pid = position_ids.expand(N, -1) if position_ids.shape[0] == 1 else position_ids
    if real is None:
        first = pid[:, 0]
    else:  # a row's first real token
        first = pid.gather(1, real.to(torch.int8).argmax(1, keepdim=True).to(pid.device))[:, 0]
    expected = layer.pos if layer.prefilled else torch.zeros_like(layer.pos)
    bad = (first.to(expected.device) != expected).nonzero().flatten().tolist()
    if bad:
        n = bad[0]
        seen, got = int(expected[n]), int(first[n])
        row = f" (batch row {n})" if N > 1 else ""
        if real is not None and not layer.prefilled:
            raise ValueError(
                f"kvpop: the first real token of the left-padded prompt row {n} has position id {got}, but a row's "
                f"positions count its real tokens from 0 (as generate's do): pass "
                f"position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0) with a padded batch"
            )
        raise ValueError(
            f"this KVpopCache has seen {seen} tokens{row}, so the next call must start at position {seen}, "
            f"but it starts at position {got}. A fixed-budget cache cannot go back (evicted tokens are gone): "
            "use a fresh kvpop.KVpopCache(model) for a new prompt, or call cache.reset() first."
        )


def _prefill_rows(layer: KVpopCacheLayer, module, query, key, value, scaling, hooks, real) -> torch.Tensor:
    """The prompt of every row: rows of equal real length together (all rows when none is padded)."""
    N, Hq, S, D = query.shape
    if real is None:
        return _prefill_group(layer, module, query, key, value, scaling, hooks)
    out = query.new_zeros(N, S, Hq, D)
    lengths = real.sum(1).tolist()
    for L in sorted(set(lengths)):
        idx = torch.tensor([n for n, x in enumerate(lengths) if x == L], device=query.device)
        sub = layer.rows(idx)
        sub_hooks = hooks.rows(idx, S - L) if hasattr(hooks, "rows") else hooks
        o = _prefill_group(sub, module, query[idx, :, S - L:], key[idx, :, S - L:], value[idx, :, S - L:],
                           scaling, sub_hooks)
        layer.set_rows(idx, sub)
        out[idx, S - L:] = o
    return out


def _prefill_group(layer: KVpopCacheLayer, module, query, key, value, scaling, hooks) -> torch.Tensor:
    """Rows with no padding: the schedule's prefill (static policies), else token by token."""
    S = query.shape[2]
    if S > 1 and layer.cache_policy.static:
        return _prefill(layer, module, query, key, value, scaling, hooks)
    outs = [_decode(layer, module, query[:, :, i], key[:, :, i], value[:, :, i], scaling, hooks, i)
            for i in range(S)]
    return torch.stack(outs, dim=1)


def _prefill(layer: KVpopCacheLayer, module, query, key, value, scaling, hooks: PriorityHooks) -> torch.Tensor:
    """Prefill ``n`` rows of ``S`` real tokens each: ``query [n, Hq, S, D]`` -> ``[n, S, Hq, D]``."""
    s, w = layer.sinks, layer.window
    n, hkv, S, D = key.shape
    prio = hooks.prompt(module, layer, key, value).float()  # [n, Hkv, S]
    k = layer.layout.long_range_k(hkv, s, w)  # one k, or k[l][h] per head
    evict_at = eviction_schedule(prio, sinks=s, window=w, k=k)
    out, _ = sparse_attention(query, key, value, evict_at, sinks=s, window=w, scale=scaling)
    # keep exactly what the schedule keeps at the prompt's last position, for each group of heads the
    # layout fills at once (uniform: the rows and KV heads flattened into one "head" axis of n * Hkv;
    # packed: each head's slots in turn)
    lay = layer.layout
    prompt = lay.prompt_state(key, value)  # keys and values as the slots store them (codes and scales)
    for h, span in lay.head_groups(hkv, s, w):
        def src(x, h=h):  # the prompt's tensor [n, Hkv, S, ...] of this group, as [R, S, ...]
            return x.flatten(0, 1) if h is None else x[:, h]

        def dst(x, lr=False, h=h, span=span):
            return lay.head_state(x, h, span, lr)

        pairs = [(dst(getattr(layer.slots, name)), src(x)) for name, x in prompt]
        _fill_slots(pairs, dst(layer.slot_pos), dst(layer.slot_prio, True), src(layer.ring_prio), src(evict_at),
                    src(prio), s, w, span.k)
    layer.pos.fill_(S)
    return out.transpose(1, 2)


def _fill_slots(pairs, slot_pos, slot_prio, ring_prio, ev, pr, s: int, w: int, k: int) -> None:
    """Write what the schedule keeps at the prompt's last position into ``R`` heads' slots (views, in place):
    each ``(state [R, B, ...], prompt [R, S, ...])`` of ``pairs`` (keys and values ``[R, B, D]`` from the
    prompt's ``[R, S, D]``; a quantised layout's scales ``[R, B]`` too), ``slot_pos [R, B]``, ``slot_prio
    [R, k]``, ``ring_prio [R, w]`` from ``ev`` (``evict_at``) and ``pr`` (priorities) ``[R, S]``."""
    R, S = ev.shape
    q = S - 1
    dev = ev.device
    n_sink = min(s, S)
    for dst, src in pairs:
        dst[:, :n_sink] = src[:, :n_sink]
    slot_pos[:, :n_sink] = torch.arange(n_sink, dtype=torch.int32, device=dev)
    win = torch.arange(max(s, S - w), max(s, S), device=dev)  # empty while the prompt is all sinks
    if win.numel():
        slots = s + (win - s) % w
        for dst, src in pairs:
            dst[:, slots] = src[:, win]
        slot_pos[:, slots] = win.to(torch.int32)
        ring_prio[:, slots - s] = pr[:, win]
    if k > 0 and S - w > s:
        elig = torch.arange(s, q - w + 1, device=dev)
        kept = ev[:, elig] > q  # [R, |E|], at most k per head
        n_kept = kept.sum(-1)
        # stable order: kept tokens first, by position
        order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)[:, :k]  # [R, min(k,|E|)]
        toks = elig[order]  # positions
        valid = torch.arange(order.shape[1], device=dev).unsqueeze(0) < n_kept.unsqueeze(1)
        lr = s + w + torch.arange(order.shape[1], device=dev)
        hidx = torch.arange(R, device=dev).unsqueeze(1)
        for dst, src in pairs:
            v = valid.view(*valid.shape, *([1] * (dst.dim() - 2)))
            dst[hidx, lr] = torch.where(v, src[hidx, toks], dst[hidx, lr])
        slot_pos[hidx, lr] = torch.where(valid, toks.to(torch.int32), slot_pos[hidx, lr])
        slot_prio[:, : order.shape[1]] = torch.where(valid, pr[hidx, toks], slot_prio[:, : order.shape[1]])


def _decode(layer: KVpopCacheLayer, module, q1, k1, v1, scaling, hooks: PriorityHooks, i: int = 0) -> torch.Tensor:
    """One token of every row: ``q1 [N, Hq, D]``, ``k1/v1 [N, Hkv, D]`` -> ``[N, Hq, D]``.

    Rows sit at their own positions ``layer.pos``; nothing here reads a value back to the host.  The layer's
    policy prices the token leaving the window before the fused step and updates its buffers after it."""
    s, w = layer.sinks, layer.window
    pos = layer.pos  # [N] int64, on the device
    N, hkv = k1.shape[:2]
    ring = ((pos.clamp_min(s) - s) % w)[:, None, None].expand(N, hkv, 1)  # ring index of the slot pos takes
    step = StepInput(module, q1, k1, v1, ring, i, scaling, hooks)
    leaving = layer.cache_policy.leaving(layer, step)
    out, lse = fixed_budget_decode(q1, k1, v1, layer.slots, leaving, pos=pos, sinks=s, window=w, scale=scaling,
                                   check=False, layout=layer.layout)
    layer.cache_policy.after(layer, step, lse)
    layer.pos.add_(1)
    return out
