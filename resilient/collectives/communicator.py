"""``Communicator``: resumable collectives over an abortable transport (docs/design.md §3).

The facade: the public API and the wiring of its parts: :mod:`.op_thread` (ops one at a
time on a private thread), :mod:`.op_loop` (one op to completion, its errors translated),
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
  :class:`~resilient.errors.InputMismatch` (a descriptor digest in every frame header,
  and a probe of the peers' current op when a wait lasts: no data between them needed;
  the rank that sees a foreign digest sends an ERROR frame to all); the op is cancelled
  on the transport and the communicator stays usable.
* ``strict`` policy: :class:`~resilient.errors.CollectiveAborted` when the full set
  cannot be delivered; broadcast/allgather: :class:`~resilient.errors.DataLost` naming
  the member whose piece exists nowhere.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from resilient.collectives.algorithms.leaf_deadline import drain
from resilient.collectives.algorithms.select import Sizing
from resilient.collectives.buffers import BufferPool
from resilient.collectives.comm_settings import CommSettings
from resilient.collectives.compression_switch import CompressionSwitch, compressed_body
from resilient.collectives.epochs import EpochTracker
from resilient.collectives.eviction import await_readmission
from resilient.collectives.group import EpochLike, GroupView
from resilient.collectives.ledger import Ledger
from resilient.collectives.op_errors import OpErrors
from resilient.collectives.op_loop import OpLoop
from resilient.collectives.op_metrics import OpMetrics
from resilient.collectives.op_thread import OpThread
from resilient.collectives.ops import (
    AllgatherOp, AllreduceOp, BroadcastOp, OpResult, OpSpec, ReduceScatterOp, as_tensor, describe, on_device,
)
from resilient.collectives.p2p import PointToPoint
from resilient.collectives.recovery import Policy
from resilient.collectives.recovery_path import RecoveryPath
from resilient.collectives.recovery_report import RecoveryReport
from resilient.transport.retrying import RetryingTransport
from resilient.collectives.work import Work
from resilient.device.routing import DeviceRoute, ErrorsToNccl, default_route
from resilient.errors import ConfigError
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
                 metrics: Any = None, hierarchical: bool = True, staging: bool | None = None,
                 device_route: DeviceRoute | None = None, shm_direct: bool | None = None) -> None:
        """``shm_direct``: CPU allreduces between members of one host take the direct
        shared-memory algorithm (:mod:`.algorithms.shm_direct`; default
        ``RESILIENT_SHM_DIRECT``, on; ``0`` there or ``False`` here: the ring). ``staging``: run CPU tensors through the host-staged data path CUDA tensors take
        (:mod:`.staged`; default ``RESILIENT_STAGING``, off). CUDA tensors take it unless
        the epoch's members each have their own GPU: then ``device_route`` (default: over
        this view's epoch data, :func:`resilient.device.routing.default_route`) sends them
        over NCCL (docs/cuda.md)."""
        self.view, self.transport, self.member_id = view, transport, view.member_id
        env = Settings.from_env() if staging is None or shm_direct is None else None
        staging = env.staging if env is not None and staging is None else bool(staging)
        shm_direct = env.shm_direct if env is not None and shm_direct is None else bool(shm_direct)
        self.settings = CommSettings(policy, op_timeout, small_bytes, slice_bytes, max_slices, recovery_timeout,
                                     epoch_timeout, ledger, health_reporter, metrics, hierarchical, staging)
        self.policy = Policy.parse(policy)
        self.op_timeout, self.epoch_timeout, self.ledger_enabled = op_timeout, epoch_timeout, ledger
        self.sizing = Sizing(small_bytes, slice_bytes, max_slices, hierarchical, staging, shm_direct=shm_direct)
        self.metrics = OpMetrics(metrics, health_reporter)
        # ops post through this: a failed link to a live member is retried (issue 5)
        self._op_transport = RetryingTransport(transport, give_up_s=op_timeout, on_suspect=self._suspect,
                                               is_member=lambda peer: peer in self._epochs.epoch.members,
                                               is_alive=view.peer_alive, dead_wait_s=epoch_timeout)
        self._epochs = EpochTracker(view, transport, self._op_transport, epoch_timeout, metrics)
        self._recovery = RecoveryPath(view, transport, self._op_transport, self._epochs, op_timeout,
                                      recovery_timeout, self._suspect)
        self._epochs.start(joining)
        self._route = device_route if device_route is not None else default_route(view)
        self._errors = OpErrors(self.member_id, ErrorsToNccl(transport, self._route),
                                ErrorsToNccl(self._op_transport, self._route), self._epochs.members)
        self._p2p = PointToPoint(self)
        self._buffers = BufferPool()
        self._loop = OpLoop(self.member_id, self._op_transport, self._epochs, self._recovery, self._errors,
                            self._buffers, self.metrics, op_timeout, self._suspect, self._route)
        self._ops = OpThread(self.member_id, self.metrics, lambda: self.epoch.number)
        self._epochs.use_op_thread(lambda fn: self._ops.submit(fn, async_op=True), self._ops.queued)
        self._epochs.watch(self._route.on_epoch)
        self.last_compression: dict[str, Any] | None = None  # scales/q of the last compressed op
        self.compression_switch: CompressionSwitch | None = None  # compression="auto" (compression_switch.py)

    # -- public API ---------------------------------------------------------------------

    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False,
                  policy: Policy | str | None = None, compression: Any = None) -> Work:
        """``compression``: None (exact float sum), ``"q8"``/``"q4"``/``"q2"``, ``"auto"``
        or a :class:`~.compressed.Compression` (``auto=True``: the measured-link switch of
        :mod:`.compression_switch`): the exact quantized allreduce of ``docs/compression.md``."""
        t = as_tensor(tensor, "allreduce tensor")
        rop = ReduceOp.parse(op)
        body = compressed_body(self, t, rop, compression, policy)
        if body is None:
            desc = describe("allreduce", t, op=rop.value)
            body = on_device(t, lambda: self.reduce_now(t, rop, desc, policy))
        return self._ops.submit(body, async_op, "allreduce", t.numel() * t.element_size())

    def reduce_scatter(self, output: Any, inputs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM,
                       async_op: bool = False, policy: Policy | str | None = None) -> Work:
        out = as_tensor(output, "reduce_scatter output")
        ins = [as_tensor(x, f"reduce_scatter input {i}") for i, x in enumerate(inputs)]
        rop = ReduceOp.parse(op)
        desc = describe("reduce_scatter", out, op=rop.value, n=len(ins))
        return self._ops.submit(on_device(out, lambda: self._collective(desc, lambda: ReduceScatterOp(
            out, ins, rop, self.size, self.sizing, self._errors.require_group_of), policy)), async_op,
            "reduce_scatter", sum(x.numel() * x.element_size() for x in ins))

    def allgather(self, outputs: Sequence[Any], tensor: Any, async_op: bool = False) -> Work:
        t = as_tensor(tensor, "allgather tensor")
        outs = [as_tensor(x, f"allgather output {i}") for i, x in enumerate(outputs)]
        desc = describe("allgather", t, n=len(outs))
        return self._ops.submit(on_device(t, lambda: self._collective(desc, lambda: AllgatherOp(
            outs, t, self.size, self.sizing, self._errors.require_group_of))), async_op,
            "allgather", t.numel() * t.element_size() * len(outs))

    def broadcast(self, tensor: Any, root: int = 0, async_op: bool = False) -> Work:
        t = as_tensor(tensor, "broadcast tensor")
        desc = describe("broadcast", t, root=int(root))
        return self._ops.submit(on_device(t, lambda: self._collective(desc, lambda: BroadcastOp(
            t, int(root), self.members, self.sizing))), async_op, "broadcast", t.numel() * t.element_size())

    def barrier(self, async_op: bool = False) -> Work:
        t = torch.zeros(1, dtype=torch.int32)
        return self._ops.submit(lambda: self.reduce_now(t, ReduceOp.SUM, {"k": "barrier"}, None), async_op, "barrier")

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

    def recv_any(self, tensor: Any, tag: int = 0, async_op: bool = False) -> Work:
        """Receive into ``tensor`` from whichever member's message comes first (torch's
        ``recv(src=None)``); ``work.contributors`` names the sender (see :mod:`.p2p`,
        ``PointToPoint.recv_any``)."""
        work = self._p2p.recv_any(as_tensor(tensor, "recv tensor"), int(tag))
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
    def admitted_at(self) -> int:
        """The op sequence number at which the newest admission (an epoch that grew the
        group, or this member's own join) took effect; 0 when none. Every member of the
        group has the same value once it has reached that op."""
        return self._epochs.admitted_at

    def reserve_seqs(self, count: int) -> int:
        """Op thread only: take ``count`` consecutive op sequence numbers now, adopting a
        newer epoch at this boundary as an op would (a joiner is admitted before or after
        them, never between); the ops then run with ``seq=`` given. Returns the first."""
        return self._epochs.reserve(None, count)[0]

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
    def device_route(self) -> DeviceRoute:
        """How this member's device ops travel per epoch (host-staged or NCCL; docs/cuda.md)."""
        return self._route

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
        return self._ops.submit(fn, async_op)

    def catch_up(self) -> None:
        """Op thread only (inside :meth:`run_on_op_thread`): adopt the newest epoch between
        ops, as the next collective would (:meth:`.recovery_path.RecoveryPath.catch_up`,
        whose errors it raises). The point-to-point ops (:mod:`.p2p`) call it when the
        epoch moved under a send/recv, so the transport runs again between live peers."""
        self._recovery.catch_up(self.policy)

    def close(self, linger: float = 0.0, leave: bool = False) -> None:
        """Finish the queued ops, then make leaving safe for the peers.

        With ``leave=True`` this member first says goodbye (:meth:`_say_goodbye`: a
        Communicator built by :func:`resilient.connect` lingers, at most
        ``min(op_timeout, 10 s)``, until the peers of its group finished their last op or
        died, :mod:`resilient.goodbye`), so leaving cannot abort a peer still reading that
        op's last bytes. A peer may still be finishing our last op after a failure and need
        our kept result: unless every peer said goodbye, if an epoch that removes a member
        is already published (or arrives within ``linger`` seconds), this member takes
        part in that recovery from its retained result
        (:meth:`.recovery_path.RecoveryPath.serve_retained`). The goodbye's wait ends early
        when an epoch removes a member after this member's last op (the others may be
        recovering it instead of saying goodbye), and after serving a recovery this member says goodbye again and lingers until the
        peers finished the op from what it sent. With ``leave=True`` it then
        ends its membership (revokes its lease through the group view), so peers that
        would need it later see an epoch change at once instead of waiting for it. Never
        raises for a failed peer; bounded by two goodbyes + ``linger`` + one recovery.
        Under the deadline straggler policy a parent first waits (at most ``op_timeout``)
        until its leaves finished the last op (they may lag by one:
        ``algorithms/leaf_deadline.drain``). When that wait is cut short — an epoch that
        removes a member (e.g. the other actives closing) aborts it, or a leaf fails — a
        leaf may still have that op to run, and this member's retained result is then the
        only copy of the op's contributors: it serves it in the recovery for the rest of
        that bound (``linger`` at least), so the leaf reports what the actives reported
        instead of running the op again over whoever is left."""
        if not self._ops.close():
            return
        budget = max(linger, self.op_timeout or 30.0)
        t0 = time.monotonic()
        if not drain(self._op_transport, self.epoch.number, budget):
            linger = max(linger, budget - (time.monotonic() - t0))
        if not (leave and self._say_goodbye(stop=self._recovery.may_need_retained)):
            if self._recovery.serve_retained(linger, self.policy) and leave:
                # the peers are finishing the op from what this member just sent: linger
                # again until they did (leaving now would abort them while they read it)
                self._say_goodbye()
        self._epochs.unwatch()
        self._route.close()
        if leave:
            try:
                self.view.leave("closed")
            except Exception as exc:  # noqa: BLE001
                log.info("close: leaving failed (the lease TTL removes this member): %s", exc)

    def _say_goodbye(self, stop: Callable[[], bool] | None = None) -> bool:
        """Before leaving (:meth:`close` with ``leave=True``): tell the peers this member
        is done and wait, bounded, until they finished their last op; True when every peer
        did (none can need our retained result any more). ``stop``: stop waiting (False)
        as soon as it holds — :meth:`close` passes "a recovery of the last op may need our
        retained result", which it then serves before it says goodbye again. This Communicator has no
        control plane of its own to say it on: False (nothing known); a subclass with one
        (``resilient.connect``'s) says it. Never raises."""
        return False

    # -- op bodies (op thread; reduce_now / run_op / take_buffer also serve compressed.py) --

    def _collective(self, desc: dict[str, Any], make: Callable[[], ReduceScatterOp | AllgatherOp | BroadcastOp],
                    policy: Policy | str | None = None) -> OpResult:
        spec = make()   # on the op thread: the group it checks against is the op's
        return spec.finish(self.run_op(desc, spec, policy=policy))

    def reduce_now(self, t: torch.Tensor, op: ReduceOp, desc: dict[str, Any], policy: Policy | str | None,
                   reserve: int = 1, seq: int | None = None, sizing: Sizing | None = None) -> OpResult:
        """Run one allreduce of ``t`` in place on the op thread (``reserve``/``seq``: see
        :meth:`run_op`; ``sizing``: this op's instead of the communicator's)."""
        spec = AllreduceOp(str(desc["k"]), t, op, self._buffers, self.sizing if sizing is None else sizing)
        return spec.finish(self.run_op(desc, spec, policy=policy, seq=seq, reserve=reserve))

    def take_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pooled flat buffer for a ledger's output (released when the ledger is dropped)."""
        return self._buffers.take(numel, dtype)

    def run_op(self, desc: dict[str, Any], spec: OpSpec, policy: Policy | str | None = None,
               seq: int | None = None, reserve: int = 1) -> Ledger:
        """Run one op with recovery (:class:`.op_loop.OpLoop`); returns its completed
        ledger. ``reserve`` > 1 takes that many sequence numbers at once (a compound op: no
        epoch is adopted inside it); the later ones run with ``seq`` given. ``policy``:
        this op's recovery policy (default: the communicator's)."""
        op_policy = self.policy if policy is None else Policy.parse(policy)
        return self._loop.run(desc, spec, op_policy, self.ledger_enabled, seq, reserve)

    # -- plumbing -----------------------------------------------------------------------

    def _suspect(self, peer: str, reason: str) -> None:
        try:
            self.view.report_suspect(peer, reason)
        except Exception as exc:  # noqa: BLE001 - the report is advisory
            log.warning("could not report %s as suspect: %s", peer, exc)
