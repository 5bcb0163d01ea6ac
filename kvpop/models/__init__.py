"""Model families kvpop can patch, one small adapter each (see :mod:`kvpop.models.base`).

Add a family by writing a :class:`FamilyAdapter` subclass and listing it in ``ADAPTERS`` (``families``).
"""
from __future__ import annotations

from typing import Any

from .base import FamilyAdapter
from .directory import check_model_dir, load_model_dir
from .families import ADAPTERS, SUPPORTED_MODEL_TYPES

__all__ = ["FamilyAdapter", "ADAPTERS", "SUPPORTED_MODEL_TYPES", "adapter_for", "cache_kwarg_name", "cache_kwargs",
           "check_model_dir",
           "load_model_dir"]



def adapter_for(model: Any) -> FamilyAdapter:
    """The adapter of ``model``'s family (by ``config.model_type``); ``TypeError`` when unsupported."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"kvpop patches transformers models (a PreTrainedModel of model_type "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}); got {type(model).__name__}")
    cfg = model.config
    mt = getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg, "model_type", None)
    if mt not in ADAPTERS:
        raise TypeError(f"kvpop supports model_type {', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)}; "
                        f"{type(model).__name__} has model_type {mt!r}")
    return ADAPTERS[mt]


def cache_kwarg_name() -> str:
    """The keyword under which ``generate`` and the models pass the cache: ``cache`` (transformers >= 5.24)
    or ``past_key_values`` (5.17 .. 5.23)."""
    from transformers.generation import utils as gen_utils

    names = getattr(gen_utils, "ALL_CACHE_NAMES", None)
    return "cache" if names and "cache" in names else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model.generate(...)`` / ``model(...)`` under the installed transformers: ``cache=``
    where it takes it (>= 5.24; ``past_key_values=`` warns there), else ``past_key_values=``; e.g.
    ``model.generate(ids, **kvpop.cache_kwargs(cache), max_new_tokens=20)``."""
    return {cache_kwarg_name(): cache}
