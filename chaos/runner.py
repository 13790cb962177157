"""The chaos run: starts real etcd (1 or 3 members), coordinator(s) and member
processes, injects a scenario's faults, and collects a
:class:`~resilient.chaos.verifier.RunLog` for :func:`~resilient.chaos.verifier.verify`.

    log = run_scenario(scenario, seed, workdir=None, backend="resilient")

The parts: :mod:`~resilient.chaos.supervision` (the processes),
:mod:`~resilient.chaos.injection` (what a fault kind may do; each kind's injection is in
``chaos/kinds/<kind>.py``), :mod:`~resilient.chaos.monitor` (op 0, exits, stops,
progress) and :mod:`~resilient.chaos.records` (the records directory). This module is the
run itself.

How faults are injected (every signal goes to a PID this runner started):

- op/phase-triggered faults (``kill``/``hang``): ``RESILIENT_FAILPOINTS`` in the victim's
  environment (:meth:`~resilient.chaos.faults.Fault.failpoint_spec`); the victim stops
  itself at that exact point; the monitor sees it (exit by SIGKILL, or state ``T``) and
  the kind records it (a hang with ``resume_after_s`` gets its SIGCONT later);
- time-triggered faults fire ``time_s`` after *every member has started op 0* (not after
  the run's start: members take seconds to reach their first op on a loaded machine, and a
  fault before op 0 would prove nothing); a ``duration_s`` workload is timed from that
  moment too. Each fires through its kind's ``inject`` (signals, shaping files, etcd,
  coordinators, ``tc netem``; see the kinds). A time-triggered fault whose time had not
  come when the run ended is recorded as never fired;
- a kind with ``needs_netns`` (``netem``) runs every member in its own network namespace
  (:class:`~resilient.chaos.netns.NetnsLab`: one bridge, a veth per member; etcd and the
  coordinators listen on the bridge's host IP, each member's transport on its namespace
  IP through ``RESILIENT_HOST``). Where the kernel has no netem qdisc (probed,
  :func:`~resilient.chaos.netns.netem_unavailable_reason`) the members still run in their
  namespaces and the fault is recorded as skipped with the probed reason; where
  namespaces cannot be made (not root, no ``ip``, ``ip netns add`` refused)
  :func:`skip_reason` skips the whole scenario with the probed reason;
- a scenario with ``hosts: H`` runs its members on ``H`` emulated hosts: one namespace
  per host, members :meth:`~resilient.chaos.scenario.Scenario.host_of` it share it (so
  their links are shared memory) and its ``host`` label (``RESILIENT_HOST_LABEL``), and
  ``host_link_mbit`` caps every host-to-host link with htb
  (:meth:`~resilient.chaos.netns.NetnsLab.cap_link`).

Like a node agent, the runner revokes the lease of a member whose process died, so the
coordinator publishes the next epoch at once — unless the scenario says
``detection: ttl``, which leaves the lease to expire after ``lease_ttl_s``. ``t0`` (time
zero of every time in the log; ``RunLog.ops_start_s`` is the time triggers' zero on that
scale) is when the first epoch holding every member was seen; the runner then writes the
``go`` file the members wait for (protocol in :mod:`resilient.chaos.worker`).

Failure behaviour: the run ends when every member that was not a fault victim has exited,
or when no live member has recorded progress for ``op_timeout_s`` (the verifier then
reports the unfinished ops as hangs). Every process started here — members,
coordinators, etcd — is stopped by PID in ``finally`` (SIGCONT first for stopped ones),
also on errors and Ctrl-C. If etcd, the coordinators or the members do not come up within
``start_timeout`` seconds, :class:`~resilient.errors.StoreUnavailable` /
:class:`RunnerError` says which, with the tail of its log.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from resilient.chaos import records
from resilient.chaos.faults import Fault
from resilient.chaos.injection import FaultLog, RunInjector, shaping_file
from resilient.chaos.members import member_id, member_index
from resilient.chaos.monitor import MemberMonitor
from resilient.chaos.scenario import Scenario, resolve_faults
from resilient.chaos.supervision import Proc, spawn, stop_all, watch_ready
from resilient.process_pool import ProcessPool
from resilient.chaos.verifier import NEVER_FIRED, EpochEvent, FaultEvent, RunLog
from resilient.errors import ConfigError, ResilientError

if TYPE_CHECKING:
    from resilient.chaos.netns import NetnsLab
    from resilient.coordinator.epoch import Epoch
    from resilient.coordinator.local_etcd import LocalEtcd
    from resilient.coordinator.store import Store
    from resilient.metrics import NodeMetricsServer

__all__ = ["START_ATTEMPTS", "ChaosRunner", "RunnerError", "RunnerUnavailable",
           "StartFailed", "run_scenario", "runner_unavailable_reason", "skip_reason"]


class RunnerUnavailable(ConfigError):
    """The runner cannot run here (a part it needs is missing); the message says which."""


class RunnerError(ResilientError):
    """A process the runner started did not come up; the message carries its log tail."""


class StartFailed(RunnerError):
    """A member that no fault touched left (or never started op 0) before every member had
    started op 0 — typically its lease expired while an overloaded machine starved it
    during start-up. Nothing under test ran yet, so :func:`run_scenario` starts the seed
    again (``start_attempts``); the message names the member and carries its log tail."""


def runner_unavailable_reason(backend: str = "resilient") -> str | None:
    """``None`` when the runner can run with ``backend``; otherwise why not."""
    if backend == "oracle":
        return None
    if importlib.util.find_spec("torch") is None:
        return ("the chaos runner's `resilient` backend needs torch (resilient.collectives.Communicator); "
                "install the package with its dependencies, or use `--backend oracle` for a self-test of the runner")
    return None


def skip_reason(scenario: Scenario) -> str | None:
    """Why this scenario must be skipped on this machine (e.g. netem needs root), else ``None``."""
    if "root" in scenario.requires and os.geteuid() != 0:
        return f"scenario {scenario.name!r} needs root and `ip netns` for tc netem; run it as root"
    if scenario.needs_netns():
        from resilient.chaos.netns import netns_unavailable_reason

        reason = netns_unavailable_reason()
        if reason is not None:
            why = "as emulated hosts" if scenario.hosts else "for tc netem"
            return f"scenario {scenario.name!r} places its members in network namespaces {why}: {reason}"
    if scenario.host_link_mbit is not None:
        from resilient.chaos.netns import u32_unavailable_reason

        reason = u32_unavailable_reason()
        if reason is not None:
            return f"scenario {scenario.name!r} caps its host links with htb: {reason}"

    return None


class ChaosRunner:
    """Runs one seed of one scenario; see the module docstring."""

    def __init__(self, scenario: Scenario, seed: int, workdir: str | os.PathLike[str] | None = None,
                 backend: str = "resilient", worker_args: Sequence[str] = (), start_timeout: float = 60.0,
                 end_condition: Callable[[ChaosRunner], bool] | None = None, end_deadline_s: float = 60.0,
                 metrics: bool = False, on_finished: Callable[[ChaosRunner], None] | None = None,
                 on_ready: Callable[[ChaosRunner], None] | None = None) -> None:
        """``end_condition`` (duration workloads): the end is named only once the duration
        is up *and* ``end_condition(runner)`` holds (e.g. "an epoch without member 2 was
        published"), or ``end_deadline_s`` after the duration at the latest — so a test
        waits on the condition instead of hoping it happens within a fixed time.

        ``metrics``: serve real Prometheus endpoints — one node-agent ``/metrics``
        (prometheus-client multiprocess mode) per member, as if each member ran on its own
        node (:attr:`metrics_urls` ``member index -> URL``), and each coordinator's own
        (:meth:`coordinator_metrics_url`). ``on_finished(runner)`` is called when every
        op is done, while members, coordinators and endpoints are still up (to scrape).
        ``on_ready(runner)`` is called once every member is in the first full epoch and its
        endpoint is up, before the workload starts (the ``go`` file): a baseline scrape there
        cannot see an op. An exception from either callback ends the run (every process
        started is still stopped) and propagates."""
        reason = runner_unavailable_reason(backend)
        if reason is not None:
            raise RunnerUnavailable(reason)
        if scenario.workload.script is not None:
            raise RunnerUnavailable("training-script workloads need the launcher integration, not built yet")
        self.sc, self.seed, self.backend = scenario, seed, backend
        self.worker_args = list(worker_args)
        self.end_condition, self.end_deadline_s = end_condition, end_deadline_s
        self.metrics, self.on_finished, self.on_ready = metrics, on_finished, on_ready
        self.metrics_urls: dict[int, str] = {}
        self._metrics_servers: dict[int, NodeMetricsServer] = {}
        self.start_timeout = start_timeout
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"resilient-chaos-{scenario.name}-"))
        self.records = self.workdir / f"seed{seed}"
        self.job = f"chaos-{seed}-{uuid.uuid4().hex[:8]}"
        self.faults: tuple[Fault, ...] = resolve_faults(scenario, seed)
        self.workers: dict[int, Proc] = {}
        self.coordinators: dict[str, Proc] = {}
        self.pool = ProcessPool()   # every process of the run (members, coordinators)
        self.log = FaultLog()
        self.epochs: list[EpochEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.t0 = 0.0
        self.end_op: int | None = None
        self.etcd: LocalEtcd | None = None
        self.store: Store | None = None
        self.ops_t0: float | None = None  # wall time every member had started op 0 (time triggers' zero)
        self.start_failure: str | None = None  # why the members did not all reach op 0 (StartFailed)
        #: members in network namespaces (netem scenarios, resilient backend); None: loopback
        self.lab: NetnsLab | None = None
        self._netem_reason: str | None = None  # why netem cannot be injected here (probed)

    # -- processes ---------------------------------------------------------------------

    def _spawn(self, etcd: LocalEtcd, name: str, args: list[str], env: dict[str, str] | None = None,
               pipe: bool = False, prefix: Sequence[str] = ()) -> Proc:
        return spawn(self.pool, name, args, self.workdir / "logs", {**os.environ, **etcd.access.child_env(), **(env or {})},
                     pipe=pipe, prefix=prefix)

    def _start_coordinator(self, etcd: LocalEtcd, cid: str) -> None:
        ttl = max(1.0, self.sc.lease_ttl_s)
        self.coordinators[cid] = self._spawn(
            etcd, f"coordinator-{cid}", ["-c", "import sys; from resilient.cli import main; sys.exit(main())",
                                         "coordinator", "--etcd", etcd.endpoint_arg, "--job", self.job, "--id", cid,
                                         "--ttl", str(ttl), "--min-members", str(self.sc.world_size),
                                         *(["--metrics-port", "0", "--metrics-host", "127.0.0.1"] if self.metrics
                                           else ["--metrics-port", "-1"])])

    def coordinator_metrics_url(self, cid: str, timeout: float = 10.0) -> str:
        """The ``/metrics`` URL coordinator ``cid`` printed on start (``metrics=True``).
        Raises :class:`RunnerError` when it printed none within ``timeout``."""
        proc = self.coordinators[cid]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in proc.log_tail(200).splitlines():
                if line.startswith("coordinator ") and " metrics http://" in line:
                    return line.rsplit(" metrics ", 1)[1].strip() + "/metrics"
            time.sleep(0.05)
        raise RunnerError(f"coordinator {cid} printed no metrics URL within {timeout:g}s:\n{proc.log_tail()}")

    def _start_worker(self, etcd: LocalEtcd, i: int, scenario_path: Path) -> None:
        fps = [f.failpoint_spec() for f in self.faults
               if f.member == i and f.trigger.in_process]
        env = {"RESILIENT_FAILPOINTS": ";".join(fps), "RESILIENT_SHAPING_FILE": str(shaping_file(self.records, i))}
        prefix: list[str] = []
        if self.lab is not None:
            ns = self.sc.host_of(i) if self.sc.hosts else i
            env["RESILIENT_HOST"] = self.lab.ips[ns]
            prefix = self.lab.exec_prefix(ns)
            if self.sc.hosts:
                env["RESILIENT_HOST_LABEL"] = f"host{ns}"
        extra: list[str] = []
        if self.metrics:
            from resilient.metrics import prepare_multiprocess_dir, serve_node_metrics, worker_env

            mdir = prepare_multiprocess_dir(self.workdir / "metrics" / member_id(i))
            server = serve_node_metrics(mdir, port=0, addr="127.0.0.1")
            self._metrics_servers[i] = server
            self.metrics_urls[i] = f"http://127.0.0.1:{server.port}/metrics"
            env.update(worker_env(mdir))
            extra = ["--metrics"]
        proc = self._spawn(etcd, f"member-{i}", ["-m", "resilient.chaos.worker", "--scenario", str(scenario_path),
                                                 "--member", str(i), "--seed", str(self.seed),
                                                 "--etcd", etcd.endpoint_arg, "--job", self.job,
                                                 "--records", str(self.records), "--backend", self.backend,
                                                 *extra, *self.worker_args], env=env, pipe=True, prefix=prefix)
        watch_ready(proc)
        self.workers[i] = proc

    # -- the run -------------------------------------------------------------------------

    def run(self) -> RunLog:
        """Run the scenario once and return its log; see the module docstring."""
        from resilient.coordinator.epoch import EpochWatcher
        from resilient.coordinator.local_etcd import LocalEtcd

        self.records.mkdir(parents=True, exist_ok=True)
        scenario_path = self.workdir / "scenario.yaml"
        if not os.path.exists(self.sc.source):
            raise ConfigError(f"scenario {self.sc.name!r} has no file to hand to the members ({self.sc.source})")
        shutil.copyfile(self.sc.source, scenario_path)
        watcher = None
        try:
            host = "127.0.0.1"
            if self.sc.needs_netns() and self.backend == "resilient":
                from resilient.chaos.netns import NetnsLab, netem_unavailable_reason

                self._netem_reason = netem_unavailable_reason()
                self.lab = NetnsLab(self.sc.hosts or self.sc.world_size).open()  # NetnsUnavailable: skip_reason
                host = self.lab.host_ip
                if self.sc.host_link_mbit is not None:
                    for a in range(self.sc.hosts):
                        for b in range(a + 1, self.sc.hosts):
                            self.lab.cap_link(a, b, self.sc.host_link_mbit)
            etcd = self.etcd = LocalEtcd(size=self.sc.etcd_members, host=host).start()
            store = self.store = etcd.access.open_store(etcd.endpoints)
            for c in range(self.sc.coordinators):
                self._start_coordinator(etcd, f"c{c}")
            for i in range(self.sc.world_size):
                self._start_worker(etcd, i, scenario_path)
            deadline = time.monotonic() + self.start_timeout
            for i, proc in self.workers.items():
                while not proc.ready.wait(0.05):
                    if not proc.alive() or time.monotonic() > deadline:
                        raise RunnerError(f"member {i} did not register within {self.start_timeout:.0f}s "
                                          f"(exit {proc.popen.poll()}):\n{proc.log_tail()}")
            watcher = EpochWatcher(store, self.job)
            try:
                watcher.wait_for(lambda e: len(e.members) == self.sc.world_size, max(1.0, deadline - time.monotonic()))
            except ResilientError as exc:
                tails = "\n".join(f"--- {p.name}\n{p.log_tail(10)}" for p in self.coordinators.values())
                raise RunnerError(f"no epoch with all {self.sc.world_size} members within "
                                  f"{self.start_timeout:.0f}s ({exc}):\n{tails}") from None
            if self.on_ready is not None:
                self.on_ready(self)
            self.t0 = time.time()
            records.write_atomic(self.records / "go", repr(self.t0))
            watcher.subscribe(self._on_epoch, replay=True)
            injector = RunInjector(self.backend, self.t0, self.log, self._stop, self.records, self.workers,
                                   self.coordinators, etcd, store, self.job,
                                   lambda cid: self._start_coordinator(etcd, cid), self.lab, self._netem_reason)
            monitor = MemberMonitor(self.sc, self.workers, self.records, self.log, self._stop, self.start_timeout)
            # time triggers and the duration count from op 0 (see _inject_timed)
            timed = threading.Thread(target=self._inject_timed, args=(monitor, injector), name="injector",
                                     daemon=True)
            timed.start()
            monitor.watch(self.faults, injector, store, self.job,
                          {i: s.path for i, s in self._metrics_servers.items()},
                          lambda: self.start_failure is not None)
            if self.start_failure is not None:
                raise StartFailed(self.start_failure)
            if self.on_finished is not None:
                self.on_finished(self)
            self._stop.set()
            timed.join(timeout=10)
        finally:
            self._stop.set()
            if watcher is not None:
                self._await_newest_epoch_logged(store)
                watcher.close()
            (self.records / "stop").write_text("")
            self._teardown()
        self._record_unfired()
        return RunLog(scenario=self.sc, seed=self.seed, records=records.read_records(
            self.records, self.sc.world_size, self.t0), faults=sorted(self.log.events(), key=lambda e: e.time_s),
            epochs=sorted(self.epochs, key=lambda e: e.number),
            ops_planned=self.sc.workload.ops if self.sc.workload.ops is not None else self.end_op,
            duration_s=time.time() - self.t0,
            ops_start_s=None if self.ops_t0 is None else self.ops_t0 - self.t0)

    def _record_unfired(self) -> None:
        """A planned fault that never fired proves nothing: record it as such."""
        fired = {(e.kind, e.victim) for e in self.log.events()}
        for f in self.faults:
            if f.trigger.in_process and (f.kind.name, f.member) not in fired:
                self.log.record(FaultEvent(f.kind.name, self.sc.op_timeout_s, f"member {f.member}",
                                           skipped=f"{NEVER_FIRED}: the victim did not reach {f.trigger.describe()}"))
        unfired = [f for f in self.faults if not f.trigger.in_process and not self.log.fired(f)]
        ops_zero = self.ops_t0 if self.ops_t0 is not None else time.time()
        for f in unfired:  # e.g. the workload ended before its time came
            self.log.record(FaultEvent(f.kind.name, ops_zero + (f.trigger.time_s or 0.0) - self.t0, f.target_text(),
                                       skipped=f"{NEVER_FIRED}: the run ended before {f.trigger.describe()} "
                                               f"(time triggers count from op 0)"))

    def _inject_timed(self, monitor: MemberMonitor, injector: RunInjector) -> None:
        """Wait until every member has started op 0, then name the end of a duration
        workload after ``duration_s`` and fire each time-triggered fault at
        ``time_s`` — both counted from that moment, so no fault lands before the first op
        (members take seconds to start on a loaded machine). A fault whose time never
        comes before the run ends is reported as never fired (the verifier counts it as
        vacuous, a failure)."""
        zero, failure = monitor.await_op0()
        with self._lock:
            self.ops_t0, self.start_failure = zero, failure
        if self._stop.is_set() or failure is not None:
            return
        duration = self.sc.workload.duration_s
        if duration is not None:
            injector.later(max(0.0, zero + duration - time.time()), self._name_the_end)
        timed = [(f.trigger.time_s, f) for f in self.faults if f.trigger.time_s is not None]
        for at, fault in sorted(timed, key=lambda t: t[0]):
            if self._stop.wait(max(0.0, zero + at - time.time())):
                return
            injector.inject(fault)

    def _name_the_end(self) -> None:
        """Duration is up: once ``end_condition`` holds (or ``end_deadline_s`` passed),
        write the op count into the ``end`` file (:func:`~resilient.chaos.records.end_op`)."""
        if self.end_condition is not None:
            deadline = time.monotonic() + self.end_deadline_s
            while not self.end_condition(self) and time.monotonic() < deadline:
                if self._stop.wait(0.05):
                    return
        self.end_op = records.end_op(self.records, self.sc.world_size)
        records.write_atomic(self.records / "end", str(self.end_op))

    def _await_newest_epoch_logged(self, store: Store) -> None:
        """Wait (at most 10 s) until the epoch watch has delivered the newest epoch in etcd,
        so a run that ends right after an epoch change still logs it (under load the watch
        can lag the end of the run). Best effort: an unreadable epoch just skips the wait."""
        from resilient.coordinator.epoch import read_epoch

        try:
            newest, _ = read_epoch(store, self.job)
        except Exception:  # noqa: BLE001 - teardown: never let this hide the run's own outcome
            return
        deadline = time.monotonic() + 10.0
        while newest is not None and time.monotonic() < deadline:
            with self._lock:
                if any(e.number >= newest.number for e in self.epochs):
                    return
            time.sleep(0.05)

    def _on_epoch(self, epoch: Epoch) -> None:
        members = tuple(sorted(member_index(m) for m in epoch.members if m.startswith("m")))
        at = (epoch.published_at or time.time()) - self.t0
        with self._lock:
            if all(e.number != epoch.number for e in self.epochs):
                self.epochs.append(EpochEvent(epoch.number, max(at, 0.0), members))

    def _teardown(self) -> None:
        stop_all(self.pool, list(self.workers.values()),
                 lambda p: (self.records / f"done-{p.name.split('-')[1]}").exists())
        for server in self._metrics_servers.values():
            server.close()
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                pass
        try:
            if self.etcd is not None:
                self.etcd.stop()
        finally:
            if self.lab is not None:  # after every process in it stopped
                lab, self.lab = self.lab, None
                lab.close()


#: How often :func:`run_scenario` starts a seed whose start-up failed (:class:`StartFailed`).
START_ATTEMPTS = 3


def run_scenario(scenario: Scenario, seed: int, workdir: str | os.PathLike[str] | None = None,
                 backend: str = "resilient", worker_args: Sequence[str] = (),
                 start_attempts: int = START_ATTEMPTS) -> RunLog:
    """Run one seed of ``scenario`` for real and return its log (see :class:`ChaosRunner`).
    Raises :class:`RunnerUnavailable` when the backend cannot run here. A seed whose
    start-up failed before every member reached op 0 (:class:`StartFailed`: nothing under
    test had run) is started again, up to ``start_attempts`` times in all, each retry noted
    on stderr; the last :class:`StartFailed` propagates."""
    for attempt in range(1, start_attempts + 1):
        wd = None if workdir is None else Path(workdir) / f"attempt{attempt}" if attempt > 1 else workdir
        runner = ChaosRunner(scenario, seed, wd, backend, worker_args)
        try:
            return runner.run()
        except StartFailed as exc:
            if attempt == start_attempts:
                raise
            print(f"chaos: {scenario.name} seed {seed}: start-up failed, starting the seed again "
                  f"({attempt}/{start_attempts}): {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        finally:
            if workdir is None:
                shutil.rmtree(runner.workdir, ignore_errors=True)
    raise AssertionError("unreachable")
