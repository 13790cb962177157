"""Ledger summaries for a recovery: every survivor gets every other survivor's, fast.

A recovery cannot plan (:mod:`.resume`) before each survivor has every other survivor's
ledger summary. They travel two ways at once, and the first complete set wins:

* **over the transport** — control frames (:func:`~resilient.transport.base.control_seq`
  of the epoch number, matched apart from any op's data), a length frame then the
  payload: from every survivor straight to every other up to :data:`DIRECT_MAX`
  survivors (one hop), around the survivors' ring beyond (``n - 1`` hops over the ring's
  links only). On loopback it takes a few milliseconds once every survivor has entered
  the recovery;
* **through etcd** (``epochs/<n>/data/ledger/<member>``, as docs/design.md §3 describes):
  each summary is put there and a watch collects the others'. Under CPU load the watch
  delivered the last summary 2–45 ms after it was written in ``bench/recovery.py``, which
  is why the transport path exists; etcd is the path that works when the transport's
  does not, e.g. when two survivors disagree on the ring (one already in the next op
  over a grown group). Up to ``etcd_max`` survivors (:data:`ETCD_MAX`, 64;
  ``RESILIENT_LEDGER_ETCD_MAX``) it runs from the start, beside the transport's, and
  the keys stay for observers (tests, ``bench/recovery.py``). Beyond that it is a
  fallback: a survivor starts it only when its transport path has not completed within
  ``max(etcd_after, 1 ms x survivors)`` seconds (:data:`ETCD_AFTER_S`, 10;
  ``RESILIENT_LEDGER_ETCD_AFTER``), so a recovery among N survivors costs no etcd write
  when the transport path works, instead of N puts and N waits on N keys. Around the
  ring a survivor whose view of the ring differs can stall the chain for some and not
  others, so one whose exchange completed over the transport looks once, a second
  after any fallback would have begun, for a summary of its epoch in etcd (one
  key-only read) and puts its own when it finds one.

Failure behaviour: a survivor that dies during the exchange -> a newer epoch -> the
transport is aborted -> :class:`~resilient.errors.TransportAborted` propagates and the
caller starts over in the newer epoch; an epoch newer than ``epoch`` (even one that only
adds members) -> :class:`~resilient.coordinator.epoch.EpochChanged`, the caller starts
over; nothing complete within ``timeout`` -> :class:`TimeoutError` naming the members
missing; a length frame over :data:`MAX_STATUS_BYTES` or a summary naming another member ->
:class:`~resilient.errors.FrameError` (a corrupt peer; nothing is decoded from it).
Whatever path wins, the other's leftovers are cancelled, so no control frame of this
exchange can meet a later one.
"""
from __future__ import annotations

import json
import logging
import random
import struct
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from resilient.collectives import tags
from resilient.collectives.algorithms.base import OpTransport, tag
from resilient.collectives.group import BlobView
from resilient.collectives.tags import control_seq
from resilient.errors import EpochChanged, FrameError, ResilientTimeout
from resilient.settings import Settings

log = logging.getLogger(__name__)

SPACE = tags.STATUS_EXCHANGE
MAX_STATUS_BYTES = 64 << 20
#: up to this many survivors every one sends its summary straight to every other (one
#: hop, n - 1 connections each); beyond it the summaries go around the ring (n - 1 hops
#: over the ring's links only)
DIRECT_MAX = 16
#: up to this many survivors the etcd path runs from the start (keys for observers);
#: beyond it only as a fallback (RESILIENT_LEDGER_ETCD_MAX)
ETCD_MAX: int = Settings.ledger_etcd_max
#: seconds (at least 1 ms per survivor) the transport path gets before the etcd fallback
#: starts beyond ETCD_MAX survivors (RESILIENT_LEDGER_ETCD_AFTER)
ETCD_AFTER_S: float = Settings.ledger_etcd_after
#: the rate at which the survivors of a large recovery that completed over the transport
#: look for a fallback in etcd (their one read each is spread over survivors / this s)
ANSWER_READS_PER_S = 10_000.0


def etcd_puts(survivors: int, etcd_max: int = ETCD_MAX) -> int:
    """The ledger keys a recovery among ``survivors`` puts when the transport path works
    (a fallback adds one per survivor that falls back)."""
    return survivors if survivors <= etcd_max else 0
_LEN = struct.Struct("<Q")
_POLL_S = 0.005


class ControlTransport(OpTransport, Protocol):
    """The op transport as the exchange uses it: post, wait, and drop what is left."""

    def cancel_op(self, op_seq: int) -> None: ...


class StatusExchange:
    """One exchange of this member's ``payload`` in epoch ``epoch`` among ``ring``.

    ``view``: the group view (``put_blob``/``wait_blobs``/``current``); ``transport``: the
    op transport (retries broken links); ``me``: this member's id, in ``ring``."""

    def __init__(self, view: BlobView, transport: ControlTransport, epoch: int, ring: Sequence[str], me: str,
                 payload: bytes, etcd_max: int = ETCD_MAX, etcd_after: float = ETCD_AFTER_S) -> None:
        self.view, self.transport, self.epoch = view, transport, int(epoch)
        self.ring, self.me, self.payload = list(ring), me, bytes(payload)
        self._etcd: dict[str, bytes] | None = None
        self._etcd_error: BaseException | None = None
        self._etcd_done = threading.Event()
        self._published = threading.Event()
        self._timeout = 60.0
        #: whether the etcd path runs from the start (else: only as a fallback, after etcd_after)
        self.etcd_at_once = etcd_puts(len(self.ring), etcd_max) > 0
        self.etcd_after = max(float(etcd_after), 0.001 * len(self.ring))
        #: whether this member's etcd path was started (its summary put, the others waited for)
        self.etcd_started = False

    # -- etcd side ----------------------------------------------------------------------

    def _publish(self) -> None:
        try:
            self.view.put_blob(self.epoch, "ledger", self.payload)
        except Exception as exc:  # noqa: BLE001 - the transport path may still complete
            log.warning("could not publish the ledger summary of epoch %d to etcd: %s", self.epoch, exc)
            self._etcd_error = exc
            self._etcd_done.set()
            return
        finally:
            self._published.set()
        try:
            self._etcd = self.view.wait_blobs(self.epoch, "ledger", self.ring, self._timeout)
        except BaseException as exc:  # noqa: BLE001 - reported to the op thread
            self._etcd_error = exc
        self._etcd_done.set()

    def wait_published(self, timeout: float = 5.0) -> bool:
        """Whether this member's summary reached etcd (waits up to ``timeout``; False at
        once when the etcd path was not started: beyond ``etcd_max`` survivors whose
        transport path completed)."""
        return self.etcd_started and self._published.wait(timeout)

    def _answer_fallback(self, start: float) -> None:
        """This member's exchange completed over the transport beyond ``etcd_max``; a
        survivor whose view of the ring differed may still have stalled and fallen back
        to etcd, waiting for every summary there. A second after any fallback would have
        begun, spread over ``survivors / ANSWER_READS_PER_S`` seconds more (10 s at
        100,000: etcd sees ~10,000 of these reads a second, not all of them at once), look
        once for a summary of this epoch in etcd (one key-only read) and, if there is
        one, put ours too. Never raises (a
        failure is logged: the stalled survivor then times out, as it would without)."""
        delay = self.etcd_after + 1.0 + random.random() * len(self.ring) / ANSWER_READS_PER_S
        time.sleep(max(0.0, start + delay - time.monotonic()))
        try:
            if self.view.any_blob(self.epoch, "ledger"):
                self.view.put_blob(self.epoch, "ledger", self.payload)
                log.info("ledger-status exchange of epoch %d: another survivor fell back to etcd; our summary "
                         "is there too", self.epoch)
        except Exception as exc:  # noqa: BLE001 - best effort; see the docstring
            log.warning("ledger-status exchange of epoch %d: could not answer a fallback through etcd: %s",
                        self.epoch, exc)

    def _start_etcd(self) -> None:
        if not self.etcd_started:
            self.etcd_started = True
            threading.Thread(target=self._publish, name=f"ledger-status-{self.epoch}", daemon=True).start()

    # -- the exchange -------------------------------------------------------------------

    def run(self, timeout: float, newer_epoch: Callable[[], int | None]) -> dict[str, bytes]:
        """Every survivor's summary, keyed by member id (see the module docstring for
        what it raises). ``newer_epoch()`` returns the number of an epoch newer than
        ``epoch`` when there is one."""
        self._timeout = timeout
        start = time.monotonic()
        if self.etcd_at_once:
            self._start_etcd()
        deadline = start + timeout
        n = len(self.ring)
        got: dict[str, bytes] = {self.me: self.payload}
        if n == 1:
            return got
        tr, seq = self.transport, control_seq(self.epoch)
        p = self.ring.index(self.me)
        sends: list[Any] = []
        finished = False

        def wait(reqs: list[Any]) -> bool:
            """True when ``reqs`` completed; False when the etcd path completed first."""
            while not tr.wait(reqs, timeout=_POLL_S):
                if self._etcd is not None:
                    return False
                if not self.etcd_started and time.monotonic() - start >= self.etcd_after:
                    log.info("ledger-status exchange of epoch %d: the transport path has not completed in %.1fs; "
                             "falling back to etcd as well", self.epoch, self.etcd_after)
                    self._start_etcd()
                newer = newer_epoch()
                if newer is not None:
                    raise EpochChanged(f"epoch {newer} superseded epoch {self.epoch} during the ledger-status "
                                       "exchange", newer, {})
                if self._etcd_done.is_set() and isinstance(self._etcd_error, EpochChanged):
                    raise self._etcd_error
                if time.monotonic() > deadline:
                    missing = sorted(set(self.ring) - set(got))
                    raise ResilientTimeout(f"no ledger summary from {missing} within {timeout}s")
            return True

        def receive(pairs: list[tuple[str, str, int]]) -> bool:
            """``(from peer, whose summary, hop)`` for each expected summary: the length
            frames, then the payloads (already on their way behind them)."""
            heads = [(peer, want, t, bytearray(_LEN.size)) for peer, want, t in pairs]
            if not wait([tr.irecv(peer, h, seq, tag(t, 0, SPACE)) for peer, _, t, h in heads]):
                return False
            bodies = []
            for peer, want, t, h in heads:
                (size,) = _LEN.unpack(h)
                if size > MAX_STATUS_BYTES:
                    raise FrameError(f"member {peer} announced a {size}-byte ledger summary (limit "
                                     f"{MAX_STATUS_BYTES}): corrupt frame")
                bodies.append((peer, want, bytearray(size), t))
            if not wait([tr.irecv(peer, b, seq, tag(t, 1, SPACE)) for peer, _, b, t in bodies]):
                return False
            for peer, want, b, _ in bodies:
                _check_member(bytes(b), want, peer)
                got[want] = bytes(b)
            return True

        def send(peer: str, data: bytes, t: int) -> None:
            sends.append(tr.isend(peer, _LEN.pack(len(data)), seq, tag(t, 0, SPACE)))
            sends.append(tr.isend(peer, data, seq, tag(t, 1, SPACE)))

        try:
            if n <= DIRECT_MAX:
                # every survivor sends its summary to every other: one hop
                others = [m for m in self.ring if m != self.me]
                for peer in others:
                    send(peer, self.payload, 0)
                if not receive([(peer, peer, 0) for peer in others]):
                    return self._etcd  # type: ignore[return-value]
            else:
                # around the ring: n - 1 hops over the ring's links only
                nxt, prv = self.ring[(p + 1) % n], self.ring[(p - 1) % n]
                for t in range(n - 1):
                    send(nxt, got[self.ring[(p - t) % n]], t)
                    if not receive([(prv, self.ring[(p - t - 1) % n], t)]):
                        return self._etcd  # type: ignore[return-value]
            if not wait(sends):
                return self._etcd  # type: ignore[return-value]
            finished = True
            if not self.etcd_started:   # others may still fall back to etcd: answer them there
                threading.Thread(target=self._answer_fallback, args=(start,), name=f"ledger-late-{self.epoch}",
                                 daemon=True).start()
            return got
        finally:
            if not finished:
                tr.cancel_op(seq)   # leftovers of this exchange never meet a later one


def _check_member(raw: bytes, want: str, via: str) -> None:
    try:
        member = json.loads(raw.decode("utf-8")).get("member")
    except (UnicodeDecodeError, ValueError, AttributeError):
        raise FrameError(f"member {via} forwarded a ledger summary that is not valid JSON") from None
    if member != want:
        raise FrameError(f"member {via} forwarded the ledger summary of {member!r} where {want!r}'s was due")
