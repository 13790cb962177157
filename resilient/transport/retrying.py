"""Retrying a transfer whose link failed while the peer is still a member (a transport wrapper).

A :class:`~resilient.errors.TransportError` that is not an abort (a reset connection, a
refused reconnect, a shaped ``drop=`` link) says nothing about whether the peer is alive:
the coordinator decides that from lease state. :class:`RetryingTransport` wraps the
communicator's transport for its ops: a request that fails that way is reported once as
*suspect* and re-posted, unchanged (same op seq, tag, buffer), with exponential backoff
until the link works again. Requests are matched by ``(peer, op seq, tag)`` in post order,
so every later request to a broken peer is held back too and all of them are re-posted in
their original order; a retried receive rewrites its whole buffer, so the op's ledger
(reductions happen after a receive completes) stays exact and nothing is resent twice.

Failure behaviour:

* the peer really died: its lease goes, the coordinator publishes an epoch without it, the
  epoch callback aborts the transport and the wait raises
  :class:`~resilient.errors.TransportAborted` (the normal recovery path) — retries stop;
* a peer whose lease is already gone but whose epoch has not come yet (a standby
  coordinator taking over) is waited for up to ``dead_wait_s`` more, never reported as
  unreachable;
* the link stays down for ``give_up_s`` (the communicator's ``op_timeout``) with the peer
  still a member: :class:`PeerUnreachable` (a :class:`~resilient.errors.CollectiveError`)
  naming the peer and the last error; never a silent hang;
* aborts, input mismatches (``OpMismatch``/``PeerReportedError``) and corrupt frames are
  not retried: they propagate at once, as before.

The wrapper is a :class:`~resilient.transport.wrapper.WrappedTransport` (every method of
the interface written out, no attribute delegation) that overrides posting, waiting,
``configure`` and ``cancel_op``.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Mapping, Sequence

from resilient.errors import FrameError, PeerUnreachable, TransportAborted, TransportError
from resilient.transport.base import Buffer, Request, Transport, buffer_nbytes
from resilient.transport.ops import OpMismatch, PeerReportedError

__all__ = ["PeerUnreachable", "RetryingTransport", "retryable"]
from resilient.transport.wrapper import WrappedTransport

#: first and largest pause between two re-posts to a broken peer
BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 1.0
_POLL_S = 0.05


def retryable(exc: BaseException | None) -> bool:
    """A link failure worth retrying: not an abort, a mismatch or a corrupt frame."""
    return (isinstance(exc, TransportError)
            and not isinstance(exc, (TransportAborted, OpMismatch, PeerReportedError, FrameError)))


class _Retry(Request):
    """A request that survives link failures: the current inner request, or none while held back."""

    _order = itertools.count()

    def __init__(self, send: bool, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int, nbytes: int) -> None:
        self.is_send, self.peer, self.buf, self.op_seq, self.tag, self.digest = send, peer, buf, op_seq, tag, digest
        self.nbytes = nbytes
        #: posted with :meth:`~resilient.transport.base.Transport.irecv_speculative`
        self.speculative = False
        self.order = next(self._order)
        self.inner: Request | None = None
        self.was_touched = False
        self.failure: BaseException | None = None   # set only when retrying gave up

    def done(self) -> bool:
        return self.inner is not None and self.inner.done()

    @property
    def error(self) -> BaseException | None:
        if self.failure is not None:
            return self.failure
        err = self.inner.error if self.inner is not None else None
        return err if err is not None and not retryable(err) else None

    def touched(self) -> bool:
        return self.was_touched or (self.inner is not None and self.inner.touched())

    def done_at(self) -> float | None:
        return self.inner.done_at() if self.inner is not None else None

    def misfit(self) -> bool:
        return self.inner is not None and self.inner.misfit()


class _Broken:
    def __init__(self, now: float, exc: BaseException) -> None:
        self.since, self.delay, self.error = now, BACKOFF_START_S, exc
        self.next_try = now + self.delay
        self.held: list[_Retry] = []


class RetryingTransport(WrappedTransport):
    """Wraps ``inner``; only ``isend``/``irecv``/``wait``/``configure``/``cancel_op`` differ."""

    def __init__(self, inner: Transport, *, give_up_s: float | None,
                 on_suspect: Callable[[str, str], None], is_member: Callable[[str], bool],
                 is_alive: Callable[[str], bool] = lambda peer: True, dead_wait_s: float = 60.0) -> None:
        super().__init__(inner)
        self.give_up_s, self.on_suspect, self.is_member = give_up_s, on_suspect, is_member
        #: whether the peer still holds its lease; a dead peer's link is not "unreachable":
        #: the coordinator's epoch without it is on its way (a standby may be taking over),
        #: so we keep waiting for it — the abort then starts the normal recovery
        self.is_alive, self.dead_wait_s = is_alive, dead_wait_s
        self._broken: dict[str, _Broken] = {}
        #: transfers re-posted after a link failure (for tests and logs)
        self.retries = 0

    # -- posting --------------------------------------------------------------------------

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        return self._post(_Retry(True, peer, buf, op_seq, tag, digest, buffer_nbytes(buf)))

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        return self._post(_Retry(False, peer, buf, op_seq, tag, digest, buffer_nbytes(buf)))

    def irecv_speculative(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        r = _Retry(False, peer, buf, op_seq, tag, digest, buffer_nbytes(buf))
        r.speculative = True
        return self._post(r)

    def cancel_recv(self, req: Request) -> bool:
        if not isinstance(req, _Retry) or req.is_send or req.done() or req.failure is not None:
            return False
        b = self._broken.get(req.peer)
        if b is not None and req in b.held:   # held back, never on the wire: just forget it
            b.held.remove(req)
            req.failure = TransportAborted(f"receive of op #{req.op_seq} from {req.peer} was cancelled")
            return True
        if req.inner is None or not self.inner.cancel_recv(req.inner):
            return False
        req.failure = TransportAborted(f"receive of op #{req.op_seq} from {req.peer} was cancelled")
        return True

    def _post(self, r: _Retry) -> _Retry:
        b = self._broken.get(r.peer)
        if b is not None:
            b.held.append(r)       # keep the per-peer order: re-posted with the others
            return r
        err = self._post_inner(r)
        if err is not None and retryable(err) and self.is_member(r.peer):
            self._break(r, err)
        return r

    def _post_inner(self, r: _Retry) -> BaseException | None:
        """Post ``r`` on the wrapped transport; the error it failed with at once, if any."""
        post = self.inner.isend if r.is_send else (self.inner.irecv_speculative if r.speculative else self.inner.irecv)
        inner = r.inner = post(r.peer, r.buf, r.op_seq, r.tag, r.digest)
        return inner.error

    def _break(self, r: _Retry, exc: BaseException) -> None:
        if r.inner is not None and r.inner.touched():
            r.was_touched = True
        r.inner = None
        b = self._broken.get(r.peer)
        if b is None:
            b = self._broken[r.peer] = _Broken(time.monotonic(), exc)
            self.on_suspect(r.peer, f"op #{r.op_seq}: link to {r.peer} failed ({exc}); retrying")
        b.error = exc
        b.held.append(r)
        b.held.sort(key=lambda x: x.order)

    def _repost_due(self) -> None:
        now = time.monotonic()
        for peer, b in list(self._broken.items()):
            if now < b.next_try:
                continue
            if not self.is_member(peer):  # left the epoch: its requests end with the abort/cancel
                del self._broken[peer]
                continue
            if self.give_up_s is not None and now - b.since > self.give_up_s:
                if now - b.since <= self.give_up_s + self.dead_wait_s and not self.is_alive(peer):
                    b.next_try = now + BACKOFF_MAX_S  # its lease is gone: wait for the new epoch
                    continue
                exc = PeerUnreachable(peer, f"the link to member {peer} has been down for {now - b.since:.1f}s "
                                            f"(more than op_timeout={self.give_up_s}s) while it is still a member; "
                                            f"last error: {b.error}. Check the network between the two members")
                for r in b.held:
                    r.failure = exc
                del self._broken[peer]
                raise exc
            held, b.held = b.held, []
            for i, r in enumerate(held):
                self.retries += 1
                err = self._post_inner(r)
                if err is not None and retryable(err):      # still down: hold this one and the rest back
                    b.held = held[i:]
                    for x in b.held:
                        x.inner = None
                    b.error = err
                    break
            if b.held:
                b.delay = min(BACKOFF_MAX_S, b.delay * 2)
                b.next_try = now + b.delay
            else:
                del self._broken[peer]

    # -- waiting --------------------------------------------------------------------------

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool:
        """Like :meth:`Transport.wait`; link failures are retried (see the module doc).
        Raises :class:`PeerUnreachable` when a link stays down past ``give_up_s``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        reqs = [r for r in requests if isinstance(r, _Retry)]
        while True:
            if self.inner.aborted:
                raise TransportAborted("transport aborted")
            if self.inner.closed:   # nothing to retry on: fail like the transport itself
                raise TransportError("transport is closed")
            self._repost_due()
            for r in reqs:
                if r.failure is not None:
                    raise r.failure
            live = [r.inner for r in reqs if r.inner is not None and not r.inner.done()]
            held = any(r.inner is None for r in reqs)
            if not live and not held:
                return True
            now = time.monotonic()
            step = None if deadline is None else max(0.0, deadline - now)
            if self._broken:  # wake up for the next re-post
                nxt = max(0.001, min(b.next_try for b in self._broken.values()) - now)
                step = nxt if step is None else min(step, nxt)
            try:
                if live:
                    self.inner.wait(live, timeout=step)
                else:  # only held-back requests: let the transport idle (it returns at once on abort)
                    self.inner.idle(min(_POLL_S, step if step is not None else _POLL_S))
            except TransportError as exc:
                if not retryable(exc):
                    raise
                failed = [(r, r.inner.error) for r in reqs if r.inner is not None and r.inner.error is not None]
                if not failed:
                    raise
                for r, err in failed:
                    if err is None:
                        continue
                    if not retryable(err) or not self.is_member(r.peer):
                        raise err
                    self._break(r, err)
            if deadline is not None and time.monotonic() >= deadline:
                return all(r.done() for r in reqs)

    # -- epochs and ops -------------------------------------------------------------------

    def configure(self, epoch: int, token: str, addresses: Mapping[str, str]) -> None:
        self._broken.clear()   # held requests belong to ops the new epoch aborted
        self.inner.configure(epoch, token, addresses)

    def cancel_op(self, op_seq: int) -> None:
        for peer, b in list(self._broken.items()):
            b.held = [r for r in b.held if r.op_seq != op_seq]
            if not b.held:
                del self._broken[peer]
        self.inner.cancel_op(op_seq)

