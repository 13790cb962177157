"""How an op waits on its requests: suspects past ``op_timeout``, probes past a short interval.

One responsibility: :func:`wait_op`, the loop behind
:meth:`~resilient.collectives.algorithms.base.OpContext.wait`. A wait that lasts
:func:`probe_interval` seconds (1 s, or a quarter of ``op_timeout`` when that is shorter:
well before it) asks the peers it still waits on which collective op they are in
(:meth:`~resilient.transport.base.Transport.probe`), and asks again every interval. Two
members that called different collectives, shapes or dtypes at the same op number, with
no data between them in that op (a broadcast from two different roots), then both fail
the op with :class:`~resilient.errors.OpMismatch` (the op loop turns it into
``InputMismatch`` on every member) instead of waiting forever; a peer that is merely
slower, in an earlier op or in ours with our descriptor, is never failed by a probe.
Past ``op_timeout`` (every ``op_timeout``) the peers still waited on are reported as
suspects once per wait, and the wait goes on: the coordinator decides, never one peer's
word.

Failure behaviour: :func:`wait_op` never gives up by itself; whatever the transport's
wait raises (the abort of an epoch change, a failed link, an op failed by a mismatch or a
peer's ERROR) propagates unchanged. A transport that is not a full
:class:`~resilient.transport.base.Transport` (a test's stand-in, a device op's split
transport) is not probed: it is waited on in slices of ``op_timeout`` as before.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

from resilient.transport.base import Request, Transport

#: seconds a wait lasts before the peers it waits on are probed (and between probes)
PROBE_AFTER_S = 1.0


class Waits(Protocol):
    """What an op waits through (the op's transport)."""

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool: ...


def probe_interval(op_timeout: float | None) -> float:
    """Seconds between probes of a lasting wait: :data:`PROBE_AFTER_S`, at most a quarter
    of ``op_timeout``."""
    return PROBE_AFTER_S if op_timeout is None else min(PROBE_AFTER_S, op_timeout / 4)


def wait_op(transport: Waits, reqs: Sequence[Request], seq: int, op_timeout: float | None,
            on_suspect: Callable[[str, str], None]) -> None:
    """Wait until every request of ``reqs`` (op ``seq``) is done (see the module docstring)."""
    reported: set[str] = set()

    def report() -> None:
        for r in reqs:
            if not r.done() and r.peer not in reported:
                reported.add(r.peer)
                on_suspect(r.peer, f"op #{seq}: waited more than {op_timeout}s")

    if not isinstance(transport, Transport):
        while not transport.wait(reqs, timeout=op_timeout):
            report()
        return
    every = probe_interval(op_timeout)
    now = time.monotonic()
    next_probe = now + every
    next_report = None if op_timeout is None else now + op_timeout
    while True:
        due = next_probe if next_report is None else min(next_probe, next_report)
        if transport.wait(reqs, timeout=max(0.0, due - time.monotonic())):
            return
        now = time.monotonic()
        if now >= next_probe:
            transport.probe(sorted({r.peer for r in reqs if not r.done()}))
            next_probe = now + every
        if next_report is not None and op_timeout is not None and now >= next_report:
            report()
            next_report = now + op_timeout
