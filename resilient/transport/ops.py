"""The op-level guarantees of the transport contract, implemented once for every transport.

One responsibility: the per-epoch bookkeeping of *ops* (as opposed to bytes) that every
transport keeps the same way — descriptor digests compared on arrival, ops cancelled
locally (:meth:`Transport.cancel_op`), ERROR messages posted and received
(:meth:`Transport.post_error`) — and the two errors they raise. A concrete transport
owns one :class:`OpGuard`, resets it in ``configure``, asks it before posting or
delivering, and fails an op's requests with the error it records; the wire format is the
transport's own (TCP carries digest and ERROR in its frame header, NCCL has no header
and checks locally). Wrappers (shaping, retrying) delegate to the transport they wrap.

Failure behaviour: nothing here raises; the methods return the exception the transport
must fail an op's requests with. Peer ERROR messages are capped
(:data:`ERROR_MESSAGE_CAP` bytes each, :data:`ERRORS_PER_EPOCH` ops per epoch), so a
peer cannot grow this state without bound.
"""
from __future__ import annotations

from resilient.errors import OpMismatch, PeerReportedError, TransportAborted, TransportError

__all__ = ["ERROR_MESSAGE_CAP", "ERRORS_PER_EPOCH", "OpGuard", "OpMismatch", "PeerReportedError"]

#: bytes of an ERROR message kept per op, and ops with a kept error per epoch
ERROR_MESSAGE_CAP, ERRORS_PER_EPOCH = 4096, 4096


class OpGuard:
    """Op errors, cancelled ops and posted ERROR messages of the current epoch."""

    def __init__(self) -> None:
        self._errors: dict[int, BaseException] = {}
        self._cancelled: set[int] = set()
        self._posted: dict[int, bytes] = {}

    def reset(self) -> None:
        """A new epoch: every op of the old one is over."""
        self._errors.clear()
        self._cancelled.clear()
        self._posted.clear()

    # -- failed ops -----------------------------------------------------------------------

    def error_of(self, op_seq: int) -> BaseException | None:
        """The error every request of ``op_seq`` fails with, if the op failed."""
        return self._errors.get(op_seq)

    def check_digest(self, peer: str, op_seq: int, theirs: int, ours: int) -> OpMismatch | None:
        """Compare a message's descriptor digest with the posted receive's; on a mismatch
        the op fails (the first error of an op is kept) and the mismatch is returned."""
        if theirs == ours:
            return None
        exc = OpMismatch(peer, op_seq, theirs, ours)
        self._errors.setdefault(op_seq, exc)
        return exc

    def peer_reported(self, peer: str, op_seq: int, message: bytes | memoryview) -> None:
        """A peer's ERROR message about ``op_seq`` (capped; the first one of an op wins)."""
        if op_seq in self._errors or len(self._errors) < ERRORS_PER_EPOCH:
            self._errors.setdefault(op_seq, PeerReportedError(peer, op_seq, bytes(message[:ERROR_MESSAGE_CAP])))

    # -- cancelled ops ----------------------------------------------------------------------

    def cancel(self, op_seq: int) -> BaseException:
        """Mark ``op_seq`` cancelled (its later messages are discarded on arrival); returns
        the error its pending requests fail with."""
        self._cancelled.add(op_seq)
        return self._errors.get(op_seq) or TransportAborted(f"op #{op_seq} was cancelled")

    def cancelled(self, op_seq: int) -> bool:
        """Whether messages of ``op_seq`` are to be discarded."""
        return op_seq in self._cancelled

    # -- posted ERROR messages --------------------------------------------------------------

    def post(self, op_seq: int, frame: bytes) -> None:
        """Remember an ERROR ``frame`` this member sent, for links opened later."""
        self._posted[op_seq] = frame

    def posted(self) -> list[bytes]:
        """Every ERROR frame posted in this epoch, in posting order."""
        return list(self._posted.values())
