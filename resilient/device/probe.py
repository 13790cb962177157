"""This process's :class:`~resilient.device.select.DeviceRecord`.

One responsibility: describe where this member's tensors live, for the transport
selection: the device string, and for a CUDA device its GPU UUID as torch reports it
(``torch.cuda.get_device_properties(i).uuid``, written ``GPU-<hex>`` as nvidia-smi does).
Whether NCCL is loadable is :func:`nccl_loadable` (the NCCL transport's own way of
finding the library); :func:`this_device` is the device a worker publishes by default.

Failure behaviour: :func:`nccl_loadable` and :func:`this_device` never raise; a CUDA device that this torch cannot see raises
:class:`~resilient.errors.ConfigError` naming ``pip install -e '.[gpu]'``; a device type
other than CPU/CUDA raises ``ConfigError``; nothing else raises.
"""
from __future__ import annotations

import os

import torch

from resilient.device.cuda import INSTALL_HINT
from resilient.device.select import DeviceRecord
from resilient.errors import ConfigError


def gpu_uuid(device: torch.device) -> str:
    """``GPU-<hex>`` of a CUDA device of this process."""
    if not torch.cuda.is_available():
        raise ConfigError(f"cannot read the UUID of {device}: this torch ({torch.__version__}) sees no CUDA device; "
                          f"{INSTALL_HINT}")
    raw = str(torch.cuda.get_device_properties(device).uuid)
    return "GPU-" + raw.removeprefix("GPU-")


def local_record(member: str, host: str, device: torch.device | str, nccl: bool = False) -> DeviceRecord:
    """This member's record: ``cpu``, or ``cuda:N`` with its GPU UUID."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return DeviceRecord(member, host, "cpu", None, nccl)
    if dev.type != "cuda":
        raise ConfigError(f"tensors on {dev} are not supported: use CPU or CUDA tensors")
    index = dev.index if dev.index is not None else 0
    return DeviceRecord(member, host, f"cuda:{index}", gpu_uuid(torch.device("cuda", index)), nccl)


def nccl_loadable() -> bool:
    """Whether this process can load NCCL (as :class:`~resilient.transport.nccl.CtypesNccl`
    finds it: ``$RESILIENT_NCCL_LIBRARY``, the ``nvidia-nccl-cu12`` wheel, the system's)."""
    import ctypes

    from resilient.transport.nccl_api import find_nccl_library

    try:
        ctypes.CDLL(find_nccl_library())
    except OSError:
        return False
    return True


def this_device() -> str:
    """``cuda:<current device>`` where this torch sees a GPU, else ``cpu``. Scripts often
    call ``torch.cuda.set_device(local_rank)`` only *after* ``init_process_group`` (when
    this is read): so on a machine with several GPUs where the current device is still 0,
    a launcher's ``LOCAL_RANK`` names the GPU (``cuda:<LOCAL_RANK mod device count>``),
    as torchrun's one-process-per-GPU convention has it. A wrong guess only costs speed:
    two members naming one GPU get the host-staged path, never NCCL (docs/cuda.md)."""
    if not torch.cuda.is_available():
        return "cpu"
    current, count = torch.cuda.current_device(), torch.cuda.device_count()
    local = os.environ.get("LOCAL_RANK", "")
    if current == 0 and count > 1 and local.isdigit():
        return f"cuda:{int(local) % count}"
    return f"cuda:{current}"


def member_record(member: str, host: str, device: torch.device | str | DeviceRecord) -> DeviceRecord:
    """The record a member publishes: ``device`` as given (a :class:`DeviceRecord` is taken
    as is, e.g. a test's claimed GPU), else :func:`local_record` with NCCL probed for CUDA."""
    if isinstance(device, DeviceRecord):
        if device.member != member:
            raise ConfigError(f"device record of {device.member!r} given to member {member!r}: pass its own")
        return device
    dev = torch.device(device)
    return local_record(member, host, dev, nccl=dev.type == "cuda" and nccl_loadable())
