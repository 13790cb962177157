"""CPU reduction: torch ops in place on CPU tensors (numpy arrays are viewed as tensors).

Numerics (tested against references in ``tests/test_kernels_cpu.py``):

* float32/float64: one IEEE operation per element, exactly what ``torch`` computes.
* float16/bfloat16: torch computes each element in float32 and rounds once to
  nearest-even. Since float32 carries at least 2p+2 bits for both formats (p = 11 and 8),
  rounding twice (exact -> float32 -> 16 bit) equals rounding the exact result once, so
  results are bit-identical to a float64 reference rounded to the 16-bit type: the test
  tolerance is **zero ulp** (NaN compares equal to NaN).
* min/max propagate NaN (``torch.minimum``/``torch.maximum``).
* int32/int64 sum and prod **wrap** modulo 2^32/2^64 (two's complement), like torch; no
  error is raised on overflow.
* AVG sums; the collective divides once by the size of its contributor set.

No temporary is allocated: ``add_``/``mul_``/``minimum(out=dst)`` write into ``dst``.
"""
from __future__ import annotations

from typing import Any

import torch

from resilient.errors import ConfigError
from resilient.kernels.ops import ReduceOp

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
)


def as_tensor(x: Any) -> torch.Tensor:
    """A tensor sharing memory with ``x`` (a tensor, or a numpy array viewed in place)."""
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.from_numpy(x)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"reduce_into needs a torch.Tensor or a writable numpy array with a supported dtype, "
            f"got {type(x).__name__} ({exc})"
        ) from None


def check_pair(d: torch.Tensor, s: torch.Tensor) -> None:
    """Raise :class:`ConfigError` (a ``ValueError``) naming the mismatch; nothing is modified."""
    if d.shape != s.shape or d.dtype != s.dtype:
        raise ConfigError(f"reduce_into: dst {tuple(d.shape)}/{d.dtype} vs src {tuple(s.shape)}/{s.dtype}: "
                          "pass buffers of the same shape and dtype")
    if d.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"reduce_into: dtype {d.dtype} is not supported; use one of "
                          f"{[str(t).replace('torch.', '') for t in SUPPORTED_DTYPES]}")
    if d.device != s.device:
        raise ConfigError(f"reduce_into: dst on {d.device} but src on {s.device}: move them to one device")


def reduce_into(dst: Any, src: Any, op: ReduceOp | str) -> None:
    """``dst <- op(dst, src)`` in place, no temporary.

    Raises :class:`~resilient.errors.ConfigError` (a ``ValueError``) on a shape, dtype or
    device mismatch, an unsupported dtype or an unknown op; nothing is modified then.
    Works for tensors on any torch device (on CUDA it is torch's elementwise kernel; the
    progress-marked GPU path is :mod:`resilient.kernels.cupy_impl`).
    """
    d, s = as_tensor(dst), as_tensor(src)
    check_pair(d, s)
    op = ReduceOp.parse(op)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        d.add_(s)
    elif op is ReduceOp.PROD:
        d.mul_(s)
    elif op is ReduceOp.MIN:
        torch.minimum(d, s, out=d)
    else:
        torch.maximum(d, s, out=d)
