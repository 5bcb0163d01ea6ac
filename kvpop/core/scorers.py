"""The two KVpop scorers: ``MLPScorer`` and ``MLSTMScorer`` (one module per layer, batched over KV heads).

Both map a layer's pre-RoPE keys and values to a raw score ``r_hat [B, Hkv, S]`` (float32).  The
mLSTM has a chunkwise-parallel form for training (:meth:`MLSTMScorer.forward`) and a recurrent one for
decoding (:meth:`~MLSTMScorer.init_state`, :meth:`~MLSTMScorer.step`, :meth:`~MLSTMScorer.score_token`).
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
        """Per-token features: ``qf, kf, vf [..., d]``, input-gate pre-activation ``ig`` and ``log f``."""
        eq = "bhsi,hio->bhso" if x.dim() == 4 else "bhi,hio->bho"
        eg = "bhsi,hi->bhs" if x.dim() == 4 else "bhi,hi->bh"
        ex = (slice(None), slice(None)) + ((None,) if x.dim() == 4 else ())
        qf = torch.einsum(eq, x, self.wq.float())
        kf = torch.einsum(eq, x, self.wk.float()) / math.sqrt(self.dim)
        vf = torch.einsum(eq, x, self.wv.float())
        ig = torch.einsum(eg, x, self.wi.float()) + self.bi.float()[(None,) + ex[1:]]
        lf = F.logsigmoid(torch.einsum(eg, x, self.wf.float()) + self.bf.float()[(None,) + ex[1:]])
        return qf, kf, vf, ig, lf

    @staticmethod
    def _read(C: torch.Tensor, n: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``C̃^T q / max(|ñ.q|, exp(-m))``: ``C [B,H,d,d]``, ``n [B,H,d]``, ``m [B,H]``, ``q [B,H,(T,)d]``."""
        if q.dim() == 3:
            num = torch.einsum("bhk,bhkv->bhv", q, C)
            den = (q * n).sum(-1)
            return num / torch.maximum(den.abs(), torch.exp(-m))[..., None]
        num = torch.einsum("bhtk,bhkv->bhtv", q, C)
        den = torch.einsum("bhtk,bhk->bht", q, n)
        return num / torch.maximum(den.abs(), torch.exp(-m)[..., None])[..., None]

    # ---------------------------------------------------------------- training (chunkwise)
    @float32_scoring
    def forward(self, k_pre: torch.Tensor, v: torch.Tensor, *, return_state: bool = False):
        """Raw scores ``r_hat [B, Hkv, S]`` float32 from ``k_pre, v [B, Hkv, S, D]`` (chunkwise-parallel).

        With ``return_state=True`` returns ``(r_hat, state)``, ``state`` the recurrent state after the
        last token (as :meth:`step` would leave it), to continue decoding after a prefill.
        """
        _check_inputs("MLSTMScorer", k_pre, v, self.num_kv_heads, self.head_dim)
        if k_pre.dim() != 4:
            raise ValueError(f"MLSTMScorer.forward takes [B, Hkv, S, D], got {tuple(k_pre.shape)}; "
                             f"use step/score_token to decode")
        x = scorer_features(k_pre, v)
        B, H, S, _ = x.shape
        w = self.window
        qf, kf, vf, ig, lf = self._proj(x)
        # the read-out at position a uses the query of token a - w (zero query before w)
        q_shift = torch.zeros_like(qf)
        if S > w:
            q_shift[:, :, w:] = qf[:, :, : S - w]
        h_shift, (C, n, m) = self._chunkwise(q_shift, kf, vf, ig, lf)
        h = torch.empty_like(h_shift)
        if S > w:
            h[:, :, : S - w] = h_shift[:, :, w:]
        tail = max(0, S - w)  # tokens still in the window at the end read the last state
        h[:, :, tail:] = self._read(C, n, m, qf[:, :, tail:])
        r = self.out(torch.cat([x, h], dim=-1))
        return (r, (C, n, m)) if return_state else r

    def _chunkwise(self, q, kf, vf, ig, lf):
        B, H, S, d = kf.shape
        dev = kf.device
        C = torch.zeros(B, H, d, d, device=dev)
        n = torch.zeros(B, H, d, device=dev)
        m = torch.full((B, H), float("-inf"), device=dev)
        outs = []
        for c0 in range(0, S, self.chunk):
            c1 = min(S, c0 + self.chunk)
            L = c1 - c0
            qc, kc, vc = q[:, :, c0:c1], kf[:, :, c0:c1], vf[:, :, c0:c1]
            igc, Fc = ig[:, :, c0:c1], torch.cumsum(lf[:, :, c0:c1], dim=-1)
            causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
            logD = Fc[..., :, None] - Fc[..., None, :] + igc[..., None, :]
            logD = logD.masked_fill(~causal, float("-inf"))
            inter = Fc + m[..., None]  # log weight of the carried state at each position
            ma = torch.maximum(inter, logD.amax(-1)).detach()
            D = torch.exp(logD - ma[..., None])
            wi = torch.exp(inter - ma)
            s = torch.einsum("bhak,bhjk->bhaj", qc, kc) * D
            num = torch.einsum("bhaj,bhjv->bhav", s, vc) + wi[..., None] * torch.einsum("bhak,bhkv->bhav", qc, C)
            den = s.sum(-1) + wi * torch.einsum("bhak,bhk->bha", qc, n)
            outs.append(num / torch.maximum(den.abs(), torch.exp(-ma))[..., None])
            m_new = ma[..., -1]
            wj = torch.exp(Fc[..., -1:] - Fc + igc - m_new[..., None])  # [B,H,L]
            carry = torch.exp(Fc[..., -1] + m - m_new)  # 0 on the first chunk (m = -inf)
            C = carry[..., None, None] * C + torch.einsum("bhjk,bhjv->bhkv", kc * wj[..., None], vc)
            n = carry[..., None] * n + (kc * wj[..., None]).sum(2)
            m = m_new
        h = torch.cat(outs, dim=2) if outs else q.new_zeros(B, H, 0, d)
        return h, (C, n, m)

    # ---------------------------------------------------------------- decoding (recurrent)
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
