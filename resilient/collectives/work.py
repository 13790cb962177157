"""``Work``: the handle an async collective returns."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol


class OpOutcome(Protocol):
    """What an op's future holds (:class:`~.ops.OpResult`, :class:`~.compressed.CompressedResult`)."""

    @property
    def contributors(self) -> tuple[str, ...]: ...

    @property
    def piece_contributors(self) -> list[tuple[str, ...]] | None: ...


class Work:
    """``wait()`` blocks until the op finished and re-raises its error (e.g.
    :class:`~resilient.errors.InputMismatch`, :class:`~resilient.errors.RemovedFromGroup`);
    ``is_completed()`` never blocks; ``contributors`` (after completion) is the tuple of
    member ids the result is the exact reduction over (``AVG`` divided by its size);
    ``piece_contributors`` lists per-piece sets under the ``per_segment`` policy."""

    def __init__(self, future: Future[OpOutcome]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        self._future.result(timeout)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def result(self) -> OpOutcome:
        return self._future.result()

    @property
    def contributors(self) -> tuple[str, ...]:
        return self._future.result().contributors

    @property
    def piece_contributors(self) -> list[tuple[str, ...]] | None:
        return self._future.result().piece_contributors

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(self)`` once the op finished (at once if it has; on the op thread
        otherwise). An exception in ``fn`` is logged by concurrent.futures, not raised."""
        self._future.add_done_callback(lambda _f: fn(self))

    def exception(self) -> BaseException | None:
        return self._future.exception()
