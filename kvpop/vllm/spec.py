"""The KV-cache spec and manager that give every request ``ceil(B / block_size)`` blocks, for ever.

A request served with the mLSTM scorer holds ``state_blocks`` more, in front (its scorer's state: vLLM
counts it in its KV-cache memory and frees it with the request).

``FixedBudgetSpec`` is vLLM's full-attention spec with a budget ``B`` (slots per KV head and layer);
``FixedBudgetManager`` allocates blocks for ``min(num_tokens, ceil(B / bs) * bs)`` tokens, so a
request's allocation stops growing once it holds its budget.  The scheduler's admission control and
the "maximum concurrency" vLLM reports both follow from ``max_memory_usage_bytes``.

Prefix caching is switched off for these layers: a block's content depends on every token that
was evicted before it was written, so two requests with one prefix do not share blocks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

__all__ = ["FixedBudgetSpec", "FixedBudgetManager"]


@dataclass(frozen=True, kw_only=True)
class FixedBudgetSpec(FullAttentionSpec):
    budget: int = 0
    """``B = s + w + k``: slots per KV head and layer (head-adaptive budgets: their mean)."""
    whole: bool = False
    """The packed layout (head-adaptive budgets): a request holds its ``budget_blocks`` from its first token
    (every layer's and head's slots sit at fixed offsets of the block), not ``min(n, B)`` slots' worth."""
    state_blocks: int = 0
    """Pages in front of a request's slots that hold its recurrent scorer's state (the mLSTM's,
    ``kvpop.vllm.recurrent``), held from its first token."""

    @property
    def budget_blocks(self) -> int:
        return cdiv(self.budget, self.block_size)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        if self.whole:
            return self.budget_blocks * self.page_size_bytes
        slots = min(self.budget_blocks, cdiv(vllm_config.model_config.max_model_len, self.block_size))
        return (self.state_blocks + slots) * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        # the block-table row: the state pages come first, then up to max_len tokens' slots
        return self.state_blocks + super().max_num_blocks_per_req(vllm_config, max_len)

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @classmethod
    def merge(cls, specs):
        # the parent rebuilds cls(...) from FullAttentionSpec's fields only: carry the budget over
        budgets = {s.budget for s in specs}
        if len(budgets) != 1:
            raise ValueError(f"all kvpop layers of one KV-cache group need one budget, got {sorted(budgets)}")
        if len({s.state_blocks for s in specs}) != 1:
            raise ValueError(f"all kvpop layers of one KV-cache group need one state size, got "
                             f"{sorted({s.state_blocks for s in specs})} pages")
        return dataclasses.replace(super().merge(specs), budget=specs[0].budget, whole=specs[0].whole,
                                   state_blocks=specs[0].state_blocks)


class FixedBudgetManager(FullAttentionManager):
    """Full-attention manager whose per-request allocation stops at ``ceil(B / bs)`` blocks (and the state
    pages in front of them, allocated with the first token: they come first in the request's block list)."""

    def _cap(self, num_tokens: int) -> int:
        spec = self.kv_cache_spec
        full = spec.budget_blocks * self.block_size
        return full if spec.whole else spec.state_blocks * self.block_size + min(num_tokens, full)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs):
        return super().get_num_blocks_to_allocate(request_id, self._cap(num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return super().allocate_new_blocks(request_id, self._cap(num_tokens), self._cap(num_tokens_main_model))

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args, **kwargs):
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, *args, **kwargs) -> None:
        return None
