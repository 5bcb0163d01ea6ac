"""A synthetic long-trace recall task ("key-value trace") for testing KV-cache eviction.

Each sequence is a trace in which a few *facts* are written early and *read* much later, with
filler in between. A fact binds a key to a value; it is a single dedicated token
``FACT(key, value)``, so a learned eviction scorer can recognise it from its own key/value
vector alone. A read ("GET") is the pair ``KEY(key) VALUE(value)``: the model must predict the
value token right after the key token, which it can only do if it still sees the fact written
hundreds of tokens earlier. Filler is runs of counting tokens (``FILL(i), FILL(i+1), ...`` with
random restarts); it is predictable locally and never needs the facts.

Layout of a sequence of length ``L`` (positions count from 0)::

    0                     BOS
    1 .. 7                filler (so that the sinks, positions 0..3, hold no fact)
    [8, fact_end)         ``n_facts`` FACT tokens at random distinct positions, filler elsewhere
    [fact_end, read_start) filler only
    [read_start, L)       ``n_reads`` reads ``KEY(k) VALUE(v)`` at random places, filler elsewhere

with ``fact_end = round(fact_frac * L)`` and ``read_start = round(read_frac * L)``. Every read
asks about a key written in this sequence, so the distance between a read and its fact is at
least ``(read_frac - fact_frac) * L`` (0.1 L by default): a recent window of a fixed budget
below that does not contain it. Each key is written at most once per sequence, so the answer is
unique. ``n_facts`` and ``n_reads`` grow with ``L`` up to their caps
(:meth:`TaskConfig.n_facts_for`, :meth:`TaskConfig.n_reads_for`), so the same generator gives
curriculum stages (short sequences) and generalisation tests (2x the training length).

The graded positions are the KEY tokens of the reads: ``answer_positions[i] = p`` means that the
logits at position ``p`` predict ``input_ids[p + 1]`` (a VALUE token). Accuracy is the fraction of
graded positions whose greedy argmax over the whole vocabulary equals that token.

Train, test and validation examples come from disjoint seed ranges: train seeds are
``[0, TEST_SEED_BASE)``, test seeds ``TEST_SEED_BASE + i`` and validation seeds
``VALID_SEED_BASE + i``. The generator is seeded by ``(seed, length)``, so it is deterministic and
independent across lengths.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "SHIPPED_MODEL",
    "TaskConfig",
    "DEFAULT",
    "VOCAB_SIZE",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "TEST_SEED_BASE",
    "VALID_SEED_BASE",
    "NAME",
    "TRAIN_LEN",
    "valid_seed",
    "make_example",
    "make_batch",
    "accuracy",
    "train_seed",
    "test_seed",
    "describe",
    "TaskBatches",
]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
N_SPECIAL = 4  # ids 0..3 are special (3 is reserved)

SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "data" / "tiny_qwen3"
"""The tiny Qwen3 trained densely on this task (``kvpop pretrain``), shipped with the package."""

NAME = "kvtrace"
TRAIN_LEN = 2048
"""The training length ``L_train`` of the shipped model."""
DEMO_GRID = {"k": (4, 16, 64), "lr_scorer": (1e-2, 3e-2), "steps": (100, 200), "joint_lr_model": (1e-4, 1e-3),
             "finetune_lr_model": (1e-4, 1e-3), "finetune_steps": (30, 100), "label": ("mean", "max"),
             "decay_span": (None, 8.0), "label_lr_scorer": (1e-2,), "label_steps": (200,), "eval_every": (50,),
             "patience": (0,)}
"""``kvpop demo --select``'s candidates on this task (``SELECT_GRID``'s keys, :mod:`kvpop.demo.grid`): every
training setting searched, two or three values each (the evaluation's batched TOVA/H2O decoding left the CPU time
for it). The label family (``--select-stage label``): mean and max label, the paper's decay range and one tied to
the training length (8 nats over a token's life), 200 steps validated every 50, the best state kept."""

TEST_SEED_BASE = 1_000_000_000
"""Seeds ``>= TEST_SEED_BASE`` are test seeds; training uses seeds below it."""
VALID_SEED_BASE = 1_500_000_000
"""Validation seeds are ``VALID_SEED_BASE + i``: disjoint from the training and the test seeds."""


class TokenIds:
    """Token ids shared by the synthetic tasks: specials, then ``n_keys`` KEY ids, ``n_values`` VALUE ids,
    ``n_keys * n_values`` FACT ids; a task puts its other ids from :attr:`extra_base` on, the filler last.
    Also the parts of a task config both tasks share: the reads after :attr:`read_start_frac` of a sequence
    (:meth:`n_reads_for`), :meth:`min_length` and :meth:`to_dict` (a task config is a dataclass)."""

    n_keys: int
    n_values: int
    n_filler: int
    read_spacing: int
    max_reads: int

    # ---- token ids -------------------------------------------------------------------------
    @property
    def key_base(self) -> int:
        return N_SPECIAL

    @property
    def value_base(self) -> int:
        return self.key_base + self.n_keys

    @property
    def fact_base(self) -> int:
        return self.value_base + self.n_values

    @property
    def extra_base(self) -> int:
        return self.fact_base + self.n_keys * self.n_values

    @property
    def filler_base(self) -> int:
        return self.extra_base

    @property
    def vocab_size(self) -> int:
        """Number of token ids used, rounded up to a multiple of 64."""
        n = self.filler_base + self.n_filler
        return (n + 63) // 64 * 64

    def key_id(self, k: int) -> int:
        return self.key_base + k

    def value_id(self, v: int) -> int:
        return self.value_base + v

    def fact_id(self, k: int, v: int) -> int:
        return self.fact_base + k * self.n_values + v

    # ---- the read region ---------------------------------------------------------------------
    @property
    def read_start_frac(self) -> float:
        """The reads happen in ``[round(read_start_frac * L), L)``."""
        raise NotImplementedError

    def n_reads_for(self, length: int) -> int:
        """Number of reads (graded positions) in a sequence of ``length`` tokens."""
        region = length - int(round(self.read_start_frac * length))
        return int(max(1, min(self.max_reads, region // self.read_spacing)))

    def min_length(self) -> int:
        return 64

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TaskConfig(TokenIds):
    """Parameters of the key-value trace task.

    Attributes:
        n_keys: size of the key vocabulary.
        n_values: size of the value vocabulary (chance accuracy is ``1 / n_values``).
        n_filler: size of the filler vocabulary.
        max_facts: most facts per sequence (reached at ``L >= max_facts * fact_spacing / fact_frac``).
        fact_spacing: at most one fact per this many tokens of the fact region.
        read_spacing: on average one read per this many tokens of the read region.
        max_reads: most reads per sequence.
        fact_frac: facts are written in ``[8, fact_frac * L)``.
        read_frac: reads happen in ``[read_frac * L, L)``.
        restart_prob: probability that a filler run restarts at a random filler token.
    """

    n_keys: int = 32
    n_values: int = 16
    n_filler: int = 64
    max_facts: int = 16
    fact_spacing: int = 8
    read_spacing: int = 8
    max_reads: int = 256
    fact_frac: float = 0.4
    read_frac: float = 0.5
    restart_prob: float = 0.1

    # ---- sizes for a length ----------------------------------------------------------------
    def n_facts_for(self, length: int) -> int:
        """Number of facts written in a sequence of ``length`` tokens."""
        region = int(round(self.fact_frac * length)) - 8
        return int(max(1, min(self.max_facts, self.n_keys, region // self.fact_spacing)))

    @property
    def read_start_frac(self) -> float:
        return self.read_frac


DEFAULT = TaskConfig()
"""The task configuration the shipped model was trained on."""
VOCAB_SIZE = DEFAULT.vocab_size
"""Vocabulary size of :data:`DEFAULT` (640)."""


def train_seed(i: int) -> int:
    """The ``i``-th training seed (``i >= 0``)."""
    return int(i) % TEST_SEED_BASE


def test_seed(i: int) -> int:
    """The ``i``-th test seed (``i >= 0``); disjoint from every training seed."""
    return TEST_SEED_BASE + int(i)


def check_seed_length(seed: int, length: int, min_length: int) -> int:
    """``length`` as an int after checking it and ``seed`` (TypeError / ValueError naming the value)."""
    if not isinstance(length, (int, np.integer)) or isinstance(length, bool):
        raise TypeError(f"length must be an int, got {type(length).__name__}")
    if length < min_length:
        raise ValueError(f"length must be >= {min_length}, got {length}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return int(length)


def filler(rng: np.random.Generator, length: int, n_filler: int, restart_prob: float) -> np.ndarray:
    """Filler ids ``0 .. n_filler - 1`` (int64 ``[length]``): counting runs that restart at a random id
    with probability ``restart_prob`` per position."""
    restarts = rng.random(length) < restart_prob
    starts = rng.integers(0, n_filler, size=length)
    fill = np.empty(length, dtype=np.int64)
    cur = int(starts[0])
    for i in range(length):
        if restarts[i]:
            cur = int(starts[i])
        fill[i] = cur
        cur = (cur + 1) % n_filler
    return fill


def graded_fields(ids: np.ndarray, read_positions: np.ndarray) -> dict:
    """``input_ids``, ``answer_positions`` (the reads' KEY tokens), ``answers`` (the tokens after them)
    and ``labels`` (``-100`` except at the answers) of a sequence ``ids``."""
    input_ids = torch.from_numpy(ids)
    answer_positions = torch.from_numpy(read_positions.astype(np.int64))
    labels = torch.full((len(ids),), -100, dtype=torch.int64)
    labels[answer_positions + 1] = input_ids[answer_positions + 1]
    return {"input_ids": input_ids, "answer_positions": answer_positions,
            "answers": input_ids[answer_positions + 1].clone(), "labels": labels}


def valid_seed(i: int) -> int:
    """The ``i``-th validation seed (for choosing training settings); disjoint from the training seeds
    and from ``test_seed(0 .. 5e8 - 1)``."""
    return VALID_SEED_BASE + int(i)


def make_example(seed: int, length: int, cfg: TaskConfig = DEFAULT) -> dict:
    """Generate one trace.

    Args:
        seed: non-negative int; ``< TEST_SEED_BASE`` for training, ``>= TEST_SEED_BASE`` for tests.
        length: sequence length ``L`` (``>= 64``).
        cfg: task parameters.

    Returns:
        dict with
          - ``input_ids``: int64 ``[L]``, starting with ``BOS_ID``.
          - ``answer_positions``: int64 ``[n]`` (``n = cfg.n_reads_for(L)``), increasing; the
            logits at ``p`` are graded against ``input_ids[p + 1]``.
          - ``answers``: int64 ``[n]``, ``input_ids[answer_positions + 1]`` (VALUE tokens).
          - ``fact_positions``: int64 ``[n_facts]``, positions of the FACT tokens (increasing).
          - ``read_fact_positions``: int64 ``[n]``, for each read the position of its fact.
          - ``labels``: int64 ``[L]``, next-token targets for causal-LM training in the
            transformers convention (``labels[p + 1] = answer`` for graded ``p``, -100 elsewhere),
            i.e. ``model(input_ids, labels=labels)`` trains on the answers only.
          - ``seed``, ``length``: the arguments.
    """
    L = check_seed_length(seed, length, cfg.min_length())
    rng = np.random.default_rng([int(seed), L, 0x6B7670])
    ids = filler(rng, L, cfg.n_filler, cfg.restart_prob) + cfg.filler_base
    ids[0] = BOS_ID

    # Facts.
    n_f = cfg.n_facts_for(L)
    fact_end = int(round(cfg.fact_frac * L))
    keys = rng.choice(cfg.n_keys, size=n_f, replace=False)
    vals = rng.integers(0, cfg.n_values, size=n_f)
    slots = (fact_end - 8) // n_f  # one fact in each slot, at a random offset
    fpos = 8 + np.arange(n_f) * slots + rng.integers(0, slots, size=n_f)
    ids[fpos] = cfg.fact_base + keys * cfg.n_values + vals

    # Reads: one per slot of the read region, a (KEY, VALUE) pair at a random offset.
    n_r = cfg.n_reads_for(L)
    read_start = int(round(cfg.read_frac * L))
    rslot = (L - read_start) // n_r
    rpos = read_start + np.arange(n_r) * rslot + rng.integers(0, rslot - 1, size=n_r)
    which = rng.integers(0, n_f, size=n_r)
    ids[rpos] = cfg.key_base + keys[which]
    ids[rpos + 1] = cfg.value_base + vals[which]

    return {
        **graded_fields(ids, rpos),
        "fact_positions": torch.from_numpy(fpos.astype(np.int64)),
        "read_fact_positions": torch.from_numpy(fpos[which].astype(np.int64)),
        "seed": int(seed),
        "length": L,
    }


def make_batch(seeds: Iterable[int], length: int, cfg: TaskConfig = DEFAULT) -> dict:
    """Stack :func:`make_example` for each seed (all of one length, so all fields stack).

    Returns the same keys as :func:`make_example`, each tensor with a leading batch dim ``B``
    (``input_ids``/``labels`` ``[B, L]``, ``answer_positions``/``answers`` ``[B, n]``,
    ``fact_positions`` ``[B, n_facts]``), ``seeds`` (list) and ``length``.
    """
    exs = [make_example(int(s), length, cfg) for s in seeds]
    if not exs:
        raise ValueError("seeds is empty")
    out = {k: torch.stack([e[k] for e in exs]) for k in
           ("input_ids", "answer_positions", "answers", "fact_positions",
            "read_fact_positions", "labels")}
    out["seeds"] = [e["seed"] for e in exs]
    out["length"] = int(length)
    return out


def _graded(logits: torch.Tensor, example: dict) -> tuple[torch.Tensor, torch.Tensor]:
    pos = example["answer_positions"]
    ans = example.get("answers")
    ids = example["input_ids"]
    if logits.dim() == 2:
        logits, pos, ids = logits[None], pos[None], ids[None]
        ans = None if ans is None else ans[None]
    if logits.dim() != 3:
        raise ValueError(f"logits must be [L, V] or [B, L, V], got shape {tuple(logits.shape)}")
    if pos.dim() != 2 or pos.shape[0] != logits.shape[0]:
        raise ValueError(f"answer_positions shape {tuple(pos.shape)} does not match logits "
                         f"{tuple(logits.shape)}")
    if ans is None:
        ans = torch.gather(ids.to(logits.device), 1, pos.to(logits.device) + 1)
    pred = torch.gather(logits.argmax(-1), 1, pos.to(logits.device))
    return pred, ans.to(logits.device)


def accuracy(logits: torch.Tensor, example: dict) -> float:
    """Fraction of graded positions whose greedy prediction is the answer.

    Args:
        logits: ``[L, V]`` or ``[B, L, V]`` (any float dtype) for an example from
            :func:`make_example` or a batch from :func:`make_batch`.
        example: the example/batch dict (uses ``answer_positions`` and ``answers`` or
            ``input_ids``).

    Returns:
        float in [0, 1]: mean over all graded positions of ``argmax(logits[p]) == input_ids[p+1]``.
    """
    pred, ans = _graded(logits, example)
    return float((pred == ans).float().mean().item())


def describe(cfg: TaskConfig = DEFAULT) -> str:
    """One-paragraph human description of the task (for reports and results.json)."""
    return (f"kv-trace: {cfg.max_facts} facts FACT(key,value) written in the first "
            f"{cfg.fact_frac:.0%} of the sequence among counting filler, read as KEY->VALUE in the "
            f"last {1 - cfg.read_frac:.0%} (one read per {cfg.read_spacing} tokens); "
            f"{cfg.n_keys} keys, {cfg.n_values} values, vocab {cfg.vocab_size}")


# --------------------------------------------------------------------------- training batches
# Batch ``i`` holds the examples of the training seeds ``i * B .. i * B + B - 1``; an endless
# re-iterable of lazy batches, so fast-forwarding over consumed batches on ``--resume`` costs nothing.
class _LazyBatch(dict):
    """A batch dict whose ``input_ids`` is generated at the first access (skipped batches cost nothing)."""

    def __init__(self, index: int, batch_size: int, seq_len: int, task_cfg: Any, make: Any = None) -> None:
        super().__init__()
        self._args = (index, batch_size, seq_len, task_cfg, make or make_batch)

    def __missing__(self, key: str) -> Any:
        i, b, L, cfg, make = self._args
        batch = make([train_seed(i * b + j) for j in range(b)], L, cfg)
        self.update(batch)
        return batch[key]


class TaskBatches:
    """Endless re-iterable of ``{"input_ids": [B, seq_len], ...}`` batches of the synthetic task (another task's
    with its ``make_batch`` and config: ``kvpop.demo.lookahead_task``'s, whose training seeds are this task's)."""

    def __init__(self, seq_len: int, batch_size: int, task_cfg: Any = None, *, make_batch: Any = None) -> None:
        self.task_cfg = task_cfg or DEFAULT
        self.make_batch = make_batch
        if seq_len < self.task_cfg.min_length():
            raise ValueError(f"--task needs --seq-len >= {self.task_cfg.min_length()}, got {seq_len}")
        self.seq_len, self.batch_size = seq_len, batch_size

    def __iter__(self) -> Iterator[dict]:
        i = 0
        while True:
            yield _LazyBatch(i, self.batch_size, self.seq_len, self.task_cfg, self.make_batch)
            i += 1
