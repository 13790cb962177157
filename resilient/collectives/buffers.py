"""``BufferPool``: flat op buffers reused across ops (fresh 64 MiB allocations cost about
7x a copy in page faults).

Two buffers deep per (numel, dtype), only for buffers of 1 MiB or more that the pool
itself handed out: a user tensor is never kept. Not thread-safe: the op thread alone uses
it. Buffers live on the device of the :class:`~resilient.device.DeviceOps` that makes
them (CPU by default), pooled per device. Nothing here fails beyond torch's own
allocation errors.
"""
from __future__ import annotations

import torch

from resilient.device import DeviceOps, device_ops

MIN_POOLED_BYTES = 1 << 20
DEPTH = 2


class BufferPool:
    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._owned: set[int] = set()

    def take(self, numel: int, dtype: torch.dtype, ops: DeviceOps | None = None) -> torch.Tensor:
        """A flat buffer of ``numel`` elements (contents undefined) on ``ops``' device (default CPU)."""
        ops = ops if ops is not None else device_ops("cpu")
        free = self._free.get((numel, dtype, ops.device))
        buf = free.pop() if free else ops.empty(numel, dtype)
        self._owned.add(buf.data_ptr())
        return buf

    def free_buffers(self) -> list[torch.Tensor]:
        """The buffers kept for reuse now (for logs and tests)."""
        return [b for bufs in self._free.values() for b in bufs]

    def adopt(self, other: "BufferPool") -> None:
        """Take over ``other``'s free buffers (``other`` keeps none): the Communicator that
        replaces a closed one (joiners admitted) reuses memory already faulted in."""
        for buf in other.free_buffers():
            self._owned.add(buf.data_ptr())
            self.release(buf)
        other._free.clear()
        other._owned.clear()

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer :meth:`take` handed out; anything else is ignored."""
        if buf.data_ptr() in self._owned and buf.numel() * buf.element_size() >= MIN_POOLED_BYTES:
            free = self._free.setdefault((buf.numel(), buf.dtype, buf.device), [])
            if len(free) < DEPTH and all(b.data_ptr() != buf.data_ptr() for b in free):
                free.append(buf)
