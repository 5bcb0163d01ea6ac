"""``kvpop.patch(model)`` / ``kvpop.unpatch(model)`` / ``with kvpop.patched(model):``: the patch lifecycle.

What ``patch`` does (transformers 5.17 .. 5.24; families: ``kvpop.models``)
    * registers, once per process, the attention function ``"kvpop"`` (``kvpop.core.attention``);
    * attaches to every attention module of the model's family a :class:`KVpopLayer` as the submodule
      ``kvpop`` (a scorer and the decay logits of its KV heads; so they appear in ``state_dict()`` and
      ``parameters()`` under ``...self_attn.kvpop.``);
    * registers a forward hook on the family's key tap (Qwen3: ``k_norm``; Qwen2, Llama: ``k_proj``)
      that hands the layer's pre-RoPE key to its ``KVpopLayer``, and a forward pre-hook on the attention
      module that hands it the cache the module is called with; the hook handles are kept;
    * sets ``model.config._attn_implementation = "kvpop"`` and remembers the previous value;
    * makes plain ``model.generate(...)`` decode through a fresh ``KVpopCache``.

``unpatch`` removes the submodules and the hooks (through their handles) and restores the previous
attention implementation: the model is then exactly the model before ``patch`` (same modules, same
``state_dict`` keys, same logits).  ``patch`` is idempotent: patching a patched model with no config
and no overrides (or with an equal config) changes nothing.  Patching a patched model with a
*different* config keeps the trained scorers and swaps the config in when the scorer's structure is
unchanged (``budget``, ``sinks``, ``mask_source``, ``tau`` ... may change; e.g.
``kvpop.patch(model, budget=4096)`` re-budgets a trained model); a structural change (``scorer``,
``scorer_hidden``, ``mlstm_dim``, the gamma range, ``window`` for the mLSTM) raises ``ValueError``: call
``kvpop.unpatch`` first (which discards the scorers).  ``kvpop.patched(model, ...)`` is the
context-manager form: patched inside the block, exactly as before after it.

Activation checkpointing: use the non-reentrant form
(``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``):
the reentrant form runs the first forward under ``no_grad``, so no layer would record ``L_score``.

Head-adaptive budgets (``KVpopConfig.head_budgets``, docs/DESIGN.md section 7): the rows must fit the
model (one per decoder layer, one budget per KV head) or ``patch`` raises ``ValueError``; on a model
whose config has them, ``patch(model, budget=X)`` needs ``head_budgets=`` too (new rows, or ``None``).

Quantised slots (``kv_dtype="int8" | "fp8"``, a ``KVpopConfig`` field: ``kvpop.patch(model, kv_dtype="int8")``):
the ``KVpopCache`` that ``generate`` builds stores keys and values in 8 bits with a float32 scale per slot and
KV head; anything but ``None``, ``"int8"`` and ``"fp8"`` raises ``ValueError``.  Re-patching with another
``kv_dtype`` keeps the scorers (it changes only the cache).

Limits: no padding in a full-sequence forward (a 2D attention mask with zeros -> ValueError), no
sliding-window layers, no attention dropout, no ``output_attentions``.

Scorers are created in float32 on the device of the attention weights; cast the model *before*
patching.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kvpop.models import SUPPORTED_MODEL_TYPES

from . import lifecycle as L
from .attention import ATTN_NAME, register
from .cache import KVpopCache
from .config import KVpopConfig, check_budget_for
from .layer import KVpopLayer
from .lifecycle import state_owner

__all__ = ["patch", "unpatch", "patched", "is_patched", "get_config", "disabled", "make_teacher",
           "SUPPORTED_MODEL_TYPES", "SPEC", "state_owner", "check_head_budgets"]

SPEC = L.register_spec(L.PatchSpec(
    name="kvpop", config_type=KVpopConfig, submodule="kvpop", layer_type=KVpopLayer, attn_name=ATTN_NAME,
    state_attr="_kvpop_state",
    config_attr="kvpop_config", cache_type=KVpopCache, transient=("active_cache", "k_pre"), label="KVpop",
    how="call kvpop.patch(model) first", undo="kvpop.unpatch(model)"))


def is_patched(model: nn.Module) -> bool:
    """True when ``model`` (or the model it wraps) carries kvpop's patch."""
    return SPEC.carried_by(model)


def get_config(model: nn.Module) -> KVpopConfig:
    """The ``KVpopConfig`` of a patched model (ValueError when it is not patched)."""
    return SPEC.config_of(model)


def patch(model: nn.Module, config: KVpopConfig | None = None, **overrides: Any) -> nn.Module:
    """Patch a transformers model in place for KVpop and return it.

    Args:
        model: a ``PreTrainedModel`` of a supported family (``config.model_type`` in
            ``SUPPORTED_MODEL_TYPES``: qwen3, qwen2, llama; e.g. ``Qwen3ForCausalLM``); anything else
            raises ``TypeError``.
        config: a ``KVpopConfig`` (default ``KVpopConfig()``, or the model's current one if patched).
        **overrides: fields of ``KVpopConfig`` applied on top of ``config`` (validated:
            ``budget < sinks + window`` -> ``ValueError``, unknown names -> ``TypeError``).

    Idempotent; re-patching a patched model with a different config: see the module docstring.  A
    model patched with another method (DMS) raises ``ValueError``.
    """
    adapter = L.check_model(model)
    _check_budget_override(model, config, overrides)
    old, new = L.requested(model, SPEC, config, overrides)
    check_budget_for(new, model.config)
    check_head_budgets(new, model, adapter)
    register()
    if old is not None:
        if new == old:
            return model
        bad = old.structural_mismatch(new)
        if bad:
            raise ValueError(
                f"model is patched with a scorer of another structure (fields {bad} differ: "
                f"{ {n: getattr(old, n) for n in bad} } -> { {n: getattr(new, n) for n in bad} }); "
                f"call kvpop.unpatch(model) first (this discards the trained scorers)"
            )
        return L.reconfigure(model, SPEC, new)

    def build(attn: nn.Module) -> tuple[nn.Module, list[Any]]:
        layer = KVpopLayer(new, adapter.num_kv_heads(attn), adapter.head_dim(attn), attn.layer_idx,
                           model_type=adapter.model_type)
        layer.to(device=adapter.weight_device(attn), dtype=torch.float32)
        return layer, [adapter.key_tap_module(attn).register_forward_hook(layer.capture_key),
                       attn.register_forward_pre_hook(layer.capture_cache, with_kwargs=True)]

    return L.install(model, SPEC, new, build)


def _check_budget_override(model: nn.Module, config: KVpopConfig | None, overrides: dict[str, Any]) -> None:
    """``patch(model, budget=X)`` on a model whose config has ``head_budgets``: refused unless
    ``head_budgets`` comes too (the per-head budgets hold the old total and are not rescaled silently)."""
    if "budget" not in overrides or "head_budgets" in overrides:
        return
    st = getattr(model, SPEC.state_attr, None)
    base = config if config is not None else (st["config"] if st is not None else None)
    if base is None or base.head_budgets is None or overrides["budget"] == base.budget:
        return
    raise ValueError(
        f"budget={overrides['budget']!r}: the config has head_budgets (per-head budgets of mean {base.budget}, "
        f"fixed at retrofit time), which a new budget alone would not rescale; pass head_budgets too: "
        f"kvpop.core.budgets.allocate(scores, total=layers*heads*{overrides['budget']!r}, ...) for adaptive budgets "
        f"at the new mean, or head_budgets=None for the uniform budget")


def check_head_budgets(config: KVpopConfig, model: nn.Module, adapter: Any = None) -> None:
    """``ValueError`` unless ``config.head_budgets`` (when set) has one row per decoder layer of ``model``
    and, in each row, one budget per KV head of that layer."""
    if config.head_budgets is None:
        return
    adapter = adapter if adapter is not None else L.check_model(model)
    mods = adapter.attention_modules(model)
    heads = {int(m.layer_idx): adapter.num_kv_heads(m) for m in mods}
    rows = config.head_budgets
    shape = [len(r) for r in rows]
    want = [heads[i] for i in sorted(heads)]
    if sorted(heads) != list(range(len(rows))) or shape != want:
        raise ValueError(
            f"head_budgets has {len(rows)} rows (layers) of {sorted(set(shape))} KV heads; the model has "
            f"{len(mods)} decoder layers with {sorted(set(want))} KV heads each (layer indices "
            f"{sorted(heads)[:8]}{' ...' if len(heads) > 8 else ''}): give one row per layer and one budget per "
            f"KV head (kvpop.core.budgets.allocate(scores [{len(mods)}, {want[0] if want else '?'}], ...))")


def unpatch(model: nn.Module) -> nn.Module:
    """Undo ``patch`` in place (scorers removed and lost, attention implementation restored); returns ``model``.

    A model that is not patched is returned unchanged.
    """
    return SPEC.remove(model)


@contextlib.contextmanager
def patched(model: nn.Module, config: KVpopConfig | None = None, **overrides: Any) -> Iterator[nn.Module]:
    """Context-manager form of :func:`patch`: ``with kvpop.patched(model, budget=2048) as m: ...``.

    Inside the block the model is patched; on exit it is unpatched (scorers discarded) if it was not
    patched before, or given back its previous config if it was (its trained scorers kept).
    """
    prev = get_config(model) if is_patched(model) else None
    patch(model, config, **overrides)
    try:
        yield model
    finally:
        if prev is None:
            unpatch(model)
        else:
            patch(model, prev)


def disabled(model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """Run a patched model densely with its current weights: its original attention implementation.

    The one mode switch: inside the block forwards run dense attention, plain ``generate`` builds
    transformers' default cache instead of a ``KVpopCache`` (so it equals the unpatched model, token for
    token), and a ``KVpopCache`` passed explicitly is refused at its first call.

    The memory-cheap way to get dense logits of the *same* weights (e.g. to compare a patched model
    with itself, or as the teacher while the model itself is frozen).  When the model is fine-tuned,
    the teacher must be the frozen original: use :func:`make_teacher` before training.
    """
    return L.dense(model, SPEC)


def make_teacher(model: nn.Module, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen dense copy of ``model``'s current weights: the distillation teacher.

    Call it **before** fine-tuning, so it holds the original weights.  The copy is unpatched (of KVpop
    or any other method it carries), in eval mode and has ``requires_grad=False`` everywhere;
    ``device``/``dtype`` optionally move it.  Costs one more copy of the weights (the price of a
    teacher that stays the original model).
    """
    return L.frozen_copy(model, device=device, dtype=dtype)
