"""The supported families: one adapter instance per ``config.model_type`` (``ADAPTERS``)."""
from __future__ import annotations

from .base import FamilyAdapter
from .llama import LlamaAdapter
from .qwen2 import Qwen2Adapter
from .qwen3 import Qwen3Adapter

__all__ = ["ADAPTERS", "SUPPORTED_MODEL_TYPES"]

ADAPTERS: dict[str, FamilyAdapter] = {a.model_type: a for a in (Qwen3Adapter(), Qwen2Adapter(), LlamaAdapter())}
SUPPORTED_MODEL_TYPES = tuple(ADAPTERS)
