"""End to end: what a user of kvpop reads first on a GPU (issue 60).

``test_e2e_decode[batch]``: HF ``generate`` of a Qwen3-8B-shaped model with random weights (``Qwen3Config`` of the
published shape: hidden 4096, 36 layers, 32 / 8 heads, head_dim 128, intermediate 12288, vocab 151936, bf16) at
batch 1 and 32, ``kvpop.patch`` + ``KVpopCache`` (B = 2048: 4 sinks, window 256) against the unpatched model with
transformers' dense ``DynamicCache`` and SDPA, at 8K, 32K and 131K tokens of context.

* **Fewer layers where the memory asks**: each (batch, context) case runs the largest layer count (at most 36) whose
  bf16 weights and *dense* cache (plus one layer's copy: ``DynamicCache`` concatenates) fit in
  ``MEMORY_FRACTION`` of the device; kvpop runs the same layers.  The count is recorded (``layers_ctx*``) and the
  memory figure is per layer.  On an 80 GB H100 that is 36 layers at batch 1, and 36 / 11 / 2 at batch 32.
* **The context is filled synthetically**, not prefilled: the dense cache gets random keys and values for every
  position, kvpop's cache a full state at that position (random keys and values in every slot; sinks, the last
  ``window`` tokens in the ring, distinct older positions with random priorities in the long-range slots), as
  ``benchmarks/test_decode.py`` builds one layer's.  ``generate`` is then given ``context + 1`` token ids and the
  filled cache: it runs the last token and decodes ``NEW_TOKENS`` greedily; that is what is timed (tokens/s of
  all rows, wall clock, ``generate``'s own overheads included).
* Memory: the peak allocated during ``generate`` minus the weights (CUDA; on the CPU the cache's bytes, no
  allocator statistics there), per layer in the comparison.  Flat memory is read at one depth: kvpop alone with
  every layer (its cache fits at any context) is also run at the contexts where the comparison had fewer layers,
  and its figure at the longest context / the shortest is the target (the prompt's token ids, which ``generate``
  holds, are in both).

``extra_info``: per context ``{kvpop,dense}_tokens_per_s_ctx*``, ``{kvpop,dense}_mem_per_layer_gb_ctx*``,
``layers_ctx*``, ``kvpop_over_dense_ctx*``, ``kvpop_mem_gb_all_layers_ctx*``; the targets'
``kvpop_over_dense_ctx32k`` (goal >= 3 at batch 32) and ``kvpop_mem_longest_over_shortest`` (<= 1.1); a roofline
per case (``benchmarks/tools/roofline.py``).

``test_train_step_16k``: one retrofit training step at S = 16384 of a Qwen3-8B-shaped model with ``TRAIN_LAYERS``
layers (36 layers of float32 master weights, their gradients and a bf16 teacher do not fit in 80 GB), KVpop's step
(the frozen teacher's forward, the patched student's forward with sparse attention and its scorers, the fused KL,
the backward: ``benchmarks/test_train_step.py``'s ``_kvpop_step``) against the dense fine-tune's (plain causal SDPA
and cross-entropy, one backward), best of ``TRAIN_STEPS`` after a warm-up: ``train_time_kvpop_over_dense``
(goal <= 1.3) and both peak memories.

Inside ``benchmarks/gpu_check.sh`` a case whose estimated time would pass the check's cap is not started (its
figures absent, the reason in ``extra_info['not_run']``; the whole test skipped when nothing ran).  Without CUDA the
same code runs tiny shapes in seconds (CI: ``pytest benchmarks/ --benchmark-disable``).

Run: ``pytest benchmarks/test_e2e.py --benchmark-only -s`` (a GPU).
"""
from __future__ import annotations

import functools
import os
import time

import pytest
import torch

from .tools import roofline as rl

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DEADLINE_ENV = "KVPOP_BENCH_DEADLINE"  # unix time at which benchmarks/tools/gpu_check.py stops this stage

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936)
if CUDA:
    MODEL, DTYPE = QWEN3_8B, torch.bfloat16
    CONTEXTS, BATCHES, NEW_TOKENS = [8192, 32768, 131072], [1, 32], 16
    SINKS, WINDOW, BUDGET = 4, 256, 2048
    MEMORY_FRACTION, HEADROOM_BYTES = 0.75, 4 * 2**30
    TRAIN_S, TRAIN_LAYERS, TRAIN_STEPS, TRAIN_KV = 16384, 4, 2, dict(sinks=4, window=256, budget=2048)
    EST_BUILD_S, EST_CASE_S, EST_TRAIN_S = 20.0, 25.0, 150.0  # generous: a case not started costs nothing
else:
    MODEL, DTYPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=256), torch.float32
    CONTEXTS, BATCHES, NEW_TOKENS = [128, 512, 2048], [1, 32], 4
    SINKS, WINDOW, BUDGET = 4, 16, 64
    # a pretend device of 40 MiB: the longest context at batch 32 gets fewer layers, as 131K does on a GPU
    MEMORY_FRACTION, HEADROOM_BYTES = 1.0, 0
    TRAIN_S, TRAIN_LAYERS, TRAIN_STEPS, TRAIN_KV = 96, 2, 1, dict(sinks=2, window=16, budget=64)
    EST_BUILD_S, EST_CASE_S, EST_TRAIN_S = 1.0, 2.0, 10.0
CPU_PRETEND_MEMORY = 40 * 2**20
TARGET_CTX = CONTEXTS[1]  # the targets' context (32K on a GPU)
LABELS = {8192: "8k", 32768: "32k", 131072: "131k"}


def _lab(ctx: int) -> str:
    return LABELS.get(ctx, str(ctx))


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _device_name() -> str:
    return torch.cuda.get_device_name() if CUDA else "cpu"


def _device_memory() -> int:
    return torch.cuda.get_device_properties(0).total_memory if CUDA else CPU_PRETEND_MEMORY


def time_left() -> float | None:
    """Seconds until the GPU check stops this stage (``KVPOP_BENCH_DEADLINE``), None outside it."""
    raw = os.environ.get(DEADLINE_ENV)
    if not raw:
        return None
    try:
        return float(raw) - time.time()
    except ValueError:
        raise ValueError(f"{DEADLINE_ENV} must be a unix time in seconds, got {raw!r}") from None


def fits_in_time(need_s: float) -> str | None:
    """None when ``need_s`` seconds fit before the check's cap, else the reason a case is not started."""
    left = time_left()
    if left is None or left >= need_s:
        return None
    return f"time cap: needs ~{need_s:.0f} s, {max(left, 0):.0f} s left before the GPU check stops the benchmarks"


def layers_for(batch: int, ctx: int, memory_bytes: int, cfg: dict = MODEL, elt: int | None = None) -> int:
    """The most layers (at most the model's) whose weights and dense cache of ``batch x ctx`` tokens (with one more
    layer's worth: ``DynamicCache`` concatenates a layer's keys and values to a new tensor at each step) fit in
    ``MEMORY_FRACTION`` of ``memory_bytes`` less ``HEADROOM_BYTES``; 0 when not even one does."""
    elt = torch.empty((), dtype=DTYPE).element_size() if elt is None else elt
    shape = rl.ModelShape.of(cfg)
    fixed = (shape.params - shape.layers * shape.layer_matmul_params) * elt  # embeddings, LM head, norms
    cache_layer = 2 * batch * shape.kv_heads * ctx * shape.head_dim * elt
    room = MEMORY_FRACTION * memory_bytes - HEADROOM_BYTES - fixed - cache_layer
    per_layer = shape.layer_matmul_params * elt + cache_layer
    return max(0, min(shape.layers, int(room // per_layer)))


_MODEL: dict[int, torch.nn.Module] = {}


def build_model(layers: int):
    """The Qwen3 of ``MODEL``'s shape with ``layers`` layers and random weights, in ``DTYPE`` on ``DEVICE``,
    unpatched (the one model of that layer count kept; a new count frees the old first)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if layers not in _MODEL:
        _MODEL.clear()
        if CUDA:
            torch.cuda.empty_cache()
        torch.manual_seed(0)
        cfg = Qwen3Config(**dict(MODEL, num_hidden_layers=layers), max_position_embeddings=max(CONTEXTS) + 64)
        cfg._attn_implementation = "sdpa"
        default = torch.get_default_dtype()
        torch.set_default_dtype(DTYPE)  # built in bf16 directly: no float32 copy of 8B weights on the way
        try:
            with torch.device(DEVICE):
                _MODEL[layers] = Qwen3ForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(default)
    return _MODEL[layers]


def fill_dense(model, batch: int, ctx: int):
    """A ``DynamicCache`` holding ``ctx`` random keys and values per layer."""
    from transformers import DynamicCache

    c = model.config
    cache = DynamicCache(config=c)
    for i in range(c.num_hidden_layers):
        shape = (batch, c.num_key_value_heads, ctx, c.head_dim)
        cache.update(torch.randn(shape, device=DEVICE, dtype=DTYPE), torch.randn(shape, device=DEVICE, dtype=DTYPE), i)
    return cache


def fill_kvpop(model, batch: int, ctx: int):
    """A ``KVpopCache`` of the patched ``model`` holding a full state at position ``ctx`` in every layer and row."""
    import kvpop

    c = model.config
    cache = kvpop.KVpopCache(model)
    hkv, d = c.num_key_value_heads, c.head_dim
    for layer in cache.layers:
        s, w, k = layer.sinks, layer.window, layer.k
        if ctx < s + w + k:
            raise ValueError(f"fill_kvpop: a context of {ctx} tokens does not fill a budget of {layer.budget}")
        dummy = torch.empty(batch, hkv, 1, d, device=DEVICE, dtype=DTYPE)
        layer.lazy_initialization(dummy, dummy)
        st = layer.slots
        st.k_cache.normal_()
        st.v_cache.normal_()
        pos = st.slot_pos.view(batch * hkv, -1)
        pos[:, :s] = torch.arange(s, dtype=torch.int32, device=DEVICE)
        ring = torch.arange(ctx - w, ctx, device=DEVICE)
        pos[:, s + (ring - s) % w] = ring.to(torch.int32)
        older = torch.rand(batch * hkv, ctx - w - s, device=DEVICE).topk(k, dim=-1).indices + s  # distinct
        pos[:, s + w:] = older.to(torch.int32)
        st.slot_prio.normal_()
        for name in layer.cache_policy.buffers:  # the policy's per-row buffers (kvpop: the ring's priorities)
            getattr(layer, name).normal_()
        layer.pos.fill_(ctx)
        layer._seen_t.fill_(ctx)
        layer.seen = ctx
        layer.prefilled = True
    return cache


def decode(model, cache, batch: int, ctx: int, new_tokens: int):
    """HF ``generate`` from a cache filled to ``ctx``: the last prompt token and ``new_tokens`` greedy tokens."""
    from kvpop.models import cache_kwarg_name

    ids = torch.randint(3, model.config.vocab_size, (batch, ctx + 1), device=DEVICE)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             **{cache_kwarg_name(): cache})
    _sync()
    return out


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _cache_bytes(provider: str, cache) -> int:
    if provider == "kvpop":
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def run_case(model, provider: str, batch: int, ctx: int, new_tokens: int = NEW_TOKENS) -> dict:
    """One timed ``generate`` (after a warm-up of 2 tokens on its own filled cache): tokens/s, memory, roofline."""
    fill = fill_kvpop if provider == "kvpop" else fill_dense
    decode(model, fill(model, batch, ctx), batch, ctx, 2)  # warm-up: autotuning, allocator
    cache = fill(model, batch, ctx)
    layers = model.config.num_hidden_layers
    cache_bytes = _cache_bytes(provider, cache)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = decode(model, cache, batch, ctx, new_tokens)
    seconds = time.perf_counter() - t0
    if tuple(out.shape) != (batch, ctx + 1 + new_tokens):
        raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(batch, ctx + 1 + new_tokens)}")
    above = (torch.cuda.max_memory_allocated() - _weight_bytes(model)) if CUDA else cache_bytes
    elt = torch.empty((), dtype=DTYPE).element_size()
    shape = rl.ModelShape.of(model.config)
    # per step: the token of the prompt's end, then new_tokens - 1 more (generate's last token needs no forward)
    steps = new_tokens
    nbytes, flops = rl.model_decode_cost(shape, batch=batch, keys_per_head=BUDGET if provider == "kvpop" else ctx + 1,
                                         cache_bytes=cache_bytes, elt=elt)
    return {"tokens_per_s": batch * new_tokens / seconds, "seconds": seconds, "mem_above_weights_gb": above / 1e9,
            "cache_bytes": cache_bytes, "layers": layers, "step": (nbytes, flops, seconds / steps)}


def _kvpop_case(model, batch: int, ctx: int) -> dict:
    import kvpop

    kvpop.patch(model, sinks=SINKS, window=WINDOW, budget=BUDGET)
    try:
        return run_case(model, "kvpop", batch, ctx)
    finally:
        kvpop.unpatch(model)


def _attempt(not_run: dict, key: str, layers: int, work):
    """``work(build_model(layers))``, or None with the reason in ``not_run[key]`` when it runs out of memory (the
    layer plan's margin too thin: that case only)."""
    try:
        return work(build_model(layers))
    except torch.cuda.OutOfMemoryError as e:
        not_run[key] = f"out of memory with {layers} layers: {str(e).splitlines()[0][:160]}"
        _MODEL.clear()
        if CUDA:
            torch.cuda.empty_cache()
        return None


@pytest.mark.benchmark(group="e2e-decode")
@pytest.mark.parametrize("batch", BATCHES, ids=[f"b{b}" for b in BATCHES])
def test_e2e_decode(benchmark, batch):
    benchmark.group = f"e2e-decode-b{batch}"
    full = MODEL["num_hidden_layers"]
    info: dict = {"batch": batch, "budget": BUDGET, "window": WINDOW, "sinks": SINKS, "new_tokens": NEW_TOKENS,
                  "contexts": CONTEXTS, "model": f"Qwen3 shape {MODEL}, random weights, {DTYPE}",
                  "context_fill": "synthetic (random keys/values; kvpop: a full slot state at the position)",
                  "memory": "CUDA peak during generate above the weights" if CUDA else "cache bytes (CPU)"}
    not_run, results, at_full = {}, {}, {}
    # kvpop against dense, the same layers (as many as the dense cache leaves room for)
    for ctx in CONTEXTS:
        layers = layers_for(batch, ctx, _device_memory())
        lab = _lab(ctx)
        info[f"layers_ctx{lab}"] = layers
        if layers == 0:
            not_run[lab] = "the dense cache alone does not fit this device's memory"
            continue
        why = fits_in_time(EST_BUILD_S * (layers not in _MODEL) + 2 * EST_CASE_S)
        if why:
            not_run[lab] = why
            continue
        pair = _attempt(not_run, lab, layers,
                        lambda m, c=ctx: (_kvpop_case(m, batch, c), run_case(m, "dense", batch, c)))
        if pair is None:
            continue
        results[ctx] = kv, dense = pair
        if layers == full:
            at_full[ctx] = kv
        for name, r in (("kvpop", kv), ("dense", dense)):
            info[f"{name}_tokens_per_s_ctx{lab}"] = r["tokens_per_s"]
            info[f"{name}_mem_per_layer_gb_ctx{lab}"] = r["mem_above_weights_gb"] / layers
            info[f"{name}_cache_bytes_ctx{lab}"] = r["cache_bytes"]
            rl.record(info, f"{name}-ctx{lab}", *r["step"], _device_name(), main=name == "kvpop" and ctx == TARGET_CTX)
        info[f"kvpop_over_dense_ctx{lab}"] = kv["tokens_per_s"] / dense["tokens_per_s"]
        if CUDA:
            torch.cuda.empty_cache()
    # flat memory: kvpop alone with every layer at the contexts the comparison ran with fewer (its cache fits)
    for ctx in CONTEXTS:
        lab = _lab(ctx)
        if ctx in at_full or lab in not_run:
            continue
        why = fits_in_time(EST_BUILD_S * (full not in _MODEL) + EST_CASE_S)
        if why:
            not_run[f"{lab} (kvpop, {full} layers)"] = why
            continue
        kv = _attempt(not_run, f"{lab} (kvpop, {full} layers)", full, lambda m, c=ctx: _kvpop_case(m, batch, c))
        if kv is not None:
            at_full[ctx] = kv
            info[f"kvpop_tokens_per_s_all_layers_ctx{lab}"] = kv["tokens_per_s"]
    for ctx, kv in at_full.items():
        info[f"kvpop_mem_gb_all_layers_ctx{_lab(ctx)}"] = kv["mem_above_weights_gb"]
    per_layer = {kv["cache_bytes"] / kv["layers"] for kv, _ in results.values()}
    assert len(per_layer) <= 1, f"kvpop's cache bytes per layer changed with the context: {sorted(per_layer)}"
    # the targets' figures under the names the verdict table reads (benchmarks/tools/targets.py)
    if 32768 in results:
        kv, dense = results[32768]
        info["kvpop_over_dense_ctx32k"] = kv["tokens_per_s"] / dense["tokens_per_s"]
    if CONTEXTS[0] in at_full and CONTEXTS[-1] in at_full:
        info["kvpop_mem_longest_over_shortest"] = (at_full[CONTEXTS[-1]]["mem_above_weights_gb"]
                                                   / at_full[CONTEXTS[0]]["mem_above_weights_gb"])
    if CONTEXTS[0] in results and CONTEXTS[-1] in results:  # dense's, per layer (its layer counts differ)
        (_, d0), (_, d1) = results[CONTEXTS[0]], results[CONTEXTS[-1]]
        info["dense_mem_longest_over_shortest"] = (d1["mem_above_weights_gb"] / d1["layers"]) / (
            d0["mem_above_weights_gb"] / d0["layers"])
    if not_run:
        info["not_run"] = "; ".join(f"ctx {c}: {why}" for c, why in not_run.items())
    benchmark.extra_info.update(info)
    if not results:
        pytest.skip(info["not_run"])
    benchmark.pedantic(lambda: None, rounds=1, iterations=1, warmup_rounds=0)  # timed above, figure by figure


@pytest.mark.benchmark(group="e2e-train-step")
def test_train_step_16k(benchmark, monkeypatch):
    """One retrofit training step, KVpop's against the dense fine-tune's, side by side (see the module docstring)."""
    from . import test_train_step as ts

    why = fits_in_time(EST_TRAIN_S)
    if why:
        benchmark.extra_info["not_run"] = why
        pytest.skip(why)
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch CPU path, not the interpreter
    import kvpop

    dev = torch.device(DEVICE)
    cfg = dict(MODEL, num_hidden_layers=TRAIN_LAYERS, max_position_embeddings=max(TRAIN_S, 1024),
               tie_word_embeddings=False, attention_dropout=0.0)
    _MODEL.clear()  # the decode benchmark's model is not needed here
    if CUDA:
        torch.cuda.empty_cache()
    ids = torch.randint(0, cfg["vocab_size"], (1, TRAIN_S), device=dev)
    model, teacher = ts._models(cfg, TRAIN_KV, dev, "student")
    kv = ts._measure(functools.partial(ts._kvpop_step, model, teacher, ids, kvpop.get_config(model)), dev, TRAIN_S,
                     TRAIN_STEPS)
    del teacher
    kvpop.unpatch(model)
    if CUDA:
        torch.cuda.empty_cache()
    dense = ts._measure(functools.partial(ts._dense_step, model, ids), dev, TRAIN_S, TRAIN_STEPS)
    del model
    info = {"S": TRAIN_S, "layers": TRAIN_LAYERS, "model": f"Qwen3 shape {MODEL} with {TRAIN_LAYERS} layers",
            "kvpop": TRAIN_KV, "kvpop_step_s": kv["step_s"], "dense_step_s": dense["step_s"],
            "kvpop_peak_mem_gb": kv["peak_mem_gb"], "dense_peak_mem_gb": dense["peak_mem_gb"],
            "train_time_kvpop_over_dense": kv["step_s"] / dense["step_s"],
            "train_mem_kvpop_over_dense": kv["peak_mem_gb"] / dense["peak_mem_gb"] if CUDA else None}
    ts.record_rooflines(info, cfg, TRAIN_KV, TRAIN_S, main="kvpop")
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1, warmup_rounds=0)

