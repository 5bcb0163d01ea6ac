"""sparse_attention: forward and forward+backward, kvpop vs dense causal SDPA vs FlexAttention vs reference.

GPU (Qwen3-8B heads: 32 query / 8 KV heads, head_dim 128, bf16): S in {4096, 16384}, budget B in
{2048, 4096}, ``evict_at = eviction_schedule`` of random priorities with s=4, w=256, k=B-260.
FlexAttention is compiled with the same mask (its block mask is built once, outside the timing;
its build time lands in ``extra_info``); the dense reference runs at S=4096 only.
CPU: one small shape through the PyTorch path (the Triton interpreter is not timed).

Targets (S=16384, B=2048): fwd+bwd <= 0.5x dense causal SDPA and >= 2x faster than
FlexAttention, timed side by side by ``test_sparse_attention_target`` (its ratios in ``extra_info``).
``extra_info``: TFLOP/s on the visible pairs of the mask (4*D flops per pair forward, 14*D
forward+backward: the backward counted as 2.5 forwards), the provider's own pair count and TFLOP/s on
it (dense causal pairs for SDPA), peak CUDA memory of one call.
"""
import importlib
import time

import pytest
import torch
import torch.nn.functional as F

import kvpop_kernels._utils as kutils
from kvpop_kernels import NEVER, eviction_schedule, reference, sparse_attention

from .tools import roofline as rl
from .tools.flex_mask import eviction_block_mask
from .tools.timing import best_time, device_name, sync, timed

CUDA = torch.cuda.is_available()
SINKS, WINDOW = 4, 256
if CUDA:
    SHAPES = [(S, B) for S in (4096, 16384) for B in (2048, 4096)]
    TARGET_SHAPE = (16384, 2048)
    BATCH, HQ, HKV, D, DTYPE, DEV = 1, 32, 8, 128, torch.bfloat16, "cuda"
    REFERENCE_MAX_S = 4096
else:
    SHAPES = [(1024, 320)]
    TARGET_SHAPE = SHAPES[0]
    BATCH, HQ, HKV, D, DTYPE, DEV = 1, 4, 2, 64, torch.float32, "cpu"
    REFERENCE_MAX_S = 1024
    WINDOW = 64
PROVIDERS = ["kvpop", "sdpa", "flex", "reference"]


def visible_pairs(ev: torch.Tensor, sinks: int, window: int) -> int:
    """Exact count of visible (query, key) pairs per KV head, summed: key t is seen by queries [t, e_t)."""
    S = ev.shape[-1]
    t = torch.arange(S, device=ev.device)
    e = torch.maximum(t + window, ev.to(torch.int64)).clamp(max=S)
    e = torch.where(t < sinks, torch.full_like(e, S), e)
    return int((e - t).sum())


def _setup(S, budget, provider, mode):
    k_slots = budget - SINKS - WINDOW
    gen = torch.Generator(device="cpu").manual_seed(0)
    prio = torch.randn(BATCH, HKV, S, generator=gen).to(DEV)
    ev = eviction_schedule(prio, sinks=SINKS, window=WINDOW, k=k_slots)
    q = torch.randn(BATCH, HQ, S, D, generator=gen).to(DEV, DTYPE)
    k = torch.randn(BATCH, HKV, S, D, generator=gen).to(DEV, DTYPE)
    v = torch.randn(BATCH, HKV, S, D, generator=gen).to(DEV, DTYPE)
    G = HQ // HKV
    extra = {}
    if provider == "kvpop":
        call = lambda q, k, v: sparse_attention(q, k, v, ev, sinks=SINKS, window=WINDOW)[0]  # noqa: E731
    elif provider == "reference":
        call = lambda q, k, v: reference.sparse_attention(q, k, v, ev, sinks=SINKS, window=WINDOW)[0]  # noqa: E731
    elif provider == "sdpa":
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # dense GQA, outside the timing
        call = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:  # flex, compiled, same mask
        fa = importlib.import_module("torch.nn.attention.flex_attention")

        def mask_mod(b, h, q_idx, kv_idx):
            e = ev[b, h // G, kv_idx]
            return (kv_idx <= q_idx) & ((kv_idx < SINKS) | (kv_idx > q_idx - WINDOW) | (q_idx < e))

        t0 = time.perf_counter()
        # from the schedule's per-block extrema (tools/flex_mask.py): create_block_mask's pass over every pair
        # took 184 s at S = 16K on the first GPU run; the same blocks (checked at S = 4096: 784 partial, 272 full)
        block_mask = eviction_block_mask(ev, mask_mod, sinks=SINKS, window=WINDOW, hq=HQ)
        sync()
        extra["block_mask_build_s"] = time.perf_counter() - t0
        flex = torch.compile(fa.flex_attention)
        call = lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True)  # noqa: E731
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return call(q, k, v)
    else:
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        grad = torch.randn(BATCH, HQ, S, D, generator=gen).to(DEV, DTYPE)

        def fn():
            q.grad = k.grad = v.grad = None
            out = call(q, k, v)
            out.backward(grad)
            return out
    return fn, ev, extra


@pytest.fixture(autouse=True)
def _cpu_takes_the_pytorch_path(monkeypatch):
    if not CUDA:  # even when tests/conftest.py switched the interpreter on in this process
        monkeypatch.setattr(kutils, "interpreting", lambda: False)


@pytest.mark.benchmark(group="sparse_attention")  # refined per mode and shape below
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("S, budget", SHAPES, ids=[f"S{S}-B{B}" for S, B in SHAPES])
def test_sparse_attention(benchmark, S, budget, provider, mode):
    benchmark.group = f"sparse_attention-{mode}-S{S}-B{budget}"
    if provider == "flex" and not CUDA:
        pytest.skip("FlexAttention is timed compiled, on the GPU only")
    if provider == "reference" and S > REFERENCE_MAX_S:
        pytest.skip(f"the dense reference forms S x S matrices: S <= {REFERENCE_MAX_S} only")
    fn, ev, extra = _setup(S, budget, provider, mode)
    for _ in range(3 if CUDA else 1):  # compile, autotune, caches: never inside a timing
        fn()
    sync()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        sync()
        extra["peak_mem_bytes"] = torch.cuda.max_memory_allocated() - base
    benchmark(timed(fn))
    pairs = visible_pairs(ev, SINKS, WINDOW) * (HQ // HKV)  # per query head, all heads and batch
    dense_pairs = BATCH * HQ * S * (S + 1) // 2
    own = dense_pairs if provider == "sdpa" else pairs
    per_pair = 4 * D if mode == "fwd" else 14 * D
    extra.update(S=S, budget=budget, heads=f"{HQ}/{HKV}", head_dim=D, dtype=str(DTYPE), provider=provider,
                 mode=mode, visible_pairs=pairs, dense_causal_pairs=dense_pairs,
                 visible_over_dense=pairs / dense_pairs, never=int((ev == NEVER).sum()))
    if benchmark.stats:
        t = benchmark.stats.stats.min
        extra.update(tflops_visible=per_pair * pairs / t / 1e12, tflops_own=per_pair * own / t / 1e12)
        elt = torch.empty((), dtype=DTYPE).element_size()
        hkv = HQ if provider == "sdpa" else HKV  # (dense SDPA reads keys and values repeated to every query head)
        rl.record(extra, provider, *rl.causal_attention_cost(batch=BATCH, hq=HQ, hkv=hkv, s=S, d=D, elt=elt,
                                                             backward=mode == "fwd_bwd", pairs=own), t,
                  device_name(), main=True)
    benchmark.extra_info.update(extra)


def _best_s(fn) -> float:
    if CUDA:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-3
    return best_time(fn, reps=3, warmup=0)


@pytest.mark.benchmark(group="sparse_attention-target")
def test_sparse_attention_target(benchmark):
    """Forward+backward at the target shape (S=16384, B=2048 on CUDA), kvpop, dense causal SDPA and
    (CUDA only) compiled FlexAttention with the same mask, timed one after the other in this test.
    ``extra_info``: ``ratio_kvpop_over_sdpa`` (target <= 0.5) and ``speedup_over_flex`` (target >= 2)."""
    S, budget = TARGET_SHAPE
    providers = ["kvpop", "sdpa"] + (["flex"] if CUDA else [])
    times, info = {}, {"S": S, "budget": budget, "heads": f"{HQ}/{HKV}", "head_dim": D, "dtype": str(DTYPE)}
    for p in providers:
        fn, ev, extra = _setup(S, budget, p, "fwd_bwd")
        for _ in range(3 if CUDA else 1):  # compile, autotune, caches: never inside a timing
            fn()
        sync()
        times[p] = _best_s(fn)
        info.update({f"{p}_{k}": v for k, v in extra.items()})
        if p == "kvpop":
            kv_fn = fn
        del fn  # the other providers' tensors go before the next one is built
    info.update(kvpop_s=times["kvpop"], sdpa_s=times["sdpa"], ratio_kvpop_over_sdpa=times["kvpop"] / times["sdpa"])
    if "flex" in times:
        info.update(flex_s=times["flex"], speedup_over_flex=times["flex"] / times["kvpop"])
    # rooflines: forward + backward over the mask's visible pairs (kvpop, flex), dense causal pairs (sdpa)
    pairs = visible_pairs(ev, SINKS, WINDOW) * (HQ // HKV)
    elt = torch.empty((), dtype=DTYPE).element_size()
    for p in providers:
        rl.record(info, p, *rl.causal_attention_cost(batch=BATCH, hq=HQ, hkv=HKV, s=S, d=D, elt=elt, backward=True,
                                                     pairs=None if p == "sdpa" else pairs), times[p], device_name(),
                  main=p == "kvpop")
    benchmark.extra_info.update(info)
    benchmark.pedantic(timed(kv_fn), rounds=1, iterations=1, warmup_rounds=0)


@pytest.mark.benchmark(group="sparse_attention-work")
@pytest.mark.parametrize("S, budget", [(4096, 2048), (16384, 2048), (16384, 4096)])
def test_visited_work(benchmark, S, budget):
    """Tile work the kernels' plans visit, as a multiple of the visible pairs and of dense causal work.

    Counted (not timed) on ``eviction_schedule`` of random priorities, [1, 8, S], s=4, w=256, k=B-260,
    with the GPU tile shapes (forward/dq: 128 rows = 4 query heads x 32 queries sharing one list,
    64-key tiles; dk/dv: 64-key tiles
    of keys sorted by the end of their query interval in chunks of 1024).  ``block_skip`` is what
    skipping 64-key blocks by their largest ``evict_at`` alone would visit.  The timed part is
    building the dk/dv tile plan on this device.
    """
    sa = importlib.import_module("kvpop_kernels.sparse_attention")
    s, w, BQ, BN = 4, 256, 32, 64
    prio = torch.randn(1, 8, S)
    ev = eviction_schedule(prio, sinks=s, window=w, k=budget - s - w).to(DEV)
    pairs = visible_pairs(ev, s, w)
    dense = 8 * S * (S + 1) // 2
    # forward / dq: per block of BQ queries, the gathered list (rounded up to tiles) + the band [lo, q0 + BQ)
    q0 = torch.arange(0, S, BQ, device=DEV)
    lo = (q0 - w + 1).clamp(min=0)
    t = torch.arange(S, device=DEV)
    live = (t.view(1, -1) < lo.view(-1, 1)) & ((t < s).view(1, -1) | (ev.view(8, 1, S) > q0.view(1, -1, 1)))
    n_list = live.sum(-1)  # [8, n_qb]
    n_band = (q0 + BQ).clamp(max=S) - lo
    fwd = int((((n_list + BN - 1) // BN + (n_band + BN - 1) // BN) * BN * BQ).sum())
    # dk/dv: the permuted key tiles' query ranges
    plan = lambda: sa._key_tiles(ev, s, w, BN)  # noqa: E731
    perm, qlo, qhi, jobs, n_tiles, S_pad = plan()
    dkdv = int(((qhi - qlo).to(torch.int64) * BN).sum())
    # plain block skipping: 64-key block [t0, t1) iterates queries [t0, max e_t)
    e = torch.maximum(t + w, ev.to(torch.int64)).clamp(max=S)
    e = torch.where(t < s, torch.full_like(e, S), e)
    pad = (-S) % BN
    eb = F.pad(e, (0, pad)).view(8, -1, BN).amax(-1)
    block = int(((eb - torch.arange(0, S + pad, BN, device=DEV)).clamp(min=0) * BN).sum())
    benchmark.extra_info.update(
        S=S, budget=budget, visible_over_dense=pairs / dense,
        fwd_work_over_visible=fwd / pairs, fwd_work_over_dense=fwd / dense,
        dkdv_work_over_visible=dkdv / pairs, dkdv_work_over_dense=dkdv / dense,
        block_skip_work_over_dense=block / dense)
    benchmark(timed(plan))
