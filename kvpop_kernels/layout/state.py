"""The two objects a decode step passes around: the slot state it updates in place (:class:`SlotState`) and the
new token it brings (:class:`DecodeStep`).  A layout (``kvpop_kernels.layout``) says where each KV head's slots
lie in these tensors; ``fixed_budget_decode`` takes a state and a layout."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

__all__ = ["SlotState", "DecodeStep", "slot_of"]


def slot_of(pos, *, sinks: int, window: int):
    """Slot of the token at ``pos`` while it is a sink or in the window: ``pos`` for a sink,
    ``s + (pos - s) % w`` in the ring otherwise (inside its head's slots, in either layout).
    ``pos`` is a Python int or an integer tensor (elementwise, no host synchronisation)."""
    if isinstance(pos, torch.Tensor):
        return torch.where(pos < sinks, pos, sinks + (pos.clamp_min(sinks) - sinks) % window)
    return pos if pos < sinks else sinks + (pos - sinks) % window


@dataclass
class SlotState:
    """The per-slot tensors of a fixed budget of slots, updated in place by each decode step.

    Shapes in the uniform layout (``kvpop_kernels.layout.UniformLayout``; the packed layout puts the slots of
    all heads of a row in one dimension of ``T``, the long-range priorities in one of ``K``), with or without
    the leading batch dimension ``N``:

    * ``k_cache, v_cache [N, Hkv, B, D]``: the keys and values of the slots (a quantised layout's codes);
    * ``slot_pos [N, Hkv, B]`` int32: each slot's token position, ``-1`` when empty;
    * ``slot_prio [N, Hkv, k]`` float32: the static priority of each long-range slot's token, ``-inf`` when
      empty;
    * ``k_scale, v_scale``: a quantised layout's float32 scales, one per slot (``slot_pos``'s shape and
      strides); None otherwise.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_pos: torch.Tensor
    slot_prio: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """``(field, tensor)`` of every tensor held (the scales only when there are some)."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, in field order."""
        return [t for _, t in self.named()]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SlotState:
        """A state of ``fn(t)`` for every tensor ``t`` held (e.g. some rows, or a batch dimension added)."""
        return replace(self, **{name: fn(t) for name, t in self.named()})

    def reset(self) -> None:
        """Empty every slot in place: keys, values and scales 0, positions -1, priorities -inf."""
        for name, t in self.named():
            if name == "slot_pos":
                t.fill_(-1)
            elif name == "slot_prio":
                t.fill_(float("-inf"))
            else:
                t.zero_()

    def nbytes(self) -> int:
        """Bytes of the tensors held."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def moved(self, step: DecodeStep) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(state tensor, the new token's part)`` of everything a step writes into the new token's slot
        besides its position: keys, values, and a quantised layout's scales."""
        pairs = [(self.k_cache, step.k_new), (self.v_cache, step.v_new)]
        if self.k_scale is not None:
            pairs += [(self.k_scale, step.k_new_scale), (self.v_scale, step.v_new_scale)]
        return pairs


@dataclass
class DecodeStep:
    """The new token of a decode step (with or without the leading batch dimension ``N``).

    * ``q [N, Hq, D]``: its queries (rotated); ``k_new, v_new [N, Hkv, D]``: its key (rotated) and value, or a
      quantised layout's codes of them once encoded (``SlotLayout.encode``), with their scales ``k_new_scale,
      v_new_scale [N, Hkv]`` float32;
    * ``leaving_prio [N, Hkv]`` float32: the priority of the token ``pos - w`` leaving the window at this step;
    * ``pos``: its position, a Python int or an int tensor ``[N]`` on the device.
    """

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    leaving_prio: torch.Tensor
    pos: int | torch.Tensor
    k_new_scale: torch.Tensor | None = None
    v_new_scale: torch.Tensor | None = None

    @property
    def batched(self) -> bool:
        """Whether the tensors have the leading batch dimension ``N``."""
        return self.q.dim() == 3

    def tensors(self) -> list[torch.Tensor]:
        """The step's input tensors (``pos`` not included)."""
        return [self.q, self.k_new, self.v_new, self.leaving_prio]
