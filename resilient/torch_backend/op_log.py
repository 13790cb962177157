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
from typing import TYPE_CHECKING, Any, Sequence

import torch

from resilient.errors import ConfigError
from resilient.live_world import World
from resilient.torch_backend.communicator_engine import CommunicatorEngine
from resilient.torch_backend.engine import ElasticEngine, Handle

if TYPE_CHECKING:  # pragma: no cover
    from resilient.coordinator.epoch import EpochWatcher
    from resilient.coordinator.membership import MemberSession
    from resilient.coordinator.store import Store
    from resilient.torch_backend.communicator_engine import Comm
    from resilient.transport.base import Transport

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


class OpLogEngine:
    """An :class:`~.engine.ElasticEngine` that runs every call on ``inner`` and logs each op
    (each call that returns a handle) when it finishes; the joiner admission is ``inner``'s.
    ``member_id``: the member named in the lines (default: ``inner``'s world's)."""

    def __init__(self, inner: ElasticEngine, path: str, member_id: str | None = None) -> None:
        self._inner = inner
        self._n = 0
        self._n_lock = threading.Lock()
        member = member_id if member_id is not None else _member_of(inner)
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

    def _logged(self, kind: str, handle: Handle) -> Handle:
        with self._n_lock:
            n, self._n = self._n, self._n + 1
        return _LoggedHandle(handle, self, kind, n)

    # -- Engine ---------------------------------------------------------------------------

    def world(self) -> World:
        return self._inner.world()

    def allreduce(self, tensor: torch.Tensor, op: str) -> Handle:
        return self._logged("allreduce", self._inner.allreduce(tensor, op))

    def broadcast(self, tensor: torch.Tensor, root: int) -> Handle:
        return self._logged("broadcast", self._inner.broadcast(tensor, root))

    def allgather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Handle:
        return self._logged("allgather", self._inner.allgather(outputs, tensor))

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str) -> Handle:
        return self._logged("reduce_scatter", self._inner.reduce_scatter(output, inputs, op))

    def barrier(self) -> Handle:
        return self._logged("barrier", self._inner.barrier())

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        return self._logged("send", self._inner.send(tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle:
        return self._logged("recv", self._inner.recv(tensor, src, tag))

    def recv_any(self, tensor: torch.Tensor, tag: int) -> Handle:
        return self._logged("recv", self._inner.recv_any(tensor, tag))

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            try:
                os.close(self._fd)
            except OSError:
                pass

    # -- ElasticEngine: the inner engine's ------------------------------------------------

    @property
    def member_id(self) -> str:
        return self._inner.member_id

    @property
    def comm(self) -> Comm | None:
        return self._inner.comm

    @property
    def admitted(self) -> bool:
        return self._inner.admitted

    @property
    def admits_by_rebuild(self) -> bool:
        return self._inner.admits_by_rebuild

    def announce_ready(self) -> None:
        self._inner.announce_ready()

    def mark_done(self) -> None:
        self._inner.mark_done()

    def job_done(self) -> bool:
        return self._inner.job_done()

    def pending_joiners(self) -> bool:
        return self._inner.pending_joiners()

    def rebuild(self, min_epoch: int, timeout: float = 60.0) -> None:
        self._inner.rebuild(min_epoch, timeout)

    def wait_admitted(self, timeout: float = 120.0) -> None:
        self._inner.wait_admitted(timeout)


class OpLogCommunicatorEngine(OpLogEngine):
    """:class:`OpLogEngine` over the real engine: also what the world's ``dist.new_group``
    engines share (``job``, ``store``, ``session``, ``watcher``, ``transport``)."""

    def __init__(self, inner: CommunicatorEngine, path: str) -> None:
        super().__init__(inner, path, member_id=inner.member_id)
        self.engine = inner

    @property
    def job(self) -> str:
        return self.engine.job

    @property
    def store(self) -> Store:
        return self.engine.store

    @property
    def session(self) -> MemberSession:
        return self.engine.session

    @property
    def watcher(self) -> EpochWatcher:
        return self.engine.watcher

    @property
    def transport(self) -> Transport:
        return self.engine.transport


def _member_of(engine: ElasticEngine) -> str:
    """The member id the op log names for ``engine`` ("" when it is not in a world yet)."""
    try:
        return engine.world().member_id
    except Exception:  # noqa: BLE001 - a joiner not admitted yet, a unit-test engine: no name
        return ""


def wrap_from_environment(engine: ElasticEngine) -> ElasticEngine:
    """``engine`` wrapped in an :class:`OpLogEngine` (an :class:`OpLogCommunicatorEngine`
    over the real engine) when ``$RESILIENT_OP_LOG`` is set, else ``engine`` itself."""
    path = os.environ.get(ENV, "")
    if not path:
        return engine
    if isinstance(engine, CommunicatorEngine):
        return OpLogCommunicatorEngine(engine, path)
    return OpLogEngine(engine, path)
