"""Dense pre-training of a small Qwen3 on a JSONL data set of token ids (``kvpop pretrain --data``).

The command is ``kvpop pretrain --data TRAIN.jsonl`` (arguments: :mod:`kvpop.cli.pretrain`); this module
holds the training (:func:`pretrain_data`), the validation measure (:func:`validation_nll`: the mean
next-token NLL and its curve over positions) and the export of the trained model with its ``TRAINING.md``
(:func:`export_data_model`).

* **Data.**  ``--data`` is read with :func:`kvpop.training.data.read_jsonl` and cut into ``--seq-len``
  sequences (:func:`kvpop.training.data.chunk`).  The sequence of each batch row is fixed by the step:
  global sample ``g = step * batch + j`` is sequence ``perm_e[g mod N]`` of epoch ``e = g // N``, ``perm_e``
  a shuffle seeded by ``--seed`` and ``e`` (:func:`sample_index`), so a resumed run sees the data an
  uninterrupted one would.  ``--valid-data`` (default ``validation.jsonl`` beside ``--data`` when there is
  one) gives the validation sequences (the first ``--eval-n``).
* **Model.**  A ``Qwen3ForCausalLM`` (``--layers``, ``--hidden``, ``--heads``/``--kv-heads``,
  ``--head-dim``, ``--intermediate``, tied embeddings, ``max_position_embeddings = --max-positions``,
  default 2 ``--seq-len``).  The vocabulary is the data directory's ``manifest.json`` ``vocab`` (the corpus
  of :mod:`studies.realtext_corpus`: bytes 0..255 and specials, 260) when it has one, else the largest
  id + 1 (``--vocab-size`` overrides).
* **Loss.**  Cross-entropy of every next token; AdamW with warm-up and an optional linear cool-down
  (as ``kvpop pretrain`` on the task).
* **Outputs.**  ``OUT/ckpt.pt`` (atomic: model, optimiser, step, RNG; SIGTERM/SIGINT checkpoint and stop;
  ``--resume`` continues exactly), ``OUT/log.jsonl``, ``OUT/model`` (the best validation NLL) and
  ``OUT/model_final`` (at ``--steps``), each with ``training.json`` and ``TRAINING.md``: the command, the
  date, the wall time, the data (fingerprint, and the corpus manifest's package versions and hashes) and
  the final train / validation loss with the validation NLL per bucket of positions (does the model use
  its context?).  ``--export DIR`` copies ``OUT/model`` there.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvpop.demo.pretrain import (
    PretrainDiverged,
    PretrainSettings,
    _lr_at,
    _RunFiles,
    _save_model,
    changed_settings,
    check_args,
    check_step,
    refuse_changed,
    restore_checkpoint,
)
from kvpop.training import data as data_io
from kvpop.training.runstate import (
    StopSignals,
    atomic_save,
    rng_state,
    write_jsonl,
)

__all__ = ["sample_index", "build_lm", "validation_nll", "pretrain_data", "export_data_model", "data_manifest",
           "BUCKET"]

BUCKET = 128
"""Positions per bucket of the validation NLL curve."""
TASK_ONLY = {"curriculum": None, "advance_acc": 0.9, "min_stage_steps": 50, "filler_weight": 0.1,
             "stop_acc": 1.01, "export_lengths": None, "export_from": "model", "task": "kvtrace"}
"""Options of the synthetic-task pre-training and their defaults: with ``--data`` another value is refused."""


def sample_index(step: int, j: int, batch: int, n: int, seed: int) -> int:
    """The sequence (of ``n``) in row ``j`` of the batch of ``step`` (see the module docstring)."""
    g = step * batch + j
    epoch, k = divmod(g, n)
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[k]


def data_manifest(path: str | os.PathLike) -> dict | None:
    """The ``manifest.json`` beside a data file (:mod:`studies.realtext_corpus`), or None when there is
    none.  What is read of it is checked: ValueError naming the file and the field when it is not JSON, not an
    object, or its ``vocab`` (``vocab_size`` an int >= 1; ``bos``, ``eos``, ``pad`` token ids in
    ``[0, vocab_size)`` or null), ``package_versions`` or ``splits`` (an object of objects) is malformed."""
    m = Path(path).parent / "manifest.json"
    if not m.is_file():
        return None
    try:
        man = json.loads(m.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as e:
        what = e.msg if isinstance(e, json.JSONDecodeError) else f"{type(e).__name__}: {str(e)[:200]}"
        raise ValueError(f"{m} (the corpus manifest beside {path}) is not valid JSON ({what}); fix or remove "
                         f"it") from None
    if not isinstance(man, dict):
        raise ValueError(f"{m} holds a JSON {type(man).__name__}, not a corpus manifest (an object with 'vocab', "
                         f"'splits', ...)")
    voc = man.get("vocab", {})
    if not isinstance(voc, dict):
        raise ValueError(f"{m}: 'vocab' must be an object like {{\"vocab_size\": 260, \"bos\": 256, \"eos\": 257, "
                         f"\"pad\": 258}}, got {type(voc).__name__} {str(voc)[:60]}")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    size = voc.get("vocab_size")
    if size is not None and not (is_int(size) and size >= 1):
        raise ValueError(f"{m}: 'vocab_size' must be an int >= 1, got {size!r}")
    for k in ("bos", "eos", "pad"):
        v = voc.get(k)
        if v is not None and not (is_int(v) and 0 <= v < (size if size is not None else 2**31)):
            raise ValueError(f"{m}: {k!r} must be a token id in [0, {size if size is not None else 2**31}) or null, "
                             f"got {v!r}")
    if not isinstance(man.get("package_versions", {}), dict):
        raise ValueError(f"{m}: 'package_versions' must be an object of package: version, got "
                         f"{type(man['package_versions']).__name__}")
    splits = man.get("splits", {})
    if not isinstance(splits, dict) or not all(isinstance(e, dict) for e in splits.values()):
        raise ValueError(f"{m}: 'splits' must be an object of split name: entry objects, got {str(splits)[:60]}")
    return man


def build_lm(vocab_size: int, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
             intermediate: int, max_positions: int, rope_theta: float, seed: int,
             special: dict[str, int | None] | None = None):
    """A freshly initialised ``Qwen3ForCausalLM`` (fp32, sdpa attention, tied embeddings)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    special = special or {}
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=max_positions,
                      rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
                      tie_word_embeddings=True, bos_token_id=special.get("bos"), eos_token_id=special.get("eos"),
                      pad_token_id=special.get("pad"))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


@torch.no_grad()
def validation_nll(model, seqs: list[torch.Tensor], *, batch_size: int = 4, bucket: int = BUCKET) -> dict[str, Any]:
    """Mean next-token NLL (nats) of ``model`` over ``seqs`` (int64 ``[L]`` each, one length), and per bucket
    of ``bucket`` predicted positions (position p predicts token p + 1)."""
    was = model.training
    model.eval()
    total = None
    for i in range(0, len(seqs), batch_size):
        ids = torch.stack(seqs[i:i + batch_size])
        logits = model(ids, use_cache=False).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").double().sum(0)
        total = nll if total is None else total + nll
    model.train(was)
    per_pos = total / len(seqs)
    n = per_pos.numel()
    buckets = [{"positions": f"{a}-{min(a + bucket, n) - 1}", "nll": round(float(per_pos[a:a + bucket].mean()), 4)}
               for a in range(0, n, bucket)]
    return {"nll": round(float(per_pos.mean()), 4), "buckets": buckets, "sequences": len(seqs)}


@torch.no_grad()
def context_curve(model, seqs: list[torch.Tensor], *, windows: tuple[int, ...] = (32, 64, 128, 256, 512),
                  start: int | None = None, batch_size: int = 4) -> dict[str, Any]:
    """Does the model use its long context?  Mean next-token NLL at the positions ``>= start`` (default the
    second half of the sequences) when each query sees only the last ``w`` tokens (itself included; a band
    mask), for each ``w`` of ``windows``, and with the full causal context: the same target tokens every time,
    so a lower NLL with more context is the context's doing, not the content's."""
    L = seqs[0].numel()
    start = L // 2 if start is None else start
    out = []
    was = model.training
    model.eval()
    for w in [*(w for w in windows if w < L), L]:
        q = torch.arange(L)[:, None]
        t = torch.arange(L)[None, :]
        vis = (t <= q) & (t > q - w)
        mask = torch.zeros(1, 1, L, L)
        mask[0, 0][~vis] = float("-inf")
        total = n = 0.0
        for i in range(0, len(seqs), batch_size):
            ids = torch.stack(seqs[i:i + batch_size])
            logits = model(ids, attention_mask=mask.expand(ids.shape[0], 1, L, L), use_cache=False).logits
            nll = F.cross_entropy(logits[:, start:-1].transpose(1, 2).float(), ids[:, start + 1:], reduction="sum")
            total += float(nll)
            n += ids.shape[0] * (L - 1 - start)
        out.append({"context": "full" if w == L else w, "nll": round(total / n, 4)})
    model.train(was)
    return {"scored_from": start, "sequences": len(seqs), "rows": out}


def _command(args: PretrainSettings) -> str:
    return getattr(args, "command_line", None) or ("kvpop pretrain " + " ".join(sys.argv[2:]))


def _training_md(info: dict) -> str:
    a = info["args"]
    lines = [f"# {info['name']}: a byte-level Qwen3 pre-trained on real text", "",
             f"A {a['layers']}-layer `Qwen3ForCausalLM` (hidden {a['hidden']}, {a['heads']} query heads / "
             f"{a['kv_heads']} KV heads, head_dim {a['head_dim']}, MLP {a['intermediate']}, RoPE theta "
             f"{a['rope_theta']:g}, max_position_embeddings {info['max_positions']}, tied embeddings, vocab "
             f"{info['vocab_size']}, {info['n_params']:,} parameters, fp32) trained densely by `kvpop pretrain "
             f"--data` (`kvpop/demo/pretrain_data.py`) on {info['train_sequences']} sequences of {a['seq_len']} "
             f"tokens.", "", "## Command", "", f"    {info['command']}", "",
             f"Date: {info['date']}. Steps: {info['step']} of {a['steps']} (batch {a['batch_size']}, "
             f"{a['batch_size'] * a['seq_len']:,} tokens per step, {info['step'] * a['batch_size'] * a['seq_len']:,} "
             f"tokens in all). Wall time: {info['elapsed_s'] / 60:.1f} minutes"
             f" with {a['threads']} torch thread(s). The data of step i are fixed by i and --seed {a['seed']}.", "",
             "## Data", "", f"- train: `{info['data']}` ({info['data_fingerprint']})",
             f"- validation: `{info['valid_data']}` ({info['valid_fingerprint']}), first {info['valid']['sequences']}"
             f" sequences"]
    man = info.get("manifest")
    if man:
        lines += ["- corpus manifest (`manifest.json` beside the data): packages "
                  + ", ".join(f"{k} {v}" for k, v in man.get("package_versions", {}).items())
                  + f"; Python {man.get('python')}"]
        for s, e in man.get("splits", {}).items():
            lines.append(f"  - {s}: {e.get('records', '?')} records from {e.get('files_used', '?')} files, file list "
                         f"hash {e.get('files_used_hash', '?')}, JSONL blake2b {e.get('jsonl_blake2b', '?')}")
    v = info["valid"]
    lines += ["", "## Figures", "",
              f"- final train loss (mean of the last 20 steps): {info['train_loss']:.4f} nats/token",
              f"- validation NLL: {v['nll']:.4f} nats/token ({v['nll'] / math.log(2):.3f} bits/byte)", "",
              "Validation NLL per bucket of positions (a model that uses its context predicts later positions "
              "better):", "", "| positions | " + " | ".join(b["positions"] for b in v["buckets"]) + " |",
              "|---|" + "---|" * len(v["buckets"]),
              "| NLL (nats) | " + " | ".join(f"{b['nll']:.3f}" for b in v["buckets"]) + " |", "",
              "(The start of a record is often a file's opening, licence text and imports, easier than what "
              "follows: the curve mixes content with context.)", ""]
    cc = info.get("context_curve")
    if cc:
        lines += [f"Long context, content held fixed: validation NLL at positions >= {cc['scored_from']} of "
                  f"{cc['sequences']} sequences when each query sees only its last w tokens (a band mask), and the "
                  f"full causal context (measured by `kvpop pretrain --export`):", "",
                  "| context w | " + " | ".join(str(r["context"]) for r in cc["rows"]) + " |",
                  "|---|" + "---|" * len(cc["rows"]),
                  "| NLL (nats) | " + " | ".join(f"{r['nll']:.4f}" for r in cc["rows"]) + " |", ""]
    return "\n".join(lines)


def _save(model, path: Path, info: dict) -> None:
    """``save_pretrained`` into ``path`` (swapped in whole, as the task's pre-training does), then its
    ``training.json`` and ``TRAINING.md``."""
    _save_model(model, path, info)
    (path / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    (path / "TRAINING.md").write_text(_training_md(info))


def export_data_model(src: str | os.PathLike, dst: str | os.PathLike, *, command: str | None = None) -> dict:
    """Copy ``config.json`` and ``model.safetensors`` of ``src`` (a model ``kvpop pretrain --data`` saved) to
    ``dst`` with its ``training.json`` and ``TRAINING.md``, adding the :func:`context_curve` on its validation
    sequences.  Returns the ``training.json`` record."""
    from kvpop.models import load_model_dir

    src, dst = Path(src), Path(dst)
    names = ("config.json", "model.safetensors", "training.json")
    missing = [n for n in names if not (src / n).is_file()]
    if missing:
        raise ValueError(f"{src} lacks {missing}: export a directory kvpop pretrain --data wrote (OUT/model)")
    info = json.loads((src / "training.json").read_text())
    model = load_model_dir(src, dtype=torch.float32).eval()
    valid = data_io.chunk(data_io.read_jsonl(info["valid_data"], vocab_size=info["vocab_size"]),
                          info["args"]["seq_len"], source=info["valid_data"])[:info["valid"]["sequences"]]
    info["context_curve"] = context_curve(model, valid)
    info["export_command"] = command
    dst.mkdir(parents=True, exist_ok=True)
    for n in ("config.json", "model.safetensors"):
        shutil.copyfile(src / n, dst / n)
    (dst / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    (dst / "TRAINING.md").write_text(_training_md(info))
    return info


def _check_args(args: PretrainSettings) -> None:
    for name, default in TASK_ONLY.items():
        if getattr(args, name, default) != default:
            raise ValueError(f"--{name.replace('_', '-')} is for the synthetic task; it has no meaning with --data")
    check_args(args, data=True)


def _vocabulary(args: PretrainSettings, man: dict | None) -> tuple[list[list[int]], int]:
    """The records of ``--data`` and the vocabulary size: ``--vocab-size``, else the manifest's, else the largest
    id + 1; every id is checked against it (ValueError naming the file and line), and so are the manifest's
    special ids."""
    voc = (man or {}).get("vocab", {})
    vocab = args.vocab_size or voc.get("vocab_size")
    records = data_io.read_jsonl(args.data, vocab_size=vocab)
    source = f"--vocab-size {vocab}" if args.vocab_size else "the manifest's 'vocab_size'"
    if vocab is None:
        vocab = max((max(r) for r in records if r), default=0) + 1
        source = "the largest token id + 1"
        if any(r and min(r) < 0 for r in records):  # read again for the file and line of the first one
            data_io.read_jsonl(args.data, vocab_size=vocab)
    for k in ("bos", "eos", "pad"):
        v = voc.get(k)
        if v is not None and v >= vocab:
            raise ValueError(f"the manifest's {k!r} id {v} ({Path(args.data).parent / 'manifest.json'}) is outside "
                             f"the vocabulary [0, {vocab}) of {source}; give a --vocab-size above {v}")
    return records, vocab


def _key(seq: torch.Tensor) -> bytes:
    return hashlib.blake2b(seq.numpy().tobytes(), digest_size=16).digest()


def _held_out(args: PretrainSettings, valid_path: Path, fingerprint: str, train: list, valid: list) -> None:
    """ValueError when the validation data is the training data: the same bytes, or every validation sequence
    used also a training sequence (the same records written otherwise)."""
    name = f"--valid-data {valid_path}" if args.valid_data else f"the validation file {valid_path} (beside --data)"
    if data_io.data_fingerprint(valid_path) == fingerprint:
        raise ValueError(f"{name} holds the same bytes as the training data --data {args.data}; validation must be "
                         f"held-out data")
    seen = {_key(s) for s in train}
    if all(_key(v) in seen for v in valid):
        raise ValueError(f"{name}: each of its {len(valid)} validation sequence(s) of --seq-len {args.seq_len} is also "
                         f"a training sequence of --data {args.data}; validation must be held-out data")


def pretrain_data(args: PretrainSettings) -> int:
    """Pre-train (or resume) on ``args.data`` (the settings of ``kvpop pretrain``); returns the exit status.
    The phases: the data read and checked (:func:`_read_data`), the model and optimiser built
    (:meth:`_DataRun.build`), the resume (:meth:`_DataRun.resume`), then the steps (:meth:`_DataRun.run`)."""
    try:
        data = _read_data(args)
    except OSError as e:
        print(f"kvpop pretrain: error: cannot read {e.filename or args.data} ({e.strerror or e})", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvpop pretrain: error: {e}", file=sys.stderr)
        return 2
    run = _DataRun.build(args, data)
    if args.resume and run.ckpt_path.exists():
        try:
            run.resume()
        except ValueError as e:
            print(f"kvpop pretrain: error: {e}", file=sys.stderr)
            return 2
    elif args.resume:
        print(f"no checkpoint at {run.ckpt_path}; starting fresh", file=sys.stderr)
    if run.state["step"] == 0:
        write_jsonl(run.out / "log.jsonl", [])
    (run.out / "args.json").write_text(json.dumps(run.settings, indent=2))
    return run.run()


@dataclass
class _Data:
    """The data of a ``--data`` run, read and checked: the manifest, the vocabulary size, the training and
    validation sequences and the files' fingerprints."""

    man: dict | None
    vocab: int
    train: list
    valid: list
    valid_path: Path
    fingerprint: str
    valid_fingerprint: str


def _read_data(args: PretrainSettings) -> _Data:
    """The settings checked, the training data chunked into ``--seq-len`` sequences, the validation data (held
    out: not the training data) cut to ``--eval-n`` sequences; ValueError (OSError) naming what is wrong."""
    _check_args(args)
    man = data_manifest(args.data)
    train_records, vocab = _vocabulary(args, man)
    train = data_io.chunk(train_records, args.seq_len, source=str(args.data))
    del train_records
    fingerprint = data_io.data_fingerprint(args.data)
    valid_path = Path(args.valid_data or (Path(args.data).parent / "validation.jsonl"))
    if not valid_path.is_file():
        raise ValueError(f"no validation data: give --valid-data (there is no {valid_path})")
    valid = data_io.chunk(data_io.read_jsonl(valid_path, vocab_size=vocab), args.seq_len,
                          source=str(valid_path))[:args.eval_n]
    _held_out(args, valid_path, fingerprint, train, valid)
    valid_fingerprint = data_io.data_fingerprint(valid_path)
    if len(train) < args.batch_size:
        raise ValueError(f"{args.data} gives {len(train)} sequence(s) of {args.seq_len} tokens, fewer than "
                         f"--batch-size {args.batch_size}")
    return _Data(man, vocab, train, valid, valid_path, fingerprint, valid_fingerprint)


@dataclass
class _DataRun(_RunFiles):
    """One ``--data`` pre-training: its settings and data, the model and optimiser, the progress (``state``,
    saved in ``ckpt.pt``) and ``good_step``, the step ``ckpt.pt`` holds (finite weights only)."""

    args: PretrainSettings
    out: Path
    data: _Data
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    state: dict
    settings: dict
    max_positions: int
    good_step: int | None = None

    @classmethod
    def build(cls, args: PretrainSettings, data: _Data) -> _DataRun:
        """The run directory, the model (the manifest's special ids) and its AdamW (no decay on vectors)."""
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        special = (data.man or {}).get("vocab", {})
        max_positions = args.max_positions or 2 * args.seq_len
        model = build_lm(data.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                         max_positions=max_positions, rope_theta=args.rope_theta, seed=args.seed,
                         special={k: special.get(k) for k in ("bos", "eos", "pad")})
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
        state: dict[str, Any] = {"step": 0, "elapsed_s": 0.0, "best_valid": math.inf, "losses": [],
                                 "data_fingerprint": data.fingerprint, "valid_fingerprint": data.valid_fingerprint,
                                 "vocab_size": data.vocab, "max_positions": max_positions}
        settings = {k: v for k, v in asdict(args).items() if k not in TASK_ONLY}
        return cls(args, out, data, model, opt, state, settings, max_positions)

    def _same_run(self, ck: dict) -> None:
        """ValueError unless checkpoint ``ck`` was trained on this data with these settings."""
        args, data, ckpt_path = self.args, self.data, self.ckpt_path
        st = ck["state"] if isinstance(ck.get("state"), dict) else {}
        if st.get("data_fingerprint") != data.fingerprint:
            raise ValueError(f"{args.data} is not the data {ckpt_path} was trained on "
                             f"({st.get('data_fingerprint')} vs now {data.fingerprint})")
        if st.get("valid_fingerprint", data.valid_fingerprint) != data.valid_fingerprint:
            raise ValueError(f"{data.valid_path} is not the validation data of the run in {ckpt_path} "
                             f"({st.get('valid_fingerprint')} vs now {data.valid_fingerprint})")
        saved = ck.get("args") if isinstance(ck.get("args"), dict) else {}
        diff = changed_settings(saved, self.settings, skip=("data", "valid_data", "vocab_size", "max_positions"))
        emb = ck.get("model", {}).get("model.embed_tokens.weight") if isinstance(ck.get("model"), dict) else None
        was = {"vocab_size": st.get("vocab_size", emb.shape[0] if isinstance(emb, torch.Tensor) else None),
               "max_positions": st.get("max_positions", saved.get("max_positions")
                                       or (2 * saved["seq_len"] if isinstance(saved.get("seq_len"), int)
                                           else None))}
        now = {"vocab_size": data.vocab, "max_positions": self.max_positions}
        diff += [f"--{k.replace('_', '-')} (was {w!r}, now {now[k]!r})" for k, w in was.items()
                 if w is not None and w != now[k]]
        refuse_changed(diff, ckpt_path)

    def resume(self) -> None:
        """``ckpt.pt`` read back (ValueError for other data or settings)."""
        self.state = restore_checkpoint(self.ckpt_path, self.model, self.opt, self.out, check=self._same_run)["state"]
        self.state.setdefault("valid_fingerprint", self.data.valid_fingerprint)
        self.good_step = self.state["step"]
        print(f"resumed at step {self.state['step']}", file=sys.stderr)

    def info(self, valid_rec: dict, name: str) -> dict:
        """What ``TRAINING.md`` / ``training.json`` beside saved weights say of the run."""
        state, data, args = self.state, self.data, self.args
        tail = state["losses"][-20:]
        return {"name": name, "command": _command(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "step": state["step"], "elapsed_s": round(state["elapsed_s"], 1), "args": self.settings,
                "vocab_size": data.vocab, "max_positions": self.max_positions,
                "n_params": sum(p.numel() for p in self.model.parameters()),
                "train_sequences": len(data.train), "data": str(args.data), "data_fingerprint": data.fingerprint,
                "valid_data": str(data.valid_path), "valid_fingerprint": data_io.data_fingerprint(data.valid_path),
                "manifest": data.man, "train_loss": round(sum(tail) / max(1, len(tail)), 4), "valid": valid_rec}

    def checkpoint(self) -> None:
        self.finite_weights()
        atomic_save({"model": self.model.state_dict(), "optim": self.opt.state_dict(), "state": self.state,
                     "args": self.settings, "rng": rng_state()}, self.ckpt_path)
        self.good_step = self.state["step"]

    def step(self, t0: float, bar: Any) -> dict:
        """One optimiser step on the step's fixed sample of sequences (:class:`PretrainDiverged` before a
        non-finite one is taken); its record."""
        args, state, model, opt, train = self.args, self.state, self.model, self.opt, self.data.train
        step = state["step"]
        ids = torch.stack([train[sample_index(step, j, args.batch_size, len(train), args.seed)]
                           for j in range(args.batch_size)])
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, args)
        logits = model(ids, use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        lv = check_step(step, loss, gn, self.ckpt_path, self.good_step)
        opt.step()
        state["step"] += 1
        state["losses"] = (state["losses"] + [lv])[-20:]
        state["elapsed_s"] = time.time() - t0
        rec = {"step": state["step"], "loss": round(lv, 4), "gn": round(float(gn), 3),
               "lr": _lr_at(step, args), "t": round(state["elapsed_s"], 1)}
        if bar is not None:
            bar.set_postfix(loss=f"{lv:.3f}")
            bar.update(1)
        return rec

    def validate(self, rec: dict, done: bool, bar: Any) -> None:
        """The validation NLL into ``rec``; the best model (``model``) and at the end ``model_final`` saved."""
        state, out = self.state, self.out
        self.finite_weights()  # the models below are saved from these weights
        v = validation_nll(self.model, self.data.valid)
        rec["valid_nll"] = v["nll"]
        rec["valid_buckets"] = [b["nll"] for b in v["buckets"]]
        if v["nll"] < state["best_valid"]:
            state["best_valid"] = v["nll"]
            _save(self.model, out / "model", self.info(v, out.name + "/model"))
            rec["saved"] = True
        if done:
            _save(self.model, out / "model_final", self.info(v, out.name + "/model_final"))
        msg = json.dumps(rec)
        (bar.write(msg) if bar is not None else print(msg, flush=True))

    def run(self) -> int:
        """The steps up to ``--steps``: validations every ``--eval-every`` steps, checkpoints every
        ``--ckpt-every``, a stop on ``--max-minutes`` or a signal; the exit status."""
        from kvpop.progress import progress

        args, state = self.args, self.state
        bar = progress(args.steps, desc="kvpop pretrain --data", initial=state["step"],
                       enabled=not args.no_progress, mininterval=5.0)
        signals = StopSignals(name="kvpop pretrain").install()
        t0 = time.time() - state["elapsed_s"]
        self.model.train()
        try:
            with open(self.out / "log.jsonl", "a") as log:
                while state["step"] < args.steps:
                    rec = self.step(t0, bar)
                    done = state["step"] >= args.steps
                    if state["step"] % args.eval_every == 0 or done:
                        self.validate(rec, done, bar)
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    stop = (args.max_minutes is not None and state["elapsed_s"] > 60 * args.max_minutes) \
                        or signals.signum is not None
                    if stop or done or state["step"] % args.ckpt_every == 0:
                        self.checkpoint()
                        if stop:
                            break
            if self.good_step != state["step"]:
                self.checkpoint()
        except PretrainDiverged as e:
            print(f"kvpop pretrain: {e}", file=sys.stderr)
            return 1
        finally:
            if bar is not None:
                bar.close()
            signals.restore()
        print(json.dumps({"done": state["step"] >= args.steps, "step": state["step"],
                          "best_valid_nll": state["best_valid"], "elapsed_s": round(state["elapsed_s"], 1)}),
              flush=True)
        if signals.signum is not None:
            print(f"kvpop pretrain: stopped by a signal after step {state['step']}; {self.ckpt_path} holds it: "
                  f"run the same command with --resume to continue", file=sys.stderr)
            return 128 + signals.signum
        return 0
