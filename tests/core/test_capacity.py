"""kvpop.core.capacity: bytes per sequence from model shapes, checked against real allocations."""
import pytest
import torch
from tiny import tiny_model

import kvpop
from kvpop.core.capacity import (
    QWEN3,
    ModelShape,
    capacity_table,
    dense_bytes_per_sequence,
    kvpop_bytes_per_sequence,
    sequences_that_fit,
)
from kvpop.models import cache_kwarg_name


def test_qwen3_parameter_counts_match_the_published_sizes():
    assert abs(QWEN3["Qwen3-4B"].num_parameters() / 4.0e9 - 1) < 0.01
    assert abs(QWEN3["Qwen3-8B"].num_parameters() / 8.2e9 - 1) < 0.01


def test_parameter_count_matches_a_built_model():
    cfg = tiny_model().config
    shape = ModelShape(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                       heads=cfg.num_attention_heads, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                       vocab=cfg.vocab_size, tied_embeddings=cfg.tie_word_embeddings)
    assert shape.num_parameters() == sum(p.numel() for p in tiny_model().parameters())


def test_dense_bytes():
    # Qwen3-8B, 32K tokens, bf16: 2 (k, v) * 36 layers * 8 heads * 128 * 2 bytes * 32768
    assert dense_bytes_per_sequence(QWEN3["Qwen3-8B"], 32768) == 4608 * 2**20
    assert dense_bytes_per_sequence(QWEN3["Qwen3-8B"], 2) == 2 * dense_bytes_per_sequence(QWEN3["Qwen3-8B"], 1)


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_kvpop_bytes_equal_the_cache_allocation(monkeypatch, scorer):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = kvpop.patch(tiny_model().to(torch.bfloat16), scorer=scorer, sinks=2, window=8, budget=40, mlstm_dim=16)
    cfg = m.config
    shape = ModelShape(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                       heads=cfg.num_attention_heads, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                       vocab=cfg.vocab_size, tied_embeddings=cfg.tie_word_embeddings)
    cache = kvpop.KVpopCache(m)
    with torch.no_grad():
        m(torch.randint(0, 128, (3, 50)), use_cache=True, **{cache_kwarg_name(): cache})
    want = kvpop_bytes_per_sequence(shape, 40, window=8, sinks=2, scorer=scorer, mlstm_dim=16)
    assert cache.nbytes() == 3 * want


def test_fit_and_table():
    s8 = QWEN3["Qwen3-8B"]
    per = kvpop_bytes_per_sequence(s8, 2048)
    n = sequences_that_fit(per, s8)
    assert n * per <= 80 * 10**9 - 2 * s8.num_parameters() < (n + 1) * per
    assert sequences_that_fit(dense_bytes_per_sequence(s8, 131072), s8) == 3
    table = capacity_table()
    assert table.count("\n") == 7 and "| Qwen3-8B | 131,072 |" in table
    with pytest.raises(ValueError, match="budget .* must be >= sinks \\+ window"):
        kvpop_bytes_per_sequence(s8, 100)
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        dense_bytes_per_sequence(s8, 0)
