"""``resilient.connect(...)``: a ready :class:`~resilient.Communicator` in one call.

It wires what every member needs, in this order: a :class:`~resilient.coordinator.Store`
on etcd (``RESILIENT_ETCD_*`` TLS/credentials from the environment), the data-plane
transport (``RESILIENT_TRANSPORT``: shared memory on one host + TCP, or TCP only), a
:class:`~resilient.coordinator.MemberSession` (this member's lease and record), an
:class:`~resilient.coordinator.EpochWatcher`, the etcd
:class:`~resilient.collectives.group.EtcdGroupView` and the Communicator; it waits until an
epoch holds this member (and ``world`` members when given). The result,
:class:`ConnectedCommunicator`, is a Communicator whose :meth:`~ConnectedCommunicator.close`
also tears those down, in reverse order. Example (a real etcd on ``127.0.0.1:2379`` and a
coordinator running for job ``demo``; run it in each of two processes)::

    import torch, resilient

    comm = resilient.connect("127.0.0.1:2379", "demo", world=2)
    try:
        t = torch.ones(4)
        comm.allreduce(t)        # t == 2 on both members
    finally:
        comm.close()             # goodbye (waits for the peer's), leaves; transport, watcher, lease, store

Failure behaviour: anything that fails while connecting (etcd unreachable:
:class:`~resilient.errors.StoreUnavailable`; a live member already holds the id:
:class:`~resilient.errors.ConfigError`; no such epoch within ``timeout``:
:class:`~resilient.errors.ResilientTimeout`) closes what was already built (the lease is
revoked, so nothing is left behind) and is raised unchanged. :meth:`close` is safe to call
twice and never raises for an unreachable etcd (the lease then expires after its TTL).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from resilient.collectives.communicator import Communicator
from resilient.collectives.group import EtcdGroupView, GroupView, addresses_of
from resilient.device.probe import member_record
from resilient.device.select import DeviceRecord
from resilient.settings import Settings

if TYPE_CHECKING:  # pragma: no cover
    from resilient.coordinator.epoch import Epoch, EpochWatcher
    from resilient.coordinator.membership import MemberSession
    from resilient.coordinator.store import Store
    from resilient.transport.base import Transport

log = logging.getLogger(__name__)

__all__ = ["connect", "ConnectedCommunicator"]


class _Closable(Protocol):
    def close(self) -> None: ...


class ConnectedCommunicator(Communicator):
    """A :class:`~resilient.Communicator` that owns its control-plane objects
    (``store``, ``session``, ``watcher``; ``transport`` and ``view`` as every Communicator)
    and closes them after itself. Built by :func:`connect`."""

    def __init__(self, view: GroupView, transport: Transport, *, store: Store, session: MemberSession,
                 watcher: EpochWatcher, owns_store: bool, **kwargs: Any) -> None:
        # set before the Communicator starts: a failing constructor is cleaned up by connect()
        self.store, self.session, self.watcher = store, session, watcher
        self._owns_store = owns_store
        self._torn_down = False
        self._handed_over = False  # rejoin(): the successor owns the transport, lease and store
        super().__init__(view, transport, **kwargs)

    def _successor(self) -> Communicator:
        return self._over(self.view, joining=True)

    def _over(self, view: GroupView, **overrides: Any) -> ConnectedCommunicator:
        kwargs = {**self.settings.as_kwargs(), **overrides}
        return ConnectedCommunicator(view, self.transport, store=self.store, session=self.session,
                                     watcher=self.watcher, owns_store=self._owns_store, **kwargs)

    def hand_over(self, view: GroupView, **overrides: Any) -> ConnectedCommunicator:
        """A new Communicator (op seq 0) over ``view`` with this one's settings
        (``overrides``: Communicator keyword arguments to change, e.g. ``joining=False``)
        that takes over this one's transport, session, watcher and store; close this one
        afterwards (its close then leaves them alone and keeps the lease). Used where every
        member rebuilds its Communicator at the same point (the torch backend admitting
        joiners). If building the new one fails, this one still owns them (raised unchanged)."""
        self._handed_over = True
        try:
            return self._over(view, **overrides)
        except BaseException:
            self._handed_over = False
            raise

    def close(self, linger: float = 0.0, leave: bool = True) -> None:
        """Close the Communicator (``leave=True``: this member's lease is revoked now, so
        the peers see an epoch without it at once; see :meth:`Communicator.close`), then
        the transport, the epoch watcher, the member session and — when :func:`connect`
        opened it — the store. Each step is attempted even if an earlier one failed
        (logged); safe to call twice. Before leaving it says goodbye and lingers, at most
        ``min(op_timeout, 10 s)``, until the group's other members finished their last op
        or died (:meth:`_say_goodbye`, :mod:`resilient.goodbye`): a member that closes right
        after the last op never aborts a peer still reading that op's bytes. Handed over
        (``leave`` false in effect): no goodbye."""
        try:
            super().close(linger=linger, leave=leave and not self._handed_over)
        finally:
            if not self._torn_down and not self._handed_over:
                self._torn_down = True
                steps: list[_Closable] = [self.transport, self.watcher, _SessionCloser(self.session)]
                _close_all(steps + ([self.store] if self._owns_store else []))

    def _say_goodbye(self, stop: Callable[[], bool] | None = None) -> bool:
        """The goodbye of :mod:`resilient.goodbye` (before the lease is revoked): put this
        member's goodbye and wait, at most ``min(op_timeout, 10 s)``, for the other members
        of the group to have put theirs or left the newest epoch (or until ``stop()``).
        True when none is owed. Never raises: an etcd error is logged and counts as not
        known (False)."""
        from resilient import goodbye

        epoch = self.epoch
        if len(epoch.members) < 2:
            return True
        if self.view.session_lost():   # removed already: the peers finish without us
            return False
        try:
            owed = goodbye.farewell(self.store, self.session.job, self.member_id, self.session.lease_id,
                                    addresses_of(epoch), self.next_seq, self.watcher.current,
                                    self.watcher.subscribe, goodbye.linger_bound(self.op_timeout), stop)
        except Exception as exc:  # noqa: BLE001 - leaving goes on as it would without a goodbye
            log.info("close: goodbye of %s failed (leaving without it): %s", self.member_id, exc)
            return False
        return not owed

    def rejoin(self, timeout: float | None = None) -> Communicator:
        """:meth:`Communicator.rejoin`; the returned Communicator (also a
        ``ConnectedCommunicator``) takes over the transport, session, watcher and store, so
        this one's close does not tear them down. If rejoining fails, this one owns them
        again (call ``rejoin`` again, or :meth:`close`)."""
        self._handed_over = True
        try:
            return super().rejoin(timeout)
        except BaseException:
            self._handed_over = False
            raise


class _SessionCloser:
    """``session.close()`` with revocation (a member that leaves drops its lease)."""

    def __init__(self, session: MemberSession) -> None:
        self.session = session

    def close(self) -> None:
        self.session.close(revoke=True, reason="closed")


def _close_all(objs: Sequence[_Closable]) -> None:
    for obj in objs:
        try:
            obj.close()
        except Exception as exc:  # noqa: BLE001 - teardown goes on; a cancellation signal is not expected here
            log.info("connect: closing %s failed: %s", type(obj).__name__, exc)


def connect(etcd: str | Sequence[str] | None = None, job: str | None = None, member_id: str | None = None, *,
            world: int | None = None, timeout: float = 60.0, ttl: float | None = None,
            lease_id: int | None = None, host: str | None = None, host_label: str | None = None,
            labels: dict[str, str] | None = None, local_rank: int = 0,
            device: str | DeviceRecord | None = None, store: Store | None = None, transport: Transport | None = None,
            wrap_transport: Callable[[Transport], Transport] | None = None,
            wrap_view: Callable[[EtcdGroupView], GroupView] | None = None,
            on_registered: Callable[[MemberSession], None] | None = None, health_reports: bool = False,
            **communicator_kwargs: Any) -> ConnectedCommunicator:
    """Join job ``job`` on etcd ``etcd`` as ``member_id`` and return a ready Communicator.

    Unset arguments come from the environment (:class:`~resilient.settings.Settings`:
    ``RESILIENT_ETCD``, ``RESILIENT_JOB``, ``RESILIENT_MEMBER_ID`` (else a generated id),
    ``RESILIENT_LEASE_ID``, ``RESILIENT_LEASE_TTL``, ``RESILIENT_HOST``). ``world``: also
    wait for an epoch of that many members; ``timeout``: seconds to wait for the epoch;
    ``host``: the address the data-plane listener binds; ``host_label``: the host this
    member counts as for hierarchical plans (default: the host name); ``labels``,
    ``local_rank``: the member's topology labels (e.g. ``rack``) and local rank (see
    :class:`~resilient.coordinator.MemberInfo`); ``device``: where this member's tensors
    live (``"cpu"``, ``"cuda:N"``; published in its member record with the GPU UUID and
    whether NCCL loads, :mod:`resilient.device.probe`, so that each epoch can choose NCCL
    for CUDA tensors: docs/cuda.md; a :class:`~resilient.device.select.DeviceRecord` is
    published as given); ``store``/``transport``: use these instead
    of opening new ones (a given store is not closed by :meth:`close`; a given transport
    is); ``wrap_transport``: applied to the new transport (e.g.
    :func:`resilient.transport.shaping.shaped_from_env`); ``wrap_view``: applied to the
    group view before the Communicator is built (e.g. the torch backend's admission
    gate); ``on_registered``: called with the member session once the member is registered
    (its lease exists), before the wait for the epoch (e.g. to tell a supervisor the lease
    id and wait for its go; what it raises is handled as any failure while connecting);
    ``health_reports``: the Communicator reports per-op health windows to the
    coordinator's straggler detector (:class:`~resilient.health_reporter.HealthReporter`
    on this member's lease). Other keyword arguments go to
    :class:`~resilient.Communicator` (``op_timeout``, ``policy``, ``joining``, ...).
    See the module docstring for the failure behaviour."""
    from resilient.agent_channel import AgentSession, agent_socket, join_via_agent
    from resilient.coordinator.epoch import EpochWatcher
    from resilient.coordinator.etcd_access import open_store_from_env
    from resilient.coordinator.membership import MemberInfo, MemberSession
    from resilient.errors import ConfigError
    from resilient.transport.hybrid import make_transport

    settings = Settings.from_env()
    job = job or settings.job
    if not job:
        raise ConfigError("connect(): no job name: pass job= or set RESILIENT_JOB")
    mid = member_id or settings.member_id or f"m-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    built: list[_Closable] = []
    try:
        if store is None:
            endpoints = etcd or settings.etcd
            if not endpoints:
                raise ConfigError("connect(): no etcd endpoints: pass etcd='host:port' or set RESILIENT_ETCD")
            store = open_store_from_env(endpoints)
            built.append(store)
        owns_store = bool(built)
        if transport is None:
            transport = make_transport(mid, job, host=host or settings.host)
            if wrap_transport is not None:
                transport = wrap_transport(transport)
        built.append(transport)
        info = MemberInfo(member_id=mid, address=transport.address, labels=dict(labels or {}), local_rank=local_rank)
        host_label = host_label or settings.host_label   # RESILIENT_HOST_LABEL
        if host_label:
            info = dataclasses.replace(info, host=host_label)
        if device is not None:
            rec = member_record(mid, info.host, device)
            info = dataclasses.replace(info, device=rec.device, labels={**info.labels, **rec.labels()})
        agent_path = agent_socket()   # resilient-run's node-lease mode: join through the node agent
        session: MemberSession
        if agent_path is not None:
            session, watcher = join_via_agent(store, job, info, agent_path, timeout)
        else:
            session = MemberSession.register(store, job, info, ttl=ttl or settings.lease_ttl,
                                             lease_id=lease_id if lease_id is not None else settings.lease_id)
            watcher = EpochWatcher(store, job)
        built += [_SessionCloser(session), watcher]
        if on_registered is not None:
            on_registered(session)
        if health_reports:
            from resilient.health_reporter import HealthReporter

            communicator_kwargs["health_reporter"] = HealthReporter(
                store, job, mid, session.lease_id, transport.stats,
                sink=session.send_health if isinstance(session, AgentSession) else None)

        def ready(e: Epoch) -> bool:
            return mid in e.members and (world is None or len(e.members) == world)

        watcher.wait_for(ready, timeout)
        etcd_view = EtcdGroupView(store, job, session, watcher)
        view: GroupView = etcd_view if wrap_view is None else wrap_view(etcd_view)
        return ConnectedCommunicator(view, transport, store=store,
                                     session=session, watcher=watcher, owns_store=owns_store, **communicator_kwargs)
    except BaseException:
        _close_all(list(reversed(built)))
        raise
