"""The plugin's settings, read from the model config that ``hf_overrides`` extended (no vLLM import)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpop import KVpopConfig, read_scorer_config

__all__ = ["Settings", "resolve", "check_scorer_file", "check_architecture", "check_kv_dtype", "POLICIES",
           "OTHER_ARCHITECTURES"]

POLICIES = ("kvpop", "streaming")
_KEYS = ("kvpop_scorers", "kvpop_policy", "kvpop_config", "kvpop_pack")
PACKS = ("rows", "slots")
ARCHITECTURE = "KVpopQwen3ForCausalLM"
"""The plugin's architecture name (``kvpop.vllm.ARCHITECTURE``; defined here, where no vLLM import is needed)."""
OTHER_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
"""The architectures of the families kvpop patches, which vLLM serves with its own model class: a model config of
one of them that carries kvpop settings is refused (:func:`check_architecture`), never served dense."""


@dataclass(frozen=True)
class Settings:
    """What the model class needs: the cache shape, the policy and where the scorers are."""

    config: KVpopConfig
    policy: str
    scorers: str | None
    pack: str | None = None
    """How the packed block of head-adaptive budgets lays heads: ``"rows"`` (each head from a row's first slot),
    ``"slots"`` (slot to slot: the bytes of the uniform cache of the same total), None: rows where the CPU backend
    attends them with vLLM's kernel, else slots (``kvpop.vllm.model.packed_align``)."""

    @property
    def uses_scorer(self) -> bool:
        return self.policy == "kvpop"


def _get(cfg: Any, key: str) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key)
    return getattr(cfg, key, None)


def _check_keys(cfg: Any) -> None:
    """A ``kvpop*`` key the plugin does not read (``kvpop_configg``, ``kvpop-config``) is a ValueError naming it:
    it would otherwise be ignored and the defaults served."""
    import difflib

    keys = cfg.keys() if isinstance(cfg, Mapping) else vars(cfg).keys() if hasattr(cfg, "__dict__") else ()
    for k in keys:
        if isinstance(k, str) and k.lower().replace("-", "_").startswith("kvpop") and k not in _KEYS:
            near = difflib.get_close_matches(k.lower().replace("-", "_"), _KEYS, n=1)
            raise ValueError(f"unknown kvpop setting {k!r}{f' (did you mean {near[0]!r}?)' if near else ''}: the "
                             f"plugin reads {', '.join(_KEYS)}")


def check_architecture(hf_config: Any, architecture: str | None) -> None:
    """ValueError when ``hf_config`` carries kvpop settings (``kvpop_scorers``, ``kvpop_config``, ...) but is served
    as ``architecture``, not the plugin's: vLLM's own model class never reads them, so the engine would serve the
    dense model without a word (``hf_overrides`` without ``"architectures"``, or with the checkpoint's own)."""
    found = [k for k in _KEYS if _get(hf_config, k) is not None]
    if found and architecture != ARCHITECTURE:
        raise ValueError(f"the model config carries kvpop settings ({', '.join(found)}) but is served as "
                         f"{architecture!r}, whose model class never reads them: the engine would serve the dense "
                         f"model. Add \"architectures\": [\"{ARCHITECTURE}\"] to hf_overrides (kvpop.vllm."
                         f"hf_overrides(...) builds both)")


def check_kv_dtype(settings: Settings, kv_cache_dtype: Any) -> None:
    """ValueError when ``kvpop_config``'s ``kv_dtype`` contradicts the engine's ``kv_cache_dtype``: the engine's cache
    dtype decides how the cache is stored (``"auto"``: the model's dtype, ``int8_per_token_head``: int8, ...), so
    a ``kv_dtype`` that differs would be dropped or contradicted without a word."""
    from .quantized import PER_TOKEN_HEAD, kv_dtype_of

    mine = settings.config.kv_dtype
    engine = kv_dtype_of(kv_cache_dtype)
    if mine is None or mine == engine:
        return
    want = next((k for k, v in PER_TOKEN_HEAD.items() if v == mine), None)
    raise ValueError(f"kvpop_config kv_dtype={mine!r} contradicts the engine's kv_cache_dtype={kv_cache_dtype!r} "
                     f"(which stores {repr(engine) if engine else 'keys and values in the model dtype'}); the "
                     f"engine's cache dtype decides: start it with kv_cache_dtype={want!r} (--kv-cache-dtype "
                     f"{want}), or leave kv_dtype out of hf_overrides")


def check_scorer_file(path: str, model_config: Any = None) -> None:
    """What ``kvpop.load_scorers`` checks of the file's tensors (floating point, finite, of a trained layer's
    magnitude), and, given the model's ``model_config`` (its Hugging Face config), the file's number of layers,
    KV heads and head size against the model's: ValueError naming the file (the tensor, or the size and both
    values).  The load checks every tensor's name and shape again."""
    from kvpop.core.checkpoint import SCORERS

    SCORERS.read_tensors(path)
    if model_config is None:
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    heads = _get(model_config, "num_attention_heads")
    head_dim = _get(model_config, "head_dim") or (_get(model_config, "hidden_size") // heads if heads else None)
    for key, attr, want in (("num_layers", "num_hidden_layers", _get(model_config, "num_hidden_layers")),
                            ("num_kv_heads", "num_key_value_heads", _get(model_config, "num_key_value_heads")),
                            ("head_dim", "head_dim", head_dim)):
        got = meta.get(key)
        if want is not None and got is not None and str(got) != str(want):
            raise ValueError(f"scorer file {path} was saved for a model of {key}={got}, this model has {attr}={want} "
                             f"(a scorer file of another model?)")


def _with_overrides(base: KVpopConfig, overrides: dict, scorers: Any) -> KVpopConfig:
    """``base`` with the ``kvpop_config`` fields; a new ``budget`` for head-adaptive rows (and no rows given)
    re-allocates them by their importance (``kvpop.core.budgets.rescale``), never scales them by hand."""
    if not overrides:
        return base
    new_budget = overrides.get("budget", base.budget)
    if base.head_budgets is None or "head_budgets" in overrides or new_budget == base.budget:
        return base.replace(**overrides)
    from kvpop.core.budgets import HEAD_BUDGETS_FILE, read_head_budgets, rescale_by

    plan_file = os.path.join(os.path.dirname(os.path.abspath(str(scorers))), HEAD_BUDGETS_FILE)
    plan = read_head_budgets(plan_file) if os.path.isfile(plan_file) else None
    if plan is None or plan.get("importance") is None or plan["head_budgets"] != base.head_budgets:
        raise ValueError(f"kvpop_config budget={new_budget}: {scorers} holds head_budgets of mean {base.budget}, and "
                         f"no {HEAD_BUDGETS_FILE} with their importance lies beside it to share another total; serve "
                         f"budget={base.budget}, or pass head_budgets= rows of mean {new_budget}")
    rest = {k: v for k, v in overrides.items() if k != "budget"}
    home = base.replace(**rest) if rest else base
    return rescale_by(home, int(new_budget), plan)


def resolve(cfg: Any) -> Settings:
    """``Settings`` from a mapping or a config object carrying the ``kvpop_*`` keys.

    Raises ``ValueError`` naming the key for: an unknown policy, a ``kvpop`` policy without a scorer
    file, a missing or foreign file, unknown ``kvpop_config`` fields, an mLSTM scorer with head-adaptive budgets
    (not served). The MLP and the mLSTM scorer are served (the mLSTM's state: ``kvpop.vllm.recurrent``).
    Head-adaptive budgets (``head_budgets``, from the file or ``kvpop_config``) are served in the packed layout;
    another ``budget`` for a file with them shares the new total by the importance they were allocated from
    (``head_budgets.json`` beside the file, as ``kvpop train --allocate`` writes it), else ``ValueError``.
    ``kvpop_pack`` (``"rows"`` / ``"slots"``, default by the backend) lays out that packed block (:class:`Settings`).
    A ``kvpop*`` key other than these four is refused by name.
    """
    _check_keys(cfg)
    policy = _get(cfg, "kvpop_policy") or "kvpop"
    if policy not in POLICIES:
        raise ValueError(f"kvpop_policy must be one of {list(POLICIES)} in vLLM, got {policy!r} (the attention-"
                         f"scored baselines tova/h2o need attention weights that a paged kernel does not return)")
    pack = _get(cfg, "kvpop_pack")
    if pack is not None and pack not in PACKS:
        raise ValueError(f"kvpop_pack must be one of {list(PACKS)} (how head-adaptive budgets' heads are packed: "
                         f"each from a row's first slot, or slot to slot), got {pack!r}")
    scorers = _get(cfg, "kvpop_scorers")
    overrides = _get(cfg, "kvpop_config") or {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"kvpop_config must be a dict of KVpopConfig fields, got {type(overrides).__name__}")
    base = KVpopConfig()
    if scorers is not None:
        if not os.path.isfile(str(scorers)):
            raise ValueError(f"kvpop_scorers={scorers!r} is not a file (a scorer file written by kvpop.save_scorers)")
        base = read_scorer_config(str(scorers))
    elif policy == "kvpop":
        raise ValueError("kvpop_policy='kvpop' needs kvpop_scorers= (a scorer file written by kvpop.save_scorers or "
                         "kvpop train); use kvpop_policy='streaming' to serve without a scorer")
    config = _with_overrides(base, dict(overrides), scorers)
    if scorers is not None and config.structural_mismatch(base):
        raise ValueError(f"kvpop_config changes the scorer's structure ({config.structural_mismatch(base)}); only "
                         f"the cache shape (budget, sinks, window of an MLP scorer) may differ from the file")
    if pack is not None and config.head_budgets is None:
        raise ValueError(f"kvpop_pack={pack!r} lays out the packed block of head-adaptive budgets; these budgets are "
                         f"uniform (budget={config.budget} for every head): drop kvpop_pack")
    if policy == "kvpop" and config.scorer == "mlstm" and config.head_budgets is not None:
        raise ValueError(
            f"the vLLM plugin serves the mLSTM scorer with uniform budgets only; {scorers} holds an 'mlstm' scorer "
            f"with head_budgets (its state pages would sit in the packed block that every layer shares: not built); "
            f"serve it with kvpop.KVpopCache in transformers")
    if policy == "kvpop" and config.priority_source not in ("scorer", "random"):
        raise ValueError(f"{scorers} was trained with priority_source={config.priority_source!r} (a control whose "
                         f"priority is not the scorer's); the vLLM plugin serves scorer priorities only: serve it with "
                         f"kvpop.KVpopCache in transformers")
    return Settings(config=config, policy=policy, scorers=None if scorers is None else str(scorers), pack=pack)
