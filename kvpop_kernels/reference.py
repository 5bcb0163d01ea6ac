"""Dense float references of every public op, written for clarity, not speed.

These are the oracles of the test-suite (``tests/``): each function follows the
definitions of ``docs/DESIGN.md`` literally, forms full ``S x S`` matrices and loops over
queries where that is the plainest statement of the rule.  They run in float64 for
ranking and float32 (or the input's wider dtype) for attention, on any device.

Names match the public ops of ``kvpop_kernels`` one to one (and ``eviction_replay``, the decoding rule
replayed with a heap: a second oracle of the schedule, fast enough for long sequences).

Eviction semantics (docs/DESIGN.md), repeated here because every function below uses them:

* window at query ``q``: positions ``q-w+1 .. q``;
* eligible set ``E(q) = {t : s <= t <= q-w}``; ``t_new = q - w`` joins it at step ``q``;
* token ``a`` ranks above ``b`` iff ``p[a] > p[b]`` or (``p[a] == p[b]`` and ``a > b``);
* the kept long-range set at ``q`` is the top ``k`` of ``E(q)``;
* ``evict_at[t]`` is the first ``q >= t+w`` at which ``t`` is not kept, ``NEVER`` otherwise;
* key ``t`` is visible to query ``q`` iff
  ``t <= q and (t < s or t > q-w or q < evict_at[t])``.

NaN priorities rank as ``-inf`` (below every number; ties, as always, to the newer token).
"""
from __future__ import annotations

import torch

from ._utils import NEVER

__all__ = [
    "NEVER",
    "rank_key",
    "visible_mask",
    "eviction_schedule",
    "eviction_decisions",
    "eviction_replay",
    "future_attention_target",
    "sparse_attention",
    "dense_causal_attention",
    "fixed_budget_decode",
    "quantized_fixed_budget_decode",
    "ragged_paged_decode",
    "paged_mlstm_decode",
]


def _clean_priority(priority: torch.Tensor) -> torch.Tensor:
    """float64 copy with NaN replaced by -inf (the documented NaN rule)."""
    p = priority.detach().to(torch.float64)
    return torch.where(torch.isnan(p), torch.full_like(p, float("-inf")), p)


def rank_key(p: float, t: int) -> tuple[float, int]:
    """Sort key of token ``t`` with priority ``p``: a larger key ranks higher."""
    return (p, t)


def visible_mask(evict_at: torch.Tensor, *, sinks: int, window: int) -> torch.Tensor:
    """Boolean visibility ``[B, Hkv, S_q=S, S_k=S]`` of key ``t`` to query ``q`` from ``evict_at [B, Hkv, S]``.

    The one statement of the mask rule: ``t <= q and (t < s or t > q - w or q < evict_at[t])``.
    """
    S = evict_at.shape[-1]
    dev = evict_at.device
    q = torch.arange(S, device=dev).view(S, 1)
    t = torch.arange(S, device=dev).view(1, S)
    causal = t <= q
    sink = t < sinks
    in_window = t > q - window
    kept = q < evict_at.to(torch.int64).unsqueeze(-2)  # [B, H, 1, S] vs [S, 1]
    return causal & (sink | in_window | kept)


def _per_head_k(k: object, H: int) -> list[int]:
    """``k`` as one int per KV head: an int is every head's; a sequence or 1-D tensor lists them."""
    if isinstance(k, int):
        return [k] * H
    ks = k.tolist() if hasattr(k, "tolist") else list(k)
    assert len(ks) == H and all(int(x) == x and x >= 0 for x in ks), (ks, H)
    return [int(x) for x in ks]


def eviction_schedule(priority: torch.Tensor, *, sinks: int, window: int, k) -> torch.Tensor:
    """Brute force: at every query ``q`` sort ``E(q)`` and keep its top ``k``.

    ``priority`` float ``[B, Hkv, S]`` -> int32 ``evict_at [B, Hkv, S]``.  ``k``: an int, or one per KV
    head (a sequence or 1-D tensor of ``Hkv`` ints): head ``h`` keeps its top ``k[h]``.
    """
    p = _clean_priority(priority)
    Bsz, H, S = p.shape
    ks = _per_head_k(k, H)
    out = torch.full((Bsz, H, S), NEVER, dtype=torch.int32)
    pl = p.cpu().tolist()
    for b in range(Bsz):
        for h in range(H):
            k = ks[h]
            pr = pl[b][h]
            ev = [NEVER] * S
            for q in range(S):
                eligible = list(range(sinks, q - window + 1))
                ranked = sorted(eligible, key=lambda t: rank_key(pr[t], t), reverse=True)
                kept = set(ranked[:k])
                for t in eligible:
                    if ev[t] == NEVER and t not in kept:
                        ev[t] = q
            out[b, h] = torch.tensor(ev, dtype=torch.int32)
    return out.to(priority.device)


def eviction_decisions(priority: torch.Tensor, *, sinks: int, window: int, k) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force decisions ``(y int8, bnd int32)``, each ``[B, Hkv, S]`` indexed by the token decided.

    For ``s <= t <= S-1-w`` with at least ``k >= 1`` tokens in ``{s..t-1}``: ``bnd`` is the k-th
    ranked token of ``{s..t-1}`` and ``y = +1`` if ``t`` ranks above it, else ``-1``.  Elsewhere
    ``y = 0`` and ``bnd = -1``.  ``k`` an int or one per KV head, as in :func:`eviction_schedule`.
    """
    p = _clean_priority(priority)
    Bsz, H, S = p.shape
    ks = _per_head_k(k, H)
    y = torch.zeros((Bsz, H, S), dtype=torch.int8)
    bnd = torch.full((Bsz, H, S), -1, dtype=torch.int32)
    pl = p.cpu().tolist()
    for b in range(Bsz):
        for h in range(H):
            k = ks[h]
            pr = pl[b][h]
            for t in range(sinks, S - window):
                before = list(range(sinks, t))
                if k == 0 or len(before) < k:
                    continue
                ranked = sorted(before, key=lambda u: rank_key(pr[u], u), reverse=True)
                kth = ranked[k - 1]
                bnd[b, h, t] = kth
                y[b, h, t] = 1 if rank_key(pr[t], t) > rank_key(pr[kth], kth) else -1
    return y.to(priority.device), bnd.to(priority.device)


def eviction_replay(priority: torch.Tensor, *, sinks: int, window: int, k) -> tuple[torch.Tensor, ...]:
    """Rule 10 replayed token by token: ``(evict_at, y, bnd)``, as :func:`eviction_schedule` and
    :func:`eviction_decisions`, in ``O(S log k)`` per head (the oracle of long sequences).

    A min-heap holds the kept long-range set.  At query ``q`` the token ``t = q - w`` joins ``E(q)``:
    while fewer than ``k`` are kept it takes a free slot; otherwise it replaces the lowest-ranked kept
    token if it ranks above it (that token's ``evict_at`` is ``q``) or is itself evicted at ``q``.  The
    heap's minimum just before ``t`` competes is ``bnd[t]``.
    """
    import heapq

    p = _clean_priority(priority)
    Bsz, H, S = p.shape
    ks = _per_head_k(k, H)
    ev = torch.full((Bsz, H, S), NEVER, dtype=torch.int32)
    y = torch.zeros((Bsz, H, S), dtype=torch.int8)
    bnd = torch.full((Bsz, H, S), -1, dtype=torch.int32)
    pl = p.cpu().tolist()
    for b in range(Bsz):
        for h in range(H):
            kh, pr = ks[h], pl[b][h]
            evh = [NEVER] * S
            heap: list[tuple[float, int]] = []  # rank_key of the kept tokens: the minimum ranks lowest
            for t in range(sinks, S - window):  # t joins E at q = t + w <= S - 1
                q, key = t + window, rank_key(pr[t], t)
                if kh == 0:
                    evh[t] = q
                    continue
                if len(heap) < kh:
                    heapq.heappush(heap, key)
                    continue
                low = heap[0]
                bnd[b, h, t] = low[1]
                y[b, h, t] = 1 if key > low else -1
                if key > low:
                    heapq.heapreplace(heap, key)
                    evh[low[1]] = q
                else:
                    evh[t] = q
            ev[b, h] = torch.tensor(evh, dtype=torch.int32)
    dev = priority.device
    return ev.to(dev), y.to(dev), bnd.to(dev)


def future_attention_target(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, window: int,
                            eps: float = 1e-6, scale: float | None = None, label: str = "mean",
                            power: float = 4.0) -> torch.Tensor:
    """Dense training target ``r_tgt [B, Hkv, S]`` (float32), by brute force over the ``S x S`` probabilities.

    ``p[h,g,u,t] = exp(scale * q_u . k_t - lse_u)`` for ``u >= t + w`` (else 0), ``N_t = max(1, S-t-w)``,
    ``m[h,g,t] = sum_u p / N_t`` (``label="mean"``), ``max_u p`` (``"max"``) or
    ``(sum_u p^power / N_t)^(1/power)`` (``"power"``, computed literally),
    ``r_tgt[h,t] = max_g log(eps + m[h,g,t])``.  ``q [B,Hq,S,D]``, ``k [B,Hkv,S,D]``, ``lse [B,Hq,S]``.
    Float32, float64 for ``"power"`` (whose ``p^a`` underflows float32).
    """
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    dt = torch.float64 if label == "power" else torch.float32
    kk = k.to(dt).repeat_interleave(G, dim=1)  # query head h*G+g reads KV head h
    logits = torch.einsum("bhud,bhtd->bhut", q.to(dt), kk) * scale
    u = torch.arange(S, device=q.device).view(S, 1)
    t = torch.arange(S, device=q.device).view(1, S)
    keep = u >= t + window
    prob = torch.exp(logits - lse.to(dt).unsqueeze(-1)) * keep
    n = torch.clamp(S - torch.arange(S, device=q.device) - window, min=1).to(dt)
    if label == "mean":
        m = prob.sum(dim=2) / n  # [B, Hq, S]
    elif label == "max":
        m = prob.amax(dim=2)
    elif label == "power":
        m = (prob.pow(power).sum(dim=2) / n).pow(1.0 / power)
    else:
        raise ValueError(f"label must be 'mean', 'max' or 'power', got {label!r}")
    r = torch.log(eps + m).view(Bsz, Hkv, G, S).amax(dim=2)
    return r.float()


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, evict_at: torch.Tensor, *,
                     sinks: int, window: int, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention with the mask of ``visible_mask``; differentiable in q, k, v.

    Returns ``(out [B,Hq,S,D] in q's dtype, lse float32 [B,Hq,S])`` (natural log).
    """
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    mask = visible_mask(evict_at, sinks=sinks, window=window).repeat_interleave(G, dim=1)
    kk = k.float().repeat_interleave(G, dim=1)
    vv = v.float().repeat_interleave(G, dim=1)
    logits = torch.einsum("bhud,bhtd->bhut", q.float(), kk) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("bhut,bhtd->bhud", torch.softmax(logits, dim=-1), vv)
    return out.to(q.dtype), lse.float()


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain causal GQA attention ``(out, lse)``: the teacher's attention and the ``B >= S`` oracle."""
    S = q.shape[2]
    never = torch.full((q.shape[0], k.shape[1], S), NEVER, dtype=torch.int32, device=q.device)
    return sparse_attention(q, k, v, never, sinks=0, window=max(S, 1), scale=scale)


def fixed_budget_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_pos: torch.Tensor,
                        slot_prio: torch.Tensor, leaving_prio: torch.Tensor, *, pos: int,
                        sinks: int, window: int, scale: float | None = None,
                        head_budgets: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch-1 decode step over a fixed budget of ``B = s + w + k`` slots per KV head.

    ``head_budgets`` (a sequence of ``Hkv`` ints ``B_h = s + w + k_h``, or a 1-D tensor): the packed
    layout of head-adaptive budgets, ``k_cache, v_cache [T, D]`` with ``T = sum B_h``, head ``h`` in the
    slots ``[off_h, off_h + B_h)`` (``off_h`` the prefix sum of the budgets), ``slot_pos [T]``,
    ``slot_prio [K]`` with ``K = sum k_h`` (head ``h`` at the prefix sum of the ``k``).  Each head runs
    the step below on its own slots (a plain loop over the heads).

    Layout of the slots of each KV head (``B = k_cache.shape[1]``):

    * ``[0, s)``: sinks, token ``t < s`` in slot ``t``;
    * ``[s, s+w)``: the window ring, token ``t >= s`` in slot ``s + (t - s) % w``;
    * ``[s+w, B)``: the ``k`` long-range slots.

    ``slot_pos [Hkv, B]`` int32 holds each slot's token position (``-1`` when empty) and
    ``slot_prio [Hkv, k]`` float32 the static priority of each long-range slot's token
    (``-inf`` when empty).  Inputs: ``q [Hq, D]``, ``k_new, v_new [Hkv, D]`` for the new token at
    position ``pos`` (keys already rotated), ``leaving_prio [Hkv]`` float32: the priority of the
    token ``t_new = pos - w`` that leaves the window now (ignored when ``pos - w < s``).

    The step, per KV head (docs/DESIGN.md "in decoding this is literally ..."):

    1. if ``t_new = pos - w >= s``: find the lowest-ranked long-range slot (lowest priority, ties
       to the oldest position; an empty slot ranks below every token); if ``t_new`` ranks above it,
       ``t_new``'s key/value (still in its ring slot) replace that slot's, else ``t_new`` is dropped;
    2. write ``k_new, v_new`` into the new token's slot (sink slot ``pos`` or ring slot);
    3. attend with every query head of the group over the slots with ``slot_pos >= 0``.

    Updates ``k_cache, v_cache, slot_pos, slot_prio`` in place; returns ``(out [Hq, D] in q's
    dtype, lse float32 [Hq])``.
    """
    if head_budgets is not None:
        return _packed_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, pos=pos,
                              sinks=sinks, window=window, scale=scale, head_budgets=head_budgets)
    Hq, D = q.shape
    Hkv, B, _ = k_cache.shape
    G = Hq // Hkv
    s, w = sinks, window
    scale = D ** -0.5 if scale is None else scale
    t_new = pos - w
    if t_new >= s and B > s + w:
        for h in range(Hkv):
            ring = s + (t_new - s) % w
            keys = [(float(slot_prio[h, j]), int(slot_pos[h, s + w + j]), j) for j in range(B - s - w)]
            lo_p, lo_t, lo_j = min(keys)
            lp = float(leaving_prio[h])
            lp = float("-inf") if lp != lp else lp  # NaN ranks as -inf
            if (lp, t_new) > (lo_p, lo_t):
                dst = s + w + lo_j
                k_cache[h, dst] = k_cache[h, ring]
                v_cache[h, dst] = v_cache[h, ring]
                slot_pos[h, dst] = t_new
                slot_prio[h, lo_j] = lp
    slot = pos if pos < s else s + (pos - s) % w
    k_cache[:, slot] = k_new
    v_cache[:, slot] = v_new
    slot_pos[:, slot] = pos
    kk = k_cache.float().repeat_interleave(G, dim=0)  # [Hq, B, D]
    vv = v_cache.float().repeat_interleave(G, dim=0)
    logits = torch.einsum("hd,hbd->hb", q.float(), kk) * scale
    valid = (slot_pos >= 0).repeat_interleave(G, dim=0)
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("hb,hbd->hd", torch.softmax(logits, dim=-1), vv)
    return out.to(q.dtype), lse.float()


def _packed_decode(q, k_new, v_new, k_cache, v_cache, slot_pos, slot_prio, leaving_prio, *, pos, sinks,
                   window, scale, head_budgets):
    """The packed layout: the uniform step on each head's slots (views, so the updates land in place)."""
    budgets = [int(b) for b in head_budgets]
    Hkv = len(budgets)
    G = q.shape[0] // Hkv
    outs, lses = [], []
    off = koff = 0
    for h, b in enumerate(budgets):
        kh = b - sinks - window
        o, lse = fixed_budget_decode(
            q[h * G:(h + 1) * G], k_new[h:h + 1], v_new[h:h + 1], k_cache[off:off + b].unsqueeze(0),
            v_cache[off:off + b].unsqueeze(0), slot_pos[off:off + b].unsqueeze(0),
            slot_prio[koff:koff + kh].unsqueeze(0), leaving_prio[h:h + 1], pos=pos, sinks=sinks, window=window,
            scale=scale)
        outs.append(o)
        lses.append(lse)
        off, koff = off + b, koff + kh
    return torch.cat(outs), torch.cat(lses)


def quantized_fixed_budget_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                  k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor,
                                  v_scale: torch.Tensor, slot_pos: torch.Tensor, slot_prio: torch.Tensor,
                                  leaving_prio: torch.Tensor, *, pos: int, sinks: int, window: int, kv_dtype: str,
                                  scale: float | None = None,
                                  head_budgets: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch-1 decode step of the quantised slot layout (``kvpop_kernels.layout.QuantizedLayout``).

    The slots of :func:`fixed_budget_decode` (uniform, or packed with ``head_budgets``) hold each key and value
    as 8-bit codes ``k_codes, v_codes`` (``kv_dtype``: ``"int8"`` or ``"fp8"``, float8 e4m3) with one float32
    scale per slot and KV head, ``k_scale, v_scale`` (``slot_pos``'s shape); a slot's value is
    ``codes * scale``.  The step:

    1. the new token's key and value are quantised, per KV head: ``scale = max_d |x_d| / qmax`` (``qmax`` 127
       for int8, 448 for fp8), ``code = x / scale`` (int8: rounded half up, ``floor(c + 0.5)``, clipped to
       ``[-127, 127]``; fp8: rounded to the nearest float8, ties to even); a zero vector has scale 0;
    2. :func:`fixed_budget_decode`'s eviction and placement, with each slot's codes and scales moving
       together (the token leaving the window keeps its codes: no requantisation);
    3. every query head attends over the dequantised valid slots of its KV head.

    Updates the codes, scales, ``slot_pos`` and ``slot_prio`` in place; returns ``(out [Hq, D] in q's dtype,
    lse float32 [Hq])``.
    """
    qmax, fp8 = {"int8": (127.0, None), "fp8": (448.0, torch.float8_e4m3fn)}[kv_dtype]
    Hq, D = q.shape
    Hkv = k_new.shape[0]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale

    def quantise(x):  # [Hkv, D] -> codes (as float64 values), scale [Hkv]
        codes, scales = [], []
        for h in range(Hkv):
            xh = x[h].float()
            sc = xh.abs().max() / qmax
            c = xh / (sc if sc > 0 else 1.0)
            c = torch.floor(c + 0.5).clamp(-qmax, qmax) if fp8 is None else c.to(fp8).float()
            codes.append(c.double())
            scales.append(sc)
        return torch.stack(codes), torch.stack(scales).double()

    kq, ks = quantise(k_new)
    vq, vs = quantise(v_new)
    # 2: the placement moves whole slots, so run it on one float64 vector per slot holding [key codes, key
    # scale, value codes, value scale] (exact: codes and float32 scales are float64 numbers); its attention
    # output is not used
    state = torch.cat([k_codes.double(), k_scale.double()[..., None], v_codes.double(),
                       v_scale.double()[..., None]], dim=-1)
    new = torch.cat([kq, ks[:, None], vq, vs[:, None]], dim=-1)
    q_pad = torch.zeros(Hq, 2 * D + 2, dtype=torch.float64)
    fixed_budget_decode(q_pad, new, new, state, state.clone(), slot_pos, slot_prio, leaving_prio, pos=pos,
                        sinks=sinks, window=window, scale=1.0, head_budgets=head_budgets)
    kc, ksc, vc, vsc = state[..., :D], state[..., D], state[..., D + 1:2 * D + 1], state[..., 2 * D + 1]
    k_codes.copy_(kc.to(k_codes.dtype) if fp8 is None else kc.float().to(fp8))
    v_codes.copy_(vc.to(v_codes.dtype) if fp8 is None else vc.float().to(fp8))
    k_scale.copy_(ksc)
    v_scale.copy_(vsc)
    # 3: attention over the dequantised slots of each KV head
    budgets = [k_codes.shape[1]] * Hkv if head_budgets is None else [int(b) for b in head_budgets]
    keys = (kc * ksc[..., None]).reshape(-1, D)  # every head's slots in turn
    vals = (vc * vsc[..., None]).reshape(-1, D)
    valid = (slot_pos >= 0).reshape(-1)
    out = torch.zeros(Hq, D, dtype=torch.float64)
    lse = torch.zeros(Hq, dtype=torch.float64)
    off = 0
    for h, b in enumerate(budgets):
        kk, vv, ok = keys[off:off + b], vals[off:off + b], valid[off:off + b]
        for g in range(h * G, (h + 1) * G):
            logits = (kk @ q[g].double() * scale).masked_fill(~ok, float("-inf"))
            lse[g] = torch.logsumexp(logits, dim=0)
            out[g] = torch.softmax(logits, dim=0) @ vv
        off += b
    return out.to(q.dtype), lse.float()


def ragged_paged_decode(q: torch.Tensor, fixed_k: torch.Tensor, fixed_v: torch.Tensor, n_fixed: int,
                        pool_k: torch.Tensor, pool_v: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, *,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per query head over each KV head's own keys: head ``h`` holds ``fixed_k[h, :n_fixed]``
    and then its ``lengths[h]`` long-range tokens, token ``i`` at ``pool_k[table[h, i // P], i % P]``
    (``P = pool_k.shape[1]``).  Query head ``g`` reads KV head ``g // (Hq // Hkv)``.  Returns
    ``(out [Hq, D] in q's dtype, lse float32 [Hq])``; a head with no key gives zeros and ``-inf``."""
    Hq, D = q.shape
    Hkv = fixed_k.shape[0]
    G = Hq // Hkv
    P = pool_k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((Hq,), float("-inf"), dtype=torch.float32, device=q.device)
    for h in range(Hkv):
        keys = [fixed_k[h, j].float() for j in range(n_fixed)]
        vals = [fixed_v[h, j].float() for j in range(n_fixed)]
        for i in range(int(lengths[h])):
            page = int(table[h, i // P])
            keys.append(pool_k[page, i % P].float())
            vals.append(pool_v[page, i % P].float())
        if not keys:
            continue
        kk, vv = torch.stack(keys), torch.stack(vals)
        for g in range(h * G, (h + 1) * G):
            logits = kk @ q[g].float() * scale
            lse[g] = torch.logsumexp(logits, dim=0)
            out[g] = torch.softmax(logits, dim=0) @ vv
    return out.to(q.dtype), lse


def paged_mlstm_decode(pages: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, kf: torch.Tensor,
                       vf: torch.Tensor, ig: torch.Tensor, log_f: torch.Tensor, q: torch.Tensor, k_new: torch.Tensor,
                       *, window: int, chunk: int) -> torch.Tensor:
    """One mLSTM decode step per row by gather, compute, scatter: row ``n``'s ``E`` state pages are copied out
    whole, read as ``C [H, d, d]``, ``n [H, d]``, ``m [H]``, ``kf, vf [H, L, d]``, ``ig, log f [H, L]``, ``ring
    [H, w, D]``; the chunk's read-outs are formed for all ``L`` rows in the matrix (chunkwise-parallel) form in
    float64 and row ``pos % L``'s kept; the state is carried on when the chunk completes; the pages are written
    back whole.  ``pos == 0`` starts from the empty state, ``pos < 0`` skips the row (read-out 0).  Returns
    ``h [N, H, d]`` float32; updates ``pages`` in place."""
    N, H, d = kf.shape
    L, w, D = chunk, window, k_new.shape[2]
    P = pages.shape[1]
    sizes = [H * d * d, H * d, H, H * L * d, H * L * d, H * L, H * L, H * w * D]
    E = -(-sum(sizes) // P)
    out = torch.zeros(N, H, d, dtype=torch.float32, device=kf.device)
    for r in range(N):
        p = int(pos[r])
        if p < 0:
            continue
        blocks = [int(b) for b in table[r, :E]]
        flat = torch.cat([pages[b] for b in blocks]).double()
        parts = list(torch.split(flat[: sum(sizes)], sizes))
        if p == 0:
            for i, fill in enumerate((0.0, 0.0, float("-inf"), 0.0, 0.0, float("-inf"), 0.0, 0.0)):
                parts[i] = torch.full_like(parts[i], fill)
        C, nn, m = parts[0].view(H, d, d), parts[1].view(H, d), parts[2].view(H)
        kb, vb, ib, lb = parts[3].view(H, L, d), parts[4].view(H, L, d), parts[5].view(H, L), parts[6].view(H, L)
        ring = parts[7].view(H, w, D)
        j = p % L
        kb[:, j], vb[:, j], ib[:, j], lb[:, j] = kf[r].double(), vf[r].double(), ig[r].double(), log_f[r].double()
        for h in range(H):
            F = torch.cumsum(lb[h], 0)
            logD = (F[:, None] - F[None, :] + ib[h][None, :]).masked_fill(
                ~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
            inter = F + m[h]
            M = torch.maximum(inter, logD.amax(1))
            Q = torch.zeros(L, d, dtype=torch.float64)
            Q[j] = q[r, h].double()
            S = (Q @ kb[h].T) * torch.exp(logD - M[:, None])
            a = torch.exp(inter - M)
            num = S @ vb[h] + a[:, None] * (Q @ C[h])
            den = S.sum(1) + a * (Q @ nn[h])
            out[r, h] = (num / torch.maximum(den.abs(), torch.exp(-M))[:, None])[j].float()
            if j == L - 1:
                wj = torch.exp(F[-1] - F + ib[h] - M[-1])
                carry = torch.exp(F[-1] + m[h] - M[-1])
                C[h] = carry * C[h] + (kb[h] * wj[:, None]).T @ vb[h]
                nn[h] = carry * nn[h] + (kb[h] * wj[:, None]).sum(0)
                m[h] = M[-1]
        if j == L - 1:
            kb.zero_(), vb.zero_(), ib.fill_(float("-inf")), lb.zero_()
        ring[:, p % w] = k_new[r].double()
        new = torch.cat([x.reshape(-1) for x in parts] + [flat[sum(sizes):]]).float()
        for e, b in enumerate(blocks):
            pages[b] = new[e * P:(e + 1) * P]
    return out
