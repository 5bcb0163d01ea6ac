"""``future_attention_target``: the transposed LSE-shifted column-sum attention (training target).

For every key ``t`` of KV head ``h`` and every query head ``g`` of its group (query head
``h*G + g``), the mean attention ``t`` receives once it has left the window::

    m[h,g,t] = (1/N_t) * sum_{u=t+w}^{S-1} exp(scale * q_u . k_t - lse_u),   N_t = max(1, S-t-w)
    r_tgt[h,t] = max_g log(eps + m[h,g,t])

``label`` picks how the later attention ``p_{u->t}`` (``u >= t + w``) is pooled into ``m``, in the
same pass (docs/DESIGN.md section 3):

* ``"mean"`` (default, the method's): the mean above.
* ``"max"``: ``m = max_u p_{u->t}`` (``0`` where no ``u`` exists), a token's strongest later reader.
* ``"power"``: the power mean ``m = ((1/N_t) sum_u p_{u->t}^a)^(1/a)`` with ``a = power > 0``;
  ``a = 1`` is the mean, ``a -> inf`` tends to the max.  Computed in the log domain: a running max
  ``M`` of ``log p`` and a sum ``Z`` of ``exp(a (log p - M))``, rescaled when ``M`` grows, so that
  ``log m = M + (log Z - log N_t) / a`` never forms ``p^a`` (which underflows float32 for small ``p``
  and large ``a``).

The epsilon, ``N_t`` and the max over the query group are the same for every label.

This is a log-sum-exp over queries for a fixed key, i.e. attention with the roles of queries
and keys swapped: the key block is the "query" of the kernel, the queries are streamed, the
score subtracts ``lse_u`` and the mask keeps ``u >= t + w``.  No running maximum is needed:
``lse_u`` already is the normaliser of row ``u``, so every term is a probability (at most
about 1; with the ``lse`` of a sparse attention a key hidden from ``u`` can exceed it, which
float32 accumulation absorbs).

Backends (docs/DESIGN.md dispatch):

* Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``): one program per (block of ``BLOCK_T``
  keys, batch, KV head).  It keeps its key tile in registers, loops over the ``G`` query heads
  of the group and, for each, over the query blocks ``u >= t_min + w`` only (the blocks left of
  the ``u >= t + w`` triangle are never visited); the sum of ``exp2`` is kept per key in fp32;
  the mean, ``log(eps + m)`` and the max over ``g`` are taken in the program.  ``"max"`` and
  ``"power"`` keep a running max (and for ``"power"`` the rescaled sum) per key instead.  Extra memory:
  none besides the ``[B, Hkv, S]`` output.
* PyTorch (CPU without the interpreter): chunks of queries, ``[B, Hq, chunk, S]`` floats at
  most per step (the ``S x S`` matrix is never formed), matmul + in-place ``exp``.

The op is a label: its inputs are detached and the output carries no gradient.
"""
from __future__ import annotations

import math

import torch

from ._utils import check_gqa, check_int, check_tensor, default_scale, empty, interpreting, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["future_attention_target", "LABELS"]

LABELS = ("mean", "max", "power")
"""Ways of pooling a key's later attention into its label (``label=`` of the op)."""
_MODE = {"mean": 0, "power": 1, "max": 2}  # the kernel's LABEL constexpr

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------- guards
def check_label(label: object, power: object) -> tuple[str, float]:
    """Validate a label and its power-mean exponent (``power`` is checked whatever the label, so a
    mistyped exponent is caught before it is used); return ``(label, float(power))``."""
    if not isinstance(label, str) or label not in LABELS:
        raise ValueError(f"label must be one of {list(LABELS)}, got {label!r}")
    if isinstance(power, bool) or not isinstance(power, (int, float)):
        raise TypeError(f"power (the power-mean exponent a) must be a float, got {type(power).__name__} ({power!r})")
    if not (power > 0 and math.isfinite(power)):
        raise ValueError(f"power (the power-mean exponent a) must be a finite float > 0 (a = 1 is the mean; for "
                         f"a -> inf use label='max'), got {power!r}")
    return label, float(power)


def _check(q: object, k: object, lse: object, window: object, eps: object,
           scale: object) -> tuple[int, float, float]:
    """Validate the arguments; return ``(G, eps, scale)``."""
    check_tensor("q", q, 4, floating=True)
    check_tensor("k", k, 4, floating=True)
    check_tensor("lse", lse, 3, floating=True)
    Bsz, Hq, S, D = q.shape
    if k.shape[0] != Bsz or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(
            f"k must be [B, Hkv, S, D] with B, S, D of q {tuple(q.shape)} (q is [B, Hq, S, D]), "
            f"got k of shape {tuple(k.shape)}"
        )
    if D < 1:
        raise ValueError(f"head_dim (last dim of q and k) must be >= 1, got {D}")
    G = check_gqa(Hq, k.shape[1])
    if tuple(lse.shape) != (Bsz, Hq, S):
        raise ValueError(f"lse must be [B, Hq, S] = {[Bsz, Hq, S]} (one natural-log normaliser per "
                         f"query row), got shape {tuple(lse.shape)}")
    check_int("window", window, minimum=1)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__} ({eps!r})")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    return G, float(eps), default_scale(scale, D)


# ------------------------------------------------------------------------------ CPU
_CPU_CHUNK_ELEMS = 1 << 24  # floats of one [B, Hq, chunk, keys] logits block (64 MiB)


def _cpu_chunk(Bsz: int, Hq: int, S: int) -> int:
    per_query = max(1, Bsz * Hq * S)
    return int(min(1024, max(16, _CPU_CHUNK_ELEMS // per_query)))


def _cpu_target(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, window: int, eps: float,
                scale: float, chunk: int | None = None, label: str = "mean",
                power: float = 1.0) -> torch.Tensor:
    """PyTorch path: float32, chunks of ``chunk`` queries, never an ``S x S`` matrix."""
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    w = window
    out = empty((Bsz, Hkv, S), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    C = _cpu_chunk(Bsz, Hq, S) if chunk is None else int(chunk)
    mean = label == "mean"
    with torch.no_grad():
        # mean: the sum of p; max / power: the running max M of log p; power also Z = sum exp(a (log p - M))
        acc = torch.zeros((Bsz, Hkv, G, S), dtype=torch.float32, device=q.device)
        run_max = None if mean else torch.full((Bsz, Hkv, G, S), float("-inf"), dtype=torch.float32, device=q.device)
        if S > w:
            BH = Bsz * Hkv
            # keys as [B*Hkv, D, S]: one batched GEMM per chunk with the G heads of a group stacked
            kT = k.detach().to(torch.float32).reshape(BH, S, D).transpose(1, 2)
            neg_lse = lse.detach().to(torch.float32).neg().reshape(BH, G, S)
            for u0 in range(w, S, C):  # only queries u >= w see any key at distance >= w
                u1 = min(u0 + C, S)
                n_u = u1 - u0
                t_hi = u1 - w  # keys t <= u1 - 1 - w are seen by some query of the chunk
                qc = q[:, :, u0:u1].detach().to(torch.float32).reshape(BH, G * n_u, D) * scale
                # x[bh, g*n_u + i, t] = log p = scale * q_{u0+i} . k_t - lse_{u0+i}
                x = torch.baddbmm(neg_lse[:, :, u0:u1].reshape(BH, G * n_u, 1), qc, kT[:, :, :t_hi])
                x = x.view(BH, G, n_u, t_hi)
                t_full = u0 - w + 1  # keys t < t_full are seen by every query of the chunk
                if t_full < t_hi:
                    uu = torch.arange(u0, u1, device=q.device).view(n_u, 1)
                    tt = torch.arange(t_full, t_hi, device=q.device).view(1, t_hi - t_full)
                    x[..., t_full:t_hi].masked_fill_(uu < tt + w, float("-inf"))
                a_acc = acc.view(BH, G, S)[..., :t_hi]
                if mean:
                    a_acc += x.exp_().sum(dim=2)
                    continue
                m_old = run_max.view(BH, G, S)[..., :t_hi]
                m_new = torch.maximum(m_old, x.amax(dim=2))
                if label == "power":
                    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    a_acc.mul_(torch.exp(power * (m_old - m_safe)))
                    a_acc += x.sub_(m_safe.unsqueeze(2)).mul_(power).exp_().sum(dim=2)
                m_old.copy_(m_new)
        n = torch.clamp(S - torch.arange(S, device=q.device) - w, min=1).to(torch.float32)
        if mean:
            r = torch.log(acc.div_(n).add_(eps))
        else:
            log_m = run_max if label == "max" else run_max + (torch.log(acc) - torch.log(n)) / power
            r = torch.log(torch.exp(log_m).add_(eps))
        out.copy_(r.amax(dim=2))
    return out


# --------------------------------------------------------------------------- Triton
if triton is not None:

    @triton.jit
    def _log2_probs(kt, Qh, Lh, u0, t, S, window, stride_qs, stride_qd, stride_ls, d, D, qk_scale,
                    MASK_T: tl.constexpr, MASK_S: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PREC: tl.constexpr, BLOCK_U: tl.constexpr):
        """``log2 p_{u->t} = log2(e) (scale * k_t . q_u - lse_u)`` ``[BLOCK_T, BLOCK_U]`` over one block of
        queries ``u``; ``-inf`` where ``u < t + w`` (``MASK_T``) or ``u >= S`` (``MASK_S``)."""
        u = u0 + tl.arange(0, BLOCK_U)
        u64 = u.to(tl.int64)  # row offsets in int64: index x stride passes 2**31 on long sequences
        q_ptrs = Qh + u64[None, :] * stride_qs + d[:, None] * stride_qd  # [BLOCK_D, BLOCK_U]
        if MASK_S:
            u_ok = u < S
            if EVEN_D:
                qt = tl.load(q_ptrs, mask=u_ok[None, :], other=0.0)
            else:
                qt = tl.load(q_ptrs, mask=u_ok[None, :] & (d[:, None] < D), other=0.0)
            lse = tl.load(Lh + u64 * stride_ls, mask=u_ok, other=0.0)
        else:
            if EVEN_D:
                qt = tl.load(q_ptrs)
            else:
                qt = tl.load(q_ptrs, mask=d[:, None] < D, other=0.0)
            lse = tl.load(Lh + u64 * stride_ls)
        if UPCAST:
            qt = qt.to(tl.float32)
        s = tl.dot(kt, qt, input_precision=DOT_PREC)  # [BLOCK_T, BLOCK_U], fp32
        x = s * qk_scale - lse.to(tl.float32)[None, :] * 1.4426950408889634  # log2 domain
        if MASK_T:
            keep = u[None, :] >= t[:, None] + window
            if MASK_S:
                keep = keep & (u < S)[None, :]
            x = tl.where(keep, x, float("-inf"))
        elif MASK_S:
            x = tl.where((u < S)[None, :], x, float("-inf"))
        return x

    @triton.jit
    def _accumulate(acc, run_max, kt, Qh, Lh, u0, t, S, window, stride_qs, stride_qd, stride_ls, d, D,
                    qk_scale, power, LABEL: tl.constexpr, MASK_T: tl.constexpr, MASK_S: tl.constexpr,
                    EVEN_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_U: tl.constexpr):
        """One block of queries into the per-key state: ``LABEL`` 0 (mean) ``acc += sum_u p``; 2 (max)
        ``run_max = max(run_max, max_u log2 p)``; 1 (power) also ``acc = sum_u 2^(a (log2 p - run_max))``,
        rescaled when ``run_max`` grows."""
        x = _log2_probs(kt, Qh, Lh, u0, t, S, window, stride_qs, stride_qd, stride_ls, d, D, qk_scale,
                        MASK_T, MASK_S, EVEN_D, UPCAST, DOT_PREC, BLOCK_U)
        if LABEL == 0:
            acc = acc + tl.sum(tl.exp2(x), axis=1)
        else:
            m_new = tl.maximum(run_max, tl.max(x, axis=1))
            if LABEL == 1:
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
                acc = acc * tl.exp2(power * (run_max - m_safe)) \
                    + tl.sum(tl.exp2(power * (x - m_safe[:, None])), axis=1)
            run_max = m_new
        return acc, run_max

    @triton.jit
    def _target_kernel(Q, K, L, OUT,
                       stride_qb, stride_qh, stride_qs, stride_qd,
                       stride_kb, stride_kh, stride_ks, stride_kd,
                       stride_lb, stride_lh, stride_ls,
                       S, HKV, BH, G, D, window, qk_scale, eps, power,
                       BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_D: tl.constexpr,
                       EVEN_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                       LABEL: tl.constexpr):
        # heaviest key blocks (t near 0, the longest run of queries) of every head first
        pid = tl.program_id(0)
        head = pid % BH
        t0 = (pid // BH) * BLOCK_T
        b = head // HKV
        h = head % HKV
        t = t0 + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        t_ok = t < S
        k_ptrs = (K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
                  + t[:, None].to(tl.int64) * stride_ks + d[None, :] * stride_kd)
        if EVEN_D:
            kt = tl.load(k_ptrs, mask=t_ok[:, None], other=0.0)
        else:
            kt = tl.load(k_ptrs, mask=t_ok[:, None] & (d[None, :] < D), other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)

        # query blocks: [u_lo, u_diag) straddle the u = t + w diagonal of this key block;
        # after it every u >= t + w, and only the last block can run past S.
        u_lo = t0 + window
        DIAG = (BLOCK_T - 1 + BLOCK_U - 1) // BLOCK_U  # constexpr
        u_diag = tl.minimum(u_lo + DIAG * BLOCK_U, S)
        n_full = tl.maximum(S - (u_lo + DIAG * BLOCK_U), 0) // BLOCK_U
        u_tail = u_lo + DIAG * BLOCK_U + n_full * BLOCK_U
        n_t = tl.maximum(S - t - window, 1).to(tl.float32)

        r = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
        for g in range(0, G):
            hq = h * G + g
            Qh = Q + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh
            Lh = L + b.to(tl.int64) * stride_lb + hq.to(tl.int64) * stride_lh
            acc = tl.zeros([BLOCK_T], dtype=tl.float32)
            run_max = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
            for u0 in range(u_lo, u_diag, BLOCK_U):
                acc, run_max = _accumulate(acc, run_max, kt, Qh, Lh, u0, t, S, window, stride_qs, stride_qd,
                                           stride_ls, d, D, qk_scale, power, LABEL, True, True, EVEN_D, UPCAST,
                                           DOT_PREC, BLOCK_U)
            for i in range(0, n_full):
                u0 = u_lo + DIAG * BLOCK_U + i * BLOCK_U
                acc, run_max = _accumulate(acc, run_max, kt, Qh, Lh, u0, t, S, window, stride_qs, stride_qd,
                                           stride_ls, d, D, qk_scale, power, LABEL, False, False, EVEN_D, UPCAST,
                                           DOT_PREC, BLOCK_U)
            if u_tail < S:
                acc, run_max = _accumulate(acc, run_max, kt, Qh, Lh, u_tail, t, S, window, stride_qs, stride_qd,
                                           stride_ls, d, D, qk_scale, power, LABEL, False, True, EVEN_D, UPCAST,
                                           DOT_PREC, BLOCK_U)
            if LABEL == 0:
                m = acc / n_t
            elif LABEL == 1:  # log2 m = M + (log2 Z - log2 N_t) / a
                # acc >= 1 wherever a query exists (its max term is 2^0); the floor only spares log2(0)
                m = tl.exp2(run_max + (tl.log2(tl.maximum(acc, 1e-30)) - tl.log2(n_t)) / power)
            else:
                m = tl.exp2(run_max)
            r = tl.maximum(r, tl.log(eps + m))
        tl.store(OUT + head.to(tl.int64) * S + t, r, mask=t_ok)

    def _gpu_configs() -> list:
        cfgs = []
        # bf16, D=128 on sm_90 (ptxas): (128, 64, 8, 2) 181 registers, 1 CTA/SM; (128, 64, 8, 1) and
        # (128, 32, 8, 2) ~120 registers, 2 CTAs/SM; none of these spills.  fp32 inputs (tf32x3) need
        # the small tiles (64, 32) to stay free of spills.
        for bt, bu, nw, ns in [(128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 2), (128, 128, 8, 2),
                               (128, 128, 8, 1), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2)]:
            cfgs.append(triton.Config({"BLOCK_T": bt, "BLOCK_U": bu}, num_warps=nw, num_stages=ns))
        return cfgs

    _target_kernel_tuned = triton.autotune(configs=_gpu_configs(),
                                           key=["S", "G", "BLOCK_D", "window", "EVEN_D", "LABEL"])(_target_kernel)

# block sizes under the interpreter (a single config: autotuning needs a GPU)
_INTERP_BLOCK_T, _INTERP_BLOCK_U = 32, 32


def _triton_target(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, window: int, eps: float,
                   scale: float, block_t: int | None = None, block_u: int | None = None,
                   label: str = "mean", power: float = 1.0) -> torch.Tensor:
    """Launch the Triton kernel.  ``block_t/block_u`` pin the tile sizes (tests); else tuned/fixed."""
    Bsz, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = empty((Bsz, Hkv, S), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    q, k, lse = q.detach(), k.detach(), lse.detach()
    dt = torch.promote_types(q.dtype, k.dtype)
    if dt == torch.float64:
        dt = torch.float32
    q, k = q.to(dt), k.to(dt)
    if lse.dtype != torch.float32:
        lse = lse.to(torch.float32)
    interp = q.device.type == "cpu" or interpreting()
    BLOCK_D = max(16, triton.next_power_of_2(D))
    even_d = BLOCK_D == D
    # bf16/fp16 tiles go to the tensor cores as they are on the GPU; the interpreter computes
    # bf16 arithmetic on raw bits, so it upcasts right after the loads.
    upcast = interp or dt == torch.float32
    dot_prec = "ieee" if interp else ("tf32x3" if dt == torch.float32 else "tf32")
    args = (q, k, lse, out, *q.stride(), *k.stride(), *lse.stride(), S, Hkv, Bsz * Hkv, G, D, window,
            scale * _LOG2E, eps, power)
    mode = _MODE[label]
    if interp or block_t is not None or block_u is not None:
        bt = block_t or (_INTERP_BLOCK_T if interp else 128)
        bu = block_u or (_INTERP_BLOCK_U if interp else 64)
        grid = (triton.cdiv(S, bt) * Bsz * Hkv,)
        _target_kernel[grid](*args, BLOCK_T=bt, BLOCK_U=bu, BLOCK_D=BLOCK_D, EVEN_D=even_d,
                             UPCAST=upcast, DOT_PREC=dot_prec, LABEL=mode)
    else:
        def grid(meta):
            return (triton.cdiv(S, meta["BLOCK_T"]) * Bsz * Hkv,)

        _target_kernel_tuned[grid](*args, BLOCK_D=BLOCK_D, EVEN_D=even_d, UPCAST=upcast,
                                   DOT_PREC=dot_prec, LABEL=mode)
    return out


# ----------------------------------------------------------------------------- public
def future_attention_target(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, window: int,
                            eps: float = 1e-6, scale: float | None = None, label: str = "mean",
                            power: float = 4.0) -> torch.Tensor:
    """Training target ``r_tgt [B, Hkv, S]`` float32 of KVpop: how much each key is attended later.

    ``r_tgt[b,h,t] = max_g log(eps + m[b,h,g,t])`` with, for ``p_u = exp(scale * q[b,h*G+g,u] . k[b,h,t]
    - lse[b,h*G+g,u])`` over the later queries ``u = t+w .. S-1`` and ``N_t = max(1, S - t - w)``:
    ``m = (1/N_t) sum_u p_u`` (``label="mean"``, default), ``m = max_u p_u`` (``"max"``) or
    ``m = ((1/N_t) sum_u p_u^a)^(1/a)`` with ``a = power`` (``"power"``, log domain).  Keys with no
    query ``u >= t + w`` get ``log(eps)`` under every label.

    Args:
        q: queries ``[B, Hq, S, D]`` (float16/bfloat16/float32/float64; RoPE already applied).
        k: keys ``[B, Hkv, S, D]``, ``Hq = G * Hkv``; query head ``h*G + g`` reads KV head ``h``.
        lse: ``[B, Hq, S]`` natural-log softmax normaliser of each query row, from the dense causal
            attention (exact target) or from ``sparse_attention`` (the paper's cheaper choice).
        window: ``w >= 1``; only queries at least ``w`` positions after the key count.
        eps: ``> 0``, added to the mean before the log.
        scale: logit scale, default ``D ** -0.5``.
        label: ``"mean"``, ``"max"`` or ``"power"`` (see above).
        power: the exponent ``a > 0`` of ``label="power"`` (default 4; validated for every label).

    Returns:
        float32 ``[B, Hkv, S]`` on the inputs' device; not differentiable (inputs are detached).
        Computation is in float32 (bf16/fp16 products on the tensor cores with fp32 accumulation
        on the GPU; float64 inputs are computed in float32).  No ``S x S`` matrix is formed.

    Raises:
        TypeError: a non-tensor input or a non-numeric ``eps``/``window``.
        ValueError: shapes that do not match, ``Hq`` not a multiple of ``Hkv``, non-float dtypes,
            ``window < 1``, ``eps <= 0``, tensors on different devices, a ``label`` not in
            ``LABELS``, ``power`` not a finite float > 0.
    """
    _, eps, scale = _check(q, k, lse, window, eps, scale)
    label, power = check_label(label, power)
    # an equivalent, int32-safe window: w >= S leaves every key without a query u >= t + w
    window = min(window, max(q.shape[2], 1))
    if use_triton(q, k, lse):
        return _triton_target(q, k, lse, window, eps, scale, label=label, power=power)
    return _cpu_target(q, k, lse, window, eps, scale, label=label, power=power)
