"""The NCCL seam of :mod:`resilient.transport.nccl`: :class:`NcclApi` (the calls the
transport makes: communicator init/abort, grouped send/recv, async error query, device
buffers) and :class:`CtypesNccl`, its binding to ``libnccl.so.2`` with ``ctypes``
(non-blocking communicators, ``ncclConfig_t`` of NCCL 2.17+), found by
:func:`find_nccl_library`. Tests put a fake behind the seam (tests/nccl_fake.py).

Written by hand on ctypes: no maintained Python binding exposes NCCL's non-blocking
communicators and ``ncclCommAbort``, which the transport's abort-on-epoch-change needs.

Failure behaviour: :func:`find_nccl_library` raises :class:`~resilient.errors.ConfigError`
naming the package to install; a failing NCCL call raises
:class:`~resilient.errors.TransportError` with NCCL's error string.
"""
from __future__ import annotations

import abc
import ctypes
import os
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from resilient.errors import ConfigError, TransportError
from resilient.settings import Settings
from resilient.transport.base import Buffer

UID_BYTES = 128
#: the in-band header of every message: op_seq, tag, descriptor digest, payload bytes
HEADER = struct.Struct("<qqQQ")

# --------------------------------------------------------------------------------------
# the seam
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class P2POp:
    kind: str          # "send" | "recv"
    ptr: int
    nbytes: int
    peer_rank: int
    buf: Any           # kept alive until the launch completes


class NcclApi(abc.ABC):
    """Every NCCL/CUDA call the transport makes. All calls return without blocking on peers."""

    @abc.abstractmethod
    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (128 bytes)."""

    @abc.abstractmethod
    def init_comm(self, nranks: int, uid: bytes, rank: int) -> Any:
        """Start a non-blocking ``ncclCommInitRankConfig``; returns the communicator."""

    @abc.abstractmethod
    def comm_ready(self, comm: Any) -> bool:
        """True once initialisation finished; raises :class:`TransportError` if it failed."""

    @abc.abstractmethod
    def buffer(self, buf: Buffer) -> tuple[int, int]:
        """(device pointer, byte count) of a buffer; :class:`ConfigError` if unusable."""

    @abc.abstractmethod
    def header(self, data: bytes | None) -> Buffer:
        """A device buffer of :data:`HEADER` size holding ``data`` (a send's header), or
        one to receive a header into (``None``)."""

    @abc.abstractmethod
    def header_bytes(self, buf: Buffer) -> bytes:
        """The bytes of a received header buffer (after its launch completed)."""

    @abc.abstractmethod
    def launch(self, comm: Any, ops: Sequence[P2POp]) -> Any:
        """Enqueue ``ops`` as one group; returns a handle for :meth:`progress`."""

    @abc.abstractmethod
    def progress(self, comm: Any, handle: Any) -> bool:
        """True when every op of the launch completed; raises :class:`TransportError` on an
        NCCL async error."""

    @abc.abstractmethod
    def abort(self, comm: Any) -> None:
        """``ncclCommAbort``: returns promptly, kills the communicator's kernels."""


# --------------------------------------------------------------------------------------
# the real api: libnccl through ctypes, CUDA streams/events through torch
# --------------------------------------------------------------------------------------

NCCL_SUCCESS, NCCL_IN_PROGRESS = 0, 7
NCCL_UINT8 = 1


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UID_BYTES)]


class _ConfigV21700(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p),
    ]


def _config_nonblocking() -> _ConfigV21700:
    undef = -(2**31)   # NCCL_CONFIG_UNDEF_INT
    return _ConfigV21700(ctypes.sizeof(_ConfigV21700), 0xCAFEBEEF, 21700, 0, undef, undef, undef, None)


def find_nccl_library() -> str:
    """``$RESILIENT_NCCL_LIBRARY``, the ``nvidia-nccl-cu12`` wheel's, or the system's."""
    env = Settings.from_env().nccl_library
    if env:
        return env
    try:
        import nvidia.nccl  # noqa: PLC0415

        for root in list(getattr(nvidia.nccl, "__path__", [])):
            cand = os.path.join(root, "lib", "libnccl.so.2")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    import ctypes.util

    return ctypes.util.find_library("nccl") or "libnccl.so.2"


class CtypesNccl(NcclApi):
    """The real NCCL, for one CUDA device (``torch.cuda``)."""

    def __init__(self, device: int = 0, library: str | None = None) -> None:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise ConfigError("the NCCL transport needs a CUDA GPU; use the TCP transport on CPU")
        path = library or find_nccl_library()
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as exc:
            raise ConfigError(f"cannot load NCCL ({path}: {exc}); `pip install nvidia-nccl-cu12` "
                              "or set RESILIENT_NCCL_LIBRARY to libnccl.so.2") from None
        self.torch = torch
        self.device = torch.device("cuda", device)
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch.cuda.Stream.__new__ is unannotated
        lib = self.lib
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId,
                                               ctypes.c_int, ctypes.POINTER(_ConfigV21700)]
        lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        for fn in (lib.ncclSend, lib.ncclRecv):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                           ctypes.c_void_p]
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]

    def _check(self, rc: int, what: str) -> int:
        if rc not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise TransportError(f"{what} failed: NCCL error {rc} ({self.lib.ncclGetErrorString(rc).decode()})")
        return rc

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), UID_BYTES)

    def init_comm(self, nranks: int, uid: bytes, rank: int) -> Any:
        u = _UniqueId()
        ctypes.memmove(ctypes.addressof(u), uid, UID_BYTES)
        comm = ctypes.c_void_p()
        cfg = _config_nonblocking()
        with self.torch.cuda.device(self.device):
            self._check(self.lib.ncclCommInitRankConfig(ctypes.byref(comm), nranks, u, rank, ctypes.byref(cfg)),
                        "ncclCommInitRankConfig")
        return comm

    def _async_state(self, comm: Any) -> int:
        state = ctypes.c_int(NCCL_IN_PROGRESS)
        self._check(self.lib.ncclCommGetAsyncError(comm, ctypes.byref(state)), "ncclCommGetAsyncError")
        return self._check(state.value, "NCCL communicator")

    def comm_ready(self, comm: Any) -> bool:
        return self._async_state(comm) == NCCL_SUCCESS

    def buffer(self, buf: Buffer) -> tuple[int, int]:
        t = self.torch
        if not isinstance(buf, t.Tensor) or buf.device != self.device or not buf.is_contiguous():
            raise ConfigError(f"the NCCL transport needs contiguous CUDA tensors on {self.device}")
        return buf.data_ptr(), buf.numel() * buf.element_size()

    def header(self, data: bytes | None) -> Buffer:
        t = self.torch
        if data is None:
            return t.zeros(HEADER.size, dtype=t.uint8, device=self.device)
        return t.frombuffer(bytearray(data), dtype=t.uint8).to(self.device)

    def header_bytes(self, buf: Buffer) -> bytes:
        assert isinstance(buf, self.torch.Tensor)
        return bytes(buf.cpu().numpy().tobytes())

    def launch(self, comm: Any, ops: Sequence[P2POp]) -> Any:
        t, lib = self.torch, self.lib
        self.stream.wait_stream(t.cuda.current_stream(self.device))
        s = ctypes.c_void_p(self.stream.cuda_stream)
        with t.cuda.device(self.device):
            self._check(lib.ncclGroupStart(), "ncclGroupStart")
            for op in ops:
                fn = lib.ncclSend if op.kind == "send" else lib.ncclRecv
                self._check(fn(ctypes.c_void_p(op.ptr), op.nbytes, NCCL_UINT8, op.peer_rank, comm, s), f"nccl{op.kind}")
            self._check(lib.ncclGroupEnd(), "ncclGroupEnd")
        return {"event": None, "ops": list(ops)}

    def progress(self, comm: Any, handle: Any) -> bool:
        if handle["event"] is None:        # group still being enqueued (non-blocking mode)
            if self._async_state(comm) != NCCL_SUCCESS:
                return False
            ev = self.torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda.Event.__new__ is unannotated
            ev.record(self.stream)
            handle["event"] = ev
        if handle["event"].query():
            return True
        self._async_state(comm)            # raises on a peer failure
        return False

    def abort(self, comm: Any) -> None:
        self.lib.ncclCommAbort(comm)
