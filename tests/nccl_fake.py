"""An in-process fake of the NCCL seam (:class:`~resilient.transport.nccl.NcclApi`) for
machines without a GPU: a "fabric" that matches sends to receives in posting order per
pair of ranks and copies the bytes, and whose communicators become ready only once every
rank has joined (like NCCL's init). A receive whose sender never sends stays in flight
forever - a hung NCCL kernel. It takes numpy arrays, memoryviews and contiguous CPU torch
tensors (standing in for device buffers). Used by tests/test_nccl_transport.py,
tests/test_transport_contract.py and tests/test_device_routing.py."""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import numpy as np
import torch

from resilient.errors import ConfigError, TransportError
from resilient.transport.nccl import HEADER, UID_BYTES, NcclApi, P2POp


class Fabric:
    """Shared by the FakeNccl of every member in one test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.joined: dict[bytes, dict[int, "FakeComm"]] = {}
        self.queues: dict[tuple[bytes, int, int, str], list[dict]] = {}
        self.inits: list[tuple[str, int, bytes, int]] = []     # (member, nranks, uid, rank)
        self.bytes_moved = 0                                    # payload bytes copied send -> recv


def _bytes(buf: Any) -> np.ndarray:
    """The bytes of a numpy array or CPU tensor, writable in place."""
    if isinstance(buf, torch.Tensor):
        return buf.view(-1).view(torch.uint8).numpy() if buf.numel() else np.zeros(0, np.uint8)
    if isinstance(buf, memoryview):
        return np.frombuffer(buf.cast("B"), np.uint8) if buf.nbytes else np.zeros(0, np.uint8)
    return buf.view(np.uint8)


class FakeComm:
    def __init__(self, uid: bytes, nranks: int, rank: int) -> None:
        self.uid, self.nranks, self.rank = uid, nranks, rank
        self.aborted = False
        self.async_error: str | None = None


class FakeNccl(NcclApi):
    def __init__(self, fabric: Fabric, member: str) -> None:
        self.fabric, self.member = fabric, member
        self.aborts: list[FakeComm] = []

    def unique_id(self) -> bytes:
        return os.urandom(UID_BYTES)

    def init_comm(self, nranks: int, uid: bytes, rank: int) -> FakeComm:
        comm = FakeComm(uid, nranks, rank)
        with self.fabric.lock:
            self.fabric.joined.setdefault(uid, {})[rank] = comm
            self.fabric.inits.append((self.member, nranks, uid, rank))
        return comm

    def comm_ready(self, comm: FakeComm) -> bool:
        with self.fabric.lock:
            return len(self.fabric.joined.get(comm.uid, {})) == comm.nranks

    def buffer(self, buf: Any) -> tuple[int, int]:
        if isinstance(buf, torch.Tensor) and buf.device.type == "cpu" and buf.is_contiguous():
            return buf.data_ptr(), buf.numel() * buf.element_size()
        if isinstance(buf, memoryview):
            return _bytes(buf).ctypes.data, buf.nbytes
        if not isinstance(buf, np.ndarray):
            raise ConfigError("fake NCCL takes numpy arrays, memoryviews and contiguous CPU tensors")
        return buf.ctypes.data, buf.nbytes

    def header(self, data: bytes | None) -> np.ndarray:
        return np.zeros(HEADER.size, np.uint8) if data is None else np.frombuffer(bytearray(data), np.uint8)

    def header_bytes(self, buf: Any) -> bytes:
        return bytes(buf.tobytes())

    def launch(self, comm: FakeComm, ops: Sequence[P2POp]) -> list[dict]:
        entries = []
        with self.fabric.lock:
            for op in ops:
                src, dst = (comm.rank, op.peer_rank) if op.kind == "send" else (op.peer_rank, comm.rank)
                e = {"op": op, "done": False}
                self.fabric.queues.setdefault((comm.uid, src, dst, op.kind), []).append(e)
                entries.append(e)
            self._match(comm.uid)
        return entries

    def _match(self, uid: bytes) -> None:
        for (u, src, dst, kind), sends in list(self.fabric.queues.items()):
            if u != uid or kind != "send":
                continue
            recvs = self.fabric.queues.get((uid, src, dst, "recv"), [])
            while sends and recvs:
                s, r = sends.pop(0), recvs.pop(0)
                n = min(s["op"].nbytes, r["op"].nbytes)
                _bytes(r["op"].buf)[:n] = _bytes(s["op"].buf)[:n]
                s["done"] = r["done"] = True
                self.fabric.bytes_moved += n

    def progress(self, comm: FakeComm, handle: list[dict]) -> bool:
        if comm.async_error:
            raise TransportError(comm.async_error)
        with self.fabric.lock:
            self._match(comm.uid)
            return all(e["done"] for e in handle)

    def abort(self, comm: FakeComm) -> None:
        comm.aborted = True
        self.aborts.append(comm)
