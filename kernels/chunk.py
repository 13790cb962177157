"""The chunk-reduction interface: reduce a received chunk, then publish its progress mark.

::

    reducer = chunk_reducer(n_chunks, device)          # CPU or CuPy, chosen by device
    reducer.reduce_chunk(c, acc[c], received, "sum", mark=op_seq + 1)
    ...
    reducer.marks.finished(mark=op_seq + 1)             # chunks whose reduction completed

The ledger uses the marks after a failure: a chunk whose mark is set holds a complete
accumulator (contributor set extended by this member); a chunk whose mark is not set holds
the accumulator as it was *before* the reduction started only if the reducer is not
running any more - on GPU, an unfinished reduction may have written part of the chunk, so
such a chunk's accumulator must be treated as lost (the recovery plan re-fetches it).

Failure behaviour: argument errors raise :class:`~resilient.errors.ConfigError` before
anything is written; the CPU reducer is synchronous (the mark is set when
:meth:`reduce_chunk` returns); the GPU reducer only enqueues, and its marks tell what
finished even if the stream never completes (see :mod:`resilient.kernels.cupy_impl`).
"""
from __future__ import annotations

import abc
from typing import Any

from resilient.kernels.ops import ReduceOp
from resilient.kernels.progress import ProgressMarks


class ChunkReducer(abc.ABC):
    """Reduces chunks into accumulators and publishes one progress mark per chunk slot."""

    marks: ProgressMarks

    @property
    def n_chunks(self) -> int:
        return self.marks.n_chunks

    @abc.abstractmethod
    def reduce_chunk(self, chunk: int, dst: Any, src: Any, op: ReduceOp | str, mark: int = 1) -> None:
        """``dst <- op(dst, src)`` in place, then set slot ``chunk`` to ``mark`` (non-zero).
        ``dst``/``src`` are the chunk's buffers (same shape and dtype)."""

    def synchronize(self) -> None:
        """Wait until every enqueued reduction finished (no-op on CPU)."""

    def reset(self) -> None:
        """Clear every mark (call between ops when nothing is in flight)."""
        self.marks.reset()

    def close(self) -> None:
        """Release device resources (no-op on CPU); idempotent."""

    def __enter__(self) -> "ChunkReducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CpuChunkReducer(ChunkReducer):
    """Synchronous torch reduction in place (:func:`resilient.kernels.cpu.reduce_into`);
    the mark is written after the reduction returned, so a set mark always means done."""

    def __init__(self, n_chunks: int) -> None:
        self.marks = ProgressMarks(n_chunks)

    def reduce_chunk(self, chunk: int, dst: Any, src: Any, op: ReduceOp | str, mark: int = 1) -> None:
        from resilient.kernels.cpu import reduce_into

        c = self.marks.check_chunk(chunk)
        m = ProgressMarks.check_mark(mark)
        reduce_into(dst, src, op)
        self.marks.publish(c, int(m))


def _is_cuda(x: Any) -> bool:
    dev = getattr(x, "device", None)
    if dev is None:
        return False
    return getattr(dev, "type", None) == "cuda" or type(x).__module__.startswith("cupy")


def chunk_reducer(n_chunks: int, device: Any = "cpu") -> ChunkReducer:
    """A reducer for buffers on ``device``: ``"cpu"`` (or a CPU tensor/array) gives
    :class:`CpuChunkReducer`; ``"cuda"``/``"cuda:N"``/a ``torch.device`` of type cuda/a
    CUDA tensor or CuPy array gives :class:`resilient.kernels.cupy_impl.CupyChunkReducer`
    (needs CuPy: ``pip install -e '.[gpu]'``; raises
    :class:`~resilient.errors.ConfigError` saying so when it is missing)."""
    kind = str(device)
    if _is_cuda(device) or kind.startswith("cuda"):
        from resilient.kernels.cupy_impl import CupyChunkReducer

        index = getattr(getattr(device, "device", device), "index", None)
        if index is None and ":" in kind:
            index = int(kind.split(":", 1)[1])
        return CupyChunkReducer(n_chunks, device_index=index)
    return CpuChunkReducer(n_chunks)
