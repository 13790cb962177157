"""The exception hierarchy of resilient: every error that crosses a module boundary.

Every error the library raises on purpose derives from :class:`ResilientError`, so callers
can catch one base class; the subclasses say *which* part failed and messages name the
cause and the fix. The two *cancellation signals* are the exception: they derive from
:class:`Cancelled`, a :class:`BaseException` (like ``trio.Cancelled`` and
``asyncio.CancelledError``), so an ``except Exception`` written for real failures cannot
swallow them; catch them by name where the recovery path handles them.

    ResilientError                  (an Exception)
    ├── ConfigError                 bad argument / flag / file (nothing was started)
    │   ├── ScenarioError           malformed chaos scenario (names line and field)
    │   ├── MetricLabelError        a metric label outside its bounded set
    │   └── ClosedError             the communicator is closed
    ├── ResilientTimeout            a bounded wait ran out (also a built-in TimeoutError)
    │   └── RendezvousTimeout       not enough nodes joined within the launcher's join timeout
    ├── StoreError                  the etcd control plane
    │   ├── StoreUnavailable        no endpoint answered within the retry budget
    │   ├── LeaseExpired            our lease is gone: we are no longer a member
    │   └── RecordError             a record read from etcd is malformed (skipped, counted)
    ├── CollectiveError             a collective could not deliver its contract
    │   ├── CollectiveAborted       `strict` policy: full contributor set impossible
    │   ├── InputMismatch           ranks called with different shape/dtype/op/collective
    │   ├── DataLost                a piece of a broadcast/allgather exists nowhere
    │   ├── GroupChanged            per-member buffers sized for a group that changed; call again
    │   ├── PeerUnreachable         a link to a live member stayed down past the op timeout
    │   ├── PeerLost                the peer of a send/recv was removed from the job (it died)
    │   └── RemovedFromGroup        this member was removed from the epoch (e.g. after SIGSTOP)
    │       └── Evicted             removed as a straggler (--straggler-policy evict); may rejoin
    ├── UnsupportedOperation        a torch.distributed op the resilient backend lacks (also a NotImplementedError)
    ├── TrainingFinished            a joiner arrived after the job called State.finish()
    └── TransportError              a peer connection failed (also a built-in ConnectionError)
        ├── FrameError              a corrupt or unexpected frame arrived
        ├── OpMismatch              a peer's message carried another op descriptor digest
        └── PeerReportedError       a peer sent an ERROR frame about the op

    Cancelled                       (a BaseException: `except Exception` does not catch it)
    ├── EpochChanged                a newer epoch superseded the one being waited on
    └── TransportAborted            a blocked send/recv was aborted: an epoch removed a peer

See docs/errors.md for which handler catches what, with a runnable example.
"""
from __future__ import annotations


class ResilientError(Exception):
    """Base class of every error raised on purpose by resilient (cancellation signals,
    :class:`Cancelled`, excepted)."""


class Cancelled(BaseException):
    """Base of resilient's cancellation signals: the work in progress was cancelled because
    the group moved on (a newer epoch), not because something failed. Not an
    :class:`Exception`, so a broad ``except Exception`` (metrics, best-effort cleanup, a
    retry loop) lets it through to the recovery path that catches it by name."""


class ConfigError(ResilientError, ValueError):
    """Invalid configuration, flag or input file; raised before anything starts."""


class ScenarioError(ConfigError):
    """A chaos scenario file is malformed; the message names the line and the field."""


class MetricLabelError(ConfigError):
    """A label value outside its bounded set (names the metric and the allowed values)."""


class ClosedError(ConfigError):
    """The object (a :class:`~resilient.Communicator`) is closed: build a new one. A
    :class:`ConfigError` because that is what a closed communicator raised before."""


class ResilientTimeout(ResilientError, TimeoutError):
    """A bounded wait ran out; the message names what was awaited and the bound. Also a
    built-in :class:`TimeoutError`, so ``except TimeoutError`` keeps catching it."""


class RendezvousTimeout(ResilientTimeout):
    """Not enough nodes joined (or no slot freed up) within the launcher's join timeout."""


class StoreError(ResilientError):
    """The etcd control plane failed."""


class StoreUnavailable(StoreError):
    """No etcd endpoint answered within the bounded retry budget."""


class LeaseExpired(StoreError):
    """Our lease expired or was revoked: this process is no longer a live member."""


class RecordError(StoreError):
    """A record read from etcd is malformed: not UTF-8 JSON, too large or too deeply
    nested, a field of the wrong type, out of range (numbers must fit in 63 bits) or not a
    valid id. ``kind`` names the record kind (``member``, ``epoch``, ``health``, ...) and
    ``key`` the etcd key when known. Readers skip such a record (logged and counted in
    ``resilient_bad_records_total``); see ``resilient.coordinator.records``."""

    def __init__(self, message: str, kind: str = "", key: str = "") -> None:
        super().__init__(message)
        self.kind, self.key = kind, key


class EpochChanged(Cancelled):
    """Raised while waiting on an epoch's rendezvous data
    (:meth:`~resilient.coordinator.EpochData.wait_all`) when a newer epoch is published:
    the members being waited for may never write. ``newest`` is the new epoch number,
    ``partial`` what had arrived. A cancellation signal (not a :class:`StoreError`): the
    caller starts again on the newer epoch."""

    def __init__(self, message: str, newest: int, partial: dict[str, bytes]) -> None:
        super().__init__(message)
        self.newest = newest
        self.partial = partial


class CollectiveError(ResilientError):
    """A collective could not deliver its contract."""


class CollectiveAborted(CollectiveError):
    """Raised under the ``strict`` policy when the full contributor set cannot be delivered."""


class InputMismatch(CollectiveError, ValueError):
    """Ranks called the same op sequence number with different shapes, dtypes, ops or kinds."""


class DataLost(CollectiveError):
    """A chunk of a broadcast/allgather exists on no survivor; names the lost member. Also
    a point-to-point message its sender finished in an older epoch that the receiver had
    not received when the group moved on (the transport drops an older epoch's frames)."""


class GroupChanged(CollectiveError):
    """An op with one buffer per member (``allgather``, list ``reduce_scatter``) was called
    with buffers for ``expected`` members, but the group changed to ``size`` members before
    the op started (the new epoch is adopted at the op boundary, after the caller read
    ``size``). Raised on *every* member for the same op (a member that sized its buffers
    right is told by the others' ERROR frames), so all can simply call it again with one
    buffer per current member; nothing was delivered."""

    def __init__(self, message: str, expected: int | None = None, size: int | None = None) -> None:
        super().__init__(message)
        self.expected, self.size = expected, size


class PeerUnreachable(CollectiveError):
    """A link to a live member (``peer``) stayed down longer than the op timeout: the op
    failed on this member and the members beyond the link were told."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer


class PeerLost(CollectiveError):
    """The peer of a point-to-point ``send``/``recv`` (``peer``, a member id) is not in
    epoch ``epoch``: it died or was removed, so the transfer can never complete. Nothing
    was handed out as a result (a receive's tensor may hold part of the message)."""

    def __init__(self, message: str, peer: str = "", epoch: int | None = None) -> None:
        super().__init__(message)
        self.peer, self.epoch = peer, epoch


class RemovedFromGroup(CollectiveError):
    """This member was removed from the current epoch (for example it was SIGSTOPped past
    its lease TTL); it must not contribute to or read results of later ops."""


class Evicted(RemovedFromGroup):
    """This member was evicted from the group as a confirmed straggler
    (``resilient coordinator --straggler-policy evict``): its lease is still alive and the
    coordinator re-admits it after a hold. ``epoch``: the epoch that evicted it;
    ``readmit_at``: wall time (``time.time()``) from which it may come back (None if
    unknown); ``hold_s``: the hold. Come back with ``comm = comm.rejoin(timeout)``."""

    def __init__(self, message: str, epoch: int | None = None, readmit_at: float | None = None,
                 hold_s: float | None = None) -> None:
        super().__init__(message)
        self.epoch, self.readmit_at, self.hold_s = epoch, readmit_at, hold_s


class UnsupportedOperation(ResilientError, NotImplementedError):
    """A ``torch.distributed`` op or argument the resilient backend does not implement
    (``op``: what was asked; the message says what to use instead)."""

    def __init__(self, op: str, hint: str = "") -> None:
        msg = f"the 'resilient' torch.distributed backend does not support {op}"
        super().__init__(msg + (f"; {hint}" if hint else ""))
        self.op = op


class TrainingFinished(ResilientError):
    """A joiner arrived after the other members called
    :meth:`resilient.elastic.State.finish`: there is no training left to take part in
    (exit normally)."""


class TransportError(ResilientError, ConnectionError):
    """A peer connection failed."""


class FrameError(TransportError):
    """A frame failed validation (bad magic, header, length or checksum)."""


class OpMismatch(TransportError):
    """A message for this op carried another op descriptor digest than ours."""

    def __init__(self, peer: str, op_seq: int, theirs: int, ours: int) -> None:
        super().__init__(f"member {peer} sent op #{op_seq} with descriptor digest {theirs:#010x}, ours is {ours:#010x}")
        self.peer, self.op_seq, self.theirs, self.ours = peer, op_seq, theirs, ours


class PeerReportedError(TransportError):
    """A peer sent an ERROR message about an op (e.g. it detected an input mismatch)."""

    def __init__(self, peer: str, op_seq: int, message: bytes) -> None:
        super().__init__(f"member {peer} reported an error for op #{op_seq}: {message[:500]!r}")
        self.peer, self.op_seq, self.message = peer, op_seq, message


class TransportAborted(Cancelled):
    """A blocked send/recv was aborted because a new epoch removed a peer (or the transport
    was aborted/closed). A cancellation signal (not a :class:`TransportError`): the op's
    recovery path catches it by name and resumes in the new epoch."""


__all__ = [
    "ResilientError", "Cancelled", "ConfigError", "ScenarioError", "MetricLabelError", "ClosedError",
    "ResilientTimeout", "RendezvousTimeout", "StoreError", "StoreUnavailable", "LeaseExpired", "RecordError",
    "EpochChanged", "CollectiveError", "CollectiveAborted", "InputMismatch", "DataLost", "GroupChanged",
    "PeerUnreachable", "PeerLost", "RemovedFromGroup", "Evicted", "UnsupportedOperation", "TrainingFinished", "TransportError", "FrameError",
    "OpMismatch", "PeerReportedError", "TransportAborted",
]
