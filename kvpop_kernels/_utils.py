"""Shared plumbing of the kernel package: backend dispatch, input guards, allocation.

Dispatch rule (docs/DESIGN.md): CUDA tensors run the Triton kernels; CPU tensors run the
same Triton kernels through the interpreter when ``TRITON_INTERPRET=1`` is set; CPU
tensors otherwise take a PyTorch/NumPy path.  ``TRITON_INTERPRET`` is read when a
``@triton.jit`` function is first run, so it must be set before the kernel modules
are imported (``tests/conftest.py`` does this when CUDA is absent).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

NEVER = 2**31 - 1
"""``evict_at`` value of a token that is never evicted (sinks, kept to the end, in the window)."""

try:  # triton is optional on non-Linux CPU installs
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Pick the backend of one op call from the device of its tensors.

    Returns True for the Triton kernels (CUDA tensors, or CPU tensors under the
    interpreter) and False for the PyTorch CPU path.
    """
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    if dev.type == "cuda":
        if not HAS_TRITON:
            raise RuntimeError("CUDA tensors need triton installed (pip install triton)")
        return True
    if dev.type == "cpu":
        return HAS_TRITON and interpreting()
    raise ValueError(f"unsupported device {dev}: kvpop_kernels runs on 'cuda' (Triton) or 'cpu'")


# --- allocation -------------------------------------------------------------------
# Outputs of the package are allocated through ``empty``.  The test-suite switches
# ``NAN_FILL`` on so that an element a kernel forgets to write shows up as NaN
# (or as a poisoned integer) instead of as a lucky zero.
NAN_FILL = False


def empty(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty`` that the tests can poison (NaN for floats, -7 for integers)."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if NAN_FILL:
        if out.is_floating_point():
            out.fill_(float("nan"))
        else:
            out.fill_(-7)
    return out


# --- input guards -------------------------------------------------------------------
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, x: object, ndim: int, *, floating: bool | None = True,
                 dtypes: Iterable[torch.dtype] | None = None) -> torch.Tensor:
    """Raise a clear TypeError/ValueError when ``x`` is not a tensor of the right rank/dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    elif floating is True and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Raise when ``value`` is not an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_split_options(num_splits: object, block_n: object) -> None:
    """The Triton decode launchers' options: ``num_splits`` an int >= 1 or None, ``block_n`` a power of
    two >= 16 or None."""
    if num_splits is not None:
        check_int("num_splits", num_splits, minimum=1)
    if block_n is not None:
        check_int("block_n", block_n, minimum=16)
        if block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")


def check_gqa(hq: int, hkv: int) -> int:
    """Return the group size ``G = Hq // Hkv`` or raise when ``Hq`` is not a multiple of ``Hkv``."""
    if hkv < 1 or hq < 1 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads ({hq}) must be a positive multiple of the number of KV heads ({hkv})"
        )
    return hq // hkv


def host_check(check: object, device: torch.device) -> bool:
    """Resolve the decode ops' ``check=`` argument: ``True`` / ``False`` as given; ``None`` (the default)
    checks on the host for CPU tensors in an eager call, never for CUDA tensors or while
    ``torch.compile`` traces (the decode hot path stays free of host synchronisation; the kernels'
    device-side guard covers it)."""
    if check is None:
        return device.type == "cpu" and not torch.compiler.is_compiling()
    if not isinstance(check, bool):
        raise TypeError(f"check must be True, False or None, got {check!r}")
    return check


def default_scale(scale: float | None, head_dim: int) -> float:
    """``scale`` or ``head_dim ** -0.5``; a head size below 1 is refused."""
    if head_dim < 1:
        raise ValueError(f"the head size D (the last dimension of q) must be >= 1, got {head_dim}")
    if scale is None:
        return head_dim ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
    return float(scale)
