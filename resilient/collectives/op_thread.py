"""``OpThread``: the private thread a Communicator's ops run on, one at a time in call
order (the transport has one user at a time), each timed into the per-op metrics.

Failure behaviour: :meth:`OpThread.submit` after :meth:`OpThread.close` raises
:class:`~resilient.errors.ClosedError`; an op's exception fails its
:class:`~.work.Work` (and is raised at once for a synchronous op); a failed op is not
timed.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from resilient.collectives.op_metrics import OpMetrics
from resilient.collectives.work import Work
from resilient.errors import ClosedError


class OpThread:
    """``epoch()``: the epoch number an op's metrics are recorded under (read when it ends)."""

    def __init__(self, member_id: str, metrics: OpMetrics, epoch: Callable[[], int]) -> None:
        self.metrics, self.epoch = metrics, epoch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"resilient-ops:{member_id}")
        self.closed = False
        self._queued = 0   # submitted, not started yet
        self._lock = threading.Lock()

    def queued(self) -> int:
        """How many submitted functions have not started yet (a background task on this
        thread, e.g. a join agreement's progress, yields to them)."""
        return self._queued

    def submit(self, fn: Callable[[], Any], async_op: bool, kind: str = "", nbytes: int = 0) -> Work:
        """Queue ``fn`` after the ops before it; wait for it unless ``async_op``. ``kind``
        (a collective's name) times it into the metrics with ``nbytes``."""
        if self.closed:
            raise ClosedError("the communicator is closed: build a new Communicator (or resilient.connect())")
        def body() -> Any:
            with self._lock:
                self._queued -= 1
            t0 = time.monotonic()
            res = fn()
            if kind:
                self.metrics.op_finished(kind, time.monotonic() - t0, nbytes, self.epoch())
            return res
        with self._lock:
            self._queued += 1
        try:
            fut: Future[Any] = self._pool.submit(body)
        except BaseException:
            with self._lock:
                self._queued -= 1
            raise
        work = Work(fut)
        if not async_op:
            fut.result()
        return work

    def close(self) -> bool:
        """Refuse new ops and wait for the queued ones; False when already closed."""
        if self.closed:
            return False
        self.closed = True
        self._pool.shutdown(wait=True)
        return True
