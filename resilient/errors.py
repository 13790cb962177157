"""The exception hierarchy of resilient.

Every error the library raises on purpose derives from :class:`ResilientError`, so callers
can catch one base class; the subclasses say *which* part failed and messages name the
cause and the fix.

    ResilientError
    ├── ConfigError                 bad argument / flag / file (nothing was started)
    │   └── ScenarioError           malformed chaos scenario (names line and field)
    ├── StoreError                  the etcd control plane
    │   ├── StoreUnavailable        no endpoint answered within the retry budget
    │   ├── LeaseExpired            our lease is gone: we are no longer a member
    │   └── RecordError             a record read from etcd is malformed (skipped, counted)
    ├── CollectiveError             a collective could not deliver its contract
    │   ├── CollectiveAborted       `strict` policy: full contributor set impossible
    │   ├── InputMismatch           ranks called with different shape/dtype/op/collective
    │   ├── DataLost                a piece of a broadcast/allgather exists nowhere
    │   ├── GroupChanged            per-member buffers sized for a group that changed; call again
    │   └── RemovedFromGroup        this member was removed from the epoch (e.g. after SIGSTOP)
    │       └── Evicted             removed as a straggler (--straggler-policy evict); may rejoin
    └── TransportError              a peer connection failed
        ├── TransportAborted        aborted because the epoch changed (expected, recoverable)
        └── FrameError              a corrupt or unexpected frame arrived
"""
from __future__ import annotations


class ResilientError(Exception):
    """Base class of every error raised on purpose by resilient."""


class ConfigError(ResilientError, ValueError):
    """Invalid configuration, flag or input file; raised before anything starts."""


class ScenarioError(ConfigError):
    """A chaos scenario file is malformed; the message names the line and the field."""


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


class CollectiveError(ResilientError):
    """A collective could not deliver its contract."""


class CollectiveAborted(CollectiveError):
    """Raised under the ``strict`` policy when the full contributor set cannot be delivered."""


class InputMismatch(CollectiveError, ValueError):
    """Ranks called the same op sequence number with different shapes, dtypes, ops or kinds."""


class DataLost(CollectiveError):
    """A chunk of a broadcast/allgather exists on no survivor; names the lost member."""


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


class TransportError(ResilientError, ConnectionError):
    """A peer connection failed."""


class TransportAborted(TransportError):
    """A blocked send/recv was aborted because a new epoch removed a peer."""


class FrameError(TransportError):
    """A frame failed validation (bad magic, header, length or checksum)."""
