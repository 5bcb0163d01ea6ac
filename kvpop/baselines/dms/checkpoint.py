"""``save_dms`` / ``load_dms``: the gates of a DMS-patched model in one safetensors file (the layer file
of :mod:`kvpop.core.checkpoint`: tensors ``layers.{idx}.gate.weight|bias``, the config in the metadata)."""
from __future__ import annotations

import os
from typing import Any

from torch import nn

from kvpop.core.checkpoint import LayerFile

from .config import DMSConfig
from .gates import dms_layers
from .patching import get_dms_config, is_dms_patched, patch_dms, unpatch_dms

__all__ = ["FORMAT", "GATES", "GATE_FILE", "save_dms", "read_dms_config", "load_dms"]

FORMAT = "kvpop-dms-gates/1"
GATES = "gates.safetensors"
"""The gate file's name in a run or checkpoint directory."""


GATE_FILE = LayerFile(format=FORMAT, config_key="dms_config", label="DMS gate file", noun="DMS gate file",
                      writer="kvpop.baselines.dms.save_dms", default_name=GATES)


def save_dms(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the gates of a DMS-patched model (safetensors, the config in the metadata, atomically)."""
    GATE_FILE.save(dms_layers(model), get_dms_config(model), path)


def read_dms_config(path: str | os.PathLike) -> DMSConfig:
    """The ``DMSConfig`` stored in a gate file (ValueError when the file is not one)."""
    return GATE_FILE.read_config(path, DMSConfig)


def load_dms(model: nn.Module, path: str | os.PathLike, **overrides: Any) -> nn.Module:
    """Load gates saved by :func:`save_dms` (patching the model with the file's config and ``overrides``).

    The file is checked in full (header, finite float tensors, names and shapes) before the gates are
    written; after an error the model is as it was (unpatched, or patched with its previous config).
    """
    cfg = read_dms_config(path).replace(**overrides)
    prev = get_dms_config(model) if is_dms_patched(model) else None
    return GATE_FILE.load(model, path, attach=lambda: patch_dms(model, cfg),
                          detach=lambda: unpatch_dms(model) if prev is None else patch_dms(model, prev),
                          check=lambda: dms_layers(model))
