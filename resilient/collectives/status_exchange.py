"""Ledger summaries for a recovery: to the members that plan with them, fast.

A recovery cannot plan (:mod:`.resume`) before the planning member holds every
survivor's ledger summary. Up to :data:`DIRECT_MAX` survivors every survivor plans (the
planner is pure: all get the same plan), so every one needs every summary; beyond it one
*planner* (the first survivor) does, and every other survivor needs only its own part of
the plan (:mod:`.recovery_decision`). The summaries travel two ways at once, and the
first complete result wins:

* **over the transport** — control frames (:func:`~resilient.transport.base.control_seq`
  of the epoch number, matched apart from any op's data), a length frame then the
  payload. Up to ``DIRECT_MAX`` survivors (16, ``RESILIENT_LEDGER_DIRECT_MAX``) from
  every survivor straight to every other (one hop). Beyond it up a tree to the planner:
  the survivors in ring order form a balanced ``fanout``-ary tree (16,
  ``RESILIENT_LEDGER_TREE_FANOUT``); each sends its subtree's summaries with its own to
  its parent; the planner calls ``decide`` on all of them, once, and each survivor's
  *decision* (:func:`~.recovery_decision.plan_decisions`) comes back down the same
  tree. A leaf (most survivors) receives no summary at all, only its decision; a
  survivor receives as many summaries as its subtree holds others (the planner N - 1, a
  second-level survivor ~N / fanout; ~N x depth in all, not N²: :func:`tree_received`). Every tree message begins with
  the digest of its sender's epoch, survivor list, ``direct_max`` and fanout: one that
  differs (a survivor
  already in the next op over a grown group) sends the receiver to the etcd path at
  once rather than read a tree that is not its own. On loopback a few milliseconds once
  every survivor has entered the recovery;
* **through etcd** (``epochs/<n>/data/ledger/<member>``, as docs/design.md §3 describes):
  each summary is put there and a watch collects the others' — every summary, so a
  survivor that completes this way plans itself (the same plan: the planner is pure).
  Under CPU load the watch delivered the last summary 2–45 ms after it was written in
  ``bench/recovery.py``, which is why the transport path exists; etcd is the path that
  works when the transport's does not, e.g. when two survivors disagree on the
  survivors. Up to ``etcd_max`` survivors (:data:`ETCD_MAX`, 64;
  ``RESILIENT_LEDGER_ETCD_MAX``) it runs from the start, beside the transport's, and
  the keys stay for observers (tests, ``bench/recovery.py``). Beyond that it is a
  fallback: a survivor starts it only when its transport path has not completed within
  ``max(etcd_after, 1 ms x survivors)`` seconds (:data:`ETCD_AFTER_S`, 10;
  ``RESILIENT_LEDGER_ETCD_AFTER``), so a recovery among N survivors costs no etcd write
  when the transport path works, instead of N puts and N waits on N keys. A survivor
  whose view of the survivors differs can stall the tree for some and not others, so
  one whose exchange completed over the transport looks once, a second after any
  fallback would have begun, for a summary of its epoch in etcd (one key-only read)
  and puts its own when it finds one.

Failure behaviour: a survivor that dies during the exchange -> a newer epoch -> the
transport is aborted -> :class:`~resilient.errors.TransportAborted` propagates and the
caller starts over in the newer epoch; an epoch newer than ``epoch`` (even one that only
adds members) -> :class:`~resilient.coordinator.epoch.EpochChanged`, the caller starts
over; nothing complete within ``timeout`` -> :class:`TimeoutError` naming the members
missing (or, in the tree, the parent whose decision did not come); a length frame over
:data:`MAX_STATUS_BYTES`, a summary naming another member, a tree message whose records
are not exactly the sender's subtree -> :class:`~resilient.errors.FrameError` (a corrupt
peer; nothing is decoded from it). The planner dying or stalling is any survivor dying or
stalling: a newer epoch without it, and the survivors start over with the next survivor
as the planner.
Whatever path wins, the other's leftovers are cancelled, so no control frame of this
exchange can meet a later one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

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
#: hop, n - 1 connections each); beyond it the summaries go up a tree to the planner and
#: each survivor gets its decision back (RESILIENT_LEDGER_DIRECT_MAX)
DIRECT_MAX: int = Settings.ledger_direct_max
#: children per survivor in that tree (RESILIENT_LEDGER_TREE_FANOUT)
TREE_FANOUT: int = Settings.ledger_tree_fanout
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
                 payload: bytes, etcd_max: int = ETCD_MAX, etcd_after: float = ETCD_AFTER_S,
                 direct_max: int | None = None, fanout: int | None = None) -> None:
        self.view, self.transport, self.epoch = view, transport, int(epoch)
        #: up to this many survivors every one gets every summary; beyond, the tree
        self.direct_max = DIRECT_MAX if direct_max is None else int(direct_max)
        self.fanout = max(1, TREE_FANOUT if fanout is None else int(fanout))
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

    def run(self, timeout: float, newer_epoch: Callable[[], int | None],
            decide: Callable[[dict[str, bytes]], dict[str, bytes]] | None = None) -> Exchanged:
        """Every survivor's summary, keyed by member id (up to ``direct_max`` survivors, or
        whenever the etcd path completed first), or this survivor's decision (beyond it:
        the summaries went up the tree, the planner called ``decide`` on all of them and
        sent each survivor its own; ``decide`` must return one decision per survivor and
        is called on the planner only). See the module docstring for what it raises.
        ``newer_epoch()`` returns the number of an epoch newer than ``epoch`` when there is
        one."""
        self._timeout = timeout
        start = time.monotonic()
        if self.etcd_at_once:
            self._start_etcd()
        deadline = start + timeout
        n = len(self.ring)
        got: dict[str, bytes] = {self.me: self.payload}
        if n == 1:
            return Exchanged(got, None)
        tree = n > self.direct_max
        if tree and decide is None:
            raise ValueError(f"a ledger-status exchange among {n} survivors (> {self.direct_max}) needs a decide function")
        tr, seq = self.transport, control_seq(self.epoch)
        p = self.ring.index(self.me)
        sends: list[Any] = []
        finished = False
        waiting = [f"no ledger summary from {sorted(set(self.ring) - {self.me})}"]  # what a timeout names

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
                    raise ResilientTimeout(f"{waiting[0]} within {timeout}s")
            return True

        def receive(pairs: list[tuple[str, int]], records: list[int] | None = None) -> list[bytes] | None:
            """One message from each ``(peer, step)``: the length frames, then the
            payloads (already on their way behind them); None when etcd completed first.
            ``records``: how many summaries or decisions each message bundles (the size
            limit is :data:`MAX_STATUS_BYTES` per record)."""
            heads = [(peer, t, bytearray(_LEN.size)) for peer, t in pairs]
            if not wait([tr.irecv(peer, h, seq, tag(t, 0, SPACE)) for peer, t, h in heads]):
                return None
            bodies = []
            for i, (peer, t, h) in enumerate(heads):
                (size,) = _LEN.unpack(h)
                limit = MAX_STATUS_BYTES * (records[i] if records else 1)
                if size > limit:
                    raise FrameError(f"member {peer} announced a {size}-byte ledger message (limit "
                                     f"{limit}): corrupt frame")
                bodies.append((peer, bytearray(size), t))
            if not wait([tr.irecv(peer, b, seq, tag(t, 1, SPACE)) for peer, b, t in bodies]):
                return None
            return [bytes(b) for _, b, _ in bodies]

        def send(peer: str, data: bytes, t: int) -> None:
            sends.append(tr.isend(peer, _LEN.pack(len(data)), seq, tag(t, 0, SPACE)))
            sends.append(tr.isend(peer, data, seq, tag(t, 1, SPACE)))

        view_digest = hashlib.sha256("\n".join([str(self.epoch), str(self.direct_max), str(self.fanout),
                                                *self.ring]).encode()).digest()[:_VIEW]

        def same_view(b: bytes, peer: str) -> bool:
            """Whether tree message ``b`` from ``peer`` was sent over our list of survivors
            (its first bytes: the digest of the sender's). One that differs comes from a
            survivor with another view of the group (one already in the next op over a
            grown group): not corrupt, but its tree is not ours."""
            if b[:_VIEW] == view_digest:
                return True
            log.info("ledger-status exchange of epoch %d: %s lists other survivors than we do; completing "
                     "through etcd", self.epoch, peer)
            return False

        def etcd_only() -> Exchanged:
            """The transport path cannot complete (survivors disagree on the tree): the etcd
            path's result (started now if it was not), within the deadline."""
            self._start_etcd()
            waiting[0] = "the survivors listed different survivors and etcd delivered no complete set"
            while not self._etcd_done.wait(_POLL_S):
                newer = newer_epoch()
                if newer is not None:
                    raise EpochChanged(f"epoch {newer} superseded epoch {self.epoch} during the ledger-status "
                                       "exchange", newer, {})
                if time.monotonic() > deadline:
                    raise ResilientTimeout(f"{waiting[0]} within {timeout}s")
            if self._etcd is None:
                assert self._etcd_error is not None
                raise self._etcd_error
            return Exchanged(self._etcd, None)

        try:
            mine: bytes | None = None
            if not tree:
                # every survivor sends its summary to every other: one hop
                others = [m for m in self.ring if m != self.me]
                for peer in others:
                    send(peer, self.payload, 0)
                raw = receive([(peer, 0) for peer in others])
                if raw is None:
                    return Exchanged(self._etcd, None)
                for peer, b in zip(others, raw):
                    _check_member(b, peer, peer)
                    got[peer] = b
            else:
                # up the tree to the planner, each survivor's decision back down
                kids = tree_children(p, n, self.fanout)
                below = {c: [self.ring[i] for i in tree_subtree(c, n, self.fanout)] for c in kids}
                waiting[0] = f"no ledger summaries from the subtrees of {[self.ring[c] for c in kids]}"
                raw = receive([(self.ring[c], _UP) for c in kids], [len(below[c]) for c in kids])
                if raw is None:
                    return Exchanged(self._etcd, None)
                for c, b in zip(kids, raw):
                    if not same_view(b, self.ring[c]):
                        return etcd_only()
                    for who, summary in unpack_records(b[_VIEW:], below[c], self.ring[c], "ledger summaries").items():
                        _check_member(summary, who, self.ring[c])
                        got[who] = summary
                if p > 0:
                    parent = self.ring[tree_parent(p, n, self.fanout)]
                    send(parent, view_digest + pack_records(got.items()), _UP)
                    waiting[0] = f"no recovery decision from {parent} (the planner: {self.ring[0]})"
                    raw = receive([(parent, _DOWN)], [1 + sum(len(below[c]) for c in kids)])
                    if raw is None:
                        return Exchanged(self._etcd, None)
                    if not same_view(raw[0], parent):
                        return etcd_only()
                    mine_below = [self.me] + [m for c in kids for m in below[c]]
                    decisions = unpack_records(raw[0][_VIEW:], mine_below, parent, "recovery decisions")
                else:
                    assert decide is not None
                    decisions = decide(got)
                    if set(decisions) != set(self.ring):
                        raise ValueError("decide returned decisions for other members than the survivors")
                mine = decisions[self.me]
                for c in kids:
                    send(self.ring[c], view_digest + pack_records((m, decisions[m]) for m in below[c]), _DOWN)
            if not wait(sends):
                return Exchanged(self._etcd, None)
            finished = True
            if not self.etcd_started:   # others may still fall back to etcd: answer them there
                threading.Thread(target=self._answer_fallback, args=(start,), name=f"ledger-late-{self.epoch}",
                                 daemon=True).start()
            return Exchanged(None, mine) if tree else Exchanged(got, None)
        finally:
            if not finished:
                tr.cancel_op(seq)   # leftovers of this exchange never meet a later one


@dataclass(frozen=True)
class Exchanged:
    """The result of :meth:`StatusExchange.run`: every survivor's summary (``summaries``:
    up to ``direct_max`` survivors, or through etcd) or this survivor's decision from the
    planner (``decision``: beyond it, over the tree)."""

    summaries: dict[str, bytes] | None
    decision: bytes | None


# -- the tree ---------------------------------------------------------------------------------
# Survivors in ring order form a balanced ``fanout``-ary tree: the first survivor is the
# planner; a survivor's subtree is a contiguous range of survivors, itself first, the rest
# split into ``fanout`` ranges of sizes differing by at most one, each the subtree of a
# child (so no second-level survivor forwards more than ~n / fanout summaries). A
# survivor receives its subtree's summaries (its children's bundles) and sends them, with
# its own, to its parent; decisions come back the same way: a leaf (most survivors)
# receives no summary at all and only its own decision.

_UP, _DOWN = 1 << 27, (1 << 27) + 1   # tag steps apart from the direct exchange's 0
_REC = struct.Struct("<IQ")
_VIEW = 16   # a tree message starts with the sender's view digest: sha256 of the epoch and survivors


def _parts(lo: int, hi: int, fanout: int) -> list[tuple[int, int]]:
    """The children's ranges of the node at ``lo`` whose subtree is ``[lo, hi)``: the rest
    split into up to ``fanout`` contiguous ranges of sizes differing by at most one."""
    q, r = divmod(hi - lo - 1, fanout)
    out, start = [], lo + 1
    for j in range(min(fanout, hi - lo - 1)):
        size = q + (1 if j < r else 0)
        out.append((start, start + size))
        start += size
    return out


def _locate(i: int, n: int, fanout: int) -> tuple[int, int, int]:
    """``(lo, hi, parent)``: survivor ``i``'s subtree ``[lo, hi)`` (``lo == i``) and its
    parent (-1 for the planner), by descent from the planner: O(fanout x depth)."""
    if not 0 <= i < n:
        raise ValueError(f"survivor {i} is not one of {n}")
    lo, hi, parent = 0, n, -1
    while lo != i:
        for a, b in _parts(lo, hi, fanout):
            if a <= i < b:
                lo, hi, parent = a, b, lo
                break
    return lo, hi, parent


def tree_parent(i: int, n: int, fanout: int) -> int:
    """Survivor ``i``'s parent (-1 for the planner, survivor 0)."""
    return _locate(i, n, fanout)[2]


def tree_children(i: int, n: int, fanout: int) -> list[int]:
    lo, hi, _ = _locate(i, n, fanout)
    return [a for a, _ in _parts(lo, hi, fanout)]


def tree_subtree(i: int, n: int, fanout: int) -> list[int]:
    """Survivor ``i`` and its descendants: a contiguous range of survivors."""
    lo, hi, _ = _locate(i, n, fanout)
    return list(range(lo, hi))


def tree_received(n: int, fanout: int) -> list[int]:
    """How many summaries each of ``n`` survivors receives over the tree (its subtree's
    others: the planner ``n - 1``, a leaf none); ``bench/scale.py`` reports them. O(n)."""
    out = [0] * n
    stack = [(0, n)]
    while stack:
        lo, hi = stack.pop()
        out[lo] = hi - lo - 1
        stack.extend(_parts(lo, hi, fanout))
    return out


def pack_records(records: Iterable[tuple[str, bytes]]) -> bytes:
    """``(member, payload)`` records as one message: per record a little-endian u32 id
    length and u64 payload length, the id (UTF-8), the payload."""
    parts: list[bytes] = []
    for who, payload in records:
        b = who.encode("utf-8")
        parts += [_REC.pack(len(b), len(payload)), b, payload]
    return b"".join(parts)


def unpack_records(raw: bytes, expect: Sequence[str], via: str, what: str) -> dict[str, bytes]:
    """The records of :func:`pack_records` message ``raw`` from ``via``: exactly one for
    each of ``expect``; :class:`~resilient.errors.FrameError` (a corrupt peer) otherwise."""
    want, out, pos, mv = set(expect), {}, 0, memoryview(raw)
    while pos < len(raw):
        if pos + _REC.size > len(raw):
            raise FrameError(f"member {via} sent {what} with a truncated record header")
        klen, plen = _REC.unpack_from(raw, pos)
        pos += _REC.size
        if klen > len(raw) - pos or plen > len(raw) - pos - klen:
            raise FrameError(f"member {via} sent {what} with a record longer than the message")
        try:
            who = bytes(mv[pos:pos + klen]).decode("utf-8")
        except UnicodeDecodeError:
            raise FrameError(f"member {via} sent {what} with a member id that is not UTF-8") from None
        pos += klen
        if who not in want or who in out:
            raise FrameError(f"member {via} sent {what} naming {who!r}, not one of its subtree's members "
                             "(or twice)")
        out[who] = bytes(mv[pos:pos + plen])
        pos += plen
    if len(out) != len(want):
        missing = sorted(want - set(out))[:5]
        raise FrameError(f"member {via} sent {what} without {missing} ({len(want) - len(out)} missing)")
    return out


def _check_member(raw: bytes, want: str, via: str) -> None:
    try:
        member = json.loads(raw.decode("utf-8")).get("member")
    except (UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        raise FrameError(f"member {via} forwarded a ledger summary that is not valid JSON") from None
    if member != want:
        raise FrameError(f"member {via} forwarded the ledger summary of {member!r} where {want!r}'s was due")
