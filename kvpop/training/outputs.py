"""Whether a ``kvpop train`` run's outputs belong together (:func:`check_same_step`): its scorers (or gates) and
its fine-tuned ``model/`` must hold the weights of one training step.

``kvpop train`` stamps each output with its step (:func:`kvpop.training.runstate.output_step`); an output
without a stamp (written before the stamps existed) counts as ``last.pt``'s step when its weights are the
checkpoint's, read memory-mapped.  Used by ``kvpop eval`` before it evaluates a run.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from .runstate import MODEL_STEP_FILE, output_step

__all__ = ["check_same_step"]

_METHOD_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(\w+)\.(.+)$")


def _checkpoint_model(path: Path) -> tuple[int, dict] | None:
    """``(step, model state dict)`` of a ``last.pt``, its tensors memory-mapped (nothing but the pickle is read
    now; ``weights_only``, so nothing in it runs); None when it is absent or cannot be read that way."""
    import torch

    if not path.is_file():
        return None
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # refused, damaged, or not a zip-format torch.save: no step to compare with
        return None
    step, sd = (ck.get("step"), ck.get("model")) if isinstance(ck, dict) else (None, None)
    if isinstance(step, bool) or not isinstance(step, int) or not isinstance(sd, dict):
        return None
    return step, sd


def _same_tensors(pairs) -> bool | None:
    """Whether every ``(a, b)`` pair is equal (compared in float32); None when there is no pair."""
    import torch

    seen = False
    for a, b in pairs:
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return None
        seen = True
        if not torch.equal(a.float(), b.float()):
            return False
    return seen or None


def _layer_file_is(layer: Path, sd: dict) -> bool | None:
    """Whether the scorer / gate file ``layer`` holds the method tensors of the checkpoint state dict ``sd``."""
    from safetensors import safe_open

    by_attr: dict[str, dict[str, Any]] = {}
    for k, v in sd.items():
        m = _METHOD_KEY.search(k)
        if m:
            by_attr.setdefault(m.group(2), {})[f"layers.{m.group(1)}.{m.group(3)}"] = v
    try:
        with safe_open(str(layer), framework="pt") as f:
            keys = list(f.keys())
            match = [t for t in by_attr.values() if set(keys) <= set(t)]
            if len(match) != 1:
                return None
            return _same_tensors((f.get_tensor(k), match[0][k]) for k in keys)
    except Exception:
        return None


def _model_is(model: Path, sd: dict, n: int = 4) -> bool | None:
    """Whether the saved model in ``model`` holds the weights of the checkpoint state dict ``sd``: its ``n``
    smallest tensors that the checkpoint holds too are compared (a trained model changes every one)."""
    from safetensors import safe_open

    files = [model / "model.safetensors"]
    if not files[0].is_file():
        try:
            wmap = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
            files = [model / f for f in sorted(set(wmap.values()))]
        except Exception:
            return None  # .bin weights (or none): not compared
    try:
        found = []
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for k in f.keys():
                    if k in sd:
                        shape = f.get_slice(k).get_shape()
                        found.append((math.prod(shape), k, path))
        pairs = []
        for _, k, path in sorted(found)[:n]:
            with safe_open(str(path), framework="pt") as f:
                pairs.append((f.get_tensor(k), sd[k]))
        return _same_tensors(pairs)
    except Exception:
        return None


def check_same_step(d: Path, layer: Path, model: Path | None, source: str) -> None:
    """``ValueError`` when a run's scorers (or gates) ``layer`` and its fine-tuned ``model`` hold the weights of
    different training steps (a ``kvpop train`` stopped between its writes): by the step stamps ``kvpop train``
    writes (:func:`kvpop.training.runstate.output_step`); an output without one (written before the stamps
    existed) is of ``last.pt``'s step when its weights are the checkpoint's.  An output whose step cannot be
    told (no stamp, and no ``last.pt`` or other weights than its) is taken as it is."""
    if model is None:
        return
    steps = {layer: output_step(layer), model: output_step(model)}
    ck, other_weights = None, set()
    if None in steps.values():
        ck = _checkpoint_model(d / "last.pt")
        if ck is not None:
            for part, is_ck in ((layer, _layer_file_is), (model, _model_is)):
                if steps[part] is None:
                    same = is_ck(part, ck[1])
                    if same:
                        steps[part] = ck[0]
                    elif same is False:
                        other_weights.add(part)
    ls, ms = steps[layer], steps[model]
    fix = (f"run the kvpop train command of {d} again with --resume: it finishes the run, or, with no step left, "
           f"writes every output anew from last.pt")
    if ls is not None and ms is not None:
        if ls != ms:
            raise ValueError(f"{source}: {layer} holds the weights of step {ls} but {model} those of step {ms}: they "
                             f"do not belong together (the run stopped between its writes); {fix}")
        return
    known, other = (layer, model) if ls is not None else (model, layer)
    if ck is not None and steps[known] == ck[0] and other in other_weights:  # one is of last.pt's step, one not
        stamp = f" and has no step stamp ({MODEL_STEP_FILE})" if other == model else " and has no step stamp"
        raise ValueError(f"{source}: {known} holds the weights of step {ck[0]}, as last.pt does, but {other} holds "
                         f"other weights{stamp}: they do not belong together (the run stopped between its writes, "
                         f"or while writing {other.name}); {fix}")
