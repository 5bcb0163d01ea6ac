"""One patch lifecycle for every method that rides on a model's attention layers (KVpop, DMS, ...).

A method describes itself once in a :class:`PatchSpec` (the submodule it attaches to each attention
module, its attention implementation, its default cache) and gets from here: attaching its layers and
hooks (:func:`install`), swapping its config in (:func:`reconfigure`), removing all of it so the model
is exactly as before (:func:`remove`), plain ``generate()`` through its cache (:class:`DefaultCache`),
dense runs of the current weights (:func:`dense`) and the frozen teacher copy (:func:`frozen_copy`).
A model carries one method at a time.  The safetensors side is ``kvpop.core.checkpoint``.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvpop.models import adapter_for, cache_kwarg_name

__all__ = ["PatchSpec", "register_spec", "carried", "state_owner", "owner", "state", "check_model", "requested",
           "install",
           "reconfigure", "remove", "layers", "dense", "frozen_copy", "DefaultCache"]


@dataclass(frozen=True)
class PatchSpec:
    """What one method attaches to a model.

    name: the method (``"kvpop"``, ``"dms"``); config_type: its config class (a frozen dataclass with
    ``replace``, default-constructible); submodule: the attribute of each attention module holding
    its layer; layer_type: that layer's class (a ``layer_idx`` attribute and a ``config``); attn_name: the
    attention implementation it sets; state_attr: the model attribute holding the patch state;
    config_attr: the model attribute exposing the config (read by its cache); cache_type: the cache
    plain ``generate()`` builds (called with the model); transient: layer attributes dropped when the
    method is removed or run densely; label, how, undo: its name, how to patch and how to unpatch, for
    errors.
    """

    name: str
    config_type: type
    submodule: str
    layer_type: type
    attn_name: str
    state_attr: str
    config_attr: str
    cache_type: Callable[[nn.Module], Any]
    transient: tuple[str, ...] = ()
    label: str = ""
    how: str = ""
    undo: str = ""

    def carried_by(self, model: nn.Module) -> bool:
        """True when ``model`` (or the model it wraps) carries this method."""
        return owner(model, self) is not None

    def config_of(self, model: nn.Module) -> Any:
        """The config of a model patched with this method (ValueError when it is not)."""
        return state(model, self)["config"]

    def remove(self, model: nn.Module) -> nn.Module:
        """Undo the patch in place (:func:`remove`); returns ``model``."""
        return remove(model, self)


_SPECS: dict[str, PatchSpec] = {}


def register_spec(spec: PatchSpec) -> PatchSpec:
    """Make ``spec`` known (so :func:`carried`, :func:`frozen_copy` and "one method per model" see it)."""
    _SPECS[spec.name] = spec
    return spec


def state_owner(model: nn.Module, attr: str) -> nn.Module | None:
    """The module carrying the patch state ``attr``: ``model`` itself or, for a wrapper (DDP, FSDP, a
    ``torch.compile`` module), the first submodule that does."""
    if getattr(model, attr, None) is not None:
        return model
    if isinstance(model, nn.Module):
        for m in model.modules():
            if getattr(m, attr, None) is not None:
                return m
    return None


def owner(model: nn.Module, spec: PatchSpec) -> nn.Module | None:
    return state_owner(model, spec.state_attr)


def carried(model: nn.Module) -> PatchSpec | None:
    """The spec of the method ``model`` (or the model it wraps) is patched with, or None."""
    for spec in _SPECS.values():
        if owner(model, spec) is not None:
            return spec
    return None


def state(model: nn.Module, spec: PatchSpec) -> dict[str, Any]:
    """The patch state of ``spec`` (``config``, ``orig_attn``, ``handles`` and the method's own keys);
    ``ValueError`` when the model does not carry it."""
    own = owner(model, spec)
    if own is None:
        raise ValueError(f"{type(model).__name__} is not patched with {spec.label}: {spec.how}")
    return getattr(own, spec.state_attr)


def check_model(model: Any) -> Any:
    """The family adapter of ``model`` (TypeError for an unsupported one or one without attention modules)."""
    adapter = adapter_for(model)
    adapter.check_config(model.config.get_text_config())
    if not adapter.attention_modules(model):
        raise TypeError(f"{type(model).__name__} has no {adapter.attention_class().__name__} module to patch")
    return adapter


def layers(model: nn.Module, spec: PatchSpec) -> list[nn.Module]:
    """The method's layers in ``model``, by layer index."""
    return sorted((m for m in model.modules() if isinstance(m, spec.layer_type)), key=lambda m: m.layer_idx)


def requested(model: nn.Module, spec: PatchSpec, config: Any, overrides: dict[str, Any]) -> tuple[Any, Any]:
    """``(current config or None, the config asked for)`` of a patch call: ``config`` (default: the current
    one, else ``config_type()``) with ``overrides`` applied (TypeError for a config of another type)."""
    if config is not None and not isinstance(config, spec.config_type):
        raise TypeError(f"config must be a {spec.config_type.__name__} or None, got {type(config).__name__}")
    st = getattr(model, spec.state_attr, None)
    old = st["config"] if st is not None else None
    base = config if config is not None else (old if old is not None else spec.config_type())
    return old, (base.replace(**overrides) if overrides else base)


def install(model: nn.Module, spec: PatchSpec, config: Any,
            build: Callable[[nn.Module], tuple[nn.Module, list[Any]]], **extra: Any) -> nn.Module:
    """Attach ``build(attn) -> (layer, hook handles)`` to every attention module as ``attn.<submodule>``,
    set the method's attention implementation (the previous one kept), the config and plain
    ``generate()``'s default cache.  ``extra`` goes into the patch state."""
    other = carried(model)
    if other is not None:
        raise ValueError(f"the model is patched with {other.label}; a model carries one method: {other.undo} first")
    adapter = check_model(model)
    handles: list[Any] = []
    for attn in adapter.attention_modules(model):
        layer, hs = build(attn)
        setattr(attn, spec.submodule, layer)
        handles.extend(hs)
    mc = model.config
    orig = mc._attn_implementation
    mc._attn_implementation = spec.attn_name
    setattr(model, spec.state_attr, {"config": config, "orig_attn": orig, "handles": handles, **extra})
    setattr(model, spec.config_attr, config)
    if "_prepare_cache_for_generation" not in model.__dict__ and hasattr(model, "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = DefaultCache(model, spec.cache_type, spec.attn_name)
    return model


def reconfigure(model: nn.Module, spec: PatchSpec, config: Any) -> nn.Module:
    """Swap a new config into a patched model (its layers keep their weights)."""
    st = state(model, spec)
    own = owner(model, spec)
    for layer in layers(own, spec):
        layer.config = config
    st["config"] = config
    setattr(own, spec.config_attr, config)
    return model


def _drop_transient(model: nn.Module, spec: PatchSpec) -> None:
    for layer in layers(model, spec):
        for name in spec.transient:
            setattr(layer, name, None)


def remove(model: nn.Module, spec: PatchSpec) -> nn.Module:
    """Undo :func:`install` in place (layers removed and lost, hooks removed, attention implementation
    restored); a model that does not carry ``spec`` is returned unchanged."""
    own = owner(model, spec)
    if own is None:
        return model
    st = getattr(own, spec.state_attr)
    for h in st.get("handles", ()):
        h.remove()
    _drop_transient(own, spec)
    for attn in own.modules():
        if isinstance(attn._modules.get(spec.submodule), spec.layer_type):
            del attn._modules[spec.submodule]
    own.config._attn_implementation = st["orig_attn"]
    delattr(own, spec.state_attr)
    for attr in (spec.config_attr, "_prepare_cache_for_generation"):
        own.__dict__.pop(attr, None)
    return model


@contextlib.contextmanager
def dense(model: nn.Module, spec: PatchSpec) -> Iterator[nn.Module]:
    """Run a patched model densely with its current weights (its original attention implementation)."""
    own = owner(model, spec)
    if own is None:
        yield model
        return
    mc = own.config
    prev = mc._attn_implementation
    mc._attn_implementation = getattr(own, spec.state_attr)["orig_attn"]
    try:
        yield model
    finally:
        mc._attn_implementation = prev
        _drop_transient(model, spec)


def frozen_copy(model: nn.Module, *, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen dense copy of ``model``'s current weights (the distillation teacher): whatever method the
    copy carries is removed; eval mode, ``requires_grad=False`` everywhere, optionally moved."""
    teacher = copy.deepcopy(model)
    spec = carried(teacher)
    if spec is not None:
        remove(teacher, spec)
    if device is not None or dtype is not None:
        teacher.to(device=device, dtype=dtype)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


class DefaultCache:
    """Installed as the instance's ``_prepare_cache_for_generation``: plain ``model.generate(...)`` then
    decodes through a fresh ``cache_type(model)`` when the caller passed no cache (under either keyword),
    asked for no ``cache_implementation`` and did not turn ``use_cache`` off.  Under :func:`dense` (the
    attention implementation is the model's original one) it builds nothing, so generate uses
    transformers' default cache and equals the unpatched model.

    An object holding the model (not a closure over it), so a deep copy or an unpickled patched model
    builds its caches from its own config.  :func:`remove` removes it.
    """

    def __init__(self, model: nn.Module, cache_type: Callable[[nn.Module], Any], attn_name: str) -> None:
        self.model = model
        self.cache_type = cache_type
        self.attn_name = attn_name

    def __call__(self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        given = any(model_kwargs.get(n) is not None for n in ("cache", "past_key_values"))
        # the mode switch: only while the model runs the method's attention (not under dense / kvpop.disabled)
        if (not given and model.config._attn_implementation == self.attn_name
                and generation_config.use_cache is not False and generation_config.cache_implementation is None):
            model_kwargs[cache_kwarg_name()] = self.cache_type(model)
        return type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, *args, **kwargs)
