"""The model-family seam: what kvpop needs to know about one transformers model family.

Everything family-specific that ``kvpop.patch`` and ``KVpopCache`` rely on lives behind a
:class:`FamilyAdapter`, chosen by ``config.model_type`` (see :func:`kvpop.models.adapter_for`):

* which modules are the attention layers that get a ``KVpopLayer``;
* where the pre-RoPE key of a layer can be tapped (the scorers read keys before the rotary
  embedding, which would otherwise carry absolute position into the score): a submodule whose
  forward output is that key, and how to view it as ``[B, S, Hkv, D]``;
* the number of KV heads and the head size of a layer;
* config checks (e.g. sliding-window layers, which kvpop does not support).

The rest of the package is family-agnostic: the attention function is registered in transformers'
``AttentionInterface``, which every supported family calls with rotated ``query [B, Hq, S, D]``,
``key/value [B, Hkv, S, D]``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FamilyAdapter"]


class FamilyAdapter:
    """One model family.  Subclasses set ``model_type``, ``attention_class_path`` and ``key_tap``."""

    #: ``config.model_type`` of the family (``"qwen3"``, ``"qwen2"``, ``"llama"`` ...).
    model_type: str = ""
    #: example checkpoints, named in docs and errors
    examples: tuple[str, ...] = ()
    #: ``"module.path:ClassName"`` of the family's attention layer in transformers
    attention_class_path: str = ""
    #: name of the attention submodule whose output is the pre-RoPE key
    key_tap: str = ""

    def attention_class(self) -> type:
        import importlib

        mod, name = self.attention_class_path.split(":")
        return getattr(importlib.import_module(mod), name)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        cls = self.attention_class()
        return [m for m in model.modules() if isinstance(m, cls)]

    def head_dim(self, attn: nn.Module) -> int:
        return int(attn.head_dim)

    def num_kv_heads(self, attn: nn.Module) -> int:
        return attn.k_proj.out_features // self.head_dim(attn)

    def key_tap_module(self, attn: nn.Module) -> nn.Module:
        return getattr(attn, self.key_tap)

    def pre_rope_key(self, output: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The tapped module's output as the pre-RoPE key ``[B, S, Hkv, D]``."""
        return output.unflatten(-1, (-1, head_dim))

    def weight_device(self, attn: nn.Module) -> torch.device:
        return attn.k_proj.weight.device

    def check_config(self, config: Any) -> None:
        """Raise ``ValueError`` for a config kvpop cannot run (sliding-window layers by default)."""
        types = getattr(config, "layer_types", None) or []
        if "sliding_attention" in types or (getattr(config, "use_sliding_window", False)
                                            and getattr(config, "sliding_window", None)):
            raise ValueError(f"kvpop does not support sliding-window attention layers ({self.model_type}: "
                             f"config.use_sliding_window={getattr(config, 'use_sliding_window', None)}, "
                             f"layer_types has 'sliding_attention'); set use_sliding_window=False")
