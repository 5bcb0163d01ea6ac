"""The kvpop library core: what a user imports to patch, train with and decode through KVpop.

``config`` (KVpopConfig), ``scorers`` (MLP / mLSTM), ``layer`` (KVpopLayer), ``attention`` (the
``"kvpop"`` attention function), ``hooks`` (the scorer's priorities while decoding), ``cache``
(KVpopCache), ``lifecycle`` (the patch lifecycle every method shares), ``patching`` (patch / unpatch /
patched), ``checkpoint`` (save / load scorers; the layer file), ``loss`` (L_score), ``distill`` (the
distillation KL, the fused chunked LM head), ``budgets`` (head-adaptive budgets: ``allocate``,
``ablation_importance``; import it from ``kvpop.core.budgets``).  The core imports ``kvpop.models``
(the family seam) and ``kvpop_kernels``, never ``kvpop.baselines``, ``kvpop.training``, ``kvpop.demo`` or
``kvpop.cli``.
"""
from .attention import set_teacher_targets, teacher_targets
from .cache import KVpopCache
from .checkpoint import load_scorers, read_scorer_config, save_scorers
from .config import KVpopConfig, decay_range_for_context
from .layer import KVpopLayer, kvpop_layers
from .loss import (
    TeacherTopK,
    distill_loss,
    fused_distill_loss,
    fused_output_head,
    fused_teacher_topk,
    score_loss,
    score_loss_terms,
    score_stats,
    teacher_topk,
)
from .patching import SUPPORTED_MODEL_TYPES, disabled, get_config, is_patched, make_teacher, patch, patched, unpatch
from .scorers import MLPScorer, MLSTMScorer, build_scorer

__all__ = [
    "KVpopConfig", "decay_range_for_context",
    "KVpopCache", "patch", "unpatch", "patched", "is_patched", "get_config", "kvpop_layers",
    "disabled", "make_teacher", "score_loss", "score_loss_terms", "score_stats", "distill_loss", "teacher_topk",
    "TeacherTopK", "fused_distill_loss", "fused_teacher_topk", "fused_output_head", "teacher_targets",
    "set_teacher_targets",
    "save_scorers", "load_scorers", "read_scorer_config", "KVpopLayer", "MLPScorer", "MLSTMScorer",
    "build_scorer", "SUPPORTED_MODEL_TYPES",
]
