"""Batched decoding with a fixed budget: throughput at batch 1 / 8 / 32 and the memory it buys.

Group ``batched-decode-ctx*``: decode tokens/s (all rows together) after a prompt of ``CTX`` tokens
per row, at batch 1, 8 and 32, ``kvpop.patch`` + ``KVpopCache`` against the unpatched model with a
``DynamicCache`` (SDPA), both measured in the same session.  The timed loop is what ``generate``
does per token (one forward of the new tokens through the cache, greedy argmax), without its
logits processors: ``DECODE_STEPS`` steps after the prefill, which is not timed.

* CPU: the shipped tiny model (``kvpop/data/tiny_qwen3``: hidden 128, 2 layers, 4 / 2 heads,
  head_dim 32, float32), one thread, context 4K, budget 512 (window 64, 4 sinks).
* CUDA: a Qwen3-8B-shaped model with random weights and 2 layers (hidden 4096, 32 / 8 heads,
  head_dim 128, bf16), context 32K, batch 32, budget 2048 (window 256).

``extra_info`` of the last case (batch 32, kvpop) holds the session's verdict figures:
``kvpop_b32_over_b1`` (kvpop tokens/s at batch 32 / batch 1, goal >= 10 on the CPU),
``kvpop_over_dense_b32`` (kvpop / dense tokens/s at batch 32, goal >= 1 on the CPU) and, on CUDA,
``kvpop_over_dense_b32_ctx32k`` (goal >= 3).  Every case records its own ``tokens_per_s``.

Group ``batched-memory``: cache bytes of a batch of 32 sequences at four lengths up to ``MEM_TOKENS``
tokens (4K on the CPU), dense vs kvpop (kvpop flat, dense grows linearly), CPU and CUDA; on CUDA
also the peak allocated memory.  Group ``batched-fit-131k`` (CUDA only): the batch whose cache
fits beside the weights at 131K tokens, dense vs kvpop, from the measured bytes per sequence and
layer scaled to the full Qwen3-8B (36 layers) and the device's memory.

Run: ``pytest benchmarks/test_batched_decode.py --benchmark-only -s``.  With ``--benchmark-disable`` (CI) the
same code runs once at smoke sizes (context 512, batches 1 / 2 / 4, 1K tokens for the memory case) and
records no verdict figure: the full CPU case decodes 32 x 4K-token rows densely, minutes on 2 cores.
"""
from __future__ import annotations

import time

import pytest
import torch

import kvpop_kernels._utils as kutils

from .tools import roofline as rl
from .tools.timing import device_name

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

if CUDA:
    CTX, BUDGET, WINDOW, SINKS, DTYPE = 32 * 1024, 2048, 256, 4, torch.bfloat16
    BATCHES, DECODE_STEPS, MEM_TOKENS = [1, 8, 32], 16, 32 * 1024
else:
    CTX, BUDGET, WINDOW, SINKS, DTYPE = 4096, 512, 64, 4, torch.float32
    BATCHES, DECODE_STEPS, MEM_TOKENS = [1, 8, 32], 16, 4096

SMOKE = dict(CTX=512, BATCHES=[1, 2, 4], DECODE_STEPS=4, MEM_TOKENS=1024)
RESULTS: dict[tuple[str, int], float] = {}  # (provider, batch) -> tokens/s, filled in parametrisation order


def _sizes(benchmark) -> dict:
    """The full sizes when timing (``--benchmark-only``), smoke sizes when timing is off (CI)."""
    if getattr(benchmark, "disabled", False):
        return SMOKE
    return dict(CTX=CTX, BATCHES=BATCHES, DECODE_STEPS=DECODE_STEPS, MEM_TOKENS=MEM_TOKENS)


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _model(provider: str):
    import kvpop

    torch.manual_seed(0)
    if CUDA:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936,
                          max_position_embeddings=131072 + 64)
        cfg._attn_implementation = "sdpa"
        with torch.device(DEVICE):
            model = Qwen3ForCausalLM(cfg).to(DTYPE).eval()
    else:
        from transformers import AutoModelForCausalLM

        from kvpop.demo.task import SHIPPED_MODEL

        model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, attn_implementation="sdpa").eval()
    if provider == "kvpop":
        kvpop.patch(model, sinks=SINKS, window=WINDOW, budget=BUDGET)
    return model


_MODELS: dict[str, torch.nn.Module] = {}


def _get_model(provider: str):
    if provider not in _MODELS:
        _MODELS[provider] = _model(provider)
    return _MODELS[provider]


def _new_cache(provider: str, model):
    from transformers import DynamicCache

    import kvpop

    return kvpop.KVpopCache(model) if provider == "kvpop" else DynamicCache(config=model.config)


def _cache_kw(cache):
    from kvpop.models import cache_kwarg_name

    return {cache_kwarg_name(): cache}


def _prefill(model, cache, ids):
    with torch.no_grad():
        logits = model(ids, use_cache=True, logits_to_keep=1, **_cache_kw(cache)).logits[:, -1]  # not [N, S, V]
    return logits.argmax(-1, keepdim=True)


def _decode(model, cache, nxt, steps):
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(nxt, use_cache=True, **_cache_kw(cache)).logits[:, -1].argmax(-1, keepdim=True)
    _sync()
    return nxt


@pytest.fixture
def cpu_setup(monkeypatch):
    if not CUDA:  # the PyTorch path (the interpreter is for correctness), one thread: a steady figure
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)
    else:
        yield


@pytest.mark.parametrize("batch_i", range(len(BATCHES)))
@pytest.mark.parametrize("provider", ["dense", "kvpop"])
def test_batched_decode(benchmark, cpu_setup, provider, batch_i):
    z = _sizes(benchmark)
    ctx, batch, steps, smoke = z["CTX"], z["BATCHES"][batch_i], z["DECODE_STEPS"], z is SMOKE
    benchmark.group = f"batched-decode-ctx{ctx // 1024}K" if ctx >= 1024 else f"batched-decode-ctx{ctx}"
    model = _get_model(provider)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, ctx), generator=torch.Generator().manual_seed(batch)).to(DEVICE)
    cache = _new_cache(provider, model)
    nxt = _prefill(model, cache, ids)
    _decode(model, cache, nxt, 2)  # warm-up steps (autotuning on CUDA)
    t0 = time.perf_counter()
    benchmark.pedantic(_decode, args=(model, cache, nxt, steps), rounds=1, iterations=1, warmup_rounds=0)
    elapsed = time.perf_counter() - t0  # one round, also under --benchmark-disable
    tps = batch * steps / elapsed
    info = dict(provider=provider, batch=batch, context=ctx, budget=BUDGET if provider == "kvpop" else None,
                decode_steps=steps, tokens_per_s=tps, step_ms=1e3 * elapsed / steps)
    # the roofline of one step (the cache as it stands after the timed steps: dense's has grown by them)
    cache_bytes = cache.nbytes() if provider == "kvpop" else _dense_cache_bytes(cache)
    keys = BUDGET if provider == "kvpop" else ctx + steps
    elt = next(model.parameters()).element_size()
    rl.record(info, provider, *rl.model_decode_cost(rl.ModelShape.of(model.config), batch=batch, keys_per_head=keys,
                                                    cache_bytes=cache_bytes, elt=elt),
              elapsed / steps, device_name(), main=True)
    if smoke:  # smoke sizes: no verdict figure
        benchmark.extra_info.update(info)
        return
    RESULTS[(provider, batch)] = tps
    if provider == "kvpop" and batch == max(BATCHES):
        b1, bmax = RESULTS.get(("kvpop", 1)), tps
        dense = RESULTS.get(("dense", batch))
        if b1:
            info["kvpop_b32_over_b1"] = bmax / b1
        if dense:
            key = "kvpop_over_dense_b32_ctx32k" if CUDA else "kvpop_over_dense_b32"
            info[key] = bmax / dense
        info["tokens_per_s_table"] = {f"{p}-b{b}": round(v, 1) for (p, b), v in sorted(RESULTS.items())}
        print("\nbatched decode tokens/s:", info["tokens_per_s_table"], {k: v for k, v in info.items()
                                                                           if k.startswith("kvpop_")})
    benchmark.extra_info.update(info)


def _dense_cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("provider", ["dense", "kvpop"])
def test_batched_memory(benchmark, cpu_setup, provider):
    """32 sequences at 1/4, 2/4, 3/4 and all of ``MEM_TOKENS`` tokens: the cache's bytes after a prompt of
    that length minus 8 tokens and 8 decode steps (the bytes a generation holds at that length, without
    decoding every token on a 2-core CPU: dense decoding of 32 x 4K tokens takes most of an hour there)."""
    benchmark.group = "batched-memory"
    model = _get_model(provider)
    batch = 32
    tokens = _sizes(benchmark)["MEM_TOKENS"]
    points = [tokens // 4 * i for i in (1, 2, 3, 4)]
    gen = torch.Generator().manual_seed(0)

    def run():
        sizes, peaks = {}, {}
        for p in points:
            ids = torch.randint(3, model.config.vocab_size, (batch, p - 8), generator=gen).to(DEVICE)
            cache = _new_cache(provider, model)
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            nxt = _prefill(model, cache, ids)
            _decode(model, cache, nxt, 8)
            sizes[p] = cache.nbytes() if provider == "kvpop" else _dense_cache_bytes(cache)
            if CUDA:
                peaks[p] = torch.cuda.max_memory_allocated()
            del cache
        return sizes, peaks

    t0 = time.perf_counter()
    sizes, peaks = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    info = dict(provider=provider, batch=batch, tokens=tokens, seconds=time.perf_counter() - t0,
                cache_bytes={str(p): b for p, b in sizes.items()},
                growth_last_over_first=sizes[points[-1]] / sizes[points[0]])
    if CUDA:
        info["peak_allocated_bytes"] = {str(p): b for p, b in peaks.items()}
    print(f"\n{provider}: cache bytes of 32 sequences at {points} tokens: {list(sizes.values())}")
    benchmark.extra_info.update(info)
    if provider == "kvpop":
        assert len(set(sizes.values())) == 1  # flat
    else:
        assert sizes[points[-1]] > 3 * sizes[points[0]]


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["dense", "kvpop"])
def test_batch_that_fits_131k(benchmark, provider):
    """Bytes per sequence and layer measured at 131K tokens (batch 1, 2 layers), scaled to Qwen3-8B's 36
    layers beside its bf16 weights on this device: the batch whose cache fits."""
    from kvpop.core.capacity import QWEN3, sequences_that_fit

    benchmark.group = "batched-fit-131k"
    model = _get_model(provider)
    ctx = 131072
    ids = torch.randint(3, model.config.vocab_size, (1, ctx), device=DEVICE)
    cache = _new_cache(provider, model)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    benchmark.pedantic(lambda: _decode(model, cache, _prefill(model, cache, ids), 4), rounds=1, iterations=1)
    per_layer = (cache.nbytes() if provider == "kvpop" else _dense_cache_bytes(cache)) / len(cache.layers)
    shape = QWEN3["Qwen3-8B"]
    per_seq = int(per_layer * shape.layers)
    fit = sequences_that_fit(per_seq, shape, memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    key = "kvpop_max_batch_ctx131k" if provider == "kvpop" else "dense_max_batch_ctx131k"
    benchmark.extra_info.update({"provider": provider, "bytes_per_seq_qwen3_8b": per_seq, key: fit,
                                 "prefill_peak_over_base_bytes": torch.cuda.max_memory_allocated() - base})
