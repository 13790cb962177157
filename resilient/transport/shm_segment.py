"""One member's shared-memory segment for the direct same-host allreduce
(:mod:`resilient.collectives.algorithms.shm_direct`): create, grow, map, publish words,
wait for a peer's words. Nothing here knows about collectives.

A segment is an anonymous ``memfd`` (it has no name: nothing is ever created in
``/dev/shm``; the kernel frees it when the last process that maps it or holds its
descriptor is gone, so a SIGKILLed member leaves nothing behind), sealed against
shrinking (it may grow; it can never shrink under a reader: no SIGBUS). Its owner maps it
read-write and is its only writer; a peer opens it through ``/proc/<owner pid>/fd/<fd>``
(same user, same PID namespace: :class:`Locator` says which) and maps it **read-only**.

Layout: a 4 KiB header of 64-bit words (word 0's low half is the *bell*, a futex word
the owner bumps and wakes after every published change), then the data area. The words'
meaning belongs to the user (:data:`W_DONE`, :func:`area_word` ... are named here so
both sides agree); the data area holds :data:`AREAS` areas whose offsets the owner
publishes.
Ordering relies on x86-64's total store order (a reader that sees a word sees every byte
the owner wrote before it): :func:`supported` is false elsewhere.

Failure behaviour: :meth:`OwnSegment.create` and :meth:`OwnSegment.ensure` raise
``OSError`` (memfd, ftruncate, mmap: e.g. ``ENOMEM``/``EMFILE``); :meth:`PeerSegment.open`
never raises, it returns None with the reason (a locator that is malformed, names another
PID namespace, a descriptor that is not the announced sealed memfd, a process that is
gone); waits return after their timeout at the latest (the caller decides what to do).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import platform
import stat
import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

HEADER = 4096
#: header words (int64); word 0 holds the bell. Per segment: layout magic, data bytes,
#: the last op the owner finished reading its peers for, the peer it sleeps on now
W_MAGIC, W_SIZE, W_DONE, W_WAITING = 1, 2, 3, 4
#: per data area (:func:`area_word`): the op whose input is in it, the op whose reduced
#: chunk is in it, that op's descriptor digest and byte count, the area's byte offset
A_IN, A_RED, A_DIGEST, A_NBYTES, A_OFFSET = range(5)
AREAS = 2
_MAGIC = 0x52534844_00000001  # "RSHD", layout version 1
_PAGE = mmap.PAGESIZE

_LOC = struct.Struct("<8sIIqqqqq")
_LOC_MAGIC = b"RSHMDIR1"
LOCATOR_BYTES = _LOC.size

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT_MAX = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc: ctypes.CDLL | None = None


@functools.cache
def supported() -> bool:
    """Whether this process can use segments: Linux on x86-64 (total store order) with
    ``memfd_create`` and a readable ``/proc/self/ns/pid``."""
    if not (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and hasattr(os, "memfd_create")):
        return False
    try:
        os.stat("/proc/self/ns/pid")
    except OSError:
        return False
    return True


def _sys() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep until the 32-bit word at ``addr`` is woken, differs from ``expected`` or
    ``timeout_s`` passed (the GIL is released meanwhile). Spurious returns are fine."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _sys().syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every process sleeping on the 32-bit word at ``addr``."""
    _sys().syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(_INT_MAX), None, None, 0)


def area_word(area: int, field: int) -> int:
    """The header word of ``field`` (``A_*``) of data area ``area`` (0 or 1)."""
    return 8 + 8 * area + field


def _pid_ns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


@dataclass(frozen=True)
class Locator:
    """Where a peer finds a segment: owner pid and descriptor number, the file's inode
    and device (so a reused pid or descriptor is never mistaken for it), the owner's PID
    namespace, and ``sid`` (a number the user chooses, carried along)."""

    pid: int
    fd: int
    ino: int
    dev: int
    pid_ns: int
    sid: int

    @property
    def where(self) -> tuple[int, int, int, int]:
        """The segment itself (``sid`` aside): pid, descriptor, inode, device."""
        return self.pid, self.fd, self.ino, self.dev

    def encode(self) -> bytes:
        return _LOC.pack(_LOC_MAGIC, 1, self.sid, self.pid, self.fd, self.ino, self.dev, self.pid_ns)

    @staticmethod
    def decode(raw: bytes) -> "Locator | None":
        """The locator in ``raw``, or None when it is not one (wrong size, magic or version)."""
        if len(raw) != _LOC.size:
            return None
        magic, version, sid, pid, fd, ino, dev, pid_ns = _LOC.unpack(raw)
        if magic != _LOC_MAGIC or version != 1 or pid <= 0 or fd < 0:
            return None
        return Locator(pid, fd, ino, dev, pid_ns, sid)


class _Mapped:
    """A mapping of a segment and the views made of it once."""

    def __init__(self, mm: mmap.mmap, writable: bool) -> None:
        self.mm = mm
        self.size = len(mm)
        self.words: np.ndarray[Any, Any] = np.frombuffer(mm, dtype=np.int64, count=HEADER // 8)
        self.bell: np.ndarray[Any, Any] = np.frombuffer(mm, dtype=np.int32, count=1)
        self.bell_addr = int(self.bell.ctypes.data)
        with warnings.catch_warnings():   # a read-only mapping: torch warns, we never write it
            warnings.simplefilter("ignore")
            self.data = torch.frombuffer(mm, dtype=torch.uint8, count=self.size - HEADER, offset=HEADER)
        self.writable = writable

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of the data area as a flat tensor of ``dtype``."""
        return self.data[offset:offset + nbytes].view(dtype)


class OwnSegment:
    """This member's segment (the only writer). ``ensure(n)`` makes the data area at
    least ``n`` bytes (growing keeps the header and every word)."""

    def __init__(self, fd: int, mapped: _Mapped) -> None:
        self.fd, self._m = fd, mapped

    @classmethod
    def create(cls, data_bytes: int = 0) -> "OwnSegment":
        fd = os.memfd_create("resilient-shmd", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            size = HEADER + page_round(data_bytes)
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            m = _Mapped(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), True)
        except BaseException:
            os.close(fd)
            raise
        m.words[W_SIZE] = size - HEADER
        m.words[W_MAGIC] = _MAGIC
        return cls(fd, m)

    def locator(self, sid: int) -> Locator:
        st = os.fstat(self.fd)
        return Locator(os.getpid(), self.fd, st.st_ino, st.st_dev, _pid_ns(), sid)

    @property
    def capacity(self) -> int:
        return self._m.size - HEADER

    def ensure(self, nbytes: int) -> None:
        """Grow the data area to at least ``nbytes``. OSError when it cannot."""
        if nbytes <= self.capacity:
            return
        size = HEADER + page_round(nbytes)
        os.ftruncate(self.fd, size)
        old = self._m
        self._m = _Mapped(mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), True)
        del old   # unmapped once the last view of it is gone
        self._m.words[W_SIZE] = size - HEADER

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self._m.view(offset, nbytes, dtype)

    def word(self, i: int) -> int:
        return int(self._m.words[i])

    def set(self, i: int, value: int) -> None:
        """Store word ``i`` (readers may see it at once; nobody is woken)."""
        self._m.words[i] = value

    def ring(self, wake: bool) -> None:
        """Bump the bell (after storing words); ``wake``: also wake its sleepers (a
        syscall: the caller skips it when no peer said it sleeps on this bell)."""
        m = self._m
        m.bell[0] = (int(m.bell[0]) + 1) & _INT_MAX
        if wake:
            futex_wake(m.bell_addr)

    def close(self) -> None:
        """Release the descriptor (peers that mapped it keep their mapping)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PeerSegment:
    """A peer's segment, mapped read-only (remapped when the owner grew it)."""

    def __init__(self, fd: int, mapped: _Mapped, locator: Locator) -> None:
        self._fd, self._m, self.locator = fd, mapped, locator

    @classmethod
    def open(cls, loc: Locator) -> "tuple[PeerSegment | None, str]":
        """Open and map the segment ``loc`` names: ``(segment, "")`` or ``(None, reason)``."""
        try:
            if loc.pid_ns != _pid_ns():
                return None, "the owner is in another PID namespace"
            fd = os.open(f"/proc/{loc.pid}/fd/{loc.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return None, f"cannot open the owner's descriptor: {exc}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_ino, st.st_dev) != (loc.ino, loc.dev) or st.st_size < HEADER:
                raise ValueError("the descriptor is not the announced segment")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK:
                raise ValueError("the segment is not sealed against shrinking")
            m = _Mapped(mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ), False)
            if int(m.words[W_MAGIC]) != _MAGIC:
                raise ValueError("the segment has another layout version")
        except (OSError, ValueError) as exc:
            os.close(fd)
            return None, str(exc)
        return cls(fd, m, loc), ""

    def word(self, i: int) -> int:
        return int(self._m.words[i])

    def bell(self) -> int:
        return int(self._m.bell[0])

    def wait(self, bell: int, timeout_s: float) -> None:
        """Sleep until the owner rings the bell past ``bell`` (or ``timeout_s``)."""
        futex_wait(self._m.bell_addr, bell, timeout_s)

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of the owner's data area (remapping when it
        grew). ValueError when the segment is smaller (the owner did not grow it)."""
        end = offset + nbytes
        if offset < 0 or nbytes < 0:
            raise ValueError(f"peer segment: bytes [{offset}, {end}) requested")
        if end > self._m.size - HEADER:
            size = os.fstat(self._fd).st_size
            if size - HEADER < end:
                raise ValueError(f"peer segment holds {size - HEADER} bytes, [{offset}, {end}) requested")
            self._m = _Mapped(mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ), False)
        return self._m.view(offset, nbytes, dtype)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def page_round(n: int) -> int:
    """``n`` rounded up to whole pages (at least one)."""
    return max(_PAGE, -(-n // _PAGE) * _PAGE)
