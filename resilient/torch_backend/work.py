"""``torch.distributed.Work`` objects for the resilient process group.

:class:`ResilientWork` wraps an engine :class:`~.engine.Handle`: ``wait()`` blocks until
the op is done (re-raising its error, e.g. :class:`~resilient.errors.CollectiveError`),
``is_completed()`` polls, ``get_future()`` returns a ``torch.futures.Future`` completed
with the op's output tensors (what DDP comm hooks chain on), and ``contributors`` is the
exact member set in the result. Completion is delivered by a daemon completion thread
(taken from up to ``KEEP_IDLE`` idle ones that earlier ops left, a new one when none is
idle: ``Thread.start()`` blocks its caller until the new thread runs, 1–2 ms per DDP
bucket on a loaded host). For a Communicator op the op thread hands the completion to
that thread when the op ends (the handle's done-callback: nothing is woken when the op is
issued, and no thread sits blocked on the handle); other handles get a thread that waits
on them. If the op fails the future is completed with the exception. Callbacks chained on the future run on that thread, never on
the communicator's op thread, so one may wait for another op.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist
from torch.futures import Future

from resilient.errors import ResilientTimeout
from resilient.torch_backend.engine import Handle


#: idle completion threads kept for later ops (more in flight at once start new ones)
KEEP_IDLE = 8


class _Completers:
    """Daemon threads that each run one completion at a time and then wait idle for the
    next (at most ``KEEP_IDLE`` idle; a thread beyond that ends). Forgotten in a forked
    child (its threads do not exist there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []

    def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (which must not raise) on an idle thread, or a new one."""
        with self._lock:
            q = self._idle.pop() if self._idle else None
        if q is None:
            q = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(q,), name="resilient-work", daemon=True).start()
        q.put(fn)

    def _loop(self, q: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            q.get()()
            with self._lock:
                if len(self._idle) >= KEEP_IDLE:
                    return
                self._idle.append(q)

    def forget(self) -> None:
        self._lock = threading.Lock()
        self._idle = []


_COMPLETERS = _Completers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_COMPLETERS.forget)


class ResilientWork(dist.Work):
    """A running op (see the module docstring)."""

    def __init__(self, handle: Handle, result: Any, then: Callable[[], object] | None = None) -> None:
        super().__init__()
        self.handle = handle
        self._result = result
        self._then = then
        self._future: Future[Any] = Future()
        self._lock = threading.Lock()
        self._done_lock = threading.Lock()
        self._started = False
        #: ``after(error or None)``: run once the op completed, before the caller sees it
        #: (set by the process group: :mod:`resilient.fsdp`'s step-aside check)
        self.after: Callable[[BaseException | None], None] | None = None
        #: the sender's rank of an any-source receive (set by the process group)
        self.sender_rank: Callable[[], int] | None = None

    @property
    def contributors(self) -> tuple[str, ...]:
        """Member ids whose inputs are in the result (valid after completion)."""
        return tuple(self.handle.contributors)

    def _complete(self) -> None:
        """Wait for the handle, run the completion step once, settle the future; re-raises
        the op's error (the future gets it too)."""
        with self._done_lock:  # one completer at a time: the future is set after ``then``
            after, self.after = self.after, None
            try:
                self.handle.wait()
                then, self._then = self._then, None
                if then is not None:
                    then()
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter and the future
                if after is not None:
                    after(exc)  # may end the process (resilient.fsdp.pause)
                if not self._future.done():
                    self._future.set_exception(exc)
                raise
            if after is not None:
                after(None)
            if not self._future.done():
                self._future.set_result(self._result)

    def _finish_quietly(self) -> None:
        try:
            self._complete()
        except BaseException:  # noqa: BLE001 - already in the future
            pass

    def _ensure_watcher(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        on_done = getattr(self.handle, "add_done_callback", None)
        if on_done is not None:
            # a Communicator op: its op thread hands the completion to an idle completer
            # when the op ends (no thread woken now, while the op thread starts the op, and
            # none blocked on the handle meanwhile)
            on_done(lambda _w: _COMPLETERS.run(self._finish_quietly))
        else:
            _COMPLETERS.run(self._finish_quietly)

    def wait(self, timeout: timedelta | None = None) -> bool:
        secs = None if timeout in (None, timedelta(0)) else timeout.total_seconds()
        if secs is not None and not self.handle.wait(secs):
            raise ResilientTimeout(f"resilient op did not finish within {secs:.1f}s")
        self._complete()
        return True

    def is_completed(self) -> bool:
        return self.handle.is_completed()

    def is_success(self) -> bool:
        if not self.handle.is_completed():
            return False
        try:
            self.handle.wait(0)
        except BaseException:  # noqa: BLE001
            return False
        return True

    def exception(self) -> BaseException | None:
        if not self.handle.is_completed():
            return None
        try:
            self.handle.wait(0)
        except BaseException as exc:  # noqa: BLE001
            return exc
        return None

    def get_future(self) -> Future[Any]:
        self._ensure_watcher()
        return self._future

    def result(self) -> Any:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        return -1 if self.sender_rank is None else self.sender_rank()

    def _source_rank(self) -> int:  # what torch's recv(src=None) reads (distributed_c10d.recv)
        return self.source_rank()

    def abort(self) -> None:  # the engine aborts ops on membership changes by itself
        return None


class _AllWorks:
    """The handle of :func:`batch_work`."""

    def __init__(self, works: Sequence[ResilientWork]) -> None:
        self.works = list(works)
        self.contributors: tuple[str, ...] = ()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self.works:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not w.handle.wait(left):
                return False
        for w in self.works:
            w._complete()  # noqa: SLF001 - results written, errors re-raised, futures settled
        union: dict[str, None] = {}
        for w in self.works:
            union.update(dict.fromkeys(w.contributors))
        self.contributors = tuple(union)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def batch_work(works: Sequence[ResilientWork]) -> ResilientWork:
    """One Work over several (a coalescing block): done when all are, their first error
    re-raised, ``contributors`` the union of theirs; its future's value is the list of
    their results."""
    return ResilientWork(_AllWorks(works), [w._result for w in works])  # noqa: SLF001


def completed_work(result: Any = None) -> ResilientWork:
    """A Work that is already done (for no-op calls such as a world of one)."""

    class _Done:
        contributors: tuple[str, ...] = ()

        def wait(self, timeout: float | None = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    return ResilientWork(_Done(), result)
