"""CPU reduction: torch ops in place on CPU tensors (numpy arrays are viewed as tensors)."""
from __future__ import annotations

from typing import Any

import torch

from resilient.kernels.ops import ReduceOp


def _as_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def reduce_into(dst: Any, src: Any, op: ReduceOp | str) -> None:
    """``dst <- op(dst, src)`` in place, no temporary. Raises ``ValueError`` on a shape or
    dtype mismatch (nothing is modified then)."""
    d, s = _as_tensor(dst), _as_tensor(src)
    if d.shape != s.shape or d.dtype != s.dtype:
        raise ValueError(f"reduce_into: dst {tuple(d.shape)}/{d.dtype} vs src {tuple(s.shape)}/{s.dtype}")
    op = ReduceOp.parse(op)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        d.add_(s)
    elif op is ReduceOp.PROD:
        d.mul_(s)
    elif op is ReduceOp.MIN:
        torch.minimum(d, s, out=d)
    else:
        torch.maximum(d, s, out=d)
