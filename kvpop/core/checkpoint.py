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
from .files import atomic_write
from .layer import kvpop_layers
from .patching import get_config, is_patched, patch, unpatch

__all__ = ["save_scorers", "load_scorers", "read_scorer_config", "FORMAT", "MAX_ABS_WEIGHT"]

FORMAT = "kvpop-scorers/1"

MAX_ABS_WEIGHT = 1e6
"""The largest magnitude :func:`load_scorers` accepts in a scorer tensor: finite weights past it (e.g.
``3e38``) overflow the scores to inf and the score loss to NaN."""


def save_scorers(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the scorers and decays of a patched ``model`` to ``path`` (safetensors, written atomically:
    a failed write leaves the previous file)."""
    from safetensors.torch import save

    cfg = get_config(model)
    layers = kvpop_layers(model)
    tensors = {}
    for layer in layers:
        for name, t in layer.state_dict().items():
            tensors[f"layers.{layer.layer_idx}.{name}"] = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    meta = {"format": FORMAT, "kvpop_config": cfg.to_json(), "num_layers": str(len(layers)),
            "num_kv_heads": str(layers[0].num_kv_heads), "head_dim": str(layers[0].head_dim)}
    data = save(tensors, metadata=meta)
    atomic_write(path, lambda f: f.write(data))


def _check_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir():
        hint = " (e.g. " + str(path / "scorers.safetensors") + ")" if (path / "scorers.safetensors").is_file() else ""
        raise ValueError(f"{path} is a directory; give the scorer file written by kvpop.save_scorers{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"no scorer file at {path}")
    return path


def _read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a file that is not one
        raise ValueError(f"{path} is not a kvpop scorer file (not a safetensors file: {e})") from None


def read_scorer_config(path: str | os.PathLike) -> KVpopConfig:
    """The ``KVpopConfig`` stored in a scorer file (ValueError when the file is not one)."""
    path = _check_path(path)
    meta = _read_metadata(path)
    if meta.get("format") != FORMAT or "kvpop_config" not in meta:
        raise ValueError(f"{path} is not a kvpop scorer file (metadata format={meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    try:
        return KVpopConfig.from_json(meta["kvpop_config"])
    except RecursionError:
        raise ValueError(f"scorer file {path}: its kvpop_config metadata is not a valid KVpopConfig as JSON "
                         f"(nested too deep to read)") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"scorer file {path}: its kvpop_config metadata is not a valid KVpopConfig as JSON "
                         f"({type(e).__name__}: {str(e)[:300]})") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        saved = load_file(str(path))
    except Exception as e:
        raise ValueError(f"cannot read the tensors of scorer file {path}: {e}") from None
    for key, t in saved.items():
        if not t.is_floating_point():
            raise ValueError(f"scorer file {path}: tensor {key} has dtype {t.dtype}, expected floating point")
        if not bool(torch.isfinite(t).all()):
            n = int((~torch.isfinite(t)).sum())
            raise ValueError(f"scorer file {path}: tensor {key} holds {n} non-finite value(s) (NaN or inf); "
                             f"the scorers it was saved from diverged")
        big = float(t.abs().max()) if t.numel() else 0.0
        if big > MAX_ABS_WEIGHT:
            raise ValueError(f"scorer file {path}: tensor {key} holds a value of magnitude {big:.3g}, above "
                             f"{MAX_ABS_WEIGHT:g}: no trained scorer has such weights (its scores would overflow "
                             f"float32); the file is damaged or the run that wrote it diverged")
    return saved


def load_scorers(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load scorers saved by :func:`save_scorers` into ``model`` (in place) and return it.

    An unpatched model is first patched with the file's config.  A patched model keeps its own config,
    which must agree with the file's on the scorer's structure (``scorer``, ``scorer_hidden``,
    ``mlstm_dim``, the gamma range, and ``window`` for the mLSTM); budget, sinks and the training
    options may differ.  Disagreeing configs, missing or unexpected tensors (``strict=True``), tensors
    of another shape (other number of layers, KV heads or head size), non-finite values, a directory
    and a file that is not a scorer file raise ``ValueError`` (a missing file ``FileNotFoundError``);
    the file is checked in full before the model is touched, so after an error the model is exactly
    as it was (an unpatched model is unpatched again).
    """
    saved_cfg = read_scorer_config(path)
    path = Path(path)
    saved = _read_tensors(path)
    was_patched = is_patched(model)
    if not was_patched:
        patch(model, saved_cfg)
    try:
        expected = _check_fit(model, path, saved_cfg, saved, strict)
    except Exception:
        if not was_patched:
            unpatch(model)
        raise
    with torch.no_grad():
        for key, t in expected.items():
            if key in saved:
                t.copy_(saved[key].to(device=t.device, dtype=t.dtype))
    return model


def _check_fit(model: nn.Module, path: Path, saved_cfg: KVpopConfig, saved: dict[str, torch.Tensor],
               strict: bool) -> dict[str, torch.Tensor]:
    """The model's scorer tensors by file key, once the file is known to fit them (else ValueError)."""
    cfg = get_config(model)
    bad = cfg.structural_mismatch(saved_cfg)
    if bad:
        raise ValueError(
            f"scorer file {path} was saved with another scorer structure: "
            + ", ".join(f"{n}: file {getattr(saved_cfg, n)!r} vs model {getattr(cfg, n)!r}" for n in bad)
        )
    expected = {f"layers.{layer.layer_idx}.{name}": t
                for layer in kvpop_layers(model) for name, t in layer.state_dict().items()}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if strict and (missing or unexpected):
        raise ValueError(f"scorer file {path} does not fit the model: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''} (another number of layers or scorer type?)")
    for key, t in expected.items():
        if key in saved and saved[key].shape != t.shape:
            raise ValueError(f"scorer file {path}: tensor {key} has shape {tuple(saved[key].shape)}, the model "
                             f"needs {tuple(t.shape)} (another number of KV heads, head size or hidden size?)")
    return expected
