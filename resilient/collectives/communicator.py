"""``Communicator``: resumable collectives over an abortable transport (docs/design.md §3).

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

import json
import logging
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from resilient.collectives.algorithms import ChainBroadcast, OpContext, RecursiveDoubling, RingReduceScatterAllgather
from resilient.collectives.algorithms.hierarchical import select as select_hierarchical, select_per_member
from resilient.collectives.algorithms.leaf import LeafPath
from resilient.collectives.eviction import removed_error
from resilient.collectives.group import GroupView, addresses_of
from resilient.collectives.ledger import Ledger, decode_status, encode_status, split
from resilient.collectives.recovery import PieceKind, Policy, members_of
from resilient.collectives.resume import build_plan, execute_plan
from resilient.collectives.retry import PeerUnreachable, RetryingTransport
from resilient.collectives.status_exchange import StatusExchange
from resilient.collectives.work import Work
from resilient.errors import (
    CollectiveError, ConfigError, GroupChanged, InputMismatch, RemovedFromGroup, StoreError, TransportAborted,
    TransportError,
)
from resilient.kernels import ReduceOp
from resilient.coordinator import records
from resilient.transport.base import OpMismatch, PeerReportedError, Transport

log = logging.getLogger(__name__)

DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}


@dataclass(frozen=True)
class OpResult:
    contributors: tuple[str, ...]
    piece_contributors: list[tuple[str, ...]] | None = None
    recovered: bool = False


def _as_tensor(x: Any, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            import numpy as np

            if isinstance(x, np.ndarray):
                t = torch.from_numpy(x)
            else:
                raise TypeError
        except TypeError:
            raise ConfigError(f"{what} must be a torch CPU tensor or a numpy array, got {type(x).__name__}") from None
    if t.device.type != "cpu":
        raise ConfigError(f"{what} is on {t.device}; the TCP communicator needs CPU tensors (use the NCCL transport for GPUs)")
    if t.dtype not in DTYPES:
        raise ConfigError(f"{what} has dtype {t.dtype}; supported: float32, float64, float16, bfloat16, int32, int64")
    return t


def _cause_of(e: Any) -> str:
    """The ``resilient_recoveries_total`` cause label of an epoch that removed members."""
    return {"member_lost": "member_lost", "lease_expired": "lease_expired", "suspect_confirmed": "suspect_confirmed",
            "health": "demoted", "demoted": "demoted", "evicted": "demoted"}.get(getattr(e, "cause", ""), "member_lost")



def _joinseq(raw: bytes) -> int:
    """The op sequence number in a member's ``joinseq`` blob (``{"seq": n}``), validated
    like every etcd record: a malformed blob raises :class:`~resilient.errors.RecordError`
    naming the rule (a joiner never starts at a guessed sequence number)."""
    return int(records.fields("rendezvous", raw, "joinseq").int("seq"))

class Communicator:
    def __init__(self, view: GroupView, transport: Transport, *, policy: Policy | str = Policy.DEFAULT,
                 op_timeout: float | None = 30.0, small_bytes: int = 64 << 10, slice_bytes: int = 2 << 20,
                 max_slices: int = 64, recovery_timeout: float = 300.0, epoch_timeout: float = 60.0,
                 ledger: bool = True, joining: bool | None = None, health_reporter: Any = None,
                 metrics: Any = None, hierarchical: bool = True) -> None:
        self.view, self.transport = view, transport
        self.hierarchical = hierarchical  # allreduce by host groups when the plan has them (algorithms/hierarchical.py)
        self._init_kwargs = dict(policy=policy, op_timeout=op_timeout, small_bytes=small_bytes, slice_bytes=slice_bytes,
                                 max_slices=max_slices, recovery_timeout=recovery_timeout, epoch_timeout=epoch_timeout,
                                 ledger=ledger, health_reporter=health_reporter, metrics=metrics,
                                 hierarchical=hierarchical)  # for rejoin()
        # ops post through this: a failed link to a live member is retried (issue 5)
        self._op_transport = RetryingTransport(transport, give_up_s=op_timeout, on_suspect=self._suspect,
                                               is_member=lambda peer: peer in self._epoch.members,
                                               is_alive=getattr(view, "peer_alive", lambda peer: True),
                                               dead_wait_s=epoch_timeout)
        self.member_id = view.member_id
        self.policy = Policy.parse(policy)
        self.op_timeout, self.small_bytes, self.slice_bytes, self.max_slices = op_timeout, small_bytes, slice_bytes, max_slices
        self.recovery_timeout, self.epoch_timeout, self.ledger_enabled = recovery_timeout, epoch_timeout, ledger
        epoch = view.current()
        if epoch is None or self.member_id not in epoch.members:
            epoch = view.wait_for(lambda e: self.member_id in e.members, epoch_timeout)
        self._group = set(epoch.members)
        self._epoch = epoch
        self._lock = threading.Lock()
        self.health_reporter = health_reporter
        self._metrics = metrics
        self._published: dict[int, int] = {}  # epoch -> the next op seq this member announced there
        self._aborted_at: float | None = None  # wall time the watch thread last aborted the transport
        self._switch: tuple[int, Any] | None = None  # (op seq, epoch) at which to adopt a growing epoch
        self._enter(epoch)
        self._status_epoch = epoch.number
        self._seq = 0
        if joining is None:
            joining = getattr(epoch, "cause", "initial") != "initial" and self.member_id in (getattr(epoch, "added", ()) or ())
        if joining:
            # Admitted at an op boundary: the group's members announce under epochs/<n>/
            # the op seq at which they adopt this epoch; we start there.
            olds = [m for m in epoch.members if m not in (getattr(epoch, "added", ()) or ())]
            raw = view.wait_blobs(epoch.number, "joinseq", olds, epoch_timeout) if olds else {}
            self._seq = max((_joinseq(v) for v in raw.values()), default=0)
            log.info("member %s joins epoch %d at op #%d", self.member_id, epoch.number, self._seq)
        else:
            self._announce(epoch.number)
        self._set_epoch_metrics()
        self._p2p: dict[tuple[str, str], int] = {}
        self._retained: Ledger | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"resilient-ops:{self.member_id}")
        self._unsub = view.subscribe(self._on_epoch)
        self.last_recovery: dict[str, Any] | None = None
        self.last_compression: dict[str, Any] | None = None  # scales/q of the last compressed op
        self._closed = False

    # -- epochs -------------------------------------------------------------------------

    def _members(self) -> list[str]:
        return [m for m in self._epoch.members if m in self._group]

    def _removes(self, e: Any) -> bool:
        return self.member_id not in e.members or any(m not in e.members for m in self._members())

    def _on_epoch(self, e: Any) -> None:
        """Watch thread: abort the transport at once when an epoch removes a member."""
        if e.number > self._epoch.number and self._removes(e):
            self._aborted_at = time.time()
            self.transport.abort(f"epoch {e.number} removed {sorted(set(self._members()) - set(e.members))}")
        elif e.number > self._epoch.number:
            try:
                self._announce(e.number)
            except Exception as exc:  # noqa: BLE001 - the op thread announces at its next boundary
                log.warning("could not announce op seq for epoch %d: %s", e.number, exc)

    def _announce(self, number: int) -> int:
        """Publish (once per epoch) the first op seq this member has not started yet; from
        then on it starts no op of that seq or later in an older epoch."""
        with self._lock:
            if number in self._published:
                return self._published[number]
            self._published[number] = seq = self._seq
        self.view.put_blob(number, "joinseq", json.dumps({"seq": seq}).encode())
        return seq

    def _adopt_growing(self, e: Any) -> None:
        """At an op boundary: agree with the group on the op seq at which the epoch ``e``
        (which removes no member of ours: joiners, role changes) takes effect — the
        largest seq any member announced — and adopt it there. Raises ``EpochChanged``
        (a StoreError) when a newer epoch supersedes ``e`` meanwhile, TimeoutError after
        ``epoch_timeout`` if a member never announces (its lease then expires and the
        next epoch removes it)."""
        self._announce(e.number)
        olds = [m for m in self._members() if m in e.members]
        raw = self.view.wait_blobs(e.number, "joinseq", olds, self.epoch_timeout)
        at = max(_joinseq(v) for v in raw.values())
        self._switch = (at, e)

    def _enter(self, e: Any) -> None:
        """Adopt epoch ``e``: transport configured, epoch/world-size gauges set, and one
        membership recovery counted (cause from the epoch) when it removed members of ours."""
        removed = self._group - set(e.members) if hasattr(self, "_epoch") else set()
        self._epoch = e
        self._group &= set(e.members)
        self._op_transport.configure(e.number, e.token, addresses_of(e))  # also forgets broken links of the old epoch
        self._set_epoch_metrics()
        if removed and self.member_id in e.members and self._metrics is not None:
            try:
                self._metrics.record_membership_recovery(_cause_of(e))
            except Exception as exc:  # noqa: BLE001
                log.debug("metrics: %s", exc)
        newest = self.view.current()
        if newest is not None and newest.number > e.number and self._removes(newest):
            self.transport.abort(f"epoch {newest.number} superseded {e.number}")

    def _newer_than(self, number: int) -> Callable[[], int | None]:
        """For :class:`StatusExchange`: the number of an epoch newer than ``number``, if any."""
        def newer() -> int | None:
            cur = self.view.current()
            return cur.number if cur is not None and cur.number > number else None
        return newer

    def _await_newer_epoch(self) -> Any:
        deadline = time.monotonic() + self.epoch_timeout
        cur = self._epoch.number
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

    # -- public API ---------------------------------------------------------------------

    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False,
                  policy: Policy | str | None = None, compression: Any = None) -> Any:
        """``compression``: None (exact float sum), ``"q8"``/``"q4"``/``"q2"``, ``"auto"``
        or a :class:`~.compressed.Compression` (``auto=True``: the measured-link switch of
        :mod:`.compression_switch`): the exact quantized allreduce of ``docs/compression.md``."""
        t = _as_tensor(tensor, "allreduce tensor")
        rop = ReduceOp.parse(op)
        if compression is not None:
            from resilient.collectives.compressed import Compression, run_compressed
            from resilient.collectives.compression_switch import run_auto

            comp = Compression.parse(compression)
            segs = comp.layout(t) if comp is not None else None
            if segs is not None:
                body = run_auto if comp.auto else run_compressed
                return self._submit(lambda: body(self, t, rop, comp, segs, policy), async_op, "allreduce",
                                    t.numel() * t.element_size())
        desc = {"k": "allreduce", "shape": list(t.shape), "dtype": str(t.dtype), "op": rop.value}
        return self._submit(lambda: self._reduce(t, rop, desc, policy), async_op, "allreduce", t.numel() * t.element_size())

    def reduce_scatter(self, output: Any, inputs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM,
                       async_op: bool = False, policy: Policy | str | None = None) -> Any:
        out = _as_tensor(output, "reduce_scatter output")
        ins = [_as_tensor(x, f"reduce_scatter input {i}") for i, x in enumerate(inputs)]
        rop = ReduceOp.parse(op)
        desc = {"k": "reduce_scatter", "shape": list(out.shape), "dtype": str(out.dtype), "op": rop.value, "n": len(ins)}
        return self._submit(lambda: self._reduce_scatter(out, ins, rop, desc, policy), async_op, "reduce_scatter",
                            sum(x.numel() * x.element_size() for x in ins))

    def allgather(self, outputs: Sequence[Any], tensor: Any, async_op: bool = False) -> Any:
        t = _as_tensor(tensor, "allgather tensor")
        outs = [_as_tensor(x, f"allgather output {i}") for i, x in enumerate(outputs)]
        desc = {"k": "allgather", "shape": list(t.shape), "dtype": str(t.dtype), "n": len(outs)}
        return self._submit(lambda: self._allgather(outs, t, desc), async_op, "allgather",
                            t.numel() * t.element_size() * len(outs))

    def broadcast(self, tensor: Any, root: int = 0, async_op: bool = False) -> Any:
        t = _as_tensor(tensor, "broadcast tensor")
        desc = {"k": "broadcast", "shape": list(t.shape), "dtype": str(t.dtype), "root": int(root)}
        return self._submit(lambda: self._broadcast(t, int(root), desc), async_op, "broadcast", t.numel() * t.element_size())

    def barrier(self, async_op: bool = False) -> Any:
        t = torch.zeros(1, dtype=torch.int32)
        desc = {"k": "barrier"}
        return self._submit(lambda: self._reduce(t, ReduceOp.SUM, desc, None), async_op, "barrier")

    def send(self, tensor: Any, dst: int, tag: int = 0, async_op: bool = False) -> Any:
        t = _as_tensor(tensor, "send tensor")
        return self._submit(lambda: self._p2p_op(t, dst, tag, True), async_op)

    def recv(self, tensor: Any, src: int, tag: int = 0, async_op: bool = False) -> Any:
        t = _as_tensor(tensor, "recv tensor")
        return self._submit(lambda: self._p2p_op(t, src, tag, False), async_op)

    @property
    def members(self) -> list[str]:
        return self._members()

    @property
    def rank(self) -> int:
        return self._members().index(self.member_id)

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
        from resilient.collectives.eviction import rejoin

        return rejoin(self, timeout)

    @property
    def next_seq(self) -> int:
        """The sequence number the next collective will get (a joiner starts at the
        group's; all members call ops in the same order)."""
        return self._seq

    @property
    def size(self) -> int:
        return len(self._members())

    def close(self, linger: float = 0.0, leave: bool = False) -> None:
        """Finish the queued ops, then make leaving safe for the peers.

        A peer may still be finishing our last op after a failure and need our kept
        result: if an epoch that removes a member is already published (or arrives within
        ``linger`` seconds), this member first takes part in that recovery from its
        retained result (:meth:`_serve_retained`). With ``leave=True`` it then ends its
        membership (revokes its lease through the group view), so peers that would need
        it later see an epoch change at once instead of waiting for it. Never raises for
        a failed peer; bounded by ``linger`` + one recovery. Under the deadline straggler
        policy a parent first waits (at most ``op_timeout``) until its leaves finished the
        last op (they may lag by one: ``algorithms/leaf_deadline.drain``)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        from resilient.collectives.algorithms.leaf_deadline import drain

        drain(self._op_transport, self._epoch.number, max(linger, self.op_timeout or 30.0))
        try:
            self._serve_retained(linger)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.info("close: serving the retained result of op #%s failed: %s",
                     self._retained.seq if self._retained else None, exc)
        try:
            self._unsub()
        except Exception:  # noqa: BLE001
            pass
        if leave and hasattr(self.view, "leave"):
            try:
                self.view.leave("closed")
            except Exception as exc:  # noqa: BLE001
                log.info("close: leaving failed (the lease TTL removes this member): %s", exc)

    def _serve_retained(self, linger: float) -> None:
        """Join a recovery of our last op from its retained result (see :meth:`close`)."""
        from resilient.collectives.algorithms import OpContext as _Ctx
        from resilient.coordinator.epoch import EpochChanged

        R = self._retained
        if R is None:
            return
        end = time.monotonic() + linger
        while True:
            e = self.view.current()
            if e is None or e.number <= self._status_epoch or self.member_id not in e.members or not self._removes(e):
                if time.monotonic() >= end:
                    return
                try:
                    self.view.wait_for(lambda x: x.number > max(self._status_epoch, self._epoch.number),
                                       max(0.01, end - time.monotonic()))
                except TimeoutError:
                    return
                continue
            self._enter(e)
            survivors = [m for m in e.members if m in R.members]
            xchg = StatusExchange(self.view, self._op_transport, e.number, survivors, self.member_id,
                                  encode_status(self.member_id, None, R))
            try:
                raw = xchg.run(max(1.0, end - time.monotonic()), self._newer_than(e.number))
            except (EpochChanged, TransportAborted):
                continue
            except TimeoutError:
                return
            self._status_epoch = e.number
            t_status = time.monotonic()
            statuses = {m: decode_status(v) for m, v in raw.items()}
            inflight = [st["inflight"]["seq"] for st in statuses.values() if st.get("inflight")]
            if inflight and min(inflight) == R.seq:
                ctx = _Ctx(self._op_transport, R, ReduceOp.SUM, self.op_timeout, self._suspect, e.number)
                execute_plan(ctx, build_plan(R, survivors, statuses, self.policy))
            return

    # -- plumbing -----------------------------------------------------------------------

    def _submit(self, fn: Callable[[], OpResult], async_op: bool, kind: str = "", nbytes: int = 0) -> Any:
        if self._closed:
            raise ConfigError("the communicator is closed")
        if kind:
            inner = fn

            def fn() -> OpResult:  # noqa: F811 - timed wrapper
                t0 = time.monotonic()
                res = inner()
                self._op_finished(kind, time.monotonic() - t0, nbytes)
                return res
        fut: Future = self._pool.submit(fn)
        work = Work(fut)
        if async_op:
            return work
        fut.result()
        return work

    def _op_finished(self, kind: str, seconds: float, nbytes: int) -> None:
        """Per op (never per slice): metrics and the health reporter; neither may fail an op."""
        if self._metrics is not None:
            try:
                self._metrics.record_collective(kind, seconds, nbytes)
            except Exception as exc:  # noqa: BLE001
                log.debug("metrics: %s", exc)
        if self.health_reporter is not None:
            try:
                self.health_reporter.op_done(self._epoch.number, seconds)
            except Exception as exc:  # noqa: BLE001
                log.debug("health reporter: %s", exc)

    def _set_epoch_metrics(self) -> None:
        if self._metrics is not None:
            try:
                self._metrics.set_epoch(self._epoch.number, len(self._members()))
            except Exception as exc:  # noqa: BLE001
                log.debug("metrics: %s", exc)

    def _slices(self, chunk_bytes: int) -> int:
        """Pipelining slices for one chunk of ``chunk_bytes`` (1 for an empty chunk)."""
        return max(1, min(self.max_slices, -(-chunk_bytes // self.slice_bytes)))

    def _slices_for(self, nbytes: int, n: int) -> int:
        return self._slices(max(1, nbytes // max(1, n)))

    def _require_group_of(self, n0: int, members: list[str], seq: int, kind: str, what: str) -> None:
        """Ops with one buffer per member cannot run over a changed group: every member is
        told (so none waits) and the caller gets a CollectiveError saying what to do."""
        n = len(members)
        if n != n0:
            self._abandon(members, seq, f"the group changed from {n0} to {n} members", group_changed=(n0, n))
            raise GroupChanged(f"{kind} #{seq}: the group changed from {n0} to {n} members before it "
                               f"started; call it again with one {what} per current member", n0, n)

    def _digest(self, desc: dict) -> int:
        return zlib.crc32(json.dumps(desc, sort_keys=True).encode())

    def _suspect(self, peer: str, reason: str) -> None:
        try:
            self.view.report_suspect(peer, reason)
        except Exception as exc:  # noqa: BLE001 - the report is advisory
            log.warning("could not report %s as suspect: %s", peer, exc)

    def _boundary(self, next_seq: int | None = None) -> bool:
        """Before an op (``next_seq``: its pre-reserved number): adopt newer epochs.
        Returns whether the op must start with a ledger-status exchange (an epoch removed
        a member)."""
        from resilient.coordinator.epoch import EpochChanged

        if self.view.session_lost() and self.member_id not in (self.view.current() or self._epoch).members:
            raise RemovedFromGroup(f"member {self.member_id} lost its lease; it is no longer in the job")
        while True:
            newest = self.view.current()
            if newest is None or newest.number <= self._epoch.number:
                break
            if self.member_id not in newest.members:
                raise removed_error(self.member_id, newest, f"member {self.member_id} is not in epoch {newest.number}: it was removed "
                                       "from the job (lease expired or evicted); restart it as a joiner")
            if self._removes(newest):
                self._switch = None
                return True
            if self._switch is not None and self._switch[1].number == newest.number:
                break
            try:
                self._adopt_growing(newest)
            except EpochChanged:
                continue
            except TimeoutError as exc:
                raise CollectiveError(f"epoch {newest.number} adds members but not every member announced its op "
                                      f"sequence number within {self.epoch_timeout}s: {exc}") from None
            break
        if self._switch is not None and (self._seq if next_seq is None else next_seq) >= self._switch[0]:
            e = self._switch[1]
            self._switch = None
            self._group |= set(e.members)
            self._enter(e)
            self._set_epoch_metrics()
            log.info("member %s adopted epoch %d at op #%d (members %s)", self.member_id, e.number, self._seq,
                     list(e.members))
        return False

    def _run(self, desc: dict, build: Callable[[list[str], int, int, int], tuple[Ledger, Any]],
             seq: int | None = None, reserve: int = 1) -> Ledger:
        """Run one op with recovery; returns its completed ledger. ``reserve`` > 1 takes
        that many sequence numbers at once (a compound op: no epoch is adopted inside it);
        the later ones run with ``seq`` given."""
        if seq is not None:
            need_status = self._boundary(next_seq=seq)
        while seq is None:
            need_status = self._boundary()
            with self._lock:
                # an epoch announced (by the watch thread) after _boundary looked: resolve it
                # first, this op must not start in the older epoch
                late = [n for n, v in self._published.items() if n > self._epoch.number and v <= self._seq
                        and not (self._switch is not None and self._switch[1].number >= n)]
                if need_status or not late:
                    seq = self._seq
                    self._seq += reserve
                    break
        digest = self._digest(desc)
        while True:
            members = self._members()
            L, algo = build(members, members.index(self.member_id), seq, digest)
            L.enabled = self.ledger_enabled
            ctx = OpContext(self._op_transport, L, self._op_of(desc), self.op_timeout, self._suspect, self._epoch.number)
            try:
                if need_status:
                    need_status = False
                    outcome = self._recover(ctx, awaiting=False)
                else:
                    try:
                        algo.run(ctx)
                        outcome = "done"
                    except (OpMismatch, PeerReportedError) as exc:
                        self._mismatch(seq, desc, exc)
                    except TransportError as exc:
                        ctx.settle()
                        log.info("op #%d interrupted: %s", seq, exc)
                        outcome = self._recover(ctx, awaiting=True)
            except (OpMismatch, PeerReportedError) as exc:
                self._mismatch(seq, desc, exc)
            except PeerUnreachable as exc:
                # tell the members beyond the broken link (they would wait for us), then raise
                msg = json.dumps({"from": self.member_id, "unreachable": exc.peer, "reason": str(exc)}).encode()
                self.transport.post_error(self._members(), seq, msg)
                self._op_transport.cancel_op(seq)
                raise
            if outcome == "done":
                break
        L.done = True
        if L.need is None:
            L.need = [L.full] * len(L.pieces)
        retained = L
        # reduce_scatter's kept input is a private concatenation, still valid: a member that
        # finished the op can still add its input to the others' chunks and stays a
        # contributor. allreduce's may be the caller's tensor (now the result) or a pooled
        # buffer released below: no input.
        retained.has_input = L.kind == "reduce_scatter"
        prev, self._retained = self._retained, retained
        if prev is not None:
            self._release(prev.out)  # nobody can need the op before the retained one
        self._release(L.inp)  # retained ledgers have no input (has_input=False)
        return L

    @staticmethod
    def _op_of(desc: dict) -> ReduceOp:
        return ReduceOp.parse(desc.get("op", "sum"))

    def _recover(self, ctx: OpContext, awaiting: bool) -> str:
        """Finish (``"done"``) or ask to rerun (``"rerun"``) ``ctx``'s op; see :mod:`.resume`."""
        from resilient.coordinator.epoch import EpochChanged

        L = ctx.ledger
        t0 = time.monotonic()
        wall0 = time.time()
        sent0, retries0 = self.transport.stats.bytes_sent, self._op_transport.retries
        while True:
            newest = self.view.current()
            if awaiting or newest is None or newest.number <= self._epoch.number:
                e = self._await_newer_epoch()
            else:
                e = newest
            awaiting = True
            if self.member_id not in e.members:
                raise removed_error(self.member_id, e, f"member {self.member_id} is not in epoch {e.number}: removed from the job")
            self._enter(e)
            ctx.epoch = e.number
            survivors = [m for m in e.members if m in L.members]
            wall_epoch = time.time()
            xchg = StatusExchange(self.view, self._op_transport, e.number, survivors, self.member_id,
                                  encode_status(self.member_id, L, self._retained))
            try:
                raw = xchg.run(self.recovery_timeout, self._newer_than(e.number))
            except EpochChanged:
                continue
            except TransportAborted as exc:  # an epoch removed another member meanwhile
                log.info("ledger-status exchange of op #%d in epoch %d interrupted: %s", L.seq, e.number, exc)
                continue
            except TimeoutError as exc:
                raise CollectiveError(f"op #{L.seq}: recovery in epoch {e.number} did not get every survivor's "
                                      f"ledger: {exc}") from None
            self._status_epoch = e.number
            t_status = time.monotonic()
            statuses = {m: decode_status(v) for m, v in raw.items()}
            inflight = [s["inflight"]["seq"] for s in statuses.values() if s.get("inflight")]
            k = min(inflight) if inflight else L.seq
            try:
                if L.seq > k:
                    R = self._retained
                    if R is not None and R.seq == k:
                        rctx = OpContext(self._op_transport, R, ctx.op, self.op_timeout, self._suspect, e.number)
                        execute_plan(rctx, build_plan(R, survivors, statuses, self.policy))
                    xchg.wait_published()
                    return "rerun"
                progress = any(
                    (s.get(key) or {}).get("seq") == L.seq and any((s.get(key) or {}).get("masks", []))
                    for s in statuses.values() for key in ("inflight", "retained"))
                if not progress:
                    xchg.wait_published()
                    return "rerun"
                plan = build_plan(L, survivors, statuses, self.policy)
                t_plan = time.monotonic()
                exec_stats = execute_plan(ctx, plan)
            except (OpMismatch, PeerReportedError):
                raise
            except TransportError as exc:
                ctx.settle()
                log.info("recovery of op #%d interrupted: %s", L.seq, exc)
                continue
            L.need = plan.need
            t_end = time.monotonic()
            self.last_recovery = {"seq": L.seq, "epoch": e.number, "seconds": t_end - t0,
                                  "status_s": t_status - t0, "plan_s": t_plan - t_status, "execute_s": t_end - t_plan,
                                  "rounds": len(plan.rounds), "transfers": len(plan.transfers()), **exec_stats,
                                  "bytes_sent": self.transport.stats.bytes_sent - sent0,
                                  "link_retries": self._op_transport.retries - retries0,
                                  "contributors": members_of(plan.need[0], L.members) if plan.need else [],
                                  # wall-clock times (time.time()) of this recovery's steps, for benchmarks
                                  "timeline": {"aborted": self._aborted_at, "entered": wall0,
                                               "epoch": wall_epoch,
                                               "statuses": wall0 + (t_status - t0), "done": time.time()}}
            self._record_recovery(e, L)
            xchg.wait_published()   # observers (resilient status, chaos verifier) read it from etcd
            return "done"

    def _record_recovery(self, e: Any, L: Ledger) -> None:
        """Metrics of one finished recovery: cause (from the epoch), time, bytes resent and
        bytes saved versus redoing the op from scratch (2(n-1)/n of the op's bytes each)."""
        if self._metrics is None or self.last_recovery is None:
            return
        n = max(1, len(self._members()))
        scratch = int(2 * (n - 1) / n * L.inp.numel() * L.inp.element_size())
        resent = int(self.last_recovery["bytes_sent"])
        try:
            self._metrics.record_op_resumed(self.last_recovery["seconds"], resent, max(0, scratch - resent))
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %s", exc)

    def _abandon(self, members: list[str], seq: int, reason: str,
                 group_changed: tuple[int, int] | None = None) -> None:
        """This member cannot take part in op ``seq``: tell the others (an ERROR frame, so
        they raise InputMismatch — or GroupChanged when ``group_changed`` = (buffers, size)
        — instead of waiting for us) and drop the op."""
        body: dict[str, Any] = {"from": self.member_id, "descriptor": reason, "peer": self.member_id}
        if group_changed is not None:
            body["group_changed"] = list(group_changed)
        msg = json.dumps(body).encode()
        self.transport.post_error(members, seq, msg)
        self._op_transport.cancel_op(seq)

    def _mismatch(self, seq: int, desc: dict, exc: BaseException) -> None:
        mine = json.dumps(desc, sort_keys=True)
        if isinstance(exc, OpMismatch):
            msg = json.dumps({"from": self.member_id, "descriptor": desc, "peer": exc.peer}).encode()
            self.transport.post_error(self._members(), seq, msg)
            self._op_transport.cancel_op(seq)
            raise InputMismatch(
                f"collective #{seq}: member {exc.peer} called a different collective/shape/dtype/op than this member "
                f"({self.member_id}: {mine}); every member must call the same ops in the same order with matching "
                "inputs") from None
        assert isinstance(exc, PeerReportedError)
        self.transport.post_error(self._members(), seq, exc.message)  # relay: reaches members without a direct link
        self._op_transport.cancel_op(seq)
        try:
            other = json.loads(exc.message.decode())
        except ValueError:
            other = {"from": exc.peer}
        if isinstance(other, dict) and other.get("group_changed"):
            n0, n = other["group_changed"]
            raise GroupChanged(
                f"collective #{seq}: member {other.get('from')} found that the group changed from {n0} to {n} members "
                f"before the op started; call it again with one buffer per current member", n0, n) from None
        if isinstance(other, dict) and other.get("unreachable"):
            raise PeerUnreachable(str(other["unreachable"]), (
                f"collective #{seq}: member {other.get('from')} gave up on its link to member {other['unreachable']}: "
                f"{other.get('reason')}")) from None
        raise InputMismatch(
            f"collective #{seq}: members disagree on the op — member {other.get('from')} ({other.get('descriptor')}) "
            f"saw a different descriptor from member {other.get('peer')}; this member ({self.member_id}) called "
            f"{mine}; every member must call the same ops in the same order with matching inputs") from None

    def _result(self, L: Ledger) -> OpResult:
        need = L.need or [L.full] * len(L.pieces)
        if L.want is not None:  # reduce_scatter: this member's output is its own chunk only
            need = [m for m, w in zip(need, L.want) if w == L.me] or need
        sets = [tuple(members_of(m, L.members)) for m in need]
        uniq = set(sets)
        if len(uniq) <= 1:
            return OpResult(sets[0] if sets else tuple(L.members), None, False)
        union = tuple(m for m in L.members if any(m in s for s in sets))
        return OpResult(union, sets, False)

    # -- buffers ------------------------------------------------------------------------

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer from the pool (two deep per (numel, dtype)) or a new one: fresh
        64 MiB allocations cost ~7x a copy in page faults."""
        pool = self.__dict__.setdefault("_pool_bufs", {})
        free = pool.get((numel, dtype))
        buf = free.pop() if free else torch.empty(numel, dtype=dtype)
        self.__dict__.setdefault("_owned", set()).add(buf.data_ptr())
        return buf

    def adopt_buffer_pool(self, old: "Communicator") -> None:
        """Take over the free pooled buffers of ``old`` (the closed Communicator this one
        replaces when joiners are admitted: ``CommunicatorEngine.rebuild``), so the first
        ops after an admission reuse memory already faulted in instead of allocating it
        again (resilient/elastic admission cost). ``old`` keeps none; never raises."""
        for bufs in old.__dict__.pop("_pool_bufs", {}).values():
            for buf in bufs:
                self.__dict__.setdefault("_owned", set()).add(buf.data_ptr())
                self._release(buf)

    def _release(self, buf: torch.Tensor) -> None:
        """Return a buffer that :meth:`_buffer` handed out (never a user tensor)."""
        if buf.data_ptr() in self.__dict__.get("_owned", ()) and buf.numel() * buf.element_size() >= (1 << 20):
            free = self.__dict__.setdefault("_pool_bufs", {}).setdefault((buf.numel(), buf.dtype), [])
            if len(free) < 2 and all(b.data_ptr() != buf.data_ptr() for b in free):
                free.append(buf)

    # -- op bodies ----------------------------------------------------------------------

    def _ring_or_rd(self, nbytes: int, n: int) -> bool:
        return nbytes > self.small_bytes and n > 1

    def _reduce(self, t: torch.Tensor, op: ReduceOp, desc: dict, policy: Any, reserve: int = 1,
                seq: int | None = None) -> OpResult:
        if t.is_contiguous():
            inp = t.detach().view(-1)  # the ledger's kept input: t is not written before the op completes
        else:
            inp = self._buffer(t.numel(), t.dtype)
            inp.copy_(t.detach().reshape(-1))
        nbytes = inp.numel() * inp.element_size()

        def build(members: list[str], me: int, seq: int, digest: int) -> tuple[Ledger, Any]:
            n = len(members)
            leaf = LeafPath.for_epoch(members, self._epoch)   # demoted members: leaf path (algorithms/leaf.py)
            nr = leaf.ring_size if leaf else n
            hier = (select_hierarchical(members, self._epoch, inp.numel(), inp.element_size(), self._slices)
                    if self.hierarchical and not leaf and self._ring_or_rd(nbytes, n) else None)
            if hier is not None:
                pieces, algo = hier
            elif self._ring_or_rd(nbytes, nr) and inp.numel() >= nr:
                S = self._slices_for(nbytes, nr)
                pieces = [(s0 + a, s0 + b) for (s0, e0) in split(inp.numel(), nr) for (a, b) in split(e0 - s0, S)]
                algo: Any = RingReduceScatterAllgather(S)
            else:
                pieces = [(0, inp.numel())]
                algo = RecursiveDoubling()
            if leaf:
                algo = leaf.wrap(algo)
            L = Ledger(seq, desc["k"], tuple(members), me, self._epoch.number, digest, inp, self._buffer(inp.numel(), inp.dtype), pieces)
            return L, algo

        old = self.policy
        if policy is not None:
            self.policy = Policy.parse(policy)
        try:
            L = self._run(desc, build, seq=seq, reserve=reserve)
        finally:
            self.policy = old
        t.copy_(self._finish_avg(L, op).view(t.shape))
        return self._result(L)

    def _finish_avg(self, L: Ledger, op: ReduceOp) -> torch.Tensor:
        """The result to hand out (the ledger keeps the undivided sums: a slower survivor
        may still need them to finish this op)."""
        if op is not ReduceOp.AVG:
            return L.out
        res = L.out.clone()
        need = L.need or [L.full] * len(L.pieces)
        for p, m in enumerate(need):
            s, e = L.pieces[p]
            v = res[s:e]
            k = bin(m).count("1")
            if v.is_floating_point():
                v.div_(k)
            else:
                v.copy_(torch.div(v, k, rounding_mode="trunc"))
        return res

    def _reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp, desc: dict, policy: Any) -> OpResult:
        n0 = len(self._members())
        if len(ins) != n0:
            raise ConfigError(f"reduce_scatter needs one input per member ({n0}), got {len(ins)}")
        for i, x in enumerate(ins):
            if x.shape != out.shape or x.dtype != out.dtype:
                raise ConfigError(f"reduce_scatter input {i} is {tuple(x.shape)}/{x.dtype}, output is {tuple(out.shape)}/{out.dtype}")
        inp = torch.cat([x.detach().reshape(-1) for x in ins]) if ins else out.reshape(-1).clone()
        m = out.numel()

        def build(members: list[str], me: int, seq: int, digest: int) -> tuple[Ledger, Any]:
            self._require_group_of(n0, members, seq, "reduce_scatter", "input")
            n = n0
            S = self._slices(m * out.element_size())
            pieces = [(c * m + a, c * m + b) for c in range(n) for (a, b) in split(m, S)]
            want, algo = [c for c in range(n) for _ in range(S)], RingReduceScatterAllgather(S, shift=1, do_ag=False)
            hier = select_per_member("reduce_scatter", members, self._epoch, m, S) if self.hierarchical else None
            if hier is not None:
                pieces, want, algo = hier[0].pieces, hier[0].owner, hier[1]
            L = Ledger(seq, "reduce_scatter", tuple(members), me, self._epoch.number, digest, inp, torch.empty_like(inp), pieces,
                       want=want)
            return L, algo

        old = self.policy
        if policy is not None:
            self.policy = Policy.parse(policy)
        try:
            L = self._run(desc, build)
        finally:
            self.policy = old
        res = self._finish_avg(L, op)
        me = L.me
        out.copy_(res[me * m:(me + 1) * m].view(out.shape))
        return self._result(L)

    def _allgather(self, outs: list[torch.Tensor], t: torch.Tensor, desc: dict) -> OpResult:
        n0 = len(self._members())
        if len(outs) != n0:
            raise ConfigError(f"allgather needs one output per member ({n0}), got {len(outs)}")
        m = t.numel()
        own = t.detach().reshape(-1).clone()

        def build(members: list[str], me: int, seq: int, digest: int) -> tuple[Ledger, Any]:
            self._require_group_of(n0, members, seq, "allgather", "output")
            n = n0
            S = self._slices(m * t.element_size())
            pieces = [(c * m + a, c * m + b) for c in range(n) for (a, b) in split(m, S)]
            owners, offs = [c for c in range(n) for _ in range(S)], [a for c in range(n) for (a, b) in split(m, S)]
            algo: Any = RingReduceScatterAllgather(S, shift=1, do_rs=False)
            hier = select_per_member("allgather", members, self._epoch, m, S) if self.hierarchical else None
            if hier is not None:
                pieces, owners, offs, algo = hier[0].pieces, hier[0].owner, hier[0].offset, hier[1]
            out = torch.empty(n * m, dtype=t.dtype)
            L = Ledger(seq, "allgather", tuple(members), me, self._epoch.number, digest, own, out, pieces,
                       piece_kind=PieceKind.COPY, owners=owners, inp_offset=offs)
            out[me * m:(me + 1) * m].copy_(own)
            for p, o in enumerate(owners):
                if o == me:
                    L.set(p, 1 << me)
            return L, algo

        L = self._run(desc, build)
        for i, o in enumerate(outs):
            o.copy_(L.out[i * m:(i + 1) * m].view(o.shape))
        return OpResult(tuple(L.members))

    def _broadcast(self, t: torch.Tensor, root: int, desc: dict) -> OpResult:
        n0 = len(self._members())
        if not 0 <= root < n0:
            raise ConfigError(f"broadcast root {root} is not a rank of this {n0}-member group")
        inp = t.detach().reshape(-1).clone()
        root_id = self._members()[root]
        nbytes = inp.numel() * inp.element_size()

        def build(members: list[str], me: int, seq: int, digest: int) -> tuple[Ledger, Any]:
            if root_id not in members:
                from resilient.errors import DataLost

                raise DataLost(f"broadcast #{seq}: the root {root_id} was lost before any survivor got its data")
            r = members.index(root_id)
            S = self._slices(nbytes)
            pieces = split(inp.numel(), S)
            L = Ledger(seq, "broadcast", tuple(members), me, self._epoch.number, digest, inp, torch.empty_like(inp), pieces,
                       piece_kind=PieceKind.COPY, owners=[r] * S)
            return L, _BroadcastWithBarrier(r, S)

        L = self._run(desc, build)
        t.copy_(L.out.view(t.shape))
        return OpResult((root_id,))

    def _p2p_op(self, t: torch.Tensor, peer_rank: int, tag: int, is_send: bool) -> OpResult:
        members = self._members()
        if not 0 <= peer_rank < len(members):
            raise ConfigError(f"rank {peer_rank} is not in this {len(members)}-member group")
        peer = members[peer_rank]
        key = (self.member_id, peer) if is_send else (peer, self.member_id)
        n = self._p2p.get(key, 0)
        self._p2p[key] = n + 1
        seq = (1 << 62) | (n & ((1 << 40) - 1))
        buf = t if t.is_contiguous() else t.contiguous()
        desc = {"k": "p2p", "shape": list(t.shape), "dtype": str(t.dtype)}
        d = self._digest(desc)
        req = self.transport.isend(peer, buf, seq, tag, d) if is_send else self.transport.irecv(peer, buf, seq, tag, d)
        while not self.transport.wait([req], timeout=self.op_timeout):
            self._suspect(peer, f"point-to-point with {peer} waited more than {self.op_timeout}s")
        if not is_send and buf is not t:
            t.copy_(buf)
        return OpResult((peer,))


class _BroadcastWithBarrier:
    """Chain broadcast, then a one-element recursive-doubling barrier in the same op."""

    def __init__(self, root: int, slices: int) -> None:
        self.chain = ChainBroadcast(root, slices)

    def run(self, ctx: OpContext) -> None:
        self.chain.run(ctx)
        L = ctx.ledger
        token = Ledger(ctx.seq, "barrier", L.members, L.me, L.epoch, L.digest, torch.zeros(1, dtype=torch.int32),
                       torch.zeros(1, dtype=torch.int32), [(0, 1)])
        sub = OpContext(ctx.transport, token, ReduceOp.SUM, ctx.op_timeout, ctx.on_suspect, ctx.epoch)
        RecursiveDoubling().run(sub)
