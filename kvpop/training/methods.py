"""What a method tells the training loop (:class:`TrainingMethod`), and the methods that have one:
KVpop (:class:`KVpopMethod`) and the DMS baseline (:class:`DMSMethod`).

:func:`kvpop.training.train.train` drives a method through this interface alone, with no branch on
which method it is; a new method subclasses :class:`TrainingMethod` (and calls :func:`register_method`
so that ``train`` finds it from how a model is patched) without touching the loop.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from kvpop.baselines import dms as _dms
from kvpop.baselines.dms.checkpoint import GATE_FILE, GATES
from kvpop.baselines.dms.patching import SPEC as DMS_SPEC
from kvpop.core import lifecycle as L
from kvpop.core.attention import set_teacher_targets, teacher_targets
from kvpop.core.checkpoint import save_scorers
from kvpop.core.loss import score_loss, score_stats
from kvpop.core.patching import SPEC as KVPOP_SPEC
from kvpop.core.patching import make_teacher, patch

from .runstate import CheckpointError

__all__ = ["TrainingMethod", "KVpopMethod", "DMSMethod", "register_method", "method_for", "METHODS"]

METHODS: dict[str, type[TrainingMethod]] = {}
"""Training methods by the name of the patch they attach (``PatchSpec.name``)."""


def register_method(cls: type[TrainingMethod]) -> type[TrainingMethod]:
    """Let :func:`method_for` (and so ``train(model, ...)`` without ``method=``) find ``cls`` from a model
    patched with ``cls.spec``; usable as a class decorator."""
    METHODS[cls.spec.name] = cls
    return cls


def method_for(model: nn.Module) -> TrainingMethod:
    """The training method of a patched ``model``, with the model's config (ValueError when the model
    carries no method or one no training method is registered for)."""
    spec = L.carried(model)
    if spec is None:
        raise ValueError("train needs a patched model: call kvpop.patch(model, ...) (or "
                         "kvpop.baselines.dms.patch_dms(model, ...)) first, or pass method=")
    if spec.name not in METHODS:
        raise ValueError(f"no training method is registered for a model patched with {spec.label} "
                         f"(registered: {sorted(METHODS)}); pass method=")
    return METHODS[spec.name](spec.config_of(model))


class TrainingMethod:
    """A method as the training loop sees it.

    * What it attaches: ``spec`` (its patch lifecycle: the layers under ``attn.<spec.submodule>``),
      :meth:`attach`, and :meth:`owns` (whether a parameter name is one of its layers').
    * What it trains and how fast: :meth:`param_groups` (its own parameters; the loop adds the model's
      with ``lr_model`` when the model trains too).
    * Its loss: :meth:`aux_loss` (``(loss, stats)`` of the last training forward; the loop adds
      ``score_weight * loss`` to the KL).
    * Its teacher needs: :meth:`needs_targets` (the teacher must run even when the model does not train)
      and :meth:`teacher_forward` (a context around the teacher's forward that yields what the student
      is handed); the teacher itself is the frozen dense copy (:meth:`make_teacher`).
    * Its step hook: :meth:`before_forward` (the 1-based step being taken and the teacher's yield) and
      :meth:`after_forward`.
    * Its run state: :meth:`start` (a run begins: e.g. DMS's noise generator, seeded by the run's seed),
      :meth:`enter` / :meth:`leave` (around the optimiser steps), :meth:`run_state` / :meth:`load_run_state`
      (the entries it adds to ``last.pt`` and restores on resume).
    * What it saves: :meth:`config_json` (stored in ``last.pt``; a resume must match it) and :meth:`save`
      (its layer file ``layer_file`` in the checkpoint directory); resuming loads the layers with the
      model's state dict.
    * :meth:`postfix`: the progress bar's figures of one step's record.
    """

    spec: ClassVar[L.PatchSpec]
    layer_file: ClassVar[str]
    learning_rates: ClassVar[dict[str, float]] = {"lr_model": 1e-5, "lr_scorer": 1e-3}
    """Default ``lr_model`` and ``lr_scorer`` (the method's own parameters) where ``TrainConfig`` gives None."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # -- what it attaches --------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> nn.Module:
        """Patch ``model`` with this method and ``config`` (in place)."""
        raise NotImplementedError

    def bind(self, model: nn.Module) -> TrainingMethod:
        """Make ``model`` carry this method: a model patched with it lends its config when this method has
        none, an unpatched one is attached; a model patched with another method raises ``ValueError``."""
        other = L.carried(model)
        if other is not None and other is not self.spec:
            raise ValueError(f"the model is patched with {other.label}, the method is {self.spec.label}: "
                             f"{other.undo} first, or pass the matching method")
        if other is None or self.config is not None:
            if self.config is None:
                self.config = self.spec.config_type()
            self.attach(model)
        else:
            self.config = self.spec.config_of(model)
        return self

    @classmethod
    def owns(cls, name: str) -> bool:
        """True for the name of a parameter of the method's layers (``...self_attn.<submodule>.``)."""
        s = cls.spec.submodule
        return f".{s}." in name or name.startswith(f"{s}.")

    # -- what it trains ----------------------------------------------------------------------------------
    def param_groups(self, params: list[tuple[str, nn.Parameter]], cfg: Any) -> list[dict[str, Any]]:
        """AdamW groups of the method's own ``(name, parameter)`` pairs (``cfg``: the ``TrainConfig``)."""
        return [{"params": [p for _, p in params], "lr": cfg.lr_scorer, "weight_decay": cfg.weight_decay}]

    # -- its loss, teacher and step hook ------------------------------------------------------------------
    def aux_loss(self, model: nn.Module) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def needs_targets(self) -> bool:
        return False

    def make_teacher(self, model: nn.Module, *, dtype: torch.dtype | None = None) -> nn.Module:
        return make_teacher(model, dtype=dtype)

    def teacher_forward(self, teacher: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def before_forward(self, model: nn.Module, step: int, targets: Any) -> None:
        pass

    def after_forward(self, model: nn.Module) -> None:
        pass

    # -- its run state ------------------------------------------------------------------------------------
    def start(self, model: nn.Module, seed: int, device: torch.device) -> None:
        pass

    def enter(self, model: nn.Module) -> None:
        pass

    def leave(self, model: nn.Module) -> None:
        pass

    def run_state(self) -> dict[str, Any]:
        return {}

    def load_run_state(self, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
        pass

    # -- what it saves ------------------------------------------------------------------------------------
    def config_json(self) -> str:
        return self.config.to_json()

    def save(self, model: nn.Module, directory: str | os.PathLike, *, step: int | None = None) -> Path:
        """Write the method's layer file ``directory/layer_file`` (with :meth:`write`), stamped with the
        training ``step`` of its weights when given; returns its path."""
        path = Path(directory) / self.layer_file
        self.write(model, path, step=step)
        return path

    def write(self, model: nn.Module, path: str | os.PathLike, *, step: int | None = None) -> None:
        """Write the layer file (``step``: stamped as the file's ``step`` metadata,
        :data:`kvpop.core.checkpoint.STEP_KEY`)."""
        raise NotImplementedError

    def postfix(self, rec: dict[str, float]) -> dict[str, str]:
        return {"kl": f"{rec['kl']:.4f}", "score": f"{rec['score']:.4f}"}

    def note(self, rec: dict[str, float], seq_len: int) -> str | None:
        """A line to print once, the first time a step's record ``rec`` needs explaining (None: nothing to say);
        ``seq_len``: the step's sequence length."""
        return None


@register_method
class KVpopMethod(TrainingMethod):
    """KVpop: scorers and decays learn ``L_score`` (docs/DESIGN.md section 3); decays take no weight decay;
    with ``target_source="teacher"`` the teacher's forward computes every layer's exact target."""

    spec = KVPOP_SPEC
    layer_file = "scorers.safetensors"

    def attach(self, model: nn.Module) -> nn.Module:
        return patch(model, self.config)

    def param_groups(self, params: list[tuple[str, nn.Parameter]], cfg: Any) -> list[dict[str, Any]]:
        return [{"params": [p for n, p in params if not n.endswith("decay_logit")], "lr": cfg.lr_scorer,
                 "weight_decay": cfg.weight_decay},
                {"params": [p for n, p in params if n.endswith("decay_logit")], "lr": cfg.lr_scorer,
                 "weight_decay": 0.0}]

    def aux_loss(self, model: nn.Module) -> tuple[torch.Tensor, dict[str, float]]:
        stats = score_stats(model)
        return score_loss(model), stats

    def needs_targets(self) -> bool:
        c = self.config  # the label for L_score, or for the oracle's mask (docs/DESIGN.md section 12)
        return c.target_source == "teacher" and ((c.compute_loss and c.priority_source == "scorer")
                                                 or c.mask_source == "teacher" or c.priority_source == "oracle-label")

    @contextlib.contextmanager
    def teacher_forward(self, teacher: nn.Module) -> Iterator[Any]:
        if not self.needs_targets():
            yield None
            return
        with teacher_targets(teacher, self.config) as targets:
            yield targets

    def before_forward(self, model: nn.Module, step: int, targets: Any) -> None:
        if self.needs_targets():
            set_teacher_targets(model, targets)

    def after_forward(self, model: nn.Module) -> None:
        if self.needs_targets():
            set_teacher_targets(model, None)

    write = staticmethod(save_scorers)

    def postfix(self, rec: dict[str, float]) -> dict[str, str]:
        none = rec.get("decisions") == 0  # nothing ranked: L_score 0 and no accuracy (note())
        return {**super().postfix(rec), "acc": "-" if none else f"{rec.get('accuracy', float('nan')):.3f}",
                "gamma": f"{rec['gamma_min']:.6f}..{rec['gamma_max']:.6f}"}

    def note(self, rec: dict[str, float], seq_len: int) -> str | None:
        if rec.get("decisions") != 0 or self.config.priority_source != "scorer":
            return None  # a priority that is not learned has no L_score by design (docs/DESIGN.md section 12)
        return f"kvpop train: note: step {rec['step']}: {no_decision_reason(self.config, seq_len)}"


@register_method
class DMSMethod(TrainingMethod):
    """DMS (``kvpop.baselines.dms``): the gates learn through the KL and the compression loss; before each
    forward the model is told its step (the target compression ratio follows the DMS schedule)."""

    spec = DMS_SPEC
    layer_file = GATES
    learning_rates = {"lr_model": 1e-5, "lr_scorer": 5e-2}
    """DMS's gates need a large rate: they start at bias ``-gate_offset`` (-5, every token kept) and AdamW
    moves a parameter by about the learning rate per step, so at 1e-3 they cannot follow the compression
    schedule.  Measured with ``kvpop train --method dms --task --target-keep 0.125`` on the shipped model:
    length 256, window 32, 60 steps: keep 0.98 at the end with 1e-3, 0.117 with 5e-2; length 128, window 16,
    60 steps, seeds 0-2: mean keep of the last 10 steps 0.115-0.123; length 1024, window 64, 150 steps: 0.128;
    on a random-weight tiny model with byte-level text (``--tiny``, this repository's source as bytes),
    length 128, 60 steps: 0.127."""

    def attach(self, model: nn.Module) -> nn.Module:
        return _dms.patch_dms(model, self.config)

    def aux_loss(self, model: nn.Module) -> tuple[torch.Tensor, dict[str, float]]:
        return _dms.dms_loss(model)

    def before_forward(self, model: nn.Module, step: int, targets: Any) -> None:
        _dms.set_dms_step(model, step)

    def start(self, model: nn.Module, seed: int, device: torch.device) -> None:
        # the relaxation's noise: a generator of this run, seeded by its seed (saved with a checkpoint), so
        # that the run draws the same noise whatever used the global stream before it
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def enter(self, model: nn.Module) -> None:
        _dms.set_dms_generator(model, self.generator)

    def leave(self, model: nn.Module) -> None:
        _dms.set_dms_generator(model, None)

    def run_state(self) -> dict[str, Any]:
        return {"noise_rng": self.generator.get_state()}

    def load_run_state(self, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
        if "noise_rng" not in checkpoint:
            return
        try:
            self.generator.set_state(checkpoint["noise_rng"])
        except (TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: its 'noise_rng' entry cannot be restored "
                                  f"({type(e).__name__}: {str(e)[:200]})") from None

    @staticmethod
    def write(model: nn.Module, path: str | os.PathLike, *, step: int | None = None) -> None:
        # _dms.save_dms with the step stamp
        GATE_FILE.save(_dms.dms_layers(model), _dms.get_dms_config(model), path, step=step)

    def postfix(self, rec: dict[str, float]) -> dict[str, str]:
        return {"kl": f"{rec['kl']:.4f}", "aux": f"{rec['score']:.4f}", "keep": f"{rec['keep_frac']:.3f}",
                "target": f"{rec['target_keep']:.3f}"}


def no_decision_reason(config: Any, seq_len: int) -> str:
    """Why a step of ``seq_len`` tokens under ``config`` ranked no token (its L_score is 0 and its accuracy, the
    share of decisions the scorer got right, is undefined: shown as ``-``, recorded as NaN)."""
    s, w = config.sinks, config.window
    rows = config.head_budgets or ((config.budget,),)
    flat = [b for r in rows for b in r]
    whole = sum(b >= seq_len for b in flat)
    none = sum(b - s - w <= 0 for b in flat)
    parts = []
    if whole:
        parts.append(f"{whole} head(s) hold the whole sequence of {seq_len} tokens (budget >= --seq-len: nothing is "
                     f"evicted)")
    if none:
        parts.append(f"{none} head(s) keep no long-range slot (budget {s + w} = sinks + window: a token leaving "
                     f"the window is evicted with no choice)")
    why = "; ".join(parts) if parts else "no token left the window while another competed for its slot"
    return (f"no token competed for a long-range slot ({why}), so L_score is 0 and its accuracy undefined "
            f"(shown as '-', NaN in history.jsonl); the scorers learn nothing from such a step: lower the budget "
            f"below --seq-len, or give every head long-range slots (--min-k with --allocate)")

