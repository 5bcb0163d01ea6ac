"""Head-adaptive budgets: how many long-range slots each (layer, KV head) gets, fixed at retrofit time.

``allocate`` shares the uniform total ``L * H * budget`` out in proportion to an importance score per
(layer, KV head); ``ablation_importance`` measures one such score (how much the model's next-token NLL
rises when one head loses its long-range slots); ``uniform`` is the method's own allocation.  The result
is ``KVpopConfig.head_budgets``.  The rule: docs/DESIGN.md section 7, "Head-adaptive budgets".
"""
from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .attention import set_teacher_targets, teacher_targets
from .config import KVpopConfig, _int
from .layer import kvpop_layers
from .patching import patched

__all__ = ["allocate", "uniform", "ablation_importance", "ablation_budgets", "rescale", "rescale_by", "set_importance",
           "rebudget",
           "read_head_budgets", "write_head_budgets", "HEAD_BUDGETS_FILE"]

HEAD_BUDGETS_FILE = "head_budgets.json"
"""What ``kvpop train --allocate`` writes into the run directory (and ``kvpop eval --run`` reads back)."""


def uniform(L: int, H: int, budget: int) -> tuple[tuple[int, ...], ...]:
    """``head_budgets`` of ``L`` layers x ``H`` KV heads that all hold ``budget`` entries."""
    _int("L", L, 1)
    _int("H", H, 1)
    _int("budget", budget, 1)
    return ((budget,) * H,) * L


def _scores_array(scores: Any) -> np.ndarray:
    """``scores`` as a float64 ``[L, H]`` array (TypeError / ValueError naming what is wrong)."""
    if isinstance(scores, torch.Tensor):
        if scores.is_complex() or scores.dtype == torch.bool:
            raise TypeError(f"scores must be a real [L, H] tensor, got dtype {scores.dtype}")
        arr = scores.detach().to(device="cpu", dtype=torch.float64).numpy()
    else:
        try:
            arr = np.asarray(scores)
        except Exception as e:
            raise TypeError(f"scores must be an [L, H] tensor, array or nested sequence of numbers, got "
                            f"{type(scores).__name__}: {e}") from None
        if arr.dtype.kind not in "iuf":
            raise TypeError(f"scores must hold real numbers, got an array of dtype {arr.dtype} "
                            f"({type(scores).__name__})")
        arr = arr.astype(np.float64)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"scores must be [L, H] (one score per layer and KV head), got shape {tuple(arr.shape)}")
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        li, h = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"scores must be finite and >= 0, got {float(arr[li, h])!r} at layer {li}, head {h} "
                         f"({int(bad.sum())} such entries)")
    return arr


def _water_fill(s: list[Fraction], units: int, floor: int) -> list[Fraction]:
    """Exact shares ``x_i = max(floor, c * s_i)`` with ``sum x_i = units`` (``units >= len(s) * floor``);
    equal shares when every score is 0."""
    n = len(s)
    if sum(s) == 0:
        return [Fraction(units, n)] * n
    floored: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in floored]
        c = Fraction(units - floor * len(floored)) / sum(s[i] for i in free)
        low = {i for i in free if c * s[i] < floor}
        if not low:
            return [Fraction(floor) if i in floored else c * s[i] for i in range(n)]
        floored |= low


def _largest_remainder(x: list[Fraction], units: int) -> list[int]:
    """Integers ``floor(x_i)`` plus one unit each for the largest remainders until they sum to ``units``;
    equal remainders go to the lower index (layer-major order: layer, then head)."""
    base = [int(v.numerator // v.denominator) for v in x]
    rest = units - sum(base)
    order = sorted(range(len(x)), key=lambda i: (-(x[i] - base[i]), i))
    for i in order[:rest]:
        base[i] += 1
    return base


def _capped_fill(s: list[Fraction], units: int, floor: int, cap: int | None) -> list[Fraction]:
    """:func:`_water_fill` with every share at most ``cap`` (None: no cap): a head whose share passes it is fixed at
    ``cap`` and the rest is shared again among the others (needs ``units <= len(s) * cap``)."""
    capped: set[int] = set()
    while True:
        free = [i for i in range(len(s)) if i not in capped]
        shares = _water_fill([s[i] for i in free], units - len(capped) * (cap or 0), floor)
        over = {i for i, x in zip(free, shares) if cap is not None and x > cap}
        if not over:
            out = [Fraction(cap or 0)] * len(s)
            for i, x in zip(free, shares):
                out[i] = x
            return out
        capped |= over


def allocate(scores: Any, *, total: int, sinks: int, window: int, min_k: int = 0,
             granularity: int = 1, max_budget: int | None = None) -> tuple[tuple[int, ...], ...]:
    """``head_budgets`` with exactly ``total`` entries, long-range slots in proportion to ``scores``.

    Args:
        scores: non-negative importance per (layer, KV head), ``[L, H]`` (tensor, array or nested lists).
        total: the uniform total ``L * H * budget`` (a multiple of ``L * H``).
        sinks, window: ``s`` and ``w``, shared by every head; each budget is ``s + w + k[l][h]``.
        min_k: the fewest long-range slots a head gets (default 0: a head may keep sinks and window only).
        granularity: every ``k[l][h]`` is a multiple of it (default 1); ``min_k`` and the slots to share,
            ``total - L*H*(s + w)``, must be multiples too.
        max_budget: no head gets more than this (e.g. the sequence length: entries past it are never filled, so a
            head's slots beyond it would be lost to the heads that can use them); what a capped head would have
            held is shared among the others by the same rule.  Ignored when the total does not fit under it
            (``total > L * H * max_budget``: every sequence then fits every head's budget whole).

    Rule: the ``K = total - L*H*(s + w)`` slots, in units of ``granularity``, are shared as
    ``x[l][h] = max(min_k, c * scores[l][h])`` with ``c`` such that they sum to ``K`` (so heads above
    the floor get slots exactly in proportion to their score; all-zero scores share equally), computed
    in exact rational arithmetic; then each head gets ``floor(x)`` units and the units left over go to
    the largest remainders, equal remainders to the lower (layer, head) index.  Deterministic: the same
    scores give the same budgets on every machine.  Returns a tuple (per layer) of tuples (per KV head)
    of budgets, for ``KVpopConfig(budget=total // (L*H), head_budgets=...)``.
    """
    arr = _scores_array(scores)
    L, H = arr.shape
    n = L * H
    _int("total", total, 1)
    _int("sinks", sinks, 0)
    _int("window", window, 1)
    _int("min_k", min_k, 0)
    _int("granularity", granularity, 1)
    if total % n:
        raise ValueError(f"total must be the uniform total L * H * budget, a multiple of L * H = {L} * {H} = {n}; "
                         f"got {total} (budget {total / n:.4g})")
    K = total - n * (sinks + window)
    if K < n * min_k:
        raise ValueError(f"total={total} leaves {K} long-range slots for {n} heads after sinks + window = "
                         f"{sinks + window} each; min_k={min_k} needs {n * min_k} (a budget of at least "
                         f"{sinks + window + min_k} per head on average)")
    if min_k % granularity or K % granularity:
        raise ValueError(f"granularity={granularity} must divide min_k={min_k} and the slots to share, "
                         f"total - L*H*(sinks + window) = {K}")
    units = K // granularity
    cap = None
    if max_budget is not None:
        _int("max_budget", max_budget, 1)
        cap_k = max(0, max_budget - sinks - window) // granularity
        if n * cap_k >= units and cap_k >= min_k // granularity:
            cap = cap_k
    shares = _capped_fill([Fraction(float(v)) for v in arr.flat], units, min_k // granularity, cap)
    ks = _largest_remainder(shares, units)
    return tuple(tuple(sinks + window + ks[li * H + h] * granularity for h in range(H)) for li in range(L))


# ------------------------------------------------------------------------------------------ importance
def _check_batches(batches: Iterable[Any]) -> list[torch.Tensor]:
    out = []
    for i, ids in enumerate(batches):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"batches[{i}] must be a tensor of token ids [B, S], got {type(ids).__name__}")
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() not in (1, 2) or ids.shape[-1] < 2 \
                or ids.numel() == 0:
            raise ValueError(f"batches[{i}] must be int64/int32 token ids [B, S] (or [S]) with S >= 2, got "
                             f"{ids.dtype} {tuple(ids.shape)}")
        out.append(ids if ids.dim() == 2 else ids[None])
    if not out:
        raise ValueError("batches is empty: give at least one batch of validation token ids [B, S]")
    return out


def _exact_targets(teacher: nn.Module, config: KVpopConfig, ids: torch.Tensor,
                   device: torch.device) -> dict[int, torch.Tensor]:
    """The frozen ``teacher``'s exact label of every layer for one batch (``kvpop.teacher_targets``)."""
    with torch.no_grad(), teacher_targets(teacher, config) as store:
        teacher(ids.to(device=device, dtype=torch.long), use_cache=False)
    return dict(store)


def _mean_nll(model: nn.Module, batches: list[torch.Tensor], device: torch.device,
              targets: list[dict[int, torch.Tensor]] | None = None) -> float:
    """Teacher-forced next-token NLL, the mean over every predicted token of every batch (float64 sums);
    ``targets``: each batch's teacher targets (``set_teacher_targets``), or ``None``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i, ids in enumerate(batches):
            ids = ids.to(device=device, dtype=torch.long)
            if targets is not None:
                set_teacher_targets(model, targets[i])
            try:
                logits = model(ids).logits[:, :-1].float()
            finally:
                if targets is not None:
                    set_teacher_targets(model, None)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                           reduction="sum").double())
            count += ids[:, 1:].numel()
    return total / count


def ablation_importance(model: nn.Module, batches: Iterable[torch.Tensor], *, config: KVpopConfig,
                        teacher: nn.Module | None = None) -> torch.Tensor:
    """Importance of each (layer, KV head)'s long-range slots: float64 ``[L, H]``, ``>= 0``.

    Entry ``[l, h]`` is how much the model's mean next-token NLL (teacher-forced, over every predicted
    token of ``batches``) rises when head ``h`` of layer ``l`` alone keeps no long-range slot (``k = 0``:
    sinks and window only) while every other head keeps ``config.k``, over the same model with every
    head at ``config.k``; a fall counts as 0.  The model runs patched with ``config`` at its uniform
    budget (``config.head_budgets`` is not used) and its current scorers: a model patched with a
    structurally equal config keeps its trained scorers (its own config is restored after); an unpatched
    model is patched for the measurement (fresh scorers, so the mask is that of an untrained scorer, or of
    ``config.mask_source``) and unpatched after.  ``batches``: validation token ids, each ``[B, S]`` (no
    padding; ``S`` above ``config.budget``, or nothing is evicted and every entry is 0).  ``L * H + 1``
    forwards under ``torch.no_grad()`` in eval mode (the model's mode is restored); deterministic where the
    forward is.  Feed the result to :func:`allocate`.

    ``teacher``: the frozen, unpatched original, needed when ``config.target_source == "teacher"`` with
    ``mask_source="teacher"`` (the oracle of the exact label: its targets are computed once per batch
    under :func:`kvpop.teacher_targets`, before ``model`` is patched, so an unpatched ``model`` may be its own
    teacher, and handed to every forward); ``ValueError`` without it.
    """
    if not isinstance(config, KVpopConfig):
        raise TypeError(f"config must be a kvpop.KVpopConfig, got {type(config).__name__}")
    ids = _check_batches(batches)
    base = config.replace(head_budgets=None) if config.head_budgets is not None else config
    exact = base.target_source == "teacher" and base.mask_source == "teacher"
    if exact and teacher is None:
        raise ValueError("config has mask_source='teacher' and target_source='teacher' (the exact label of the "
                         "frozen original as the mask): pass teacher= (the unpatched original model), or "
                         "target_source='student' (the label from the measured model's own attention)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        # before the patch: the teacher may be the unpatched model itself
        targets = [_exact_targets(teacher, base, x, device) for x in ids] if exact else None
        with patched(model, base):
            layers = kvpop_layers(model)
            heads = {layer.num_kv_heads for layer in layers}
            if len(heads) != 1:
                raise ValueError(f"ablation_importance needs the same number of KV heads in every layer, got "
                                 f"{sorted(heads)}")
            H = heads.pop()
            baseline = _mean_nll(model, ids, device, targets)
            out = torch.zeros(len(layers), H, dtype=torch.float64)
            for li, layer in enumerate(layers):
                for h in range(H):
                    layer.k_override = tuple(0 if j == h else base.k for j in range(H))
                    try:
                        out[li, h] = max(0.0, _mean_nll(model, ids, device, targets) - baseline)
                    finally:
                        layer.k_override = None
    finally:
        model.train(was_training)
    return out


def ablation_budgets(model: nn.Module, batches: Iterable[torch.Tensor], *, config: KVpopConfig,
                     teacher: nn.Module | None = None,
                     min_k: int = 0) -> tuple[tuple[tuple[int, ...], ...], torch.Tensor]:
    """``(head_budgets, importance)`` chosen before training: :func:`ablation_importance` under ``config``'s
    label computed exactly from the dense model (``mask_source="teacher"``, ``target_source="teacher"``; no
    scorer needed), shared by :func:`allocate` at the uniform total ``L x H x config.budget``.  ``teacher``:
    the frozen dense model whose attention makes the label (default ``model`` itself, which must then be the
    original)."""
    measure = config.replace(mask_source="teacher", target_source="teacher")
    batches = _check_batches(batches)
    imp = ablation_importance(model, batches, config=measure, teacher=model if teacher is None else teacher)
    L, H = imp.shape
    longest = max(int(b.shape[-1]) for b in batches)  # no head holds more than a sequence can fill
    rows = allocate(imp, total=L * H * config.budget, sinks=config.sinks, window=config.window, min_k=min_k,
                    max_budget=longest)
    return rows, imp


# ------------------------------------------------------------------------------ re-budgeting and files
def rescale(config: KVpopConfig, budget: int, *, importance: Any = None, min_k: int = 0,
            granularity: int = 1) -> KVpopConfig:
    """``config`` at mean budget ``budget``.

    Uniform configs: ``config.replace(budget=budget)``.  With ``head_budgets``: ``config`` itself at its own
    budget; at another, the rows allocated anew from the ``importance`` they were chosen by
    (:func:`allocate` at the total ``L * H * budget`` with ``min_k`` and ``granularity``); without an
    importance, ``ValueError`` (the rows hold the old total, and scaling them by hand would change which
    heads hold the slots)."""
    if not isinstance(config, KVpopConfig):
        raise TypeError(f"config must be a kvpop.KVpopConfig, got {type(config).__name__}")
    _int("budget", budget, 1)
    if config.head_budgets is None:
        return config if budget == config.budget else config.replace(budget=budget)
    if budget == config.budget:
        return config
    if importance is None:
        raise ValueError(f"the config has head_budgets (per-head budgets of mean {config.budget}, fixed at retrofit "
                         f"time); budget {budget} needs the importance they were allocated from to share the new "
                         f"total ({HEAD_BUDGETS_FILE} with an \"importance\" table, which kvpop train --allocate "
                         f"writes into the run directory), or evaluate at budget {config.budget}")
    L, H = len(config.head_budgets), len(config.head_budgets[0])
    arr = _scores_array(importance)
    if arr.shape != (L, H):
        raise ValueError(f"importance has shape {tuple(arr.shape)}; the head_budgets are {L} layers x {H} KV heads")
    rows = allocate(arr, total=L * H * budget, sinks=config.sinks, window=config.window, min_k=min_k,
                    granularity=granularity)
    return config.replace(budget=budget, head_budgets=rows)


def rescale_by(config: KVpopConfig, budget: int, plan: dict | None) -> KVpopConfig:
    """:func:`rescale` with the ``importance``, ``min_k`` and ``granularity`` of ``plan`` (a head-budgets document,
    :func:`read_head_budgets`; ``None``: no importance)."""
    plan = plan or {}
    return rescale(config, budget, importance=plan.get("importance"), min_k=plan.get("min_k", 0),
                   granularity=plan.get("granularity", 1))


_PLAN = "_kvpop_budget_plan"


def set_importance(model: nn.Module, importance: Any, *, min_k: int = 0, granularity: int = 1) -> None:
    """Remember on a patched ``model`` the importance its ``head_budgets`` were allocated from, so that
    :func:`rebudget` can share another total the same way (and come back to the current rows exactly)."""
    from .patching import get_config

    cfg = get_config(model)
    if cfg.head_budgets is None:
        raise ValueError("set_importance: the model's config has no head_budgets (uniform budgets need none)")
    arr = _scores_array(importance)
    L, H = len(cfg.head_budgets), len(cfg.head_budgets[0])
    if arr.shape != (L, H):
        raise ValueError(f"importance has shape {tuple(arr.shape)}; the head_budgets are {L} layers x {H} KV heads")
    _int("min_k", min_k, 0)
    _int("granularity", granularity, 1)
    setattr(model, _PLAN, {"importance": arr, "min_k": min_k, "granularity": granularity, "home": cfg})


def rebudget(model: nn.Module, budget: int) -> nn.Module:
    """Re-patch a patched ``model`` at mean budget ``budget`` (its scorers kept): ``kvpop.patch(model,
    budget=...)`` for uniform budgets; with ``head_budgets``, the rows of :func:`rescale` from the importance
    given to :func:`set_importance` (the original rows at the original budget), else ``ValueError``."""
    from .patching import get_config, patch

    cfg = get_config(model)
    if budget == cfg.budget:
        return model
    if cfg.head_budgets is None:
        return patch(model, budget=int(budget))
    plan = getattr(model, _PLAN, None)
    if plan is not None and plan["home"].budget == budget:
        return patch(model, plan["home"])
    return patch(model, rescale_by(cfg, int(budget), plan))


def read_head_budgets(path: Any) -> dict[str, Any]:
    """A head-budgets file: a JSON list of lists (per layer, per KV head budgets), or an object with a
    ``"head_budgets"`` key (what :func:`write_head_budgets` writes: also ``"importance"`` ``[L, H]``,
    ``"min_k"``, ``"granularity"``).  Returns ``{"head_budgets": rows (tuples), "importance": [L, H] list or
    None, "min_k": int, "granularity": int, ...the file's other keys}``; ``ValueError`` naming the file
    for anything else (the rows are checked against a model by ``kvpop.patch``)."""
    import json
    from pathlib import Path

    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{p}: no such file") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{p}: cannot read it as JSON ({type(e).__name__}: {str(e)[:200]})") from None
    out: dict[str, Any] = {"importance": None, "min_k": 0, "granularity": 1}
    if isinstance(data, dict):
        if "head_budgets" not in data:
            raise ValueError(f"{p}: a JSON object needs a \"head_budgets\" key (one list of budgets per layer); "
                             f"got keys {sorted(data)[:10]}")
        out.update(data)
        rows = data["head_budgets"]
    else:
        rows = data
    ok = (isinstance(rows, list) and rows and all(isinstance(r, list) and r for r in rows)
          and all(isinstance(b, int) and not isinstance(b, bool) for r in rows for b in r))
    if not ok:
        raise ValueError(f"{p}: head_budgets must be a non-empty list (one per layer) of non-empty lists of "
                         f"integers (one budget per KV head), got {json.dumps(rows)[:200]}")
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"{p}: every layer needs one budget per KV head (the same count), got rows of lengths "
                         f"{[len(r) for r in rows]}")
    total, n = sum(map(sum, rows)), len(rows) * len(rows[0])
    if total % n:
        raise ValueError(f"{p}: the budgets sum to {total}, not a multiple of layers x heads = {n}: they must hold "
                         f"the uniform total layers x heads x budget")
    out["head_budgets"] = tuple(tuple(r) for r in rows)
    out["budget"] = total // n
    imp = out["importance"]
    if imp is not None:
        shape = f"{len(rows)} x {len(rows[0])}"
        ok = (isinstance(imp, list) and imp and all(isinstance(r, list) and r for r in imp)
              and len({len(r) for r in imp}) == 1
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for r in imp for x in r))
        if not ok:
            raise ValueError(f"{p}: \"importance\" must be a list of {len(rows)} lists of {len(rows[0])} numbers (one "
                             f"per layer and KV head, as \"head_budgets\" is {shape}), got "
                             f"{json.dumps(imp)[:120]}")
        if (len(imp), len(imp[0])) != (len(rows), len(rows[0])):
            raise ValueError(f"{p}: importance has shape {(len(imp), len(imp[0]))}, head_budgets {shape}")
        try:
            _scores_array(imp)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}: \"importance\": {e}") from None
    for key in ("min_k", "granularity"):
        try:
            _int(f"{p}: {key}", out[key], 0 if key == "min_k" else 1)
        except TypeError as e:
            raise ValueError(str(e)) from None
    return out


def write_head_budgets(path: Any, head_budgets: Any, *, importance: Any = None, min_k: int = 0,
                       granularity: int = 1, **extra: Any) -> None:
    """Write a head-budgets file (:func:`read_head_budgets` reads it back), atomically."""
    import json

    from .files import atomic_write

    doc = {"head_budgets": [list(r) for r in head_budgets], "budget": sum(map(sum, head_budgets)) //
           (len(head_budgets) * len(head_budgets[0])), "min_k": min_k, "granularity": granularity,
           "importance": None if importance is None else _scores_array(importance).tolist(), **extra}
    text = json.dumps(doc, indent=1) + "\n"
    atomic_write(path, lambda f: f.write(text), binary=False)
