"""The CUDA implementation of :class:`~resilient.device.ops.DeviceOps`.

One responsibility: buffer operations on the tensors of one CUDA device.

* Accumulators are CUDA tensors on that device (``torch.empty(..., device=cuda:N)``).
* Reductions are the CuPy kernels of :mod:`resilient.kernels.cupy_impl`
  (``kernels/cuda/reduce.cu``): each launch reduces one chunk and its last block writes
  the chunk's progress mark into host-mapped pinned memory after a system-scope fence, so
  the mark the ledger reads after an abort names exactly the finished reductions.
* Three streams of our own: ``compute`` (reductions, device copies), ``d2h`` and ``h2d``
  (the host-staged path's copies, so they overlap with the sends and with compute). Each
  copy first waits for ``compute``, and a reduction that consumes a copy waits for its
  event, so the order is that of the calls; :meth:`CudaOps.wait_for_caller` makes
  ``compute`` wait for the caller's current stream (the user's tensor is complete) and
  :meth:`CudaOps.release_to_caller` makes the caller's stream wait for ours.
* Host staging buffers are pinned (``pin_memory=True``): pageable memory would make the
  copies synchronous.

Importable without CUDA: torch's CUDA API is only called and CuPy only imported when a
:class:`CudaOps` is constructed. Failure behaviour: without a CUDA build of torch, a GPU
or CuPy, the constructor raises :class:`~resilient.errors.ConfigError` naming
``pip install -e '.[gpu]'``; argument errors raise ``ConfigError`` before anything is
enqueued; a kernel fault surfaces as CuPy's/torch's CUDA error on the next wait, and the
marks of the chunks it did not finish stay unset (such a chunk may be partly reduced:
recovery treats it as lost).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from resilient.device.ops import CopyEvent, check_range, check_same
from resilient.errors import ConfigError
from resilient.kernels import ChunkReducer, ReduceOp

if TYPE_CHECKING:
    from resilient.kernels.cupy_impl import CupyChunkReducer

INSTALL_HINT = "install the GPU extras with `pip install -e '.[gpu]'` (CuPy, NCCL) and a CUDA build of torch"


class CudaEvent:
    """A :class:`torch.cuda.Event` recorded after one copy."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]  # torch leaves Event.query unannotated

    def wait(self) -> None:
        self.event.synchronize()


def cuda_unavailable_reason() -> str | None:
    """Why :class:`CudaOps` cannot be built here (None: it can). Never raises."""
    if not torch.cuda.is_available():
        return f"this torch ({torch.__version__}) sees no CUDA device"
    try:
        from resilient.kernels.cupy_impl import import_cupy

        import_cupy()
    except ConfigError as exc:
        return str(exc)
    return None


class CudaOps:
    """Buffer operations on one CUDA device (see the module docstring)."""

    def __init__(self, device_index: int = 0) -> None:
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise ConfigError(f"CUDA tensors need the GPU data path, which is unavailable: {reason}; {INSTALL_HINT}")
        count = torch.cuda.device_count()
        self.index = int(device_index)
        if not 0 <= self.index < count:
            raise ConfigError(f"CUDA device {device_index} does not exist (this machine has {count}): "
                              "pass the tensor's own device index")
        self._device = torch.device("cuda", self.index)
        # torch leaves Stream.__new__/Event.__new__ unannotated: targeted ignores below
        self.compute = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        self.d2h = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        self.h2d = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]

    @property
    def device(self) -> torch.device:
        return self._device

    def _check_here(self, t: torch.Tensor, what: str) -> None:
        if t.device != self._device:
            raise ConfigError(f"{what} is on {t.device}, these ops work on {self._device}: "
                              "use the ops of the tensor's own device")

    def _check_pinned(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or not t.is_pinned():
            raise ConfigError("the host staging buffer must be pinned CPU memory: allocate it with host_buffer()")

    def _event(self, stream: torch.cuda.Stream) -> CudaEvent:
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(stream)
        return CudaEvent(ev)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(int(numel), dtype=dtype, device=self._device)

    def view(self, flat: torch.Tensor, start: int, end: int) -> torch.Tensor:
        self._check_here(flat, "the viewed buffer")
        s, e = check_range(flat, start, end)
        return flat[s:e]

    def reducer(self, n_chunks: int) -> ChunkReducer:
        from resilient.kernels.cupy_impl import CupyChunkReducer

        return CupyChunkReducer(n_chunks, device_index=self.index)

    def _cupy_reducer(self, reducer: ChunkReducer) -> "CupyChunkReducer":
        from resilient.kernels.cupy_impl import CupyChunkReducer

        if not isinstance(reducer, CupyChunkReducer) or reducer.device_index != self.index:
            raise ConfigError(f"CUDA reductions need this device's reducer: use CudaOps.reducer(), got {reducer!r}")
        return reducer

    def reduce(self, reducer: ChunkReducer, chunk: int, dst: torch.Tensor, src: torch.Tensor,
               op: ReduceOp | str, mark: int, after: CopyEvent | None = None) -> None:
        red = self._cupy_reducer(reducer)
        self._check_here(dst, "the accumulator")
        self._check_here(src, "the reduced chunk")
        if isinstance(after, CudaEvent):
            self.compute.wait_event(after.event)
        elif after is not None:
            after.wait()
        red.reduce_chunk(chunk, dst, src, op, mark=mark, stream=int(self.compute.cuda_stream))
        dst.record_stream(self.compute)
        src.record_stream(self.compute)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        check_same(dst, src, "copy")
        self._check_here(dst, "the copy's destination")
        with torch.cuda.stream(self.compute):
            dst.copy_(src.view(dst.shape), non_blocking=True)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(int(numel), dtype=dtype, pin_memory=True)

    def to_host(self, host_dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        check_same(host_dst, src, "to_host")
        self._check_pinned(host_dst)
        self._check_here(src, "the D2H source")
        return self._staged_copy(self.d2h, host_dst, src, device_side=src)

    def from_host(self, dst: torch.Tensor, host_src: torch.Tensor) -> CopyEvent:
        check_same(dst, host_src, "from_host")
        self._check_pinned(host_src)
        self._check_here(dst, "the H2D destination")
        return self._staged_copy(self.h2d, dst, host_src, device_side=dst)

    def _staged_copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor,
                     device_side: torch.Tensor) -> CudaEvent:
        """``dst <- src`` on a copy stream, after ``compute``; the device tensor is kept
        alive for that stream (``record_stream``)."""
        stream.wait_stream(self.compute)
        with torch.cuda.stream(stream):
            dst.copy_(src.view(dst.shape), non_blocking=True)
        device_side.record_stream(stream)
        return self._event(stream)

    def wait_for_caller(self) -> None:
        self.compute.wait_stream(torch.cuda.current_stream(self._device))

    def release_to_caller(self) -> None:
        current = torch.cuda.current_stream(self._device)
        for s in (self.compute, self.d2h, self.h2d):
            current.wait_stream(s)

    def synchronize(self) -> None:
        for s in (self.compute, self.d2h, self.h2d):
            s.synchronize()

    def op_stream(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self.compute)
