"""The control plane at scale: ``python bench/scale.py --gpus 100000 --gpus-per-node 8``.

Simulation mode (default) drives the **real coordinator code** (:class:`Coordinator`'s
watch handler and reconcile pass, :mod:`resilient.coordinator.delta`, the directory) with
synthetic node agents on a virtual clock, over :class:`bench.sim_store.SimStore`, which
enforces etcd's limits (1.5 MiB request, 4 MiB response, 1,000 lease revokes/s, 0.5 s
expiry tick) and adds estimated etcd latencies (bench/sim_store.py). Each agent runs the real
:class:`NodeHealthAggregator` fed synthetic rank windows, so the health summaries counted
are the ones the agents' write policy makes. CPU time of the coordinator code is measured
(``time.process_time``, less the agents' timers that ran meanwhile) and added to the
virtual clock. It injects a rank
crash seen by its agent, a silent node loss, a rack loss, a straggler demotion, a rejoin
and a coordinator failover, and checks that sample agents (each with its own state,
resolving deltas or the snapshot) derive the plan hash the coordinator published.
Prints one JSON line (docs/scale.md explains each key and the model).

``--real-etcd --nodes N`` starts a local etcd and ``--client-processes`` processes that
keep ``N`` node leases alive over multiplexed keep-alive streams
(:class:`resilient.coordinator.lease_mux.LeaseMux`), registers each node's record, runs a
real coordinator (delta epochs), checks for 60 s (``--hold``) that no lease is lost, then
stops refreshing one node and measures the epoch that removes it. One JSON line.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable, ParamSpec, TypeVar, cast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.calibrate_sim import DEFAULT_OUT as DEFAULT_PARAMS, load_params  # noqa: E402
from bench.sim_store import EXPIRY_TICK, Clock, Latency, SimStore  # noqa: E402
from resilient.collectives.join_agreement import encode_agreed  # noqa: E402
from resilient.collectives.status_exchange import TREE_FANOUT, DIRECT_MAX  # noqa: E402
from resilient.collectives.status_exchange import etcd_puts as ledger_puts, tree_received  # noqa: E402
from resilient.coordinator import keys  # noqa: E402
from resilient.coordinator.delta import EpochDelta, EpochState, is_delta, parse_delta, resolve  # noqa: E402
from resilient.coordinator.directory import NodeRecord  # noqa: E402
from resilient.coordinator.health_cache import HealthCache  # noqa: E402
from resilient.coordinator.health import DemotionRule, StragglerPolicy, no_demotion  # noqa: E402
from resilient.coordinator.liveness import node_lease_ttl  # noqa: E402
from resilient.coordinator.membership import KEEPALIVE_FRACTION, MemberInfo  # noqa: E402
from resilient.coordinator.node_health import NodeHealthAggregator, SummaryPolicy  # noqa: E402
from resilient.coordinator.service import Coordinator, CoordinatorConfig  # noqa: E402
from resilient.coordinator.policy import HealthPolicy  # noqa: E402
from resilient.coordinator.store import KV, Store, WatchEvent  # noqa: E402
from resilient.coordinator.straggler import HealthRecord  # noqa: E402
from resilient.coordinator.straggler import StragglerConfig  # noqa: E402

JOB = "scale"
#: proxy -> agent send cost per watcher and event (grpc-proxy fan-out), seconds
PROXY_SEND = 15e-6
NET = 0.0002            # one hop on the cluster network
LOCAL_FANOUT = 0.0001   # agent -> its ranks over a unix socket
#: one epoch's figures, and the JSON line (mixed JSON values)
Record = dict[str, Any]
P = ParamSpec("P")
T = TypeVar("T")


def as_store(sim: SimStore) -> Store:
    """The simulated etcd where the coordinator code takes a :class:`Store`. ``Store`` is
    the concrete etcd client class, not a Protocol, so mypy cannot match SimStore to it
    structurally; SimStore implements each of its methods the coordinator calls with the
    same parameters (``tests/test_scale_bench.py`` checks every one), which is what this
    cast states."""
    return cast(Store, sim)


class SimCoordinator(Coordinator):
    """The real coordinator, whose watch handler's CPU is counted into the virtual clock
    (the watch thread's CPU is the coordinator's too) and whose last event time is noted
    (a debounce starts there)."""

    def __init__(self, sim: "Sim", cid: str, config: CoordinatorConfig, policy: HealthPolicy) -> None:
        super().__init__(sim.etcd, JOB, cid, config, health_policy=policy)
        self.sim = sim
        self._health = SimHealthCache(sim)

    def _on_member_events(self, events: list[WatchEvent]) -> None:
        self.sim.last_event_at = self.sim.clock.now
        self.sim._timed(super()._on_member_events, events)


class SimHealthCache(HealthCache):
    """The coordinator's health cache, whose watch handler's CPU is the coordinator's too."""

    def __init__(self, sim: "Sim") -> None:
        super().__init__(sim.etcd, JOB)
        self.sim = sim

    def _on_events(self, events: list[WatchEvent]) -> None:
        self.sim._timed(super()._on_events, events)


def data_plane_traffic(d: EpochDelta) -> Record:
    """The etcd traffic the data plane makes for epoch ``d``, by the rules the members
    run (not simulated member by member): a removal starts a recovery among the
    ``d.size`` survivors, whose ledger exchange puts ``status_exchange.etcd_puts`` keys
    (none beyond 64 survivors while the transport works) and waits on them with two
    watches each when it puts them; a growing epoch's join agreement puts one key (the
    tree root's; a stalled tree adds its fallback records) and every old member and
    joiner waits for it with two watches (the epoch's ``joinseq`` prefix and ``epoch``)."""
    writes = watches = 0
    if d.removed:
        ledger = ledger_puts(d.size)
        writes += ledger
        watches += 2 * ledger
    if d.added and d.size > len(d.added):
        writes += 1
        watches += 2 * d.size
    return {"data_plane_writes": writes, "data_plane_watches": watches}


class Agent:
    """A synthetic node agent: one lease, one node record, keep-alives every ttl/3, and
    the real :class:`NodeHealthAggregator` fed synthetic rank windows (:meth:`windows`)."""

    def __init__(self, sim: "Sim", idx: int) -> None:
        self.sim, self.idx = sim, idx
        self.node = f"n{idx:05d}"
        self.rack = idx // sim.args.nodes_per_rack
        self.alive = True
        self.ranks = list(range(sim.args.gpus_per_node))
        self.lease = 0
        self.health = NodeHealthAggregator(sim.etcd, JOB, self.node, None, sim.summary_policy,
                                           clock=sim.clock_now, wall=sim.clock_now,
                                           rng=random.Random(f"{sim.args.seed}:{idx}"))
        self.members = [f"{self.node}-g{r}" for r in range(sim.args.gpus_per_node)]
        #: each rank's busy fraction (busy_s / op_s) when healthy; a straggler's is 1.0
        self.busy = [sim.args.health_busy] * sim.args.gpus_per_node
        self.seq = 0
        self.state: EpochState | None = None   # sample agents only: their own copy
        #: the agent's input so far: a digest chaining the state it loaded and every
        #: record it was delivered since (equal digests: equal states, see Sim.deliver)
        self.held = ""

    def record(self) -> bytes:
        infos = tuple(MemberInfo(member_id=f"{self.node}-g{r}", host=self.node, local_rank=r,
                                 address=f"10.{self.idx // 256 % 256}.{self.idx % 256}.1:{29500 + r}",
                                 labels={"rack": f"rack{self.rack:04d}"}, pid=1000 + r, device=f"cuda:{r}")
                      for r in self.ranks)
        return NodeRecord(self.node, self.node, {"rack": f"rack{self.rack:04d}"}, infos,
                          self.sim.args.ttl).to_json()

    def register(self) -> None:
        """Grant the node lease as the real agents do (:func:`node_lease_ttl` of the
        liveness bound ``--ttl``), write the record on it, and keep it alive every
        ``granted * KEEPALIVE_FRACTION`` s (:class:`LeaseMux`'s schedule), from a random phase."""
        st = self.sim.store
        self.lease = st.grant(self.sim.node_ttl)
        self.health.lease_id = self.lease
        st.put(keys.node(JOB, self.node), self.record(), lease=self.lease)
        phase = self.sim.rng.random() * self.sim.refresh
        self.sim.clock.at(self.sim.clock.now + phase, self.keepalive)

    def start_windows(self) -> None:
        """Start this node's ranks' health windows (one per rank every
        ``--health-window`` s, from a random phase), as their reporters send them to the
        agent."""
        phase = self.sim.rng.random() * self.sim.args.health_window
        self.sim.clock.at(self.sim.clock.now + phase, self.windows)

    def windows(self, again: bool = True) -> None:
        """One window of each rank, fed to the real aggregator (which writes the summary
        when its policy says so): busy fraction ``busy[r]`` plus Gaussian noise of
        ``--health-noise`` (in op periods), the rest of the window waiting on a peer."""
        if not self.alive:
            return
        sim, args = self.sim, self.sim.args
        self.seq += 1
        now, win, noise, gauss = sim.clock.now, args.health_window, args.health_noise, sim.rng.gauss
        ops = max(1, round(10 * win))
        epoch = sim.epoch_number
        for r in self.ranks:
            b = min(1.0, max(0.0, self.busy[r] + gauss(0.0, noise)))
            self.health.maybe_flush({"v": 1, "member": self.members[r], "epoch": epoch, "seq": self.seq,
                                     "at": now, "ops": ops, "window_s": win, "wait_s": {"p": win * (1.0 - b)}})
        if again:
            sim.clock.at(now + win, self.windows)

    def keepalive(self) -> None:
        if not self.alive:
            return
        self.sim.store.keepalive(self.lease)
        self.sim.last_keepalive[self.idx] = self.sim.clock.now
        self.sim.clock.at(self.sim.clock.now + self.sim.refresh, self.keepalive)


class Sim:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.clock = Clock()
        self.latency_source = args.sim_params or (DEFAULT_PARAMS if os.path.exists(DEFAULT_PARAMS) else "defaults")
        self.store = SimStore(self.clock, None if self.latency_source == "defaults" else load_params(
            self.latency_source))
        self.etcd = as_store(self.store)
        #: the node lease's TTL for the liveness bound ``--ttl``, and its refresh period
        self.node_ttl = node_lease_ttl(args.ttl)
        self.refresh = self.node_ttl * KEEPALIVE_FRACTION
        n = args.gpus // args.gpus_per_node
        self.summary_policy = SummaryPolicy(budget=args.health_budget)
        #: the epoch the ranks are in (their health windows carry it)
        self.epoch_number = 0
        self.agents = [Agent(self, i) for i in range(n)]
        for a in self.agents:
            a.health.set_job_size(n)
        self.last_keepalive: dict[int, float] = {}
        self.coord_cpu = 0.0
        self.epochs: list[Record] = []
        self.samples: list[Agent] = []
        #: the state every agent whose input digest (Agent.held) is the key holds
        self.held_states: dict[str, EpochState] = {}
        self.coord: Coordinator | None = None
        self.leader_lease = 0
        #: virtual time of the coordinator's last watch event (its debounce starts there)
        self.last_event_at = 0.0

    def clock_now(self) -> float:
        return self.clock.now

    # -- coordinator driving ---------------------------------------------------------------

    def _timed(self, fn: Callable[P, T], *a: P.args, **kw: P.kwargs) -> T:
        """Run the coordinator's ``fn``, count its CPU (less that of agents' timers the
        simulated latencies let run meanwhile) and move the virtual clock by it."""
        t0, timers0 = time.process_time(), self.clock.timer_cpu
        try:
            return fn(*a, **kw)
        finally:
            dt = time.process_time() - t0 - (self.clock.timer_cpu - timers0)
            self.coord_cpu += dt
            self.clock.advance(dt)

    def become_leader(self, cid: str, policy: HealthPolicy | None = None) -> tuple[Coordinator, float]:
        cfg = CoordinatorConfig(ttl=self.args.ttl, reload_interval=self.args.reload_interval, delta_min_members=1)
        c = SimCoordinator(self, cid, cfg, policy or no_demotion)
        self.leader_lease = self.store.grant(self.args.ttl)
        assert self.etcd.create(keys.leader(JOB), cid.encode(), lease=self.leader_lease)
        c.election.lease_id = self.leader_lease
        c.election.leader_revision = self.kv(keys.leader(JOB)).create_revision
        cpu0 = self.coord_cpu
        self._timed(c.start_leading)
        self.coord = c
        self._leader_keepalive(c)
        return c, self.coord_cpu - cpu0

    def _leader_keepalive(self, c: Coordinator) -> None:
        if self.coord is not c:
            return
        self.store.keepalive(self.leader_lease)
        self.clock.at(self.clock.now + self.args.ttl / 3, lambda: self._leader_keepalive(c))

    def leader(self) -> Coordinator:
        """The leading coordinator (AssertionError between leaders)."""
        assert self.coord is not None, "no coordinator leads"
        return self.coord

    def kv(self, key: str) -> KV:
        """The record at ``key`` (AssertionError when absent)."""
        kv = self.store.get(key)
        assert kv is not None, f"{key} is absent"
        return kv

    def reconcile(self) -> tuple[str, float, int]:
        """One pass of the coordinator loop body: (outcome, cpu seconds, key writes)."""
        c = self.leader()
        with c._cond:
            p = c._pending
            lost_seen, join_seen = dict(p.lost_seen), dict(p.join_seen)
            from resilient.coordinator.service import _Pending

            c._pending = _Pending()
        w0, cpu0 = self.store.c.main_key_writes, self.coord_cpu
        if c._reload_due:
            self._timed(c._reload)
        outcome, _ = self._timed(c._reconcile, lost_seen, join_seen, True)
        return outcome, self.coord_cpu - cpu0, self.store.c.main_key_writes - w0

    def publish_after(self, t_event: float, what: str, debounce: float | None = None,
                      late_reader: bool = False) -> Record:
        """Run the clock to the debounce, reconcile, and record the epoch (virtual ms)."""
        rec = self.maybe_publish(t_event, what, debounce, late_reader)
        assert rec is not None, f"{what}: the coordinator published nothing"
        return rec

    def maybe_publish(self, t_event: float, what: str, debounce: float | None = None,
                      late_reader: bool = False) -> Record | None:
        """:meth:`publish_after`, or None when the pass published nothing."""
        debounce = self.leader().config.debounce if debounce is None else debounce
        self.clock.run_until(self.clock.now + debounce)
        outcome, cpu, writes = self.reconcile()
        if outcome != "published":
            return None
        t_commit = self.clock.now
        raw = self.kv(keys.epoch(JOB)).value
        d = parse_delta(raw)
        self.epoch_number = d.number
        rec: Record = {"what": what, "number": d.number, "bytes": len(raw), "cpu_ms": cpu * 1000, "writes": writes,
               "publish_ms": (t_commit - t_event) * 1000, "removed": len(d.removed), "added": len(d.added),
               "cause": d.cause, "snapshot_epoch": d.snapshot == d.number, "size": d.size,
               "avoid_links": len(d.extras.get("avoid") or [])}
        rec.update(data_plane_traffic(d))
        rec.update(self.deliver(raw, d, t_commit, late_reader))
        self.epochs.append(rec)
        return rec

    # -- agents ----------------------------------------------------------------------------

    def deliver(self, raw: bytes, d: EpochDelta, t_commit: float, late_reader: bool = False) -> Record:
        """Every agent gets ``raw`` through a grpc-proxy and checks the plan hash it
        derives. Sample agents derive from their own copy of the state. Every other live
        agent's derivation is shared with the agents of equal input: its state is a pure,
        deterministic function of the state it loaded and the records delivered since
        (``resolve`` + ``derive_hash``: no clock, no randomness, no I/O but the same
        store), so agents whose digest of that input (:attr:`Agent.held`) is equal hold
        equal states and derive equal hashes; it is derived once per distinct digest and
        checked for every agent. 12,500 separate copies of a 100k-member state would not
        fit this machine's memory. One late reader resolves from scratch."""
        cpu = []
        for a in self.samples:
            t0 = time.process_time()
            a.state = resolve(self.etcd, JOB, d, a.state)
            got = a.state.derive_hash()
            cpu.append(time.process_time() - t0)
            assert got == d.plan_hash, f"agent {a.node} derived {got}, the epoch says {d.plan_hash}"
        if late_reader:
            late = resolve(self.etcd, JOB, d, None)
            assert late.derive_hash() == d.plan_hash, "a late reader (snapshot + history) derived another plan"
        rec_digest = hashlib.sha256(raw).hexdigest()
        derived: dict[str, tuple[str, EpochState, str]] = {}
        checked = 0
        for a in self.agents:
            if not a.alive:
                continue
            res = derived.get(a.held)
            if res is None:
                nxt = hashlib.sha256(f"{a.held}:{rec_digest}".encode()).hexdigest()
                state = resolve(self.etcd, JOB, d, self.held_states.get(a.held))
                res = derived[a.held] = (nxt, state, state.derive_hash())
            assert res[2] == d.plan_hash, f"agent {a.node} derived {res[2]}, the epoch says {d.plan_hash}"
            a.held = res[0]
            checked += 1
        self.held_states = {nxt: state for nxt, state, _ in derived.values()}
        derive = statistics.median(cpu) if cpu else 0.0
        per_proxy = -(-len(self.agents) // self.args.proxies)
        times = []
        for i, a in enumerate(self.agents):
            if not a.alive:
                continue
            pos = i % per_proxy
            times.append(self.store.lat.watch + NET + (pos + 1) * PROXY_SEND + NET + derive + LOCAL_FANOUT)
        times.sort()
        return {"deliver_p99_ms": times[int(0.99 * (len(times) - 1))] * 1000, "agent_derive_ms": derive * 1000,
                "agents_deriving": len(self.samples) + late_reader, "agents_checked": checked,
                "distinct_agent_inputs": len(derived)}

    def kill_node_silently(self, a: Agent) -> float:
        a.alive = False
        return self.clock.now

    def wait_removed(self, nodes: list[Agent], limit: float) -> float:
        """Run the clock until every node's record is gone (1 ms steps); the virtual time
        the coordinator's watch saw the last removal."""
        deadline = self.clock.now + limit
        while any(self.store._kv.get(keys.node(JOB, a.node)) for a in nodes):
            if self.clock.now > deadline:
                raise AssertionError("lease expiry did not remove the nodes")
            self.clock.run_until(self.clock.now + 0.001)
        return self.last_event_at


def run_sim(args: argparse.Namespace) -> Record:
    sim = Sim(args)
    t_setup = time.monotonic()
    lat, sim.store.lat = sim.store.lat, Latency(0, 0, 0, 0, 0, 0, 0)   # agents register in parallel
    for a in sim.agents:
        a.register()
    sim.store.lat = lat
    coord, _ = sim.become_leader("coord-a", StragglerPolicy() if args.straggler_policy else None)
    outcome, init_cpu, init_writes = sim.reconcile()
    assert outcome == "published", outcome
    raw = sim.kv(keys.epoch(JOB)).value
    assert is_delta(raw)
    d0 = parse_delta(raw)
    sim.samples = sim.rng.sample(sim.agents, min(args.derive_sample, len(sim.agents)))
    first = resolve(sim.etcd, JOB, d0, None)     # one snapshot read; each sample agent then holds
    for a in sim.samples:                         # its own copy and builds its own ring
        a.state = EpochState(first.number, first.infos, first.roles, first.extras, first.token)
        assert a.state.derive_hash() == d0.plan_hash
    loaded = hashlib.sha256(raw).hexdigest()      # every agent loaded the first epoch
    for a in sim.agents:
        a.held = loaded
    sim.held_states = {loaded: first}
    out: Record = {"gpus": args.gpus, "nodes": len(sim.agents), "initial_epoch_cpu_ms": round(init_cpu * 1000, 1),
                 "initial_epoch_writes": init_writes}

    # -- steady state: keep-alives, the agents' health summaries (the real aggregator, fed
    # a window of each rank every --health-window s), idle coordinator passes
    # the agents' first summaries, as if their spread over the first nodes / budget s were
    # over: one window round each, its summary (the aggregator's bytes) put with no
    # latency (like the registration) without spending the aggregator's tokens, so each
    # node's next minor write comes when its bucket next fills, at a uniform phase over
    # nodes / budget s, as in the steady state; then windows every --health-window s
    sim.epoch_number = d0.number
    lat, sim.store.lat = sim.store.lat, Latency(0, 0, 0, 0, 0, 0, 0)
    for a in sim.agents:
        a.windows(again=False)
        sim.store.put(keys.health_of(JOB, a.node), json.dumps(a.health.summary(), separators=(",", ":")).encode(),
                      lease=a.lease)
        a.start_windows()
    sim.store.lat = lat
    warm_end = sim.clock.now + args.health_warmup   # the coordinator takes them in (its cache, its policy)
    while sim.clock.now < warm_end:
        sim.clock.run_until(sim.clock.now + coord.config.resync_interval)
        sim.reconcile()
    counters0 = sim.store.c.snapshot()
    health0 = sum(a.health.writes for a in sim.agents)
    cpu0 = sim.coord_cpu
    t0 = sim.clock.now
    next_pass = t0
    while sim.clock.now < t0 + args.steady:
        next_pass += coord.config.resync_interval
        sim.clock.run_until(next_pass)
        outcome, _, _ = sim.reconcile()
        assert outcome == "unchanged", outcome
    steady_s = sim.clock.now - t0
    c1 = sim.store.c.snapshot()
    idle_cpu = sim.coord_cpu - cpu0
    reload_cpu0 = sim.coord_cpu
    sim._timed(coord._reload)
    reload_cpu = sim.coord_cpu - reload_cpu0
    sim.reconcile()
    out["keepalives_per_s"] = round((c1["keepalives"] - counters0["keepalives"]) / steady_s)
    out["steady_writes_per_s"] = round((c1["raft_writes"] - counters0["raft_writes"]) / steady_s, 1)
    out["health_writes_per_s"] = round((sum(a.health.writes for a in sim.agents) - health0) / steady_s, 1)
    out["health_summary_bytes"] = round(statistics.mean(
        len(kv.value) + len(kv.key) for kv in sim.store._range(keys.health(JOB))))
    out["coordinator_idle_core_fraction"] = round(
        (idle_cpu + reload_cpu * steady_s / args.reload_interval) / steady_s, 4)
    out["reload_cpu_ms"] = round(reload_cpu * 1000, 1)
    write_bytes_per_s = (c1["bytes_written"] - counters0["bytes_written"]) / steady_s

    # -- a rank crash seen by its agent: departed marker + the node record without it, one txn
    a = sim.agents[7]
    t_crash = sim.clock.now
    from resilient.coordinator.store import Put

    a.ranks.remove(3)
    sim.clock.advance(0.0001)   # the agent's waitpid
    sim.store.txn([], [Put(keys.departed_of(JOB, f"{a.node}-g3"),
                           json.dumps({"lease": a.lease, "reason": "exit 1", "at": sim.clock.now}).encode()),
                       Put(keys.node(JOB, a.node), a.record(), lease=a.lease)])
    sim.clock.advance(sim.store.lat.watch)
    crash = sim.publish_after(t_crash, "rank crash")
    assert crash["cause"] == "member_lost" and crash["removed"] == 1, crash

    # -- a silent node loss: its lease expires
    b = sim.agents[len(sim.agents) // 2 + 3]
    if b in sim.samples:
        sim.samples.remove(b)
    # the worst phase: it dies right after a keep-alive, so its lease runs a full TTL
    seen = sim.last_keepalive.get(b.idx, 0)
    while sim.last_keepalive.get(b.idx, 0) == seen:
        sim.clock.run_until(sim.clock.now + 0.002)
    t_loss = sim.kill_node_silently(b)
    t_gone = sim.wait_removed([b], args.ttl * 3)
    # the debounce runs from the watch event (plus its delivery), not from the 1 ms poll
    debounce = t_gone + sim.store.lat.watch + coord.config.debounce - sim.clock.now
    loss = sim.publish_after(t_loss, "silent node loss", debounce=max(0.0, debounce), late_reader=True)
    assert loss["cause"] == "lease_expired" and loss["removed"] == args.gpus_per_node, loss
    out["epoch_bytes_node_loss"] = loss["bytes"]
    # etcd's part: its lessor revokes expired leases on a 0.5 s tick (0-500 ms after the
    # lease's TTL, by the tick's phase); the coordinator's part: watch, debounce, reconcile,
    # txn. The lease's TTL is node_lease_ttl(--ttl) so that TTL + tick <= the bound --ttl.
    out["node_lease_ttl_s"] = sim.node_ttl
    tick_wait = t_gone - (sim.last_keepalive[b.idx] + sim.node_ttl)
    out["lease_expiry_to_delete_ms"] = round(tick_wait * 1000, 1)
    reaction_ms = loss["publish_ms"] - (sim.node_ttl + tick_wait) * 1000
    out["silent_loss_reaction_ms"] = round(reaction_ms, 1)
    out["publish_ms_after_silent_loss_worst_tick"] = round((sim.node_ttl + EXPIRY_TICK) * 1000 + reaction_ms, 1)

    # -- a rack loss: every node of one rack (power)
    racks = sorted({x.rack for x in sim.agents})
    rack = racks[len(racks) // 3]
    victims = [x for x in sim.agents if x.rack == rack and x.alive]
    for x in victims:
        if x in sim.samples:
            sim.samples.remove(x)
        x.alive = False
    t_rack = sim.clock.now
    sim.wait_removed(victims, args.ttl * 3)
    sim.clock.advance(sim.store.lat.watch)
    rack_ep = sim.publish_after(t_rack, "rack loss")
    while True:   # leases that expired on a later tick come as a further epoch
        if rack_ep["removed"] >= len(victims) * args.gpus_per_node or sum(
                e["removed"] for e in sim.epochs if e["what"] == "rack loss") >= len(victims) * args.gpus_per_node:
            break
        rack_ep = sim.publish_after(sim.clock.now, "rack loss")

    # -- a straggler: one rank turns slow (it waits on nobody), which its agent's real
    # aggregator writes at once; it is demoted: a role change
    s = sim.agents[11]
    slow_id = f"{s.node}-g5"
    t_slow = sim.clock.now
    s.busy[5] = 1.0
    if args.straggler_policy:   # the real detector, fed by the node summaries through the coordinator's cache
        for _ in range(int(8 * StragglerConfig().confirm_windows * args.health_window) + 10):
            sim.clock.advance(1.0)
            got = sim.maybe_publish(t_slow, "straggler probe/demote")
            assert got is None or got["cause"] == "health", got
            assert coord._pub is not None
            if coord._pub.state.roles.get(slow_id) == "demoted":
                break
        else:
            raise AssertionError("the straggler policy did not demote the slow rank")
    else:
        def demote_slow(records: Mapping[str, HealthRecord]) -> set[str]:
            return {slow_id}

        coord.health_policy = DemotionRule(demote_slow)
        slow = sim.publish_after(t_slow, "straggler demoted")
        assert slow["cause"] == "health", slow
    out["straggler_demoted_s"] = round(sim.clock.now - t_slow, 1)

    # -- the crashed rank restarts: the node record with 8 ranks again (a join epoch)
    a.ranks = list(range(args.gpus_per_node))
    t_join = sim.clock.now
    sim.store.put(keys.node(JOB, a.node), a.record(), lease=a.lease)
    sim.clock.advance(sim.store.lat.watch)
    joined = sim.publish_after(t_join, "rank rejoined", debounce=coord.config.join_debounce)
    # the old members' join agreement (the data plane's, within milliseconds): its root's
    # one record, which the coordinator reads before it lets a removal keep the joiner
    # (docs/recovery.md, "a removal while an admission is pending")
    d_join = parse_delta(sim.kv(keys.epoch(JOB)).value)
    root = f"{sim.agents[0].node}-g0"
    sim.store.put(keys.epoch_data_of(JOB, joined["number"], "joinseq", root),
                  encode_agreed(joined["number"], 1000, d_join.size - joined["added"]))

    # -- an idle pass writes the periodic snapshot (off the publish path)
    snaps0, cpu_before = coord.snapshots_written, sim.coord_cpu
    sim.clock.run_until(sim.clock.now + coord.config.resync_interval)
    sim.reconcile()
    out["snapshot_cpu_ms"] = round((sim.coord_cpu - cpu_before) * 1000, 1) if coord.snapshots_written > snaps0 else None

    # -- coordinator failover: the leader dies (its lease expires), a standby takes over
    sim.coord = None
    coord._health.close()   # the old leader's process is gone
    t_fail = sim.clock.now
    while sim.store.get(keys.leader(JOB)) is not None:
        sim.clock.run_until(sim.clock.now + 0.05)
    c2, load_cpu = sim.become_leader("coord-b", StragglerPolicy() if args.straggler_policy else coord.health_policy)
    outcome, resolve_cpu, _ = sim.reconcile()
    assert outcome == "unchanged", outcome
    out["failover_takeover_ms"] = round((sim.clock.now - t_fail) * 1000, 1)
    out["failover_load_cpu_ms"] = round((load_cpu + resolve_cpu) * 1000, 1)
    e = sim.agents[-5]
    if e in sim.samples:
        sim.samples.remove(e)
    t_e = sim.clock.now
    sim.store.put(keys.departed_of(JOB, e.node), json.dumps({"lease": e.lease, "reason": "agent stop",
                                                            "at": sim.clock.now}).encode())
    sim.store.revoke(e.lease)
    e.alive = False
    sim.clock.advance(sim.store.lat.watch)
    after = sim.publish_after(t_e, "node loss after failover", late_reader=True)
    assert after["cause"] == "member_lost", after

    scenario = [ep for ep in sim.epochs]
    out["writes_per_epoch"] = max(ep["writes"] for ep in scenario)
    # the data plane's etcd writes and watches of the same epochs (ledger exchange, join agreement)
    out["data_plane_writes_per_epoch"] = max(ep["data_plane_writes"] for ep in scenario)
    out["writes_per_epoch_with_data_plane"] = max(ep["writes"] + ep["data_plane_writes"] for ep in scenario)
    out["data_plane_watches_per_epoch"] = max(ep["data_plane_watches"] for ep in scenario)
    # the same recovery's ledger summaries over the transport (not simulated member by
    # member: status_exchange's tree, the rules the members run): every survivor's goes up
    # the tree to the planner; what the survivors receive in all, and the most a survivor
    # other than the planner receives, against every survivor receiving every other's
    removal = [ep for ep in scenario if ep["removed"]]
    survivors = max(int(ep["size"]) for ep in removal) if removal else 0
    received = tree_received(survivors, TREE_FANOUT) if survivors > DIRECT_MAX else [survivors - 1] * survivors
    out["ledger_survivors"] = survivors
    out["ledger_summaries_received"] = sum(received)
    out["ledger_summaries_received_all_to_all"] = survivors * (survivors - 1)
    out["ledger_summaries_max_but_planner"] = max(received[1:], default=0)
    out["ledger_survivors_receiving_none"] = sum(1 for r in received if r == 0)
    out["coordinator_cpu_ms_per_epoch"] = round(max(ep["cpu_ms"] for ep in scenario), 2)
    out["straggler_policy"] = bool(args.straggler_policy)
    # epochs whose plan avoids links (the detector's probe): the planner's swaps need the full plan
    avoiding = [ep["cpu_ms"] for ep in scenario if ep["avoid_links"]]
    out["cpu_ms_per_epoch_without_avoided_links"] = round(
        max(ep["cpu_ms"] for ep in scenario if not ep["avoid_links"]), 2)
    out["cpu_ms_per_epoch_avoiding_links"] = round(max(avoiding), 2) if avoiding else None
    out["publish_ms_after_crash"] = round(crash["publish_ms"], 1)
    out["publish_ms_after_silent_loss"] = round(loss["publish_ms"], 1)
    out["deliver_p99_ms"] = round(max(ep["deliver_p99_ms"] for ep in scenario), 1)
    # DB: live keys plus one compaction window of history (Helm: --auto-compaction-retention
    # hours, default 1), with bbolt's ~2x page overhead; epochs: one failure per 30 min
    epoch_bytes = statistics.mean(ep["bytes"] for ep in scenario) * 2
    hour_history = write_bytes_per_s * 3600 + 2 * (epoch_bytes + len(sim.agents) * 100)
    out["etcd_db_mb_after_hour"] = round(2 * (sim.store.live_bytes + hour_history) / 1e6, 1)
    out["plan_hash_agree"] = True
    out["agents_deriving_per_epoch"] = len(sim.samples)
    out["agents_checked_per_epoch"] = min(ep["agents_checked"] for ep in scenario)
    out["distinct_agent_inputs_max"] = max(ep["distinct_agent_inputs"] for ep in scenario)
    out["epochs"] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in ep.items()} for ep in scenario]
    out["sim_latency"] = {"source": os.path.relpath(sim.latency_source) if sim.latency_source != "defaults"
                          else "defaults", **{k: round(v * 1000, 3) for k, v in vars(sim.store.lat).items()}}
    out["sim_wall_s"] = round(time.monotonic() - t_setup, 1)
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=100_000)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes-per-rack", type=int, default=32)
    ap.add_argument("--ttl", type=float, default=5.0,
                    help="liveness bound, seconds: a node silent this long is declared dead (its lease is granted "
                         "node_lease_ttl(ttl) = floor(ttl - 0.5) s: etcd's expiry loop adds up to 0.5 s)")
    ap.add_argument("--proxies", type=int, default=16, help="etcd grpc-proxies between agents and etcd")
    ap.add_argument("--steady", type=float, default=60.0, help="simulated seconds of steady state")
    ap.add_argument("--health-budget", type=float, default=10.0,
                    help="health summary writes/s for the whole job (the agents' --health-write-budget)")
    ap.add_argument("--health-window", type=float, default=1.0, help="a rank's health window, s")
    ap.add_argument("--health-noise", type=float, default=0.02,
                    help="std. dev. of a window's busy fraction (op periods): 0.02 crosses the summaries' 0.05 "
                         "deadband often, so the budget binds (the most writes)")
    ap.add_argument("--health-busy", type=float, default=0.5, help="a healthy rank's busy fraction")
    ap.add_argument("--health-warmup", type=float, default=10.0,
                    help="simulated seconds of windows before the steady state is measured")
    ap.add_argument("--reload-interval", type=float, default=300.0, help="coordinator's paged full re-read, s")
    ap.add_argument("--derive-sample", type=int, default=8, help="agents that derive every plan themselves")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sim-params", default=None,
                    help="latency file from bench/calibrate_sim.py (default: bench/sim_params.json when present)")
    ap.add_argument("--straggler-policy", action="store_true",
                    help="run the coordinator with the straggler policy (the real detector) throughout")
    ap.add_argument("--real-etcd", action="store_true")
    ap.add_argument("--nodes", type=int, default=12_500)
    ap.add_argument("--client-processes", type=int, default=os.cpu_count() or 2,
                    help="--real-etcd: lease-holding client processes (default: one per core; each keeps its "
                         "share over 8 asyncio streams, and more processes than cores only add GIL hand-offs)")
    ap.add_argument("--hold", type=float, default=60.0)
    ap.add_argument("--coordinator-after-ready", action="store_true",
                    help="--real-etcd: start the coordinator once every node has registered (it then reads all "
                         "the records at once), instead of before registration (the default, as deployed: it "
                         "builds its directory from the watch as the nodes register)")
    ap.add_argument("--timeline", default=None,
                    help="--real-etcd: write a diagnostic timeline (CPU per process every 0.5 s, each client's "
                         "answer lag and losses, the coordinator's reloads, snapshots and slow etcd calls, etcd's "
                         "slow-request warnings) as JSON to this file")
    ap.add_argument("--full", action="store_true", help="print every epoch too")
    args = ap.parse_args()
    if args.real_etcd:
        from bench.scale_real import run_real

        print(json.dumps(run_real(args)))
        return
    out = run_sim(args)
    if not args.full:
        out.pop("epochs")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
