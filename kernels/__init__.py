"""Reduction kernels with per-chunk progress marks (DESIGN §5).

The one interface the collectives use::

    reduce_into(dst, src, op)   # dst <- op(dst, src), in place, same shape and dtype

``op`` is a :class:`ReduceOp` (or its name). CPU tensors and numpy arrays are reduced by
:mod:`resilient.kernels.cpu`; the GPU implementation lives in
:mod:`resilient.kernels.cupy_impl`.
"""
from __future__ import annotations

from resilient.kernels.ops import ReduceOp
from resilient.kernels.cpu import reduce_into

__all__ = ["ReduceOp", "reduce_into"]
