"""``OpLoop``: run one op of a Communicator to completion — its sequence number and epoch
(:mod:`.epochs`), its layout (the op's :class:`~.ops.OpSpec`), the algorithm run, the
translation of what went wrong into the op's error (:mod:`.op_errors`) or into a recovery
(:mod:`.recovery_path`), and retiring the finished ledger (kept for a slower survivor,
the one before it released to the buffer pool).

Failure behaviour: a transport error or abort during the algorithm settles the ledger
and recovers the op in the next epoch (a rerun lays it out again over the survivors); a
foreign descriptor or a peer's ERROR frame raises the op's ``CollectiveError`` on every
member (:meth:`.op_errors.OpErrors.mismatch`); a link given up raises
:class:`~resilient.errors.PeerUnreachable` after telling the members beyond it; errors of
the epoch tracker and of the recovery path (``RemovedFromGroup``, ``CollectiveError``)
propagate. Runs on the op thread only (not thread-safe).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from resilient.collectives.algorithms.base import OpContext
from resilient.collectives.buffers import BufferPool
from resilient.collectives.epochs import EpochTracker
from resilient.collectives.ledger import Ledger
from resilient.collectives.op_errors import OpErrors
from resilient.collectives.op_metrics import OpMetrics
from resilient.collectives.ops import OpSpec, digest
from resilient.collectives.recovery import Policy
from resilient.collectives.recovery_path import Outcome, RecoveryPath
from resilient.device.routing import DeviceRoute
from resilient.errors import OpMismatch, PeerReportedError, PeerUnreachable, TransportAborted, TransportError
from resilient.kernels import ReduceOp
from resilient.transport.retrying import RetryingTransport

log = logging.getLogger(__name__)


class OpLoop:
    """The op loop of one Communicator (see the module docstring); ``on_suspect`` reports
    a peer that waits too long."""

    def __init__(self, member_id: str, op_transport: RetryingTransport, epochs: EpochTracker,
                 recovery: RecoveryPath, errors: OpErrors, buffers: BufferPool, metrics: OpMetrics,
                 op_timeout: float | None, on_suspect: Callable[[str, str], None], route: DeviceRoute) -> None:
        self.member_id, self.op_transport, self.epochs, self.recovery = member_id, op_transport, epochs, recovery
        self.errors, self.buffers, self.metrics = errors, buffers, metrics
        self.op_timeout, self.on_suspect, self.route = op_timeout, on_suspect, route

    def run(self, desc: dict[str, Any], spec: OpSpec, policy: Policy, ledger: bool, seq: int | None,
            reserve: int) -> Ledger:
        """Run one op (descriptor ``desc``) with recovery under ``policy``; returns its
        completed ledger. ``ledger``: keep the ledger's piece masks (off: a failure reruns
        the op). ``reserve`` > 1 takes that many sequence numbers at once (a compound op:
        no epoch is adopted inside it); the later ones run with ``seq`` given."""
        seq, need_status = self.epochs.reserve(seq, reserve)
        op, d = ReduceOp.parse(desc.get("op", "sum")), digest(desc)
        while True:
            members = self.epochs.members()
            epoch = self.epochs.epoch
            L, algo = spec.layout(members, members.index(self.member_id), seq, d, epoch)
            L.enabled = ledger
            tr = self.route.op_transport(L, epoch, self.op_transport)   # NCCL for device buffers when routed
            ctx = OpContext(tr, L, op, self.op_timeout, self.on_suspect, epoch.number)
            outcome = self._attempt(ctx, algo.run, seq, desc, policy, need_status)
            need_status = False
            if outcome == "done":
                break
        self._retire(L)
        return L

    def _attempt(self, ctx: OpContext, run: Callable[[OpContext], None], seq: int, desc: dict[str, Any],
                 policy: Policy, need_status: bool) -> Outcome:
        """One try at the op: a status exchange first when an epoch removed a member
        (``need_status``), else the algorithm, recovering when the transport fails."""
        try:
            if need_status:
                return self.recovery.recover(ctx, False, policy)
            try:
                run(ctx)
                return "done"
            except (OpMismatch, PeerReportedError):
                raise   # TransportErrors that are the op's error: below
            except (TransportError, TransportAborted) as exc:   # an abort is a cancellation signal
                ctx.settle()
                log.info("op #%d interrupted: %s", seq, exc)
                return self.recovery.recover(ctx, True, policy)
        except (OpMismatch, PeerReportedError) as exc:
            self.errors.mismatch(seq, desc, exc)
        except PeerUnreachable as exc:
            self.errors.unreachable(seq, exc.peer, str(exc))
            raise

    def _retire(self, L: Ledger) -> None:
        """Mark ``L`` complete, keep it as the retained ledger, release the one before it."""
        L.done = True
        if L.need is None:
            L.need = [L.full] * len(L.pieces)
        # reduce_scatter's kept input is a private concatenation, still valid: a member that
        # finished the op can still add its input to the others' chunks and stays a
        # contributor. allreduce's may be the caller's tensor (now the result) or a pooled
        # buffer released below: no input.
        L.has_input = L.kind == "reduce_scatter"
        prev, self.recovery.retained = self.recovery.retained, L
        if prev is not None:
            self.buffers.release(prev.out)  # nobody can need the op before the retained one
        self.buffers.release(L.inp)  # retained ledgers have no input (has_input=False)
        rep = self.recovery.last_report
        if rep is not None and rep.seq == L.seq:
            self.metrics.op_resumed(rep, L, len(self.epochs.members()))
