"""``KVpopConfig``: every knob of a patched model, validated once.

The config is a frozen dataclass: change a patched model's settings with
``kvpop.patch(model, budget=4096)`` (which re-validates and swaps the config in) rather
than by mutating it.  ``to_dict`` / ``from_dict`` give the JSON form stored in scorer
checkpoints.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from kvpop_kernels.future_target import LABELS
from kvpop_kernels.layout import KV_DTYPES, check_kv_dtype

from .cache_policy import cache_policy, registered_policies

__all__ = ["KVpopConfig", "MAX_SLOTS", "MAX_WIDTH", "BUDGET_PER_POSITION", "check_budget_for", "SCORERS",
           "MASK_SOURCES", "TARGET_LSES", "TARGET_SOURCES", "LABELS", "STRUCTURAL_FIELDS",
           "decay_range_for_context", "EPS_RANGE", "LABEL_POWER_RANGE", "KV_DTYPES", "PRIORITY_SOURCES"]

SCORERS = ("mlp", "mlstm")
MASK_SOURCES = ("scorer", "teacher", "streaming")
TARGET_LSES = ("sparse", "dense")
TARGET_SOURCES = ("student", "teacher")
PRIORITY_SOURCES = ("scorer", "random", "keynorm+", "keynorm-", "window-attention", "oracle-label")
"""Where a token's score ``r`` comes from (``KVpopConfig.priority_source``; docs/DESIGN.md section 12)."""

STRUCTURAL_FIELDS = ("scorer", "scorer_hidden", "mlstm_dim", "gamma_min", "gamma_max")
"""Fields that fix the scorer's parameter shapes or meaning: they must agree between a
patched model and a scorer checkpoint (``window`` too for the ``mlstm`` scorer, whose
readout position is ``t + window``)."""


EPS_RANGE = (1e-30, 1.0)
"""The ``eps`` a config may hold: the target ``log(eps + m)`` is computed in float32 and ``m`` is a mean
attention probability (at most 1).  Past 1 the target flattens to ``m / eps`` and the near-tie discount
silences the score loss; 1e300 is inf in float32 (``inf - inf``: a NaN loss); below 1e-30 (1e-300 is 0 in
float32) a token no later query reads gets ``log(0) = -inf``."""

LABEL_POWER_RANGE = (0.01, 1e4)
"""The power-mean exponent ``a`` of ``label="power"`` a config may hold.  The target computes
``(mean_u p^a)^(1/a)`` in the log domain in float32 (``kvpop_kernels.future_attention_target``): its error is
about ``1e-7 / a`` nats, 4e-5 at 0.01, 0.4 at 1e-6, and below about 1e-10 the result is the max (1e-300 is 0
in float32: every entry ``log(eps)``).  As ``a -> 0`` the power mean tends to the geometric mean, as ``a ->
inf`` to the max (``label="max"``; it lies within ``log(N) / a`` nats of the max of ``N`` readers: 1.4e-3 for
a million at 1e4)."""

MAX_WIDTH = 2**16
"""The widest scorer MLP (``scorer_hidden``) or mLSTM feature (``mlstm_dim``) a config may ask for."""

MAX_SLOTS = 2**31 - 1
"""The most slots a budget (and a sink or window count) may ask for: cache positions are int32, and
``2**31 - 1`` is ``NEVER``.  A model's own bound is tighter, see :data:`BUDGET_PER_POSITION`."""

BUDGET_PER_POSITION = 8
"""``kvpop.patch`` and ``KVpopCache(model)`` refuse a budget above this many times the model's
``max_position_embeddings``: past the longest sequence the model takes a budget evicts nothing and
only allocates (the factor leaves room for RoPE scaling past that length)."""


def check_budget_for(config: Any, model_config: Any, what: str = "budget") -> None:
    """``ValueError`` when ``config.budget`` exceeds :data:`BUDGET_PER_POSITION` times the
    ``max_position_embeddings`` of ``model_config`` (a transformers config; no bound when it has none)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    mp = getattr(text, "max_position_embeddings", None)
    if isinstance(mp, int) and not isinstance(mp, bool) and mp > 0 and config.budget > BUDGET_PER_POSITION * mp:
        raise ValueError(
            f"{what}={config.budget} is more than {BUDGET_PER_POSITION} x the model's max_position_embeddings "
            f"({mp}): it would allocate {config.budget} slots per KV head and layer and evict nothing; give a "
            f"budget <= {BUDGET_PER_POSITION * mp}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _int(name: str, value: Any, minimum: int, maximum: int = MAX_SLOTS) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({str(value)[:60]})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        shown = value if value.bit_length() <= 64 else f"an integer of about {int(value.bit_length() * 0.30103)} digits"
        raise ValueError(f"{name} must be <= {maximum}, got {shown}")


def _pos_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


class ConfigFields:
    """What the frozen config dataclass of every method (``KVpopConfig``, ``DMSConfig``) shares: a
    validated :meth:`replace` and the JSON form stored in checkpoints (with ``"method": METHOD`` when
    the class names one)."""

    METHOD: ClassVar[str | None] = None

    def replace(self, **overrides: Any) -> Any:
        """A validated copy with ``overrides`` applied (unknown names -> TypeError listing the fields)."""
        names = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(overrides) - names)
        if bad:
            raise TypeError(f"unknown {type(self).__name__} field(s) {bad}; valid fields: {sorted(names)}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON-serialisable)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        d = self.to_dict()
        return json.dumps({"method": self.METHOD, **d} if self.METHOD else d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        """Inverse of ``to_dict``; unknown keys -> ValueError."""
        d = {k: v for k, v in d.items() if not (cls.METHOD and k == "method")}
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"unknown {cls.__name__} field(s) {bad} (written by a newer kvpop?)")
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> Any:
        return cls.from_dict(json.loads(s))


@dataclass(frozen=True)
class KVpopConfig(ConfigFields):
    """Settings of KVpop (docs/DESIGN.md notation: ``s`` sinks, ``w`` window, ``B`` budget, ``k = B - s - w``).

    Cache shape
        sinks: ``s`` first tokens kept forever (default 4).
        window: ``w`` most recent tokens, the query included (default 256).
        budget: ``B = s + w + k`` entries per layer and KV head (default 2048).  A learned
            policy needs at least one long-range slot, so ``budget >= sinks + window + 1``
            (``k >= 1``); a smaller budget raises ``ValueError``.  ``budget >= S`` evicts nothing.

    Scorer
        scorer: ``"mlp"`` (two-layer MLP per KV head on the token's pre-RoPE key and value) or
            ``"mlstm"`` (an mLSTM cell per KV head that has read up to ``t + w`` when it scores ``t``);
            see ``kvpop.scorers``.
        scorer_hidden: hidden width of the scorer MLPs (default 128).
        mlstm_dim: key/value feature width ``d`` of the mLSTM memory ``C [d, d]`` (default 64).
        gamma_min, gamma_max: range of the learned per-KV-head decay ``gamma_h`` (default
            [0.999, 0.999999]); ``gamma_init`` its initial value (default 0.9999), strictly inside.

    Training (see ``kvpop.loss`` and ``kvpop.patch``)
        eps: ``epsilon`` of the target ``log(eps + m)`` (default 1e-6), in :data:`EPS_RANGE` ``[1e-30, 1]``.
        label: how the target pools the attention a token receives from the queries after it left
            the window (docs/DESIGN.md section 3): ``"mean"`` (default, the method's), ``"max"`` (its
            strongest later reader) or ``"power"`` (the power mean ``(mean_u p^a)^(1/a)``).
        label_power: the exponent ``a`` of ``label="power"``, in :data:`LABEL_POWER_RANGE` ``[0.01, 1e4]``
            (default 4.0; ``a = 1`` is the mean, large ``a`` approaches the max); validated whatever the label.
        tau: temperature of the logistic score loss ``softplus(-y * delta / tau)`` (default 1.0).
        tie_margin: scale of the near-tie discount ``1 - exp(-|p_tgt[t] - p_tgt[bnd]| / tie_margin)``
            (default 0.5, in natural-log units of mean attention; ``0`` switches the discount off).
        balance: weight keep and drop decisions so that each class carries half the loss of a
            layer (default True).
        mask_source: which priorities build the training mask: ``"scorer"`` (default, the
            learned policy), ``"teacher"`` (the oracle: the exact label itself, no scorer; the name
            means the label the scorer is taught, not the teacher model: whose queries and keys make it
            is ``target_source``, with the default ``"student"`` this model's own in the same pass over
            the dense LSE, one extra no-grad dense attention per layer, whatever ``target_lse``, and the
            loss then uses that label too) or ``"streaming"`` (a constant priority: sinks + a window of
            ``w + k`` tokens, the fine-tune-only ablation).
        target_lse: normaliser used by the target: ``"sparse"`` (the LSE of the sparse attention
            already computed, the paper's cheap choice, default) or ``"dense"`` (exact; one extra
            no-grad dense attention per layer).
        target_source: whose queries and keys make the target: ``"student"`` (default: the model
            being trained, in its own forward, with ``target_lse``) or ``"teacher"`` (exact: the frozen
            teacher's queries, keys and dense LSE, computed inside the teacher's forward layer by layer,
            ``kvpop.teacher_targets``; only ``[B, Hkv, S]`` per layer is kept; ``target_lse`` is then
            unused).  With ``mask_source="teacher"`` the oracle mask uses the same target (the frozen
            teacher's only with ``target_source="teacher"``).
        compute_loss: compute ``L_score`` in training forwards (default True).  Off, a training
            forward only runs sparse attention (fine-tune the model with a fixed scorer).
        priority_source: where the score ``r`` of the priority comes from, in the training mask
            (``mask_source="scorer"``) and in ``KVpopCache`` alike (docs/DESIGN.md section 12):
            ``"scorer"`` (default, the learned scorer) or a control whose priority is not learned (no
            ``L_score``, the scorer never updated): ``"random"`` (the scorer at its seeded init, frozen),
            ``"keynorm+"`` / ``"keynorm-"`` (plus / minus the pre-RoPE key norm), ``"window-attention"``
            (the attention the token received while in the window) or ``"oracle-label"`` (the exact label:
            not causal, full-sequence forwards and prefills only; a decode step refuses it).

    Decoding
        policy: ``"kvpop"`` (default); ``"streaming"``, ``"tova"``, ``"h2o"`` are baselines served by
            ``kvpop.KVpopCache``.  In a full-sequence forward ``"streaming"`` uses the
            constant-priority mask; ``"tova"`` and ``"h2o"`` are defined only while decoding and a
            full-sequence forward under them raises ``NotImplementedError``.  Any policy registered in
            ``kvpop.core.cache_policy`` is accepted (``register_policy``).

    Head-adaptive budgets (docs/DESIGN.md section 7, "Head-adaptive budgets")
        head_budgets: ``None`` (default: every layer and KV head holds ``budget`` entries) or one row per
            layer of one budget ``B[l][h] = s + w + k[l][h]`` per KV head, fixed at retrofit time
            (``kvpop.core.budgets.allocate``) and saved with the scorers.  Every entry is
            ``>= sinks + window`` (a head may keep no long-range slot), every row has the same length
            (the model's KV heads) and the total is the uniform one: ``sum = layers * heads * budget``
            (``budget`` is then the mean).  ``kvpop.patch`` checks the rows against the model.

    Quantised slots (docs/DESIGN.md section 5, "Cache layout")
        kv_dtype: ``None`` (default: the cache keeps keys and values in the model's dtype), ``"int8"`` or
            ``"fp8"`` (float8 e4m3): ``KVpopCache`` stores them in 8 bits with one float32 scale per slot and
            KV head (``kvpop_kernels.layout.QuantizedLayout``), the priorities in float32.  Decoding only
            (training and full-sequence forwards are unchanged); policies ``kvpop`` and ``streaming``.
    """

    sinks: int = 4
    window: int = 256
    budget: int = 2048
    scorer: str = "mlp"
    scorer_hidden: int = 128
    mlstm_dim: int = 64
    eps: float = 1e-6
    label: str = "mean"
    label_power: float = 4.0
    tau: float = 1.0
    tie_margin: float = 0.5
    balance: bool = True
    gamma_min: float = 0.999
    gamma_max: float = 0.999999
    gamma_init: float = 0.9999
    mask_source: str = "scorer"
    target_lse: str = "sparse"
    target_source: str = "student"
    compute_loss: bool = True
    policy: str = "kvpop"
    head_budgets: tuple[tuple[int, ...], ...] | None = None
    kv_dtype: str | None = None
    priority_source: str = "scorer"

    def __post_init__(self) -> None:
        _int("sinks", self.sinks, 0)
        _int("window", self.window, 1)
        _int("budget", self.budget, -(2**63))  # type and the upper bound; the lower one follows
        if self.budget < self.sinks + self.window + 1:
            raise ValueError(
                f"budget={self.budget} leaves no long-range slot: it must be >= sinks + window + 1 = "
                f"{self.sinks} + {self.window} + 1 = {self.sinks + self.window + 1} (k = budget - sinks - window "
                f"must be >= 1 for a learned policy); raise budget or lower window/sinks"
            )
        _choice("scorer", self.scorer, SCORERS)
        _choice("mask_source", self.mask_source, MASK_SOURCES)
        _choice("target_lse", self.target_lse, TARGET_LSES)
        _choice("target_source", self.target_source, TARGET_SOURCES)
        _choice("policy", self.policy, registered_policies())  # the cache policies (kvpop.core.cache_policy)
        _choice("priority_source", self.priority_source, PRIORITY_SOURCES)
        if self.priority_source != "scorer" and self.mask_source != "scorer":
            raise ValueError(f"priority_source={self.priority_source!r} sets the priority of the mask; with "
                             f"mask_source={self.mask_source!r} it would do nothing: use mask_source='scorer'")
        if check_kv_dtype(self.kv_dtype) is not None:
            if not cache_policy(self.policy).static:
                static = registered_policies(static=True)
                raise ValueError(f"kv_dtype={self.kv_dtype!r} works with the policies {static} (an attention-scored "
                                 f"policy scores every slot from full-precision keys), got policy={self.policy!r}")
        _int("scorer_hidden", self.scorer_hidden, 1, MAX_WIDTH)
        _int("mlstm_dim", self.mlstm_dim, 1, MAX_WIDTH)
        _pos_float("eps", self.eps)
        if not EPS_RANGE[0] <= self.eps <= EPS_RANGE[1]:
            raise ValueError(f"eps must lie in [{EPS_RANGE[0]:g}, {EPS_RANGE[1]:g}] (the target log(eps + m), m a mean "
                             f"attention probability <= 1, in float32), got {self.eps!r}")
        if not isinstance(self.label, str) or self.label not in LABELS:
            raise ValueError(f"label must be one of {list(LABELS)}, got {self.label!r}")
        if isinstance(self.label_power, bool) or not isinstance(self.label_power, (int, float)):
            raise TypeError(f"label_power must be a float, got {type(self.label_power).__name__} "
                            f"({self.label_power!r})")
        if not (math.isfinite(self.label_power) and self.label_power > 0):
            raise ValueError(f"label_power must be a finite number > 0 (1 is the mean; for the max use "
                             f"label='max'), got {self.label_power!r}")
        lo, hi = LABEL_POWER_RANGE
        if not lo <= self.label_power <= hi:
            raise ValueError(f"label_power must lie in [{lo:g}, {hi:g}], got {self.label_power!r}: the power mean is "
                             f"computed in float32, which cannot resolve a smaller exponent (below about 1e-10 it "
                             f"returns the max); for a -> inf use label='max'")
        _pos_float("tau", self.tau)
        if isinstance(self.tie_margin, bool) or not isinstance(self.tie_margin, (int, float)) \
                or not math.isfinite(self.tie_margin) or self.tie_margin < 0:
            raise ValueError(f"tie_margin must be a finite number >= 0, got {self.tie_margin!r}")
        if not (0.0 < self.gamma_min < self.gamma_max < 1.0):
            raise ValueError(
                f"need 0 < gamma_min < gamma_max < 1, got gamma_min={self.gamma_min}, gamma_max={self.gamma_max}"
            )
        if not (self.gamma_min < self.gamma_init < self.gamma_max):
            raise ValueError(
                f"gamma_init must lie strictly inside ({self.gamma_min}, {self.gamma_max}), got {self.gamma_init}"
            )

        if self.head_budgets is not None:
            self._check_head_budgets()

    def _check_head_budgets(self) -> None:
        hb = self.head_budgets
        if not isinstance(hb, (tuple, list)) or not hb or not all(isinstance(r, (tuple, list)) and r for r in hb):
            raise TypeError(f"head_budgets must be None or a non-empty sequence (one per layer) of non-empty "
                            f"sequences of ints (one per KV head), got {str(hb)[:80]}")
        rows = tuple(tuple(r) for r in hb)
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"head_budgets: every layer needs one budget per KV head (the same count), got row "
                             f"lengths {sorted({len(r) for r in rows})}")
        for li, r in enumerate(rows):
            for h, b in enumerate(r):
                _int(f"head_budgets[{li}][{h}]", b, self.sinks + self.window)
        total, want = sum(map(sum, rows)), len(rows) * len(rows[0]) * self.budget
        if total != want:
            raise ValueError(
                f"head_budgets must hold the uniform total, layers x heads x budget = {len(rows)} x {len(rows[0])} "
                f"x {self.budget} = {want} entries, got {total} (mean {total / (len(rows) * len(rows[0])):.4g} "
                f"per head); rescale them (kvpop.core.budgets.allocate) or pass head_budgets=None")
        object.__setattr__(self, "head_budgets", rows)  # lists (from JSON) -> tuples: hashable, comparable

    def layer_budgets(self, layer_idx: int, num_heads: int) -> tuple[int, ...]:
        """The budget ``B[l][h]`` of each of the ``num_heads`` KV heads of layer ``layer_idx`` (all ``budget``
        without ``head_budgets``; ``ValueError`` when the rows do not fit the layer)."""
        if self.head_budgets is None:
            return (self.budget,) * num_heads
        if not 0 <= layer_idx < len(self.head_budgets) or len(self.head_budgets[layer_idx]) != num_heads:
            raise ValueError(
                f"head_budgets has {len(self.head_budgets)} layers x {len(self.head_budgets[0])} KV heads; the "
                f"model's layer {layer_idx} has {num_heads} KV heads (allocate budgets for this model)")
        return self.head_budgets[layer_idx]

    def layer_k(self, layer_idx: int, num_heads: int) -> int | tuple[int, ...]:
        """Long-range slots of layer ``layer_idx``: the int ``k`` when uniform, else ``k[l][h]`` per KV head
        (what ``kvpop_kernels.eviction_schedule(k=...)`` takes)."""
        if self.head_budgets is None:
            return self.k
        return tuple(b - self.sinks - self.window for b in self.layer_budgets(layer_idx, num_heads))

    def target_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``kvpop_kernels.future_attention_target`` that this config sets."""
        return {"window": self.window, "eps": self.eps, "label": self.label, "power": float(self.label_power)}

    @property
    def k(self) -> int:
        """Long-range slots ``k = budget - sinks - window`` (>= 1)."""
        return self.budget - self.sinks - self.window

    def structural_mismatch(self, other: KVpopConfig) -> list[str]:
        """Names of the fields that make scorer weights of ``self`` and ``other`` incompatible."""
        names = list(STRUCTURAL_FIELDS)
        if self.scorer == "mlstm" or other.scorer == "mlstm":
            names.append("window")
        return [n for n in names if getattr(self, n) != getattr(other, n)]


def decay_range_for_context(train_len: int, span_nats: float, *, gamma_max: float | None = None,
                            gamma_init: float | None = None) -> dict[str, float]:
    """The learned decay's range tied to the training length: ``{"gamma_min", "gamma_max", "gamma_init"}``.

    ``gamma_min = exp(-span_nats / train_len)``: at the lower end of the range the age penalty
    ``-(q - t) log(gamma)`` grows by ``span_nats`` nats over a token's whole life in a training
    sequence (``q - t = train_len``), whatever the length.  The paper's fixed lower end 0.999 spans
    ``-16384 log(0.999) = 16.4`` nats at its training length 16,384, but only 0.51 nats at 512.
    ``gamma_max`` defaults to ``KVpopConfig``'s (0.999999); ``gamma_init`` to ``KVpopConfig``'s 0.9999
    when that lies strictly inside the range, else to the geometric middle of ``1 - gamma``
    (``1 - sqrt((1 - gamma_min)(1 - gamma_max))``).  The learned per-head decay is
    ``gamma_min + (gamma_max - gamma_min) sigmoid(logit)`` (``KVpopLayer``): free to reach the lower end.
    Pass the result to ``KVpopConfig(**...)`` or ``kvpop.patch(model, **...)``.
    """
    _int("train_len", train_len, 1)
    _pos_float("span_nats", span_nats)
    d = KVpopConfig()
    gmax = d.gamma_max if gamma_max is None else gamma_max
    gmin = math.exp(-float(span_nats) / train_len)
    if not (0.0 < gmin < gmax < 1.0):
        raise ValueError(f"span_nats={span_nats} over train_len={train_len} gives gamma_min={gmin!r}, which must lie "
                         f"below gamma_max={gmax!r} (a span of at least {-train_len * math.log(gmax):.4g} nats)")
    if gamma_init is None:
        gamma_init = d.gamma_init if gmin < d.gamma_init < gmax else 1.0 - math.sqrt((1.0 - gmin) * (1.0 - gmax))
    return {"gamma_min": gmin, "gamma_max": gmax, "gamma_init": float(gamma_init)}
