"""``Communicator``: resumable collectives over an abortable transport (docs/design.md §3).

The facade: the public API, the op loop with error translation, close. Its parts:
:mod:`.epochs` (which epoch an op runs in), :mod:`.ops` (one spec per collective: input
checks, layout, result), :mod:`.algorithms.select` (which algorithm),
:mod:`.recovery_path` (finishing an op after a failure), :mod:`.op_errors` /
:mod:`.error_frame` (what one member tells the others when it gives up an op),
:mod:`.buffers`, :mod:`.op_metrics`, :mod:`.p2p`.

Every op has a sequence number; all members call ops in the same order. Ops run one at a
time on a private thread (``async_op=True`` returns a :class:`~.work.Work`). The op's
input is copied first (the API is in place; the copy is the ledger's kept input) and the
result is written back at the end. Algorithms: recursive doubling up to ``small_bytes``,
else the pipelined ring (slices of ``slice_bytes``); broadcast is a pipelined chain plus a
tiny barrier.

Failure behaviour:

* a peer dies / hangs: the coordinator publishes an epoch without it; our epoch callback
  aborts the transport (every blocked send/recv returns at once), the op's ledger is
  settled and :mod:`.resume` finishes the op with the survivors. ``contributors`` tells
  the exact set. A wait longer than ``op_timeout`` reports the peer as *suspect* (the
  coordinator confirms by lease state) and keeps waiting.
* a link fails but no member died (reset connection, dropped link): the peer is reported
  as suspect and the transfer is re-posted with backoff on the same epoch
  (:mod:`.retry`); a link down longer than ``op_timeout`` raises
  :class:`~.retry.PeerUnreachable` (a CollectiveError naming the peer) on this member and,
  through an ERROR frame, on the others.
* this member was removed (SIGSTOPped past its TTL, evicted): every op raises
  :class:`~resilient.errors.RemovedFromGroup`; nothing it holds is sent to survivors
  (new epoch token in the handshake, epoch number in every frame).
* ranks disagree on kind/shape/dtype/op/root at one sequence number: every rank raises
  :class:`~resilient.errors.InputMismatch` (a descriptor digest in every frame header;
  the rank that sees a foreign digest sends an ERROR frame to all); the op is cancelled
  on the transport and the communicator stays usable.
* ``strict`` policy: :class:`~resilient.errors.CollectiveAborted` when the full set
  cannot be delivered; broadcast/allgather: :class:`~resilient.errors.DataLost` naming
  the member whose piece exists nowhere.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any, Callable, Sequence

import torch

from resilient.collectives.algorithms.base import OpContext
from resilient.collectives.algorithms.leaf_deadline import drain
from resilient.collectives.algorithms.select import Sizing
from resilient.collectives.buffers import BufferPool
from resilient.collectives.comm_settings import CommSettings
from resilient.collectives.compressed import Compression, run_compressed
from resilient.collectives.compression_switch import CompressionSwitch, run_auto
from resilient.collectives.epochs import EpochTracker
from resilient.collectives.eviction import await_readmission
from resilient.collectives.group import EpochLike, GroupView
from resilient.collectives.ledger import Ledger
from resilient.collectives.op_errors import OpErrors
from resilient.collectives.op_metrics import OpMetrics
from resilient.collectives.ops import (
    AllgatherOp, AllreduceOp, BroadcastOp, OpResult, OpSpec, ReduceScatterOp, as_tensor, describe, digest,
    on_device, result_of,
)
from resilient.collectives.p2p import PointToPoint
from resilient.collectives.recovery import Policy
from resilient.collectives.recovery_path import RecoveryPath
from resilient.collectives.recovery_report import RecoveryReport
from resilient.transport.retrying import RetryingTransport
from resilient.collectives.work import Work
from resilient.errors import (
    ClosedError, ConfigError, EpochChanged, OpMismatch, PeerReportedError, PeerUnreachable, TransportAborted,
    TransportError,
)
from resilient.kernels import ReduceOp
from resilient.settings import Settings
from resilient.transport.base import Transport

log = logging.getLogger(__name__)

__all__ = ["Communicator", "CommSettings", "OpResult"]


class Communicator:
    def __init__(self, view: GroupView, transport: Transport, *, policy: Policy | str = Policy.DEFAULT,
                 op_timeout: float | None = 30.0, small_bytes: int = 64 << 10, slice_bytes: int = 2 << 20,
                 max_slices: int = 64, recovery_timeout: float = 300.0, epoch_timeout: float = 60.0,
                 ledger: bool = True, joining: bool | None = None, health_reporter: Any = None,
                 metrics: Any = None, hierarchical: bool = True, staging: bool | None = None) -> None:
        """``staging``: run CPU tensors through the host-staged data path CUDA tensors take
        (:mod:`.staged`; default ``RESILIENT_STAGING``, off). CUDA tensors always take it."""
        self.view, self.transport, self.member_id = view, transport, view.member_id
        staging = Settings.from_env().staging if staging is None else bool(staging)
        self.settings = CommSettings(policy, op_timeout, small_bytes, slice_bytes, max_slices, recovery_timeout,
                                     epoch_timeout, ledger, health_reporter, metrics, hierarchical, staging)
        self.policy = Policy.parse(policy)
        self.op_timeout, self.epoch_timeout, self.ledger_enabled = op_timeout, epoch_timeout, ledger
        self.sizing = Sizing(small_bytes, slice_bytes, max_slices, hierarchical, staging)
        self.metrics = OpMetrics(metrics, health_reporter)
        # ops post through this: a failed link to a live member is retried (issue 5)
        self._op_transport = RetryingTransport(transport, give_up_s=op_timeout, on_suspect=self._suspect,
                                               is_member=lambda peer: peer in self._epochs.epoch.members,
                                               is_alive=view.peer_alive, dead_wait_s=epoch_timeout)
        self._epochs = EpochTracker(view, transport, self._op_transport, epoch_timeout, metrics)
        self._recovery = RecoveryPath(view, transport, self._op_transport, self._epochs, lambda: self.policy,
                                      op_timeout, recovery_timeout, self._suspect)
        self._epochs.start(joining)
        self._errors = OpErrors(self.member_id, transport, self._op_transport, self._epochs.members)
        self._p2p = PointToPoint(self)
        self._buffers = BufferPool()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"resilient-ops:{self.member_id}")
        self._unsub = view.subscribe(self._epochs.on_epoch)
        self.last_compression: dict[str, Any] | None = None  # scales/q of the last compressed op
        self.compression_switch: CompressionSwitch | None = None  # compression="auto" (compression_switch.py)
        self._closed = False

    # -- public API ---------------------------------------------------------------------

    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False,
                  policy: Policy | str | None = None, compression: Any = None) -> Work:
        """``compression``: None (exact float sum), ``"q8"``/``"q4"``/``"q2"``, ``"auto"``
        or a :class:`~.compressed.Compression` (``auto=True``: the measured-link switch of
        :mod:`.compression_switch`): the exact quantized allreduce of ``docs/compression.md``."""
        t = as_tensor(tensor, "allreduce tensor")
        rop = ReduceOp.parse(op)
        nbytes = t.numel() * t.element_size()
        comp = Compression.parse(compression) if compression is not None else None
        if comp is not None and t.device.type != "cpu":
            raise ConfigError(f"compressed allreduce of a tensor on {t.device}: the codec runs on the CPU; "
                              "pass compression=None (exact, host-staged) or a CPU tensor")
        segs = comp.layout(t) if comp is not None else None
        if comp is not None and segs is not None:
            body = run_auto if comp.auto else run_compressed
            return self._submit(lambda: body(self, t, rop, comp, segs, policy), async_op, "allreduce", nbytes)
        desc = describe("allreduce", t, op=rop.value)
        return self._submit(on_device(t, lambda: self.reduce_now(t, rop, desc, policy)), async_op, "allreduce", nbytes)

    def reduce_scatter(self, output: Any, inputs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM,
                       async_op: bool = False, policy: Policy | str | None = None) -> Work:
        out = as_tensor(output, "reduce_scatter output")
        ins = [as_tensor(x, f"reduce_scatter input {i}") for i, x in enumerate(inputs)]
        rop = ReduceOp.parse(op)
        desc = describe("reduce_scatter", out, op=rop.value, n=len(ins))
        return self._submit(on_device(out, lambda: self._collective(desc, lambda: ReduceScatterOp(
            out, ins, rop, self.size, self.sizing, self._errors.require_group_of), policy)), async_op,
            "reduce_scatter", sum(x.numel() * x.element_size() for x in ins))

    def allgather(self, outputs: Sequence[Any], tensor: Any, async_op: bool = False) -> Work:
        t = as_tensor(tensor, "allgather tensor")
        outs = [as_tensor(x, f"allgather output {i}") for i, x in enumerate(outputs)]
        desc = describe("allgather", t, n=len(outs))
        return self._submit(on_device(t, lambda: self._collective(desc, lambda: AllgatherOp(
            outs, t, self.size, self.sizing, self._errors.require_group_of))), async_op,
            "allgather", t.numel() * t.element_size() * len(outs))

    def broadcast(self, tensor: Any, root: int = 0, async_op: bool = False) -> Work:
        t = as_tensor(tensor, "broadcast tensor")
        desc = describe("broadcast", t, root=int(root))
        return self._submit(on_device(t, lambda: self._collective(desc, lambda: BroadcastOp(
            t, int(root), self.members, self.sizing))), async_op, "broadcast", t.numel() * t.element_size())

    def barrier(self, async_op: bool = False) -> Work:
        t = torch.zeros(1, dtype=torch.int32)
        return self._submit(lambda: self.reduce_now(t, ReduceOp.SUM, {"k": "barrier"}, None), async_op, "barrier")

    def send(self, tensor: Any, dst: int, tag: int = 0, async_op: bool = False) -> Work:
        """Send to rank ``dst`` of the live group (:mod:`.p2p`: matched in program order per
        pair, carried across an epoch change; ``tensor`` unchanged until the Work is done)."""
        work = self._p2p.send(as_tensor(tensor, "send tensor"), int(dst), int(tag))
        if not async_op:
            work.wait()
        return work

    def recv(self, tensor: Any, src: int, tag: int = 0, async_op: bool = False) -> Work:
        """Receive from rank ``src`` into ``tensor`` (see :meth:`send` and :mod:`.p2p`)."""
        work = self._p2p.recv(as_tensor(tensor, "recv tensor"), int(src), int(tag))
        if not async_op:
            work.wait()
        return work

    @property
    def members(self) -> list[str]:
        return self._epochs.members()

    @property
    def rank(self) -> int:
        return self.members.index(self.member_id)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def next_seq(self) -> int:
        """The sequence number the next collective will get (a joiner starts at the
        group's; all members call ops in the same order)."""
        return self._epochs.seq

    @property
    def hierarchical(self) -> bool:
        """Whether ops run by host groups when the plan has them (settable between ops,
        the same on every member)."""
        return self.sizing.hierarchical

    @hierarchical.setter
    def hierarchical(self, on: bool) -> None:
        self.sizing = replace(self.sizing, hierarchical=on)

    @property
    def epoch(self) -> EpochLike:
        """The epoch the next op starts in (until a newer one is adopted at its boundary)."""
        return self._epochs.epoch

    @property
    def last_recovery(self) -> RecoveryReport | None:
        """What the last op finished by recovery did (None before any)."""
        return self._recovery.last_report

    @property
    def retained(self) -> Ledger | None:
        """The completed ledger of this member's last op (kept for a slower survivor)."""
        return self._recovery.retained

    def rejoin(self, timeout: float | None = None) -> "Communicator":
        """After :class:`~resilient.errors.Evicted` (``--straggler-policy evict``): close
        this Communicator, ask the coordinator to re-admit this member, wait (at most
        ``timeout`` s; default: until the published re-admission time + ``epoch_timeout``)
        for the epoch that has it again and return a **new** Communicator (same view,
        transport and settings, built with ``joining=True``) whose first op is the group's
        next one (``next_seq``). Use it as ``comm = comm.rejoin()``. Raises TimeoutError
        if not re-admitted in time (call again to keep waiting), RemovedFromGroup if the
        lease is gone, ConfigError if this member was not evicted
        (:mod:`resilient.collectives.eviction`)."""
        self.close()
        await_readmission(self.view, self.transport, self.epoch.number, self.epoch_timeout, timeout)
        return self._successor()

    def _successor(self) -> "Communicator":
        """The Communicator :meth:`rejoin` returns (same view, transport and settings,
        ``joining=True``); a subclass that owns more (``resilient.connect``'s) hands it on."""
        return Communicator(self.view, self.transport, joining=True, **self.settings.as_kwargs())

    def adopt_buffer_pool(self, old: "Communicator") -> None:
        """Take over the free pooled buffers of ``old`` (the closed Communicator this one
        replaces when joiners are admitted: ``CommunicatorEngine.rebuild``), so the first
        ops after an admission reuse memory already faulted in instead of allocating it
        again (resilient/elastic admission cost). ``old`` keeps none; never raises."""
        self._buffers.adopt(old._buffers)

    def run_on_op_thread(self, fn: Callable[[], OpResult], async_op: bool = True) -> Any:
        """Run ``fn`` on the op thread, after the ops queued before it, as an op of its own
        (a :class:`Work`; ``fn``'s exception fails it). The transport has one user at a
        time, this thread: this is how a caller outside this class drives it (the
        point-to-point ops, :mod:`.p2p`)."""
        return self._submit(fn, async_op)

    def catch_up(self) -> None:
        """Op thread only (inside :meth:`run_on_op_thread`): adopt the newest epoch between
        ops, as the next collective would (:meth:`.recovery_path.RecoveryPath.catch_up`,
        whose errors it raises). The point-to-point ops (:mod:`.p2p`) call it when the
        epoch moved under a send/recv, so the transport runs again between live peers."""
        self._recovery.catch_up()

    def close(self, linger: float = 0.0, leave: bool = False) -> None:
        """Finish the queued ops, then make leaving safe for the peers.

        A peer may still be finishing our last op after a failure and need our kept
        result: if an epoch that removes a member is already published (or arrives within
        ``linger`` seconds), this member first takes part in that recovery from its
        retained result (:meth:`.recovery_path.RecoveryPath.serve_retained`). With
        ``leave=True`` it then ends its membership (revokes its lease through the group
        view), so peers that would need it later see an epoch change at once instead of
        waiting for it. Never raises for a failed peer; bounded by ``linger`` + one
        recovery. Under the deadline straggler policy a parent first waits (at most
        ``op_timeout``) until its leaves finished the last op (they may lag by one:
        ``algorithms/leaf_deadline.drain``)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        drain(self._op_transport, self.epoch.number, max(linger, self.op_timeout or 30.0))
        try:
            self._recovery.serve_retained(linger)
        except (Exception, EpochChanged, TransportAborted) as exc:  # noqa: BLE001 - best effort on the way out
            log.info("close: serving the retained result of op #%s failed: %s",
                     self.retained.seq if self.retained else None, exc)
        try:
            self._unsub()
        except Exception:  # noqa: BLE001
            pass
        if leave:
            try:
                self.view.leave("closed")
            except Exception as exc:  # noqa: BLE001
                log.info("close: leaving failed (the lease TTL removes this member): %s", exc)

    # -- op bodies (op thread; reduce_now / run_op / take_buffer also serve compressed.py) ----

    def _collective(self, desc: dict[str, Any], make: Callable[[], ReduceScatterOp | AllgatherOp | BroadcastOp],
                    policy: Policy | str | None = None) -> OpResult:
        spec = make()   # on the op thread: the group it checks against is the op's
        return spec.finish(self.run_op(desc, spec, policy=policy))

    def reduce_now(self, t: torch.Tensor, op: ReduceOp, desc: dict[str, Any], policy: Policy | str | None,
                   reserve: int = 1, seq: int | None = None) -> OpResult:
        """Run one allreduce of ``t`` in place on the op thread (``reserve``/``seq``: see :meth:`run_op`)."""
        spec = AllreduceOp(str(desc["k"]), t, op, self._buffers, self.sizing)
        return spec.finish(self.run_op(desc, spec, policy=policy, seq=seq, reserve=reserve))

    def take_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pooled flat buffer for a ledger's output (released when the ledger is dropped)."""
        return self._buffers.take(numel, dtype)

    result_of = staticmethod(result_of)

    def run_op(self, desc: dict[str, Any], spec: OpSpec, policy: Policy | str | None = None,
               seq: int | None = None, reserve: int = 1) -> Ledger:
        """Run one op with recovery; returns its completed ledger. ``reserve`` > 1 takes
        that many sequence numbers at once (a compound op: no epoch is adopted inside it);
        the later ones run with ``seq`` given. ``policy``: this op's recovery policy."""
        old = self.policy
        if policy is not None:
            self.policy = Policy.parse(policy)
        try:
            return self._run(desc, spec, seq, reserve)
        finally:
            self.policy = old

    def _run(self, desc: dict[str, Any], spec: OpSpec, seq: int | None, reserve: int) -> Ledger:
        seq, need_status = self._epochs.reserve(seq, reserve)
        op, d = ReduceOp.parse(desc.get("op", "sum")), digest(desc)
        while True:
            members = self.members
            L, algo = spec.layout(members, members.index(self.member_id), seq, d, self.epoch)
            L.enabled = self.ledger_enabled
            ctx = OpContext(self._op_transport, L, op, self.op_timeout, self._suspect, self.epoch.number)
            try:
                if need_status:
                    need_status = False
                    outcome = self._recovery.recover(ctx, awaiting=False)
                else:
                    try:
                        algo.run(ctx)
                        outcome = "done"
                    except (OpMismatch, PeerReportedError) as exc:
                        self._errors.mismatch(seq, desc, exc)
                    except (TransportError, TransportAborted) as exc:   # an abort is a cancellation signal
                        ctx.settle()
                        log.info("op #%d interrupted: %s", seq, exc)
                        outcome = self._recovery.recover(ctx, awaiting=True)
            except (OpMismatch, PeerReportedError) as exc:
                self._errors.mismatch(seq, desc, exc)
            except PeerUnreachable as exc:
                self._errors.unreachable(seq, exc.peer, str(exc))
                raise
            if outcome == "done":
                break
        L.done = True
        if L.need is None:
            L.need = [L.full] * len(L.pieces)
        # reduce_scatter's kept input is a private concatenation, still valid: a member that
        # finished the op can still add its input to the others' chunks and stays a
        # contributor. allreduce's may be the caller's tensor (now the result) or a pooled
        # buffer released below: no input.
        L.has_input = L.kind == "reduce_scatter"
        prev, self._recovery.retained = self._recovery.retained, L
        if prev is not None:
            self._buffers.release(prev.out)  # nobody can need the op before the retained one
        self._buffers.release(L.inp)  # retained ledgers have no input (has_input=False)
        rep = self.last_recovery
        if rep is not None and rep.seq == L.seq:
            self.metrics.op_resumed(rep, L, self.size)
        return L

    # -- plumbing -----------------------------------------------------------------------

    def _submit(self, fn: Callable[[], Any], async_op: bool, kind: str = "", nbytes: int = 0) -> Work:
        if self._closed:
            raise ClosedError("the communicator is closed: build a new Communicator (or resilient.connect())")
        body = fn
        if kind:
            def body() -> Any:
                t0 = time.monotonic()
                res = fn()
                self.metrics.op_finished(kind, time.monotonic() - t0, nbytes, self.epoch.number)
                return res
        fut: Future[Any] = self._pool.submit(body)
        work = Work(fut)
        if not async_op:
            fut.result()
        return work

    def _suspect(self, peer: str, reason: str) -> None:
        try:
            self.view.report_suspect(peer, reason)
        except Exception as exc:  # noqa: BLE001 - the report is advisory
            log.warning("could not report %s as suspect: %s", peer, exc)
