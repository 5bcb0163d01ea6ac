"""DMS's ragged cache: per layer and KV head the sinks, a ring of the window and the kept long-range
tokens in pages of a pool the heads share (docs/DESIGN.md, DMS), and the attention step through it."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

import kvpop_kernels
from kvpop.core.cache import ServedCache, cache_settings

from .config import DMSConfig, check_float, check_int
from .gates import gate_evict_at

__all__ = ["DMSCacheLayer", "DMSCache", "head_entries", "cache_attention"]


class DMSCacheLayer(CacheLayerMixin):
    """One layer of :class:`DMSCache` (batch 1): per KV head a fixed part and a paged long-range store.

    Fixed part: ``s`` sink slots and a ring of ``w`` window slots per head (token ``t`` in slot
    ``s + (t - s) % w``; ``fixed_k/fixed_v [Hkv, s + w, D]``) and the gate decision of each ring token
    (``ring_evict [Hkv, w]``).  Long-range store: the tokens a head kept when they left the window, in
    order, in pages of ``page`` tokens from a pool the layer's heads share (``pool_k/pool_v [n_pages,
    page, D]``, ``pool_pos [n_pages, page]``); head ``h``'s ``i``-th kept token sits at
    ``pool[table[h, i // page], i % page]`` and ``kept_len[h]`` counts them (all on the device).  Page 0
    is a scratch page no head owns (the writes of heads that keep nothing land there) and the table's
    last column a write-off column.  Nothing is ever removed (a DMS decision is final).

    A decode step reads nothing back to the host: the host keeps upper bounds of the pages in use and
    of the longest head since it last read them (at most one new page per head every ``page`` steps),
    and reads them again only when the bounds could pass the capacity, then grows the pool and table
    by ``growth`` (or to room for ``lookahead`` more pages per head, whichever is more).  Memory is the
    pages the heads fill (at most ``page - 1`` spare slots each) plus that spare pool, never a padded
    maximum over heads.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, *, sinks: int, window: int, threshold: float, page: int = 16, growth: float = 1.25,
                 lookahead: int = 4):
        super().__init__()
        check_int("page", page, 1)
        check_int("lookahead", lookahead, 1)
        check_float("growth", growth, 1.0)
        self.sinks, self.window, self.threshold = sinks, window, threshold
        self.page, self.growth, self.lookahead = page, growth, lookahead
        self.seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, hkv, _, d = key_states.shape
        dev, dt = key_states.device, key_states.dtype
        self.device, self.dtype = dev, dt
        n = self.sinks + self.window
        self.fixed_k = torch.zeros(hkv, n, d, dtype=dt, device=dev)
        self.fixed_v = torch.zeros(hkv, n, value_states.shape[-1], dtype=dt, device=dev)
        self.ring_evict = torch.zeros(hkv, self.window, dtype=torch.bool, device=dev)
        self.pool_k = torch.zeros(1, self.page, d, dtype=dt, device=dev)
        self.pool_v = torch.zeros(1, self.page, value_states.shape[-1], dtype=dt, device=dev)
        self.pool_pos = torch.full((1, self.page), -1, dtype=torch.int32, device=dev)
        self.table = torch.zeros(hkv, 1, dtype=torch.int64, device=dev)  # no page column yet + write-off
        self.kept_len = torch.zeros(hkv, dtype=torch.int64, device=dev)
        self.next_free = torch.ones((), dtype=torch.int64, device=dev)
        self._read_pages, self._read_longest, self._steps = 1, 0, 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if key_states.shape[0] != 1:
            raise NotImplementedError(f"DMSCache decodes one sequence at a time (batch 1); got batch "
                                      f"{key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    @property
    def prefilled(self) -> bool:
        return self.seen > 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.seen = 0
        self.pending = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("DMSCache does not support beam search (batch size 1 only)")

    def slot_of(self, pos: int) -> int:
        return pos if pos < self.sinks else self.sinks + (pos - self.sinks) % self.window

    # -- capacity (host) -------------------------------------------------------------------------------
    def _bounds(self, steps: int) -> tuple[int, int]:
        """Upper bounds of (pages in use, longest head) after ``steps`` more one-token appends."""
        k = self._steps + steps
        return self._read_pages + self.kept_len.shape[0] * -(-k // self.page), self._read_longest + k

    def _read_back(self) -> None:
        self._read_pages, self._read_longest = (int(x) for x in torch.stack([self.next_free,
                                                                              self.kept_len.max()]).tolist())
        self._steps = 0

    def _grow(self, pages: int, longest: int) -> None:
        """Pool of at least ``pages`` pages and a table of at least ``ceil(longest / page)`` columns."""
        cap = self.pool_k.shape[0]
        if pages > cap:
            new = max(pages, math.ceil(cap * self.growth))
            for name in ("pool_k", "pool_v", "pool_pos"):
                old = getattr(self, name)
                buf = old.new_full((new, *old.shape[1:]), -1 if name == "pool_pos" else 0)
                buf[:cap] = old
                setattr(self, name, buf)
        cols, width = -(-longest // self.page), self.table.shape[1] - 1
        if cols > width:
            new = max(cols, math.ceil(width * self.growth))
            buf = torch.zeros(self.table.shape[0], new + 1, dtype=torch.int64, device=self.table.device)
            buf[:, :width] = self.table[:, :width]
            self.table = buf

    def _reserve_steps(self, steps: int) -> None:
        """Room for ``steps`` more one-token appends per head; reads back only when the bounds pass."""
        pages, longest = self._bounds(steps)
        if pages <= self.pool_k.shape[0] and -(-longest // self.page) <= self.table.shape[1] - 1:
            return
        self._read_back()
        self._grow(*self._bounds(max(steps, self.lookahead * self.page)))

    # -- the long-range store (device) -----------------------------------------------------------------
    def _write(self, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append, per head ``h``, the tokens ``i`` with ``keep[h, i]`` (``keep [Hkv, m]``, ``k/v [Hkv, m, D]``,
        ``pos [m]``), in order; the capacity must have been reserved."""
        P = self.page
        H, m = keep.shape
        W = self.table.shape[1] - 1
        idx = torch.where(keep, self.kept_len[:, None] + keep.long().cumsum(1) - 1, 0)  # [H, m]
        newp = keep & (idx % P == 0)
        ids = self.next_free + newp.flatten().long().cumsum(0).view(H, m) - 1
        self.table.scatter_(1, torch.where(newp, idx // P, W), torch.where(newp, ids, 0))
        page = torch.where(keep, self.table.gather(1, (idx // P).clamp(max=W)), 0).flatten()
        off = torch.where(keep, idx % P, 0).flatten()
        self.pool_k.index_put_((page, off), k.reshape(H * m, -1).to(self.pool_k.dtype))
        self.pool_v.index_put_((page, off), v.reshape(H * m, -1).to(self.pool_v.dtype))
        self.pool_pos.index_put_((page, off), pos.to(torch.int32).expand(H, m).reshape(-1))
        self.kept_len += keep.sum(1)
        self.next_free += newp.sum()

    def extend(self, keep: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append many tokens at once (a prefill): reads the per-head counts back once and reserves exactly."""
        lens = self.kept_len.tolist()
        adds = keep.sum(1).tolist()
        P = self.page
        new_pages = sum(-(-(n + a) // P) - -(-n // P) for n, a in zip(lens, adds))
        self._read_back()
        self._grow(self._read_pages + new_pages, max(n + a for n, a in zip(lens, adds)))
        self._write(keep, k, v, pos)
        self._read_back()

    def long_positions(self) -> list[list[int]]:
        """Positions of the long-range tokens each head holds, in order (reads the device)."""
        out = []
        for h, n in enumerate(self.kept_len.tolist()):
            i = torch.arange(n, device=self.table.device)
            out.append(self.pool_pos[self.table[h, i // self.page], i % self.page].tolist())
        return out

    def head_entries(self) -> list[int]:
        """Entries each KV head holds now: sinks and window tokens seen, plus its kept long-range tokens."""
        fixed = min(self.seen, self.sinks + self.window)
        return [fixed + n for n in self.kept_len.tolist()] if self.is_initialized else []

    def nbytes(self) -> int:
        """Bytes allocated by this layer: the fixed slots, the page pool and its tables."""
        if not self.is_initialized:
            return 0
        ts = [self.fixed_k, self.fixed_v, self.ring_evict, self.pool_k, self.pool_v, self.pool_pos, self.table,
              self.kept_len]
        return sum(t.numel() * t.element_size() for t in ts)

    def kept_bytes(self) -> int:
        """Bytes of the keys and values the heads hold (without unused capacity)."""
        if not self.is_initialized:
            return 0
        fk, fv = self.fixed_k, self.fixed_v
        per = fk.shape[-1] * fk.element_size() + fv.shape[-1] * fv.element_size()
        return per * sum(self.head_entries())

    def attend(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per query head ``q [Hq, D]`` over what each KV head holds -> ``[Hq, D]`` (q's dtype):
        ``kvpop_kernels.ragged_paged_decode`` (each head costs its own length on the Triton path), over
        the table's columns up to the host's bound of the longest head."""
        n_fixed = min(self.seen, self.sinks + self.window)
        pages, longest = self._bounds(0)
        pages = min(pages, self.pool_k.shape[0])  # the spare pool is never referenced
        cols = min(-(-longest // self.page), self.table.shape[1] - 1)
        out, _ = kvpop_kernels.ragged_paged_decode(q, self.fixed_k, self.fixed_v, n_fixed, self.pool_k[:pages],
                                                   self.pool_v[:pages], self.table[:, :cols], self.kept_len,
                                                   scale=scale, check=False)  # no host read per step
        return out


class DMSCache(ServedCache, Cache):
    """Per-KV-head ragged cache for batch-1 decoding with a DMS-patched model (:func:`patch_dms`).

    Each head keeps the sinks, the window and the long-range tokens its gates kept, so heads hold
    different numbers of tokens (:meth:`head_entries`); the long-range tokens live in pages of ``page``
    tokens (:class:`DMSCacheLayer`), so memory (:meth:`nbytes`) is what the heads hold plus at most
    ``page - 1`` slots per head and a spare pool of at most ``growth - 1`` of the pages in use or
    ``lookahead`` pages per head, never a padded maximum over heads.  Prefill (the first call, several
    tokens) is the teacher-forced hard-gate forward (``sparse_attention`` with :func:`gate_evict_at`);
    every later token is one decode step over all heads at once, which reads nothing back to the host.
    ``threshold`` overrides the model's ``DMSConfig.threshold``.
    """

    def __init__(self, model: Any = None, *, config: DMSConfig | None = None, num_layers: int | None = None,
                 threshold: float | None = None, page: int = 16, lookahead: int = 4):
        config, num_layers = cache_settings("DMSCache", model, config, num_layers, attr="dms_config",
                                            how="a DMS-patched model (patch_dms(model)) or config=DMSConfig(...)")
        self.dms_config = self.served_config = config
        self._claims: dict[int, tuple[str, Any, bool]] = {}
        if threshold is not None:
            check_float("threshold", threshold)  # NaN would evict nothing, silently
        thr = config.threshold if threshold is None else float(threshold)
        super().__init__(layers=[DMSCacheLayer(sinks=config.sinks, window=config.window, threshold=thr, page=page,
                                               lookahead=lookahead) for _ in range(num_layers)])

    served_by = "dms"
    served_fields = ("sinks", "window")
    served_how = "kvpop.baselines.dms.patch_dms(model)"
    served_ctor = "kvpop.baselines.dms.DMSCache(model)"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer_idx < len(self.layers) or self.layers[layer_idx].seen == 0:
            self.check_served(layer_idx)  # the layer's first call: is the model DMS-patched for this cache?
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def head_entries(self) -> torch.Tensor:
        """Entries held per layer and KV head, int64 ``[num_layers, Hkv]``."""
        return torch.tensor([la.head_entries() for la in self.layers], dtype=torch.int64)

    def nbytes(self) -> int:
        return sum(la.nbytes() for la in self.layers)

    def kept_bytes(self) -> int:
        return sum(la.kept_bytes() for la in self.layers)


def head_entries(cache: DMSCache) -> torch.Tensor:
    return cache.head_entries()


def cache_attention(cache: DMSCache, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, logits: torch.Tensor, scaling: float | None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    if module.layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[module.layer_idx]
    pending, layer.pending = layer.pending, None
    if pending is None or pending[0] is not key:
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    S = query.shape[2]
    if layer.seen > 0 and S > 1 and isinstance(position_ids, torch.Tensor) and position_ids.numel():
        first = int(position_ids.reshape(-1)[0])  # a host read on multi-token calls only, never per token
        if first != layer.seen:
            raise ValueError(
                f"this DMSCache has seen {layer.seen} tokens, so the next call must start at position {layer.seen}, "
                f"but it starts at position {first}. Its decisions are final (evicted tokens are gone): use a "
                f"fresh kvpop.baselines.dms.DMSCache(model) for a new prompt, or call cache.reset() first.")
    pos = torch.arange(layer.seen, layer.seen + S, device=key.device)
    evict = (logits[0] > layer.threshold) & (pos >= layer.sinks)  # [Hkv, S]
    if layer.seen == 0 and S > 1:
        return _prefill(layer, query, key, value, evict, scale)
    outs = [_decode(layer, query[0, :, i], key[0, :, i], value[0, :, i], evict[:, i], scale) for i in range(S)]
    return torch.stack(outs, dim=0).unsqueeze(0)  # [1, S, Hq, D]


def _prefill(layer: DMSCacheLayer, query, key, value, evict, scale) -> torch.Tensor:
    s, w = layer.sinks, layer.window
    S = key.shape[2]
    ev = gate_evict_at(evict[None], sinks=s, window=w)
    out, _ = kvpop_kernels.sparse_attention(query, key, value, ev, sinks=s, window=w, scale=scale)
    kk, vv = key[0], value[0]
    n_sink = min(s, S)
    layer.fixed_k[:, :n_sink] = kk[:, :n_sink]
    layer.fixed_v[:, :n_sink] = vv[:, :n_sink]
    win = torch.arange(max(s, S - w), S, device=kk.device)
    if win.numel():
        slots = s + (win - s) % w
        layer.fixed_k[:, slots] = kk[:, win]
        layer.fixed_v[:, slots] = vv[:, win]
        layer.ring_evict[:, slots - s] = evict[:, win]
    left = torch.arange(s, max(s, S - w), device=kk.device)  # tokens that have left the window
    if left.numel():
        layer.extend(~evict[:, left], kk[:, left], vv[:, left], left)
    layer.seen = S
    return out.transpose(1, 2)


def _decode(layer: DMSCacheLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, evict: torch.Tensor,
            scale: float) -> torch.Tensor:
    """One token at position ``layer.seen``: ``q [Hq, D]``, ``k/v [Hkv, D]``, ``evict [Hkv]`` -> ``[Hq, D]``.
    No value is read back to the host (but for a rare capacity check, :class:`DMSCacheLayer`)."""
    s, w = layer.sinks, layer.window
    p = layer.seen
    slot = layer.slot_of(p)
    if p >= s + w:  # token p - w leaves the window now: the heads that kept it store it
        layer._reserve_steps(1)
        pos = torch.full((1,), p - w, dtype=torch.int64, device=k.device)
        layer._write(~layer.ring_evict[:, slot - s, None], layer.fixed_k[:, slot:slot + 1],
                     layer.fixed_v[:, slot:slot + 1], pos)
        layer._steps += 1
    layer.fixed_k[:, slot] = k
    layer.fixed_v[:, slot] = v
    if p >= s:
        layer.ring_evict[:, slot - s] = evict
    layer.seen = p + 1
    return layer.attend(q, scale)
