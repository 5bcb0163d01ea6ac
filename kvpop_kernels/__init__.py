"""Triton kernels of KVpop (learned fixed-budget KV-cache eviction).

Every op takes CUDA tensors to Triton, CPU tensors to the Triton interpreter when
``TRITON_INTERPRET=1`` is set before import, and CPU tensors otherwise to a PyTorch
path.  Each op has a dense oracle of the same name in ``kvpop_kernels.reference``.
This package never imports transformers.
"""
from ._utils import NEVER
from .decode import fixed_budget_decode
from .future_target import future_attention_target
from .layout import SlotState
from .paged_decode import ragged_paged_decode
from .schedule import eviction_decisions, eviction_schedule, visible_at
from .sparse_attention import sparse_attention

__all__ = [
    "NEVER",
    "eviction_schedule",
    "eviction_decisions",
    "visible_at",
    "future_attention_target",
    "sparse_attention",
    "fixed_budget_decode",
    "SlotState",
    "ragged_paged_decode",
]
