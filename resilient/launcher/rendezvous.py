"""Node rendezvous through etcd, lease keep-alive, and the agent-hosted TCPStore.

**Node ranks (``--nnodes MIN:MAX`` with etcd).** Every agent holds one *node lease*
(``--lease-ttl``, kept alive by :class:`LeaseKeeper`) and claims the lowest free slot
``/resilient/<job>/slots/<i>`` for ``i`` in ``0..MAX-1`` with a create-if-absent
transaction attached to that lease; the slot number is its ``GROUP_RANK``. Slots of dead
agents free themselves when their lease expires (or is revoked on a clean exit), so a
replacement node gets the lost node's rank. No slot free -> wait (up to ``join_timeout``)
for one to free up, then fail with a clear error.

The job *starts* when ``MIN`` slots are taken (after an optional ``last_call_timeout`` to
gather more, up to ``MAX``): the first agent to see that creates
``/resilient/<job>/launcher/started`` (create-if-absent, no lease) holding the slots and agent
ids of the initial group and its master address; every agent reads that one record, so all agree on
``GROUP_WORLD_SIZE`` and ``MASTER_ADDR/PORT``. An agent not in the record arrived
later (also a replacement that reuses a dead node's slot): it is admitted (slots never exceed MAX) and its workers start as joiners
(``RESILIENT_JOINER=1``); resilient's coordinator admits them at an op boundary.

Failure behaviour: etcd unreachable -> :class:`~resilient.errors.StoreUnavailable` within
the store's retry budget (never a hang); MIN not reached within ``join_timeout`` ->
:class:`RendezvousTimeout` naming how many nodes came. If the node lease is lost (agent
stalled past its TTL) the keeper logs it and the agent goes on; the coordinator has
already treated that node's members as gone. Node records that are malformed
(``resilient.coordinator.records``) are skipped, logged and counted; a malformed
``launcher/started`` record raises :class:`~resilient.errors.ResilientError` naming the
key to delete.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypedDict

from resilient.coordinator import records
from resilient.errors import LeaseExpired, RecordError, RendezvousTimeout, ResilientError, StoreError

log = logging.getLogger(__name__)


class NodeRecord(TypedDict):
    """A ``slots/<i>`` record: the agent holding node slot ``i`` (not under ``nodes/``,
    which holds the node agents' membership records, docs/scale.md)."""

    addr: str
    store_port: int
    nproc: int
    host: str
    agent: str


class StartedRecord(TypedDict):
    """The ``launcher/started`` record: the rendezvous round that started the job."""

    nodes: list[int]
    agents: list[str]
    master_addr: str
    master_port: int
    time: float


def parse_node(raw: bytes, key: str = "") -> NodeRecord:
    """Validate a ``slots/<i>`` record ({addr, store_port, nproc, host, agent});
    :class:`~resilient.errors.RecordError` if malformed."""
    f = records.fields("node", raw, key)
    return {"addr": f.str("addr", max_len=255), "store_port": f.int("store_port", hi=65535),
            "nproc": f.int("nproc", lo=1, hi=1 << 20), "host": f.str("host", "", max_len=255),
            "agent": f.name("agent")}


def parse_started(raw: bytes, key: str = "") -> StartedRecord:
    """Validate the ``launcher/started`` record ({nodes, agents, master_addr,
    master_port, time}); :class:`~resilient.errors.RecordError` if malformed."""
    f = records.fields("rendezvous", raw, key)
    return {"nodes": list(f.ints("nodes", hi=1 << 20)), "agents": list(f.names("agents")),
            "master_addr": f.str("master_addr", max_len=255), "master_port": f.int("master_port", lo=1, hi=65535),
            "time": f.float("time", 0.0)}


def slots_prefix(job: str) -> str:
    return f"/resilient/{job}/slots/"


def started_key(job: str) -> str:
    return f"/resilient/{job}/launcher/started"


def member_key(job: str, member_id: str) -> str:
    return f"/resilient/{job}/members/{member_id}"


class LeaseKeeper:
    """One thread refreshing a set of leases every ``ttl/3`` seconds.

    A lease added with ``until`` is refreshed only until ``until()`` returns True (used to
    hand a worker's lease over to the worker's own keep-alive once it registered). A lease
    etcd reports gone is dropped (and logged).
    """

    def __init__(self, store: Any, ttl: float) -> None:
        self._store = store
        self._interval = max(0.2, ttl / 3.0)
        self._leases: dict[int, Callable[[], bool] | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def add(self, lease_id: int, until: Callable[[], bool] | None = None) -> None:
        with self._lock:
            self._leases[lease_id] = until

    def remove(self, lease_id: int) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def kept(self) -> set[int]:
        with self._lock:
            return set(self._leases)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                items = list(self._leases.items())
            for lease_id, until in items:
                try:
                    if until is not None and until():
                        self.remove(lease_id)
                        continue
                    self._store.keepalive(lease_id, budget=self._interval)
                except LeaseExpired:
                    log.warning("lease %x is gone (expired or revoked); no longer refreshing it", lease_id)
                    self.remove(lease_id)
                except StoreError as exc:
                    log.warning("keep-alive of lease %x failed: %s", lease_id, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass(frozen=True)
class NodeSlot:
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    joiner: bool


def local_address(local_addr: str | None) -> str:
    return local_addr or socket.getfqdn()


class NodeRendezvous:
    """Registers this agent as a node of ``job`` (see the module docstring)."""

    def __init__(self, store: Any, job: str, keeper: LeaseKeeper, ttl: float) -> None:
        self.store = store
        self.job = job
        self.lease = store.grant(ttl)
        self.agent_id = f"{self.lease:x}"  # unique per agent run (a slot may be reused)
        keeper.add(self.lease)
        self.group_rank: int | None = None

    def join(self, min_nodes: int, max_nodes: int, nproc: int, addr: str, store_port: int,
             join_timeout: float = 600.0, last_call: float = 0.0, poll: float = 0.1) -> NodeSlot:
        deadline = time.monotonic() + join_timeout
        info = {"addr": addr, "store_port": store_port, "nproc": nproc, "host": socket.gethostname(),
                "agent": self.agent_id}
        payload = json.dumps(info).encode()
        prefix = slots_prefix(self.job)
        while self.group_rank is None:
            for i in range(max_nodes):
                if self.store.create(f"{prefix}{i}", payload, lease=self.lease):
                    self.group_rank = i
                    break
            else:
                if time.monotonic() > deadline:
                    raise RendezvousTimeout(
                        f"job {self.job!r} already has --nnodes max={max_nodes} nodes and no slot freed up "
                        f"within {join_timeout:.0f}s; raise MAX in --nnodes or stop a node"
                    )
                time.sleep(poll)
        log.info("node registered as group rank %d of job %s", self.group_rank, self.job)
        reached_at: float | None = None
        while True:
            rec = self.store.get(started_key(self.job))
            if rec is not None:
                break
            nodes = self._nodes()
            if len(nodes) >= min_nodes:
                reached_at = reached_at or time.monotonic()
                if len(nodes) >= max_nodes or time.monotonic() - reached_at >= last_call:
                    first = min(nodes)
                    record = {"nodes": sorted(nodes), "agents": [n["agent"] for n in nodes.values()],
                              "master_addr": nodes[first]["addr"],
                              "master_port": nodes[first]["store_port"], "time": time.time()}
                    self.store.create(started_key(self.job), json.dumps(record).encode())
                    continue  # read back whichever record won
            elif time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"only {len(nodes)} of --nnodes min={min_nodes} nodes joined job {self.job!r} within "
                    f"{join_timeout:.0f}s; start the other agents with the same --rdzv-endpoint and "
                    "--rdzv-id, or lower MIN (--rdzv-conf join_timeout=SECONDS to wait longer)"
                )
            time.sleep(poll)
        try:
            started = parse_started(rec.value, rec.key)
        except RecordError as exc:
            raise ResilientError(f"{exc}; every agent of job {self.job!r} reads this one record: delete the key "
                                 "(etcdctl del KEY) and start the agents again") from None
        nodes = self._nodes()
        for gr, n in nodes.items():
            if n["nproc"] != nproc:
                raise ResilientError(
                    f"node {gr} runs --nproc-per-node {n['nproc']} but this node {nproc}; "
                    "resilient-run needs the same --nproc-per-node on every node"
                )
        initial = self.agent_id in started["agents"]
        return NodeSlot(
            group_rank=self.group_rank,
            group_world_size=len(started["nodes"]) if initial else max(len(nodes), len(started["nodes"])),
            master_addr=started["master_addr"],
            master_port=int(started["master_port"]),
            joiner=not initial,
        )

    def _nodes(self) -> dict[int, NodeRecord]:
        """Every node slot's record; malformed ones skipped (logged, counted as ``node``)."""
        prefix = slots_prefix(self.job)
        out: dict[int, NodeRecord] = {}
        for kv in self.store.get_prefix(prefix):
            try:
                slot = kv.key[len(prefix):]
                if not slot.isdigit() or len(slot) > 6:
                    raise RecordError(f"bad node record at {kv.key}: the key does not end in a slot number",
                                      "node", kv.key)
                out[int(slot)] = parse_node(kv.value, kv.key)
            except RecordError as exc:
                records.skip(exc, kv.key)
        return out

    def leave(self) -> None:
        """Free our slot at once (revoke the node lease)."""
        try:
            self.store.revoke(self.lease)
        except StoreError as exc:
            log.warning("could not revoke node lease %x: %s (it expires after its TTL)", self.lease, exc)


def host_tcp_store(addr: str, port: int, bind: str | None = None) -> tuple[Any, int]:
    """Host torch's TCPStore the workers reach through MASTER_ADDR/MASTER_PORT
    (``TORCHELASTIC_USE_AGENT_STORE=True``), as torchrun's agent does. ``port`` 0 picks a
    free port. ``bind`` (e.g. ``127.0.0.1`` under ``--standalone``): listen on that address
    only (torch's own server listens on every interface; we hand it a socket bound here).
    Raises ``ResilientError`` naming the port when it is taken."""
    import socket
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore  # torch.distributed.TCPStore (re-exported there without __all__)

    try:
        fd = None
        if bind is not None:
            sock = socket.create_server((bind, port), backlog=128)
            port = sock.getsockname()[1]
            fd = sock.detach()   # the store owns the listening socket from here on
        store = TCPStore(host_name=bind or addr, port=port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30), master_listen_fd=fd)
    except (RuntimeError, OSError) as exc:
        raise ResilientError(
            f"cannot host the workers' TCPStore on port {port}: {exc}; the port is probably in use, "
            "pass another --master-port"
        ) from exc
    return store, store.port
