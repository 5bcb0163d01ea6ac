"""The demo's retrofits: short training runs of a shipped tiny model on its task's training sequences.

:func:`retrofit` trains what a KVpop policy of the harness needs (scorers with ``mask_source="scorer"``,
by default the model frozen; the joint variants also the model; ``fixed-finetune`` the model with the
fixed StreamingLLM mask); :func:`retrofit_dms` trains the DMS baseline (gates and model together).
Both go through ``kvpop.training.train`` with a :class:`RetrofitConfig`, write their parts into a
directory and reuse a finished one.  Used by ``kvpop demo``, its selection (``kvpop.demo.search``) and the
studies, which measure the results with :mod:`kvpop.evaluation`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvpop.baselines.dms import DMSConfig, patch_dms, save_dms
from kvpop.baselines.dms.budget import GATES
from kvpop.core.checkpoint import load_scorers, save_scorers
from kvpop.core.config import LABELS, PRIORITY_SOURCES, KVpopConfig, decay_range_for_context
from kvpop.core.lifecycle import carried, remove
from kvpop.core.patching import make_teacher, patch
from kvpop.policies import DEFAULT_SINKS, DEFAULT_WINDOW, JOINT, LABEL_SOURCES, LABEL_VARIANTS, SCORER_OF
from kvpop.progress import one_bar
from kvpop.training.runstate import append_jsonl, atomic_save, write_jsonl
from kvpop.training.train import TrainConfig, train

from . import task as T

__all__ = ["RetrofitConfig", "retrofit", "retrofit_dms", "kv_config", "initial_scorers", "retrofit_seed", "SCORER_OF",
           "JOINT", "LABEL_SOURCES", "LABEL_VARIANTS", "DEFAULT_SINKS", "DEFAULT_WINDOW"]



@dataclass
class RetrofitConfig:
    """A short retrofit run (:func:`retrofit`).

    Attributes:
        steps: optimiser steps; length/batch: training sequences (train seeds ``task.train_seed``).
        budget: the training budget (the demo uses 12.5 % of the length trained at).
        sinks, window: as in evaluation (the mLSTM scorer's readout depends on the window).
        lr_scorer, tau: scorer learning rate and score-loss temperature.
        target_source: whose attention makes the scorers' label (``KVpopConfig.target_source``):
            ``"student"`` (the model being trained, its sparse normaliser) or ``"teacher"`` (the frozen
            original with the full cache).
        train_model: also fine-tune the model (KL to the frozen original) with ``lr_model``.
        checkpoint_every: steps between checkpoints (resume after an interruption).
        label, label_power: the label the scorers learn (``KVpopConfig.label``: ``"mean"``, the paper's,
            ``"max"`` or ``"power"`` with exponent ``label_power``).
        decay_span: ``None`` keeps ``KVpopConfig``'s range of the learned decay; a number of nats ties the
            range to the training length (:func:`kvpop.core.config.decay_range_for_context`).
        init_scorers: a scorer file (``kvpop.save_scorers``) the scorers start from instead of their
            seeded initialisation (a joint retrofit warm-started by its scorer-only one); ``done.json``
            records the SHA-256 of its content (metadata and tensors), not its path.
        eval_every: with a ``validate`` callback (:func:`retrofit`), validate every this many steps and at
            the last, and keep the best state (early stopping by selection); 0: no validation.
        patience: stop after this many validations without a better or equal one (a tie goes to the later state,
            the default; 0: train every step).
        head_allocation: ``None`` (uniform budgets) or ``"ablation"``: head-adaptive budgets fixed before
            training (the same total), shared by :func:`kvpop.core.budgets.allocate` in proportion to
            :func:`~kvpop.core.budgets.ablation_importance` on ``ABLATION_SEQUENCES`` validation sequences of
            the training length, the mask being the label computed exactly from the frozen model; written
            with the importance to ``head_budgets.json`` (``kvpop eval --run`` and ``kvpop demo`` re-budget
            from it).
        priority_source: where the priority's score comes from (``KVpopConfig.priority_source``, docs/DESIGN.md
            section 12): ``"scorer"`` (default, learned) or a same-structure control whose priority is not
            learned (``"random"``, ``"keynorm+"``, ``"keynorm-"``, ``"window-attention"``, ``"oracle-label"``:
            no score loss, the scorer never updated; the model fine-tuned as in every joint retrofit).  A KVpop
            policy's setting only (``fixed-finetune`` refuses another).
    """

    steps: int = 200
    length: int = 1024
    batch: int = 1
    budget: int = 128
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    lr_scorer: float = 1e-2
    lr_model: float = 1e-4
    tau: float = 1.0
    train_model: bool = False
    checkpoint_every: int = 25
    seed: int = 0
    target_source: str = "student"
    label: str = "mean"
    label_power: float = 4.0
    decay_span: float | None = None
    init_scorers: str | None = None
    eval_every: int = 0
    patience: int = 0
    head_allocation: str | None = None
    priority_source: str = "scorer"

    def __post_init__(self) -> None:
        if self.priority_source not in PRIORITY_SOURCES:
            raise ValueError(f"priority_source must be one of {list(PRIORITY_SOURCES)}, got {self.priority_source!r}")
        if self.priority_source == "window-attention" and self.head_allocation is not None:
            raise ValueError("priority_source='window-attention' is served with uniform budgets only: "
                             "head_allocation must be None")
        if self.head_allocation not in (None, "ablation"):
            raise ValueError(f"head_allocation must be None (uniform budgets) or 'ablation', got "
                             f"{self.head_allocation!r}")
        if self.label not in LABELS:
            raise ValueError(f"label must be one of {list(LABELS)}, got {self.label!r}")
        for name in ("eval_every", "patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.decay_span is not None and not (isinstance(self.decay_span, (int, float))
                                                and not isinstance(self.decay_span, bool) and self.decay_span > 0):
            raise ValueError(f"decay_span must be None (KVpopConfig's decay range) or a number of nats > 0, got "
                             f"{self.decay_span!r}")

    def decay_range(self) -> dict[str, float]:
        """``KVpopConfig``'s decay fields of this retrofit (empty: its defaults)."""
        return {} if self.decay_span is None else decay_range_for_context(self.length, float(self.decay_span))

    def stamp(self) -> dict[str, Any]:
        """These settings as ``done.json`` records them (``init_scorers`` by its content's SHA-256)."""
        d = asdict(self)
        if self.head_allocation is None:  # a uniform retrofit stamps as it did before the option existed
            del d["head_allocation"]
        if self.priority_source == "scorer":  # likewise a learned priority
            del d["priority_source"]
        if self.init_scorers is not None:
            d["init_scorers"] = {"sha256": _content_sha256(self.init_scorers)}
        return d


def _content_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a safetensors file's content: its metadata and every tensor (name, dtype, shape, bytes) in
    name order, so that two files holding the same scorers hash alike whatever order their header took."""
    import hashlib

    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), "pt") as f:
        h.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def retrofit_seed(name: str, seed: int) -> int:
    """The seed of every random draw of retrofit ``name`` (its layers' initialisation, DMS's relaxation noise):
    a stable hash (CRC-32) of the name and ``seed``, the same in every process.  A joint retrofit's label
    variants share the joint retrofit's (the same start, only the label differs); the training sequences are
    ``seed``'s, the same for every retrofit."""
    import zlib

    return zlib.crc32(f"{name}/{int(seed)}".encode())


@contextlib.contextmanager
def _seeded(seed: int, model: nn.Module):
    """A block whose global-stream draws come from ``seed`` (CPU, and the model's CUDA device when it has
    one); the global streams are restored on exit."""
    dev = next(model.parameters()).device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _train_data(cfg: RetrofitConfig, n: int, task_cfg: Any, task: Any) -> list[torch.Tensor]:
    return [task.make_batch([task.train_seed(cfg.seed * 1_000_003 + i * cfg.batch + j) for j in range(cfg.batch)],
                            cfg.length, task_cfg)["input_ids"] for i in range(n)]


def kv_config(policy: str, cfg: RetrofitConfig) -> KVpopConfig:
    """The :class:`~kvpop.core.config.KVpopConfig` a retrofit of ``policy`` with ``cfg`` trains under (uniform
    budgets: :func:`retrofit` shares them by head afterwards when ``cfg.head_allocation`` asks); ValueError naming
    a setting the policy cannot take."""
    trainable = ("fixed-finetune", *SCORER_OF)
    if policy not in trainable:
        raise ValueError(f"retrofit trains one of {list(trainable)}, got {policy!r}")
    if policy == "fixed-finetune":
        if cfg.init_scorers is not None or cfg.head_allocation is not None or cfg.priority_source != "scorer":
            raise ValueError("init_scorers, head_allocation, priority_source: fixed-finetune trains no scorers (its "
                             f"mask is StreamingLLM's), got priority_source={cfg.priority_source!r}")
        return KVpopConfig(sinks=cfg.sinks, window=cfg.window, budget=cfg.budget, mask_source="streaming",
                           compute_loss=False, tau=cfg.tau)
    if cfg.priority_source != "scorer" and policy not in JOINT:
        raise ValueError(f"priority_source={cfg.priority_source!r} trains no scorer, so the scorer-only retrofit "
                         f"{policy!r} would train nothing: use a joint policy ({list(JOINT)})")
    return KVpopConfig(sinks=cfg.sinks, window=cfg.window, budget=cfg.budget, scorer=SCORER_OF[policy],
                       mask_source="scorer", tau=cfg.tau, target_source=cfg.target_source, label=cfg.label,
                       label_power=cfg.label_power, priority_source=cfg.priority_source, **cfg.decay_range())


def initial_scorers(base: nn.Module, policy: str, path: str | os.PathLike, cfg: RetrofitConfig) -> Path:
    """Save to ``path`` the scorers :func:`retrofit` of ``policy`` with ``cfg`` starts from (the same seeded
    initialisation, no step trained; uniform budgets): served on ``base``'s weights, the *untrained* control of a
    priority that is not learned (``cfg.priority_source``), whose training never updates them
    (docs/DESIGN.md section 12)."""
    if policy == "fixed-finetune" or cfg.init_scorers is not None or cfg.head_allocation is not None:
        raise ValueError(f"initial_scorers: the seeded start of a KVpop policy with uniform budgets and no "
                         f"init_scorers, got {policy!r} (init_scorers={cfg.init_scorers!r}, head_allocation="
                         f"{cfg.head_allocation!r})")
    kv = kv_config(policy, cfg)
    model = copy.deepcopy(base)
    _strip(model)
    with _seeded(retrofit_seed(LABEL_VARIANTS.get(policy, policy), cfg.seed), model):
        patch(model, kv)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_scorers(model, path)
    return path


def retrofit(base: nn.Module, policy: str, out_dir: str | os.PathLike, cfg: RetrofitConfig | None = None, *,
             resume: bool = True, progress: bool = True, task_cfg: Any = None, task: Any = T,
             validate: Callable[[nn.Module], float] | None = None) -> Path:
    """Train what ``policy`` needs from ``base`` (left untouched) and save it into ``out_dir``.

    * ``kvpop-mlp`` / ``kvpop-mlstm``: a copy of ``base`` patched with that scorer
      (``mask_source="scorer"``) trained by ``kvpop.training.train``; writes ``scorers.safetensors``
      (and ``model/`` when ``cfg.train_model``).
    * ``kvpop-mlp-joint`` / ``kvpop-mlstm-joint``: the same with ``train_model`` on (the method's recipe:
      model and scorers together, the model with a KL loss to the frozen original); writes both.
    * ``fixed-finetune``: the model fine-tuned with the fixed StreamingLLM mask
      (``mask_source="streaming"``, no score loss, KL to the frozen original); writes ``model/``.

    With ``validate`` (the model in training -> a score, higher is better) and ``cfg.eval_every``, the
    run validates every ``eval_every`` steps, saves the best state and stops after ``cfg.patience``
    validations without a better one; ``done.json`` records every validation and the best step.

    A finished run leaves ``done.json`` (settings and last losses); with ``resume`` an existing
    ``done.json`` with the same settings is reused as it is, and an interrupted run continues from
    its last checkpoint (``train.pt/last.pt``).  Returns ``out_dir``.
    """
    cfg = cfg or RetrofitConfig()
    kv = kv_config(policy, cfg)
    if cfg.head_allocation is not None:
        kv = _allocate(base, kv, cfg, Path(out_dir), task_cfg if task_cfg is not None else task.DEFAULT, task)
    train_model = cfg.train_model or policy == "fixed-finetune" or policy in JOINT
    save = None if policy == "fixed-finetune" else (lambda m, out: save_scorers(m, out / "scorers.safetensors"))

    def attach(m: nn.Module) -> None:
        patch(m, kv)
        if cfg.init_scorers is not None:
            load_scorers(m, cfg.init_scorers)

    return _run(base, out_dir, {"policy": policy, **cfg.stamp()}, cfg, attach, save, train_model,
                retrofit_seed(LABEL_VARIANTS.get(policy, policy), cfg.seed), resume=resume, progress=progress,
                task_cfg=task_cfg, task=task, validate=validate)


def retrofit_dms(base: nn.Module, out_dir: str | os.PathLike, cfg: RetrofitConfig | None = None, *,
                 target_keep: float = 0.04, schedule_frac: float = 0.6, resume: bool = True, progress: bool = True,
                 task_cfg: Any = None, task: Any = T) -> Path:
    """Train DMS from ``base`` (left untouched): gates and model together, KL to the frozen original plus
    the compression loss; the target compression ratio ``1 / target_keep`` is reached after
    ``schedule_frac`` of the steps.  ``cfg`` is a :class:`RetrofitConfig` (steps,
    length, sinks, window, ``lr_scorer`` for the gates, ``lr_model``).  Writes ``gates.safetensors``,
    ``model/`` and ``done.json`` into ``out_dir`` (reused by ``resume`` when the settings agree)."""
    cfg = cfg or RetrofitConfig()
    dms = DMSConfig(sinks=cfg.sinks, window=cfg.window, target_keep=target_keep,
                    schedule_steps=max(1, round(schedule_frac * cfg.steps)))
    if cfg.init_scorers is not None or cfg.eval_every or cfg.head_allocation is not None:
        raise ValueError("retrofit_dms takes no init_scorers, eval_every or head_allocation (its gates decide each "
                         "head's memory; its compression schedule runs to the end)")
    settings = {"policy": "dms", **asdict(cfg), "target_keep": target_keep, "schedule_frac": schedule_frac}
    return _run(base, out_dir, settings, cfg, lambda m: patch_dms(m, dms), lambda m, out: save_dms(m, out / GATES),
                True, retrofit_seed("dms", cfg.seed), resume=resume, progress=progress, task_cfg=task_cfg, task=task)


def _run(base: nn.Module, out_dir: str | os.PathLike, settings: dict, cfg: RetrofitConfig,
         attach: Callable[[nn.Module], Any], save: Callable[[nn.Module, Path], Any] | None, train_model: bool,
         rseed: int, *, resume: bool, progress: bool, task_cfg: Any, task: Any,
         validate: Callable[[nn.Module], float] | None = None) -> Path:
    """One retrofit: a copy of ``base`` (any method removed) gets ``attach``-ed (its layers initialised from
    ``rseed``, the global streams untouched), trains (seed ``rseed``), ``save``s its layers into ``out_dir``
    (and ``model/`` when ``train_model``); ``done.json`` marks it finished."""
    task_cfg = task_cfg if task_cfg is not None else task.DEFAULT
    out = Path(out_dir)
    settings = {**settings, "task_config": task_cfg.to_dict()}
    done_file = out / "done.json"
    if resume and done_file.exists() and json.loads(done_file.read_text()).get("settings") == settings:
        return out
    out.mkdir(parents=True, exist_ok=True)
    if done_file.exists():
        done_file.unlink()
    model = copy.deepcopy(base)
    _strip(model)
    model.eval()
    teacher = make_teacher(model) if train_model else None
    with _seeded(rseed, model):  # the layers' initialisation, whatever ran before it in the process
        attach(model)
    ckpt = out / "train.pt"
    stamp = ckpt / "settings.json"
    if ckpt.exists() and (not resume or not stamp.exists() or json.loads(stamp.read_text()) != settings):
        for f in ckpt.iterdir():
            f.unlink()
    ckpt.mkdir(exist_ok=True)
    stamp.write_text(json.dumps(settings))
    data = _train_data(cfg, min(cfg.steps, 1000), task_cfg, task)
    tc = TrainConfig(steps=cfg.steps, lr_scorer=cfg.lr_scorer, lr_model=cfg.lr_model, train_model=train_model,
                     checkpoint_dir=str(ckpt), checkpoint_every=cfg.checkpoint_every, progress=progress,
                     seed=rseed)
    record: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tqdm/torch noise about the tiny model
        if validate is not None and cfg.eval_every:
            hist, record = _train_validated(model, data, tc, teacher, resume, cfg, validate, ckpt)
        else:
            hist = train(model, data, tc, teacher=teacher, resume=resume)
    if save is not None:
        save(model, out)
    if train_model:
        plain = copy.deepcopy(model)
        _strip(plain)
        plain.save_pretrained(str(out / "model"))
    tmp = done_file.with_name("done.json.tmp")
    tmp.write_text(json.dumps({"settings": settings, "last": hist[-1] if hist else {}, **record}, indent=1))
    os.replace(tmp, done_file)
    return out


ABLATION_SEQUENCES = 8
"""Validation sequences (``task.valid_seed(0..7)``) of ``head_allocation="ablation"``'s importance."""


def _allocate(base: nn.Module, kv: KVpopConfig, cfg: RetrofitConfig, out: Path, task_cfg: Any,
              task: Any) -> KVpopConfig:
    """``kv`` with head-adaptive budgets by ablation importance (:attr:`RetrofitConfig.head_allocation`),
    written to ``out/head_budgets.json``; reused from there when it was measured with the same settings."""
    from kvpop.core import budgets as B

    f = out / B.HEAD_BUDGETS_FILE
    what = json.loads(json.dumps({"rule": "ablation", "length": cfg.length,
                                  "mask": kv.replace(mask_source="teacher", target_source="teacher").to_dict(),
                                  "sequences": f"{task.__name__}.valid_seed(0..{ABLATION_SEQUENCES - 1})"}))
    if f.exists():
        hb = B.read_head_budgets(f)
        if hb.get("measured_on") == what:
            return kv.replace(head_budgets=hb["head_budgets"])
    ids = task.make_batch([task.valid_seed(i) for i in range(ABLATION_SEQUENCES)], cfg.length, task_cfg)["input_ids"]
    model = copy.deepcopy(base)
    _strip(model)
    rows, imp = B.ablation_budgets(model, [ids[i:i + 4] for i in range(0, ids.shape[0], 4)], config=kv, teacher=base)
    out.mkdir(parents=True, exist_ok=True)
    B.write_head_budgets(f, rows, importance=imp, measured_on=what)
    return kv.replace(head_budgets=rows)


def _train_validated(model: nn.Module, data: list, tc: TrainConfig, teacher: nn.Module | None, resume: bool,
                     cfg: RetrofitConfig, validate: Callable[[nn.Module], float], ckpt: Path) -> tuple[list, dict]:
    """Train to ``cfg.steps`` in segments of ``cfg.eval_every`` steps (each resumes the last checkpoint, so the
    run is the one uninterrupted run), validate after each, keep the best state in ``ckpt/best.pt`` (of equal
    scores the later: a tie goes to the default, here the run as long as asked, the one tie rule of every choice,
    docs/DESIGN.md section 7 "Selection") and stop after ``cfg.patience`` validations without a better or equal
    one; then load the best state.  Validations survive an
    interruption (``ckpt/validation.jsonl``).  Returns the loss history and ``{"validation", "best_step"}``."""
    vfile, best_file = ckpt / "validation.jsonl", ckpt / "best.pt"
    done = ([json.loads(x) for x in vfile.read_text().splitlines() if x.strip()]
            if resume and vfile.exists() and best_file.exists() else [])
    write_jsonl(vfile, done)
    stops = [*range(cfg.eval_every, cfg.steps, cfg.eval_every), cfg.steps]
    with one_bar():  # one bar over the segments: its elapsed time and ETA are the run's
        hist, best, done = _segments(model, data, tc, teacher, resume, cfg, validate, stops, done, vfile, best_file)
    model.load_state_dict(torch.load(best_file, weights_only=True))
    return hist, {"validation": done, "best_step": best["step"], "best_score": best["score"]}


def _segments(model, data, tc, teacher, resume, cfg, validate, stops, done, vfile, best_file):
    """:func:`_train_validated`'s segments: train to each stop, validate, keep the best state, stop early."""
    from dataclasses import replace

    hist: list[dict] = []
    best, bad = None, 0
    for i, target in enumerate(stops):
        hist += train(model, data, replace(tc, steps=target, progress_total=tc.steps), teacher=teacher,
                      resume=resume or i > 0)  # one count of the run's steps over its segments
        rec = next((r for r in done if r["step"] == target), None)  # validated before an interruption
        better = False
        if rec is None:
            model.eval()
            rec = {"step": target, "score": float(validate(model))}
            model.train()
            better = best is None or rec["score"] >= best["score"]  # a tie goes to the default: the later state
            if better:  # the state first: a record never names a best state that was not saved
                atomic_save({k: v.detach().clone() for k, v in model.state_dict().items()}, best_file)
            append_jsonl(vfile, rec)
            done.append(rec)
        better = better or best is None or rec["score"] >= best["score"]
        if better:
            best, bad = rec, 0
        else:
            bad += 1
            if cfg.patience and bad >= cfg.patience:
                break
    return hist, best, done


def _strip(model: nn.Module) -> None:
    spec = carried(model)
    if spec is not None:
        remove(model, spec)
