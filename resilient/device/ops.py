"""The device-generic buffer operations the ledger, algorithms and recovery work on.

One responsibility: the :class:`DeviceOps` protocol (and its small helpers) that hides
where an op's accumulators live. Everything a collective does to its buffers goes
through it::

    ops = device_ops(tensor.device)            # CpuOps or CudaOps (resilient.device)
    ops.wait_for_caller()                      # the caller's pending work on the tensor is done
    acc = ops.empty(numel, dtype)              # accumulator, on the tensor's device
    piece = ops.view(acc, start, end)          # a flat piece of it (shares memory)
    red = ops.reducer(n_chunks)                # progress marks, one slot per chunk
    ops.reduce(red, c, piece, received, op, mark=seq + 1)   # reduce, THEN mark c
    ev = ops.to_host(stage, piece)             # D2H into a (pinned) host staging buffer
    ev = ops.from_host(piece, stage)           # H2D from it
    ops.release_to_caller()                    # the caller's stream sees our results
    with ops.op_stream(): ...                  # the op thread's own torch work, ordered with ours

The CPU implementation (:class:`resilient.device.cpu.CpuOps`) is today's behaviour:
torch CPU tensors, :func:`resilient.kernels.reduce_into`, synchronous copies (every
event is already done). The CUDA one (:class:`resilient.device.cuda.CudaOps`) keeps the
accumulators on the GPU, reduces with the CuPy kernels (the mark is written by the
kernel after the reduction, into host-mapped memory) and copies on its own streams.

Failure behaviour: argument errors (a view out of range, a non-flat buffer, mismatched
sizes) raise :class:`~resilient.errors.ConfigError` naming the fix before anything is
written; device faults surface as the device library's error on the next wait.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch

from resilient.errors import ConfigError
from resilient.kernels import ChunkReducer, ReduceOp


@runtime_checkable
class CopyEvent(Protocol):
    """Completion of one enqueued copy."""

    def done(self) -> bool:
        """True once the copy finished (never blocks)."""
        ...

    def wait(self) -> None:
        """Block until the copy finished."""
        ...


class Completed:
    """The event of a synchronous copy: already done."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def __repr__(self) -> str:
        return "Completed()"


COMPLETED = Completed()


@runtime_checkable
class DeviceOps(Protocol):
    """Buffer operations of one device (see the module docstring for the call order)."""

    @property
    def device(self) -> torch.device:
        """Where the accumulators live."""
        ...

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat uninitialised accumulator of ``numel`` elements on :attr:`device`."""
        ...

    def view(self, flat: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of a flat contiguous buffer (shares memory)."""
        ...

    def reducer(self, n_chunks: int) -> ChunkReducer:
        """A chunk reducer with ``n_chunks`` mark slots for buffers on this device."""
        ...

    def reduce(self, reducer: ChunkReducer, chunk: int, dst: torch.Tensor, src: torch.Tensor,
               op: ReduceOp | str, mark: int, after: CopyEvent | None = None) -> None:
        """``dst <- op(dst, src)``, then mark slot ``chunk`` with ``mark``; ordered after
        ``after`` (a copy that produced ``src`` or ``dst``). May return before it ran
        (CUDA): the mark says when it finished."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst <- src`` on this device (same size and dtype), ordered with :meth:`reduce`."""
        ...

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host staging buffer (pinned where the device needs it for async copies)."""
        ...

    def to_host(self, host_dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        """Enqueue ``host_dst <- src`` (device to host) after this device's pending work."""
        ...

    def from_host(self, dst: torch.Tensor, host_src: torch.Tensor) -> CopyEvent:
        """Enqueue ``dst <- host_src`` (host to device) after this device's pending work."""
        ...

    def wait_for_caller(self) -> None:
        """Order everything enqueued afterwards after the caller's pending work (the
        user's tensor is complete). No-op on CPU."""
        ...

    def release_to_caller(self) -> None:
        """Make the caller's later work wait for everything enqueued here. No-op on CPU."""
        ...

    def synchronize(self) -> None:
        """Block until everything enqueued here finished."""
        ...

    def op_stream(self) -> AbstractContextManager[object]:
        """While entered, plain torch work of the calling thread goes where :meth:`reduce`
        and :meth:`copy` go (CUDA: the compute stream), so the op's own ``copy_``/``clone``
        are ordered with them. Nothing on CPU."""
        ...


def check_flat(t: torch.Tensor, what: str) -> None:
    """:class:`ConfigError` unless ``t`` is a 1-d contiguous tensor."""
    if t.dim() != 1 or not t.is_contiguous():
        raise ConfigError(f"{what} must be a flat contiguous tensor, got shape {tuple(t.shape)}: "
                          "pass tensor.reshape(-1) of a contiguous tensor")


def check_range(flat: torch.Tensor, start: int, end: int) -> tuple[int, int]:
    """``(start, end)`` as ints, or :class:`ConfigError` naming the valid range."""
    check_flat(flat, "a viewed buffer")
    s, e, n = int(start), int(end), flat.numel()
    if not 0 <= s <= e <= n:
        raise ConfigError(f"view [{start}, {end}) is outside the buffer of {n} elements: "
                          f"use 0 <= start <= end <= {n}")
    return s, e


def check_same(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """:class:`ConfigError` unless ``dst`` and ``src`` have one element count and dtype."""
    if dst.numel() != src.numel() or dst.dtype != src.dtype:
        raise ConfigError(f"{what}: dst {dst.numel()}x{dst.dtype} vs src {src.numel()}x{src.dtype}: "
                          "pass buffers of the same size and dtype")
