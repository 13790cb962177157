"""Direct shared-memory allreduce for the members of one host (issue 16): no ring, no
per-chunk messages.

Every member owns one segment (:mod:`resilient.transport.shm_segment`: an anonymous
memfd, mapped read-only by its peers). One op, member ``p`` of ``n``:

1. **in** — copy its input once into its own segment and publish the op's *ticket* in
   its ``W_IN`` word (with the op's descriptor digest);
2. **rs** — once every peer's ``W_IN`` shows the op, reduce chunk ``p`` (the ring's
   chunk ``p``: ``split(numel, n)``) reading every member's input straight from its
   segment, in cache-sized blocks in member-index order (so the bits do not depend on
   timing), into its output and into chunk ``p`` of its segment's *reduced* buffer (one
   page boundary after its input); publish ``W_RED``;
3. **ag** — copy each peer's reduced chunk out of that peer's segment as soon as its
   ``W_RED`` shows the op; publish ``W_DONE`` (it no longer reads anyone's segment).
   After the transport's abort (an epoch removed a member) it waits for nobody: it
   reduces each chunk not yet published itself, from the published inputs (step 2's
   bits).

A member overwrites its segment at its next op only after every peer's ``W_DONE``
passed its previous op. Waits read the peer's words, then sleep on the peer's futex bell
(2 ms at most, so an abort is seen within that: the transport's ``wait`` is asked between
sleeps), reporting a peer waited on past ``op_timeout`` as a suspect like
:meth:`~.base.OpContext.wait`, and adding the time slept to the transport's
``stats.wait_s_by_peer`` for that peer (what the ring's receives add: the health
reporter's windows, so the straggler detector sees a member that is late to the direct
ops; no bytes are counted, and same-host peers have no link speed). Tickets are
``(session id << 40) | (seq + 1)`` in each owner's own numbering, so they only grow on
one segment: a word *beyond* the expected ticket means the peer moved on without us.

**Sessions.** The first direct op of an epoch (per communicator and member set) swaps
segment locators with every peer over the transport (tag space ``SHM_DIRECT``, step 0),
opens and maps them, and votes (step 1): every member takes the direct path for that
epoch only when every member mapped every peer; otherwise every member runs the ring
(:class:`~.ring.RingReduceScatterAllgather`, the same ledger layout) for that epoch. A
member that cannot grow its segment for an op publishes ``W_NBYTES = -1`` with its
ticket: every member then runs that op on the ring. Peers' segments of earlier sessions
are unmapped when a new session starts (a dead member's segment is freed then).

**Ledger and recovery.** The layout is the ring's (``n`` chunks x ``slices``); a piece's
mask is 0 until its final value is in ``out``, then the full set. The input (``inp``)
is written only in chunk mode when the ledger allows it (``Ledger.deliver``: ``inp`` is the
caller's tensor): final values then go into it as well, this member's input is read from
its segment copy, and on any error ``inp`` is restored from that copy before the error
propagates, so a recovery or a rerun reads the input (``finish`` then has no copy to make). **A member that dies (or is stopped) after publishing its input stays a
contributor:** its input stays readable in the survivors' mappings (segments never
shrink), so every survivor that saw every input finishes the op over the full set —
copying the reduced chunks that were published and, after the epoch's abort, reducing
the others itself (step 3) — with no recovery and no resend. A member that dies before
publishing leaves the survivors waiting for its ``W_IN``; the abort raises
``TransportAborted`` there, the masks describe ``out`` exactly and the ordinary recovery
(:mod:`..resume`) finishes the op over the survivors from their kept inputs. A survivor
aborted before it saw every input while another finished gets the finished member's
(full) sets through the recovery's decided sets (docs/recovery.md), so every survivor
reports one set. A member that leaves an op by an error
invalidates its ``W_IN``/``W_RED`` first, and every read of a peer's region is checked
against the peer's ticket afterwards (a seqlock): a SIGSTOPped member that resumes after
the survivors moved on fails its op (``TransportError``) instead of delivering a torn
chunk, and a peer dying mid-op leaves its mapping readable (no SIGBUS: segments never
shrink). Failpoints: phases ``rs`` (fraction of the own chunk reduced) and ``ag``
(fraction of the peers' chunks copied or reduced), as the ring's.

Failure behaviour: the transport's abort raises ``TransportAborted`` from a wait for
the peers' inputs or for room in the own segment (once every input is seen it only ends
the waiting: step 3); a peer's descriptor digest that differs from ours raises
:class:`~resilient.errors.OpMismatch` (every member sees one, since every digest is
published before anyone waits); a peer that gave the op up or moved past it raises
:class:`~resilient.errors.TransportError` (the op loop then recovers in the next epoch).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from resilient.collectives import failpoints, tags
from resilient.collectives.algorithms.base import Capabilities, OpContext, OpTransport, tag
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.group import EpochLike
from resilient.errors import OpMismatch, TransportAborted, TransportError
from resilient.kernels import ReduceOp
from resilient.kernels.copy import copy_into
from resilient.transport.hybrid import split_address
from resilient.transport.shm_segment import (
    A_DIGEST, A_IN, A_NBYTES, A_OFFSET, A_RED, AREAS, LOCATOR_BYTES, W_DONE, W_WAITING, Locator, OwnSegment,
    PeerSegment, area_word, page_round, supported,
)

log = logging.getLogger(__name__)


#: bytes reduced per block (the destination block stays in cache while every input is added)
BLOCK_BYTES = 512 << 10
#: ops up to this size: every member reduces the whole buffer itself (one wait per op)
ALL_MAX_BYTES = 1 << 20
#: longest futex sleep between checks of the transport's abort
SLEEP_S = 0.002
#: reads of a peer's word before the first sleep
SPINS = 20
_SEQ_BITS = 40
_SID_MASK = (1 << 23) - 1


@dataclass
class Counts:
    """Ops of this process by path (diagnostics and tests): ``direct`` through the
    segments, ``ring`` on the ring (a session or an op that could not use them)."""

    direct: int = 0
    ring: int = 0


COUNTS = Counts()


#: ``combine(a, b, out=)``: the elementwise op of each reduce op, as
#: :func:`resilient.kernels.reduce_into` computes it (AVG sums; the op divides at the end),
#: called without its per-call checks (the buffers are the op's own, checked once)
_COMBINE: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PROD: torch.mul,
    ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
}


def eligible(members: list[str], epoch: EpochLike) -> bool:
    """Whether the op's ``members`` can run the direct allreduce: this platform supports
    segments, every member published a shared-memory address with one host key (one boot
    and network namespace: :mod:`resilient.transport.hybrid`), and the plan does not place
    them on different hosts (emulated hosts of the hierarchical tests and benches)."""
    if len(members) < 2 or not supported():
        return False
    keys = set()
    for m in members:
        info = epoch.infos.get(m)
        if info is None:
            return False
        _, key, name = split_address(info.address)
        if key is None or name is None:
            return False
        keys.add(key)
    return len(keys) == 1 and _one_planned_host(members, epoch)


def _one_planned_host(members: list[str], epoch: EpochLike) -> bool:
    """False when the plan's well-formed ``host_groups`` put two of ``members`` in different runs."""
    runs, ring = epoch.plan.host_groups, list(epoch.members)
    if not runs:
        return True
    run_of: dict[str, int] = {}
    for g, (start, count) in enumerate(runs):
        if start < 0 or count < 1 or start + count > len(ring):
            return True   # unusable grouping: the shared-memory host key decides
        for m in ring[start:start + count]:
            run_of[m] = g
    return len({run_of.get(m, -1) for m in members}) == 1


def ticket(sid: int, seq: int) -> int:
    """Op ``seq``'s ticket on a segment whose session id is ``sid`` (never 0)."""
    return ((sid & _SID_MASK) << _SEQ_BITS) | (seq + 1)


def _done_with(seg: PeerSegment, done: int) -> Callable[[], bool]:
    """Whether the owner of ``seg`` finished reading for the op of ticket ``done``."""
    return lambda: seg.word(W_DONE) >= done


@dataclass
class _Session:
    """One epoch's direct allreduces over one member set (``me``: this member's index)."""

    own: OwnSegment
    sid: int
    me: int
    peers: dict[int, tuple[PeerSegment, int]]   # member index -> (segment, its sid)
    count: int = 0                              # direct ops run so far (the area is count % AREAS)
    seqs: list[int] = field(default_factory=list)   # the last AREAS ops' seqs
    stride: int = 0                             # bytes of one data area now


@dataclass
class _MemberState:
    """What one communicator keeps between ops: its segment and its sessions."""

    own: OwnSegment | None = None
    next_sid: int = 1
    sessions: dict[tuple[int, tuple[str, ...]], _Session | None] = field(default_factory=dict)
    mapped: dict[tuple[int, int, int, int], PeerSegment] = field(default_factory=dict)   # by Locator.where

    def close(self) -> None:
        for seg in self.mapped.values():
            seg.close()
        self.mapped.clear()
        self.sessions.clear()
        if self.own is not None:
            self.own.close()


_STATES: "weakref.WeakKeyDictionary[OpTransport, _MemberState]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def _state_of(tr: OpTransport) -> _MemberState | None:
    """The state kept for the communicator posting through ``tr`` (None: ``tr`` cannot be
    weakly referenced; the caller then takes the ring)."""
    with _STATES_LOCK:
        try:
            st = _STATES.get(tr)
            if st is None:
                st = _STATES[tr] = _MemberState()
                weakref.finalize(tr, st.close)
        except TypeError:
            return None
        return st


class ShmDirect(ABC):
    """What the direct shared-memory collectives share (:class:`ShmDirectAllreduce`,
    :mod:`.shm_direct_rs`): the per-epoch session (segment locators swapped and voted
    on), the op's area made free and large enough, publishing words, abort-aware waits
    on a peer's words, reads re-checked against the peer's ticket, and reducing one chunk
    of every member's input in member order. A subclass runs one op through the
    segments (:meth:`_direct`) and names the ring algorithm of the same ledger layout
    that runs an op when the segments cannot (:meth:`_ring`)."""

    SPACE = tags.SHM_DIRECT
    capabilities = Capabilities()

    def __init__(self, slices: int) -> None:
        self.slices = slices

    def run(self, ctx: OpContext) -> None:
        st = _state_of(ctx.transport) if ctx.seq < (1 << _SEQ_BITS) else None
        sess = self._session(ctx, st) if st is not None else None
        if sess is None:
            COUNTS.ring += 1
            self._ring(ctx)
            return
        self._direct(ctx, sess)

    def _session(self, ctx: OpContext, st: _MemberState) -> _Session | None:
        key = (ctx.epoch, ctx.members)
        if key in st.sessions:
            return st.sessions[key]
        sid = st.next_sid
        st.next_sid += 1
        if st.own is None:
            try:
                st.own = OwnSegment.create()
            except OSError as exc:
                log.warning("shared-memory allreduce: cannot create a segment (%s): ring instead", exc)
        locs = self._swap(ctx, 0, st.own.locator(sid).encode() if st.own is not None else bytes(LOCATOR_BYTES))
        peers: dict[int, tuple[PeerSegment, int]] = {}
        ok = st.own is not None
        for q, raw in locs.items():
            loc = Locator.decode(raw)
            seg = st.mapped.get(loc.where) if loc is not None else None
            if loc is not None and seg is None:
                seg, why = PeerSegment.open(loc)
                if seg is None:
                    log.warning("shared-memory allreduce: cannot map %s's segment (%s): ring instead",
                                ctx.members[q], why)
            if seg is None or loc is None:
                ok = False
                continue
            peers[q] = (seg, loc.sid)
        votes = self._swap(ctx, 1, b"\x01" if ok else b"\x00")
        # earlier sessions' mappings go now (a dead member's segment is freed with them)
        keep = {seg.locator.where for seg, _ in peers.values()}
        for where in [w for w in st.mapped if w not in keep]:
            st.mapped.pop(where).close()
        st.mapped.update({seg.locator.where: seg for seg, _ in peers.values()})
        st.sessions.clear()
        if ok and all(v == b"\x01" for v in votes.values()) and st.own is not None:
            st.sessions[key] = _Session(st.own, sid, ctx.me, peers)
        else:
            st.sessions[key] = None
        return st.sessions[key]

    def _swap(self, ctx: OpContext, step: int, mine: bytes) -> dict[int, bytes]:
        """Send ``mine`` to every peer and receive theirs (same length) in step ``step``."""
        tr, t = ctx.transport, tag(step, 0, self.SPACE)
        bufs = {q: bytearray(len(mine)) for q in range(len(ctx.members)) if q != ctx.me}
        reqs = [tr.irecv(ctx.members[q], b, ctx.seq, t, ctx.digest) for q, b in bufs.items()]
        reqs += [tr.isend(ctx.members[q], mine, ctx.seq, t, ctx.digest) for q in bufs]
        ctx.wait(reqs)
        return {q: bytes(b) for q, b in bufs.items()}

    def _room(self, ctx: OpContext, sess: _Session, nbytes: int) -> bool:
        """Make this op's area free and ``nbytes`` large: wait until every peer finished
        reading the op that used it last (or, when the areas must grow and move, every
        earlier op). False when the segment cannot grow (the op then runs on the ring)."""
        if sess.stride < nbytes:
            last = sess.seqs[-1:]
            stride = page_round(nbytes)
            try:
                sess.own.ensure(AREAS * stride)
            except OSError as exc:
                log.warning("shared-memory allreduce #%d: cannot grow the segment to %d bytes (%s): ring",
                            ctx.seq, AREAS * stride, exc)
                return False
        elif len(sess.seqs) == AREAS:
            last = sess.seqs[:1]
        else:
            last = []
        for prev in last:
            for q, (seg, sid) in sess.peers.items():
                self._await(ctx, sess, q, _done_with(seg, ticket(sid, prev)))
        if sess.stride < nbytes:
            # the areas move (a new one may cover an old one): no old ticket stays valid
            for a in range(AREAS):
                sess.own.set(area_word(a, A_IN), 0)
                sess.own.set(area_word(a, A_RED), 0)
            sess.stride = page_round(nbytes)
        return True

    def _begin(self, ctx: OpContext, sess: _Session, nbytes: int,
               span: int | None = None) -> tuple[int, int, dict[int, int], bool]:
        """Claim this op's area (:meth:`_room`: ``span`` bytes, default ``nbytes``) and
        write its header words (tickets cleared, digest, size or -1 when it does not fit,
        offset): ``(area, own ticket, peers' tickets, fits)``. Raises what :meth:`_room` raises."""
        own = sess.own
        mine = ticket(sess.sid, ctx.seq)
        theirs = {q: ticket(sid, ctx.seq) for q, (_, sid) in sess.peers.items()}
        area = sess.count % AREAS
        fits = self._room(ctx, sess, nbytes if span is None else span)
        sess.count += 1
        sess.seqs = (sess.seqs + [ctx.seq])[-AREAS:]
        own.set(area_word(area, A_IN), 0)
        own.set(area_word(area, A_RED), 0)
        own.set(area_word(area, A_DIGEST), ctx.digest)
        own.set(area_word(area, A_NBYTES), nbytes if fits else -1)
        own.set(area_word(area, A_OFFSET), area * sess.stride)
        return area, mine, theirs, fits

    def _await_inputs(self, ctx: OpContext, sess: _Session, area: int, theirs: dict[int, int]) -> OpMismatch | None:
        """Wait until every peer published this op's input; the mismatch (for the caller
        to raise, keeping its words so every peer sees it too) when a peer's descriptor
        digest differs."""
        for q, (seg, _) in sess.peers.items():
            self._await(ctx, sess, q, self._ready(ctx, q, seg, area_word(area, A_IN), theirs[q]))
            if seg.word(area_word(area, A_DIGEST)) != ctx.digest:
                return OpMismatch(ctx.members[q], ctx.seq, seg.word(area_word(area, A_DIGEST)), ctx.digest)
        return None

    @staticmethod
    def _all_fit(sess: _Session, area: int) -> bool:
        """Whether every peer could hold this op in its segment (else every member runs the ring)."""
        return all(seg.word(area_word(area, A_NBYTES)) >= 0 for seg, _ in sess.peers.values())

    def _publish(self, sess: _Session, word: int, value: int) -> None:
        """Store ``word``, ring the bell, and wake the peers sleeping on it (if any)."""
        sess.own.set(word, value)
        sess.own.ring(any(seg.word(W_WAITING) == sess.me + 1 for seg, _ in sess.peers.values()))

    def _chunk(self, ctx: OpContext, c: int) -> tuple[int, int]:
        S, pieces = self.slices, ctx.ledger.pieces
        return pieces[c * S][0], pieces[c * S + S - 1][1]

    def _mark(self, ctx: OpContext, c: int, mask: int | None = None) -> None:
        """Chunk ``c``'s pieces get ``mask`` (default: the full set)."""
        L, S = ctx.ledger, self.slices
        L.set_range(c * S, (c + 1) * S, L.full if mask is None else mask)

    def _view(self, ctx: OpContext, q: int, seg: PeerSegment, area: int, nbytes: int,
              dtype: torch.dtype, at: int = 0) -> torch.Tensor:
        """``nbytes`` of peer ``q``'s area ``area`` from byte ``at`` on; TransportError
        when its segment does not hold them."""
        try:
            return seg.view(seg.word(area_word(area, A_OFFSET)) + at, nbytes, dtype)
        except (OSError, ValueError) as exc:
            raise TransportError(f"op #{ctx.seq}: member {ctx.members[q]}'s shared-memory segment: {exc}") from None

    def _reduce_own(self, ctx: OpContext, ins: list[torch.Tensor], region: torch.Tensor | None,
                    phase: str, c: int | None = None, frac0: float = 0.0, share: float = 1.0,
                    deliver: torch.Tensor | None = None) -> None:
        """Chunk ``c`` (default: this member's) of every input, reduced in member order in
        cache-sized blocks, into ``out`` (and into ``region`` and ``deliver``). Failpoint
        ``phase`` at fractions ``frac0 .. frac0 + share`` of it."""
        a, b = self._chunk(ctx, ctx.me if c is None else c)
        out, combine = ctx.ledger.out, _COMBINE[ctx.op]
        step = max(1, BLOCK_BYTES // max(1, out.element_size()))
        probe = failpoints.ACTIVE and ctx.ledger.enabled
        if probe:
            step = max(1, min(step, (b - a) // 16))
        for x in range(a, b, step):
            y = min(b, x + step)
            if probe:
                ctx.failpoint(phase, frac0 + share * (x - a) / (b - a))
            dst = out[x:y]
            combine(ins[0][x:y], ins[1][x:y], out=dst)
            for src in ins[2:]:
                combine(dst, src[x:y], out=dst)
            # streamed whatever the block's size: neither destination is read by this member again
            if region is not None:
                copy_into(region[x:y], dst, None if deliver is None else deliver[x:y], min_bytes=0)
            elif deliver is not None:
                copy_into(deliver[x:y], dst, min_bytes=0)

    @staticmethod
    def _check(ctx: OpContext, sess: _Session, word: int, theirs: dict[int, int],
               peers: dict[int, tuple[PeerSegment, int]]) -> None:
        """After reading: every one of ``peers`` still shows this op in ``word``."""
        for q, (seg, _) in peers.items():
            if seg.word(word) != theirs[q]:
                raise TransportError(f"op #{ctx.seq}: member {ctx.members[q]} overwrote its shared-memory "
                                     "segment while this member read it (this member was left behind)")

    @staticmethod
    def _ready(ctx: OpContext, q: int, seg: PeerSegment, word: int, want: int) -> Callable[[], bool]:
        """Whether ``seg``'s ``word`` shows ticket ``want``; TransportError when the peer
        moved past it or gave this op up.

        ``W_DONE`` is read *before* ``word``: a peer that finished the op normally keeps
        ``word`` at ``want`` until this member's own ``W_DONE`` lets it reuse the area, so
        ``done >= want`` with ``word != want`` read after it can only mean the peer cleared
        ``word`` when it gave the op up. (Read the other way round, a peer that published
        ``word`` and finished the whole op between the two reads — this member descheduled
        for a millisecond on a loaded host — looked as if it had given the op up: a
        spurious failure of every member, and no epoch to recover in.)"""
        def ready() -> bool:
            done = seg.word(W_DONE)
            w = seg.word(word)
            if w == want:
                return True
            if w > want or done >= want:
                raise TransportError(f"op #{ctx.seq}: member {ctx.members[q]} left this op "
                                     f"({'moved past it' if w > want else 'gave it up'})")
            return False
        return ready

    @staticmethod
    def _await(ctx: OpContext, sess: _Session, q: int, ready: Callable[[], bool]) -> None:
        """Until ``ready()``: read, then sleep on peer ``q``'s bell (saying so in our
        ``W_WAITING``, so that it wakes us); the transport's abort (asked between sleeps)
        raises ``TransportAborted`` — unless ``ready()`` holds when it is seen (the word
        came during the last sleep: the op goes on, as it would have a moment earlier)."""
        for _ in range(SPINS):
            if ready():
                return
        seg = sess.peers[q][0]
        t0, reported = time.monotonic(), False
        sess.own.set(W_WAITING, q + 1)
        stats = getattr(ctx.transport, "stats", None)
        try:
            while True:
                bell = seg.bell()
                if ready():
                    return
                seg.wait(bell, SLEEP_S)
                try:
                    ctx.transport.wait((), 0)
                except TransportAborted:
                    if ready():
                        return
                    raise
                if (not reported and ctx.op_timeout is not None and time.monotonic() - t0 > ctx.op_timeout):
                    reported = True
                    ctx.on_suspect(ctx.members[q], f"op #{ctx.seq}: waited more than {ctx.op_timeout}s "
                                                   "(shared memory)")
        finally:
            sess.own.set(W_WAITING, 0)
            if stats is not None:   # the straggler detector's per-peer waits, as a ring's receives count them
                stats.add_wait(ctx.members[q], time.monotonic() - t0)

    @abstractmethod
    def _ring(self, ctx: OpContext) -> None:
        """Run the op on the ring algorithm of the same ledger layout."""

    @abstractmethod
    def _direct(self, ctx: OpContext, sess: _Session) -> None:
        """Run the op through the segments of ``sess``."""


class ShmDirectAllreduce(ShmDirect):
    """The direct allreduce (the module's docstring); the ring allreduce when the segments cannot run an op."""

    def final_order(self, n_members: int, index: int, n_pieces: int) -> list[int]:
        """Its own chunk's pieces, then the others' in member order."""
        if n_members < 2 or n_pieces % n_members:
            return list(range(n_pieces))
        S = n_pieces // n_members
        return [c * S + j for c in [index] + [c for c in range(n_members) if c != index] for j in range(S)]

    def _direct(self, ctx: OpContext, sess: _Session) -> None:
        """Run the op through the segments, or on the ring when a member could not hold
        it (every member then runs the ring: they all read the same words)."""
        L, own = ctx.ledger, sess.own
        inp = L.inp
        nbytes, dtype = inp.numel() * inp.element_size(), inp.dtype
        every = nbytes <= ALL_MAX_BYTES
        # chunk mode: the whole input, then (a page boundary on) the reduced own chunk at its
        # place in a buffer of the op's length (the pages of the other chunks stay untouched)
        red_at = page_round(nbytes)
        area, mine, theirs, fits = self._begin(ctx, sess, nbytes, None if every else red_at + nbytes)
        failed = True
        try:
            region = own.view(area * sess.stride, nbytes, dtype) if fits else None
            if region is not None:
                copy_into(region, inp)   # all of it: a peer reduces this member's chunk from it if it dies
            self._publish(sess, area_word(area, A_IN), mine)
            mismatch = self._await_inputs(ctx, sess, area, theirs)
            if mismatch is not None:
                failed = False   # keep our words: every peer must see the mismatch too
                raise mismatch
            if region is None or not self._all_fit(sess, area):
                COUNTS.ring += 1
                self._ring(ctx)
                failed = False
                return
            ins = [inp if q == ctx.me else self._view(ctx, q, sess.peers[q][0], area, nbytes, dtype)
                   for q in range(len(ctx.members))]
            if every:
                self._reduce_every(ctx, sess, area, ins, theirs)
            else:
                self._chunks(ctx, sess, area, ins, theirs, region, red_at, mine)
            COUNTS.direct += 1
            failed = False
        finally:
            if failed:   # a member left behind must not finish from our area
                own.set(area_word(area, A_IN), 0)
                own.set(area_word(area, A_RED), 0)
            self._publish(sess, W_DONE, mine)

    def _chunks(self, ctx: OpContext, sess: _Session, area: int, ins: list[torch.Tensor], theirs: dict[int, int],
                region: torch.Tensor, red_at: int, mine: int) -> None:
        """Chunk mode: reduce the own chunk, publish it, gather the others.

        When the ledger allows it (:attr:`~resilient.collectives.ledger.Ledger.deliver`:
        ``inp`` is the caller's tensor), every final value goes into ``inp`` as well as into
        ``out`` (a peer's chunk is read once for both), this member's input is read from its
        segment copy (``region``) instead, and the op's ``finish`` skips its copy into the
        caller's tensor. Whatever this raises, ``inp`` is first restored from ``region``
        (the input again), so the recovery or a rerun of the op reads the input."""
        L = ctx.ledger
        deliver = L.inp if L.deliver else None
        if deliver is not None:
            ins = list(ins)
            ins[ctx.me] = region
        try:
            self._reduce_own(ctx, ins, sess.own.view(area * sess.stride + red_at, region.numel() * region.element_size(),
                                                     region.dtype), "rs", deliver=deliver)
            self._check(ctx, sess, area_word(area, A_IN), theirs, sess.peers)
            self._mark(ctx, ctx.me)
            self._publish(sess, area_word(area, A_RED), mine)
            self._gather(ctx, sess, area, ins, theirs, red_at, deliver)
        except BaseException:
            if deliver is not None:
                copy_into(deliver, region)   # the caller's tensor holds the input again
            raise
        L.delivered = deliver is not None

    def _reduce_every(self, ctx: OpContext, sess: _Session, area: int, ins: list[torch.Tensor],
                      theirs: dict[int, int]) -> None:
        """Small ops: every member reduces every chunk itself (one wait per op): its own
        chunk first (failpoint ``rs``), then the others (``ag``)."""
        n, me = len(ctx.members), ctx.me
        for i, c in enumerate([me] + [c for c in range(n) if c != me]):
            if i == 0:
                self._reduce_own(ctx, ins, None, "rs", c)
            else:
                self._reduce_own(ctx, ins, None, "ag", c, (i - 1) / (n - 1), 1 / (n - 1))
            self._check(ctx, sess, area_word(area, A_IN), theirs, sess.peers)
            self._mark(ctx, c)

    def _gather(self, ctx: OpContext, sess: _Session, area: int, ins: list[torch.Tensor],
                theirs: dict[int, int], red_at: int, deliver: torch.Tensor | None = None) -> None:
        """Copy every peer's reduced chunk as soon as it is ready (then check it was not
        overwritten meanwhile), marking its pieces final (each copied or reduced chunk
        goes into ``deliver`` too, when given).

        Every input is published (and stays so until this member's ``W_DONE``), so a peer's
        chunk never *has* to come from that peer: once the transport is aborted (an epoch
        removed someone — the peer died or was stopped after publishing its input — or
        this member is being left behind), this member stops waiting and reduces each chunk
        not yet published itself, from every member's input in member order (the bits the
        peer would have published), re-checking the input tickets afterwards. So a victim
        that published its input stays a contributor on every survivor and the op needs no
        recovery; nothing here waits after the abort."""
        out, pending = ctx.ledger.out, sorted(sess.peers)
        probe = failpoints.ACTIVE and ctx.ledger.enabled
        red = area_word(area, A_RED)
        nbytes, dtype = out.numel() * out.element_size(), out.dtype
        copied, aborted = 0, False
        while pending:
            ready = [q for q in pending if sess.peers[q][0].word(red) == theirs[q]]
            if not ready and not aborted:
                q = pending[0]
                try:
                    self._await(ctx, sess, q, self._ready(ctx, q, sess.peers[q][0], red, theirs[q]))
                except TransportAborted as exc:
                    log.info("op #%d: %s; reducing the chunks of %s from their inputs", ctx.seq, exc,
                             [ctx.members[p] for p in pending if sess.peers[p][0].word(red) != theirs[p]])
                    aborted = True
                continue
            if not ready:   # aborted: the first pending chunk, reduced here
                q = pending[0]
                self._reduce_own(ctx, ins, None, "ag", q, copied / len(sess.peers), 1 / len(sess.peers), deliver)
                self._check(ctx, sess, area_word(area, A_IN), theirs, sess.peers)
                self._mark(ctx, q)
                pending.remove(q)
                copied += 1
                continue
            for q in ready:
                seg = sess.peers[q][0]
                view = self._view(ctx, q, seg, area, nbytes, dtype, red_at)
                a, b = self._chunk(ctx, q)
                parts = 8 if probe else 1
                for j in range(parts):
                    x, y = a + (b - a) * j // parts, a + (b - a) * (j + 1) // parts
                    if probe:
                        ctx.failpoint("ag", (copied + j / parts) / len(sess.peers))
                    copy_into(out[x:y], view[x:y], None if deliver is None else deliver[x:y])
                self._check(ctx, sess, red, theirs, {q: sess.peers[q]})
                self._mark(ctx, q)
                pending.remove(q)
                copied += 1

    def _ring(self, ctx: OpContext) -> None:
        RingReduceScatterAllgather(self.slices).run(ctx)
