"""DMS beside KVpop while decoding, at the same MEAN number of cache entries per KV head.

KVpop holds exactly ``B`` entries in every head; DMS (``kvpop.baselines.dms``) holds what each head's gates
kept, so at the same mean ``B`` its heads differ.  The method's claim: DMS lets a few heads keep most of
the budget, and ragged caches are slow to execute.

Groups ``decode-dms-step-B*``: ONE layer's batch-1 decode step, at context ``CTX``:

* ``kvpop``: ``kvpop_kernels.fixed_budget_decode`` over ``B`` slots per head;
* ``dms-uniform``: the ``DMSCache`` decode step (the code ``generate`` runs: one step over all heads
  of the paged store, no host read) with every head at ``B`` entries (the ragged code without raggedness);
* ``dms-measured``: the same step with per-head lengths in the proportions a trained DMS produced
  (``DMS_PROFILE``, mean 1, scaled to mean ``B``);
* ``dms-padded``: the alternative way to run a ragged cache: one batched attention over every head
  padded to the longest head, with a length mask (faster to launch, but its memory is the padded
  maximum, which ``DMSCache`` avoids).

``extra_info``: the per-head entries, their spread (``entries_min/max/std``), the bytes held, and on
CUDA a CUDA-event timing.  Group ``decode-dms-generate-ctx*``: whole-model batch-1 generation (a tiny
Qwen3 on the CPU, a 2-layer Qwen3-8B-shaped model with random weights on CUDA): a ``ctx``-token prompt,
then ``GEN_TOKENS`` greedy tokens, through ``KVpopCache`` at budget ``GEN_BUDGET`` and through
``DMSCache`` with random gates whose threshold is calibrated (``kvpop.baselines.dms.budget.calibrate_threshold``) so
that the mean entries per head after the prompt is ``GEN_BUDGET``; ``extra_info`` has decode tokens/s
and the per-head entries DMS produced.

Run: ``pytest benchmarks/test_decode_dms.py --benchmark-only`` (``--benchmark-disable`` in CI).  No
GPU figures have been measured for this file yet.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import kvpop_kernels._utils as kutils
from kvpop.baselines import dms as D
from kvpop.baselines.dms.cache import _decode
from kvpop.models import cache_kwarg_name
from kvpop_kernels import SlotState, fixed_budget_decode

from .tools.timing import best_time

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

if CUDA:
    HQ, HKV, HD, DTYPE = 32, 8, 128, torch.bfloat16
    SINKS, WINDOW, CTX = 4, 256, 131072
    BUDGETS = [2048, 4096]
else:
    HQ, HKV, HD, DTYPE = 8, 4, 64, torch.float32
    SINKS, WINDOW, CTX = 4, 64, 32768
    BUDGETS = [256, 1024]

DMS_PROFILE = [0.216, 0.220, 1.227, 2.337]
"""Entries per (layer, KV head) over their mean, sorted, measured on the demo's tiny model (2 layers x 2
KV heads) after a 100-step DMS retrofit (``kvpop train --method dms --task --seq-len 1024 --window 32
--steps 100 --schedule-steps 60 --target-keep 0.1 --lr-model 1e-4 --lr-scorer 0.05``), on a 4096-token
test sequence at mean budget 256: heads held 55, 56, 313 and 596 entries.  Tiled over ``HKV`` heads."""
PROVIDERS = ["kvpop", "dms-uniform", "dms-measured", "dms-padded"]


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def head_lengths(budget: int, provider: str) -> list[int]:
    """Entries per KV head, mean ``budget`` (at least ``s + w`` each)."""
    if provider in ("kvpop", "dms-uniform"):
        return [budget] * HKV
    prof = [DMS_PROFILE[i % len(DMS_PROFILE)] for i in range(HKV)]
    scale = budget / (sum(prof) / len(prof))
    return [max(SINKS + WINDOW, round(p * scale)) for p in prof]


def _dms_layer(lengths: list[int], gen: torch.Generator) -> D.DMSCacheLayer:
    """A DMSCacheLayer at position CTX: sinks and a full ring, head h holding ``lengths[h] - s - w``
    long-range tokens; every ring token is marked for eviction, so the lengths stay put while timing."""
    layer = D.DMSCacheLayer(sinks=SINKS, window=WINDOW, threshold=0.0)
    kv = torch.randn(1, HKV, 1, HD, generator=gen).to(DEVICE, DTYPE)
    layer.lazy_initialization(kv, kv)
    layer.fixed_k.copy_(torch.randn(layer.fixed_k.shape, generator=gen))
    layer.fixed_v.copy_(torch.randn(layer.fixed_v.shape, generator=gen))
    layer.ring_evict.fill_(True)
    m = max(lengths) - SINKS - WINDOW
    keep = torch.arange(m).view(1, m) < torch.tensor([n - SINKS - WINDOW for n in lengths]).view(HKV, 1)
    k = torch.randn(HKV, m, HD, generator=gen).to(DEVICE, DTYPE)
    v = torch.randn(HKV, m, HD, generator=gen).to(DEVICE, DTYPE)
    layer.extend(keep.to(DEVICE), k, v, torch.arange(SINKS, SINKS + m, device=DEVICE))
    layer.seen = CTX
    return layer


def _kvpop_step(budget: int, q, kn, vn, gen):
    s, w, k = SINKS, WINDOW, budget - SINKS - WINDOW
    kc = torch.randn(HKV, budget, HD, generator=gen).to(DEVICE, DTYPE)
    vc = torch.randn(HKV, budget, HD, generator=gen).to(DEVICE, DTYPE)
    slot_pos = torch.empty(HKV, budget, dtype=torch.int32)
    slot_pos[:, :s] = torch.arange(s, dtype=torch.int32)
    ring = torch.arange(CTX - w, CTX)
    slot_pos[:, s + (ring - s) % w] = ring.to(torch.int32)
    for h in range(HKV):
        slot_pos[h, s + w:] = (torch.randperm(CTX - w - s, generator=gen)[:k] + s).to(torch.int32)
    state = [kc, vc, slot_pos.to(DEVICE), torch.randn(HKV, k, generator=gen).to(DEVICE)]
    lp = torch.randn(HKV, generator=gen).to(DEVICE)
    cur = {"pos": CTX}

    def step():
        cur["pos"] += 1
        return fixed_budget_decode(q, kn, vn, SlotState(*state), lp, pos=cur["pos"], sinks=s, window=w)

    return step, 2 * HKV * budget * HD * kc.element_size()


def _dms_step(lengths: list[int], q, kn, vn, gen):
    layer = _dms_layer(lengths, gen)
    evict = torch.ones(HKV, dtype=torch.bool, device=DEVICE)
    scale = HD ** -0.5

    def step():
        return _decode(layer, q, kn, vn, evict, scale)

    return step, layer


def _padded_step(lengths: list[int], q, gen):
    """All heads padded to the longest: one SDPA over [Hkv, max_len] with a key-length mask."""
    n = max(lengths)
    kc = torch.randn(1, HKV, n, HD, generator=gen).to(DEVICE, DTYPE)
    vc = torch.randn(1, HKV, n, HD, generator=gen).to(DEVICE, DTYPE)
    mask = (torch.arange(n).view(1, n) < torch.tensor(lengths).view(HKV, 1)).to(DEVICE)
    mask = mask.repeat_interleave(HQ // HKV, 0).view(1, HQ, 1, n)
    q4 = q.view(1, HQ, 1, HD)

    def step():
        return F.scaled_dot_product_attention(q4, kc, vc, attn_mask=mask, enable_gqa=True)

    return step, 2 * HKV * n * HD * kc.element_size()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_decode_dms_step(benchmark, monkeypatch, provider, budget):
    benchmark.group = f"decode-dms-step-B{budget}"
    if not CUDA:  # the PyTorch path, never the interpreter
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(HQ, HD, generator=gen).to(DEVICE, DTYPE)
    kn = torch.randn(HKV, HD, generator=gen).to(DEVICE, DTYPE)
    vn = torch.randn(HKV, HD, generator=gen).to(DEVICE, DTYPE)
    lengths = head_lengths(budget, provider)
    if provider == "kvpop":
        step, held = _kvpop_step(budget, q, kn, vn, gen)
    elif provider == "dms-padded":
        step, held = _padded_step(lengths, q, gen)
    else:
        step, layer = _dms_step(lengths, q, kn, vn, gen)
        held = layer.nbytes()

    def run():
        out = step()
        _sync()
        return out

    for _ in range(5):
        run()
    if provider.startswith("dms") and provider != "dms-padded":
        assert layer.head_entries() == [min(layer.seen, SINKS + WINDOW) + n for n in layer.kept_len.tolist()]
        assert sum(layer.head_entries()) == sum(lengths)  # every ring token was marked: nothing appended
    t = torch.tensor(lengths, dtype=torch.float32)
    info = {"provider": provider, "context": CTX, "mean_budget": budget, "Hq": HQ, "Hkv": HKV, "head_dim": HD,
            "dtype": str(DTYPE), "entries_per_head": lengths, "entries_min": int(t.min()),
            "entries_max": int(t.max()), "entries_std": float(t.std()), "bytes_held": held}
    if CUDA:
        import triton.testing

        info["eager_ms"] = triton.testing.do_bench(step, warmup=25, rep=200)
    benchmark(run)
    benchmark.extra_info.update(info)


@pytest.mark.benchmark(group="decode-dms-step-ratio")
@pytest.mark.parametrize("budget", BUDGETS)
def test_decode_dms_step_ratio(benchmark, monkeypatch, budget):
    """The measured-spread DMS step over KVpop's step at the same mean budget, timed side by side
    (the method reports KVpop decoding 131K tokens in about 40% of DMS's time: ratio ~2.5)."""
    if not CUDA:
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(HQ, HD, generator=gen).to(DEVICE, DTYPE)
    kn = torch.randn(HKV, HD, generator=gen).to(DEVICE, DTYPE)
    vn = torch.randn(HKV, HD, generator=gen).to(DEVICE, DTYPE)
    kv_step, _ = _kvpop_step(budget, q, kn, vn, gen)
    dms_step, _ = _dms_step(head_lengths(budget, "dms-measured"), q, kn, vn, gen)
    uni_step, _ = _dms_step(head_lengths(budget, "dms-uniform"), q, kn, vn, gen)
    reps = 30 if not CUDA else 200
    t_kv = best_time(kv_step, reps=reps, warmup=3)
    t_dms = best_time(dms_step, reps=reps, warmup=3)
    t_uni = best_time(uni_step, reps=reps, warmup=3)
    benchmark.extra_info.update(mean_budget=budget, context=CTX, kvpop_s=t_kv, dms_measured_s=t_dms,
                                dms_uniform_s=t_uni, dms_over_kvpop=t_dms / t_kv,
                                dms_measured_over_uniform=t_dms / t_uni)
    benchmark.pedantic(dms_step, rounds=1, iterations=1, warmup_rounds=0)


# ----------------------------------------------------------------------------- whole-model generation
if CUDA:
    GEN_CFG = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=151936)
    GEN_CONTEXTS, GEN_BUDGET, GEN_WINDOW, GEN_TOKENS = [8 * 1024, 32 * 1024], 2048, 256, 32
else:
    GEN_CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=256)
    GEN_CONTEXTS, GEN_BUDGET, GEN_WINDOW, GEN_TOKENS = [1024], 128, 32, 16


def _gen_model(method: str, prompt: torch.Tensor):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvpop
    from kvpop.baselines.dms.budget import calibrate_threshold

    torch.manual_seed(0)
    cfg = Qwen3Config(max_position_embeddings=max(GEN_CONTEXTS) + 2 * GEN_TOKENS, **GEN_CFG)
    cfg._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg).to(DTYPE).eval()
    if method == "kvpop":
        return kvpop.patch(model, sinks=SINKS, window=GEN_WINDOW, budget=GEN_BUDGET)
    D.patch_dms(model, sinks=SINKS, window=GEN_WINDOW)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for la in D.dms_layers(model):
            la.gate.weight.copy_(torch.randn(la.gate.weight.shape, generator=g).to(la.gate.weight.device))
        thr = calibrate_threshold(model, prompt, GEN_BUDGET)
    return D.patch_dms(model, threshold=thr)


@pytest.mark.parametrize("method", ["kvpop", "dms"])
@pytest.mark.parametrize("ctx", GEN_CONTEXTS)
def test_decode_dms_generate(benchmark, monkeypatch, method, ctx):
    if not CUDA:
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    benchmark.group = f"decode-dms-generate-ctx{ctx}"
    prompt = torch.randint(0, GEN_CFG["vocab_size"], (1, ctx), device=DEVICE)
    model = _gen_model(method, prompt)
    caches = []

    def run():
        cache = D.DMSCache(model) if method == "dms" else None
        kw = {} if cache is None else {cache_kwarg_name(): cache}
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False, **kw)
        _sync()
        caches.append(cache)
        return out

    run()  # warm-up
    with torch.no_grad():
        t_prefill = best_time(lambda: model(prompt, use_cache=True), reps=1, warmup=0)
    t0 = time.perf_counter()
    out = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    total = time.perf_counter() - t0
    assert out.shape == (1, ctx + GEN_TOKENS)
    info = dict(method=method, ctx=ctx, new_tokens=GEN_TOKENS, mean_budget=GEN_BUDGET, total_s=total,
                prefill_s=t_prefill, decode_tokens_per_s=GEN_TOKENS / max(total - t_prefill, 1e-9))
    if method == "dms":
        ent = caches[-1].head_entries()
        info.update(entries_per_head=ent.tolist(), entries_mean=float(ent.float().mean()),
                    entries_min=int(ent.min()), entries_max=int(ent.max()), cache_bytes=caches[-1].nbytes(),
                    threshold=D.get_dms_config(model).threshold)
    benchmark.extra_info.update(info)
