"""Qwen3 (and Qwen3-based reasoning models): the pre-RoPE key is the output of ``k_norm``."""
from __future__ import annotations

import torch

from .base import FamilyAdapter


class Qwen3Adapter(FamilyAdapter):
    model_type = "qwen3"
    examples = ("Qwen/Qwen3-4B", "Qwen/Qwen3-8B")
    attention_class_path = "transformers.models.qwen3.modeling_qwen3:Qwen3Attention"
    key_tap = "k_norm"  # RMSNorm over [B, S, Hkv, D]: its output is the key just before RoPE

    def pre_rope_key(self, output: torch.Tensor, head_dim: int) -> torch.Tensor:
        return output
