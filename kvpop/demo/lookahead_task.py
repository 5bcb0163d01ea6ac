"""A synthetic recall task in which a token's importance is revealed only by the tokens *after* it
("lookahead trace"), for testing KV-cache eviction that can wait for the window.

The first task (:mod:`kvpop.demo.task`) writes each fact as one dedicated token, so any per-token
classifier can tell the tokens that will be read from the rest.  Here the same token ids occur as
needed and as never-needed tokens, and nothing at or before a token tells which it is: a *marker*
written after it does.

A *fact* is one token ``FACT(k, v)`` (as in the first task).  Facts come in *blocks* of
``block_records`` facts (``fact_gap`` filler tokens between two facts) followed by one marker token,
``KEEP`` or ``DROP``; a fixed share of the blocks (``keep_frac``, at least one) is ``KEEP``, which ones
drawn at random.  Later, *reads* ``KEY(k) VALUE(v)`` ask only for keys of facts in ``KEEP`` blocks: the
model must predict the value right after the key, which it can do only if it still sees the fact.  Facts
in ``DROP`` blocks are never read.  Keys are distinct within a sequence, so every answer is unique and
the dense model never needs the markers; an eviction policy does.  Every ``FACT`` id occurs in kept and
in dropped blocks.

Timing, with the demo's window ``w = 32`` in mind: the marker lies at most ``block_span`` tokens after
every fact of its block (inside the window that an mLSTM scorer reads before it scores the token), and
blocks start at least ``block_period > w`` tokens apart, so the window after a fact never holds the
marker of the *next* block.  A scorer that sees only the token and its left context (the MLP scorer;
TOVA and H2O, for which no read has happened yet when facts are written) cannot tell ``KEEP`` from
``DROP`` facts; a scorer that has read the ``w`` tokens after the token can.

Layout of a sequence of length ``L`` (positions count from 0)::

    0                        BOS
    1 .. 7                   filler (the sinks, positions 0..3, hold no fact)
    [8, record_end)          ``n_blocks`` blocks (``records_per_block(L)`` FACTs, then KEEP/DROP),
                             one per slot of the region at a random offset, filler elsewhere
    [record_end, L)          ``n_reads`` reads ``KEY(k) VALUE(v)`` (k from KEEP blocks, each once
                             before any is repeated) at random places, filler elsewhere

with ``record_end = round(record_frac * L)``.  Blocks are full (``block_records`` facts) from
``full_length`` tokens on; shorter sequences (the first stages of a pre-training curriculum) have
fewer facts per block.  Filler is runs of counting tokens with random restarts, as in the first task.
The graded positions are the KEY tokens of the reads; accuracy is the greedy argmax over the whole
vocabulary.

What the demo's budgets leave at the shipped model's training length, and what was measured:
``kvpop/data/demo_results/README.md``.

Seeds: train ``[0, TEST_SEED_BASE)``, test ``TEST_SEED_BASE + i``, validation
``VALID_SEED_BASE + i`` (disjoint from both for ``i < VALID_SEED_BASE - TEST_SEED_BASE``).  The
generator is seeded by ``(seed, length)``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .task import (  # the seeds and special ids are the first task's
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TEST_SEED_BASE,
    VALID_SEED_BASE,
    TokenIds,
    check_seed_length,
    filler,
    graded_fields,
    test_seed,
    train_seed,
    valid_seed,
)
from .task import accuracy as task_accuracy

__all__ = [
    "NAME",
    "SHIPPED_MODEL",
    "TRAIN_LEN",
    "LookaheadConfig",
    "TaskConfig",
    "DEFAULT",
    "VOCAB_SIZE",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "TEST_SEED_BASE",
    "VALID_SEED_BASE",
    "make_example",
    "make_batch",
    "accuracy",
    "train_seed",
    "test_seed",
    "valid_seed",
    "describe",
    "init_embeddings",
]

NAME = "lookahead"

SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "data" / "tiny_qwen3_lookahead"
"""The tiny Qwen3 trained densely on this task (``kvpop pretrain --task lookahead``)."""
TRAIN_LEN = 512
"""The training length ``L_train`` of the shipped model."""
BUDGET_FRACTIONS = (0.09375, 0.125, 0.25)
"""The demo's budgets as fractions of ``L_train``: 48 / 64 / 128 entries at 512 (6.25 % would be 32, below
sinks 4 + window 32).  Long-range slots: 12 / 28 / 92, against 18 kept facts of 54."""
DEMO_GRID = {"k": (12, 28, 64), "lr_scorer": (1e-2, 3e-2), "steps": (100, 200), "joint_lr_model": (1e-4, 1e-3),
             "finetune_lr_model": (1e-4, 1e-3), "finetune_steps": (30, 100), "label": ("mean", "max"),
             "decay_span": (None,), "label_lr_scorer": (3e-3,), "label_steps": (3000,), "eval_every": (250,),
             "patience": (3,)}
"""``kvpop demo --select``'s candidates on this task (``SELECT_GRID``'s keys, :mod:`kvpop.demo.grid`): the
training budget's long-range slots ``k`` at the smallest and the middle budget's (12, 28) and beyond the largest
kept set (64); two scorer learning rates, two step counts, two model learning rates for the joint and
fixed-pattern fine-tunes. The label family (``--select-stage label``): the paper's mean label and the max, up to
3,000 steps validated every 250 with patience 3 (the mLSTM passes 0.95 on the max label only after ~750 steps),
at the scorer learning rate and with the decay range the label study chose on validation sequences
(``kvpop/data/demo_results/README.md``: lr 1e-2 diverged, 1e-3 was slow; every decay of the paper's range gave
the max label's oracle 1.000 and a stronger age penalty only lost, so the paper's range is the one candidate)."""
DEMO_TRAIN_LENGTH = 512
"""The demo's retrofits train on sequences of ``L_train`` tokens (half of it would hold only 4 blocks, one of
them kept)."""



@dataclass(frozen=True)
class LookaheadConfig(TokenIds):
    """Parameters of the lookahead trace task.

    Attributes:
        n_keys: size of the key vocabulary (at least ``max_blocks * block_records``: keys are
            distinct within a sequence).
        n_values: size of the value vocabulary (chance accuracy is ``1 / n_values``).
        n_filler: size of the filler vocabulary.
        block_records: records per block; the marker follows the last one.
        fact_gap: filler tokens between two facts of a block.
        block_period: least distance between two block starts (``> window`` of the scorer).
        max_blocks: most blocks per sequence.
        keep_frac: share of the blocks that are ``KEEP`` (exactly ``round(keep_frac * n_blocks)``,
            at least one; which ones is random).
        read_spacing: on average one read per this many tokens of the read region.
        max_reads: most reads per sequence.
        record_frac: blocks are written in ``[8, record_frac * L)``, reads happen after.
        restart_prob: probability that a filler run restarts at a random filler token.
        full_length: sequences of at least this length have full blocks (:meth:`records_per_block`).
    """

    n_keys: int = 64
    n_values: int = 8
    n_filler: int = 64
    block_records: int = 6
    fact_gap: int = 0
    block_period: int = 33
    max_blocks: int = 9
    keep_frac: float = 1.0 / 3.0
    read_spacing: int = 6
    max_reads: int = 256
    record_frac: float = 0.6
    restart_prob: float = 0.1
    full_length: int = 256

    def __post_init__(self) -> None:
        if self.fact_gap < 0:
            raise ValueError(f"fact_gap must be >= 0, got {self.fact_gap}")
        if self.block_period < self.block_span + 1:
            raise ValueError(f"block_period {self.block_period} must be >= the block's span + 1 = "
                             f"block_records * (fact_gap + 1) + 1 = {self.block_span + 1}")
        if self.n_keys < self.max_blocks * self.block_records:
            raise ValueError(f"n_keys {self.n_keys} must be >= max_blocks * block_records = "
                             f"{self.max_blocks * self.block_records} (keys are distinct in a sequence)")
        if not 0.0 < self.keep_frac <= 1.0:
            raise ValueError(f"keep_frac must be in (0, 1], got {self.keep_frac}")

    @property
    def block_span(self) -> int:
        """Tokens from a block's first fact to its marker (exclusive) with full blocks."""
        return self.block_records * (self.fact_gap + 1)

    def n_keep_for(self, n_blocks: int) -> int:
        """``KEEP`` blocks among ``n_blocks``: ``round(keep_frac * n_blocks)``, at least 1."""
        return int(max(1, min(n_blocks, round(self.keep_frac * n_blocks))))

    # ---- token ids (kvpop.demo.task.TokenIds, then KEEP, DROP, the filler) ----------------
    @property
    def keep_id(self) -> int:
        return self.extra_base

    @property
    def drop_id(self) -> int:
        return self.extra_base + 1

    @property
    def filler_base(self) -> int:
        return self.extra_base + 2

    # ---- sizes for a length ----------------------------------------------------------------
    def n_blocks_for(self, length: int) -> int:
        """Number of record blocks in a sequence of ``length`` tokens."""
        region = int(round(self.record_frac * length)) - 8
        return int(max(1, min(self.max_blocks, region // self.block_period)))

    def records_per_block(self, length: int) -> int:
        """Facts per block: ``block_records`` from ``full_length`` tokens on, fewer in shorter sequences
        (``block_records * length / full_length``, at least 2), so the short sequences of a training
        curriculum start with a few facts, as the first task's do."""
        return int(max(2, min(self.block_records, self.block_records * length // self.full_length)))

    @property
    def read_start_frac(self) -> float:
        return self.record_frac


TaskConfig = LookaheadConfig
DEFAULT = LookaheadConfig()
"""The task configuration the shipped model was trained on."""
VOCAB_SIZE = DEFAULT.vocab_size


def init_embeddings(weight: torch.Tensor, cfg: LookaheadConfig = DEFAULT) -> None:
    """Pre-training initialisation (``kvpop pretrain --task lookahead``): set the embedding of every
    ``FACT(k, v)`` to ``(E[KEY(k)] + E[VALUE(v)]) / sqrt(2)`` in place (``weight``: the ``[V, H]`` input
    embedding, tied to the LM head).  With 2048 FACT ids, each read rarely, a fact's embedding learnt
    from scratch needs far more steps than the CPU budget; this start shares the structure the dense
    model needs (a read ``KEY(k)`` matches ``FACT(k, .)``, and copying the fact's embedding predicts
    ``VALUE(v)``).  The task itself is unchanged."""
    with torch.no_grad():
        k = torch.arange(cfg.n_keys).repeat_interleave(cfg.n_values)
        v = torch.arange(cfg.n_values).repeat(cfg.n_keys)
        fact = (weight[cfg.key_base + k] + weight[cfg.value_base + v]) / 2 ** 0.5
        weight[cfg.fact_base + k * cfg.n_values + v] = fact


def make_example(seed: int, length: int, cfg: LookaheadConfig = DEFAULT) -> dict:
    """Generate one trace.

    Returns a dict with ``input_ids`` (int64 ``[L]``, from ``BOS_ID``), ``answer_positions``
    (int64 ``[n]``, the KEY tokens of the reads: the logits there are graded against
    ``input_ids[p + 1]``), ``answers``, ``labels`` (``-100`` except at ``answer_positions + 1``),
    ``fact_positions`` (int64 ``[n_facts]``, every FACT token), ``record_keep``
    (bool ``[n_records]``: whether its block is ``KEEP``), ``marker_positions`` (int64 ``[n_blocks]``),
    ``read_fact_positions`` (int64 ``[n]``, the VALUE token each read asks for), ``seed``, ``length``.
    """
    L = check_seed_length(seed, length, cfg.min_length())
    rng = np.random.default_rng([int(seed), L, 0x6C6B6864])
    ids = filler(rng, L, cfg.n_filler, cfg.restart_prob) + cfg.filler_base
    ids[0] = BOS_ID

    # Blocks: one per slot of the record region; consecutive starts are >= block_period apart.
    R = cfg.records_per_block(L)
    n_b = cfg.n_blocks_for(L)
    record_end = int(round(cfg.record_frac * L))
    slot = (record_end - 8) // n_b
    span = min(slot, cfg.block_period)
    starts_b = 8 + np.arange(n_b) * slot + rng.integers(0, max(1, slot - span + 1), size=n_b)
    keep = np.zeros(n_b, dtype=bool)
    keep[rng.permutation(n_b)[:cfg.n_keep_for(n_b)]] = True
    keys = rng.choice(cfg.n_keys, size=n_b * R, replace=False)
    vals = rng.integers(0, cfg.n_values, size=n_b * R)
    step = cfg.fact_gap + 1
    fpos = (starts_b[:, None] + step * np.arange(R)[None, :]).reshape(-1)
    mpos = starts_b + step * R
    if mpos[-1] >= L:
        raise ValueError(f"length {L} too short for a block of {R} records")
    ids[fpos] = cfg.fact_base + keys * cfg.n_values + vals
    ids[mpos] = np.where(keep, cfg.keep_id, cfg.drop_id)
    rec_keep = np.repeat(keep, R)

    # Reads: one per slot of the read region; keys of KEEP records, each once before any repeats.
    n_r = cfg.n_reads_for(L)
    read_start = max(record_end, int(mpos[-1]) + 1)
    rslot = (L - read_start) // n_r
    if rslot < 2:
        raise ValueError(f"length {L} too short for {n_r} reads")
    rpos = read_start + np.arange(n_r) * rslot + rng.integers(0, rslot - 1, size=n_r)
    kept = np.flatnonzero(rec_keep)
    order = np.concatenate([rng.permutation(kept) for _ in range(-(-n_r // len(kept)))])[:n_r]
    ids[rpos] = cfg.key_base + keys[order]
    ids[rpos + 1] = cfg.value_base + vals[order]

    return {
        **graded_fields(ids, rpos),
        "fact_positions": torch.from_numpy(fpos.astype(np.int64)),
        "record_keep": torch.from_numpy(rec_keep),
        "marker_positions": torch.from_numpy(mpos.astype(np.int64)),
        "read_fact_positions": torch.from_numpy(fpos[order].astype(np.int64)),
        "seed": int(seed),
        "length": L,
    }


_STACKED = ("input_ids", "answer_positions", "answers", "labels", "fact_positions", "record_keep",
            "marker_positions", "read_fact_positions")


def make_batch(seeds: Iterable[int], length: int, cfg: LookaheadConfig = DEFAULT) -> dict:
    """Stack :func:`make_example` for each seed (one length, so every field stacks)."""
    exs = [make_example(int(s), length, cfg) for s in seeds]
    if not exs:
        raise ValueError("seeds is empty")
    out = {k: torch.stack([e[k] for e in exs]) for k in _STACKED}
    out["seeds"] = [e["seed"] for e in exs]
    out["length"] = int(length)
    return out


def accuracy(logits: torch.Tensor, example: dict) -> float:
    """Fraction of graded positions whose greedy prediction is the answer (as the first task)."""
    return task_accuracy(logits, example)


def describe(cfg: LookaheadConfig = DEFAULT) -> str:
    """One-paragraph human description of the task (for reports and results.json)."""
    return (f"lookahead-trace: up to {cfg.max_blocks} blocks of {cfg.block_records} facts FACT(key,value), "
            f"each block followed by a KEEP ({cfg.keep_frac:.0%} of blocks) or DROP marker, in the first "
            f"{cfg.record_frac:.0%} of the sequence; reads KEY->VALUE of KEEP facts only in the rest "
            f"(one per {cfg.read_spacing} tokens); {cfg.n_keys} keys (distinct per sequence), "
            f"{cfg.n_values} values, vocab {cfg.vocab_size}")
