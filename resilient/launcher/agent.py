"""The node agent: spawn the workers, watch them, revoke dead ones' leases, restart them.

For each worker incarnation the agent grants an etcd lease (``Store.grant``) and passes its
id in ``RESILIENT_LEASE_ID``; until the worker has registered — through the agent's
channel (node-lease mode, the default: below) or by its own ``MemberSession`` writing
``members/<member id>`` on that lease — the agent keeps the lease alive (a slow import
must not look like a hang). Then it stops: a worker that joined through the channel lives
on the node lease and its own lease is revoked; for one that registered itself the
worker's own keep-alive is the only one (so a SIGSTOPped worker is removed when the lease
expires).

The workers are children of one :class:`~resilient.process_pool.ProcessPool` (each in its
own session); its waiter threads hand each exit to the main loop, which at once writes
``departed/<member id>`` and revokes the lease
(:func:`resilient.coordinator.membership.revoke_member`: the fast detection path; the
member's keys vanish in the same etcd revision). Then:

* exit code 0: the worker is done — unless it imported resilient and its interpreter never
  ran its normal exit (``os._exit(0)`` somewhere: :mod:`resilient.script_exit`): then its
  script did not finish, it counts as failed and the summary names it;
* otherwise, while the worker has restarts left (``--max-restarts`` is a budget *per
  worker*): start that worker alone again, with a new lease and member id,
  ``TORCHELASTIC_RESTART_COUNT`` + 1 and ``RESILIENT_JOINER=1``; its siblings are not
  touched (torchrun would restart all of them);
* restarts exhausted (with the default ``--max-restarts 0``: at the first failure): the
  worker stays down and **its siblings keep running** — they finish the work as the
  survivors (the collectives absorb the death). When every worker has ended the agent
  prints a summary of who died, when, how, in which membership epoch the group shrank and
  whether it was restarted (:mod:`resilient.launcher.summary`) and exits 0 if the work
  finished (some worker exited 0, none exited with an error code of its own), else 1;
* with ``--fail-fast`` (``PET_FAIL_FAST``/``RESILIENT_FAIL_FAST``), torchrun's
  behaviour instead: stop the other workers (SIGTERM, ``--shutdown-timeout``, SIGKILL) and
  exit 1 with torchrun's failure summary naming the local rank, rank, exit code or signal
  and pid.

Signals in ``--signals-to-handle`` (SIGTERM, SIGINT, SIGHUP, SIGQUIT) are forwarded to
every running worker; the agent waits ``--shutdown-timeout`` seconds, SIGKILLs what is left
(the worker's process group), revokes every lease and exits ``128 + signal number``
(torchrun exits 1 with a traceback; the shell convention says which signal it was).

**Node lease** (the default; ``--no-node-lease`` or ``RESILIENT_NODE_LEASE=0``: a lease per
worker only, as above; docs/scale.md): the agent grants one lease for the node
(:func:`node_grant_ttl`: ``floor(--lease-ttl - 0.5)`` s, so that a silent node is
published within ``--lease-ttl``), refreshed every third of that
over one multiplexed keep-alive stream (:class:`~resilient.coordinator.lease_mux.LeaseMux`),
and serves a local channel (:class:`~.node_channel.NodeChannel`, a unix socket in its run
directory, passed as ``RESILIENT_AGENT_SOCKET``) through which :func:`resilient.connect`
registers each worker: the agent writes **one** ``nodes/<node>`` record (:class:`~.node_members.NodeMembers`)
listing its ranks, relays every ``epoch`` record from its one etcd watch to them (they
open no watch of their own), takes their health windows into one ``health/<node>``
summary, written on change within the job's write budget (``--health-write-budget``,
``--node-health-interval``: :mod:`resilient.coordinator.node_health`) and their beats. The agent vouches for its ranks: an
exit is handled at once by one transaction (the node record without the rank +
``departed/<member id>``, siblings untouched), and a hung worker — no beat for
``--lease-ttl`` seconds (SIGSTOP) — is removed the same way (reason ``heartbeat stale``)
and told so. A worker that registers itself (``MemberSession`` on ``RESILIENT_LEASE_ID``,
no channel) is on its own lease, not the node's: it is handled exactly as with
``--no-node-lease`` (its hang expires that lease; its exit revokes it), and the agent logs
that it registered itself. A ``--lease-ttl`` under 2.5 s is granted as given, with a
warning that the bound is then ``--lease-ttl`` + 0.5 s. At 100,000 GPUs this turns 100,000 leases, keep-alive
streams and epoch watchers into one per node (each incarnation's own lease costs one
grant at its start and one revoke when it joined, nothing per second after).

Failure behaviour: if etcd is unreachable when a worker exits, the revoke is logged and the
lease expires after ``--lease-ttl``; the restart still happens (a new lease needs etcd, so
the restart fails with ``StoreUnavailable`` if etcd stays down past the store's retry budget,
and the agent then stops all workers and exits 1).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from resilient.errors import ConfigError, ResilientError, StoreError
from resilient.launcher.args import LaunchConfig
from resilient.launcher.env import Placement, ResilientIds, agent_process_env, worker_env
from resilient.launcher.logs import WorkerLogs, WorkerStreams
from resilient.launcher.summary import Death, format_summary, job_exit_code, shrink_epoch
from resilient.process_pool import DEVNULL, Child, ProcessPool, Spec, signal_name
from resilient.script_exit import left_early, unfinished

if TYPE_CHECKING:  # pragma: no cover - the launcher imports the etcd client only with --etcd
    from resilient.coordinator.lease_mux import LeaseMux
    from resilient.coordinator.store import Store
    from resilient.launcher.node_channel import NodeChannel
    from resilient.launcher.node_members import NodeMembers
    from resilient.launcher.rendezvous import LeaseKeeper

log = logging.getLogger("resilient.launcher")


@dataclass
class ControlPlane:
    """The etcd side of the agent (absent with static rendezvous and no ``--etcd``)."""

    store: Store
    endpoints: list[str]
    job: str
    lease_ttl: float
    keeper: LeaseKeeper
    #: the node lease every worker shares (RESILIENT_NODE_LEASE=1), else None
    node_lease: int | None = None


@dataclass
class NodeMode:
    """Node-lease mode's parts: the node lease's keep-alive stream, the node record, the
    ranks' channel, and the run directory holding its socket."""

    mux: LeaseMux
    members: NodeMembers
    channel: NodeChannel
    run_dir: str
    #: the node lease's TTL (:func:`node_grant_ttl` of ``--lease-ttl``)
    granted_ttl: float


@dataclass
class Failure:
    local_rank: int
    rank: int
    pid: int
    exitcode: int
    restart_count: int
    error_file: str
    at: float

    def describe(self) -> str:
        if self.exitcode < 0:
            return f"Signal {-self.exitcode} ({signal_name(-self.exitcode)}) received by PID {self.pid}"
        return f"exited with code {self.exitcode}"


@dataclass
class Worker:
    local_rank: int
    rank: int
    restart_count: int = 0
    proc: Child | None = None
    lease_id: int | None = None
    member_id: str | None = None
    streams: WorkerStreams | None = None
    done: bool = False
    exitcode: int | None = None
    pids: list[int] = field(default_factory=list)
    vouched_out: bool = False         # node-lease mode: removed (stale beats, or its exit handled)
    #: node-lease mode: the worker's own lease (RESILIENT_LEASE_ID) is still live; revoked once
    #: the worker joined through the channel, kept by the worker if it registered itself
    own_lease_live: bool = False
    #: ``RESILIENT_EXIT_MARKER`` of the current incarnation (:mod:`resilient.script_exit`)
    exit_marker: str = ""


SOCKET_NAME = "agent.sock"
UNIX_PATH_MAX = 107  # bytes of a unix socket path Linux accepts (sun_path is 108 with its NUL)


def agent_run_dir(tmpdir: str | None = None) -> str:
    """A new private directory (mode 0700, :func:`tempfile.mkdtemp`) for the agent's
    channel socket: under ``tmpdir`` (default: ``TMPDIR``, as :mod:`tempfile` picks it),
    or, when ``<that dir>/resilient-agent-XXXXXXXX/agent.sock`` would be longer than a
    unix socket path may be (a deep TMPDIR: pytest's ``tmp_path`` under a long test name,
    a home-directory TMPDIR), under ``/tmp`` instead, with a log line saying so. The
    directory is as private there (0700, this user's); the caller removes it. Raises
    :class:`OSError` when no directory can be made (the launcher reports it)."""
    base = tmpdir if tmpdir is not None else tempfile.gettempdir()
    probe = os.path.join(base, "resilient-agent-" + "x" * 8, SOCKET_NAME)
    if len(os.fsencode(probe)) > UNIX_PATH_MAX and os.path.isdir("/tmp"):
        log.info("TMPDIR %s is too deep for a unix socket path (%d bytes > %d): the agent's channel goes "
                 "under /tmp", base, len(os.fsencode(probe)), UNIX_PATH_MAX)
        base = "/tmp"
    return tempfile.mkdtemp(prefix="resilient-agent-", dir=base)


def node_grant_ttl(bound: float) -> float:
    """The TTL the agent grants its node lease for ``--lease-ttl`` ``bound``:
    :func:`~resilient.coordinator.liveness.node_lease_ttl` (``floor(bound - 0.5)``: etcd
    revokes an expired lease up to 0.5 s late, so a silent node is then published within
    ``bound``). A bound under 2.5 s, which etcd cannot keep, is granted as given, with a
    warning that a silent node is then declared dead up to ``max(bound, 2) + 0.5`` s after
    its last refresh (etcd's least TTL is 2 s). Never raises."""
    from resilient.coordinator.liveness import ETCD_EXPIRY_LOOP, ETCD_MIN_LEASE_TTL, node_lease_ttl

    try:
        return float(node_lease_ttl(bound))
    except ConfigError:
        late = max(bound, ETCD_MIN_LEASE_TTL) + ETCD_EXPIRY_LOOP
        log.warning("--lease-ttl %gs is under %gs: the node lease is granted %gs as given, so a silent node is "
                    "declared dead up to %gs after its last refresh, not within %gs; pass --lease-ttl %g or more "
                    "for the bound to hold", bound, ETCD_MIN_LEASE_TTL + ETCD_EXPIRY_LOOP, bound, late, bound,
                    ETCD_MIN_LEASE_TTL + ETCD_EXPIRY_LOOP)
        return bound


class Agent:
    """Runs the workers of one node until they finish, fail for good, or a signal arrives."""

    def __init__(self, cfg: LaunchConfig, placement: Placement, logs: WorkerLogs,
                 control: ControlPlane | None = None, metrics_dir: str | None = None) -> None:
        self.cfg = cfg
        self.placement = placement
        self.logs = logs
        self.control = control
        self.metrics_dir = metrics_dir
        self.token = uuid.uuid4().hex[:6]
        self.base_env = agent_process_env(os.environ, cfg.nproc_per_node, ",".join(cfg.signals_to_handle))
        if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            log.warning("setting OMP_NUM_THREADS=1 for each worker (as torchrun); set it yourself to tune")
        self.workers = [Worker(lr, placement.global_rank(lr)) for lr in range(cfg.nproc_per_node)]
        self.failures: list[Failure] = []
        self.deaths: list[Death] = []
        self.restarts = 0
        self.pool = ProcessPool()
        #: where the workers mark their script started/finished (resilient.script_exit)
        self.exit_dir = tempfile.mkdtemp(prefix="resilient-exit-")
        #: local ranks that exited 0 without finishing their script (counted as failed)
        self.unfinished: list[int] = []
        #: (local rank, reason): workers that left before the end of their script by design
        #: (an HSDP survivor stepping aside, a joiner not admitted): exit 0, named in the summary
        self.left: list[tuple[int, str]] = []
        self._worker_of: dict[Child, Worker] = {}
        self._signal: int | None = None
        self.node: NodeMode | None = None
        if control is not None and cfg.node_lease:
            self.node = self._start_node_mode(control)

    def _start_node_mode(self, c: ControlPlane) -> NodeMode:
        """Grant the node lease (kept over one LeaseMux stream), open the channel."""

        from resilient.coordinator.lease_mux import LeaseMux
        from resilient.coordinator.node_health import SummaryPolicy
        from resilient.launcher.node_channel import NodeChannel
        from resilient.launcher.node_members import NodeMembers

        granted = node_grant_ttl(c.lease_ttl)
        c.node_lease = c.store.grant(granted)
        mux = LeaseMux(c.store)
        mux.add(c.node_lease, granted, on_lost=lambda lid: log.error(
            "node lease %x is gone (expired: etcd unreachable or this agent stalled); the coordinator "
            "drops every rank of this node", lid))
        node_id = f"n{self.placement.group_rank}-{self.token}"
        members = NodeMembers(c.store, c.job, node_id, socket.gethostname(), c.node_lease, c.lease_ttl)
        run_dir = agent_run_dir()
        try:
            channel = NodeChannel(os.path.join(run_dir, SOCKET_NAME), c.store, c.job, members, self._expects,
                                  SummaryPolicy(budget=self.cfg.health_write_budget,
                                                min_gap=self.cfg.node_health_interval))
        except BaseException:  # the channel could not open: nothing of node mode is left behind
            shutil.rmtree(run_dir, ignore_errors=True)
            mux.close()
            try:
                c.store.revoke(c.node_lease)
            except StoreError:
                pass  # it expires after its TTL
            c.node_lease = None
            raise
        log.info("node lease %x (TTL %gs for --lease-ttl %gs), node record %s: the agent vouches for its %d ranks",
                 c.node_lease, granted, c.lease_ttl, node_id, self.cfg.nproc_per_node)
        return NodeMode(mux, members, channel, run_dir, granted)

    def _expects(self, member_id: str) -> bool:
        """Whether ``member_id`` is the id of a running worker (a channel hello's check)."""
        return any(w.member_id == member_id and not w.done and not w.vouched_out for w in self.workers)

    # -- signals --------------------------------------------------------------------------

    def request_stop(self, signum: int) -> None:
        """Called from a signal handler: only records the signal (the main loop acts)."""
        if self._signal is None:
            self._signal = signum

    # -- one worker -----------------------------------------------------------------------

    def _spawn(self, w: Worker, joiner: bool) -> None:
        ids = None
        if self.control is not None:
            c = self.control
            w.member_id = f"g{self.placement.group_rank}-l{w.local_rank}-a{w.restart_count}-{self.token}"
            # Every worker gets a lease of its own in RESILIENT_LEASE_ID, kept alive by the agent
            # until it registers (a slow import must not look like a hang). In node-lease mode
            # a worker that joins through the channel (resilient.connect) lives on the node
            # lease and the agent revokes its own one (_hand_over); a worker that registers
            # itself (MemberSession on RESILIENT_LEASE_ID) keeps it alive itself, so a hang
            # expires it as without the node agent: never a member on the node lease that
            # nobody checks.
            w.lease_id, w.vouched_out = c.store.grant(c.lease_ttl), False
            w.own_lease_live = c.node_lease is not None
            from resilient.coordinator import keys

            key = keys.member(c.job, w.member_id)
            lease, mid, node = w.lease_id, w.member_id, self.node

            def registered(key: str = key, lease: int = lease, mid: str = mid) -> bool:
                if node is not None and node.members.registered_here(mid):
                    return True     # joined through the channel: _hand_over revokes the lease
                kv = c.store.get(key)
                if kv is None or kv.lease != lease:
                    return False
                if node is not None:
                    log.info("member %s registered itself on its own lease %x (not through the node agent's "
                             "channel): its liveness is that lease's keep-alive, as with --no-node-lease",
                             mid, lease)
                return True

            c.keeper.add(w.lease_id, until=registered)
            ids = ResilientIds(tuple(c.endpoints), c.job, w.lease_id, w.member_id, c.lease_ttl)
        w.streams = self.logs.open(w.local_rank, w.restart_count)
        env = worker_env(
            self.base_env, self.placement, w.local_rank, self.cfg.role, w.restart_count,
            self.cfg.max_restarts, w.streams.error_file, ids, self.cfg.job, joiner,
            self.cfg.virtual_local_rank,
        )
        if self.node is not None:
            from resilient.launcher.channel_wire import SOCKET_ENV

            env[SOCKET_ENV] = self.node.channel.path
        from resilient.script_exit import ENV as EXIT_MARKER

        w.exit_marker = env[EXIT_MARKER] = os.path.join(self.exit_dir, f"{w.local_rank}-{w.restart_count}")
        if self.cfg.local_addr and "RESILIENT_HOST" not in env:
            env["RESILIENT_HOST"] = self.cfg.local_addr  # the data-plane listener binds where the node lives
        if self.metrics_dir:
            from resilient.metrics import worker_env as metrics_env

            env.update(metrics_env(self.metrics_dir))
        w.proc = self.pool.start(Spec(self.cfg.cmd, env=env, stdin=DEVNULL, stdout=w.streams.stdout,
                                      stderr=w.streams.stderr, name=f"local rank {w.local_rank}"))
        self._worker_of[w.proc] = w
        w.pids.append(w.proc.pid)
        log.info("started local rank %d (rank %d, restart %d, pid %d, member %s, lease %s)",
                 w.local_rank, w.rank, w.restart_count, w.proc.pid, w.member_id,
                 f"{w.lease_id:x}" if w.lease_id is not None else "-")

    def _release(self, w: Worker, rc: int) -> None:
        """The worker's process has exited: remove it from the node record (node-lease mode,
        it joined through the channel) or revoke its own lease at once; close its logs."""
        if self.node is not None and w.member_id is not None and self.node.members.registered_here(w.member_id):
            if not w.vouched_out:
                self._vouch_out(w, f"exit code {rc}" if rc >= 0 else f"signal {-rc}")
            self._hand_over(w)
        elif self.control is not None and w.lease_id is not None and w.member_id is not None:
            w.own_lease_live = False
            from resilient.coordinator.membership import revoke_member

            self.control.keeper.remove(w.lease_id)
            reason = f"exit code {rc}" if rc >= 0 else f"signal {-rc}"
            try:
                revoke_member(self.control.store, self.control.job, w.member_id, w.lease_id, reason)
                log.info("local rank %d exited (%s): revoked lease %x of member %s",
                         w.local_rank, reason, w.lease_id, w.member_id)
            except StoreError as exc:
                log.error("could not revoke lease %x of local rank %d (%s); it expires after %gs",
                          w.lease_id, w.local_rank, exc, self.control.lease_ttl)
        if self.metrics_dir and w.proc is not None:
            from resilient.metrics import mark_worker_dead

            mark_worker_dead(w.proc.pid, self.metrics_dir)
        if w.streams is not None:
            w.streams.close()

    def _hand_over(self, w: Worker) -> None:
        """Node-lease mode: ``w`` joined through the channel, so it lives on the node lease:
        stop keeping its own lease and revoke it (a failed revoke is logged; the lease then
        expires after ``--lease-ttl``, holding nothing)."""
        c = self.control
        if c is None or not w.own_lease_live or w.lease_id is None:
            return
        w.own_lease_live = False
        c.keeper.remove(w.lease_id)
        try:
            c.store.revoke(w.lease_id)
        except StoreError as exc:
            log.warning("could not revoke the spare lease %x of local rank %d (%s); it expires after %gs",
                        w.lease_id, w.local_rank, exc, c.lease_ttl)

    def _vouch_out(self, w: Worker, reason: str, tell: bool = False) -> None:
        """Node-lease mode: remove one channel-registered worker from the node record (its
        siblings keep theirs) and mark it departed, in one transaction."""
        c, node = self.control, self.node
        assert c is not None and node is not None and w.member_id is not None  # node-lease mode only
        w.vouched_out = True
        try:
            node.members.remove(w.member_id, reason)
            log.info("local rank %d (%s): removed member %s from node %s", w.local_rank, reason, w.member_id,
                     node.members.node)
        except StoreError as exc:
            w.vouched_out = False   # tried again on the next check / exit
            log.error("could not remove member %s of local rank %d: %s", w.member_id, w.local_rank, exc)
            return
        node.channel.forget(w.member_id, reason if tell else None)

    def _check_heartbeats(self) -> None:
        """Node-lease mode: revoke the own lease of each worker that joined through the
        channel; a running worker that sent no beat for the lease TTL is hung (SIGSTOP,
        deadlock in C): vouch it out, as its own lease would expire."""
        if self.node is None or self.control is None:
            return
        for w in self.workers:
            if w.own_lease_live and w.member_id is not None and self.node.members.registered_here(w.member_id):
                self._hand_over(w)
        stale = set(self.node.channel.stale(self.control.lease_ttl))
        for w in self.workers:
            if w.member_id in stale and not w.done and not w.vouched_out and w.proc is not None and w.proc.alive():
                log.warning("local rank %d: no beat for more than %gs (hung?)", w.local_rank, self.control.lease_ttl)
                self._vouch_out(w, f"heartbeat stale for more than {self.control.lease_ttl:g}s", tell=True)

    # -- main loop ------------------------------------------------------------------------

    def run(self) -> int:
        """Start every worker and supervise them; returns the agent's exit code."""
        try:
            for w in self.workers:
                self._spawn(w, joiner=self.placement.joiner)
            while not all(w.done for w in self.workers):
                if self._signal is not None:
                    return self._shutdown(self._signal)
                self._check_heartbeats()
                proc = self.pool.wait_any(timeout=min(self.cfg.monitor_interval, 0.5))
                if proc is None or proc.returncode is None:
                    continue
                w, rc = self._worker_of[proc], proc.returncode
                if proc is not w.proc:
                    continue
                self._release(w, rc)
                if rc == 0 and unfinished(w.exit_marker):
                    # exit code 0, but the interpreter never ran its normal exit: os._exit(0)
                    # somewhere (a library, a thread), so the script did not finish
                    w.done, w.exitcode = True, 1
                    self.unfinished.append(w.local_rank)
                    log.error("local rank %d (pid %d) exited with code 0 but did not finish its script (the "
                              "process ended without Python's normal exit: os._exit(0)?); counted as failed",
                              w.local_rank, proc.pid)
                    continue
                if rc == 0:
                    w.done, w.exitcode = True, 0
                    why = left_early(w.exit_marker)
                    if why is not None:
                        self.left.append((w.local_rank, why))
                        log.warning("local rank %d left before the end of its script: %s", w.local_rank, why)
                    else:
                        log.info("local rank %d finished", w.local_rank)
                    continue
                failure = Failure(w.local_rank, w.rank, proc.pid, rc, w.restart_count,
                                  w.streams.error_file if w.streams else "", time.time())
                self.failures.append(failure)
                death = Death(w.local_rank, w.rank, proc.pid, rc, w.restart_count, w.member_id, failure.at)
                self.deaths.append(death)
                if self._signal is None and w.restart_count < self.cfg.max_restarts:
                    death.restarted = True
                    w.restart_count += 1
                    self.restarts += 1
                    log.warning("local rank %d (pid %d) %s; restarting it as a joiner (restart %d of %d)",
                                w.local_rank, proc.pid, failure.describe(), w.restart_count, self.cfg.max_restarts)
                    self._spawn(w, joiner=True)
                    continue
                w.done, w.exitcode = True, rc
                if self._signal is None and self.cfg.fail_fast:
                    log.error("local rank %d (pid %d) %s and has no restarts left (--max-restarts %d); "
                              "--fail-fast: stopping the other workers", w.local_rank, proc.pid,
                              failure.describe(), self.cfg.max_restarts)
                    self._stop_workers(signal.SIGTERM)
                    self._print_summary(failure)
                    return 1
                if self._signal is None:
                    log.warning("local rank %d (pid %d) %s and has no restarts left (--max-restarts %d); "
                                "the other workers go on without it (--fail-fast would stop them)",
                                w.local_rank, proc.pid, failure.describe(), self.cfg.max_restarts)
            return self._finish()
        except BaseException:
            self._stop_workers(signal.SIGTERM)
            raise
        finally:
            self._drop_node_lease()
            shutil.rmtree(self.exit_dir, ignore_errors=True)

    def _drop_node_lease(self) -> None:
        """Node-lease mode: every worker is gone; close the channel, revoke the node lease."""

        c, node = self.control, self.node
        if c is None or node is None or c.node_lease is None:
            return
        node.channel.close()
        node.mux.remove(c.node_lease)
        node.mux.close()
        try:
            c.store.revoke(c.node_lease)
        except StoreError as exc:
            log.warning("could not revoke node lease %x (%s); it expires after %gs", c.node_lease, exc,
                        node.granted_ttl)
        c.node_lease = None
        shutil.rmtree(node.run_dir, ignore_errors=True)

    def _finish(self) -> int:
        """Every worker ended: the exit code from their last incarnations and, if any worker
        died on the way, the summary (see :mod:`resilient.launcher.summary`)."""
        rc = job_exit_code(w.exitcode for w in self.workers)
        if self.deaths or self.unfinished or self.left:
            store = self.control.store if self.control is not None else None
            job = self.control.job if self.control is not None else ""
            for d in self.deaths:
                d.epoch = shrink_epoch(store, job, d.member_id)
            finished = [w.local_rank for w in self.workers if w.exitcode == 0]
            errored = [w.local_rank for w in self.workers if w.exitcode is not None and w.exitcode > 0]
            errored = [lr for lr in errored if lr not in self.unfinished]
            print(format_summary(self.deaths, finished, errored, rc, self.cfg.max_restarts, self.unfinished,
                                 self.left), file=sys.stderr, flush=True)
        return rc

    def _shutdown(self, signum: int) -> int:
        log.warning("received %s: forwarding it to the workers and shutting down", signal.Signals(signum).name)
        self._stop_workers(signum)
        return 128 + signum

    def _running(self) -> list[Worker]:
        return [w for w in self.workers if w.proc is not None and not w.done]

    def _stop_workers(self, sig: int) -> None:
        """Send ``sig`` to every running worker, wait ``--shutdown-timeout``, SIGKILL the rest
        (their process groups), reap them and revoke their leases."""
        running = [(w, w.proc) for w in self._running() if w.proc is not None]
        for w, proc in running:
            if proc.alive():
                log.info("sending %s to local rank %d (pid %d)", signal_name(sig), w.local_rank, proc.pid)
        codes = self.pool.stop(self.cfg.shutdown_timeout, sig, [proc for _, proc in running])
        for (w, _), rc in zip(running, codes):
            w.done, w.exitcode = True, rc
            self._release(w, rc)

    def _print_summary(self, root: Failure) -> None:
        """torchrun's ``ChildFailedError`` layout."""
        script = next((a for a in self.cfg.cmd[1:] if not a.startswith("-")), self.cfg.cmd[0])
        sep = "=" * 60
        lines = [sep, f"{script} FAILED", "-" * 60, "Failures:"]
        others = [f for f in self.failures if f is not root]
        if not others:
            lines.append("  <NO_OTHER_FAILURES>")
        for i, f in enumerate(others, 1):
            lines += self._failure_lines(i, f)
        lines += ["-" * 60, "Root Cause (first observed failure):"]
        lines += self._failure_lines(0, root)
        lines.append(sep)
        print("\n".join(lines), file=sys.stderr, flush=True)

    def _failure_lines(self, idx: int, f: Failure) -> list[str]:
        return [
            f"[{idx}]:",
            f"  time      : {datetime.fromtimestamp(f.at).strftime('%Y-%m-%d_%H:%M:%S')}",
            f"  host      : {socket.getfqdn()}",
            f"  rank      : {f.rank} (local_rank: {f.local_rank})",
            f"  exitcode  : {f.exitcode} (pid: {f.pid})",
            f"  restarts  : {f.restart_count} of {self.cfg.max_restarts}",
            f"  error_file: {f.error_file if f.error_file and os.path.exists(f.error_file) else '<N/A>'}",
            f"  traceback : {f.describe()}",
        ]


def install_signal_handlers(names: list[str], handler: Any) -> dict[int, Any]:
    """Install ``handler(signum)`` for each signal name; returns the previous handlers."""
    previous = {}
    for name in names:
        signum = getattr(signal, name)
        try:
            previous[signum] = signal.signal(signum, lambda s, _f: handler(s))
        except (ValueError, OSError) as exc:  # not the main thread, or SIGKILL/SIGSTOP
            raise ResilientError(f"cannot handle {name}: {exc}; remove it from --signals-to-handle") from exc
    return previous
