"""Per-chunk progress marks: which chunk reductions of an op have finished.

A :class:`ProgressMarks` is an array of ``n_chunks`` unsigned 64-bit slots in host memory.
A reducer writes a non-zero *mark* into slot ``c`` only after the reduction of chunk ``c``
is complete; the ledger reads the slots to learn exactly which chunks hold a finished
accumulator. Mark values are chosen by the caller (for example ``op_seq + 1``, or a step
number), so a reader can tell a mark of this op from a stale one of an earlier op when it
does not :meth:`reset` between ops.

On CPU the slots are plain memory written after the reduction returns. On GPU
(:class:`resilient.kernels.cupy_impl.MappedProgressMarks`) they live in host-mapped pinned
memory written by the kernel itself after a system-scope fence, so they stay readable and
exact when the stream never returns (a hung NCCL kernel queued behind, then aborted):
reading marks never synchronises with the device.
"""
from __future__ import annotations

import numpy as np

from resilient.errors import ConfigError


class ProgressMarks:
    """``n_chunks`` mark slots backed by a host ``uint64`` array (zero = not finished)."""

    def __init__(self, n_chunks: int, buffer: np.ndarray | None = None) -> None:
        if int(n_chunks) < 1:
            raise ConfigError(f"ProgressMarks needs at least one chunk, got n_chunks={n_chunks}")
        self.n_chunks = int(n_chunks)
        if buffer is None:
            buffer = np.zeros(self.n_chunks, dtype=np.uint64)
        if buffer.dtype != np.uint64 or buffer.shape != (self.n_chunks,):
            raise ConfigError(f"mark buffer must be uint64[{self.n_chunks}], got {buffer.dtype}{list(buffer.shape)}")
        self._slots = buffer

    def check_chunk(self, chunk: int) -> int:
        """``chunk`` as an index, or :class:`ConfigError` naming the valid range."""
        c = int(chunk)
        if not 0 <= c < self.n_chunks:
            raise ConfigError(f"chunk index {chunk} out of range: this reducer has chunks 0..{self.n_chunks - 1}")
        return c

    @staticmethod
    def check_mark(mark: int) -> np.uint64:
        m = int(mark)
        if not 0 < m < 2**64:
            raise ConfigError(f"a progress mark must be in 1..2**64-1 (0 means 'not finished'), got {mark}")
        return np.uint64(m)

    def publish(self, chunk: int, mark: int) -> None:
        """Host-side publish (the CPU reducer calls this after the reduction returned)."""
        self._slots[self.check_chunk(chunk)] = self.check_mark(mark)

    def read(self) -> np.ndarray:
        """A snapshot copy of every slot (never waits for the device)."""
        return self._slots.copy()

    def get(self, chunk: int) -> int:
        return int(self._slots[self.check_chunk(chunk)])

    def finished(self, mark: int | None = None) -> tuple[int, ...]:
        """Chunks whose slot is set (to ``mark`` exactly, when given), in index order."""
        snap = self.read()
        hit = snap != 0 if mark is None else snap == np.uint64(int(mark))
        return tuple(int(i) for i in np.flatnonzero(hit))

    def reset(self) -> None:
        """Zero every slot. Only safe while no reduction using these marks is in flight."""
        self._slots[:] = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n_chunks={self.n_chunks}, finished={list(self.finished())})"
