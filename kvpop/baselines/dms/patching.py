"""``patch_dms`` / ``unpatch_dms``: DMS's patch lifecycle, through the one every method shares
(:mod:`kvpop.core.lifecycle`)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvpop.core import lifecycle as L

from .attention import DMS_ATTN_NAME, register
from .cache import DMSCache
from .config import DMSConfig
from .gates import DMSLayer

__all__ = ["SPEC", "patch_dms", "unpatch_dms", "is_dms_patched", "get_dms_config", "make_dms_teacher"]

SPEC = L.register_spec(L.PatchSpec(
    name="dms", config_type=DMSConfig, submodule="dms", layer_type=DMSLayer, attn_name=DMS_ATTN_NAME,
    state_attr="_kvpop_dms_state",
    config_attr="dms_config", cache_type=DMSCache, transient=("hidden", "active_cache"), label="DMS",
    how="call kvpop.baselines.dms.patch_dms(model) first", undo="kvpop.baselines.dms.unpatch_dms(model)"))


is_dms_patched = SPEC.carried_by
get_dms_config = SPEC.config_of
unpatch_dms = SPEC.remove


def patch_dms(model: nn.Module, config: DMSConfig | None = None, **overrides: Any) -> nn.Module:
    """Attach DMS gates to every attention layer of ``model`` (in place; idempotent) and return it.

    A DMS-patched model takes a new config (e.g. ``patch_dms(model, threshold=1.5)``) without losing its
    gates.  A KVpop-patched model raises ``ValueError`` (``kvpop.unpatch`` it first).
    """
    adapter = L.check_model(model)
    old, new = L.requested(model, SPEC, config, overrides)
    register()
    if old is not None:
        return L.reconfigure(model, SPEC, new)
    hidden_size = model.config.get_text_config().hidden_size

    def build(attn: nn.Module) -> tuple[nn.Module, list[Any]]:
        layer = DMSLayer(new, hidden_size, adapter.num_kv_heads(attn), adapter.head_dim(attn), attn.layer_idx)
        layer.to(device=adapter.weight_device(attn), dtype=torch.float32)
        return layer, [attn.register_forward_pre_hook(layer.capture, with_kwargs=True)]

    return L.install(model, SPEC, new, build, step=0)


def make_dms_teacher(model: nn.Module, *, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen dense copy of a (DMS-patched) model's current weights: the distillation teacher
    (``kvpop.make_teacher``, which removes whatever method the copy carries)."""
    return L.frozen_copy(model, device=device, dtype=dtype)
