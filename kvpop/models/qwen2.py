"""Qwen2 (e.g. DeepSeek-R1-Distill-Qwen): no key norm, the pre-RoPE key is ``k_proj``'s output."""
from __future__ import annotations

from .base import FamilyAdapter


class Qwen2Adapter(FamilyAdapter):
    model_type = "qwen2"
    examples = ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "Qwen/Qwen2.5-7B-Instruct")
    attention_class_path = "transformers.models.qwen2.modeling_qwen2:Qwen2Attention"
    key_tap = "k_proj"  # [B, S, Hkv * D] (with bias): viewed as [B, S, Hkv, D]
