"""The op-level half of the transport interface, written once above the core.

One responsibility: :class:`OpLayer` implements :meth:`~resilient.transport.base.Transport.cancel_op`
and :meth:`~resilient.transport.base.Transport.post_error` for every concrete transport,
over its :class:`~resilient.transport.ops.OpGuard` (digests, failed and cancelled ops,
posted ERROR frames) and three small hooks in which the transport only *carries* things:
drop the requests of an op (:meth:`OpLayer._drop_op`), encode an ERROR frame for its wire
(:meth:`OpLayer._error_frame`) and deliver it (:meth:`OpLayer._deliver_error`). A
transport also asks :meth:`OpLayer._op_failure` when a request is posted and waited on,
and :meth:`~resilient.transport.ops.OpGuard.check_digest` when a message is matched.
Wrappers (:mod:`~resilient.transport.wrapper`) do not derive from it: they pass both
calls on to the transport they wrap.

Failure behaviour: :meth:`OpLayer.cancel_op` never raises (the op's requests fail with
the op's recorded error or :class:`~resilient.errors.TransportAborted`);
:meth:`OpLayer.post_error` is best effort and bounded by its ``timeout`` (delivery
failures are the transport's to log, never raised).
"""
from __future__ import annotations

import abc
from typing import Sequence

from resilient.transport.base import Transport
from resilient.transport.ops import OpGuard


class OpLayer(Transport):
    """``cancel_op``/``post_error`` over an :class:`OpGuard` (see the module docstring)."""

    #: the op bookkeeping of the current epoch (reset by the transport's ``configure``)
    _ops: OpGuard

    def cancel_op(self, op_seq: int) -> None:
        self._drop_op(op_seq, self._ops.cancel(op_seq))

    def post_error(self, peers: Sequence[str], op_seq: int, message: bytes, timeout: float = 2.0) -> None:
        frame = self._error_frame(op_seq, message)
        self._ops.post(op_seq, frame)  # a transport with links may also send it on links opened later
        self._deliver_error([p for p in peers if p != self.member_id], op_seq, frame, timeout)

    def _op_failure(self, op_seq: int) -> BaseException | None:
        """The error a request of ``op_seq`` fails with at once (the op failed), if any."""
        return self._ops.error_of(op_seq)

    @abc.abstractmethod
    def _drop_op(self, op_seq: int, exc: BaseException) -> None:
        """Fail every request of ``op_seq`` with ``exc`` and discard its messages still
        arriving (``self._ops.cancelled(op_seq)`` is already true)."""

    @abc.abstractmethod
    def _error_frame(self, op_seq: int, message: bytes) -> bytes:
        """``message`` about ``op_seq`` as this transport carries it."""

    @abc.abstractmethod
    def _deliver_error(self, peers: Sequence[str], op_seq: int, frame: bytes, timeout: float) -> None:
        """Send ``frame`` to ``peers`` (best effort, at most ``timeout`` seconds)."""
