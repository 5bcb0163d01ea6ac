"""kvpop: learned fixed-budget KV-cache eviction (KVpop) for transformers' Qwen3 models.

Typical use::

    import kvpop
    teacher = kvpop.make_teacher(model)            # frozen dense copy of the original weights
    kvpop.patch(model, budget=2048, scorer="mlp")  # scorers + kvpop attention, in place
    out = model(input_ids)                         # training forward: sparse attention + L_score terms
    loss = kvpop.distill_loss(out.logits, teacher(input_ids).logits) + kvpop.score_loss(model)
    kvpop.save_scorers(model, "scorers.safetensors")

Kernels live in ``kvpop_kernels`` (which never imports transformers).
"""
from .cache import KVpopCache
from .checkpoint import load_scorers, read_scorer_config, save_scorers
from .config import KVpopConfig
from .loss import distill_loss, score_loss, score_loss_terms, score_stats, teacher_topk
from .patch import (KVpopLayer, disabled, get_config, is_patched, kvpop_layers, make_teacher, patch,
                    unpatch)
from .scorers import MLPScorer, MLSTMScorer, build_scorer

__all__ = [
    "KVpopConfig",
    "KVpopCache",
    "patch",
    "unpatch",
    "is_patched",
    "get_config",
    "kvpop_layers",
    "disabled",
    "make_teacher",
    "score_loss",
    "score_loss_terms",
    "score_stats",
    "distill_loss",
    "teacher_topk",
    "save_scorers",
    "load_scorers",
    "read_scorer_config",
    "KVpopLayer",
    "MLPScorer",
    "MLSTMScorer",
    "build_scorer",
]
