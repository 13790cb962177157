"""GPU chunk reduction with progress marks in host-mapped pinned memory (CuPy).

The kernels are ``kernels/cuda/reduce.cu``, compiled at first use by NVRTC through
``cupy.RawModule`` (one module per process and device, cached). Each launch reduces one
chunk with 16-byte vector loads and, when its last block finishes, writes the chunk's mark
into a host-mapped pinned slot after ``__threadfence_system()``. Reading the marks is a
plain host memory read: it never synchronises with the device, so it keeps working and
stays exact while the stream is stuck (for example behind a hung NCCL kernel that is
about to be aborted).

Buffers can be CUDA ``torch.Tensor`` s (any supported dtype, bfloat16 included) or CuPy
arrays; they must be contiguous and on this reducer's device. Launches go to the caller's
current stream (torch's for tensors, CuPy's for arrays) unless ``stream`` is given, so they
order naturally with the NCCL receive that produced ``src``.

CuPy is imported inside functions only: ``import resilient.kernels`` works without it.
Failure behaviour: without CuPy or without a GPU, constructing :class:`CupyChunkReducer`
raises :class:`~resilient.errors.ConfigError` naming the fix; argument errors raise
``ConfigError`` before anything is launched; a kernel that faults surfaces as CuPy's
``CUDARuntimeError`` on the next synchronising call, and the marks of chunks it did not
finish stay unset. A chunk whose mark is unset after an abort may be *partly* reduced.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from resilient.errors import ConfigError
from resilient.kernels.chunk import ChunkReducer
from resilient.kernels.ops import ReduceOp
from resilient.kernels.progress import ProgressMarks

SOURCE = Path(__file__).resolve().parent / "cuda" / "reduce.cu"
GATE_SOURCE = Path(__file__).resolve().parent / "cuda" / "gate.cu"
THREADS = 256
BLOCKS_PER_SM = 8

# dtype name (torch or numpy spelling) -> kernel suffix
DTYPES = {
    "float32": "float32", "float": "float32",
    "float64": "float64", "double": "float64",
    "float16": "float16", "half": "float16",
    "bfloat16": "bfloat16",
    "int32": "int32", "int": "int32",
    "int64": "int64", "long": "int64",
}
_OP_KERNEL = {ReduceOp.SUM: "sum", ReduceOp.AVG: "sum", ReduceOp.PROD: "prod", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


def import_cupy() -> Any:
    """``cupy``, or :class:`ConfigError` saying how to get it."""
    try:
        import cupy  # noqa: PLC0415 - lazy on purpose
    except ImportError as exc:
        raise ConfigError(
            f"the GPU kernels need CuPy ({exc}); install it with `pip install -e '.[gpu]'` from a checkout "
            "or `pip install 'resilient-collectives[gpu]'` (cupy-cuda12x), or use CPU tensors"
        ) from None
    return cupy


def kernel_name(op: ReduceOp | str, dtype: str) -> str:
    """Exported symbol for ``op`` on ``dtype``, e.g. ``resilient_reduce_sum_bfloat16``."""
    key = str(dtype).replace("torch.", "")
    if key not in DTYPES:
        raise ConfigError(f"GPU reduce: dtype {dtype} is not supported; use one of {sorted(set(DTYPES.values()))}")
    return f"resilient_reduce_{_OP_KERNEL[ReduceOp.parse(op)]}_{DTYPES[key]}"


@functools.lru_cache(maxsize=None)
def _module(path: str, device_index: int) -> Any:
    cupy = import_cupy()
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=Path(path).read_text(), options=("--std=c++17",))


def reduce_module(device_index: int = 0) -> Any:
    """The compiled ``reduce.cu`` RawModule for a device (compiled once, cached)."""
    return _module(str(SOURCE), device_index)


def gate_module(device_index: int = 0) -> Any:
    return _module(str(GATE_SOURCE), device_index)


class MappedProgressMarks(ProgressMarks):
    """Marks in pinned host memory mapped into the device address space.

    The host reads through a numpy view of the pinned allocation; the device writes
    through the same address (unified virtual addressing, which every 64-bit CUDA platform
    we support has), so no copy or synchronisation is involved.
    """

    def __init__(self, n_chunks: int) -> None:
        cupy = import_cupy()
        n = int(n_chunks)
        if n < 1:
            raise ConfigError(f"ProgressMarks needs at least one chunk, got n_chunks={n_chunks}")
        self._mem = cupy.cuda.PinnedMemory(8 * n, flags=cupy.cuda.runtime.hostAllocMapped)
        self._ptr = int(self._mem.ptr)
        view = np.frombuffer(self._mem, dtype=np.uint64, count=n)
        view[:] = 0
        super().__init__(n, view)

    def device_ptr(self, chunk: int) -> int:
        return self._ptr + 8 * self.check_chunk(chunk)


def _buffer_info(x: Any) -> tuple[int, int, str, int, Any]:
    """(pointer, element count, dtype name, device index, stream) of a CUDA tensor/array."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        if x.device.type != "cuda":
            raise ConfigError(f"GPU reduce needs CUDA tensors, got one on {x.device}; use CpuChunkReducer for CPU")
        if not x.is_contiguous():
            raise ConfigError("GPU reduce needs contiguous tensors: call .contiguous() on the chunk view")
        stream = torch.cuda.current_stream(x.device).cuda_stream
        return x.data_ptr(), x.numel(), str(x.dtype).replace("torch.", ""), x.device.index or 0, stream
    if mod.startswith("cupy"):
        cupy = import_cupy()
        if not x.flags.c_contiguous:
            raise ConfigError("GPU reduce needs C-contiguous CuPy arrays: use cupy.ascontiguousarray")
        return x.data.ptr, x.size, x.dtype.name, x.device.id, cupy.cuda.get_current_stream().ptr
    raise ConfigError(f"GPU reduce needs a CUDA torch.Tensor or a cupy.ndarray, got {type(x).__name__}")


class CupyChunkReducer(ChunkReducer):
    """Chunk reducer for one CUDA device; see the module docstring for the guarantees."""

    def __init__(self, n_chunks: int, device_index: int | None = None) -> None:
        cupy = import_cupy()
        try:
            ndev = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDARuntimeError without a driver
            raise ConfigError(f"no usable CUDA device for the GPU kernels ({exc}); use CPU tensors") from None
        self.device_index = int(device_index or 0)
        if not 0 <= self.device_index < ndev:
            raise ConfigError(f"CUDA device {self.device_index} does not exist (this machine has {ndev})")
        dev = cupy.cuda.Device(self.device_index)
        with dev:
            self._sms = int(dev.attributes["MultiProcessorCount"])
            self.marks: MappedProgressMarks = MappedProgressMarks(n_chunks)   # device-written marks
            self._done_blocks = cupy.zeros(int(n_chunks), dtype=cupy.uint32)
        self._module = reduce_module(self.device_index)
        self._last_stream: int | None = None

    def grid_for(self, n: int, itemsize: int) -> int:
        vectors = max(1, (n * itemsize + 15) // 16)
        return int(max(1, min((vectors + THREADS - 1) // THREADS, self._sms * BLOCKS_PER_SM)))

    def launch(self, dst: Any, src: Any, op: ReduceOp | str, mark_ptr: int, counter_ptr: int,
               mark: int, stream: int | None = None, dtype: str | None = None) -> None:
        """Enqueue one reduction (``mark_ptr`` 0: no mark). Validates before launching.

        ``dtype`` reinterprets CuPy arrays of the same item size (CuPy has no bfloat16:
        pass ``uint16`` arrays holding bfloat16 bits with ``dtype="bfloat16"``)."""
        cupy = import_cupy()
        dp, n, dt, dev, dstream = _buffer_info(dst)
        sp, n2, dt2, dev2, _ = _buffer_info(src)
        if dtype is not None:
            want = str(dtype).replace("torch.", "")
            size = {"float64": 8, "int64": 8, "float32": 4, "int32": 4}.get(DTYPES.get(want, ""), 2)
            if dst.dtype.itemsize != size or src.dtype.itemsize != size:
                raise ConfigError(f"GPU reduce: cannot view {dt}/{dt2} buffers as {want} (item size {size})")
            dt = dt2 = want
        if (n, dt) != (n2, dt2) or dev != dev2:
            raise ConfigError(f"GPU reduce: dst {n}x{dt} on cuda:{dev} vs src {n2}x{dt2} on cuda:{dev2}: "
                              "pass chunks of the same size and dtype on one device")
        if dev != self.device_index:
            raise ConfigError(f"GPU reduce: buffers on cuda:{dev}, reducer on cuda:{self.device_index}")
        kernel = self._module.get_function(kernel_name(op, dt))
        itemsize = {"float64": 8, "int64": 8, "float32": 4, "int32": 4}.get(DTYPES[dt], 2)
        s = stream if stream is not None else dstream
        self._last_stream = s
        with cupy.cuda.Device(self.device_index):
            kernel((self.grid_for(n, itemsize),), (THREADS,),
                   (np.uint64(dp), np.uint64(sp), np.uint64(n), np.uint64(counter_ptr),
                    np.uint64(mark_ptr), np.uint64(mark)),
                   stream=cupy.cuda.ExternalStream(s))

    def reduce_chunk(self, chunk: int, dst: Any, src: Any, op: ReduceOp | str, mark: int = 1,
                     stream: int | None = None, dtype: str | None = None) -> None:
        """Enqueue ``dst <- op(dst, src)`` and the mark publish; returns without waiting."""
        c = self.marks.check_chunk(chunk)
        m = int(ProgressMarks.check_mark(mark))
        counter = int(self._done_blocks.data.ptr) + 4 * c
        self.launch(dst, src, op, self.marks.device_ptr(c), counter, m, stream, dtype)

    def reduce_into(self, dst: Any, src: Any, op: ReduceOp | str, stream: int | None = None,
                    dtype: str | None = None) -> None:
        """The same kernel without a mark (what the bandwidth benchmark measures)."""
        self.launch(dst, src, op, 0, int(self._done_blocks.data.ptr), 1, stream, dtype)

    def synchronize(self) -> None:
        cupy = import_cupy()
        with cupy.cuda.Device(self.device_index):
            if self._last_stream is not None:
                cupy.cuda.ExternalStream(self._last_stream).synchronize()
            else:
                cupy.cuda.Device(self.device_index).synchronize()

    def close(self) -> None:
        self._done_blocks = None


class Gate:
    """Holds a stream until :meth:`open` (``kernels/cuda/gate.cu``): simulates a stream stuck
    behind a hung kernel. The wait is bounded by ``max_seconds`` so it cannot wedge the GPU."""

    def __init__(self, device_index: int = 0) -> None:
        cupy = import_cupy()
        self.device_index = device_index
        self._mem = cupy.cuda.PinnedMemory(8, flags=cupy.cuda.runtime.hostAllocMapped)
        self._view = np.frombuffer(self._mem, dtype=np.uint32, count=2)
        self._view[:] = 0

    def hold(self, stream: int, max_seconds: float = 60.0) -> None:
        cupy = import_cupy()
        fn = gate_module(self.device_index).get_function("resilient_wait_gate")
        ptr = int(self._mem.ptr)
        with cupy.cuda.Device(self.device_index):
            fn((1,), (1,), (np.uint64(ptr), np.uint64(int(max_seconds * 1e6)), np.uint64(ptr + 4)),
               stream=cupy.cuda.ExternalStream(stream))

    def open(self) -> None:
        self._view[0] = 1

    @property
    def timed_out(self) -> bool:
        return bool(self._view[1])
