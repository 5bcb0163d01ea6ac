"""Attention backends of the plugin: vLLM's own paged kernels, with kvpop writing the cache.

Both subclass a stock vLLM backend and set ``forward_includes_kv_cache_update = True``: vLLM's
position-based cache write (``slot_mapping``) is never used, the backend writes the fixed-budget
layout of :mod:`kvpop.vllm.slots` itself.  Per forward, for each request of the batch:

* a **decode** token (one new token after at least one cached): :func:`slots.decode_step` for all
  decode requests at once (eviction + write), then the backend's unchanged paged decode kernel with
  ``seq_len = min(n, B)``: it reads exactly the request's ``min(n, B)`` occupied slots;
* a **prompt or a later chunk** (several tokens): :func:`slots.extend`, i.e. ``eviction_schedule`` +
  ``sparse_attention`` over the cached slots and the chunk, then the kept tokens are written.

With the mLSTM scorer (``layer.kvpop_recurrent``) the step's priorities are computed here, not in the model:
each request's scorer state sits in the first ``E`` blocks of its block-table row (:mod:`kvpop.vllm.recurrent`),
its slots in the rest (the stock kernels get the shifted table); a decode token prices the token leaving the
window (``decode_step``'s ``p_leave``), a prompt or chunk prices the tokens leaving inside it.

Beside the KV cache each layer keeps two side tables ``[num_blocks, Hkv, bs]`` (int32 positions,
float32 priorities): 8 bytes per slot and KV head, allocated on the first forward (vLLM does not
count them in its KV-cache memory: 3% of the cache for a 32-wide float32 head, 1.6% for a 128-wide
bfloat16 one).

``KVpopCPUBackend`` (CPU_ATTN) is what the tests run.  ``KVpopTritonBackend`` (TRITON_ATTN, CUDA) is
written alongside and **untested on a GPU**: a pure-decode batch takes one fixed-shape path with no
host synchronisation and no Python loop over requests (CUDA-graph capturable: padded rows of a graph
batch write their slots into the null block 0 and their mLSTM state nowhere), then vLLM's unified Triton
kernel over ``min(n, B)`` slots (head-adaptive budgets: ``kvpop_kernels.slot_decode.packed_slot_decode``); a batch
with a prompt or chunk in it runs eagerly, request by request, through ``extend``.  The mLSTM's state is read and
written in its pages (``kvpop_kernels.mlstm_decode`` on a GPU, :func:`recurrent.decode_priorities_in_pages` on the
CPU).  ``kv_cache_dtype="int8_per_token_head"`` / ``"fp8_per_token_head"``:
kvpop's codes and scales in vLLM's own page (:mod:`kvpop.vllm.quantized`), dequantised on load by those kernels
on a GPU, by kvpop's PyTorch attention on the CPU.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from kvpop_kernels.slot_decode import packed_slot_decode

from . import quantized, recurrent, slots

__all__ = ["KVpopCPUBackend", "KVpopCPUImpl", "KVpopTritonBackend", "KVpopTritonImpl"]


class _FixedBudgetImpl:
    """What both implementations share: side tables, request classification, the prompt/chunk path."""

    _kvpop_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _check_supported(self) -> None:
        quantized.check_cache_dtype(self.kv_cache_dtype, cpu=isinstance(self, CPUAttentionBackendImpl))
        no_window = getattr(self, "sliding_window", None) in (None, -1, (-1, -1))
        if not no_window or getattr(self, "alibi_slopes", None) is not None:
            raise NotImplementedError("kvpop layers have no sliding window or ALiBi of their own")

    def _tables(self, K: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
        nb, hkv, bs, _ = K.shape
        shared = layer.kvpop_layout is not None  # the layers of a packed block share one cache: and its tables
        t = _SHARED_TABLES.get((K.data_ptr(), K.device)) if shared else self._kvpop_tables
        if t is None or t[0].shape != (nb, hkv, bs) or t[0].device != K.device:
            t = (torch.full((nb, hkv, bs), -1, dtype=torch.int32, device=K.device),
                 torch.full((nb, hkv, bs), float("-inf"), dtype=torch.float32, device=K.device))
            if shared:
                _SHARED_TABLES[(K.data_ptr(), K.device)] = t
            else:
                self._kvpop_tables = t
        return t

    @staticmethod
    def _where(layer) -> dict:
        """The slot layout keywords of :mod:`slots` for ``layer``."""
        if layer.kvpop_layout is not None:
            return {"layout": layer.kvpop_layout}
        return {"budget": layer.kvpop_budget}

    def _extend_rows(self, layer, rows, qsl, ctx, bt, query, key, value, prio, K, V, output, *, k_pre=None,
                     state=None) -> None:
        """The prompt/chunk path, one request at a time (host-side bookkeeping; runs eagerly).  With the mLSTM
        (``state``: :meth:`_state`) the priorities come from each request's state and ``k_pre``."""
        sp, pr = self._tables(K, layer)
        for r in rows:
            a, b = qsl[r], qsl[r + 1]
            p = prio[a:b] if state is None else self._recurrent_extend(layer, state, r, bt[r], K, V, pr, ctx[r],
                                                                       k_pre[a:b], value[a:b])
            output[a:b] = slots.extend(K, V, sp, pr, bt[r], ctx[r], query[a:b], key[a:b], value[a:b], p,
                                       sinks=layer.kvpop_sinks, window=layer.kvpop_window, scale=self.scale,
                                       **self._where(layer)).to(output.dtype)

    # ----------------------------------------------------------- the mLSTM's state (kvpop.vllm.recurrent)
    @staticmethod
    def _state(layer, kv_cache: torch.Tensor, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pages [num_blocks, page floats]``, a float32 view of the KV cache, ``state blocks [R, E])``: the
        first ``E`` block-table columns of each request hold its mLSTM state (its slots follow)."""
        if not kv_cache.is_contiguous():
            raise NotImplementedError(f"kvpop keeps the mLSTM's state in KV-cache pages, which needs a contiguous "
                                      f"cache; got shape {tuple(kv_cache.shape)}, strides {kv_cache.stride()}")
        pages = kv_cache.view(kv_cache.shape[0], -1).view(torch.float32)
        E = recurrent.state_blocks(layer.kvpop_recurrent[0].scorer, pages.shape[1] * 4)
        return pages, bt[:, :E]

    @staticmethod
    def _window_addr(layer, table: torch.Tensor, t: torch.Tensor, bs: int):
        """Physical ``(block, head, offset)`` ``[N, Hkv, m]`` of tokens ``t [N, m]`` while they are sinks or in the
        window (the uniform layout)."""
        s, w = layer.kvpop_sinks, layer.kvpop_window
        slot = torch.where(t < s, t, s + (t - s).clamp(min=0) % w)
        N, m = t.shape
        hkv = layer.num_kv_heads
        heads = torch.arange(hkv, device=t.device)[None, :, None].expand(N, hkv, m)
        return slots.UniformSlots(layer.kvpop_budget, hkv).addr(table, heads, slot[:, None].expand(N, hkv, m), bs)

    def _recurrent_decode(self, layer, state, rows, bt, V, pos, k_pre, value, valid=None):
        """``(p_new, p_leave)`` ``[N, Hkv]`` of one decode token per request ``rows``: the mLSTM's state absorbs the
        token and prices the one leaving the window (its value read from its window slot, which the new token is
        about to take).  The state is read and written in its pages: on the CPU by
        :func:`recurrent.decode_priorities_in_pages` (PyTorch, the transformers cache's bits), on the GPU backend by
        :func:`recurrent.decode_priorities_kernel` (a Triton kernel; fixed shapes, no host read; rows not ``valid``
        write nowhere and read their slots from block 0, vLLM's null block)."""
        pages, st = state
        st = st[rows]
        if valid is not None:
            st = torch.where(valid[:, None], st, torch.zeros_like(st))
            bt = torch.where(valid[:, None], bt, torch.zeros_like(bt))
        t = (pos.long() - layer.kvpop_window).clamp(min=0)
        v_leave = V[self._window_addr(layer, bt, t[:, None], V.shape[2])].squeeze(2)
        sc = layer.kvpop_recurrent[0]
        args = (sc.scorer, sc.log_gamma(), pages, st, pos, k_pre, value, v_leave)
        if isinstance(self, TritonAttentionImpl):
            p_leave = recurrent.decode_priorities_kernel(*args, valid=valid)
        else:
            p_leave = recurrent.decode_priorities_in_pages(*args)
        return torch.zeros_like(p_leave), p_leave

    def _recurrent_extend(self, layer, state, r: int, bt_row, K, V, pr, ctx: int, k_pre, value) -> torch.Tensor:
        """The priorities ``[n, Hkv]`` of a prompt or chunk of request ``r`` after ``ctx`` tokens: those of the chunk's
        tokens that leave the window within it; those of the cached window tokens that do are written into the
        priority table at their slots (the others are read only once they leave, and stay 0)."""
        pages, st = state
        idx = st[r].long()
        w, n = layer.kvpop_window, k_pre.shape[0]
        flat = pages[idx].view(1, -1)
        tw = torch.arange(ctx - min(w, ctx), ctx, device=K.device)
        v_win = V[self._window_addr(layer, bt_row[None], tw[None], V.shape[2])][0]  # [Hkv, nw, D]
        sc = layer.kvpop_recurrent[0]
        p_t = recurrent.extend_priorities(sc.scorer, sc.log_gamma(), flat, ctx, k_pre, value, v_win)
        pages[idx] = flat.view(idx.numel(), -1)
        lo = max(0, ctx - w)
        n_old = max(0, min(ctx, ctx + n - w) - lo)  # cached tokens leaving in this chunk: [lo, lo + n_old)
        if n_old:
            t_old = torch.arange(lo, lo + n_old, device=K.device)
            pr[self._window_addr(layer, bt_row[None], t_old[None], K.shape[2])] = p_t[None, :, :n_old]
        p = torch.zeros(n, p_t.shape[0], dtype=torch.float32, device=K.device)
        p[: p_t.shape[1] - n_old] = p_t[:, n_old:].T
        return p

    def _packed_decode(self, layer, K, V, bt, pos, query, key, value, prio, valid=None, attend=None) -> torch.Tensor:
        """Eviction, write and attention of one token per request in the packed layout (fixed shapes); ``attend(bt,
        pos, query)`` attends instead of kvpop's decode where given (the CPU backend's vLLM kernel over heads that
        start rows)."""
        sp, pr = self._tables(K, layer)
        slots.decode_step(K, V, sp, pr, bt, pos, key, value, prio, sinks=layer.kvpop_sinks,
                          window=layer.kvpop_window, layout=layer.kvpop_layout, valid=valid)
        if attend is not None:
            return attend(bt, pos, query)
        if isinstance(self, TritonAttentionImpl):
            return self._packed_attention(layer, K, V, bt, pos, query, valid=valid)
        return slots.decode_attention(K, V, bt, pos, query, layout=layer.kvpop_layout, scale=self.scale, valid=valid)

    def _packed_attention(self, layer, K, V, bt, pos, query, ks=None, vs=None, valid=None) -> torch.Tensor:
        """The packed layout's decode attention through ``kvpop_kernels.packed_slot_decode`` (Triton on a GPU: each
        head walks its own slots, 8-bit codes dequantised on load; its PyTorch path on a CPU); fixed shapes, padded
        rows (``valid`` False) read the null block."""
        lay = layer.kvpop_layout
        if valid is not None:
            bt = torch.where(valid[:, None], bt, torch.zeros_like(bt))
        b, offs = lay.device_args(K.device)
        return packed_slot_decode(query, K, V, bt, pos.long().clamp(min=0), b, offs, rows=lay.rows,
                                  block_size=K.shape[2], scale=self.scale, k_scale=ks, v_scale=vs,
                                  max_budget=max(lay.budgets))


_SHARED_TABLES: dict = {}
"""Side tables of a KV cache shared by the layers of a packed block, by the cache's address and device."""


# ------------------------------------------------------------------------------------- CPU
@functools.cache
def _cpu_block_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple[bool, bool]:
    """Whether CPU_ATTN stores keys / values transposed (``[D, bs]``) inside a block for this ISA.

    Found by writing one block with vLLM's own cache-write op and comparing with both layouts, so a
    layout this code does not know fails loudly instead of being misread.
    """
    from vllm import _custom_ops as ops

    bs, D = block_size, head_size
    kv = torch.zeros(1, 1, bs, 2 * D, dtype=dtype)
    kc, vc = kv.view(1, 1, 2 * bs, D).chunk(2, dim=2)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(bs, 1, D, generator=g).to(dtype)
    v = torch.randn(bs, 1, D, generator=g).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(bs, dtype=torch.int64), isa)
    out = []
    for name, x, stored in (("keys", k, kc), ("values", v, vc)):
        flat = stored.reshape(-1)
        if torch.equal(flat, x[:, 0].reshape(-1)):
            out.append(False)
        elif torch.equal(flat, x[:, 0].t().reshape(-1)):
            out.append(True)
        else:
            raise NotImplementedError(f"kvpop: CPU_ATTN's {name} layout for ISA {isa!r} ({dtype}, block {bs}, head "
                                      f"{D}) is neither [bs, D] nor [D, bs] per block; not supported")
    return out[0], out[1]


def _logical(region: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``[nb, Hkv, bs, D]`` view of a CPU_ATTN key or value region (``[nb, Hkv, bs, D]``-shaped chunk)."""
    nb, hkv, bs, D = region.shape
    s0, s1 = region.stride(0), region.stride(1)
    return region.as_strided((nb, hkv, bs, D), (s0, s1, 1, bs) if transposed else (s0, s1, D, 1),
                             region.storage_offset())


class KVpopCPUImpl(_FixedBudgetImpl, CPUAttentionBackendImpl):
    def kvpop_forward(self, layer, query, key, value, prio, kv_cache, meta, output, k_pre=None) -> None:
        if meta is None:  # warm-up / profiling run
            return
        self._check_supported()
        nb, hkv, bs, _ = kv_cache.shape
        region_k, region_v = kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
        if self.kv_cache_dtype in quantized.PER_TOKEN_HEAD:  # codes and scales in vLLM's per-token-head page
            quantized.check_page_views(hkv, bs, self.head_size, self.kv_cache_dtype)
            quantized.cpu_forward(self, layer, *quantized.page_views(kv_cache, self.head_size), query, key, value,
                                  prio, meta, output)
            return
        if self.kv_cache_dtype != "auto":  # plain fp8 codes in CPU_ATTN's blocks, the scales in side tables
            tk, tv = quantized.cpu_block_layout(layer.isa, bs, self.head_size)
            K, V = _logical(region_k, tk), _logical(region_v, tv)
            quantized.cpu_forward(self, layer, K, V, *quantized.scale_tables(K), query, key, value, prio, meta,
                                  output)
            return
        tk, tv = _cpu_block_layout(layer.isa, kv_cache.dtype, bs, self.head_size)
        K, V = _logical(region_k, tk), _logical(region_v, tv)
        B = layer.kvpop_budget
        qsl_t = meta.query_start_loc.long()
        R = qsl_t.shape[0] - 1
        qlen = qsl_t[1:] - qsl_t[:-1]
        ctx = meta.seq_lens[:R].long() - qlen
        bt = meta.block_table[:R]
        state = None
        if layer.kvpop_recurrent:  # the mLSTM's state pages come first in each request's block-table row
            state = self._state(layer, kv_cache, bt)
            bt = bt[:, state[1].shape[1]:]
        dec = ((qlen == 1) & (ctx > 0)).nonzero().flatten()
        if dec.numel() and layer.kvpop_layout is not None:
            tok = qsl_t[dec]
            rows = layer.kvpop_layout.starts_rows(bs)  # then vLLM's kernel reads each head's rows
            attend = functools.partial(self._rows_attention, layer, kv_cache) if rows else None
            output[tok] = self._packed_decode(layer, K, V, bt[dec], ctx[dec], query[tok], key[tok], value[tok],
                                              prio[tok], attend=attend).to(output.dtype)
        elif dec.numel():
            sp, pr = self._tables(K, layer)
            tok = qsl_t[dec]
            p_new, p_leave = (prio[tok], None) if state is None else self._recurrent_decode(
                layer, state, dec, bt[dec], V, ctx[dec], k_pre[tok], value[tok])
            slots.decode_step(K, V, sp, pr, bt[dec], ctx[dec], key[tok], value[tok], p_new,
                              sinks=layer.kvpop_sinks, window=layer.kvpop_window, budget=B, p_leave=p_leave)
            output[tok] = self._vllm_decode_attention(layer, query[tok], region_k, region_v, bt[dec],
                                                      (ctx[dec] + 1).clamp(max=B).to(torch.int32))
        ext = ((qlen > 1) | ((qlen == 1) & (ctx == 0))).nonzero().flatten().tolist()
        if ext:
            self._extend_rows(layer, ext, qsl_t.tolist(), ctx.tolist(), bt, query, key, value, prio, K, V, output,
                              k_pre=k_pre, state=state)

    def _rows_attention(self, layer, kv_cache: torch.Tensor, bt: torch.Tensor, pos: torch.Tensor,
                        query: torch.Tensor) -> torch.Tensor:
        """The decode attention of a packed layout whose heads start rows (``kvpop.vllm.model.packed_align``) by
        vLLM's own C++ kernel: the cache viewed as blocks of one row (``[num_blocks * rows, 1, bs, D]``, a row
        being one KV head's part of a block, in whatever layout the ISA stores it) and each (request, KV head) one
        sequence of its rows, ``min(pos + 1, B_h)`` long (``slots.row_sequences``), its ``g`` query heads the
        sequence's heads.  ``[N, Hq, D]``."""
        nb, rows, bs, _ = kv_cache.shape
        n, hq, d = query.shape
        hkv = len(layer.kvpop_layout.budgets)
        region_k, region_v = kv_cache.view(nb * rows, 1, 2 * bs, d).chunk(2, dim=2)
        table, seen = slots.row_sequences(bt, pos, layout=layer.kvpop_layout, bs=bs)
        out = self._vllm_decode_attention(layer, query.reshape(n * hkv, hq // hkv, d), region_k, region_v, table,
                                          seen)
        return out.view(n, hq, d)

    def _vllm_decode_attention(self, layer, q: torch.Tensor, region_k: torch.Tensor, region_v: torch.Tensor,
                               table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """vLLM's ``cpu_attention_with_kv_cache`` for one query per sequence ``q [S, heads, D]`` over the first
        ``seq_lens [S]`` (int32) positions of the blocks ``table [S, >= blocks]`` of ``region_k`` / ``region_v``
        (``[blocks, kv heads, bs, D]``-shaped CPU_ATTN regions); ``[S, heads, D]``."""
        from vllm import _custom_ops as ops
        from vllm import envs

        q = q.contiguous()
        out = torch.empty_like(q)
        n, heads, d = q.shape
        qsl = torch.arange(n + 1, dtype=torch.int32)
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=n, num_heads=heads, num_kv_heads=region_k.shape[1], head_dim=d, seq_lens=seq_lens,
            dtype=q.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=self.kv_cache_dtype)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=region_k, value_cache=region_v, output=out, query_start_loc=qsl, seq_lens=seq_lens,
            scale=self.scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table.contiguous(),
            softcap=0, scheduler_metadata=sched, s_aux=None, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)
        return out


class KVpopCPUBuilder(CPUAttentionMetadataBuilder):
    """CPU_ATTN's metadata builder; for a packed block (pages of ``L * Hkv`` rows, read by kvpop alone) the
    stock kernel's scheduler metadata, built but never used, is sized for a head count it accepts; so it is for a
    per-token-head cache (read by kvpop alone: the metadata and the ISA are those of an unquantised cache)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        cache = vllm_config.cache_config
        quant = cache.cache_dtype in quantized.PER_TOKEN_HEAD
        if quant:  # CPU_ATTN's ISA choice and scheduler know no per-token-head dtype (shallow copies: no checks)
            cache = copy.copy(cache)
            object.__setattr__(cache, "cache_dtype", "auto")
            vllm_config = copy.copy(vllm_config)
            object.__setattr__(vllm_config, "cache_config", cache)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if getattr(kv_cache_spec, "whole", False):
            self.num_kv_heads = math.gcd(self.num_kv_heads, self.num_heads)


class KVpopCPUBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update = True  # the write needs the eviction state: done inside forward
    supported_kv_cache_dtypes = [*CPUAttentionBackend.supported_kv_cache_dtypes, *quantized.PER_TOKEN_HEAD]

    @classmethod
    def customize_spec(cls, spec):
        """A per-token-head cache's page as vLLM's Triton backend sizes it: ``2 * (D + 4)`` bytes per slot and row
        (the codes and one float32 scale each for the key and the value), so vLLM counts the scales."""
        if spec.kv_quant_mode.is_per_token_head:
            return TritonAttentionBackend.customize_spec(spec)
        return super().customize_spec(spec)

    @staticmethod
    def get_impl_cls():
        return KVpopCPUImpl

    @staticmethod
    def get_builder_cls():
        return KVpopCPUBuilder


# ------------------------------------------------------------------------------------- GPU
class KVpopTritonImpl(_FixedBudgetImpl, TritonAttentionImpl):
    """UNTESTED ON A GPU (no GPU was available when it was written); see the module docstring."""

    def kvpop_forward(self, layer, query, key, value, prio, kv_cache, meta, output, k_pre=None) -> None:
        if meta is None:  # profiling run
            output.zero_()
            return
        self._check_supported()
        if self.kv_cache_dtype in quantized.PER_TOKEN_HEAD:
            self._per_token_head_forward(layer, query, key, value, prio, kv_cache, meta, output)
            return
        D = self.head_size
        K, V = kv_cache[..., :D], kv_cache[..., D:]  # [nb, Hkv, bs, D] views of [nb, Hkv, bs, 2D]
        B = layer.kvpop_budget
        qsl = meta.query_start_loc
        R = qsl.shape[0] - 1
        if meta.max_query_len == 1 and layer.kvpop_layout is not None:
            pos = meta.seq_lens[:R].long() - 1
            output[:R] = self._packed_decode(layer, K, V, meta.block_table[:R], pos, query[:R], key[:R], value[:R],
                                             prio[:R], valid=pos >= 0).to(output.dtype)
            return
        table, state = meta.block_table, None
        if layer.kvpop_recurrent:  # the mLSTM's state pages come first in each request's block-table row
            state = self._state(layer, kv_cache, table)
            table = table[:, state[1].shape[1]:]
        if meta.max_query_len == 1:  # pure decode: fixed shapes, no host sync (graph capturable)
            sp, pr = self._tables(K, layer)
            pos = meta.seq_lens[:R].long() - 1
            valid = pos >= 0  # padded rows of a graph batch have seq_len 0 (and stale block-table rows)
            p_new, p_leave = (prio[:R], None) if state is None else self._recurrent_decode(
                layer, state, slice(0, R), table[:R], V, pos.clamp(min=0), k_pre[:R], value[:R], valid=valid)
            slots.decode_step(K, V, sp, pr, table[:R], pos, key[:R], value[:R], p_new,
                              sinks=layer.kvpop_sinks, window=layer.kvpop_window, budget=B, valid=valid,
                              p_leave=p_leave)
            clamped = dataclasses.replace(meta, seq_lens=meta.seq_lens.clamp(max=B), block_table=table)
            self.forward(layer, query, key, value, kv_cache, clamped, output)
            return
        # a prompt or a chunk in the batch: eager, request by request (decode rows too)
        q_host = qsl.tolist()
        seq = meta.seq_lens[:R].tolist()
        ctx = [seq[r] - (q_host[r + 1] - q_host[r]) for r in range(R)]
        rows = [r for r in range(R) if q_host[r + 1] > q_host[r]]
        self._extend_rows(layer, rows, q_host, ctx, table, query, key, value, prio, K, V, output, k_pre=k_pre,
                          state=state)

    def _per_token_head_forward(self, layer, query, key, value, prio, kv_cache, meta, output) -> None:
        """``int8_per_token_head`` / ``fp8_per_token_head``: kvpop's codes and scales in vLLM's page
        (:func:`quantized.page_views`).  A pure-decode batch: :func:`quantized.decode_step` (fixed shapes, padded
        graph rows in the null block), then under uniform budgets vLLM's unified Triton kernel over ``min(n, B)``
        slots, which dequantises each slot on load with its scale from the page; under head-adaptive budgets
        :meth:`_packed_attention` (kvpop's Triton kernel, the same on load).  A batch with a prompt or chunk: eager,
        request by request."""
        nb, rows, bs, _ = kv_cache.shape
        quantized.check_page_views(rows, bs, self.head_size, self.kv_cache_dtype)
        uniform = layer.kvpop_layout is None
        if uniform:  # vLLM's scale views of this cache, made (and set to 1) before kvpop writes a scale
            self._ensure_scale_caches(kv_cache)
        K, V, ks, vs = quantized.page_views(kv_cache, self.head_size)
        sp, pr = self._tables(K, layer)
        B = layer.kvpop_budget
        layout = slots.UniformSlots(B, rows) if uniform else layer.kvpop_layout
        where = dict(sinks=layer.kvpop_sinks, window=layer.kvpop_window)
        qsl = meta.query_start_loc
        R = qsl.shape[0] - 1
        table = meta.block_table
        if meta.max_query_len == 1:  # pure decode: fixed shapes, no host sync (graph capturable)
            pos = meta.seq_lens[:R].long() - 1
            valid = pos >= 0  # padded rows of a graph batch have seq_len 0 (and stale block-table rows)
            quantized.decode_step(K, V, ks, vs, sp, pr, table[:R], pos, key[:R], value[:R], prio[:R], layout=layout,
                                  valid=valid, **where)
            if uniform:
                clamped = dataclasses.replace(meta, seq_lens=meta.seq_lens.clamp(max=B))
                self.forward(layer, query, key, value, kv_cache, clamped, output)
            else:
                output[:R] = self._packed_attention(layer, K, V, table[:R], pos, query[:R], ks, vs,
                                                    valid=valid).to(output.dtype)
            return
        q_host = qsl.tolist()
        seq = meta.seq_lens[:R].tolist()
        for r in range(R):
            a, e = q_host[r], q_host[r + 1]
            if e > a:
                output[a:e] = quantized.extend(K, V, ks, vs, sp, pr, table[r], seq[r] - (e - a), query[a:e], key[a:e],
                                               value[a:e], prio[a:e], scale=self.scale, layout=layout,
                                               **where).to(output.dtype)


class KVpopTritonBackend(TritonAttentionBackend):
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_impl_cls():
        return KVpopTritonImpl
