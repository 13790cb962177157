"""Large CPU copies with streaming (non-temporal) stores: :func:`copy_into`.

The direct shared-memory allreduce (:mod:`resilient.collectives.algorithms.shm_direct`)
copies every input into its segment, every peer's reduced chunk out of the peer's segment,
and the result back into the caller's tensor: three passes over the op's bytes, none of
whose destinations is read again soon. Through the cache (torch's ``copy_``) those copies
run at DRAM speed with a read of every destination line first; with streaming stores they
skip that read, ~1.5x faster here (docs/bench.md, fifteenth and seventeenth sessions).

Why by hand (``kernels/stream_copy.c``, an optional C extension): torch's copy kernel
writes through the cache, and glibc's ``memcpy`` streams only above a threshold derived
from the cache size, settable only by ``GLIBC_TUNABLES`` before the process starts and then
for the whole process. Where the extension was not built (no C compiler at install time),
:func:`copy_into` is torch's ``copy_``; ``STREAMING`` says which this process has.

``RESILIENT_STREAM_COPY=0`` switches streaming off (every copy is torch's), read once at
the first large copy.

Failure behaviour: :func:`copy_into` raises what ``dst.copy_(src)`` raises for mismatched
shapes or dtypes; it streams only between two contiguous CPU tensors of one dtype and
shape, of at least :data:`MIN_BYTES`, that do not overlap, into a tensor autograd does not
track (anything else is ``copy_``). A streamed copy bumps ``dst``'s version counter as
``copy_`` does. It returns once every byte is stored and visible to other processes (the C
side fences), so a caller may publish a ready word right after it.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch
from torch.autograd.graph import increment_version

_stream_copy: ModuleType | None
try:
    from resilient.kernels import _stream_copy
except ImportError:   # not built: no C compiler when the package was installed
    _stream_copy = None

#: whether this process's :func:`copy_into` streams (the extension is built for x86-64)
STREAMING: bool = _stream_copy is not None and bool(_stream_copy.STREAMING)
#: copies below this stay in the cache (the destination is likely read again soon)
MIN_BYTES = 2 << 20

_enabled: bool | None = None


def enabled() -> bool:
    """Whether large copies stream now: the extension streams and ``RESILIENT_STREAM_COPY``
    is not ``0`` (read once; a malformed value raises :class:`~resilient.errors.ConfigError`)."""
    global _enabled
    if _enabled is None:
        from resilient.settings import Settings
        _enabled = STREAMING and Settings.from_env(os.environ).stream_copy
    return _enabled


def _overlap(a: torch.Tensor, b: torch.Tensor, nbytes: int) -> bool:
    """Whether the ``nbytes`` at ``a`` and at ``b`` share a byte (the same bytes included)."""
    p, q = a.data_ptr(), b.data_ptr()
    return p < q + nbytes and q < p + nbytes


def _streamable(dst: torch.Tensor, src: torch.Tensor, min_bytes: int) -> bool:
    nbytes = dst.numel() * dst.element_size()
    if (nbytes < min_bytes or dst.dtype != src.dtype or dst.shape != src.shape
            or dst.device.type != "cpu" or src.device.type != "cpu" or dst.requires_grad
            or not dst.is_contiguous() or not src.is_contiguous() or not enabled()):
        return False
    return not _overlap(dst, src, nbytes)   # overlapping bytes: torch's copy (and its error)


def copy_into(dst: torch.Tensor, src: torch.Tensor, also: torch.Tensor | None = None,
              min_bytes: int = MIN_BYTES) -> None:
    """``dst.copy_(src)`` (and ``also.copy_(src)``), with streaming stores when both are
    contiguous CPU tensors of one dtype and shape, of at least ``min_bytes`` (default
    :data:`MIN_BYTES`; a caller that knows the destination is not read again soon may
    stream smaller blocks), not overlapping, and ``dst`` does not require grad. With
    ``also``, when both destinations stream and do not overlap, ``src`` is read once for
    the two."""
    nbytes = dst.numel() * dst.element_size()
    if also is not None:
        if (_streamable(dst, src, min_bytes) and _streamable(also, src, min_bytes)
                and not _overlap(dst, also, nbytes)):
            assert _stream_copy is not None   # enabled() implies it
            _stream_copy.copy2(dst.data_ptr(), also.data_ptr(), src.data_ptr(), nbytes)
            increment_version(dst)
            increment_version(also)
            return
        copy_into(dst, src, min_bytes=min_bytes)
        copy_into(also, src, min_bytes=min_bytes)
        return
    if not _streamable(dst, src, min_bytes):
        dst.copy_(src)
        return
    assert _stream_copy is not None   # enabled() implies it
    _stream_copy.copy(dst.data_ptr(), src.data_ptr(), nbytes)
    increment_version(dst)
