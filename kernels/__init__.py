"""Reduction kernels with per-chunk progress marks (docs/design.md §5).

The interface the collectives use::

    reduce_into(dst, src, op)   # dst <- op(dst, src), in place, same shape and dtype

    reducer = chunk_reducer(n_chunks, device)                     # CPU or CuPy
    reducer.reduce_chunk(c, dst, src, op, mark=op_seq + 1)        # reduce, then mark c
    reducer.marks.finished(mark=op_seq + 1)                       # chunks that finished

``op`` is a :class:`ReduceOp` (or its name). CPU tensors and numpy arrays are reduced by
:mod:`resilient.kernels.cpu`; the GPU implementation (CUDA source in ``kernels/cuda/``,
loaded through CuPy, which is imported lazily) lives in :mod:`resilient.kernels.cupy_impl`.
"""
from __future__ import annotations

from resilient.kernels.chunk import ChunkReducer, CpuChunkReducer, chunk_reducer
from resilient.kernels.cpu import SUPPORTED_DTYPES, reduce_into
from resilient.kernels.ops import ReduceOp
from resilient.kernels.progress import ProgressMarks

__all__ = [
    "ChunkReducer", "CpuChunkReducer", "ProgressMarks", "ReduceOp", "SUPPORTED_DTYPES",
    "chunk_reducer", "reduce_into",
]
