"""``RecoveryPath``: finish an op after an epoch removed members — the one recovery loop,
for the op a member is in (:meth:`RecoveryPath.recover`) and for the retained result of
its last op when it closes (:meth:`RecoveryPath.serve_retained`).

Each round: adopt the newest epoch, exchange ledger statuses with the survivors
(:mod:`.status_exchange`), then the lowest op any survivor is still in is finished from
the ledgers (:mod:`.resume`); a member already past it serves its retained ledger and
reruns its own op. A newer epoch or a transport abort during a round starts the next
round on the newer epoch.

Failure behaviour: a survivor whose status does not arrive within ``recovery_timeout``
raises :class:`~resilient.errors.CollectiveError` (``recover``) or ends the service
(``serve_retained``: best effort on the way out); a member the epoch removed gets
:class:`~resilient.errors.RemovedFromGroup`; mismatch errors propagate to the op loop.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal

from resilient.collectives import failpoints
from resilient.collectives.algorithms.base import OpContext
from resilient.collectives.epochs import EpochTracker
from resilient.collectives.eviction import removed_error
from resilient.collectives.group import EpochLike, GroupView
from resilient.collectives.ledger import Ledger, decode_status, encode_status
from resilient.collectives.recovery import Policy, RecoveryPlan, members_of
from resilient.collectives.recovery_decision import (Decision, RoundFacts, decode_decision, facts_of,
                                                     fatal_decisions, plan_decisions)
from resilient.collectives.recovery_report import RecoveryReport, Timeline
from resilient.collectives.resume import build_plan, execute_plan
from resilient.transport.retrying import RetryingTransport
from resilient.collectives.status_exchange import StatusExchange
from resilient.settings import Settings
from resilient.errors import CollectiveError, EpochChanged, TransportAborted, TransportError
from resilient.kernels import ReduceOp
from resilient.errors import OpMismatch, PeerReportedError
from resilient.transport.base import Transport

log = logging.getLogger(__name__)

Outcome = Literal["done", "rerun"]


@dataclass
class _Round:
    epoch: EpochLike
    survivors: list[str]
    xchg: StatusExchange
    facts: RoundFacts
    #: every survivor's validated summary (decode_status), or None: the planner decided
    statuses: dict[str, dict[str, Any]] | None
    decision: Decision | None   # this member's, from the planner (beyond direct_max survivors)
    wall_epoch: float
    t_status: float

    def plan(self, ledger: Ledger, policy: Policy) -> RecoveryPlan:
        """The recovery plan of ``ledger``'s op: built here from every summary, or this
        member's slice of the planner's (raises what :meth:`Decision.plan_for` raises)."""
        if self.statuses is not None:
            return build_plan(ledger, self.survivors, self.statuses, policy)
        assert self.decision is not None
        return self.decision.plan_for(ledger)


def _decode_all(raw: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    out = {}
    for m, v in raw.items():
        try:
            out[m] = decode_status(v)
        except CollectiveError as exc:
            raise CollectiveError(f"the ledger summary of {m}: {exc}") from None
    return out


class RecoveryPath:
    def __init__(self, view: GroupView, transport: Transport, op_transport: RetryingTransport,
                 epochs: EpochTracker, op_timeout: float | None, recovery_timeout: float,
                 on_suspect: Callable[[str, str], None]) -> None:
        self.view, self.transport, self.op_transport, self.epochs = view, transport, op_transport, epochs
        self.op_timeout, self.recovery_timeout = op_timeout, recovery_timeout
        self.on_suspect = on_suspect
        self.member_id = view.member_id
        settings = Settings.from_env()
        #: the ledger summaries' etcd path: from the start up to this many survivors, else a fallback
        self.ledger_etcd_max, self.ledger_etcd_after = settings.ledger_etcd_max, settings.ledger_etcd_after
        #: up to this many survivors each gets every summary; beyond, a tree to one planner
        self.ledger_direct_max, self.ledger_tree_fanout = settings.ledger_direct_max, settings.ledger_tree_fanout
        self.status_epoch = epochs.epoch.number   # the newest epoch whose status exchange this member finished
        self.retained: Ledger | None = None       # the completed ledger of this member's last op
        self.last_report: RecoveryReport | None = None

    # -- one round ------------------------------------------------------------------------

    def _round(self, e: EpochLike, ledger: Ledger | None, members: tuple[str, ...], timeout: float,
               policy: Policy, next_seq: int | None = None) -> _Round | None:
        """Adopt ``e`` and exchange statuses; None when a newer epoch or an abort
        interrupted the exchange (start again). TimeoutError propagates; a malformed
        summary or decision raises CollectiveError. As the planner (the first survivor,
        beyond ``direct_max`` survivors) this member plans with ``ledger`` or its retained
        ledger, whichever is of the op to finish, under ``policy``."""
        self.epochs.enter(e)
        survivors = [m for m in e.members if m in members]
        wall_epoch = time.time()
        retained = self.retained

        def decide(raw: dict[str, bytes]) -> dict[str, bytes]:
            if failpoints.ACTIVE:
                op = ledger if ledger is not None else retained
                failpoints.check(op.seq if op is not None else -1, "plan", 0.0, e.number)
            try:
                statuses = _decode_all(raw)
            except CollectiveError as exc:
                return fatal_decisions(survivors, str(exc))
            return plan_decisions(survivors, statuses, [ledger, retained], policy, build_plan)

        xchg = StatusExchange(self.view, self.op_transport, e.number, survivors, self.member_id,
                              encode_status(self.member_id, ledger, retained, next_seq,
                                            policy.value if ledger is not None else None),
                              self.ledger_etcd_max, self.ledger_etcd_after, self.ledger_direct_max,
                              self.ledger_tree_fanout)
        try:
            got = xchg.run(timeout, self.epochs.newer_than(e.number), decide)
        except EpochChanged:
            return None
        except TransportAborted as exc:  # an epoch removed another member meanwhile
            log.info("ledger-status exchange in epoch %d interrupted: %s", e.number, exc)
            return None
        self.status_epoch = e.number
        if got.summaries is not None:
            statuses = _decode_all(got.summaries)
            return _Round(e, survivors, xchg, facts_of(statuses), statuses, None, wall_epoch, time.monotonic())
        assert got.decision is not None
        d = decode_decision(got.decision, self.member_id)
        return _Round(e, survivors, xchg, d.facts, None, d, wall_epoch, time.monotonic())

    def _finish(self, ledger: Ledger, r: _Round, op: ReduceOp, policy: Policy) -> dict[str, float]:
        ctx = OpContext(self.op_transport, ledger, op, self.op_timeout, self.on_suspect, r.epoch.number)
        return execute_plan(ctx, r.plan(ledger, policy))

    # -- the op this member is in -----------------------------------------------------------

    def recover(self, ctx: OpContext, awaiting: bool, policy: Policy) -> Outcome:
        """Finish (``"done"``) or ask to rerun (``"rerun"``) ``ctx``'s op under the op's
        ``policy``; see :mod:`.resume`. ``awaiting``: the op failed, so wait for an epoch
        newer than the current one (else start from the newest published)."""
        L = ctx.ledger
        L.ready_input()   # a lazily written input (the compressed ring's q) is read from here on
        t0 = time.monotonic()
        wall0 = time.time()
        sent0, retries0 = self.transport.stats.bytes_sent, self.op_transport.retries
        while True:
            newest = self.view.current()
            if awaiting or newest is None or newest.number <= self.epochs.epoch.number:
                e = self.epochs.await_newer_epoch()
            else:
                e = newest
            awaiting = True
            if self.member_id not in e.members:
                raise removed_error(self.member_id, e, f"member {self.member_id} is not in epoch {e.number}: removed from the job")
            try:
                r = self._round(e, L, L.members, self.recovery_timeout, policy)
            except TimeoutError as exc:
                raise CollectiveError(f"op #{L.seq}: recovery in epoch {e.number} did not get every survivor's "
                                      f"ledger: {exc}") from None
            if r is None:
                continue
            ctx.epoch = e.number
            k = L.seq if r.facts.lowest is None else r.facts.lowest
            try:
                if L.seq > k or r.facts.not_started(L.seq):
                    R = self.retained
                    if R is not None and R.seq == k:
                        self._finish(R, r, ctx.op, policy)
                    r.xchg.wait_published()
                    return "rerun"
                if not r.facts.progressed(L.seq):
                    r.xchg.wait_published()
                    return "rerun"
                plan = r.plan(L, policy)
                t_plan = time.monotonic()
                exec_stats = execute_plan(ctx, plan)
            except (OpMismatch, PeerReportedError):
                raise
            except (TransportError, TransportAborted) as exc:   # an abort is a cancellation signal
                ctx.settle()
                log.info("recovery of op #%d interrupted: %s", L.seq, exc)
                continue
            L.need = plan.need
            t_end = time.monotonic()
            stats = dict(exec_stats)
            self.last_report = RecoveryReport(
                seq=L.seq, epoch=e.number, seconds=t_end - t0, status_s=r.t_status - t0, plan_s=t_plan - r.t_status,
                execute_s=t_end - t_plan, rounds=len(plan.rounds), transfers=plan.transfer_count(),
                bytes_sent=self.transport.stats.bytes_sent - sent0, link_retries=self.op_transport.retries - retries0,
                contributors=members_of(plan.need[0], L.members) if plan.need else [],
                timeline=Timeline(aborted=self.epochs.aborted_at, entered=wall0, epoch=r.wall_epoch,
                                  statuses=wall0 + (r.t_status - t0), done=time.time()),
                wait_recv_s=stats.pop("wait_recv_s", 0.0), wait_send_s=stats.pop("wait_send_s", 0.0),
                reduce_s=stats.pop("reduce_s", 0.0), plan_from="summaries" if r.statuses is not None else "planner",
                extra=stats)
            r.xchg.wait_published()   # observers (tests, bench/recovery.py) read it from etcd, at small scale
            return "done"

    # -- between ops: a point-to-point op that finds the epoch moved ---------------------------

    def catch_up(self, policy: Policy) -> None:
        """Outside any collective (the torch backend's point-to-point): adopt the newest
        epoch as a collective's boundary would. A growing epoch is adopted by
        :meth:`.epochs.EpochTracker.boundary`; one that removed members of ours is entered
        with its ledger-status round among the survivors (which the survivors' next
        collectives would otherwise wait for), finishing our retained op from its result
        when a survivor is still in it. Returns at once when the epoch did not move.
        Failure behaviour: a survivor whose status does not arrive within
        ``recovery_timeout`` -> :class:`~resilient.errors.CollectiveError` naming the epoch
        (the survivor runs no op: every survivor must reach some op for the group to move
        on); this member removed -> RemovedFromGroup; an aborted transport with no newer
        epoch within ``epoch_timeout`` -> CollectiveError (from ``await_newer_epoch``)."""
        while True:
            if not self.epochs.boundary():
                if not self.transport.aborted:
                    return
                self.epochs.await_newer_epoch()  # aborted by an epoch not visible yet
                continue
            e = self.view.current()
            if e is None:
                continue
            if self.member_id not in e.members:
                raise removed_error(self.member_id, e, f"member {self.member_id} is not in epoch {e.number}: removed from the job")
            R = self.retained
            try:
                r = self._round(e, None, R.members if R is not None else tuple(self.epochs.members()),
                                self.recovery_timeout, policy, next_seq=self.epochs.seq)
            except TimeoutError as exc:
                raise CollectiveError(f"epoch {e.number}: the survivors' ledger statuses did not all arrive within "
                                      f"{self.recovery_timeout}s (a survivor that issues no op holds the group "
                                      f"back): {exc}") from None
            if r is None:
                continue
            if R is not None and r.facts.lowest == R.seq:
                self._finish(R, r, ReduceOp.SUM, policy)
            r.xchg.wait_published()
            return

    # -- the retained result, on the way out --------------------------------------------------

    def may_need_retained(self) -> bool:
        """Whether a recovery of our last op may be waiting for our retained result: an
        epoch newer than our last ledger-status exchange removes a member (the condition
        under which :meth:`serve_retained` joins a round)."""
        return self.retained is not None and self._wants_round(self.view.current())

    def _wants_round(self, e: EpochLike | None, cut: bool = False) -> bool:
        """Whether epoch ``e`` calls this member into a round for its retained result: newer
        than its last status exchange, with it a member, and removing a member (or any
        newer epoch after a round was ``cut`` short)."""
        return (e is not None and e.number > self.status_epoch and self.member_id in e.members
                and (cut or self.epochs.removes(e)))

    def serve_retained(self, linger: float, policy: Policy) -> bool:
        """Join a recovery of our last op from its retained result (``Communicator.close``;
        ``policy``: the communicator's default); True when this member took part in one.
        Best effort: never raises, a failure is logged (the peers then recover without
        this member)."""
        R = self.retained
        if R is None:
            return False
        try:
            return self._serve(R, linger, policy)
        except (Exception, EpochChanged, TransportAborted) as exc:  # noqa: BLE001 - best effort on the way out
            log.info("close: serving the retained result of op #%s failed: %s", R.seq, exc)
            return False

    def _serve(self, R: Ledger, linger: float, policy: Policy) -> bool:
        end = time.monotonic() + linger
        # a round cut short by a newer epoch: the survivors go on in that epoch whatever it
        # changes (their op's members are R's, not the group we narrowed to on entering)
        cut = False
        while True:
            e = self.view.current()
            if not self._wants_round(e, cut):
                if time.monotonic() >= end:
                    return False
                try:
                    self.view.wait_for(lambda x: x.number > max(self.status_epoch, self.epochs.epoch.number),
                                       max(0.01, end - time.monotonic()))
                except TimeoutError:
                    return False
                continue
            assert e is not None   # _wants_round
            try:
                r = self._round(e, None, R.members, max(1.0, end - time.monotonic()), policy)
            except TimeoutError:
                return False
            if r is None:
                cut = True
                continue
            if r.facts.lowest == R.seq:
                self._finish(R, r, ReduceOp.SUM, policy)
                return True
            return False
