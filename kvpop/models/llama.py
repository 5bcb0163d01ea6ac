"""Llama (e.g. DeepSeek-R1-Distill-Llama): the pre-RoPE key is ``k_proj``'s output."""
from __future__ import annotations

from .base import FamilyAdapter


class LlamaAdapter(FamilyAdapter):
    model_type = "llama"
    examples = ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "meta-llama/Llama-3.1-8B-Instruct")
    attention_class_path = "transformers.models.llama.modeling_llama:LlamaAttention"
    key_tap = "k_proj"  # [B, S, Hkv * D]: viewed as [B, S, Hkv, D]
