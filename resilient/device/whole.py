"""Whole-tensor host staging: run a CPU-only op on the host copies of a call's tensors.

One responsibility: for the ops whose data path is CPU-only (the compressed/quantized
allreduce's codec, the leaf paths of demoted members, the torch backend's composed ops:
gather, scatter, all_to_all, reduce, the coalesced forms), copy each device tensor of
the call D2H into a host buffer of its device's ops (pinned for CUDA), let the op run on
those host tensors exactly as for CPU tensors (same values, same contributor contract),
and copy the outputs H2D back once it completed. CPU tensors are staged too when staging
is forced (``RESILIENT_STAGING=1`` / ``Communicator(staging=True)``), which is how this is
tested without a GPU; otherwise they are used as they are.

:data:`COUNTS` counts the whole-tensor copies of this process (diagnostics, tests).

Failure behaviour: a device without usable ops raises
:class:`~resilient.errors.ConfigError` from :func:`~resilient.device.device_ops` when a
tensor is staged; if the op fails, :meth:`WholeStaging.write_back` is never called and the
caller's outputs are left as they were (never partly written back).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from resilient.device import device_ops

R = TypeVar("R")


@dataclass
class StageCounts:
    """Whole-tensor copies: ``d2h`` (staged in) and ``h2d`` (written back)."""

    d2h: int = 0
    h2d: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, d2h: int = 0, h2d: int = 0) -> None:
        with self._lock:
            self.d2h += d2h
            self.h2d += h2d


COUNTS = StageCounts()


def needs_staging(t: torch.Tensor, forced: bool) -> bool:
    """Whether ``t`` goes through the host for a CPU-only op."""
    return t.device.type != "cpu" or forced


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (same shape and values) in a host buffer of its device's ops."""
    h = device_ops(t.device).host_buffer(t.numel(), t.dtype).view(t.shape)
    h.copy_(t)
    COUNTS.add(d2h=1)
    return h


class WholeStaging:
    """The host copies of one call's tensors (see the module docstring)."""

    def __init__(self, forced: bool) -> None:
        self.forced = forced
        self._outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host(self, t: torch.Tensor, output: bool = False) -> torch.Tensor:
        """``t`` itself, or its host copy when it is staged (``output``: written back by
        :meth:`write_back`)."""
        if not needs_staging(t, self.forced):
            return t
        h = to_host(t)
        if output:
            self._outputs.append((t, h))
        return h

    def hosts(self, ts: list[torch.Tensor], output: bool = False) -> list[torch.Tensor]:
        return [self.host(t, output) for t in ts]

    @property
    def staged(self) -> bool:
        return bool(self._outputs)

    def write_back(self) -> None:
        """Copy every staged output's host copy back into the caller's tensor (H2D)."""
        for t, h in self._outputs:
            t.copy_(h)
        COUNTS.add(h2d=len(self._outputs))

    def then(self, inner: Callable[[], object] | None) -> Callable[[], object] | None:
        """A completion callback: ``inner`` (on the host copies), then :meth:`write_back`."""
        if not self._outputs:
            return inner

        def done() -> object:
            res = inner() if inner is not None else None
            self.write_back()
            return res
        return done

    def run(self, body: Callable[[], R]) -> Callable[[], R]:
        """``body`` followed by :meth:`write_back` (for a synchronous op body); ``body``
        itself when nothing was staged."""
        if not self._outputs:
            return body

        def go() -> R:
            res = body()
            self.write_back()
            return res
        return go
