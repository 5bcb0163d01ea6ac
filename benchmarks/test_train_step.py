"""One full KVpop training step at S = 16,384 on a Qwen3-0.6B-shaped model (random weights, bf16), on a GPU.

Providers, side by side in one run, each ``steps`` timed steps after one warm-up:

* ``kvpop``: what ``kvpop.training.train`` does per micro-batch: the frozen teacher's forward (bf16
  weights) with its top-256 log-probabilities from the fused chunked head, the patched student's
  forward under bf16 autocast (float32 master weights; sparse attention with the scorer's mask, the
  sparse-LSE target and ``L_score`` in every layer), the fused KL, one backward;
* ``kvpop-teacher-target``: the same with ``target_source="teacher"`` (the teacher's forward also
  computes every layer's exact target);
* ``dense``: the unpatched model under the same autocast, dense SDPA attention and the plain
  next-token cross-entropy of transformers (full ``[S, V]`` logits), one backward.

``extra_info``: ``{provider}_tokens_per_s``, ``{provider}_peak_mem_gb`` (``max_memory_allocated`` over
the step, weights and gradients included), and the verdict-table figures ``train_tokens_per_s_ratio``
(kvpop / dense) and ``train_peak_mem_ratio`` (kvpop / dense).  No optimiser step (the same for all).

Run: ``pytest benchmarks/test_train_step.py --benchmark-only -s`` on a GPU (``gpu`` marker: skipped
without CUDA).  ``test_train_step_cpu_smoke`` runs the same code on a tiny model on the CPU so that it
cannot rot where no GPU is.
"""
from __future__ import annotations

import contextlib
import functools
import time

import pytest
import torch

from .tools import roofline as rl
from .tools.timing import device_name

S_GPU = 16384
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, tie_word_embeddings=True, attention_dropout=0.0)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
            attention_dropout=0.0)
KV_GPU = dict(sinks=4, window=256, budget=2048)
KV_TINY = dict(sinks=2, window=16, budget=64)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _autocast(dev: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()


def _models(model_cfg: dict, kv: dict, dev: torch.device, target_source: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvpop

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**model_cfg)).to(dev)
    teacher = kvpop.make_teacher(model, dtype=torch.bfloat16 if dev.type == "cuda" else None)
    kvpop.patch(model, **kv, target_source=target_source)
    return model.train(), teacher


def _kvpop_step(model, teacher, ids, kv_cfg) -> None:
    import kvpop
    from kvpop.training.methods import method_for
    from kvpop.training.train import _Step, teacher_step

    dev = ids.device
    need = kv_cfg.target_source == "teacher"
    with _autocast(dev), (kvpop.teacher_targets(teacher, kv_cfg) if need else contextlib.nullcontext()) as tg:
        topk = teacher_step(teacher, ids, 256)
    if need:
        kvpop.set_teacher_targets(model, tg)
    with _autocast(dev):
        kl, ls, _ = _Step(model, method_for(model))(ids, topk)
    (kl + ls).backward()
    model.zero_grad(set_to_none=True)
    if need:
        kvpop.set_teacher_targets(model, None)


def _dense_step(model, ids) -> None:
    with _autocast(ids.device):
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def _measure(step, dev: torch.device, S: int, steps: int) -> dict:
    step()  # warm-up (Triton autotuning, allocator)
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else float("nan")
    return {"tokens_per_s": S / best, "step_s": best, "peak_mem_gb": peak}


def _run(model_cfg: dict, kv: dict, S: int, dev: torch.device, steps: int) -> dict:
    import kvpop

    out = {}
    ids = torch.randint(0, model_cfg["vocab_size"], (1, S), device=dev)
    for name, src in (("kvpop", "student"), ("kvpop_teacher_target", "teacher")):
        model, teacher = _models(model_cfg, kv, dev, src)
        cfg = kvpop.get_config(model)
        r = _measure(functools.partial(_kvpop_step, model, teacher, ids, cfg), dev, S, steps)
        out.update({f"{name}_{k}": v for k, v in r.items()})
        del model, teacher
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    model, _ = _models(model_cfg, kv, dev, "student")
    kvpop.unpatch(model)
    r = _measure(functools.partial(_dense_step, model, ids), dev, S, steps)
    out.update({f"dense_{k}": v for k, v in r.items()})
    out["train_tokens_per_s_ratio"] = out["kvpop_tokens_per_s"] / out["dense_tokens_per_s"]
    out["train_peak_mem_ratio"] = out["kvpop_peak_mem_gb"] / out["dense_peak_mem_gb"]
    record_rooflines(out, model_cfg, kv, S, main="kvpop")
    return out


def kvpop_pairs_per_head(S: int, budget: int) -> int:
    """(query, key) pairs one query head attends under a fixed budget: all earlier keys up to ``budget``, then
    ``budget`` (an upper bound: the first ``budget`` queries see fewer)."""
    B = min(budget, S)
    return B * (B + 1) // 2 + (S - B) * B


def record_rooflines(out: dict, model_cfg: dict, kv: dict, S: int, main: str) -> None:
    """The roofline of each provider's step in ``out`` (``{provider}_step_s`` read, ``roofline*`` written): KVpop's
    steps with the teacher's forward (bf16) and sparse attention, the dense fine-tune's with causal attention;
    float32 master weights (``benchmarks/tools/roofline.py``'s ``train_step_cost``)."""
    shape = rl.ModelShape.of(model_cfg)
    for name in ("kvpop", "kvpop_teacher_target", "dense"):
        if f"{name}_step_s" not in out:
            continue
        cost = (rl.train_step_cost(shape, s=S, pairs_per_head=S * (S + 1) // 2) if name == "dense" else
                rl.train_step_cost(shape, s=S, pairs_per_head=kvpop_pairs_per_head(S, kv["budget"]), teacher_elt=2))
        rl.record(out, name, *cost, out[f"{name}_step_s"], device_name(), main=name == main)


@pytest.mark.gpu
@pytest.mark.benchmark(group="train-step")
def test_train_step_gpu(benchmark):
    dev = torch.device("cuda")
    res = {}

    def go():
        res.update(_run(QWEN3_06B, KV_GPU, S_GPU, dev, steps=3))

    benchmark.pedantic(go, rounds=1, iterations=1)
    benchmark.extra_info.update({"S": S_GPU, "model": "Qwen3-0.6B shape, random weights", **res})
    print("\n" + "\n".join(f"{k}: {v:.4g}" for k, v in res.items() if isinstance(v, float)))
    for name in ("kvpop", "kvpop_teacher_target", "dense"):
        assert res[f"{name}_tokens_per_s"] > 0 and res[f"{name}_peak_mem_gb"] > 0


def test_train_step_cpu_smoke(monkeypatch):
    """The GPU benchmark's code on a tiny model on the CPU (one step each, nothing timed or claimed)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch CPU path, not the interpreter
    res = _run(TINY, KV_TINY, 96, torch.device("cpu"), steps=1)
    assert all(res[f"{n}_tokens_per_s"] > 0 for n in ("kvpop", "kvpop_teacher_target", "dense"))
