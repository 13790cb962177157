"""The real :class:`~.engine.Engine`: :class:`resilient.collectives.Communicator` bound to
the job's control plane, built from the environment ``resilient-run`` gives a worker.

``from_environment(store=, rank=, size=, timeout=)`` (called by
``dist.init_process_group("resilient")``):

1. reads ``RESILIENT_ETCD``, ``RESILIENT_JOB``, ``RESILIENT_MEMBER_ID`` (default: a fresh
   id), ``RESILIENT_LEASE_ID`` (the agent's lease; default: our own), ``RESILIENT_LEASE_TTL``,
   ``RESILIENT_HOST``, ``RESILIENT_JOINER`` (:class:`~resilient.settings.Settings`) and the
   etcd TLS/credential variables ``RESILIENT_ETCD_{CA_CERT,CERT,KEY,USER,
   PASSWORD_FILE,PASSWORD}`` (:mod:`resilient.coordinator.etcd_access`);
2. connects with :func:`resilient.connect` (the data-plane transport listener, a
   :class:`MemberSession` whose ``MemberInfo.address`` is that listener, the epoch watcher);
3. ``connect`` waits (up to the ``timeout`` given to ``init_process_group``) for an epoch that
   contains this member (a joiner is admitted by the coordinator in the next epoch).
   Outside ``resilient-run`` (no ``RESILIENT_MEMBER_ID``: mp.spawn, torchrun, torch's test
   suite) the member registers with ``local_rank`` = the ``rank`` given to
   ``init_process_group`` (the planner orders a host's members by it), waits for an epoch
   of exactly ``world_size`` members, and checks that it sits at that rank — unless members
   of that epoch started before it (a restarted rank: :mod:`.start_markers`), which makes
   it a joiner, as below;
4. the Communicator is built on the etcd-backed group view behind an
   :class:`AdmittedView`, with per-op health reports (and rank metrics where the node
   agent serves them). ``send``/``recv`` are the Communicator's
   (:mod:`resilient.collectives.p2p`: ops of a batch posted together, carried across an
   epoch change).

The torch ``store`` (the launcher's TCPStore) is not used: etcd is the rendezvous.

Joiners (``RESILIENT_JOINER=1``: a restarted worker, or one on a node that joined later;
outside ``resilient-run``, a process restarted with ``init_process_group(rank=, world_size=)``
while its peers are past their start) start **not admitted**: their Communicator is behind a :class:`NotAdmittedGate`. They are
admitted at ``resilient.elastic.State.sync()`` (:meth:`CommunicatorEngine.wait_admitted`,
after which the gate is gone and the first op is the state transfer, at op seq 0 on every
member). A joiner whose script issues any other collective first (an unchanged
torch.distributed script: DDP's constructor, a plain ``dist.all_reduce``) can never be in
the survivors' ops — they run theirs at other sequence numbers over the members without
it, so such an op could only hang or mix unrelated data — so the gate ends the process
with exit code 0 and a message saying why (:func:`leave_unadmitted`); the job goes on
with the survivors and its status stays a success.

Failure behaviour: missing variables -> :class:`~resilient.errors.ConfigError` naming
them and that ``resilient-run`` sets them; the ring putting this member at another rank
than the one asked for -> ConfigError (two processes asked for one rank, or host names that
do not sort in rank order); etcd down -> StoreUnavailable; no epoch with
us in time -> :class:`~resilient.errors.ResilientTimeout` naming the last epoch; the Communicator not importable ->
ConfigError saying so. Once running, a member removed from the job (lease expired) gets
RemovedFromGroup from :meth:`CommunicatorEngine.world` and every op.
"""
from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn, Protocol, Sequence, Union

import torch

from resilient.collectives.group import EpochLike, EtcdGroupView, GroupView
from resilient.coordinator import keys
from resilient.errors import ConfigError, ResilientTimeout
from resilient.live_world import World
from resilient.settings import Settings
from resilient.torch_backend.views import FilteredView, replace_epoch

if TYPE_CHECKING:  # pragma: no cover
    from resilient.collectives.communicator import Communicator
    from resilient.collectives.work import Work
    from resilient.connection import ConnectedCommunicator
    from resilient.coordinator.epoch import EpochWatcher
    from resilient.coordinator.membership import MemberSession
    from resilient.coordinator.store import Store
    from resilient.transport.base import Transport

    #: what an engine runs its ops on: a Communicator, or a joiner's behind its gate
    Comm = Union[Communicator, "NotAdmittedGate"]


class _Closable(Protocol):
    def close(self) -> None: ...


class CommunicatorEngine:
    """Adapts a Communicator to the :class:`~.engine.ElasticEngine` protocol (in-place results).
    ``closers``: closed after the Communicator (a Communicator built by
    :func:`resilient.connect` closes its transport, watcher, session and store itself)."""

    def __init__(self, comm: Comm, watcher: EpochWatcher, session: MemberSession, member_id: str,
                 closers: Sequence[_Closable] = (), store: Store | None = None, job: str = "",
                 transport: Transport | None = None) -> None:
        self.comm = comm
        self.watcher = watcher
        self.session = session
        self.member_id = member_id
        self._closers = list(closers)
        self._store, self.job, self._transport = store, job, transport
        #: False on a joiner until :meth:`wait_admitted` returns (ops go through the gate)
        self.admitted = not isinstance(comm, NotAdmittedGate)

    @property
    def admits_by_rebuild(self) -> bool:
        """Joiners are admitted by :meth:`rebuild` (:class:`~.engine.ElasticEngine`)."""
        return True

    @property
    def store(self) -> Store:
        if self._store is None:
            raise ConfigError("this engine was built without a store (a unit-test engine)")
        return self._store

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise ConfigError("this engine was built without a transport (a unit-test engine)")
        return self._transport

    def _comm_members(self) -> list[str]:
        return list(self.comm.members)

    # -- admitting joiners ----------------------------------------------------------------

    def _ready_prefix(self) -> str:
        return keys.root(self.job).rstrip("/") + "/sync-ready/"

    def announce_ready(self) -> None:
        """A joiner says it is waiting in ``State.sync()`` (key on its own lease, so it
        vanishes with it). Until then the others keep training instead of waiting for it.
        It also marks itself admitted over its own (fresh) epoch in ``sync-rebuilt/``: joiners
        admitted in the same epoch (a whole node) are in each other's Communicator, and each
        waits in :meth:`wait_admitted` only for members that are not fresh themselves."""
        self.store.put(self._ready_prefix() + self.member_id, b"1", lease=self.session.lease_id)
        self.store.put(self._rebuilt_prefix() + self.member_id, str(self._comm_epoch()).encode(),
                       lease=self.session.lease_id)

    def mark_done(self) -> None:
        """Record that training finished (a key under the job, no lease), so a joiner that
        arrives too late learns it instead of failing. Failure: StoreError propagates."""
        self.store.put(self._ready_prefix() + "~done", b"1")

    def job_done(self) -> bool:
        return self.store.get(self._ready_prefix() + "~done") is not None

    def pending_joiners(self) -> bool:
        """True when the newest epoch has members this communicator does not run ops with
        (joiners the coordinator admitted; the Communicator's group only shrinks) and all
        of them announced they are ready to sync. Failure behaviour: etcd errors propagate
        (StoreError) — the caller's sync() fails rather than guess."""
        epoch = self.watcher.current()
        if epoch is None or self.member_id not in epoch.members:
            return False
        group = set(self._comm_members())
        new = [m for m in epoch.members if m not in group]
        if not new:
            return False
        ready = {keys.last_segment(kv.key) for kv in self.store.get_prefix(self._ready_prefix())}
        if "~done" in ready:  # training finished: admit no one any more
            return False
        return all(m in ready for m in new)

    def rebuild(self, min_epoch: int, timeout: float = 60.0) -> None:
        """Replace the Communicator by a fresh one over the members of the newest epoch
        (numbered at least ``min_epoch``); op sequence numbers restart at 0, as they do in
        a joiner's fresh Communicator. Called by every member at the same point
        (``State.sync()`` agrees on it). Failure behaviour: no such epoch within
        ``timeout`` -> :class:`~resilient.errors.ResilientTimeout`; an engine whose
        Communicator :func:`resilient.connect` did not build -> ConfigError; the old
        Communicator is closed (keeping the lease, transport and watcher, which the new
        one takes over) only after the new one exists. The new one takes over the old
        one's free pooled buffers (its first ops after an admission then allocate nothing)."""
        from resilient.connection import ConnectedCommunicator

        self.watcher.wait_for(lambda e: e.number >= min_epoch and self.member_id in e.members, timeout)
        old = self.comm
        connected = old.inner if isinstance(old, NotAdmittedGate) else old
        if not isinstance(connected, ConnectedCommunicator):
            raise ConfigError("rebuild(): this engine's Communicator was not built by resilient.connect "
                              "(a dist.new_group engine); only the world's engine admits joiners")
        view = AdmittedView.of_current(EtcdGroupView(self.store, self.job, self.session, self.watcher))
        self.comm = connected.hand_over(view, joining=False)
        self.admitted = True  # (a joiner rebuilds only inside wait_admitted, i.e. while being admitted)
        old.close()
        self.comm.adopt_buffer_pool(old.inner if isinstance(old, NotAdmittedGate) else old)
        # tell the joiners our transport now accepts them (see wait_admitted)
        self.store.put(self._rebuilt_prefix() + self.member_id, str(self._comm_epoch()).encode(),
                       lease=self.session.lease_id)

    def _rebuilt_prefix(self) -> str:
        return keys.root(self.job).rstrip("/") + "/sync-rebuilt/"

    def _comm_epoch(self) -> int:
        """The number of the epoch the Communicator runs on (the watcher's newest when it
        has none yet)."""
        epoch = self.comm.epoch
        if epoch is not None and epoch.number:
            return epoch.number
        current = self.watcher.current()
        return current.number if current is not None else 0

    def wait_admitted(self, timeout: float = 120.0) -> None:
        """Joiner side: wait until every other member of our Communicator has rebuilt its
        own over our epoch (before that their transports refuse our connections). Re-reads
        ``sync-rebuilt/`` at every change to it (an etcd watch,
        :class:`resilient.coordinator.wake.PrefixWake`; else every 0.1 s). Failure behaviour:
        :class:`~resilient.errors.ResilientTimeout` naming the members that did not rebuild; a member that dies meanwhile
        is dropped from the wait when an epoch removes it."""
        import time

        from resilient.coordinator.wake import PrefixWake

        wake = PrefixWake(self.store, self._rebuilt_prefix())
        try:
            self._wait_admitted(wake, time.monotonic() + timeout, timeout)
        finally:
            wake.close()

    def _wait_admitted(self, wake: Any, deadline: float, timeout: float) -> None:
        import time

        from resilient.coordinator import keys

        mine = self._comm_epoch()
        while True:
            others = [m for m in self._comm_members() if m != self.member_id]
            current = self.watcher.current()
            if current is not None:
                others = [m for m in others if m in current.members]
            have = {}
            for kv in self.store.get_prefix(self._rebuilt_prefix()):
                try:
                    have[keys.last_segment(kv.key)] = int(kv.value)
                except ValueError:
                    continue
            newer = [have[m] for m in others if have.get(m, -1) > mine]
            if newer:
                # they admitted us over a newer epoch than the one our Communicator was built
                # on (a node's joiners admitted in two epochs, one by one): run with their
                # members, or our first op (the transfer) waits on a different ring forever
                self.rebuild(max(newer), timeout=max(1.0, deadline - time.monotonic()))
                mine = self._comm_epoch()
                continue
            missing = [m for m in others if have.get(m, -1) < mine]
            if not missing or self.job_done():
                self._open_gate()
                return
            if time.monotonic() > deadline:
                raise ResilientTimeout(f"joiner {self.member_id}: members {missing} did not admit it (rebuild their "
                                       f"communicator over epoch {mine}) within {timeout:.0f}s")
            wake.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def _open_gate(self) -> None:
        """Admitted: from now on ops run on the Communicator itself."""
        if isinstance(self.comm, NotAdmittedGate):
            self.comm = self.comm.inner
        self.admitted = True

    def world(self) -> World:
        epoch = self.watcher.current()
        if epoch is None:
            raise ConfigError("no epoch published yet for this job; is a coordinator running?")
        members = epoch.members
        if self.member_id in epoch.members:
            # the members the communicator actually runs ops with (a member it has not
            # admitted yet is not counted: ranks/sizes never include someone not in the ops)
            admitted = set(self._comm_members())
            members = tuple(m for m in epoch.members if m in admitted)
        return World.from_members(self.member_id, epoch.number, members)

    def allreduce(self, tensor: torch.Tensor, op: str) -> Work:
        return self.comm.allreduce(tensor, op=op, async_op=True)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self.comm.broadcast(tensor, root=root, async_op=True)

    def allgather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        return self.comm.allgather(list(outputs), tensor, async_op=True)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str) -> Work:
        return self.comm.reduce_scatter(output, list(inputs), op=op, async_op=True)

    def barrier(self) -> Work:
        return self.comm.barrier(async_op=True)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self.comm.send(tensor, dst, tag=tag, async_op=True)  # a joiner's gate refuses it (leave_unadmitted)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return self.comm.recv(tensor, src, tag=tag, async_op=True)

    def recv_any(self, tensor: torch.Tensor, tag: int) -> Work:
        return self.comm.recv_any(tensor, tag=tag, async_op=True)

    def close(self) -> None:
        for c in [self.comm, *self._closers]:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


def _required(value: str | None, name: str) -> str:
    if not value:
        raise ConfigError(f"dist.init_process_group('resilient') needs ${name}; run the script under "
                          "`resilient-run` (it sets RESILIENT_ETCD and RESILIENT_JOB), or set them yourself")
    return value


def from_environment(store: Any = None, rank: int = 0, size: int = 1,
                     timeout: timedelta = timedelta(minutes=5)) -> CommunicatorEngine:
    """Build the engine for this worker (see the module docstring). ``store`` (torch's
    rendezvous store) is not used."""
    settings = Settings.from_env()
    endpoints = _required(settings.etcd, "RESILIENT_ETCD")
    job = _required(settings.job, "RESILIENT_JOB")
    try:
        from resilient.connection import connect
    except ImportError as exc:
        raise ConfigError(f"the resilient collectives (resilient.collectives.Communicator) are not "
                          f"available: {exc}") from exc
    from resilient.metrics import multiprocess_enabled, rank_metrics
    from resilient.device.probe import this_device

    # launched by our own agent: it placed us; otherwise (mp.spawn, torchrun, torch's test
    # suite) the rank given to init_process_group is the ring position we register for,
    # and we wait for all `size` members, and only them (a dead earlier run's leases expire first)
    explicit = settings.member_id is None
    member_id = settings.member_id or f"m-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    # per-op health windows feed the coordinator's straggler detector (low rate, never
    # fails an op); metrics only where the node agent serves them (resilient-run
    # --metrics-port sets PROMETHEUS_MULTIPROC_DIR for its workers)
    extra: dict[str, Any] = {"metrics": rank_metrics()} if multiprocess_enabled() else {}
    connected = connect(endpoints, job, member_id, world=size if explicit else None,
                        timeout=timeout.total_seconds(), ttl=settings.lease_ttl, lease_id=settings.lease_id,
                        host=settings.host, local_rank=rank if explicit else int(os.environ.get("LOCAL_RANK", "0")),
                        wrap_view=AdmittedView.of_current, health_reports=True, joining=False,
                        device=this_device(), **extra)
    # outside resilient-run, a process whose peers started before it (a restarted rank) is a
    # joiner too (start_markers.py): gated like RESILIENT_JOINER=1, never run into their ops
    joiner = settings.joiner or (explicit and _joins_running_job(connected, job, member_id))
    comm: Comm = NotAdmittedGate(connected, member_id) if joiner else connected
    engine = CommunicatorEngine(comm, connected.watcher, connected.session, member_id,
                                store=connected.store, job=job, transport=connected.transport)
    if explicit and not joiner and engine.world().rank != rank:
        got = engine.world()
        engine.close()
        raise ConfigError(f"init_process_group asked for rank {rank}, but epoch {got.epoch} of job {job!r} puts this "
                          f"member at rank {got.rank} of {list(got.members)}: two processes asked for the same rank, "
                          "or they run on hosts whose names do not sort in rank order (use resilient-run there)")
    return engine


def _joins_running_job(connected: ConnectedCommunicator, job: str, member_id: str) -> bool:
    """Explicit-rank start: mark this member started and say whether members of its epoch
    started before it (:mod:`.start_markers`; etcd errors propagate)."""
    from resilient.torch_backend import start_markers

    members = connected.epoch.members
    before = start_markers.started_without(connected.store, job, member_id, members)
    start_markers.mark_started(connected.store, job, member_id, members, connected.session.lease_id)
    return bool(before)


def leave_unadmitted(member_id: str, op: str) -> NoReturn:
    """End a joiner that issued ``op`` before being admitted: say why on stderr, exit 0
    (``os._exit``: the op may run on a thread of torch's, where SystemExit would be turned
    into a RuntimeError; nothing of this process has been shared yet). The node agent
    revokes the lease when the process exits."""
    import sys

    msg = (f"[resilient] joiner {member_id} is not admitted to the running job: its first collective "
           f"({op}) came before resilient.elastic.State.sync(), the step boundary where the members "
           "admit and sync joiners, so it could never be part of their ops. The job goes on with the "
           "survivors; this worker exits with code 0. To have restarted workers rejoin, keep the "
           "training state in resilient.elastic.State and call state.sync() at the start of each step "
           "(docs/ddp.md).")
    from resilient.script_exit import deliberate

    try:
        deliberate("joiner not admitted")
        sys.stdout.flush()
        print(msg, file=sys.stderr, flush=True)
    finally:
        os._exit(0)


class NotAdmittedGate:
    """Stands for a joiner's Communicator until it is admitted (see the module docstring):
    its ``members``, ``rank``, ``size``, ``epoch``, ``next_seq`` and ``close`` are the
    Communicator's; each op calls ``on_op(member_id, name)`` — by default
    :func:`leave_unadmitted`, which never returns — instead of running. ``inner`` is the
    Communicator."""

    def __init__(self, inner: Communicator, member_id: str,
                 on_op: Callable[[str, str], NoReturn] = leave_unadmitted) -> None:
        self.inner = inner
        self.member_id = member_id
        self._on_op = on_op

    @property
    def members(self) -> list[str]:
        return self.inner.members

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def epoch(self) -> EpochLike:
        return self.inner.epoch

    @property
    def next_seq(self) -> int:
        return self.inner.next_seq

    def close(self) -> None:
        self.inner.close()

    def _refuse(self, op: str) -> NoReturn:
        self._on_op(self.member_id, op)

    def allreduce(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("allreduce")

    def broadcast(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("broadcast")

    def allgather(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("allgather")

    def reduce_scatter(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("reduce_scatter")

    def barrier(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("barrier")

    def send(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("send")

    def recv(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("recv")

    def recv_any(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("recv")


class AdmittedView(FilteredView):
    """A GroupView that shows each epoch with only the *admitted* members (the newest
    epoch's members when the Communicator was built; members leave it by dying, never
    join it). So the Communicator never adopts a growing epoch by itself at an arbitrary
    op boundary: a joiner takes part only from the ``State.sync()`` where every member
    rebuilds its Communicator over the grown epoch (op seq 0 on all of them, joiner
    included). Everything else is the etcd-backed view's (:class:`~.views.FilteredView`)."""

    def __init__(self, inner: GroupView, admitted: Iterable[str]) -> None:
        super().__init__(inner)
        self.admitted = frozenset(admitted)

    @classmethod
    def of_current(cls, inner: GroupView) -> "AdmittedView":
        """Admitting the members of ``inner``'s newest epoch (none if there is none)."""
        epoch = inner.current()
        return cls(inner, epoch.members if epoch is not None else ())

    def filter_epoch(self, epoch: EpochLike) -> EpochLike:
        members = tuple(m for m in epoch.members if m in self.admitted)
        if members == tuple(epoch.members):
            return epoch
        return replace_epoch(epoch, members=members, added=tuple(m for m in epoch.added if m in self.admitted))
