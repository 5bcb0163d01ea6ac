"""Model directories (``save_pretrained`` output): checked from their files before any weight is allocated.

:func:`check_model_dir` reads ``config.json`` and the safetensors headers only: a directory of a family
kvpop does not patch (a GPT-2 directory would otherwise load as whatever class the caller named, with that
class's default sizes), a config whose sizes disagree with its weights, a config without weights, or a
broken ``config.json`` is refused with a ``ValueError`` naming the file and the supported families.
:func:`load_model_dir` then loads the checked directory with ``AutoModelForCausalLM`` (local files only).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["check_model_dir", "load_model_dir", "resolve_model_dir", "WEIGHT_FILES"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""What ``from_pretrained`` reads the weights from (``.bin`` files are read with ``weights_only``)."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")


def resolve_model_dir(spec: str | os.PathLike, *, option: str = "--model") -> Path:
    """The model directory ``spec`` names: ``spec`` itself when it exists, else, for a Hugging Face hub id
    (``Qwen/Qwen3-0.6B``), its snapshot in the local Hugging Face cache (``HF_HUB_CACHE``), found as transformers
    finds it offline (``huggingface_hub.snapshot_download(local_files_only=True)``: no network).
    ``FileNotFoundError`` saying how to get a model directory when neither is there."""
    d = Path(spec)
    if d.exists():
        return d
    text = str(spec)
    if not _HUB_ID.match(text) or text.startswith(".") or ".." in text:
        raise FileNotFoundError(f"{option} {text}: no model directory there (no such directory); give a local "
                                f"directory saved with save_pretrained (config.json and the weights)")
    try:
        from huggingface_hub import snapshot_download

        snap = Path(snapshot_download(text, local_files_only=True))
    except Exception as e:  # not cached (LocalEntryNotFoundError), a bad id (HFValidationError), no hub installed
        from huggingface_hub import constants

        raise FileNotFoundError(
            f"{option} {text}: no such directory, and no snapshot of the Hugging Face model {text!r} in the local "
            f"cache ({constants.HF_HUB_CACHE}; kvpop never downloads): download it first, e.g. "
            f"`hf download {text} --local-dir models/{text.split('/')[-1]}` (huggingface_hub's CLI), then give "
            f"{option} models/{text.split('/')[-1]} ({type(e).__name__})") from None
    if not (snap / "config.json").is_file():
        raise FileNotFoundError(f"{option} {text}: the local Hugging Face cache's snapshot {snap} holds no config.json "
                                f"(an incomplete download?): download it again, or give a local model directory")
    return snap


def _supported() -> tuple[str, ...]:
    from .families import SUPPORTED_MODEL_TYPES

    return SUPPORTED_MODEL_TYPES


def check_model_dir(path: str | os.PathLike, *, families: tuple[str, ...] | None = None) -> Any:
    """The transformers config of the model directory ``path``, once its files show a model kvpop can load.

    ``families``: the ``model_type`` values accepted (default: every family ``kvpop.patch`` supports).
    ``FileNotFoundError`` when ``path`` does not exist; ``ValueError`` naming the file for a path that is
    not a directory, a missing or unreadable ``config.json``, an unsupported ``model_type``, no weight
    file, or safetensors weights whose embedding shape or layer count disagree with the config.
    """
    families = tuple(families or _supported())
    d = Path(path)
    if not d.exists():
        raise FileNotFoundError(f"no model directory at {d} (no such directory)")
    if not d.is_dir():
        raise ValueError(f"{d} is not a directory; a model directory (save_pretrained) holds config.json and "
                         f"the weights")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{d} is not a model directory: it has no config.json")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{cfg_path} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{cfg_path} is not a model config (JSON nested too deep to read)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path} holds a JSON {type(raw).__name__}, not a model config (an object)")
    mt = raw.get("model_type")
    if mt not in families:
        raise ValueError(f"{cfg_path} has model_type {mt!r}; kvpop supports the families "
                         f"{', '.join(repr(f) for f in families)} (a causal LM saved with save_pretrained)")
    weights = [f for f in WEIGHT_FILES if (d / f).is_file()]
    if not weights:
        raise ValueError(f"{d} has a config.json but no weights (none of {', '.join(WEIGHT_FILES)})")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # transformers raises ValueError, TypeError, KeyError ... for a bad config
        raise ValueError(f"{cfg_path} is not a valid {mt} config: {type(e).__name__}: {str(e)[:300]}") from None
    from .families import ADAPTERS

    ADAPTERS[mt].check_config(config.get_text_config())
    _check_weight_shapes(d, weights, config)
    return config


def _safetensors_files(d: Path, weights: list[str]) -> list[Path]:
    if "model.safetensors" in weights:
        return [d / "model.safetensors"]
    if "model.safetensors.index.json" in weights:
        index = d / "model.safetensors.index.json"
        try:
            wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return [d / f for f in sorted(set(wmap.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): "
                             f"{type(e).__name__}: {str(e)[:200]}") from None
    return []  # .bin weights: no header to read without unpickling; from_pretrained checks them


def _check_weight_shapes(d: Path, weights: list[str], config: Any) -> None:
    """Compare the safetensors headers (shapes only, nothing loaded) with the config's sizes."""
    from safetensors import safe_open

    text = config.get_text_config()
    vocab, hidden, layers = (getattr(text, n, None) for n in ("vocab_size", "hidden_size", "num_hidden_layers"))
    embed = None
    seen_layers: set[int] = set()
    for f in _safetensors_files(d, weights):
        if not f.is_file():
            raise ValueError(f"{d}: the weight shard {f.name} named in model.safetensors.index.json is missing")
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    m = _LAYER.search(key)
                    if m:
                        seen_layers.add(int(m.group(1)))
                    if key.endswith("embed_tokens.weight"):
                        embed = (key, list(st.get_slice(key).get_shape()))
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise ValueError(f"{f} is not a readable safetensors file: {str(e)[:200]}") from None
    if embed is not None and vocab is not None and hidden is not None and embed[1] != [vocab, hidden]:
        raise ValueError(f"{d}: the weights do not fit config.json: {embed[0]} is {embed[1]}, the config says "
                         f"[vocab_size, hidden_size] = [{vocab}, {hidden}]")
    if seen_layers and layers is not None and max(seen_layers) + 1 != layers:
        raise ValueError(f"{d}: the weights do not fit config.json: they hold {max(seen_layers) + 1} layers, the "
                         f"config says num_hidden_layers = {layers}")


def load_model_dir(path: str | os.PathLike, *, families: tuple[str, ...] | None = None, dtype: Any = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` of a directory that :func:`check_model_dir` accepted
    (local files only; ``dtype`` default float32).  ``ValueError`` naming ``path`` when it cannot load."""
    import pickle

    import torch
    from transformers import AutoModelForCausalLM

    config = check_model_dir(path, families=families)
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), config=config, local_files_only=True,
                                                    dtype=torch.float32 if dtype is None else dtype)
    except pickle.UnpicklingError as e:  # a .bin file, read by torch.load(weights_only=True): nothing ran
        found = re.search(r"GLOBAL:?\s+([\w.]+)", str(e))
        what = f" (it names the Python object {found.group(1)})" if found else ""
        bins = ", ".join(f for f in WEIGHT_FILES if f.endswith(".bin") and (Path(path) / f).is_file()) or "its .bin"
        if not found and "global" not in str(e).lower():
            msg = " ".join(str(e).replace("Weights only load failed.", "").split())
            msg = re.split(r"In PyTorch 2\.6|Re-running `torch\.load`|Check the documentation", msg)[0].strip()
            raise ValueError(f"cannot load the model from {path}: {bins} is not a file written by torch.save"
                             + (f" ({msg[:200]})" if msg else "")) from None
        raise ValueError(f"the weights in {path} ({bins}) were refused because loading them could run code: they "
                         f"hold objects other than tensors{what}. Save the model with save_pretrained "
                         f"(safetensors) from a trusted copy") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"cannot load the model from {path}: {type(e).__name__}: {str(e)[:400]}") from None
