"""The CPU implementation of :class:`~resilient.device.ops.DeviceOps`: today's data path.

One responsibility: buffer operations on torch CPU tensors. Reductions are
:func:`resilient.kernels.reduce_into` through :class:`~resilient.kernels.CpuChunkReducer`
(the mark is written after the reduction returned); copies are synchronous, so every
:class:`~resilient.device.ops.CopyEvent` returned is already done and "staging" buffers
are plain host tensors (the staging pipeline then runs exactly as on a GPU, minus the
asynchrony: that is how it is tested).

Failure behaviour: argument errors raise :class:`~resilient.errors.ConfigError` before
anything is written (a failed reduction leaves its mark unset).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from resilient.device.ops import COMPLETED, CopyEvent, check_range, check_same
from resilient.errors import ConfigError
from resilient.kernels import ChunkReducer, CpuChunkReducer, ReduceOp


class CpuOps:
    """Buffer operations on CPU tensors (stateless; one instance serves every op)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _check_cpu(self, t: torch.Tensor, what: str) -> None:
        if t.device.type != "cpu":
            raise ConfigError(f"{what} is on {t.device}, not the CPU: use CudaOps for CUDA tensors")

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(int(numel), dtype=dtype)

    def view(self, flat: torch.Tensor, start: int, end: int) -> torch.Tensor:
        s, e = check_range(flat, start, end)
        return flat[s:e]

    def reducer(self, n_chunks: int) -> ChunkReducer:
        return CpuChunkReducer(n_chunks)

    def reduce(self, reducer: ChunkReducer, chunk: int, dst: torch.Tensor, src: torch.Tensor,
               op: ReduceOp | str, mark: int, after: CopyEvent | None = None) -> None:
        if after is not None:
            after.wait()
        reducer.reduce_chunk(chunk, dst, src, op, mark=mark)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        check_same(dst, src, "copy")
        dst.copy_(src.view(dst.shape))

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(int(numel), dtype=dtype)

    def to_host(self, host_dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        check_same(host_dst, src, "to_host")
        self._check_cpu(host_dst, "the host staging buffer")
        host_dst.copy_(src.view(host_dst.shape))
        return COMPLETED

    def from_host(self, dst: torch.Tensor, host_src: torch.Tensor) -> CopyEvent:
        check_same(dst, host_src, "from_host")
        self._check_cpu(host_src, "the host staging buffer")
        dst.copy_(host_src.view(dst.shape))
        return COMPLETED

    def wait_for_caller(self) -> None:
        return None

    def release_to_caller(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def op_stream(self) -> AbstractContextManager[object]:
        return nullcontext()
