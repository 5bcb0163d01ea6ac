"""Slot layouts of the fixed-budget decode state: where each KV head's ``B_h = s + w + k_h`` slots lie.

A step's tensors travel as two objects (``state.py``): the slot state it updates in place (:class:`SlotState`:
keys, values, slot positions, long-range priorities, a quantised layout's scales) and the new token
(:class:`DecodeStep`).  One object per layout says where the slots lie in the state; it is taken by
``fixed_budget_decode(state, layout=...)`` and held by each layer of ``kvpop.KVpopCache``:

* :class:`UniformLayout` -- every KV head holds the same ``B`` slots: ``k_cache, v_cache [N, Hkv, B, D]``,
  ``slot_pos [N, Hkv, B]``, ``slot_prio [N, Hkv, k]``;
* :class:`PackedLayout` -- head-adaptive budgets, one ``B_h`` per KV head, packed back to back:
  ``k_cache, v_cache [N, T, D]`` (``T = sum B_h``), ``slot_pos [N, T]``, ``slot_prio [N, K]``
  (``K = sum k_h``);
* :class:`QuantizedLayout` -- either of them with 8-bit keys and values and a float32 scale per slot.

Inside one head both hold sinks ``[0, s)``, the window ring ``[s, s + w)`` and the long-range slots
``[s + w, B_h)``.  A layout answers what differs between them: the state's shapes
(:meth:`SlotLayout.state_shapes`), each head's place (:meth:`SlotLayout.spans`), the check of a step's
tensors (:meth:`SlotLayout.check`), what the Triton kernels read of it (:meth:`SlotLayout.kernel_meta`),
the vectorised PyTorch step (:meth:`SlotLayout.torch_step`) and the views a prefill fills
(:meth:`SlotLayout.head_groups`).  The eviction rule, the kernels and the launcher are shared
(``kvpop_kernels.decode``); a further layout is a further class here (``base.py`` the interface, one module
per layout).  Semantics: docs/DESIGN.md sections
5 and 9.
"""
from __future__ import annotations

from .base import HeadSpan, SlotLayout
from .packed import PackedLayout
from .quantized import KV_DTYPES, QuantizedLayout, check_kv_dtype, dequantize, quantize
from .state import DecodeStep, SlotState, slot_of
from .uniform import UniformLayout

__all__ = ["SlotLayout", "SlotState", "DecodeStep", "UniformLayout", "PackedLayout", "QuantizedLayout", "HeadSpan",
           "KV_DTYPES", "as_layout", "check_kv_dtype", "dequantize", "quantize", "slot_of"]


def as_layout(layout: SlotLayout | None, head_budgets=None) -> SlotLayout:
    """The layout of a ``fixed_budget_decode`` call: ``layout`` as given, or ``PackedLayout(head_budgets)``
    for the shorthand ``head_budgets=``, or the uniform layout of the tensors."""
    if layout is not None:
        if head_budgets is not None:
            raise ValueError("give layout= or head_budgets=, not both (head_budgets=B is "
                             "layout=PackedLayout(B))")
        if not isinstance(layout, SlotLayout):
            raise TypeError(f"layout must be a kvpop_kernels.layout.SlotLayout (UniformLayout(), "
                            f"PackedLayout(budgets), ...), got {type(layout).__name__}")
        return layout
    if head_budgets is not None:
        return PackedLayout(head_budgets)
    return UniformLayout()
