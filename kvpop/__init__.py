"""kvpop: learned fixed-budget KV-cache eviction (KVpop) for transformers' Qwen3, Qwen2 and Llama models.

Typical use::

    import kvpop
    teacher = kvpop.make_teacher(model)            # frozen dense copy of the original weights
    kvpop.patch(model, budget=2048, scorer="mlp")  # scorers + kvpop attention, in place
    out = model(input_ids)                         # training forward: sparse attention + L_score terms
    loss = kvpop.distill_loss(out.logits, teacher(input_ids).logits) + kvpop.score_loss(model)
    kvpop.save_scorers(model, "scorers.safetensors")

The package is layered (imports flow one way): ``kvpop.cli`` -> ``kvpop.demo`` / ``kvpop.training``
-> ``kvpop.core`` (everything re-exported here) -> ``kvpop.models`` (one adapter per model family)
-> ``kvpop_kernels`` (Triton kernels, never imports transformers).  Importing ``kvpop`` also registers the
baselines' cache policies (``kvpop.baselines.attention_scores``: ``KVpopCache(policy="tova" | "h2o")``).  See
``docs/DESIGN.md``.
"""
from .baselines import attention_scores as _attention_scores  # noqa: F401  (registers the tova and h2o policies)
from .core import (
                   SUPPORTED_MODEL_TYPES,
                   KVpopCache,
                   KVpopConfig,
                   KVpopLayer,
                   MLPScorer,
                   MLSTMScorer,
                   TeacherTopK,
                   build_scorer,
                   decay_range_for_context,
                   disabled,
                   distill_loss,
                   fused_distill_loss,
                   fused_output_head,
                   fused_teacher_topk,
                   get_config,
                   is_patched,
                   kvpop_layers,
                   load_scorers,
                   make_teacher,
                   patch,
                   patched,
                   read_scorer_config,
                   save_scorers,
                   score_loss,
                   score_loss_terms,
                   score_stats,
                   set_teacher_targets,
                   teacher_targets,
                   teacher_topk,
                   unpatch,
)
from .models import cache_kwargs

__all__ = [
    "KVpopConfig", "KVpopCache", "patch", "unpatch", "patched", "is_patched", "get_config", "kvpop_layers",
    "disabled", "make_teacher", "score_loss", "score_loss_terms", "score_stats", "distill_loss", "teacher_topk",
    "TeacherTopK", "fused_distill_loss", "fused_teacher_topk", "fused_output_head", "teacher_targets",
    "set_teacher_targets",
    "save_scorers", "load_scorers", "read_scorer_config", "KVpopLayer", "MLPScorer", "MLSTMScorer",
    "build_scorer", "SUPPORTED_MODEL_TYPES", "decay_range_for_context", "cache_kwargs",
]
