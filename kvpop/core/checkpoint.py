"""``save_scorers`` / ``load_scorers``: the learned part of a patched model in one safetensors file.

File layout: one tensor per scorer parameter, named ``layers.{layer_idx}.{name}`` with ``name`` as in
the ``KVpopLayer``'s ``state_dict`` (``scorer.mlp.w1``, ``decay_logit`` ...), saved in float32.
Metadata (strings): ``format = "kvpop-scorers/1"``, ``kvpop_config`` (``KVpopConfig.to_json()``),
``num_layers``, ``num_kv_heads``, ``head_dim``; a file written by ``kvpop train`` also ``step`` (the
optimiser step of the weights, decimal: :func:`read_step`).

The model weights are not in this file: fine-tuned model weights go through transformers'
``save_pretrained`` of the *unpatched* model (or of a patched one: the scorer tensors then ride
along under ``...self_attn.kvpop.``).

The safetensors side of every method's layer file (write atomically, check the header, the tensors and
their fit before the model is touched) is :class:`LayerFile`; DMS's gate file uses it too.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import KVpopConfig
from .files import atomic_write
from .layer import kvpop_layers
from .patching import get_config, is_patched, patch, unpatch

__all__ = ["save_scorers", "load_scorers", "read_scorer_config", "rewrite_scorer_config", "read_step", "FORMAT",
           "MAX_ABS_WEIGHT", "STEP_KEY", "LayerFile"]

FORMAT = "kvpop-scorers/1"

MAX_ABS_WEIGHT = 1e6
"""The largest magnitude a layer file's tensor may hold: finite weights past it (e.g. ``3e38``) overflow
the scores to inf and the score loss to NaN."""


@dataclass(frozen=True)
class LayerFile:
    """One kind of safetensors file holding a method's per-layer tensors (``layers.{idx}.{name}``, float32)
    with the config as JSON in the metadata.

    format: the metadata ``format`` value; config_key: the metadata key of the config; label: what the
    file is, for errors ("kvpop scorer file"); noun: the same without the method ("scorer file");
    writer, default_name: the function that writes one and its usual file name (for the directory hint).
    """

    format: str
    config_key: str
    label: str
    noun: str
    writer: str
    default_name: str

    def save(self, layers: list[nn.Module], config: Any, path: str | os.PathLike, *, step: int | None = None,
             **meta: str) -> None:
        """Write ``layers``' state dicts and ``config`` (``.to_json()``) to ``path`` atomically (a failed write
        leaves the previous file); ``step``: the training step of the weights, stamped as metadata
        :data:`STEP_KEY` (:func:`read_step`)."""
        from safetensors.torch import save

        if step is not None:
            meta[STEP_KEY] = str(_step(step))
        tensors = {f"layers.{la.layer_idx}.{n}": t.detach().to(device="cpu", dtype=torch.float32).contiguous()
                   for la in layers for n, t in la.state_dict().items()}
        meta = {"format": self.format, self.config_key: config.to_json(), "num_layers": str(len(layers)), **meta}
        data = save(tensors, metadata=meta)
        atomic_write(path, lambda f: f.write(data))

    def check_path(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        if path.is_dir():
            hint = (" (e.g. " + str(path / self.default_name) + ")") if (path / self.default_name).is_file() else ""
            raise ValueError(f"{path} is a directory; give the {self.noun} written by {self.writer}{hint}")
        if not path.is_file():
            raise FileNotFoundError(f"no {self.noun} at {path}")
        return path

    def read_config(self, path: str | os.PathLike, config_type: type) -> Any:
        """The ``config_type`` stored in the file (``config_type.from_json``; ValueError when the file is not one)."""
        from safetensors import safe_open

        path = self.check_path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # safetensors raises its own error types for a file that is not one
            raise ValueError(f"{path} is not a {self.label} (not a safetensors file: {e})") from None
        if meta.get("format") != self.format or self.config_key not in meta:
            raise ValueError(f"{path} is not a {self.label} (metadata format={meta.get('format')!r}, "
                             f"expected {self.format!r})")
        try:
            return config_type.from_json(meta[self.config_key])
        except RecursionError:
            raise ValueError(f"{self.noun} {path}: its {self.config_key} metadata is not a valid "
                             f"{config_type.__name__} as JSON (nested too deep to read)") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{self.noun} {path}: its {self.config_key} metadata is not a valid "
                             f"{config_type.__name__} as JSON ({type(e).__name__}: {str(e)[:300]})") from None

    def rewrite_config(self, path: str | os.PathLike, config: Any) -> None:
        """Write ``config`` (``.to_json()``) into the file at ``path`` in place of its own, tensors and other
        metadata unchanged (atomically); ValueError when the file is not one."""
        from safetensors import safe_open
        from safetensors.torch import load_file, save

        path = self.check_path(path)
        self.read_config(path, type(config))  # the file is one of this kind
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        meta[self.config_key] = config.to_json()
        data = save(load_file(str(path)), metadata=meta)
        atomic_write(path, lambda f: f.write(data))

    def read_tensors(self, path: str | os.PathLike) -> dict[str, torch.Tensor]:
        """The file's tensors, each checked to be floating point and finite."""
        from safetensors.torch import load_file

        try:
            saved = load_file(str(path))
        except Exception as e:
            raise ValueError(f"cannot read the tensors of {self.noun} {path}: {e}") from None
        for key, t in saved.items():
            if not t.is_floating_point():
                raise ValueError(f"{self.noun} {path}: tensor {key} has dtype {t.dtype}, expected floating point")
            if not bool(torch.isfinite(t).all()):
                n = int((~torch.isfinite(t)).sum())
                raise ValueError(f"{self.noun} {path}: tensor {key} holds {n} non-finite value(s) (NaN or inf); "
                                 f"the layers it was saved from diverged")
            big = float(t.abs().max()) if t.numel() else 0.0
            if big > MAX_ABS_WEIGHT:
                raise ValueError(f"{self.noun} {path}: tensor {key} holds a value of magnitude {big:.3g}, above "
                                 f"{MAX_ABS_WEIGHT:g}: no trained layer has such weights (its scores would "
                                 f"overflow float32); the file is damaged or the run that wrote it diverged")
        return saved

    def fit(self, layers: list[nn.Module], saved: dict[str, torch.Tensor], path: str | os.PathLike,
            strict: bool = True) -> dict[str, torch.Tensor]:
        """The layers' tensors by file key, once ``saved`` is known to fit them (else ValueError)."""
        expected = {f"layers.{la.layer_idx}.{n}": t for la in layers for n, t in la.state_dict().items()}
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if strict and (missing or unexpected):
            raise ValueError(f"{self.noun} {path} does not fit the model: missing {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                             f"{' ...' if len(unexpected) > 8 else ''} (another number of layers or layer type?)")
        for key, t in expected.items():
            if key in saved and saved[key].shape != t.shape:
                raise ValueError(f"{self.noun} {path}: tensor {key} has shape {tuple(saved[key].shape)}, the model "
                                 f"needs {tuple(t.shape)} (another number of KV heads, head size or hidden size?)")
        return expected

    def load(self, model: nn.Module, path: str | os.PathLike, *, attach: Callable[[], Any],
             detach: Callable[[], Any], check: Callable[[], list[nn.Module]], strict: bool = True) -> nn.Module:
        """Read and check the whole file, ``attach()`` the method, ``check()`` its fit (returns the layers),
        copy the tensors in.  After an error the model is ``detach()``-ed again (when ``attach`` was run)."""
        path = Path(path)
        saved = self.read_tensors(path)
        attach()
        try:
            expected = self.fit(check(), saved, path, strict)
        except Exception:
            detach()
            raise
        with torch.no_grad():
            for key, t in expected.items():
                if key in saved:
                    t.copy_(saved[key].to(device=t.device, dtype=t.dtype))
        return model


STEP_KEY = "step"
"""The metadata key of a layer file (scorers, DMS gates) that holds the training step of its weights, as
a decimal string; ``kvpop train`` writes it (and ``model/kvpop_step.json`` beside the fine-tuned model,
:data:`kvpop.training.runstate.MODEL_STEP_FILE`), so that outputs of different steps are not paired."""


def _step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return step


def read_step(path: str | os.PathLike) -> int | None:
    """The training step stamped into a layer file (``scorers.safetensors``, ``gates.safetensors``) by
    ``kvpop train``, or ``None`` for a file without one (written by ``save_scorers`` without ``step``, or
    before the stamp existed); ``ValueError`` naming the file when it is not safetensors or the stamp is not
    a decimal int."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a file that is not one
        raise ValueError(f"{path} is not a safetensors file ({e})") from None
    if STEP_KEY not in meta:
        return None
    v = meta[STEP_KEY]
    if not (isinstance(v, str) and v.isdigit() and len(v) < 20):
        raise ValueError(f"{path}: its {STEP_KEY!r} metadata is {str(v)[:40]!r}, not a step (a decimal int >= 0)")
    return int(v)


SCORERS = LayerFile(format=FORMAT, config_key="kvpop_config", label="kvpop scorer file", noun="scorer file",
                    writer="kvpop.save_scorers", default_name="scorers.safetensors")


def save_scorers(model: nn.Module, path: str | os.PathLike, *, step: int | None = None) -> None:
    """Write the scorers and decays of a patched ``model`` to ``path`` (safetensors, written atomically);
    ``step``: the training step of the weights, stamped in the metadata (:func:`read_step`)."""
    layers = kvpop_layers(model)
    SCORERS.save(layers, get_config(model), path, step=step, num_kv_heads=str(layers[0].num_kv_heads),
                 head_dim=str(layers[0].head_dim))


def read_scorer_config(path: str | os.PathLike) -> KVpopConfig:
    """The ``KVpopConfig`` stored in a scorer file (ValueError when the file is not one)."""
    return SCORERS.read_config(path, KVpopConfig)


def rewrite_scorer_config(path: str | os.PathLike, config: KVpopConfig) -> None:
    """Store ``config`` in the scorer file at ``path`` in place of its own (the weights unchanged); its scorer
    structure must be the file's (``KVpopConfig.structural_mismatch``), else ValueError naming the fields."""
    if not isinstance(config, KVpopConfig):
        raise TypeError(f"config must be a kvpop.KVpopConfig, got {type(config).__name__}")
    bad = config.structural_mismatch(read_scorer_config(path))
    if bad:
        raise ValueError(f"scorer file {path}: the new config changes the scorer's structure ({bad}); only the cache "
                         f"shape and training options may change")
    SCORERS.rewrite_config(path, config)


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
    was_patched = is_patched(model)

    def check() -> list[nn.Module]:
        cfg = get_config(model)
        bad = cfg.structural_mismatch(saved_cfg)
        if bad:
            raise ValueError(
                f"scorer file {path} was saved with another scorer structure: "
                + ", ".join(f"{n}: file {getattr(saved_cfg, n)!r} vs model {getattr(cfg, n)!r}" for n in bad)
            )
        return kvpop_layers(model)

    return SCORERS.load(model, path, attach=lambda: was_patched or patch(model, saved_cfg),
                        detach=lambda: was_patched or unpatch(model), check=check, strict=strict)
