"""Quantised KV caches for kvpop layers: codes of ``KVpopCache(kv_dtype="int8" | "fp8")`` in vLLM's cache.

Two ways, one quantiser (``kvpop_kernels.layout.quantize``: one float32 scale per token and KV head, ``scale =
max |x| / qmax``; int8 codes rounded half up in ``[-127, 127]``, fp8 float8 e4m3fn rounded to nearest even):

* ``kv_cache_dtype="int8_per_token_head"`` / ``"fp8_per_token_head"``: **vLLM's in-page layout**.  Each page
  row (KV head, or a packed block's row) holds per slot ``[K codes (D) | K scale (4 bytes) | V codes (D) |
  V scale (4 bytes)]``, the layout of vLLM's Triton backend for these dtypes (``TritonAttentionBackend.
  customize_spec`` sizes the page, so vLLM counts the scales in its KV-cache memory and admission).
  :func:`page_views` gives the codes and the scales as strided views of the page, checked once per shape
  against the views vLLM's own backend carves (:func:`check_page_views`).  Nothing lives beside the pool but
  the positions and priorities.
* ``kv_cache_dtype="fp8"`` (``"fp8_e4m3"``): vLLM's per-tensor fp8 cache, one byte per element, in the in-block
  order of CPU_ATTN's fp8 write (:func:`cpu_block_layout`).  vLLM's page has no room for a scale, so the
  per-slot scales sit in two side tables ``[num_blocks, rows, bs]`` float32 (:func:`scale_tables`) that vLLM
  does not count (8 bytes per slot and KV head).  Kept for engines that ask for plain fp8; the per-token-head
  dtypes are the counted way.

Either way a token leaving the window moves into a long-range slot with its codes and its scales (no
requantisation); a slot is read as ``codes * scale`` in float32 and the decode attention is kvpop's own, for
uniform and head-adaptive (packed) budgets alike.  The layers' ``k_scale`` / ``v_scale`` are not used.  The
functions below take the codes as ``K, V`` views of the cache's own dtype: ``torch.int8`` (int8 codes) or
``torch.uint8`` (float8 e4m3fn bytes).  docs/DESIGN.md section 5 and docs/vllm.md give the bytes and the
tolerance.

Nothing here imports vLLM at module level (only :func:`cpu_block_layout` and :func:`check_page_views`, when
called).
"""
from __future__ import annotations

import functools

import torch

from kvpop_kernels.layout import quantize

from . import slots

__all__ = ["KV_CACHE_DTYPES", "PER_TOKEN_HEAD", "kv_dtype_of", "check_cache_dtype", "page_views",
           "check_page_views", "scale_tables", "decode_step", "decode_attention", "extend", "cpu_block_layout",
           "cpu_forward"]

PER_TOKEN_HEAD = {"int8_per_token_head": "int8", "fp8_per_token_head": "fp8"}
"""vLLM's per-token-head cache dtypes kvpop layers take, and kvpop's ``kv_dtype`` of each."""

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", *PER_TOKEN_HEAD)
"""The ``kv_cache_dtype`` values kvpop layers take: ``auto`` (the model's dtype), vLLM's two names of float8 e4m3
(``fp8`` is ``fp8_e4m3`` in vLLM; scales beside the pool) and the two per-token-head dtypes (scales in the
page)."""

_FP8 = getattr(torch, "float8_e4m3fn", None)
_SCALE_BYTES = 4


def kv_dtype_of(kv_cache_dtype) -> str | None:
    """kvpop's ``kv_dtype`` for a vLLM ``kv_cache_dtype``: ``None`` for ``"auto"``, ``"fp8"`` for ``"fp8"`` /
    ``"fp8_e4m3"`` / ``"fp8_per_token_head"``, ``"int8"`` for ``"int8_per_token_head"``; ``ValueError`` naming the
    value for anything else (``fp8_e5m2`` and the 4-bit formats are other encodings than kvpop's)."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kvpop layers serve kv_cache_dtype in {list(KV_CACHE_DTYPES)} (int8 / fp8 e4m3 with one "
                         f"scale per slot and KV head, as KVpopCache(kv_dtype='int8' | 'fp8')), got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return None
    return PER_TOKEN_HEAD.get(kv_cache_dtype, "fp8")


def check_cache_dtype(kv_cache_dtype, *, cpu: bool) -> str | None:
    """:func:`kv_dtype_of`, and plain fp8 refused off the CPU backend (``NotImplementedError``: the GPU backend
    serves the per-token-head dtypes, whose scales vLLM counts)."""
    kv_dtype = kv_dtype_of(kv_cache_dtype)
    if kv_dtype is not None and not cpu and kv_cache_dtype not in PER_TOKEN_HEAD:
        raise NotImplementedError(f"kvpop serves kv_cache_dtype={kv_cache_dtype!r} on the CPU backend only; the GPU "
                                  f"backend takes 'auto', 'int8_per_token_head' and 'fp8_per_token_head'")
    return kv_dtype


def page_views(kv_cache: torch.Tensor, head_size: int):
    """``(K, V, k_scale, v_scale)`` of a per-token-head cache ``kv_cache [num_blocks, rows, bs, 2 * (D + 4)]``
    (``torch.int8`` or ``torch.uint8``): the codes ``[num_blocks, rows, bs, D]`` and the float32 scales
    ``[num_blocks, rows, bs]``, strided views of the page (vLLM's layout: ``[K | K scale | V | V scale]`` per
    slot)."""
    D = int(head_size)
    nb, rows, bs, content = kv_cache.shape
    if kv_cache.element_size() != 1 or content != 2 * (D + _SCALE_BYTES) or D % _SCALE_BYTES:
        raise ValueError(f"a per-token-head cache holds 2 * (head_size + 4) bytes per slot with head_size a multiple "
                         f"of 4; got {tuple(kv_cache.shape)} {kv_cache.dtype} for head_size {D}")
    half = D + _SCALE_BYTES
    K, V = kv_cache[..., :D], kv_cache[..., half:half + D]
    ks = kv_cache[..., D:half].view(torch.float32)[..., 0]
    vs = kv_cache[..., half + D:].view(torch.float32)[..., 0]
    return K, V, ks, vs


@functools.cache
def check_page_views(rows: int, block_size: int, head_size: int, cache_dtype: str) -> None:
    """That :func:`page_views` reads the bytes vLLM's own Triton backend carves for ``cache_dtype`` (its
    ``_ensure_scale_caches`` and ``_pth_key_value_caches``, run on a small page of this shape): values written
    through vLLM's views, part after part, read back through kvpop's.  ``NotImplementedError`` if not (a vLLM
    whose layout this code does not know)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    D = head_size
    dtype = torch.int8 if cache_dtype == "int8_per_token_head" else torch.uint8
    kv = torch.zeros(2, rows, block_size, 2 * (D + _SCALE_BYTES), dtype=dtype)
    probe = object.__new__(TritonAttentionImpl)
    probe._kv_quant_mode, probe.fp8_dtype = get_kv_quant_mode(cache_dtype), _FP8
    probe._k_scale_cache = probe._v_scale_cache = None
    kc, vc = TritonAttentionImpl._pth_key_value_caches(probe, kv)  # [nb, bs, rows, D + 4]: codes, then the scale
    kc, vc = kc[..., :D], vc[..., :D]  # what vLLM's kernels read as codes
    ksc, vsc = probe._k_scale_cache, probe._v_scale_cache  # [nb, bs, rows] float32
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(1, 120, (2, *kc.shape), generator=g, dtype=torch.uint8)
    scales = torch.rand(2, *ksc.shape, generator=g) + 1.0
    for view, x in ((kc, codes[0]), (ksc, scales[0]), (vc, codes[1]), (vsc, scales[1])):
        view.copy_(x.view(view.dtype) if view.element_size() == 1 else x)
    K, V, ks, vs = page_views(kv, D)
    ok = (torch.equal(K.transpose(1, 2).reshape(-1).view(torch.uint8), codes[0].reshape(-1))
          and torch.equal(V.transpose(1, 2).reshape(-1).view(torch.uint8), codes[1].reshape(-1))
          and torch.equal(ks.transpose(1, 2), scales[0]) and torch.equal(vs.transpose(1, 2), scales[1]))
    if not ok:
        raise NotImplementedError(f"kvpop: vLLM's {cache_dtype} page ({rows} rows, block {block_size}, head {D}) is "
                                  f"not [K | K scale | V | V scale] per slot; not supported")


_SCALES: dict = {}
"""Per-slot scale tables of each fp8 cache, by the address of its first byte and its device (the layers of a
packed block share one cache tensor, so they share these too)."""


def scale_tables(K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_scale, v_scale)`` ``[num_blocks, rows, bs]`` float32 of the cache ``K`` (a logical view
    ``[num_blocks, rows, bs, D]``), allocated on first use.  A slot past a request's ``min(n, B_h)`` holds a
    stale scale that is never read."""
    nb, rows, bs, _ = K.shape
    key = (K.data_ptr(), K.device)  # layers may hold views of one buffer: the view's own address
    t = _SCALES.get(key)
    if t is None or t[0].shape != (nb, rows, bs):
        t = _SCALES[key] = (torch.zeros(nb, rows, bs, dtype=torch.float32, device=K.device),
                            torch.zeros(nb, rows, bs, dtype=torch.float32, device=K.device))
    return t


def _codes(x: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of ``x [..., D]`` (kvpop's quantiser) in the dtype of the cache ``like``: int8 codes for
    ``torch.int8``, float8 e4m3fn bytes for ``torch.uint8``."""
    if like.dtype == torch.int8:
        return quantize(x, "int8")
    q, s = quantize(x, "fp8")
    return q.view(torch.uint8), s


def _dequant(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., D]`` (int8, or the bytes of float8 e4m3fn) times ``scale [...]``, float32."""
    c = codes if codes.dtype == torch.int8 else codes.view(_FP8)
    return c.float() * scale[..., None]


class _Dense(slots.UniformSlots):
    """Head ``h``'s slot ``j`` at ``(table[j // bs], h, j % bs)`` of a dense copy, with the heads' own budgets."""

    def __init__(self, budgets) -> None:
        self.budgets = tuple(int(b) for b in budgets)


def _addresses(layout, table: torch.Tensor, bs: int):
    """Physical addresses ``[N, Hkv, Bmax]`` of every head's slots ``[0, Bmax)`` of the requests of ``table``
    (a padded slot ``j >= B_h`` addresses the head's last slot), and ``(j [Bmax], budgets [Hkv])``, from the
    layout's constants made once (``slots._head_slots``, ``slots._fixed``)."""
    j, sl, b = slots._head_slots(layout, max(layout.budgets), table.device)
    return tuple(slots._addr_of(table, slots._fixed(layout, "all", sl, bs))), j, b


@torch.no_grad()
def decode_step(K, V, k_scale, v_scale, slot_pos, slot_prio, block_table, pos, k_new, v_new, p_new, *, sinks: int,
                window: int, layout, valid: torch.Tensor | None = None) -> None:
    """:func:`slots.decode_step` on quantised codes (``K, V`` int8 or fp8-byte views of the cache): the new token
    is quantised per KV head, the token leaving the window moves with its codes and its scales (``moved``).
    ``valid``: as in :func:`slots.decode_step` (rows marked False, a CUDA-graph batch's padding, touch the null
    block 0 only)."""
    kq, ks = _codes(k_new, K)
    vq, vs = _codes(v_new, V)
    slots.decode_step(K, V, slot_pos, slot_prio, block_table, pos, kq, vq, p_new, sinks=sinks, window=window,
                      layout=layout, valid=valid, moved=((k_scale, ks), (v_scale, vs)))


@torch.no_grad()
def decode_attention(K, V, k_scale, v_scale, block_table, pos, q, *, layout, scale: float,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`slots.decode_attention` over the dequantised slots (float32, fixed shapes; a stale slot's bytes
    may be a NaN code: read as 0, never attended)."""
    if K.dtype == torch.int8:
        codes = None
    else:  # float8 bytes: a stale slot's may be a NaN code (never attended, but 0 * NaN is NaN)
        def codes(x):
            return x.view(_FP8).float().nan_to_num_(0.0, 0.0, 0.0)
    return slots.decode_attention(K, V, block_table, pos, q, layout=layout, scale=scale, valid=valid,
                                  scales=(k_scale, v_scale), codes=codes)


@torch.no_grad()
def extend(K, V, k_scale, v_scale, slot_pos, slot_prio, block_row, ctx: int, q, k, v, p, *, sinks: int,
           window: int, scale: float, layout) -> torch.Tensor:
    """:func:`slots.extend` of one request on quantised slots: the chunk attends to its cached slots dequantised
    and to itself in full precision (as a prompt does in ``KVpopCache``); then every kept chunk token is stored as
    its codes and scales, and every kept cached token keeps its own (moved, never requantised)."""
    L, hkv, d = k.shape
    bs = K.shape[2]
    (blk, row, off), j, b = _addresses(layout, block_row[None], bs)
    at = (blk[0], row[0], off[0])  # [Hkv, Bmax]
    old = (K[at], V[at], k_scale[at], v_scale[at])
    old_pos = slot_pos[at].long()
    dense = _Dense(layout.budgets)
    kk, vv = _dequant(old[0], old[2])[None], _dequant(old[1], old[3])[None]
    sp, pr = slot_pos[at][None].clone(), slot_prio[at][None].clone()
    zero = torch.zeros(1, dtype=torch.long, device=K.device)
    out = slots.extend(kk, vv, sp, pr, zero, ctx, q, k, v, p, sinks=sinks, window=window, scale=scale, layout=dense)
    new_pos = sp[0].long()
    live = j[None] < torch.clamp(b, max=ctx + L)[:, None]  # [Hkv, Bmax]: the slots the request holds now
    fresh = new_pos >= ctx  # a chunk token: its own codes; else a cached one: the codes of its old slot
    kq, ks = _codes(k.transpose(0, 1), K)  # [Hkv, L, D], [Hkv, L]
    vq, vs = _codes(v.transpose(0, 1), V)
    ci = (new_pos - ctx).clamp(0, L - 1)
    cached = j[None] < torch.clamp(b, max=ctx)[:, None]
    big = torch.iinfo(torch.long).max
    by_pos, order = torch.where(cached, old_pos, torch.full_like(old_pos, big)).sort(dim=1)
    src = order.gather(1, torch.searchsorted(by_pos, new_pos.contiguous()).clamp(max=j.numel() - 1))
    pick = fresh[..., None]

    def take(x, idx):
        return x.gather(1, idx[..., None].expand(-1, -1, d)) if x.dim() == 3 else x.gather(1, idx)

    new = (torch.where(pick, take(kq, ci), take(old[0], src)), torch.where(pick, take(vq, ci), take(old[1], src)),
           torch.where(fresh, take(ks, ci), take(old[2], src)), torch.where(fresh, take(vs, ci), take(old[3], src)))
    dst = (at[0][live], at[1][live], at[2][live])
    for table, x in zip((K, V, k_scale, v_scale, slot_pos, slot_prio), new + (sp[0], pr[0])):
        table[dst] = x[live].to(table.dtype)
    return out


@functools.cache
def cpu_block_layout(isa: str, block_size: int, head_size: int) -> tuple[bool, bool]:
    """Whether CPU_ATTN's fp8 cache stores keys / values transposed (``[D, bs]``) inside a block, found by
    writing exactly representable values with vLLM's own fp8 cache write (``k_scale = v_scale = 1``), which
    also checks that its bytes are float8 e4m3fn's (so kvpop's codes sit where and as vLLM's would)."""
    from vllm import _custom_ops as ops

    bs, D = block_size, head_size
    kv = torch.zeros(1, 1, bs, 2 * D, dtype=torch.uint8)
    kc, vc = kv.view(1, 1, 2 * bs, D).chunk(2, dim=2)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(1, 127, (2, bs, D), generator=g, dtype=torch.uint8)  # positive, finite e4m3fn bytes
    codes[:, :, 0] |= 128  # and some negative
    k, v = (c.view(_FP8).float()[:, None, :] for c in codes)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(bs, dtype=torch.int64), isa, 1.0, 1.0, "fp8")
    out = []
    for name, c, stored in (("keys", codes[0], kc), ("values", codes[1], vc)):
        flat = stored.reshape(-1)
        if torch.equal(flat, c.reshape(-1)):
            out.append(False)
        elif torch.equal(flat, c.t().reshape(-1)):
            out.append(True)
        else:
            raise NotImplementedError(f"kvpop: CPU_ATTN's fp8 {name} for ISA {isa!r} (block {bs}, head {D}) are not "
                                      f"float8 e4m3fn bytes in a [bs, D] or [D, bs] block; not supported")
    return out[0], out[1]


def cpu_forward(impl, layer, K, V, ks, vs, query, key, value, prio, meta, output) -> None:
    """One forward of a kvpop layer on a quantised cache (CPU_ATTN): decode tokens of every request at once, then
    prompts and chunks one request at a time; ``K, V`` the code views ``[num_blocks, rows, bs, D]``, ``ks, vs``
    the scales ``[num_blocks, rows, bs]`` (:func:`page_views`, or :func:`scale_tables` for plain fp8)."""
    sp, pr = impl._tables(K, layer)
    layout = layer.kvpop_layout
    if layout is None:
        layout = slots.UniformSlots(layer.kvpop_budget, K.shape[1])
    where = dict(sinks=layer.kvpop_sinks, window=layer.kvpop_window)
    qsl = meta.query_start_loc.long()
    R = qsl.shape[0] - 1
    qlen = qsl[1:] - qsl[:-1]
    ctx = meta.seq_lens[:R].long() - qlen
    bt = meta.block_table[:R]
    dec = ((qlen == 1) & (ctx > 0)).nonzero().flatten()
    if dec.numel():
        tok = qsl[dec]
        decode_step(K, V, ks, vs, sp, pr, bt[dec], ctx[dec], key[tok], value[tok], prio[tok], layout=layout, **where)
        output[tok] = decode_attention(K, V, ks, vs, bt[dec], ctx[dec], query[tok], layout=layout,
                                       scale=impl.scale).to(output.dtype)
    q_host, ctx_host = qsl.tolist(), ctx.tolist()
    for r in ((qlen > 1) | ((qlen == 1) & (ctx == 0))).nonzero().flatten().tolist():
        a, e = q_host[r], q_host[r + 1]
        output[a:e] = extend(K, V, ks, vs, sp, pr, bt[r], ctx_host[r], query[a:e], key[a:e], value[a:e], prio[a:e],
                             scale=impl.scale, layout=layout, **where).to(output.dtype)
