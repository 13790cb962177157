"""Opt-in op log: ``RESILIENT_OP_LOG=path`` makes the backend write one JSON line per op.

Each finished op of the resilient process group appends::

    {"t": 1764582000.123, "pid": 4242, "rank": 2, "member": "g0-l2-a0-1f2e3d", "n": 17,
     "kind": "allreduce", "epoch": 3, "contributors": ["g0-l0-...", "g0-l1-...", ...]}

``n`` is the op's ordinal among the ops this process issued on the group (0-based; members
that issued the same ops in the same order give an op the same ``n``), ``rank`` the
launch rank (``$RANK``), ``epoch`` the membership epoch when the op finished and
``contributors`` the exact member set whose inputs are in the result (what
``work.contributors`` says). A failed op has ``"error": "<ErrorClass>: <message>"``
instead of ``contributors``. For debugging ("which members were in step 17's gradient?")
and for tests that check results against the contributor sets.

``path`` may contain ``{pid}``, ``{rank}`` or ``{member}``; without them every process
of the job appends to the same file (each line is one ``write`` on an ``O_APPEND``
descriptor, so lines of different processes never interleave).

Failure behaviour: a path that cannot be opened raises :class:`~resilient.errors.ConfigError`
from ``init_process_group`` naming the variable; a write that fails later is dropped with
a warning (logging never fails an op).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from resilient.errors import ConfigError
from resilient.torch_backend.engine import Handle

log = logging.getLogger(__name__)

ENV = "RESILIENT_OP_LOG"


class _LoggedHandle:
    """An engine handle that writes its op's line once, when it is first seen finished."""

    def __init__(self, inner: Handle, oplog: "OpLogEngine", kind: str, n: int) -> None:
        self._inner, self._log, self._kind, self._n = inner, oplog, kind, n
        self._written = False
        self._lock = threading.Lock()

    @property
    def contributors(self) -> tuple[str, ...]:
        return self._inner.contributors

    def _record(self, error: BaseException | None) -> None:
        with self._lock:
            if self._written:
                return
            self._written = True
        rec: dict[str, Any] = {"kind": self._kind, "n": self._n}
        if error is None:
            rec["contributors"] = list(self._inner.contributors)
        else:
            rec["error"] = f"{type(error).__name__}: {error}"
        self._log.write(rec)

    def wait(self, timeout: float | None = None) -> bool:
        try:
            done = self._inner.wait(timeout)
        except BaseException as exc:
            self._record(exc)
            raise
        if done is not False:
            self._record(None)
        return done

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class OpLogEngine:
    """Delegates everything to ``inner``; calls that return a handle (the ops) are logged."""

    def __init__(self, inner: Any, path: str) -> None:
        self._inner = inner
        self._n = 0
        self._n_lock = threading.Lock()
        member = str(getattr(inner, "member_id", ""))
        rank = os.environ.get("RANK", "")
        self._static = {"pid": os.getpid(), "rank": int(rank) if rank.isdigit() else rank, "member": member}
        path = path.replace("{pid}", str(os.getpid())).replace("{rank}", rank).replace("{member}", member)
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise ConfigError(f"{ENV}={path!r}: cannot open the op log ({exc}); give a writable file path "
                              "or unset the variable") from exc
        self.op_log_path = path

    def write(self, rec: dict[str, Any]) -> None:
        try:
            epoch = self._inner.world().epoch
        except Exception:  # noqa: BLE001 - removed from the group, etc.
            epoch = None
        line = json.dumps({"t": time.time(), **self._static, "epoch": epoch, **rec}) + "\n"
        try:
            os.write(self._fd, line.encode())
        except OSError as exc:
            log.warning("%s: could not write the op log: %s", ENV, exc)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            kind = type(out)  # class-level check: a handle's ``contributors`` may block until done
            if callable(getattr(kind, "wait", None)) and callable(getattr(kind, "is_completed", None)):
                with self._n_lock:
                    n, self._n = self._n, self._n + 1
                return _LoggedHandle(out, self, name, n)
            return out

        return call

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            try:
                os.close(self._fd)
            except OSError:
                pass


def wrap_from_environment(engine: Any) -> Any:
    """``engine`` wrapped in an :class:`OpLogEngine` when ``$RESILIENT_OP_LOG`` is set, else
    ``engine`` itself."""
    path = os.environ.get(ENV, "")
    return OpLogEngine(engine, path) if path else engine
