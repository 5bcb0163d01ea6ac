"""Tiny random models of every supported family, shared by the model-level tests."""
import torch

SMALL = dict(sinks=2, window=8, budget=24)  # k = 14: S = 64 has 40 decisions per head
FAMILIES = ("qwen3", "qwen2", "llama")


def tiny_config(family="qwen3", **kw):
    """A 2-layer config (hidden 64, 4 query / 2 KV heads, head_dim 32) of ``family``."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                attention_dropout=0.0)
    base.update(kw)
    if family == "qwen2":
        base.pop("head_dim")  # Qwen2 derives it: hidden_size / num_attention_heads
        base["hidden_size"] = 128
    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    return cls(**base)


def tiny_model(seed=0, family="qwen3", **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **kw)).eval()


def record_qk(model, ids):
    """``({layer_idx: (q, k, scale)}, logits)`` of a plain dense forward of an unpatched ``model``: every layer's
    rotated queries and keys, through a recording attention function (dense reference attention)."""
    from transformers import AttentionInterface

    from kvpop_kernels import reference

    rec = {}

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        rec[module.layer_idx] = (query.detach().clone(), key.detach().clone(), scaling)
        out, _ = reference.dense_causal_attention(query, key, value, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvpop_test_record", record)
    prev = model.config._attn_implementation
    model.config._attn_implementation = "kvpop_test_record"
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        model.config._attn_implementation = prev
    return rec, logits


def randomize_scorers(model, seed=5):
    """Give a patched model's scorers seeded random weights (the decays kept), so that their scores matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".kvpop." in n and not n.endswith("decay_logit"):
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def kvtrace_model(hidden=64, heads=4, kv_heads=2, intermediate=128):
    """A seeded random 2-layer Qwen3 (head_dim 16) over the kvtrace task's vocabulary, in eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvpop.demo import task as T

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=T.VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=1024, tie_word_embeddings=True, attention_dropout=0.0)
    return Qwen3ForCausalLM(cfg).eval()
