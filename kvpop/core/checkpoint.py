"""``save_scorers`` / ``load_scorers``: the learned part of a patched model in one safetensors file.

File layout: one tensor per scorer parameter, named ``layers.{layer_idx}.{name}`` with ``name`` as in
the ``KVpopLayer``'s ``state_dict`` (``scorer.mlp.w1``, ``decay_logit`` ...), saved in float32.
Metadata (strings): ``format = "kvpop-scorers/1"``, ``kvpop_config`` (``KVpopConfig.to_json()``),
``num_layers``, ``num_kv_heads``, ``head_dim``.

The model weights are not in this file: fine-tuned model weights go through transformers'
``save_pretrained`` of the *unpatched* model (or of a patched one: the scorer tensors then ride
along under ``...self_attn.kvpop.``).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .config import KVpopConfig
from .layer import kvpop_layers
from .patching import get_config, is_patched, patch

__all__ = ["save_scorers", "load_scorers", "read_scorer_config", "FORMAT"]

FORMAT = "kvpop-scorers/1"


def save_scorers(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the scorers and decays of a patched ``model`` to ``path`` (safetensors, written atomically)."""
    from safetensors.torch import save_file

    cfg = get_config(model)
    layers = kvpop_layers(model)
    tensors = {}
    for layer in layers:
        for name, t in layer.state_dict().items():
            tensors[f"layers.{layer.layer_idx}.{name}"] = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    meta = {"format": FORMAT, "kvpop_config": cfg.to_json(), "num_layers": str(len(layers)),
            "num_kv_heads": str(layers[0].num_kv_heads), "head_dim": str(layers[0].head_dim)}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def read_scorer_config(path: str | os.PathLike) -> KVpopConfig:
    """The ``KVpopConfig`` stored in a scorer file (ValueError when the file is not one)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT or "kvpop_config" not in meta:
        raise ValueError(f"{path} is not a kvpop scorer file (metadata format={meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    return KVpopConfig.from_json(meta["kvpop_config"])


def load_scorers(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load scorers saved by :func:`save_scorers` into ``model`` (in place) and return it.

    An unpatched model is first patched with the file's config.  A patched model keeps its own config,
    which must agree with the file's on the scorer's structure (``scorer``, ``scorer_hidden``,
    ``mlstm_dim``, the gamma range, and ``window`` for the mLSTM); budget, sinks and the training
    options may differ.  Disagreeing configs, missing or unexpected tensors (``strict=True``) and
    tensors of another shape (other number of layers, KV heads or head size) raise ``ValueError``.
    """
    from safetensors.torch import load_file

    saved_cfg = read_scorer_config(path)
    if not is_patched(model):
        patch(model, saved_cfg)
    cfg = get_config(model)
    bad = cfg.structural_mismatch(saved_cfg)
    if bad:
        raise ValueError(
            f"scorer file {path} was saved with another scorer structure: "
            + ", ".join(f"{n}: file {getattr(saved_cfg, n)!r} vs model {getattr(cfg, n)!r}" for n in bad)
        )
    saved = load_file(str(path))
    layers = {layer.layer_idx: layer for layer in kvpop_layers(model)}
    expected = {}
    for idx, layer in layers.items():
        for name, t in layer.state_dict().items():
            expected[f"layers.{idx}.{name}"] = (layer, name, t)
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if strict and (missing or unexpected):
        raise ValueError(f"scorer file {path} does not fit the model: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''} (another number of layers or scorer type?)")
    for key, (layer, name, t) in expected.items():
        if key in saved and saved[key].shape != t.shape:
            raise ValueError(f"scorer file {path}: tensor {key} has shape {tuple(saved[key].shape)}, the model "
                             f"needs {tuple(t.shape)} (another number of KV heads, head size or hidden size?)")
    with torch.no_grad():
        for key, (layer, name, t) in expected.items():
            if key in saved:
                t.copy_(saved[key].to(device=t.device, dtype=t.dtype))
    return model
