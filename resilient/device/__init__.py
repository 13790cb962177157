"""Device-generic data path of the collectives (docs/cuda.md).

One responsibility: choose the buffer operations for a tensor's device. The parts:

* :mod:`.ops` - the :class:`DeviceOps` protocol the ledger, algorithms and recovery use;
* :mod:`.cpu` - :class:`CpuOps` (today's behaviour), :mod:`.cuda` - :class:`CudaOps`
  (accumulators on the GPU, CuPy kernels with progress marks, own copy streams);
* :mod:`.staging` - the host-staged schedule (pinned slots, D2H/H2D overlapped with sends);
* :mod:`.select` - host-staged vs NCCL, from the members' device records;
* :mod:`.probe` - this process's device record (GPU UUID).

Importing this package never imports CuPy or initialises CUDA. Failure behaviour:
:func:`device_ops` raises :class:`~resilient.errors.ConfigError` for a device other than
CPU/CUDA, and (from :class:`CudaOps`) naming ``pip install -e '.[gpu]'`` when the GPU
path is unavailable.
"""
from __future__ import annotations

import torch

from resilient.device.cpu import CpuOps
from resilient.device.cuda import CudaOps
from resilient.device.ops import COMPLETED, CopyEvent, DeviceOps
from resilient.device.select import DeviceRecord, TransportChoice, choose_transport
from resilient.device.staging import PieceState, RecvMode, StageChunk, StagingPipeline, plan_chunks
from resilient.errors import ConfigError

__all__ = [
    "COMPLETED", "CopyEvent", "CpuOps", "CudaOps", "DeviceOps", "DeviceRecord", "PieceState", "RecvMode",
    "StageChunk", "StagingPipeline", "TransportChoice", "choose_transport", "device_ops", "plan_chunks",
]

_CPU = CpuOps()
_CUDA: dict[int, CudaOps] = {}


def device_ops(device: torch.device | str) -> DeviceOps:
    """The ops for ``device`` (``cpu``, ``cuda``, ``cuda:N``; CUDA ones cached per index)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return _CPU
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else 0
        if index not in _CUDA:
            _CUDA[index] = CudaOps(index)
        return _CUDA[index]
    raise ConfigError(f"tensors on {dev} are not supported: use CPU or CUDA tensors")


def _cpu_ops_implement_the_protocol(ops: CpuOps) -> DeviceOps:
    return ops   # mypy checks CpuOps against DeviceOps here


def _cuda_ops_implement_the_protocol(ops: CudaOps) -> DeviceOps:
    return ops   # mypy checks CudaOps against DeviceOps here
