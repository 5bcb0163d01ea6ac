"""One KVpop training step in a fresh process; prints its peak memory as one JSON line (CPU).

``python benchmarks/tools/train_step_memory.py --mode fused --seq 2048 --vocab 151936``

Modes (a tiny patched Qwen3: 2 layers, hidden 64, 4 query / 2 KV heads, head size 32, budget 1024,
window 256; the teacher a frozen copy; batch 1):

* ``base``: the student's forward and backward with no LM head at all (loss: the mean square of the
  final hidden states, plus ``L_score``): the model's own activations;
* ``dense``: the training step as it was before the fused head (b6ff720): the teacher's and the
  student's full ``[S, V]`` logits, the teacher's top-k logits, the student's gathered and
  renormalised over them (that KL, restated here), backward;
* ``fused``: ``kvpop.training.train``'s own step (``teacher_step`` + ``_Step``): chunked LM head fused
  with the top-k and the KL, recomputed in the backward.

The figure is the rise of the process's peak resident set (``VmHWM``, reset just before the step)
over its resident set just before the step (model, teacher and inputs built), i.e. what the step
itself adds.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "0")  # the PyTorch CPU path, never the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Reset the kernel's high-water mark of this process (VmHWM) to its current resident set."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: ru_maxrss since the start of the process
        pass


def _peak_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["base", "dense", "fused"], required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--chunk", type=int, default=None,
                   help="positions per chunk of the fused head (default: kvpop's, about 128 MiB of logits)")
    args = p.parse_args(argv)

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvpop
    from kvpop.core.loss import fused_output_head, score_loss
    from kvpop.training.methods import method_for
    from kvpop.training.train import _Step, teacher_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=max(args.seq, 256), attention_dropout=0.0)
    model = Qwen3ForCausalLM(cfg)
    teacher = kvpop.make_teacher(model)
    kvpop.patch(model, sinks=4, window=256, budget=1024)
    model.train()
    ids = torch.randint(0, args.vocab, (1, args.seq))
    before = _rss_bytes()
    _reset_peak()
    t0 = time.perf_counter()
    if args.mode == "base":
        with fused_output_head(model, lambda h, w, b: h.float().pow(2).mean()) as res:
            model(ids, use_cache=False)
        loss = res["value"] + score_loss(model)
    elif args.mode == "dense":
        with torch.no_grad():
            vals, idx = torch.topk(teacher(ids, use_cache=False).logits, args.top_k, dim=-1)
        logits = model(ids, use_cache=False).logits
        log_pt = torch.log_softmax(vals.float(), -1)
        log_ps = torch.log_softmax(logits.gather(-1, idx).float(), -1)
        loss = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean() + score_loss(model)
    else:
        topk = teacher_step(teacher, ids, args.top_k, chunk_size=args.chunk)
        kl, ls, _ = _Step(model, method_for(model), args.chunk)(ids, topk)
        loss = kl + ls
    loss.backward()
    wall = time.perf_counter() - t0
    out = {"mode": args.mode, "seq": args.seq, "vocab": args.vocab, "chunk": args.chunk,
           "step_peak_bytes": _peak_bytes() - before, "rss_before_bytes": before,
           "wall_s": wall, "loss": float(loss.detach())}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
