"""Quantised slots: keys and values in 8 bits with one float32 scale per slot (:class:`QuantizedLayout`, in the
slots of a uniform or packed layout), and the free functions :func:`quantize` / :func:`dequantize`."""
from __future__ import annotations

from dataclasses import replace

import torch

from .base import SlotLayout
from .packed import PackedLayout
from .state import DecodeStep, SlotState
from .uniform import UniformLayout

__all__ = ["KV_DTYPES", "QuantizedLayout", "check_kv_dtype", "dequantize", "quantize"]

KV_DTYPES = ("int8", "fp8")
"""The storage a :class:`QuantizedLayout` offers: ``"int8"`` (symmetric, ``|code| <= 127``) and ``"fp8"``
(``torch.float8_e4m3fn``, ``|code| <= 448``; where torch has it)."""


def check_kv_dtype(kv_dtype) -> tuple[torch.dtype, float] | None:
    """``(storage dtype, largest code)`` of ``kv_dtype`` (None: the model's dtype, no quantisation);
    ``ValueError`` for anything but None and :data:`KV_DTYPES`."""
    if kv_dtype is None:
        return None
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be None (the model's dtype) or one of {list(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == "int8":
        return torch.int8, 127.0
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:  # pragma: no cover - depends on the torch build
        raise ValueError(f"kv_dtype='fp8' needs torch.float8_e4m3fn, which this torch {torch.__version__} lacks; "
                         f"use kv_dtype='int8'")
    return fp8, float(torch.finfo(fp8).max)


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of ``x [..., D]``, one float32 scale per vector: ``scale = max|x| / qmax`` and
    ``codes = x / scale`` (``int8``: rounded half up and clipped to ``[-127, 127]``; ``fp8``: torch's cast,
    round to nearest even), a zero vector with scale 0.  ``dequantize(codes, scale)`` gives it back to
    within half a code step."""
    dtype, qmax = check_kv_dtype(kv_dtype)
    xf = x.float()
    sc = xf.abs().amax(dim=-1) / qmax
    r = xf / torch.where(sc > 0, sc, torch.ones_like(sc))[..., None]
    if dtype == torch.int8:
        return torch.floor(r + 0.5).clamp_(-qmax, qmax).to(torch.int8), sc
    return r.to(dtype), sc


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes [..., D]`` times ``scale [...]``, float32."""
    return codes.float() * scale[..., None]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as its bytes (CPU indexing and ``where`` on float8 are not there in every torch;
    moves of codes are copies of bits)."""
    return x.view(torch.uint8) if x.is_floating_point() and x.element_size() == 1 else x


class QuantizedLayout(SlotLayout):
    """Keys and values of every slot in 8 bits (``kv_dtype``: ``"int8"`` or ``"fp8"``), with one float32 scale
    per slot and KV head for the keys (``k_scale``) and one for the values (``v_scale``), in the slots of
    ``base`` (a :class:`UniformLayout` or :class:`PackedLayout`; default uniform).  The scales have
    ``slot_pos``'s shape and strides; the priorities stay float32.

    A step quantises the new token (:func:`quantize`) and writes its codes and scales into the slot it takes;
    the token leaving the window moves with its codes and scales (no requantisation); the attention
    dequantises every slot on load.  So a quantised step is the base step on the dequantised state
    (``reference.quantized_fixed_budget_decode``).

    ``QuantizedLayout(kv_dtype, base)`` is an instance of a subclass of both this class and ``type(base)``
    (holding ``base``'s budgets): the slots' places are the base layout's own methods, inherited, and this
    class overrides only what quantisation changes (``base`` is kept as :attr:`geometry`)."""

    extra_state = ("k_scale", "v_scale")

    def __new__(cls, *args, **kwargs):
        if cls is not QuantizedLayout:  # a concrete kind (also what copy and pickle call)
            return super().__new__(cls)
        base = args[1] if len(args) > 1 else kwargs.get("base")
        base = UniformLayout() if base is None else base
        kind = _KINDS.get(type(base))
        if kind is None:
            raise TypeError(f"QuantizedLayout's base must be a UniformLayout or PackedLayout, got {base!r}")
        return super().__new__(kind)

    def __init__(self, kv_dtype: str, base: SlotLayout | None = None):
        self.dtype, self.qmax = check_kv_dtype(kv_dtype)
        base = UniformLayout() if base is None else base
        vars(self).update(vars(base))  # the base's budget(s): its inherited methods read them
        self.kv_dtype, self.base = kv_dtype, base

    def __repr__(self) -> str:
        return f"QuantizedLayout({self.kv_dtype!r}, {self.base!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, QuantizedLayout) and (other.kv_dtype, other.base) == (self.kv_dtype, self.base)

    def __hash__(self) -> int:
        return hash((QuantizedLayout.__name__, self.kv_dtype, self.base))

    @property
    def geometry(self) -> SlotLayout:
        return self.base

    def host_budgets(self, T, sinks, window, read):
        base = self.base.host_budgets(T, sinks, window, read)
        return self if base is self.base else QuantizedLayout(self.kv_dtype, base)

    # codes are moved as bits (float8 indexing is not in every torch build)
    def head_state(self, x, head, span, lr=False):
        return super().head_state(_bits(x), head, span, lr)

    def gather_slots(self, x, slot, offs):
        return super().gather_slots(_bits(x), slot, offs).view(x.dtype)

    # what quantisation changes
    def cache_dtype(self, dtype):
        return self.dtype

    def prompt_state(self, key, value):
        kq, ks = quantize(key, self.kv_dtype)
        vq, vs = quantize(value, self.kv_dtype)
        return [("k_cache", _bits(kq)), ("k_scale", ks), ("v_cache", _bits(vq)), ("v_scale", vs)]

    def read_slots(self, state, which, slot, offs):
        codes, scale = getattr(state, f"{which}_cache"), getattr(state, f"{which}_scale")
        return dequantize(self.gather_slots(codes, slot, offs), self.gather_slots(scale, slot, offs))

    def load(self, state):
        return dequantize(state.k_cache, state.k_scale), dequantize(state.v_cache, state.v_scale)

    def check(self, step, state, sinks, window, cache_dtypes=None):
        super().check(step, state, sinks, window, cache_dtypes=(self.dtype,))

    def check_scales(self, state: SlotState) -> None:
        for name in ("k_scale", "v_scale"):
            x, slot_pos = getattr(state, name), state.slot_pos
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{self!r} keeps one scale per slot: pass {name}= a float32 tensor of slot_pos's shape "
                                f"{tuple(slot_pos.shape)}, got {type(x).__name__}")
            if x.dtype != torch.float32 or x.shape != slot_pos.shape or x.stride() != slot_pos.stride():
                raise ValueError(f"{name} must be float32 with slot_pos's shape {tuple(slot_pos.shape)} and strides "
                                 f"{tuple(slot_pos.stride())}, got {x.dtype} {tuple(x.shape)} strides "
                                 f"{tuple(x.stride())}")
            if x.device != slot_pos.device:
                raise ValueError(f"{name} must be on slot_pos's device {slot_pos.device}, got {x.device}")

    def encode(self, step: DecodeStep) -> DecodeStep:
        kq, ks = quantize(step.k_new, self.kv_dtype)
        vq, vs = quantize(step.v_new, self.kv_dtype)
        return replace(step, k_new=kq, v_new=vq, k_new_scale=ks, v_new_scale=vs)

    def torch_write(self, step, state, *, sinks, window):
        return super().torch_write(replace(step, k_new=_bits(step.k_new), v_new=_bits(step.v_new)),
                                   replace(state, k_cache=_bits(state.k_cache), v_cache=_bits(state.v_cache)),
                                   sinks=sinks, window=window)


class _QuantizedUniform(QuantizedLayout, UniformLayout):
    """Quantised slots in the uniform layout."""


class _QuantizedPacked(QuantizedLayout, PackedLayout):
    """Quantised slots in the packed layout."""


_KINDS = {UniformLayout: _QuantizedUniform, PackedLayout: _QuantizedPacked}
