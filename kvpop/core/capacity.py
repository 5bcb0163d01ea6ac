"""Capacity on paper: bytes of cache per sequence, dense vs a fixed budget, and how many sequences fit.

A dense cache grows by ``2 * L * Hkv * D * bytes`` per token; a ``KVpopCache`` holds exactly ``B``
entries per layer and KV head forever, plus a few bytes of slot bookkeeping per entry (computed
here from the layout ``KVpopCache`` allocates, see :func:`kvpop_bytes_per_sequence`).  The model
shapes below are the published ``config.json`` numbers of Qwen3-4B and Qwen3-8B (no download).
``python -m kvpop.core.capacity`` prints the table of docs/library.md.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelShape", "QWEN3", "dense_bytes_per_sequence", "kvpop_bytes_per_sequence", "sequences_that_fit",
           "capacity_rows", "capacity_table"]


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder's ``config.json`` that size its weights and its KV cache."""

    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool

    def num_parameters(self) -> int:
        """Parameters of a Qwen3-style decoder (q/k/v/o projections without bias, q/k RMSNorm, SwiGLU MLP)."""
        H, D = self.hidden, self.head_dim
        attn = H * self.heads * D + 2 * H * self.kv_heads * D + self.heads * D * H + 2 * D
        mlp = 3 * H * self.intermediate
        per_layer = attn + mlp + 2 * H
        emb = self.vocab * H * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + emb + H


QWEN3 = {
    # Qwen/Qwen3-4B and Qwen/Qwen3-8B config.json (hidden_size, intermediate_size, num_hidden_layers,
    # num_attention_heads, num_key_value_heads, head_dim, vocab_size, tie_word_embeddings)
    "Qwen3-4B": ModelShape(layers=36, kv_heads=8, head_dim=128, heads=32, hidden=2560, intermediate=9728,
                           vocab=151936, tied_embeddings=True),
    "Qwen3-8B": ModelShape(layers=36, kv_heads=8, head_dim=128, heads=32, hidden=4096, intermediate=12288,
                           vocab=151936, tied_embeddings=False),
}


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def dense_bytes_per_sequence(shape: ModelShape, tokens: int, *, dtype_bytes: int = 2) -> int:
    """Keys and values of ``tokens`` tokens in every layer and KV head (a dense cache)."""
    _positive("tokens", tokens)
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes * tokens


def kvpop_bytes_per_sequence(shape: ModelShape, budget: int, *, window: int = 256, sinks: int = 4,
                             dtype_bytes: int = 2, scorer: str = "mlp", mlstm_dim: int = 64,
                             mlstm_chunk: int = 128) -> int:
    """Bytes one sequence holds in a ``KVpopCache`` of budget ``B``, whatever its length.

    Per layer and KV head: keys and values ``2 * B * D`` elements, ``slot_pos`` (int32) per slot,
    ``slot_prio`` (float32) per long-range slot, ``ring_prio`` (float32) per window slot (the buffer of the
    learned and streaming policies); per layer ``pos`` (int64); with the mLSTM scorer also its state
    (``C [d, d]``, ``n [d]``, ``m`` at the start of the chunk being filled and that chunk's features
    ``kf, vf [L, d]``, ``i, log f [L]``, all float32; ``L = mlstm_chunk``) and a ring of ``w`` pre-RoPE
    keys (model dtype) per KV head.
    Equals ``KVpopCache.nbytes()`` per batch row (tested).
    """
    _positive("budget", budget)
    if budget < sinks + window:
        raise ValueError(f"budget ({budget}) must be >= sinks + window ({sinks + window})")
    if scorer not in ("mlp", "mlstm"):
        raise ValueError(f"scorer must be 'mlp' or 'mlstm', got {scorer!r}")
    k = budget - sinks - window
    D = shape.head_dim
    per_head = 2 * budget * D * dtype_bytes + 4 * budget + 4 * k + 4 * window
    if scorer == "mlstm":
        per_head += (4 * (mlstm_dim * mlstm_dim + mlstm_dim + 1) + 4 * (2 * mlstm_chunk * mlstm_dim + 2 * mlstm_chunk)
                     + dtype_bytes * window * D)
    return shape.layers * (shape.kv_heads * per_head + 8)


def sequences_that_fit(per_sequence: int, shape: ModelShape, *, memory_bytes: int = 80 * 10**9,
                       weight_bytes_per_param: int = 2, reserve_bytes: int = 0) -> int:
    """How many sequences' caches fit in ``memory_bytes`` beside the bf16 weights (and ``reserve_bytes``
    for activations and workspace): an upper bound, no fragmentation or framework overhead counted."""
    free = memory_bytes - shape.num_parameters() * weight_bytes_per_param - reserve_bytes
    return max(0, free // per_sequence)


def capacity_rows(models=("Qwen3-4B", "Qwen3-8B"), contexts=(8192, 32768, 131072), budgets=(2048, 4096),
                  **kw) -> list[dict]:
    """One row per (model, context): GiB per sequence and sequences on an 80 GB GPU, dense and per budget."""
    rows = []
    for name in models:
        shape = QWEN3[name]
        for ctx in contexts:
            dense = dense_bytes_per_sequence(shape, ctx)
            row = {"model": name, "context": ctx, "dense_bytes": dense, "dense_fit": sequences_that_fit(dense, shape)}
            for B in budgets:
                b = kvpop_bytes_per_sequence(shape, B, **kw)  # the same at every context
                row[f"kvpop{B}_bytes"] = b
                row[f"kvpop{B}_fit"] = sequences_that_fit(b, shape)
            rows.append(row)
    return rows


def capacity_table(**kw) -> str:
    """The README's capacity table (markdown)."""
    mib = 2**20
    lines = ["| model | context | dense MiB/seq | B=2048 MiB/seq | B=4096 MiB/seq | dense seqs | B=2048 seqs | "
             "B=4096 seqs |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in capacity_rows(**kw):
        lines.append(f"| {r['model']} | {r['context']:,} | {r['dense_bytes'] / mib:,.0f} | "
                     f"{r['kvpop2048_bytes'] / mib:,.0f} | {r['kvpop4096_bytes'] / mib:,.0f} | {r['dense_fit']:,} | "
                     f"{r['kvpop2048_fit']:,} | {r['kvpop4096_fit']:,} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    for name, shape in QWEN3.items():
        print(f"{name}: {shape.num_parameters() / 1e9:.2f} B parameters, "
              f"{shape.num_parameters() * 2 / 1e9:.1f} GB in bf16")
    print(capacity_table())
