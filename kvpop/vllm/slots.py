"""The fixed-budget cache of many requests inside a paged KV cache (no vLLM import here).

:func:`decode_step` writes one new token for each of ``N`` requests at once; :func:`extend` runs a prompt
or a later chunk of one request; :func:`decode_attention` attends one token per request over a packed
block.  Where a request's slot lives is a layout's business: :class:`UniformSlots` (head ``h``'s slot ``j``
in block ``j // bs``, head row ``h``: what vLLM's own paged kernels read) or :class:`PackedSlots`
(head-adaptive budgets: every head's slots one after another, the layers of a model one after another,
over the rows of shared pages).  The slot layout, why the occupied slots stay ``[0, min(n, B_h))``, the
side tables and what each operation guarantees: docs/DESIGN.md section 5, "How the vLLM plugin holds
the cache".
"""
from __future__ import annotations

import itertools
import math

import torch

from kvpop_kernels import eviction_schedule, sparse_attention

__all__ = ["UniformSlots", "PackedSlots", "slot_index", "decode_step", "extend", "gather_slots",
           "decode_attention"]

_I32MAX = 2**31 - 1


def _rows_of(table: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """``table [N, nb]`` gathered at ``page [N, ...]``."""
    n = table.shape[0]
    return table.long().gather(1, page.reshape(n, -1)).reshape(page.shape)


class _Flat:
    """One tensor of the cache (``[num_blocks, rows, bs, D]`` slots or ``[num_blocks, rows, bs]`` side table) read
    and written by a linear index: ``(block, row, offset)`` -> ``block * u0 + row * u1 + offset * u2`` into a view
    of its storage whose rows (of ``D``, or single entries) start every ``g`` elements (``g`` the strides' greatest
    common divisor), where one ``index_select`` / ``index_copy_`` replaces an advanced index of three tensors
    (several times faster per step on a CPU).  Where those rows overlap (``g < D``: a page holding codes and
    scales side by side) only reads take the view; a view whose last dimension is not contiguous (a transposed
    ``[D, bs]`` block) keeps the three-tensor index throughout (``units`` None)."""

    __slots__ = ("x", "view", "units", "overlap")

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        st, sh = x.stride(), x.shape
        row = sh[3] if x.dim() == 4 else 1
        if x.dim() == 4 and st[3] != 1 and sh[3] > 1:
            self.view = self.units = None
            self.overlap = False
            return
        g = math.gcd(*st[:3]) or 1
        self.units = tuple(v // g for v in st[:3])
        self.overlap = g < row
        m = sum((n - 1) * u for n, u in zip(sh[:3], self.units)) + 1
        self.view = x.as_strided((m, row) if x.dim() == 4 else (m,), (g, 1) if x.dim() == 4 else (g,))

    def index(self, at):
        """The linear index ``[...]`` of the addresses ``at = (block, row, offset)`` (the tuple itself when this
        tensor keeps the three-tensor index)."""
        if self.units is None:
            return at
        if isinstance(at, _At):
            return at.linear(self.units)
        u0, u1, u2 = self.units
        return at[0] * u0 + at[1] * u1 + at[2] * u2

    def get(self, i) -> torch.Tensor:
        if self.units is None:
            return self.x[i]
        out = self.view.index_select(0, i.reshape(-1))
        return out.view(*i.shape, *self.view.shape[1:])

    @property
    def writes_linear(self) -> bool:
        """Whether :meth:`put` takes a linear index (else the ``(block, row, offset)`` addresses)."""
        return self.units is not None and not self.overlap

    def put(self, i, v: torch.Tensor) -> None:
        """Write ``v`` at ``i``: a linear index where :attr:`writes_linear`, else the addresses."""
        if not self.writes_linear:
            self.x[i] = v.to(self.x.dtype)
            return
        self.view.index_copy_(0, i.reshape(-1), v.to(self.x.dtype).expand(*i.shape, *self.view.shape[1:])
                              .reshape(-1, *self.view.shape[1:]))


def _flats(*xs: torch.Tensor) -> tuple[list[_Flat], dict]:
    """:class:`_Flat` of each tensor, and a memo for :func:`_indices` (tensors of equal strides share indices)."""
    return [_Flat(x) for x in xs], {}


def _indices(f: _Flat, at, memo: dict, key):
    """``f.index(at)``, computed once per (addresses ``key``, strides)."""
    k = (key, f.units)
    if k not in memo:
        memo[k] = f.index(at)
    return memo[k]


class UniformSlots:
    """Every KV head holds ``budget`` slots; head ``h``'s slot ``j`` is at ``(table[j // bs], h, j % bs)``."""

    def __init__(self, budget: int, num_kv_heads: int) -> None:
        self.budgets = (int(budget),) * num_kv_heads

    def addr(self, table: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor, bs: int):
        """Physical ``(block, row, offset)`` of head ``heads``' slot ``slots`` (long, both ``[N, ...]``) of
        the requests of ``table [N, nb]``."""
        return _rows_of(table, slots // bs), heads, slots % bs


def aligned(budget: int, align: int) -> int:
    """``budget`` rounded up to a multiple of ``align``: the packed slots a head takes (:class:`PackedSlots`)."""
    return -(-int(budget) // align) * align


class PackedSlots:
    """Head-adaptive budgets: head ``h`` of this layer holds ``budgets[h]`` slots, at packed index
    ``u = base + offset_h + j`` (``offset_h`` the prefix sum of the budgets, each rounded up to a multiple of
    ``align``; ``base`` the slots the layers before this one take), page ``u // (rows * bs)``, row
    ``(u // bs) % rows``, offset ``u % bs`` of pages of ``rows`` rows of ``bs`` slots.

    ``align = 1`` packs the heads slot to slot; ``align = bs`` (with ``base`` a multiple of it) starts every
    head at offset 0 of a row, so a head's slots are whole rows and then a prefix of one: what vLLM's own
    attention kernel reads as a sequence of blocks (the CPU backend's ``_rows_attention``), for at most
    ``align - 1`` unused slots after each head."""

    def __init__(self, budgets, rows: int, base: int = 0, align: int = 1) -> None:
        self.budgets = tuple(int(b) for b in budgets)
        self.rows, self.base, self.align = int(rows), int(base), int(align)
        if self.align < 1:
            raise ValueError(f"align must be a positive number of slots, got {align}")
        self.offsets = tuple(itertools.accumulate((0,) + tuple(aligned(b, self.align) for b in self.budgets[:-1])))
        self._offs: dict = {}

    @property
    def total(self) -> int:
        return sum(self.budgets)

    @property
    def span(self) -> int:
        """Packed slots the layer's heads take, the unused ones after each head included (the next layer's
        ``base`` is this layer's ``base + span``)."""
        return sum(aligned(b, self.align) for b in self.budgets)

    def starts_rows(self, bs: int) -> bool:
        """Whether every head's slot 0 is at offset 0 of a row of ``bs`` slots (worked out once per ``bs``)."""
        k = ("starts rows", bs)
        if k not in self._offs:
            self._offs[k] = all((self.base + o) % bs == 0 for o in self.offsets)
        return self._offs[k]

    def device_args(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(budgets int32, packed index of each head's slot 0 int64)`` ``[Hkv]`` on ``device`` (made once:
        ``kvpop_kernels.slot_decode.packed_slot_decode``'s arguments, no copy inside a CUDA graph)."""
        t = self._offs.get(("args", device))
        if t is None:
            t = self._offs[("args", device)] = (
                torch.tensor(self.budgets, dtype=torch.int32, device=device),
                torch.tensor([self.base + o for o in self.offsets], dtype=torch.int64, device=device))
        return t

    def addr(self, table: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor, bs: int):
        dev = slots.device
        offs = self._offs.get(dev)
        if offs is None:
            offs = self._offs[dev] = torch.tensor(self.offsets, dtype=torch.long, device=dev)
        u = self.base + offs[heads] + slots
        per_page = self.rows * bs
        r = u % per_page
        return _rows_of(table, u // per_page), r // bs, r % bs


def slot_index(block_table: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical ``(block, offset)`` of logical ``slots`` (``[N, ...]`` long) of the rows of ``block_table [N, nb]``
    (the uniform layout)."""
    return _rows_of(block_table, slots // block_size), slots % block_size


def _layout(layout, budget, hkv):
    if layout is not None:
        return layout
    if budget is None:
        raise TypeError("give budget= (uniform budgets) or layout=")
    return UniformSlots(budget, hkv)


def _head_slots(layout, n_max: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots ``[0, n_max)`` of every head: ``(j [n_max], slots [Hkv, n_max] clamped to each head's budget,
    budgets [Hkv])``; a padded slot (``j >= B_h``) addresses the head's last slot, to be masked."""
    memo = _memo(layout)
    k = ("slots", n_max, device)
    if k not in memo:
        b = torch.tensor(layout.budgets, dtype=torch.long, device=device)
        j = torch.arange(n_max, device=device)
        memo[k] = (j, torch.minimum(j[None, :], b[:, None] - 1), b)
    return memo[k]


def gather_slots(K: torch.Tensor, V: torch.Tensor, slot_pos: torch.Tensor, slot_prio: torch.Tensor,
                 block_row: torch.Tensor, n_slots: int, block_size: int, *, layout=None, heads=None):
    """Contents of slots ``[0, n_slots)`` of one request's ``heads`` (all by default):
    ``K, V [H, n, D]``, ``pos [H, n]``, ``prio [H, n]``."""
    if heads is None:
        heads = torch.arange(len(layout.budgets) if layout is not None else K.shape[1], device=K.device)
    layout = _layout(layout, n_slots, K.shape[1])
    slots = torch.arange(n_slots, device=K.device)
    h = heads[:, None].expand(-1, n_slots)
    blk, row, off = layout.addr(block_row[None], h[None], slots[None, None].expand(1, *h.shape), block_size)
    at = (blk[0], row[0], off[0])
    return K[at], V[at], slot_pos[at], slot_prio[at]


_MEMO: dict = {}


def _memo(layout) -> dict:
    """The constant index tensors of a layout (by its kind, budgets, rows and base: a layout made anew for every
    forward shares them)."""
    key = (type(layout).__name__, tuple(layout.budgets), getattr(layout, "rows", None), getattr(layout, "base", 0),
           getattr(layout, "align", 1))
    return _MEMO.setdefault(key, {})


class _At(tuple):
    """Physical addresses ``(block, row, offset)`` whose rows and offsets are constants of a layout (:func:`_fixed`):
    a linear index is ``block * u0`` plus a constant made once per strides (:meth:`_Flat.index`)."""

    def __new__(cls, blk: torch.Tensor, row: torch.Tensor, off: torch.Tensor, memo: dict):
        t = super().__new__(cls, (blk, row.expand_as(blk), off.expand_as(blk)))
        t.fixed, t.memo = (row, off), memo
        return t

    def linear(self, units) -> torch.Tensor:
        c = self.memo.get(units)
        if c is None:
            row, off = self.fixed
            c = self.memo[units] = row * units[1] + off * units[2]
        return self[0] * units[0] + c


def _fixed(layout, key, slots: torch.Tensor, bs: int):
    """``(page column, row, offset, memo)`` ``[Hkv, m]`` of every head's ``slots [Hkv, m]`` (the part of an address
    that does not depend on the request), made once per layout, ``key`` and block size."""
    memo = _memo(layout)
    k = (key, bs, slots.device)
    if k not in memo:
        hkv, m = slots.shape
        pages = (getattr(layout, "base", 0) + getattr(layout, "span", sum(layout.budgets))) // bs + 2
        ident = torch.arange(pages, device=slots.device)[None]
        heads = torch.arange(hkv, device=slots.device)[:, None].expand(hkv, m)
        memo[k] = (*(x[0] for x in layout.addr(ident, heads[None], slots[None], bs)), {})
    return memo[k]


def _addr_of(block_table: torch.Tensor, fixed) -> _At:
    """Physical ``(block, row, offset)`` ``[N, Hkv, m]`` of the requests of ``block_table`` at :func:`_fixed`'s
    addresses."""
    col, row, off, memo = fixed
    n = block_table.shape[0]
    blk = block_table.long().gather(1, col.reshape(1, -1).expand(n, -1)).view(n, *col.shape)
    return _At(blk, row, off, memo)


def _lr_slots(layout, s: int, w: int, device):
    """``(j [k_max], slots [Hkv, k_max] clamped to each head's budget, has [Hkv, k_max], budgets [Hkv])`` of the
    long-range slots (made once per layout)."""
    memo = _memo(layout)
    k = ("lr", s, w, device)
    if k not in memo:
        j, lr, b = _head_slots(layout, max(layout.budgets), device)
        j, lr = j[s + w:], lr[:, s + w:]
        memo[k] = (j, lr, j[None, :] < b[:, None], b)
    return memo[k]


@torch.no_grad()
def decode_step(K: torch.Tensor, V: torch.Tensor, slot_pos: torch.Tensor, slot_prio: torch.Tensor,
                block_table: torch.Tensor, pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                p_new: torch.Tensor, *, sinks: int, window: int, budget: int | None = None, layout=None,
                valid: torch.Tensor | None = None, p_leave: torch.Tensor | None = None, moved=()) -> None:
    """The eviction step and cache write of one new token for each of ``N`` requests (in place).

    Args:
        K, V: logical views ``[num_blocks, rows, bs, D]`` of the paged cache.
        slot_pos, slot_prio: side tables ``[num_blocks, rows, bs]`` int32 / float32.
        block_table: ``[N, >= blocks per request]`` the requests' block-table rows.
        pos: ``[N]`` integer, the new token's position (= tokens the request has seen before it).
        k_new, v_new: ``[N, Hkv, D]`` the new token's key (rotated) and value.
        p_new: ``[N, Hkv]`` float32, the new token's static priority (stored with it).
        budget / layout: the uniform budget ``B``, or a layout (:class:`UniformSlots`, :class:`PackedSlots`).
        valid: optional ``[N]`` bool; rows marked False (padding of a CUDA-graph batch, whose block-table
            rows may be stale) read and write block 0 only, vLLM's null block, which no request ever owns and
            no kvpop request reads (its manager never puts the null block in a block table).
        p_leave: optional ``[N, Hkv]`` float32, the priority of the token ``pos - w`` leaving the window,
            computed now (a recurrent scorer); by default the one stored with it.

    Per request and head (``kvpop_kernels.reference.fixed_budget_decode``, steps 1-2, with the head's own
    ``k_h = B_h - s - w``): when the token ``t = pos - w`` leaves the window (``t >= s``) it replaces the
    long-range slot of lowest priority (ties to the oldest position, then the lowest slot index; an empty
    slot ranks below every token) if it ranks above it, else it is dropped; then the new token takes its
    sink or ring slot.  Attention is the caller's (over ``min(pos + 1, B_h)`` slots).  Every write is a
    fixed-shape scatter into slots the row owns (``[0, min(pos + 1, B_h))``, allocated by vLLM): a head that
    keeps nothing rewrites its new token's slot with its own content before the new token takes it.
        moved: pairs ``(table, new)`` of more side tables ``[num_blocks, rows, bs]`` (a quantised cache's
            scales) whose entry moves with the token leaving the window and whose new token's entry is ``new
            [N, Hkv]``.
    """
    s, w = sinks, window
    bs = K.shape[2]
    N, hkv = p_new.shape
    layout = _layout(layout, budget, hkv)
    dev = K.device
    pos = pos.long().clamp(min=0)
    if valid is not None:
        block_table = torch.where(valid[:, None], block_table, torch.zeros_like(block_table))
    (fk, fv, fp, fr, *fm), memo = _flats(K, V, slot_pos, slot_prio, *(t for t, _ in moved))
    heads = torch.arange(hkv, device=dev)[None, :].expand(N, hkv)
    new_slot = torch.where(pos < s, pos, s + (pos - s).clamp(min=0) % w)  # also the leaving token's slot
    at = layout.addr(block_table, heads, new_slot[:, None].expand(N, hkv), bs)  # [N, Hkv] each
    k_max = max(layout.budgets) - s - w
    if k_max > 0:
        t_leave = pos - w
        j, lr, has, b = _lr_slots(layout, s, w, dev)  # [k_max], [Hkv, k_max] x 2, [Hkv]
        lr_at = _addr_of(block_table, _fixed(layout, ("lr", s, w), lr, bs))  # [N, Hkv, k_max] each
        lp = fr.get(_indices(fr, lr_at, memo, "lr"))
        lt = fp.get(_indices(fp, lr_at, memo, "lr")).long()
        filled = (j[None, None, :] < pos[:, None, None])  # slot j holds a token iff j < min(pos, B_h)
        lp = torch.where(filled, lp, torch.full_like(lp, float("-inf")))
        lt = torch.where(filled, lt, torch.full_like(lt, -1))
        lp = torch.where(has[None], lp, torch.full_like(lp, float("inf")))  # padding: never the lowest
        lt = torch.where(has[None], lt, torch.full_like(lt, _I32MAX))
        low_p = lp.amin(dim=-1)  # [N, Hkv]
        older = torch.where(lp == low_p[..., None], lt, torch.full_like(lt, _I32MAX))
        low_t, jj = older.min(dim=-1)  # first index among equal values: the lowest slot
        ring_p = fr.get(_indices(fr, at, memo, "at")).nan_to_num(nan=float("-inf")) if p_leave is None \
            else p_leave.float()
        keep = ((t_leave >= s)[:, None] & (b > s + w)[None]
                & ((ring_p > low_p) | ((ring_p == low_p) & (low_t < t_leave[:, None]))))
        # a head that keeps nothing rewrites the new token's own slot (overwritten below), never the lowest
        # long-range slot: that one may be past the request's allocation, where a stale block-table column can
        # name a block another request writes in this same scatter.  So every head moves its leaving token to
        # ``dst`` (its own slot where it keeps nothing: a no-op before the new token's write)
        dst_at = None
        for f in (fk, fv, fp, fr, *fm):
            if f.writes_linear:
                ia, il = _indices(f, at, memo, "at"), _indices(f, lr_at, memo, "lr")
                dst = torch.where(keep, il.gather(2, jj[..., None]).squeeze(2), ia)
            else:
                if dst_at is None:
                    dst_at = tuple(torch.where(keep, x.gather(2, jj[..., None]).squeeze(2), a)
                                   for x, a in zip(lr_at, at))
                dst = dst_at
            if f is fp:
                f.put(dst, t_leave[:, None].expand(N, hkv))
            elif f is fr:
                f.put(dst, ring_p)
            else:
                f.put(dst, f.get(_indices(f, at, memo, "at")))
    for f, new in ((fk, k_new), (fv, v_new), (fp, pos[:, None].expand(N, hkv)), (fr, p_new.float()),
                   *zip(fm, (n for _, n in moved))):
        f.put(_indices(f, at, memo, "at") if f.writes_linear else at, new)


def _chunk_view(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x [num_blocks, rows, bs, ...]`` as chunks ``x[block, row]`` (``[bs, ...]`` each, any inner strides) of one
    view of its storage, ``(view [m, bs, ...], (u0, u1))``: chunk ``(block, row)`` is ``view[block * u0 + row *
    u1]``, so one ``index_select`` reads many whole chunks (a gather of ``bs``-slot runs, not of single slots)."""
    st = x.stride()
    g = math.gcd(st[0], st[1]) or 1
    u = (st[0] // g, st[1] // g)
    m = (x.shape[0] - 1) * u[0] + (x.shape[1] - 1) * u[1] + 1
    if x.dim() == 3 and st[2] == 1 or x.dim() == 4 and st[3] == 1 and st[2] == x.shape[3]:
        return x.as_strided((m, math.prod(x.shape[2:])), (g, 1)), u  # a chunk one flat run: index_select's fast path
    return x.as_strided((m, *x.shape[2:]), (g, *st[2:])), u


def _runs(layout, bs: int, device):
    """The chunks (runs of ``bs`` slots in one page row) that hold each head's slots, made once per layout: ``(fixed
    [Hkv, R]`` (:func:`_fixed` of each chunk's first slot), ``slot [Hkv, R * bs]``: the head's slot index at each
    position of its chunks laid end to end, ``_I32MAX`` where the position is not one of its slots)``.

    Both layouts lay a head's slots ``0, 1, ...`` one after another through whole chunks (the uniform one from
    offset 0 of each block's row ``h``; the packed one from offset ``lo_h`` of the row holding its slot 0, on
    through the next rows and pages), so head ``h``'s slot ``j`` is at position ``lo_h + j`` of its chunks;
    a head with fewer chunks than the most repeats its last (every position past its slots is masked)."""
    memo = _memo(layout)
    k = ("runs", bs, device)
    if k not in memo:
        b = torch.tensor(layout.budgets, dtype=torch.long, device=device)
        hkv = b.numel()
        lo = _fixed(layout, ("slot 0",), torch.zeros(hkv, 1, dtype=torch.long, device=device), bs)[2].reshape(hkv)
        n_runs = -(-(lo + b) // bs)  # [Hkv]
        r = torch.arange(int(n_runs.max()), device=device)
        first = (r[None] * bs - lo[:, None]).clamp(min=0)  # [Hkv, R]: the slot at the start of each chunk
        first = torch.minimum(first, b[:, None] - 1)
        jj = torch.arange(r.numel() * bs, device=device)[None] - lo[:, None]  # [Hkv, R * bs]
        slot = torch.where((jj >= 0) & (jj < b[:, None]), jj, torch.full_like(jj, _I32MAX))
        memo[k] = (_fixed(layout, ("runs",), first, bs), slot)
    return memo[k]


def row_sequences(block_table: torch.Tensor, pos: torch.Tensor, *, layout: PackedSlots,
                  bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed layout whose heads start rows (:meth:`PackedSlots.starts_rows`) as sequences for vLLM's attention
    kernels: each (request, KV head) one sequence of one KV head whose blocks are the cache's rows (row ``row`` of
    block ``b`` is block ``b * rows + row`` of the cache viewed ``[num_blocks * rows, 1, ...]``), so its
    ``min(pos + 1, B_h)`` occupied slots are the sequence's first positions.  ``(block table [N * Hkv, R] int32,
    seq_lens [N * Hkv] int32)`` of the requests of ``block_table [N, >= pages]`` at ``pos [N]`` (after
    :func:`decode_step`)."""
    if not layout.starts_rows(bs):
        raise ValueError(f"row_sequences needs every head to start a row of {bs} slots; this layout packs them "
                         f"from offsets {[layout.base + o for o in layout.offsets]} (align={layout.align})")
    (col, row, _, memo), _ = _runs(layout, bs, block_table.device)  # [Hkv, R] each
    n, (hkv, r) = block_table.shape[0], col.shape
    c = memo.get("row_sequences")
    if c is None:
        c = memo["row_sequences"] = (row.reshape(1, -1).to(torch.int32), layout.device_args(block_table.device)[0])
    rows, budgets = c
    blk = block_table.gather(1, col.reshape(1, -1).expand(n, -1)).to(torch.int32)
    table = torch.add(rows, blk, alpha=layout.rows).view(n * hkv, r)
    seen = torch.minimum(pos.to(torch.int32).clamp(min=0).add(1)[:, None], budgets[None]).view(n * hkv)
    return table, seen


@torch.no_grad()
def decode_attention(K: torch.Tensor, V: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor,
                     q: torch.Tensor, *, layout, scale: float, valid: torch.Tensor | None = None,
                     scales: tuple[torch.Tensor, torch.Tensor] | None = None, codes=None) -> torch.Tensor:
    """Attention ``[N, Hq, D]`` of one query per request ``q [N, Hq, D]`` over the ``min(pos + 1, B_h)``
    occupied slots of each KV head (after :func:`decode_step`), in float32; fixed shapes, no host read
    (the packed layout's decode where vLLM's kernels, one length for every head, do not apply: heads packed slot to
    slot, or a quantised cache).

    The slots are read a chunk at a time (:func:`_runs`: each head's runs of ``bs`` slots, one ``index_select``
    per tensor), every position of a chunk that is not one of the head's occupied slots masked: its logit is
    replaced (its key may hold any bytes), its value must be finite (vLLM's cache starts zeroed and holds only
    what the model wrote; 8-bit float codes go through ``codes``).  ``scales``: ``(key scales, value scales)``
    ``[num_blocks, rows, bs]`` of quantised slots, folded into the logits and the softmax weights rather than
    into every element; ``codes`` maps a chunk's stored elements to float32 (default ``.float()``)."""
    N, hq, d = q.shape
    hkv = len(layout.budgets)
    g = hq // hkv
    bs = K.shape[2]
    if valid is not None:
        block_table = torch.where(valid[:, None], block_table, torch.zeros_like(block_table))
    (col, row, _, memo), slot = _runs(layout, bs, K.device)
    P = slot.shape[1]
    blk = block_table.gather(1, col.reshape(1, -1).expand(N, -1))  # [N, Hkv * R], the table's dtype
    lin: dict = {}

    def read(x):
        view, u = _chunk_view(x)
        i = lin.get(u)
        if i is None:
            c = memo.get(("row", u))
            if c is None:
                c = memo[("row", u)] = row.reshape(-1) * u[1]
            i = lin[u] = torch.add(c, blk, alpha=u[0]).view(-1)  # int64 (c is), whatever the table holds
        return view.index_select(0, i).view(N, hkv, P, *x.shape[3:])

    to_float = codes or (lambda x: x.float())
    kk, vv = to_float(read(K)), to_float(read(V))  # [N, Hkv, P, D]
    # slot j of a head is seen iff j < min(pos + 1, B_h) (``slot`` is _I32MAX past B_h and off its slots)
    unseen = slot[:, None, :] > pos.long().clamp(min=0).view(N, 1, 1, 1)  # [N, Hkv, 1, P]
    logits = torch.matmul(q.float().view(N, hkv, g, d), kk.transpose(-1, -2))  # [N, Hkv, g, P]
    if scales is None:
        logits = logits.masked_fill_(unseen, float("-inf")).mul_(scale)
        return torch.matmul(torch.softmax(logits, dim=-1), vv).view(N, hq, d).to(q.dtype)
    ksc, vsc = (read(x) for x in scales)  # [N, Hkv, P]
    logits = logits.mul_((ksc * scale)[:, :, None, :]).masked_fill_(unseen, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    # a stale scale may be any float: never multiplied into an unseen position's 0
    p = p.mul_(vsc.masked_fill(unseen[:, :, 0], 0.0)[:, :, None, :])
    return torch.matmul(p, vv).view(N, hq, d).to(q.dtype)


@torch.no_grad()
def extend(K: torch.Tensor, V: torch.Tensor, slot_pos: torch.Tensor, slot_prio: torch.Tensor,
           block_row: torch.Tensor, ctx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           p: torch.Tensor, *, sinks: int, window: int, budget: int | None = None, scale: float,
           layout=None) -> torch.Tensor:
    """Attention of ``L`` new tokens of one request after ``ctx`` cached ones, then their cache write.

    Args:
        K, V, slot_pos, slot_prio, budget / layout: as in :func:`decode_step`.
        block_row: ``[>= blocks per request]`` the request's block-table row.
        ctx: tokens the request has seen before this chunk (``0`` for a prompt).
        q: ``[L, Hq, D]``; k, v: ``[L, Hkv, D]`` (rotated keys); p: ``[L, Hkv]`` float32 priorities.

    Returns the attention output ``[L, Hq, D]``: the same as ``L`` successive decode steps (and, from
    ``ctx = 0``, as one ``sparse_attention`` forward over the whole sequence with the same priorities and
    each head's own ``k_h``).  Heads of one budget run together (all of them under uniform budgets).

    The virtual sequence of a head: its ``n = min(ctx, B_h)`` cached tokens ordered by position (sinks,
    long-range, window), then the chunk.  A token evicted before ``ctx`` never comes back (the ``k_h``
    tokens that outranked it are still eligible), so the kept set at every chunk query is the top-``k_h``
    of the cached long-range tokens and the tokens that left the window since; and a token's virtual index
    differs from its position by one constant for every window and chunk token, so windows and
    eligibility are the same.  Ties go to the newer token in both orders.
    """
    L, hkv, _ = k.shape
    layout = _layout(layout, budget, hkv)
    g = q.shape[1] // hkv
    by_budget: dict[int, list[int]] = {}
    for h, b in enumerate(layout.budgets):
        by_budget.setdefault(b, []).append(h)
    if len(by_budget) == 1:
        return _extend_heads(K, V, slot_pos, slot_prio, block_row, ctx, q, k, v, p, torch.arange(hkv, device=K.device),
                             layout.budgets[0], sinks=sinks, window=window, scale=scale, layout=layout)
    out = q.new_empty(q.shape)
    for b, hs in by_budget.items():
        h = torch.tensor(hs, device=K.device)
        qh = (h[:, None] * g + torch.arange(g, device=K.device)).flatten()
        out[:, qh] = _extend_heads(K, V, slot_pos, slot_prio, block_row, ctx, q[:, qh], k[:, h], v[:, h], p[:, h], h,
                                   b, sinks=sinks, window=window, scale=scale, layout=layout)
    return out


def _extend_heads(K, V, slot_pos, slot_prio, block_row, ctx, q, k, v, p, heads, B, *, sinks, window, scale, layout):
    """:func:`extend` for the KV heads ``heads`` (all of budget ``B``) and their query heads ``q``."""
    s, w = sinks, window
    k_lr = B - s - w
    bs = K.shape[2]
    L, hkv, d = k.shape
    dev = K.device
    n = min(ctx, B)
    if n:
        ck, cv, cpos, cprio = gather_slots(K, V, slot_pos, slot_prio, block_row, n, bs, layout=layout, heads=heads)
        order = cpos.long().argsort(dim=1)  # per head: sinks, long-range, window
        ck, cv = ck.gather(1, order[..., None].expand(-1, -1, d)), cv.gather(1, order[..., None].expand(-1, -1, d))
        cpos, cprio = cpos.long().gather(1, order), cprio.gather(1, order)
    else:
        ck = cv = k.new_zeros(hkv, 0, d)
        cpos = torch.zeros(hkv, 0, dtype=torch.long, device=dev)
        cprio = torch.zeros(hkv, 0, dtype=torch.float32, device=dev)
    chunk_pos = torch.arange(ctx, ctx + L, device=dev)
    vk = torch.cat([ck.to(k.dtype), k.transpose(0, 1)], dim=1)  # [Hkv, Sv, D]
    vv = torch.cat([cv.to(v.dtype), v.transpose(0, 1)], dim=1)
    vpos = torch.cat([cpos, chunk_pos[None].expand(hkv, L)], dim=1)
    vprio = torch.cat([cprio, p.float().transpose(0, 1)], dim=1).contiguous()
    Sv = n + L
    evict_at = eviction_schedule(vprio[None], sinks=s, window=w, k=k_lr)
    vq = torch.cat([q.new_zeros(n, q.shape[1], q.shape[2]), q], dim=0).transpose(0, 1)[None]  # [1, Hq, Sv, D]
    out, _ = sparse_attention(vq, vk[None].to(q.dtype), vv[None].to(q.dtype), evict_at, sinks=s, window=w,
                              scale=scale)
    # what the schedule keeps at the chunk's last token, per head, as virtual indices into the sequence
    last = Sv - 1
    ev = evict_at[0].long()
    idx = torch.arange(Sv, device=dev)
    sink_v = idx[: min(s, Sv)]
    win_v = idx[max(s, Sv - w):]
    kept_lr = (idx[None] >= s) & (idx[None] <= last - w) & (ev > last)  # [Hkv, Sv]
    n_lr = int(kept_lr[0].sum())  # min(k, |E|), the same for every head of this budget
    lr_v = kept_lr.long().argsort(dim=1, descending=True, stable=True)[:, :n_lr]  # in virtual (position) order
    for vi, slots in ((sink_v[None].expand(hkv, -1), sink_v[None].expand(hkv, -1)),
                      (win_v[None].expand(hkv, -1), None),
                      (lr_v, s + w + torch.arange(n_lr, device=dev)[None].expand(hkv, -1))):
        if vi.shape[1] == 0:
            continue
        tpos = vpos.gather(1, vi)  # real positions [Hkv, m]
        if slots is None:  # ring slots by real position
            slots = s + (tpos - s) % w
        blk, row, off = layout.addr(block_row[None], heads[None, :, None].expand(1, hkv, slots.shape[1]),
                                    slots[None], bs)
        at = (blk[0], row[0], off[0])
        K[at] = vk.gather(1, vi[..., None].expand(-1, -1, d)).to(K.dtype)
        V[at] = vv.gather(1, vi[..., None].expand(-1, -1, d)).to(V.dtype)
        slot_pos[at] = tpos.to(slot_pos.dtype)
        slot_prio[at] = vprio.gather(1, vi)
    return out[0, :, n:].transpose(0, 1)
