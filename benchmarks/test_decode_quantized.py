"""Quantised-slot decode benchmarks (``kvpop_kernels.layout.QuantizedLayout``).

Group ``decode-step-quantized``: one layer's batch-1 decode step over a full cache of ``B`` slots per KV head
at a 32K context, the slots in the model's dtype (``float``: bf16 on CUDA, float32 on the CPU, where ``bf16``
runs too) against int8 and fp8 (e4m3) slots with a float32 scale per slot and KV head, timed side by side in
one run (the shapes of ``test_decode.py``: Qwen3-8B heads and ``B = 2048`` on CUDA; 4 / 2 heads, head_dim 64,
``B = 512``, the PyTorch path, on the CPU). ``extra_info`` of each provider: the step time, the bytes of the
layer's decode state per sequence (keys, values, scales, slot positions, priorities: ``bytes_per_sequence``)
and its ratio to the float layout's (``bytes_over_float``), and the ratio of the step times
(``time_over_float``).

Run: ``pytest benchmarks/test_decode_quantized.py --benchmark-only``.
"""
from __future__ import annotations

import pytest
import torch

import kvpop_kernels._utils as kutils
from kvpop_kernels import SlotState, fixed_budget_decode
from kvpop_kernels.layout import QuantizedLayout, quantize

from .test_decode import CUDA, DEVICE, DTYPE, HKV, HQ, SINKS, WINDOW, D, _kvpop_state, _stepper, kvpop_cost
from .tools import roofline as rl
from .tools.timing import best_time, device_name

CTX, BUDGET = 32 * 1024, (2048 if CUDA else 512)
PROVIDERS = ["float"] + ([] if CUDA else ["bf16"]) + ["int8"] + (["fp8"] if hasattr(torch, "float8_e4m3fn") else [])


def _state(kv_dtype, gen):
    """A full cache at ``CTX`` (``test_decode._kvpop_state``), its keys and values quantised for ``kv_dtype``:
    ``(SlotState, extra kwargs)``."""
    kc, vc, sp, pr = _kvpop_state(CTX, BUDGET, gen)
    if kv_dtype == "float":
        return SlotState(kc, vc, sp, pr), {}
    if kv_dtype == "bf16":  # (the CPU's float is float32: bf16 slots too, the queries in bf16 as well)
        return SlotState(kc.bfloat16(), vc.bfloat16(), sp, pr), {}
    (kq, ks), (vq, vs) = quantize(kc, kv_dtype), quantize(vc, kv_dtype)
    return SlotState(kq, vq, sp, pr, k_scale=ks, v_scale=vs), {"layout": QuantizedLayout(kv_dtype)}


@pytest.mark.benchmark(group="decode-step-quantized")
def test_decode_step_quantized(benchmark, monkeypatch):
    if not CUDA:
        monkeypatch.setattr(kutils, "interpreting", lambda: False)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(HQ, D, generator=gen).to(DEVICE, DTYPE)
    kn = torch.randn(HKV, D, generator=gen).to(DEVICE, DTYPE)
    vn = torch.randn(HKV, D, generator=gen).to(DEVICE, DTYPE)
    lp = torch.randn(HKV, generator=gen).to(DEVICE)
    steps, nbytes = {}, {}
    for name in PROVIDERS:
        st, kw = _state(name, gen)
        nbytes[name] = st.nbytes()

        dt = st.k_cache.dtype if name == "bf16" else DTYPE

        def at(p, st=st, kw=kw, dt=dt):
            return fixed_budget_decode(q.to(dt), kn.to(dt), vn.to(dt), st, lp, pos=p, sinks=SINKS, window=WINDOW,
                                       **kw)

        steps[name] = _stepper(at, CTX, None)
        for _ in range(5):
            steps[name]()
    # alternating rounds, best of all, on one intra-op thread (a shared CPU: see test_decode.py)
    threads = torch.get_num_threads()
    if not CUDA:
        torch.set_num_threads(1)
    try:
        best = dict.fromkeys(PROVIDERS, float("inf"))
        for _ in range(5):
            for name in PROVIDERS:
                best[name] = min(best[name], best_time(steps[name], reps=10, warmup=1))
    finally:
        torch.set_num_threads(threads)
    info = {"context": CTX, "budget": BUDGET, "Hq": HQ, "Hkv": HKV, "head_dim": D, "float_dtype": str(DTYPE),
            "device": DEVICE, "intra_op_threads": 1 if not CUDA else threads}
    for name in PROVIDERS:
        info[f"{name}_s"] = best[name]
        info[f"{name}_bytes_per_sequence"] = nbytes[name]
        info[f"{name}_bytes_over_float"] = nbytes[name] / nbytes["float"]
        info[f"{name}_time_over_float"] = best[name] / best["float"]
        quant = name in ("int8", "fp8")
        rl.record(info, name, *kvpop_cost(BUDGET, code_elt=1 if quant else None, scales=quant,
                                          elt=2 if name == "bf16" else None), best[name], device_name(),
                  main=name == "int8")
    # the int8 figures under the names the verdict table's rows read (benchmarks/tools/targets.py)
    info.update(int8_s=best["int8"], float_s=best["float"], int8_time_over_float=best["int8"] / best["float"],
                int8_bytes_over_float=nbytes["int8"] / nbytes["float"])
    benchmark.extra_info.update(info)
    benchmark.pedantic(steps["int8"], rounds=1, iterations=1, warmup_rounds=0)
