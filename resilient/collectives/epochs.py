"""``EpochTracker``: which epoch a Communicator's ops run in, and when it adopts a newer one.

* An epoch that **removes** a member of ours aborts the transport at once (watch thread,
  :meth:`EpochTracker.on_epoch`); the op thread then recovers the op in it.
* An epoch that only **grows** the group (joiners, role changes) is adopted at an op
  boundary the whole group agrees on: every old member announces (from the watch thread)
  the first op seq it has not started, and all adopt it at the largest one. With
  ``RESILIENT_JOIN_TREE=1``, over a transport with a join side channel (TCP, hybrid),
  the largest is reduced along a tree of the old members and its root writes the one key
  ``epochs/<n>/data/joinseq/<root>`` everyone waits on (:mod:`.join_agreement`); the op
  thread carries the tree's messages while it waits on an op, at a boundary, or in a
  short progress task queued when the epoch is seen (which gives the thread back to any
  op queued behind it). A tree that gives no result within ``RESILIENT_JOIN_TREE_STALL``
  seconds is completed through a few covering records (the stalled member's, its
  children's and its ancestors': :mod:`.join_agreement`). Otherwise (``RESILIENT_JOIN_TREE=0``, and over NCCL) every old member puts its
  own ``joinseq`` key and everyone waits for all of them.
  Several growing epochs are adopted one by one, in order, each at its own agreed seq
  (never skipping one the group may adopt: docs/recovery.md).
* A **removal while an admission is pending**: an agreed admission stands (every member
  admits the joiners at the agreed seq, whichever path it took); one not agreed in etcd
  is cancelled by the coordinator, which leaves the joiners out of the removal and adds
  them again, and the joiner waits for that (docs/recovery.md).

Failure behaviour: a member not in the newest epoch gets
:class:`~resilient.errors.RemovedFromGroup` (``Evicted`` when the plan says so); a growing
epoch whose members do not all announce within ``epoch_timeout`` raises
:class:`~resilient.errors.CollectiveError` (the silent member's lease then expires and the
next epoch removes it); no newer epoch within ``epoch_timeout`` after a failed op raises
``CollectiveError`` asking whether the coordinator runs.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Callable, Protocol

from concurrent.futures import Future

from resilient.collectives.eviction import removed_error
from resilient.collectives.group import EpochLike, GroupView, addresses_of
from resilient.collectives.join_agreement import JoinAgreement, old_members, wait_outcome
from resilient.errors import CollectiveError, EpochChanged, RecordError, RemovedFromGroup
from resilient.settings import Settings
from resilient.transport.base import JoinCarrier, Transport

log = logging.getLogger(__name__)

#: epoch cause -> the ``resilient_recoveries_total`` cause label
_CAUSE_LABELS = {"member_lost": "member_lost", "lease_expired": "lease_expired",
                 "suspect_confirmed": "suspect_confirmed", "health": "demoted", "demoted": "demoted",
                 "evicted": "demoted"}


class _DaemonWorker:
    """One daemon thread running submitted calls in order, each into a :class:`Future`.

    Written by hand because :class:`concurrent.futures.ThreadPoolExecutor` joins its
    threads when the interpreter exits: a member that closed while a join agreement's
    settle still waited on its records (up to ``epoch_timeout``) would not exit until that
    wait ended. :meth:`shutdown` cancels the queued calls and lets the running one end
    with the process; a call's exception goes into its future, never out of the thread."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[int], Callable[..., int], tuple[object, ...]] | None] = \
            queue.SimpleQueue()
        self._stopped = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., int], *args: object) -> Future[int]:
        fut: Future[int] = Future()
        if self._stopped:
            fut.cancel()
        else:
            self._calls.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        self._stopped = True
        self._calls.put(None)

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fut, fn, args = item
            if self._stopped:
                fut.cancel()
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller through the future
                fut.set_exception(exc)


class EpochMetrics(Protocol):
    def set_epoch(self, number: int, size: int) -> None: ...

    def record_membership_recovery(self, cause: str) -> None: ...


class Configurable(Protocol):
    """The op transport's epoch switch (``RetryingTransport.configure``)."""

    def configure(self, epoch: int, token: str, addresses: dict[str, str]) -> None: ...


def cause_label(e: EpochLike) -> str:
    """The ``resilient_recoveries_total`` cause label of an epoch that removed members."""
    return _CAUSE_LABELS.get(e.cause, "member_lost")


#: epochs ahead of this member's view whose join messages are kept until it sees them
_EARLY_EPOCHS = 8


class _Up:
    """The :class:`~.join_agreement.Channel` over a transport's join side channel."""

    def __init__(self, carrier: JoinCarrier) -> None:
        self.carrier = carrier

    def send_up(self, parent: str, epoch: int, seq: int) -> None:
        self.carrier.post_join(parent, epoch, seq)


class EpochTracker:
    """The epoch, group and op sequence counter of one Communicator (see the module
    docstring). ``transport``: aborted on a removal; ``op_transport``: configured on
    every adopted epoch."""

    def __init__(self, view: GroupView, transport: Transport, op_transport: Configurable, epoch_timeout: float,
                 metrics: EpochMetrics | None) -> None:
        self.view, self.transport, self.op_transport = view, transport, op_transport
        self.member_id = view.member_id
        self.epoch_timeout = epoch_timeout
        self.metrics = metrics
        self.lock = threading.Lock()
        self.published: dict[int, int] = {}  # epoch -> the next op seq this member announced there
        self.aborted_at: float | None = None  # wall time the watch thread last aborted the transport
        self.switch: tuple[int, EpochLike] | None = None  # (op seq, epoch) at which to adopt a growing epoch
        self.seen: dict[int, EpochLike] = {}  # newer epochs the watch thread delivered, not adopted yet
        self.seq = 0
        self.admitted_at = 0  # the op seq at which the newest admission took effect (agreed: see boundary/start)
        self._unwatch: Callable[[], None] = lambda: None
        #: the join side channel (None: one etcd key per old member) and its agreements
        settings = Settings.from_env()
        self.carrier: JoinCarrier | None = transport.join_carrier() if settings.join_tree else None
        self.join_stall = settings.join_tree_stall
        self.agreements: dict[int, JoinAgreement] = {}
        self._settling: dict[int, Future[int]] = {}  # epoch -> this old member's JoinAgreement.settle
        self._early: dict[int, dict[str, int]] = {}  # epoch -> child -> seq, before we saw that epoch
        self._on_op_thread: Callable[[Callable[[], None]], object] | None = None  # its result is not used
        self._ops_queued: Callable[[], int] = lambda: 0
        self._waiter: _DaemonWorker | None = None
        if self.carrier is not None:
            self.carrier.on_join(self._on_join_message)
        epoch = view.current()
        if epoch is None or self.member_id not in epoch.members:
            epoch = view.wait_for(lambda e: self.member_id in e.members, epoch_timeout)
        self.group = set(epoch.members)
        self.epoch = epoch
        self.enter(epoch, first=True)

    def start(self, joining: bool | None) -> None:
        """Announce this member's first op seq, or (a joiner: ``joining``, default: the
        epoch added us) start at the group's."""
        epoch = self.epoch
        if joining is None:
            joining = epoch.cause != "initial" and self.member_id in epoch.added
        if joining:
            # Admitted at an op boundary: the group's members agree under epochs/<n>/ on
            # the op seq at which they adopt this epoch; we start there.
            self.seq = self.admitted_at = self._joiner_start()
            log.info("member %s joins epoch %d at op #%d", self.member_id, self.epoch.number, self.seq)
        else:
            # also a fresh Communicator built in an epoch that admitted others a moment
            # after its own start (cause "joined" at start-up): they wait for this
            self.announce(epoch)
        self.set_metrics()

    def _joiner_start(self) -> int:
        """A joiner's first op seq: the agreed seq of the epoch that added it (either form,
        :func:`~.join_agreement.wait_outcome`). When a newer epoch supersedes that epoch
        first, the result is read once more (one in etcd is final then: the joiner is in the
        group at that seq); when there is none, the coordinator left this joiner out of the
        removal that superseded its admission (``coordinator/decide.py``) and adds it again
        in a later epoch: it waits for that epoch, within ``epoch_timeout`` in all, and
        starts there. Raises EpochChanged / TimeoutError when it is neither admitted nor
        added again in time, RemovedFromGroup when a newer epoch keeps it without an
        agreed seq (an inconsistent record)."""
        deadline = time.monotonic() + self.epoch_timeout
        while True:
            epoch = self.epoch
            if not old_members(epoch):
                return 0
            try:
                return wait_outcome(self.view, epoch, max(0.0, deadline - time.monotonic()))
            except EpochChanged:
                pass
            try:
                return wait_outcome(self.view, epoch, 0.0)   # a result that landed just before the newer epoch
            except (EpochChanged, TimeoutError):
                pass
            newest = self.view.current()
            if newest is not None and self.member_id in newest.members and self.member_id not in newest.added:
                raise RemovedFromGroup(f"member {self.member_id}: epoch {newest.number} keeps it in the group, but its "
                                       f"admission in epoch {epoch.number} has no agreed op seq; restart it as a joiner")
            log.info("member %s: its admission in epoch %d was superseded before its op seq was agreed; waiting to be "
                     "added again", self.member_id, epoch.number)
            again = self.view.wait_for(lambda e: e.number > epoch.number and self.member_id in e.members
                                       and self.member_id in e.added, max(0.0, deadline - time.monotonic()))
            self.group = set(again.members)
            self.enter(again, first=True)

    def use_op_thread(self, submit: Callable[[Callable[[], None]], object],
                      queued: Callable[[], int] = lambda: 0) -> None:
        """``submit`` queues a function on the op thread (the transport's one user): the
        tree messages of an agreement seen while the op thread is idle go out through it
        (:meth:`_progress_agreement`, which gives the thread back as soon as ``queued()``
        says an op waits: the op's own waits progress the transport, so the tree's
        messages keep moving). Agreements announced before this are queued now."""
        self._on_op_thread = submit
        self._ops_queued = queued
        with self.lock:
            pending = [a for n, a in self.agreements.items() if n >= self.epoch.number and a.reduction is not None]
        for ag in pending:
            self._queue_progress(ag)

    def _queue_progress(self, ag: JoinAgreement) -> None:
        submit = self._on_op_thread
        if submit is None:
            return  # before use_op_thread: queued there
        try:
            submit(lambda: self._progress_agreement(ag))
        except Exception as exc:  # noqa: BLE001 - closed: nothing to progress for
            log.debug("join agreement of epoch %d not progressed: %s", ag.number, exc)

    def watch(self, *also: Callable[[EpochLike], None]) -> None:
        """From now on, :meth:`on_epoch` (then each of ``also``, e.g. the device route's)
        sees every epoch the view publishes."""
        unsubs = [self.view.subscribe(cb) for cb in (self.on_epoch, *also)]

        def unwatch() -> None:
            for u in unsubs:
                u()
        self._unwatch = unwatch

    def unwatch(self) -> None:
        """Stop :meth:`watch` (and the join side channel's handler); never raises (best
        effort on the way out)."""
        try:
            self._unwatch()
            if self.carrier is not None:
                self.carrier.drop_join(self._on_join_message)   # not a successor's (rebuild)
            if self._waiter is not None:
                self._waiter.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # -- membership -------------------------------------------------------------------

    def members(self) -> list[str]:
        return [m for m in self.epoch.members if m in self.group]

    def removes(self, e: EpochLike) -> bool:
        return self.member_id not in e.members or any(m not in e.members for m in self.members())

    def on_epoch(self, e: EpochLike) -> None:
        """Watch thread: abort the transport at once when an epoch removes a member."""
        if e.number > self.epoch.number and self.removes(e):
            self.aborted_at = time.time()
            self.transport.abort(f"epoch {e.number} removed {sorted(set(self.members()) - set(e.members))}")
        elif e.number > self.epoch.number:
            with self.lock:
                self.seen[e.number] = e
            try:
                self.announce(e)
            except Exception as exc:  # noqa: BLE001 - the op thread announces at its next boundary
                log.warning("could not announce op seq for epoch %d: %s", e.number, exc)

    def announce(self, e: EpochLike) -> int:
        """Publish (once per epoch) the first op seq this member has not started yet; from
        then on it starts no op of that seq or later in an older epoch. With a join side
        channel it goes into ``e``'s agreement tree (its messages leave from the op
        thread: a progress task is queued for it), else into this member's own key."""
        number = e.number
        with self.lock:
            if number in self.published:
                return self.published[number]
            self.published[number] = seq = self.seq
        if self.carrier is None:
            self.view.put_blob(number, "joinseq", json.dumps({"seq": seq}).encode())
            return seq
        if not old_members(e):
            return seq  # nobody was there before e: nothing to agree
        ag = self._agreement(e)
        if ag.reduction is None:
            return seq  # not an old member of e (e.g. a joiner of it): it only waits
        tree = ag.tree
        parent = tree.parent(self.member_id)
        self.carrier.join_links([*tree.children(self.member_id), *([parent] if parent is not None else [])])
        ag.contribute(seq)
        self._queue_progress(ag)
        self._settle(ag, seq)
        return seq

    # -- the join agreement over the data plane (see the module docstring) -------------------

    def _agreement(self, e: EpochLike) -> JoinAgreement:
        """``e``'s agreement at this member (made once; child messages that came before it
        are replayed into it)."""
        assert self.carrier is not None
        with self.lock:
            ag = self.agreements.get(e.number)
            if ag is None:
                ag = self.agreements[e.number] = JoinAgreement(self.view, e, self.member_id, _Up(self.carrier))
                for old in [n for n in self.agreements if n < self.epoch.number]:
                    del self.agreements[old]
            early = self._early.pop(e.number, {})
        for child, seq in early.items():
            ag.on_child(child, seq)
        return ag

    def _on_join_message(self, peer: str, number: int, seq: int) -> None:
        """The carrier's handler (the op thread, inside the transport's progress): a
        child's subtree maximum for epoch ``number``'s agreement."""
        with self.lock:
            ag = self.agreements.get(number)
            if ag is None:
                if number < self.epoch.number:
                    return  # an agreement this member is past
                if number not in self._early and len(self._early) >= _EARLY_EPOCHS:
                    raise ValueError(f"join messages for {len(self._early)} epochs this member has not seen; "
                                     f"refused the one for epoch {number}")
                self._early.setdefault(number, {})[peer] = seq
                return
        ag.on_child(peer, seq)

    def _progress_agreement(self, ag: JoinAgreement) -> None:
        """On the op thread: progress the transport until this member's part of ``ag``
        went out (its subtree is complete and its frame written), an op is queued behind
        this task (it progresses the transport itself: an op must never wait for an
        agreement its peers need that op to finish), the transport is aborted (an epoch
        removed a member), a newer epoch supersedes ``ag``'s, or ``epoch_timeout``
        passes. Never raises."""
        assert self.carrier is not None and ag.reduction is not None
        deadline = time.monotonic() + self.epoch_timeout
        try:
            while time.monotonic() < deadline and not self.transport.aborted and not self.transport.closed:
                if ag.reduction.done and not self.carrier.joins_pending() or self._ops_queued() > 0:
                    return
                newest = self.view.current()
                if newest is not None and newest.number > ag.number or self.epoch.number > ag.number:
                    return
                self.transport.idle(0.02)
        except Exception as exc:  # noqa: BLE001 - the op after it reports a broken transport
            log.debug("join agreement of epoch %d: %s", ag.number, exc)

    def _settle(self, ag: JoinAgreement, seq: int) -> Future[int]:
        """This old member's :meth:`JoinAgreement.settle` of ``ag`` (announced ``seq``), begun
        once, on the helper thread, when it announces: its fallback record goes out after
        ``join_stall`` seconds even while the op thread is inside an op."""
        with self.lock:
            fut = self._settling.get(ag.number)
            if fut is None:
                if self._waiter is None:
                    self._waiter = _DaemonWorker(f"resilient-join:{self.member_id}")
                fut = self._settling[ag.number] = self._waiter.submit(ag.settle, seq, self.join_stall,
                                                                       self.epoch_timeout)
                for old in [n for n in self._settling if n < self.epoch.number]:
                    del self._settling[old]
        return fut

    def _await_agreement(self, ag: JoinAgreement) -> int:
        """On the op thread: the agreed seq of ``ag`` (this old member's :meth:`_settle`),
        progressing the transport (the tree's messages) meanwhile. Raises what
        :meth:`JoinAgreement.settle` raises."""
        fut = self._settle(ag, self.published[ag.number])   # announced (adopt_growing) before this
        if fut.done() and not fut.cancelled() and fut.exception() is not None:
            # it ended (a newer epoch, a timeout): the boundary asks again, read afresh
            assert self._waiter is not None
            fut = self._waiter.submit(ag.wait, self.epoch_timeout)
        while not fut.done():
            if self.transport.aborted or self.transport.closed:
                time.sleep(0.005)  # the wait ends with the newer epoch (EpochChanged)
            else:
                self.transport.idle(0.01)
        return fut.result()

    def adopt_growing(self, e: EpochLike) -> None:
        """At an op boundary: agree with the group on the op seq at which the epoch ``e``
        (which removes no member of ours) takes effect — the largest seq any member
        announced — and adopt it there. Raises ``EpochChanged`` when a newer epoch
        supersedes ``e`` meanwhile, TimeoutError after ``epoch_timeout``."""
        self.announce(e)
        if self.carrier is not None:
            self.switch = (self._await_agreement(self._agreement(e)), e)
            return
        # every old member's own key, or covering records of tree members around them
        # (a job mixing both: join_agreement's rules b and c)
        self.switch = (wait_outcome(self.view, e, self.epoch_timeout), e)

    def enter(self, e: EpochLike, first: bool = False) -> None:
        """Adopt epoch ``e``: transport configured, epoch/world-size gauges set, and one
        membership recovery counted (cause from the epoch) when it removed members of ours."""
        if not first and e.number > self.epoch.number and self.removes(e):
            self._keep_agreed_switch(e, self.seq)   # the recovery path enters a removal here
        removed = set() if first else self.group - set(e.members)
        self.epoch = e
        self.group &= set(e.members)
        self.op_transport.configure(e.number, e.token, addresses_of(e))  # also forgets broken links of the old epoch
        self.set_metrics()
        if removed and self.member_id in e.members and self.metrics is not None:
            try:
                self.metrics.record_membership_recovery(cause_label(e))
            except Exception as exc:  # noqa: BLE001
                log.debug("metrics: %s", exc)
        newest = self.view.current()
        if newest is not None and newest.number > e.number and self.removes(newest):
            self.transport.abort(f"epoch {newest.number} superseded {e.number}")

    def set_metrics(self) -> None:
        if self.metrics is not None:
            try:
                self.metrics.set_epoch(self.epoch.number, len(self.members()))
            except Exception as exc:  # noqa: BLE001
                log.debug("metrics: %s", exc)

    def newer_than(self, number: int) -> Callable[[], int | None]:
        """For :class:`~.status_exchange.StatusExchange`: the number of an epoch newer than ``number``, if any."""
        def newer() -> int | None:
            cur = self.view.current()
            return cur.number if cur is not None and cur.number > number else None
        return newer

    def await_newer_epoch(self) -> EpochLike:
        """After a failed op: the next epoch (see the module docstring for the errors)."""
        deadline = time.monotonic() + self.epoch_timeout
        cur = self.epoch.number
        while True:
            e = self.view.current()
            if e is not None and e.number > cur:
                if self.member_id not in e.members:
                    raise removed_error(self.member_id, e,
                        f"member {self.member_id} was removed from the job in epoch {e.number} (its lease expired or it "
                        f"was evicted, e.g. after being stopped); it must not contribute to later ops — restart it as a joiner")
                return e
            left = deadline - time.monotonic()
            if left <= 0:
                if self.view.session_lost():
                    raise RemovedFromGroup(f"member {self.member_id} lost its lease and sees no newer epoch than {cur}")
                raise CollectiveError(f"a peer failed during an op but no new epoch was published within "
                                      f"{self.epoch_timeout}s (epoch {cur}); is the coordinator running?")
            try:
                self.view.wait_for(lambda e: e.number > cur, min(left, 1.0))
            except TimeoutError:
                pass

    # -- op boundaries ------------------------------------------------------------------

    def boundary(self, next_seq: int | None = None) -> bool:
        """Before an op (``next_seq``: its pre-reserved number): adopt newer epochs.
        Returns whether the op must start with a ledger-status exchange (an epoch removed
        a member)."""
        if self.view.session_lost() and self.member_id not in (self.view.current() or self.epoch).members:
            raise RemovedFromGroup(f"member {self.member_id} lost its lease; it is no longer in the job")
        nxt = self.seq if next_seq is None else next_seq
        while True:
            self._admit_kept(nxt)
            newest = self.view.current()
            if newest is None or newest.number <= self.epoch.number:
                break
            if self.member_id not in newest.members:
                raise removed_error(self.member_id, newest, f"member {self.member_id} is not in epoch {newest.number}: it was removed "
                                       "from the job (lease expired or evicted); restart it as a joiner")
            if self.removes(newest):
                self._keep_agreed_switch(newest, nxt)
                return True
            if self.switch is not None and self.switch[1].number <= self.epoch.number:
                break   # a switch kept through a removal, at a later op: _admit_kept applies it there
            if self.switch is None:
                # Growing epochs are adopted one by one, in order, each at the op seq the
                # group agreed for it: a member that reaches this boundary when a later
                # epoch is already out must still switch to an earlier one it announced
                # where the others do, else it runs an op in another epoch than they do.
                e = self._next_growing(newest)
                try:
                    self.adopt_growing(e)
                except EpochChanged:
                    continue
                except TimeoutError as exc:
                    raise CollectiveError(f"epoch {e.number} adds members but not every member announced its op "
                                          f"sequence number within {self.epoch_timeout}s: {exc}") from None
            assert self.switch is not None   # set by adopt_growing
            at, e = self.switch
            if nxt < at:
                break   # later epochs take effect no earlier (announcements only grow): at a later boundary
            self.switch = None
            self.admitted_at = max(self.admitted_at, at)
            self.group |= set(e.members)
            self.enter(e)
            self._forget_seen(e.number)
            self.set_metrics()
            log.info("member %s adopted epoch %d at op #%d (members %s)", self.member_id, e.number, self.seq,
                     list(e.members))
        return False

    def _keep_agreed_switch(self, newest: EpochLike, nxt: int) -> None:
        """A removal (``newest``) supersedes a growing epoch this member announced and has
        not adopted yet: its admission stands if its op seq was agreed — every member then
        admits the joiners still in ``newest`` at that seq, whichever path it took to get
        there (a member that adopted it before the removal has them in its group already)
        — and is dropped if not; the coordinator leaves the joiners out of a removal when
        their seq had not been agreed (``coordinator/decide.py``), so both cases give every
        member the same group (docs/recovery.md). The seq is read from etcd when this
        member had not computed it: a result there is final once ``newest`` is out. An
        admission whose result cannot be read (no result, a malformed record, etcd gone)
        is dropped, with a warning naming the joiners left out."""
        if self.switch is not None:
            at: int | None = self.switch[0]
            e = self.switch[1]
        else:
            with self.lock:
                pending = [self.seen[n] for n in sorted(self.seen)
                           if self.epoch.number < n < newest.number and self.member_id in self.seen[n].members]
            if not pending:
                return
            at, e = None, pending[0]
        joiners = (set(e.members) & set(newest.members)) - self.group
        if not joiners:
            self.switch = None
            return
        if at is None:
            try:
                at = wait_outcome(self.view, e, min(self.epoch_timeout, 10.0))
            except (EpochChanged, TimeoutError, RecordError) as exc:
                log.warning("member %s: epoch %d removed members while the admission of %s (epoch %d) had no agreed op "
                            "seq (%s); left out of the group", self.member_id, newest.number, sorted(joiners),
                            e.number, exc)
                self.switch = None
                return
        if self.switch != (at, e):   # called on the boundary and again on entering the removal
            log.info("member %s: the admission of %s (epoch %d, op #%d) stands through the removal of epoch %d",
                     self.member_id, sorted(joiners), e.number, at, newest.number)
        self.switch = (at, e)
        if nxt >= at:   # its op is next: they take part in it (an op in flight is recovered by its own members)
            self._admit(at, e, joiners)

    def _admit_kept(self, nxt: int) -> None:
        """At a boundary: apply a switch kept through a removal (:meth:`_keep_agreed_switch`;
        its epoch is older than ours) once ``nxt`` reaches its op: its joiners that are in
        our epoch join the group."""
        if self.switch is None:
            return
        at, e = self.switch
        if e.number > self.epoch.number or nxt < at:
            return
        joiners = (set(e.members) & set(self.epoch.members)) - self.group
        self._admit(at, e, joiners)
        self.set_metrics()
        log.info("member %s admitted %s of epoch %d at op #%d (in epoch %d)", self.member_id, sorted(joiners),
                 e.number, at, self.epoch.number)

    def _admit(self, at: int, e: EpochLike, joiners: set[str]) -> None:
        """The kept switch ``(at, e)`` takes effect: ``joiners`` join the group."""
        self.switch = None
        self.admitted_at = max(self.admitted_at, at)
        self.group |= joiners
        self._forget_seen(e.number)

    def _forget_seen(self, number: int) -> None:
        """Drop the delivered epochs up to ``number`` (adopted, or settled through a removal)."""
        with self.lock:
            for n in [n for n in self.seen if n <= number]:
                del self.seen[n]

    def _next_growing(self, newest: EpochLike) -> EpochLike:
        """The oldest epoch newer than ours, removing no member of ours, that the watch
        thread delivered (and so this member announced: the others may adopt it); else ``newest``."""
        with self.lock:
            for n in sorted(self.seen):
                e = self.seen[n]
                if self.epoch.number < n < newest.number and self.member_id in e.members and not self.removes(e):
                    return e
        return newest

    def reserve(self, seq: int | None, count: int) -> tuple[int, bool]:
        """The op's sequence number (``seq`` when pre-reserved, else the next ``count``
        taken at once) and whether it starts with a status exchange."""
        if seq is not None:
            return seq, self.boundary(next_seq=seq)
        while True:
            need_status = self.boundary()
            with self.lock:
                # an epoch announced (by the watch thread) after boundary looked: resolve it
                # first, this op must not start in the older epoch
                # (none while a switch is pending: that epoch takes effect after this op, and a
                # later one no earlier, as every member announces epochs in order)
                late = [n for n, v in self.published.items() if n > self.epoch.number and v <= self.seq
                        and self.switch is None]
                if need_status or not late:
                    seq = self.seq
                    self.seq += count
                    return seq, need_status
