"""Serve a KVpop model in vLLM: an out-of-tree plugin (no fork of vLLM).

Every request gets the flat ``B``-slot cache of ``kvpop.KVpopCache`` per layer and KV head inside vLLM's
paged KV cache, ``ceil(B / block_size)`` blocks whatever its length.  :func:`hf_overrides` builds the
model's settings; :func:`register` (the ``vllm.general_plugins`` entry point) registers the model class
and the KV-cache spec; this module imports vLLM only inside it (``model``, ``backends`` and ``spec`` import
vLLM at their top, and only ``register`` imports them).  Installing and serving:
docs/vllm.md; the settings, the modules and the cache contract: docs/DESIGN.md section 5.
"""
from __future__ import annotations

from typing import Any

from .settings import ARCHITECTURE  # the architecture name that selects the plugin's model class (no vLLM import)

__all__ = ["ARCHITECTURE", "register", "hf_overrides"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the model class and the KV-cache spec.

    vLLM calls it in every process it starts (front end, engine core, workers), possibly several
    times; registering twice is harmless.
    """
    from vllm import ModelRegistry
    from vllm.config import CompilationConfig
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "kvpop.vllm.model:KVpopQwen3ForCausalLM")
    # vLLM fills in its built-in specs only while the registry is empty: let it do so first, or
    # registering ours would leave FullAttentionSpec and the others unregistered.
    KVCacheSpecRegistry._ensure_registered()
    from .spec import FixedBudgetManager, FixedBudgetSpec

    KVCacheSpecRegistry.register(FixedBudgetSpec, FixedBudgetManager, uniform_type_base_spec=FixedBudgetSpec)
    # our attention op is where torch.compile splits the graph (piecewise CUDA graphs), like vLLM's own
    from .model import OP_NAME, KVpopArchitectureCheck, KVpopEngineCheck

    if OP_NAME not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(OP_NAME)
    # the settings, the scorer file and the engine's options checked where the engine's config is built (the
    # caller's process), so that their error reaches the caller: see KVpopEngineCheck
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    MODELS_CONFIG_MAP[ARCHITECTURE] = KVpopEngineCheck
    from .settings import OTHER_ARCHITECTURES

    for arch in OTHER_ARCHITECTURES:  # kvpop settings on a model vLLM serves itself: refused, never served dense
        MODELS_CONFIG_MAP.setdefault(arch, KVpopArchitectureCheck)


def hf_overrides(scorers: str | None = None, *, policy: str = "kvpop", pack: str | None = None,
                 **config: Any) -> dict[str, Any]:
    """The ``hf_overrides`` that serve a Qwen3 checkpoint with the plugin.

    Args:
        scorers: path of a kvpop scorer file (``kvpop.save_scorers``); required for ``policy="kvpop"``.
        policy: ``"kvpop"`` or ``"streaming"``.
        pack: head-adaptive budgets only: ``"rows"`` starts each head's slots at a row of the packed block (at
            most ``block_size - 1`` more slots a head; what the CPU backend attends with vLLM's own kernel, its
            default for an unquantised cache), ``"slots"`` packs them slot to slot (the bytes of the uniform cache
            of the same total; the default elsewhere).
        **config: ``KVpopConfig`` fields (``sinks``, ``window``, ``budget``) that override the file's.

    Example: ``hf_overrides("scorers.safetensors", budget=2048)``; ``hf_overrides(policy="streaming",
    sinks=4, window=256, budget=2048)``.
    """
    from .settings import check_scorer_file, resolve

    out: dict[str, Any] = {"architectures": [ARCHITECTURE], "kvpop_policy": policy}
    if scorers is not None:
        out["kvpop_scorers"] = str(scorers)
    if config:
        out["kvpop_config"] = dict(config)
    if pack is not None:
        out["kvpop_pack"] = pack
    settings = resolve(out)  # a mistake fails here, in the caller's process, with the same message
    if settings.scorers is not None:
        check_scorer_file(settings.scorers)  # NaN or overflowing weights too
    return out
