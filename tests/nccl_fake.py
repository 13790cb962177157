"""An in-process fake of the NCCL seam (:class:`~resilient.transport.nccl.NcclApi`) for
machines without a GPU: a "fabric" that matches sends to receives in posting order per
pair of ranks and copies the bytes, and whose communicators become ready only once every
rank has joined (like NCCL's init). A receive whose sender never sends stays in flight
forever - a hung NCCL kernel. Used by tests/test_nccl_transport.py and
tests/test_transport_contract.py."""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import numpy as np

from resilient.errors import ConfigError, TransportError
from resilient.transport.nccl import UID_BYTES, NcclApi, P2POp


class Fabric:
    """Shared by the FakeNccl of every member in one test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.joined: dict[bytes, dict[int, "FakeComm"]] = {}
        self.queues: dict[tuple[bytes, int, int, str], list[dict]] = {}
        self.inits: list[tuple[str, int, bytes, int]] = []     # (member, nranks, uid, rank)


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
        if not isinstance(buf, np.ndarray):
            raise ConfigError("fake NCCL takes numpy arrays")
        return buf.ctypes.data, buf.nbytes

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
                r["op"].buf.view(np.uint8)[:n] = s["op"].buf.view(np.uint8)[:n]
                s["done"] = r["done"] = True

    def progress(self, comm: FakeComm, handle: list[dict]) -> bool:
        if comm.async_error:
            raise TransportError(comm.async_error)
        with self.fabric.lock:
            self._match(comm.uid)
            return all(e["done"] for e in handle)

    def abort(self, comm: FakeComm) -> None:
        comm.aborted = True
        self.aborts.append(comm)
