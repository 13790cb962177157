"""The base of transport wrappers: every method of the interface passed on, written out.

One responsibility: :class:`WrappedTransport` is a :class:`~resilient.transport.base.Transport`
over another one (``inner``) whose every method and property calls ``inner``'s — no
attribute delegation, so a wrapper's interface is exactly the transport interface and a
type checker sees it. A wrapper (:mod:`~resilient.transport.shaping`,
:mod:`~resilient.transport.retrying`) overrides only what it changes.

Failure behaviour: whatever ``inner`` raises, unchanged.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from resilient.transport.base import Buffer, JoinCarrier, Request, Transport, TransportStats


class WrappedTransport(Transport):
    """``inner`` with nothing changed (subclasses override what they change)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.member_id = inner.member_id

    @property
    def address(self) -> str:
        return self.inner.address

    @property
    def stats(self) -> TransportStats:
        return self.inner.stats

    @property
    def aborted(self) -> bool:
        return self.inner.aborted

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def configure(self, epoch: int, token: str, addresses: Mapping[str, str]) -> None:
        self.inner.configure(epoch, token, addresses)

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        return self.inner.isend(peer, buf, op_seq, tag, digest)

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        return self.inner.irecv(peer, buf, op_seq, tag, digest)

    def irecv_speculative(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        return self.inner.irecv_speculative(peer, buf, op_seq, tag, digest)

    def cancel_recv(self, req: Request) -> bool:
        return self.inner.cancel_recv(req)

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool:
        return self.inner.wait(requests, timeout)

    def cancel_op(self, op_seq: int) -> None:
        self.inner.cancel_op(op_seq)

    def post_error(self, peers: Sequence[str], op_seq: int, message: bytes, timeout: float = 2.0) -> None:
        self.inner.post_error(peers, op_seq, message, timeout)

    def probe(self, peers: Sequence[str]) -> None:
        self.inner.probe(peers)

    def join_carrier(self) -> JoinCarrier | None:
        return self.inner.join_carrier()

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def close(self) -> None:
        self.inner.close()

    def idle(self, timeout: float) -> None:
        self.inner.idle(timeout)
