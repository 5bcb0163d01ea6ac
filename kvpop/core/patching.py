"""``kvpop.patch(model)`` / ``kvpop.unpatch(model)`` / ``with kvpop.patched(model):``: the patch lifecycle.

What ``patch`` does (transformers 5.17 .. 5.24; families: ``kvpop.models``)
    * registers, once per process, the attention function ``"kvpop"`` (``kvpop.core.attention``);
    * attaches to every attention module of the model's family a :class:`KVpopLayer` as the submodule
      ``kvpop`` (a scorer and the decay logits of its KV heads; so they appear in ``state_dict()`` and
      ``parameters()`` under ``...self_attn.kvpop.``);
    * registers a forward hook on the family's key tap (Qwen3: ``k_norm``; Qwen2, Llama: ``k_proj``)
      that hands the layer's pre-RoPE key to its ``KVpopLayer``, and a forward pre-hook on the attention
      module that hands it the cache the module is called with; the hook handles are kept;
    * sets ``model.config._attn_implementation = "kvpop"`` and remembers the previous value;
    * makes plain ``model.generate(...)`` decode through a fresh ``KVpopCache``.

``unpatch`` removes the submodules and the hooks (through their handles) and restores the previous
attention implementation: the model is then exactly the model before ``patch`` (same modules, same
``state_dict`` keys, same logits).  ``patch`` is idempotent: patching a patched model with no config
and no overrides (or with an equal config) changes nothing.  Patching a patched model with a
*different* config keeps the trained scorers and swaps the config in when the scorer's structure is
unchanged (``budget``, ``sinks``, ``mask_source``, ``tau`` ... may change; e.g.
``kvpop.patch(model, budget=4096)`` re-budgets a trained model); a structural change (``scorer``,
``scorer_hidden``, ``mlstm_dim``, the gamma range, ``window`` for the mLSTM) raises ``ValueError``: call
``kvpop.unpatch`` first (which discards the scorers).  ``kvpop.patched(model, ...)`` is the
context-manager form: patched inside the block, exactly as before after it.

Activation checkpointing: use the non-reentrant form
(``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``):
the reentrant form runs the first forward under ``no_grad``, so no layer would record ``L_score``.

Limits: no padding in a full-sequence forward (a 2D attention mask with zeros -> ValueError), no
sliding-window layers, no attention dropout, no ``output_attentions``.

Scorers are created in float32 on the device of the attention weights; cast the model *before*
patching.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kvpop.models import SUPPORTED_MODEL_TYPES, adapter_for, cache_kwarg_name

from .attention import ATTN_NAME, register
from .cache import KVpopCache
from .config import KVpopConfig, check_budget_for
from .layer import KVpopLayer, kvpop_layers

__all__ = ["patch", "unpatch", "patched", "is_patched", "get_config", "disabled", "make_teacher",
           "SUPPORTED_MODEL_TYPES"]

_STATE_ATTR = "_kvpop_state"


def _check_model(model: Any) -> Any:
    adapter = adapter_for(model)  # TypeError for an unsupported model
    adapter.check_config(model.config.get_text_config())
    if not adapter.attention_modules(model):
        raise TypeError(f"{type(model).__name__} has no {adapter.attention_class().__name__} module to patch")
    return adapter


def state_owner(model: nn.Module, attr: str) -> nn.Module | None:
    """The module carrying the patch state ``attr``: ``model`` itself or, for a wrapper (DDP, FSDP, a
    ``torch.compile`` module), the first submodule that does (shared by kvpop's and DMS's patches)."""
    if getattr(model, attr, None) is not None:
        return model
    if isinstance(model, nn.Module):
        for m in model.modules():
            if getattr(m, attr, None) is not None:
                return m
    return None


def _patched_owner(model: nn.Module) -> nn.Module | None:
    return state_owner(model, _STATE_ATTR)


def is_patched(model: nn.Module) -> bool:
    """True when ``model`` (or the model it wraps) carries kvpop's patch."""
    return _patched_owner(model) is not None


def get_config(model: nn.Module) -> KVpopConfig:
    """The ``KVpopConfig`` of a patched model (ValueError when it is not patched)."""
    owner = _patched_owner(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} is not patched: call kvpop.patch(model) first")
    return getattr(owner, _STATE_ATTR)["config"]


def patch(model: nn.Module, config: KVpopConfig | None = None, **overrides: Any) -> nn.Module:
    """Patch a transformers model in place for KVpop and return it.

    Args:
        model: a ``PreTrainedModel`` of a supported family (``config.model_type`` in
            ``SUPPORTED_MODEL_TYPES``: qwen3, qwen2, llama; e.g. ``Qwen3ForCausalLM``); anything else
            raises ``TypeError``.
        config: a ``KVpopConfig`` (default ``KVpopConfig()``, or the model's current one if patched).
        **overrides: fields of ``KVpopConfig`` applied on top of ``config`` (validated:
            ``budget < sinks + window`` -> ``ValueError``, unknown names -> ``TypeError``).

    Idempotent; re-patching a patched model with a different config: see the module docstring.
    """
    adapter = _check_model(model)
    if config is not None and not isinstance(config, KVpopConfig):
        raise TypeError(f"config must be a kvpop.KVpopConfig or None, got {type(config).__name__}")
    state = getattr(model, _STATE_ATTR, None)
    base = config if config is not None else (state["config"] if state is not None else KVpopConfig())
    new = base.replace(**overrides) if overrides else base
    check_budget_for(new, model.config)
    register()
    if state is not None:
        old = state["config"]
        if new == old:
            return model
        bad = old.structural_mismatch(new)
        if bad:
            raise ValueError(
                f"model is patched with a scorer of another structure (fields {bad} differ: "
                f"{ {n: getattr(old, n) for n in bad} } -> { {n: getattr(new, n) for n in bad} }); "
                f"call kvpop.unpatch(model) first (this discards the trained scorers)"
            )
        for layer in kvpop_layers(model):
            layer.config = new
        state["config"] = new
        model.kvpop_config = new
        return model

    handles = []
    for attn in adapter.attention_modules(model):
        layer = KVpopLayer(new, adapter.num_kv_heads(attn), adapter.head_dim(attn), attn.layer_idx,
                           model_type=adapter.model_type)
        layer.to(device=adapter.weight_device(attn), dtype=torch.float32)
        attn.kvpop = layer
        handles.append(adapter.key_tap_module(attn).register_forward_hook(layer.capture_key))
        handles.append(attn.register_forward_pre_hook(layer.capture_cache, with_kwargs=True))
    mc = model.config
    orig = mc._attn_implementation
    mc._attn_implementation = ATTN_NAME
    setattr(model, _STATE_ATTR, {"config": new, "orig_attn": orig, "handles": handles})
    model.kvpop_config = new  # read by kvpop.KVpopCache(model)
    if "_prepare_cache_for_generation" not in model.__dict__ and hasattr(model, "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = _DefaultKVpopCache(model)
    return model


class _DefaultKVpopCache:
    """Installed as the instance's ``_prepare_cache_for_generation``: plain ``model.generate(...)`` then
    decodes through a fresh ``KVpopCache(model)`` when the caller passed no cache (under either keyword),
    asked for no ``cache_implementation`` and did not turn ``use_cache`` off.

    Under :func:`disabled` (the attention implementation is the model's original one) it builds
    nothing, so generate uses transformers' default cache and equals the unpatched model.
    An object holding the model (not a closure over it), so a deep copy or an unpickled patched model
    builds its caches from its own config.  ``unpatch`` removes it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        given = any(model_kwargs.get(n) is not None for n in ("cache", "past_key_values"))
        # the mode switch: only while the model runs kvpop attention (not under kvpop.disabled)
        if (not given and model.config._attn_implementation == ATTN_NAME and generation_config.use_cache is not False
                and generation_config.cache_implementation is None):
            model_kwargs[cache_kwarg_name()] = KVpopCache(model)
        return type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)


def unpatch(model: nn.Module) -> nn.Module:
    """Undo ``patch`` in place (scorers removed and lost, attention implementation restored); returns ``model``.

    A model that is not patched is returned unchanged.
    """
    owner = _patched_owner(model)
    if owner is None:
        return model
    state = getattr(owner, _STATE_ATTR)
    for h in state.get("handles", ()):
        h.remove()
    for layer in kvpop_layers(owner):
        layer.active_cache = layer.k_pre = None
    for attn in owner.modules():
        if isinstance(attn._modules.get("kvpop"), KVpopLayer):
            del attn._modules["kvpop"]
    owner.config._attn_implementation = state["orig_attn"]
    delattr(owner, _STATE_ATTR)
    for attr in ("kvpop_config", "_prepare_cache_for_generation"):
        owner.__dict__.pop(attr, None)
    return model


@contextlib.contextmanager
def patched(model: nn.Module, config: KVpopConfig | None = None, **overrides: Any) -> Iterator[nn.Module]:
    """Context-manager form of :func:`patch`: ``with kvpop.patched(model, budget=2048) as m: ...``.

    Inside the block the model is patched; on exit it is unpatched (scorers discarded) if it was not
    patched before, or given back its previous config if it was (its trained scorers kept).
    """
    prev = get_config(model) if is_patched(model) else None
    patch(model, config, **overrides)
    try:
        yield model
    finally:
        if prev is None:
            unpatch(model)
        else:
            patch(model, prev)


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run a patched model densely with its current weights: its original attention implementation.

    The one mode switch: inside the block forwards run dense attention, plain ``generate`` builds
    transformers' default cache instead of a ``KVpopCache`` (so it equals the unpatched model, token for
    token), and a ``KVpopCache`` passed explicitly is refused at its first call.

    The memory-cheap way to get dense logits of the *same* weights (e.g. to compare a patched model
    with itself, or as the teacher while the model itself is frozen).  When the model is fine-tuned,
    the teacher must be the frozen original: use :func:`make_teacher` before training.
    """
    owner = _patched_owner(model)
    if owner is None:
        yield model
        return
    state = getattr(owner, _STATE_ATTR)
    mc = owner.config
    prev = mc._attn_implementation
    mc._attn_implementation = state["orig_attn"]
    try:
        yield model
    finally:
        mc._attn_implementation = prev
        for layer in kvpop_layers(model):
            layer.k_pre = layer.active_cache = None


def make_teacher(model: nn.Module, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen dense copy of ``model``'s current weights: the distillation teacher.

    Call it **before** fine-tuning, so it holds the original weights.  The copy is unpatched, in eval
    mode and has ``requires_grad=False`` everywhere; ``device``/``dtype`` optionally move it.
    Costs one more copy of the weights (the price of a teacher that stays the original model).
    """
    teacher = copy.deepcopy(model)
    unpatch(teacher)
    if device is not None or dtype is not None:
        teacher.to(device=device, dtype=dtype)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher
