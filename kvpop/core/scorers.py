"""The two KVpop scorers: ``MLPScorer`` and ``MLSTMScorer`` (one module per layer, batched over KV heads).

Both map a layer's pre-RoPE keys and values to a raw score ``r_hat [B, Hkv, S]`` (float32).  The
mLSTM has a chunkwise-parallel form for training (:meth:`MLSTMScorer.forward`); decoding runs the same
chunk function (:meth:`~MLSTMScorer.decode_state`, :meth:`~MLSTMScorer.decode_leaving`), so a token's
decode-time score has the training forward's bits; the recurrent form (:meth:`~MLSTMScorer.init_state`,
:meth:`~MLSTMScorer.step`, :meth:`~MLSTMScorer.score_token`) agrees with it to rounding only.
The formulas, the inputs and the timing: docs/DESIGN.md section 3 ("Scorers") and section 7.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import KVpopConfig
from .priority import head_linear, silu, to_rows

__all__ = ["MLPScorer", "MLSTMScorer", "build_scorer", "scorer_features", "float32_scoring"]


def float32_scoring(fn: Callable) -> Callable:
    """Run ``fn`` with autocast off on the device of its first tensor argument: scorers (and ``L_score``)
    compute in float32 under ``--bf16`` autocast too, as they do while decoding (docs/DESIGN.md section 7)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dev = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if dev is None or not torch.is_autocast_enabled(dev):
            return fn(*args, **kwargs)
        with torch.autocast(dev, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def scorer_features(k_pre: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``x = [rms(k_pre); rms(v)]`` in float32, ``[..., 2D]`` from ``k_pre, v [..., D]`` (no learned weight)."""
    k = F.rms_norm(k_pre.float(), (k_pre.shape[-1],), eps=1e-6)
    vv = F.rms_norm(v.float(), (v.shape[-1],), eps=1e-6)
    return torch.cat([k, vv], dim=-1)


def _check_inputs(name: str, k_pre: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int) -> None:
    for nm, x in (("k_pre", k_pre), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {nm} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-1] != head_dim or x.shape[1] != heads:
            raise ValueError(
                f"{name}: {nm} must be [B, Hkv={heads}, ..., D={head_dim}], got shape {tuple(x.shape)}"
            )
    if k_pre.shape != v.shape:
        raise ValueError(f"{name}: k_pre {tuple(k_pre.shape)} and v {tuple(v.shape)} must have one shape")


class _HeadMLP(nn.Module):
    """Per-head two-layer MLP ``[B, H, S, I] -> [B, H, S]`` (weights ``[H, I, hidden]``, ``[H, hidden]``).

    No output bias: only differences of scores within a head matter (eviction ranks tokens of one head;
    ``L_score`` compares two tokens of one head), so an output bias would get an exactly-zero gradient
    and Adam would turn its rounding noise into random steps.
    """

    def __init__(self, heads: int, d_in: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(heads, d_in, hidden) / math.sqrt(d_in))
        self.b1 = nn.Parameter(torch.zeros(heads, hidden))
        self.w2 = nn.Parameter(torch.randn(heads, hidden) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, H, ..., I]`` -> ``[B, H, ...]``, one token at a time in effect: the rows are scored in
        blocks (``kvpop.core.priority``), so a token's score has the same bits however many are scored."""
        rows, back = to_rows(x)
        return back(self.rows(rows))

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [H, M', I]`` (``kvpop.core.priority.to_rows``) -> ``[H, M']``."""
        w1, b1, w2 = self.w1.float(), self.b1.float(), self.w2.float()
        hdn = silu(head_linear(rows, w1) + b1[:, None, :])
        return (hdn * w2[:, None, :]).sum(-1)


class MLPScorer(nn.Module):
    """Two-layer MLP per KV head on the token's pre-RoPE key and value (``scorer="mlp"``).

    Args:
        num_kv_heads: ``Hkv``.  head_dim: ``D``.  hidden: width of the hidden layer.
    """

    lookahead_uses_window = False

    def __init__(self, num_kv_heads: int, head_dim: int, hidden: int = 128) -> None:
        super().__init__()
        self.num_kv_heads, self.head_dim, self.hidden = num_kv_heads, head_dim, hidden
        self.mlp = _HeadMLP(num_kv_heads, 2 * head_dim, hidden)

    @float32_scoring
    def forward(self, k_pre: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Raw scores ``r_hat [B, Hkv, ...]`` float32 from ``k_pre, v [B, Hkv, ..., D]`` (any dtype).

        Works for a whole sequence ``[B, Hkv, S, D]`` and for one token ``[B, Hkv, D]`` alike.
        """
        _check_inputs("MLPScorer", k_pre, v, self.num_kv_heads, self.head_dim)
        return self.mlp(scorer_features(k_pre, v))

    @float32_scoring
    def score_token(self, state: None, k_pre: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Decoding: the score ``[B, Hkv]`` of one token (``state`` is unused, for symmetry with mLSTM)."""
        return self.forward(k_pre, v)


class MLSTMScorer(nn.Module):
    """mLSTM cell per KV head that reads ``w`` tokens ahead before scoring (``scorer="mlstm"``).

    Args:
        num_kv_heads: ``Hkv``.  head_dim: ``D``.  window: ``w`` (the read-out position is ``t + w``).
        dim: feature width ``d`` of the memory ``C [d, d]``.  hidden: width of the output MLP.
        chunk: chunk length of the chunkwise-parallel training form.
    """

    lookahead_uses_window = True

    def __init__(self, num_kv_heads: int, head_dim: int, window: int, dim: int = 64, hidden: int = 128,
                 chunk: int = 128) -> None:
        super().__init__()
        H, I = num_kv_heads, 2 * head_dim
        self.num_kv_heads, self.head_dim, self.window, self.dim, self.chunk = H, head_dim, window, dim, chunk
        self.wq = nn.Parameter(torch.randn(H, I, dim) / math.sqrt(I))
        self.wk = nn.Parameter(torch.randn(H, I, dim) / math.sqrt(I))
        self.wv = nn.Parameter(torch.randn(H, I, dim) / math.sqrt(I))
        self.wi = nn.Parameter(torch.randn(H, I) * 0.01)
        self.bi = nn.Parameter(torch.zeros(H))
        self.wf = nn.Parameter(torch.randn(H, I) * 0.01)
        # forget-gate bias: sigmoid(4) = 0.982, a memory of ~50 tokens to start from
        self.bf = nn.Parameter(torch.full((H,), 4.0))
        self.out = _HeadMLP(H, I + dim, hidden)

    # ---------------------------------------------------------------- shared pieces
    def _proj(self, x: torch.Tensor):
        """Per-token features of ``x [B, H, ..., I]``: ``qf, kf, vf [B, H, ..., d]``, the input-gate
        pre-activation ``ig`` and ``log f`` ``[B, H, ...]``.  Computed on rows (``kvpop.core.priority``):
        a token's features have the same bits whether it is projected alone or with a whole sequence."""
        rows, back = to_rows(x)
        d = self.dim
        qkv = head_linear(rows, torch.cat([self.wq, self.wk, self.wv], dim=-1).float())
        qf, kf, vf = qkv[..., :d], qkv[..., d:2 * d] / math.sqrt(d), qkv[..., 2 * d:]
        ig = (rows * self.wi.float()[:, None, :]).sum(-1) + self.bi.float()[:, None]
        lf = F.logsigmoid((rows * self.wf.float()[:, None, :]).sum(-1) + self.bf.float()[:, None])
        return back(qf), back(kf), back(vf), back(ig), back(lf)

    @staticmethod
    def _read(C: torch.Tensor, n: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``C̃^T q / max(|ñ.q|, exp(-m))``: ``C [B,H,d,d]``, ``n [B,H,d]``, ``m [B,H]``, ``q [B,H,(T,)d]``."""
        if q.dim() == 3:
            num = torch.einsum("bhk,bhkv->bhv", q, C)
            den = (q * n).sum(-1)
            return num / torch.maximum(den.abs(), torch.exp(-m))[..., None]
        num = torch.einsum("bhtk,bhkv->bhtv", q, C)
        den = (q * n[:, :, None, :]).sum(-1)  # a product and a sum: see ``_chunk``'s ``den``
        return num / torch.maximum(den.abs(), torch.exp(-m)[..., None])[..., None]

    # ---------------------------------------------------------------- training (chunkwise)
    @float32_scoring
    def forward(self, k_pre: torch.Tensor, v: torch.Tensor, *, return_state: bool = False):
        """Raw scores ``r_hat [B, Hkv, S]`` float32 from ``k_pre, v [B, Hkv, S, D]`` (chunkwise-parallel).

        With ``return_state=True`` returns ``(r_hat, state)``, ``state`` the decoding state after the
        last token (:meth:`decode_state`'s layout), to continue decoding after a prefill.
        """
        _check_inputs("MLSTMScorer", k_pre, v, self.num_kv_heads, self.head_dim)
        if k_pre.dim() != 4:
            raise ValueError(f"MLSTMScorer.forward takes [B, Hkv, S, D], got {tuple(k_pre.shape)}; "
                             f"use decode_state/decode_leaving to decode")
        x = scorer_features(k_pre, v)
        B, H, S, _ = x.shape
        w = self.window
        qf, kf, vf, ig, lf = self._proj(x)
        # the read-out at position a uses the query of token a - w (zero query before w)
        q_shift = torch.zeros_like(qf)
        if S > w:
            q_shift[:, :, w:] = qf[:, :, : S - w]
        h_shift, (C, n, m), start = self._chunkwise(q_shift, kf, vf, ig, lf)
        h = torch.empty_like(h_shift)
        if S > w:
            h[:, :, : S - w] = h_shift[:, :, w:]
        tail = max(0, S - w)  # tokens still in the window at the end read the last state
        h[:, :, tail:] = self._read(C, n, m, qf[:, :, tail:])
        r = self.out(torch.cat([x, h], dim=-1))
        if not return_state:
            return r
        # decoding continues in the chunk of position S: its start state and the features it holds so far
        c0 = (S // self.chunk) * self.chunk
        state = self.decode_state(B, x.device)
        for buf, st in zip(state[:3], start):
            buf.copy_(st)
        for buf, f in zip(state[3:], (kf, vf, ig, lf)):
            buf[:, :, : S - c0] = f[:, :, c0:S]
        return r, state

    def _chunk(self, q, kf, vf, ig, lf, C, n, m):
        """One chunk of exactly ``self.chunk`` positions (padding: zero features, ``ig = -inf``,
        ``log f = 0``): the read-outs ``h [B,H,L,d]`` of its queries ``q`` and the state after it.
        Training runs it chunk by chunk; decoding runs it at every step on the chunk it is filling, so
        the read-out of a position has the same bits in both (same shapes, same op order)."""
        L = self.chunk
        dev = kf.device
        # one memory layout on every path (a matrix product's summation order may depend on the strides)
        q, kf, vf, ig, lf, C, n, m = (t.contiguous() for t in (q, kf, vf, ig, lf, C, n, m))
        Fc = torch.cumsum(lf, dim=-1)
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        logD = Fc[..., :, None] - Fc[..., None, :] + ig[..., None, :]
        logD = logD.masked_fill(~causal, float("-inf"))
        inter = Fc + m[..., None]  # log weight of the carried state at each position
        ma = torch.maximum(inter, logD.amax(-1)).detach()
        D = torch.exp(logD - ma[..., None])
        wi = torch.exp(inter - ma)
        s = torch.einsum("bhak,bhjk->bhaj", q, kf) * D
        num = torch.einsum("bhaj,bhjv->bhav", s, vf) + wi[..., None] * torch.einsum("bhak,bhkv->bhav", q, C)
        # a product and a sum, not a matrix-vector einsum (its summation order changed with the batch size)
        den = s.sum(-1) + wi * (q * n[..., None, :]).sum(-1)
        h = num / torch.maximum(den.abs(), torch.exp(-ma))[..., None]
        m_new = ma[..., -1]
        wj = torch.exp(Fc[..., -1:] - Fc + ig - m_new[..., None])  # [B,H,L]; 0 at padding
        carry = torch.exp(Fc[..., -1] + m - m_new)  # 0 on the first chunk (m = -inf)
        C = carry[..., None, None] * C + torch.einsum("bhjk,bhjv->bhkv", kf * wj[..., None], vf)
        # a product and a sum, as ``den`` above: the matrix-vector einsum's summation order changed with the batch
        n = carry[..., None] * n + (kf * wj[..., None]).sum(-2)
        return h, (C, n, m_new)

    def _chunkwise(self, q, kf, vf, ig, lf):
        """All chunks of a sequence: ``(h [B,H,S,d], state after the last token, state at the start of
        the chunk that position S falls in)``."""
        B, H, S, d = kf.shape
        L = self.chunk
        pad = -S % L
        if pad:
            q, kf, vf = (F.pad(t, (0, 0, 0, pad)) for t in (q, kf, vf))
            ig, lf = F.pad(ig, (0, pad), value=float("-inf")), F.pad(lf, (0, pad))
        dev = kf.device
        C = torch.zeros(B, H, d, d, device=dev)
        n = torch.zeros(B, H, d, device=dev)
        m = torch.full((B, H), float("-inf"), device=dev)
        start = (C, n, m)
        outs = []
        for c0 in range(0, S, L):
            c1 = c0 + L
            if c1 > S:
                start = (C, n, m)
            h, (C, n, m) = self._chunk(q[:, :, c0:c1], kf[:, :, c0:c1], vf[:, :, c0:c1], ig[:, :, c0:c1],
                                       lf[:, :, c0:c1], C, n, m)
            outs.append(h)
        if S % L == 0:
            start = (C, n, m)
        h = torch.cat(outs, dim=2)[:, :, :S] if outs else q.new_zeros(B, H, 0, d)
        return h, (C, n, m), start

    # ---------------------------------------------------------------- decoding (the training chunks)
    def decode_state(self, batch: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """Empty decoding state: ``(C [B,H,d,d], n [B,H,d], m [B,H])`` at the start of the chunk being
        filled, and that chunk's features so far ``kf, vf [B,H,L,d]``, ``ig, log f [B,H,L]`` (padding:
        zeros, ``ig = -inf``)."""
        H, d, L = self.num_kv_heads, self.dim, self.chunk
        return (torch.zeros(batch, H, d, d, device=device), torch.zeros(batch, H, d, device=device),
                torch.full((batch, H), float("-inf"), device=device),
                torch.zeros(batch, H, L, d, device=device), torch.zeros(batch, H, L, d, device=device),
                torch.full((batch, H, L), float("-inf"), device=device), torch.zeros(batch, H, L, device=device))

    def state_floats(self) -> int:
        """Float32 values a cache keeps per sequence for this layer to decode: :meth:`decode_state` and the ring
        of the last ``w`` pre-RoPE keys that ``ScorerHooks`` (and the vLLM plugin's state pages) keep beside it."""
        H, d, L = self.num_kv_heads, self.dim, self.chunk
        return H * (d * d + d + 1 + 2 * L * d + 2 * L + self.window * self.head_dim)

    @float32_scoring
    def decode_leaving(self, state: tuple[torch.Tensor, ...], k_new: torch.Tensor, v_new: torch.Tensor,
                       pos: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> torch.Tensor:
        """One decoding step of every row: absorb the token at ``pos [B]`` (``k_new, v_new [B,Hkv,D]``),
        then score the token ``t = pos - w`` (``k_t, v_t``) from the read-out at ``pos``: ``[B, Hkv]``.

        The read-out runs the training's chunk function (:meth:`_chunk`) on the chunk ``pos`` falls in,
        so the score has the bits a full-sequence forward gives ``t``.  ``state`` (:meth:`decode_state`)
        is updated in place; nothing is read back to the host (rows may sit at different positions).
        """
        C, n, m, kb, vb, ib, lb = state
        L = self.chunk
        B, H = k_new.shape[:2]
        _, kf, vf, ig, lf = self._proj(scorer_features(k_new, v_new))
        j = (pos % L)[:, None, None]  # [B,1,1]: the new token's place in its chunk
        onehot = torch.arange(L, device=pos.device)[None, None, :] == j  # [B,1,L]
        kb.copy_(torch.where(onehot[..., None], kf[:, :, None], kb))
        vb.copy_(torch.where(onehot[..., None], vf[:, :, None], vb))
        ib.copy_(torch.where(onehot, ig[..., None], ib))
        lb.copy_(torch.where(onehot, lf[..., None], lb))
        x_t = scorer_features(k_t, v_t)
        qf, *_ = self._proj(x_t)
        q = torch.where(onehot[..., None], qf[:, :, None], torch.zeros_like(kb))
        h, (C2, n2, m2) = self._chunk(q, kb, vb, ib, lb, C, n, m)
        h_t = h.gather(2, j[..., None].expand(B, H, 1, h.shape[-1])).squeeze(2)  # the new token's row
        done = (pos % L == L - 1)[:, None]  # chunks completed at this step carry their state on
        C.copy_(torch.where(done[..., None, None], C2, C))
        n.copy_(torch.where(done[..., None], n2, n))
        m.copy_(torch.where(done, m2, m))
        kb.masked_fill_(done[..., None, None], 0.0)
        vb.masked_fill_(done[..., None, None], 0.0)
        ib.masked_fill_(done[..., None], float("-inf"))
        lb.masked_fill_(done[..., None], 0.0)
        return self.out(torch.cat([x_t, h_t], dim=-1))

    # ---------------------------------------------------------------- the recurrent form
    def init_state(self, batch: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Empty state ``(C [B,Hkv,d,d], n [B,Hkv,d], m [B,Hkv])`` float32 (``m = -inf``)."""
        H, d = self.num_kv_heads, self.dim
        return (torch.zeros(batch, H, d, d, device=device), torch.zeros(batch, H, d, device=device),
                torch.full((batch, H), float("-inf"), device=device))

    @float32_scoring
    def step(self, state, k_pre: torch.Tensor, v: torch.Tensor):
        """Absorb one token: ``k_pre, v [B, Hkv, D]`` -> the new state (not in place)."""
        _check_inputs("MLSTMScorer.step", k_pre, v, self.num_kv_heads, self.head_dim)
        C, n, m = state
        _, kf, vf, ig, lf = self._proj(scorer_features(k_pre, v))
        m_new = torch.maximum(lf + m, ig)
        a = torch.exp(lf + m - m_new)
        b = torch.exp(ig - m_new)
        C = a[..., None, None] * C + b[..., None, None] * kf[..., :, None] * vf[..., None, :]
        n = a[..., None] * n + b[..., None] * kf
        return C, n, m_new

    @float32_scoring
    def score_token(self, state, k_pre: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Score ``[B, Hkv]`` float32 of the token with ``k_pre, v [B, Hkv, D]``, reading ``state``.

        In decoding, ``state`` has absorbed tokens up to ``t + w`` when token ``t`` is scored.
        """
        _check_inputs("MLSTMScorer.score_token", k_pre, v, self.num_kv_heads, self.head_dim)
        C, n, m = state
        x = scorer_features(k_pre, v)
        qf, *_ = self._proj(x)
        h = self._read(C, n, m, qf)
        return self.out(torch.cat([x, h], dim=-1))


def build_scorer(config: KVpopConfig, num_kv_heads: int, head_dim: int) -> nn.Module:
    """The scorer ``config.scorer`` names, for a layer with ``num_kv_heads`` heads of width ``head_dim``."""
    if config.scorer == "mlp":
        return MLPScorer(num_kv_heads, head_dim, config.scorer_hidden)
    if config.scorer == "mlstm":
        return MLSTMScorer(num_kv_heads, head_dim, config.window, config.mlstm_dim, config.scorer_hidden)
    raise ValueError(f"scorer must be one of ['mlp', 'mlstm'], got {config.scorer!r}")
