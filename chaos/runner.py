"""The chaos runner: starts real etcd (1 or 3 members), coordinator(s) and member
processes, injects a scenario's faults, and collects a
:class:`~resilient.chaos.verifier.RunLog` for :func:`~resilient.chaos.verifier.verify`.

    log = run_scenario(scenario, seed, workdir=None, backend="resilient")

How faults are injected (every signal goes to a PID this runner started):

- op/phase-triggered ``kill``/``hang``: ``RESILIENT_FAILPOINTS`` in the victim's
  environment (:meth:`~resilient.chaos.faults.Fault.failpoint_spec`); the victim stops
  itself at that exact point; the runner sees it (exit by SIGKILL, or state ``T``),
  records the fault and, for a hang with ``resume_after_s``, sends SIGCONT later;
- time-triggered faults fire ``time_s`` after *every member has started op 0* (not after
  the run's start: members take seconds to reach their first op on a loaded machine, and a
  fault before op 0 would prove nothing); a ``duration_s`` workload is timed from that
  moment too. ``kill``/``hang``: SIGKILL / SIGSTOP (+ SIGCONT). A time-triggered fault
  whose time had not come when the run ended is recorded as never fired;
- ``etcd_kill``: SIGKILL that etcd member (restarted after ``restart_after_s``);
- ``coordinator_kill``: SIGKILL the coordinator whose id is under ``leader`` in etcd;
- ``slow``, ``drop_link``, ``partition``: written into each affected member's shaping
  file (``RESILIENT_SHAPING_FILE`` of :mod:`resilient.transport.shaping`, re-read by the
  member's transport within 0.2 s): ``delay=``/``bw=`` for slow, ``drop=m<j>`` on both
  ends of each cut link; removed again after ``duration_s`` (resilient backend only —
  the oracle backend has no transport, so there they are recorded as skipped);
- ``netem``: a scenario with a ``netem`` fault runs every member in its own network
  namespace (:class:`~resilient.chaos.netns.NetnsLab`: one bridge, a veth per member;
  etcd and the coordinators listen on the bridge's host IP, each member's transport on
  its namespace IP through ``RESILIENT_HOST``). At the trigger the runner puts ``tc
  netem`` delay/loss on the traffic between the two members of ``link`` only (htb + u32
  on both namespace veths) and removes it after ``duration_s``. Where the kernel has no
  netem qdisc (probed, :func:`~resilient.chaos.netns.netem_unavailable_reason`) the
  members still run in their namespaces and the fault is recorded as skipped with the
  probed reason; where namespaces cannot be made (not root, no ``ip``, ``ip netns add``
  refused) :func:`skip_reason` skips the whole scenario with the probed reason.

Like a node agent, the runner revokes the lease of a member whose process died, so the
coordinator publishes the next epoch at once — unless the scenario says
``detection: ttl``, which leaves the lease to expire after ``lease_ttl_s``. ``t0`` (time zero of every time in the log; ``RunLog.ops_start_s`` is the time triggers' zero on that scale)
log) is when the first epoch holding every member was seen; the runner then writes the
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
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from resilient.chaos.faults import Fault, FaultKind
from resilient.chaos.scenario import Scenario, resolve_faults
from resilient.chaos.verifier import NEVER_FIRED, EpochEvent, FaultEvent, OpRecord, RunLog
from resilient.chaos.worker import member_id, member_index
from resilient.errors import ConfigError, ResilientError

#: Faults the runner cannot inject, with the reason recorded in the report.
UNSUPPORTED: dict[FaultKind, str] = {}
#: Faults injected through the members' transport shaping files (resilient backend only).
SHAPING_KINDS = frozenset({FaultKind.SLOW, FaultKind.DROP_LINK, FaultKind.PARTITION})
ORACLE_NO_TRANSPORT = "the oracle backend has no transport to shape; run with the resilient backend"


#: Duration workloads end this many ops past the furthest member when the time is up.
END_MARGIN_OPS = 5
END_MARGIN_S = 2.0


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
    if FaultKind.NETEM in scenario.fault_kinds():
        from resilient.chaos.netns import netns_unavailable_reason

        reason = netns_unavailable_reason()
        if reason is not None:
            return f"scenario {scenario.name!r} places its members in network namespaces for tc netem: {reason}"
    return None


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    lease_id: int | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stopped(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, IndexError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""


def _signal(proc: _Proc, sig: int) -> None:
    if proc.alive():
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


class ChaosRunner:
    """Runs one seed of one scenario; see the module docstring."""

    def __init__(self, scenario: Scenario, seed: int, workdir: str | os.PathLike | None = None,
                 backend: str = "resilient", worker_args: Sequence[str] = (), start_timeout: float = 60.0,
                 end_condition: Callable[["ChaosRunner"], bool] | None = None, end_deadline_s: float = 60.0,
                 metrics: bool = False, on_finished: Callable[["ChaosRunner"], None] | None = None) -> None:
        """``end_condition`` (duration workloads): the end is named only once the duration
        is up *and* ``end_condition(runner)`` holds (e.g. "an epoch without member 2 was
        published"), or ``end_deadline_s`` after the duration at the latest — so a test
        waits on the condition instead of hoping it happens within a fixed time.

        ``metrics``: serve real Prometheus endpoints — one node-agent ``/metrics``
        (prometheus-client multiprocess mode) per member, as if each member ran on its own
        node (:attr:`metrics_urls` ``member index -> URL``), and each coordinator's own
        (:meth:`coordinator_metrics_url`). ``on_finished(runner)`` is called when every
        op is done, while members, coordinators and endpoints are still up (to scrape)."""
        reason = runner_unavailable_reason(backend)
        if reason is not None:
            raise RunnerUnavailable(reason)
        if scenario.workload.script is not None:
            raise RunnerUnavailable("training-script workloads need the launcher integration, not built yet")
        self.sc, self.seed, self.backend = scenario, seed, backend
        self.worker_args = list(worker_args)
        self.end_condition, self.end_deadline_s = end_condition, end_deadline_s
        self.metrics, self.on_finished = metrics, on_finished
        self.metrics_urls: dict[int, str] = {}
        self._metrics_servers: dict[int, object] = {}
        self.start_timeout = start_timeout
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"resilient-chaos-{scenario.name}-"))
        self.records = self.workdir / f"seed{seed}"
        self.job = f"chaos-{seed}-{uuid.uuid4().hex[:8]}"
        self.faults: tuple[Fault, ...] = resolve_faults(scenario, seed)
        self.workers: dict[int, _Proc] = {}
        self.coordinators: dict[str, _Proc] = {}
        self.events: list[FaultEvent] = []
        self.epochs: list[EpochEvent] = []
        self.victims: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.t0 = 0.0
        self.end_op: int | None = None
        self.etcd = None
        self.store = None
        self._shaping: dict[int, dict[int, str]] = {}  # member -> {fault id: spec items}
        self._resuming: set[int] = set()  # stopped members a SIGCONT is scheduled for
        self.ops_t0: float | None = None  # wall time every member had started op 0 (time triggers' zero)
        self._fired: set[int] = set()  # id() of time-triggered faults whose time came
        self.start_failure: str | None = None  # why the members did not all reach op 0 (StartFailed)
        #: members in network namespaces (netem scenarios, resilient backend); None: loopback
        self.lab = None
        self._netem_reason: str | None = None  # why netem cannot be injected here (probed)

    # -- processes ---------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, pipe: bool = False,
               prefix: Sequence[str] = ()) -> _Proc:
        log_path = self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
        # prefix: `ip netns exec NS` (it execs python, so the PID is the member's own)
        popen = subprocess.Popen([*prefix, sys.executable, *args], stdout=subprocess.PIPE if pipe else log, stderr=log,
                                 env={**os.environ, **self.etcd.access.child_env(), **(env or {})},
                                 start_new_session=True, text=pipe or None)
        log.close()
        return _Proc(name, popen, log_path)

    def _start_coordinator(self, cid: str) -> None:
        ttl = max(1.0, self.sc.lease_ttl_s)
        self.coordinators[cid] = self._spawn(
            f"coordinator-{cid}", ["-c", "import sys; from resilient.cli import main; sys.exit(main())",
                                   "coordinator", "--etcd", self.etcd.endpoint_arg, "--job", self.job, "--id", cid,
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

    def _start_worker(self, i: int, scenario_path: Path) -> None:
        fps = [f.failpoint_spec() for f in self.faults
               if f.member == i and f.trigger.in_process]
        env = {"RESILIENT_FAILPOINTS": ";".join(fps), "RESILIENT_SHAPING_FILE": str(self._shaping_file(i))}
        prefix: list[str] = []
        if self.lab is not None:
            env["RESILIENT_HOST"] = self.lab.ips[i]
            prefix = self.lab.exec_prefix(i)
        extra: list[str] = []
        if self.metrics:
            from resilient.metrics import prepare_multiprocess_dir, serve_node_metrics, worker_env

            mdir = prepare_multiprocess_dir(self.workdir / "metrics" / member_id(i))
            server = serve_node_metrics(mdir, port=0, addr="127.0.0.1")
            self._metrics_servers[i] = server
            self.metrics_urls[i] = f"http://127.0.0.1:{server.port}/metrics"
            env.update(worker_env(mdir))
            extra = ["--metrics"]
        proc = self._spawn(f"member-{i}", ["-m", "resilient.chaos.worker", "--scenario", str(scenario_path),
                                           "--member", str(i), "--seed", str(self.seed),
                                           "--etcd", self.etcd.endpoint_arg, "--job", self.job,
                                           "--records", str(self.records), "--backend", self.backend,
                                           *extra, *self.worker_args], env=env, pipe=True, prefix=prefix)

        def read_ready() -> None:
            for line in proc.popen.stdout:  # type: ignore[union-attr]
                parts = line.split()
                if len(parts) >= 3 and parts[0] == "READY":
                    proc.lease_id = int(parts[2])
                    proc.ready.set()
            proc.popen.stdout.close()  # type: ignore[union-attr]

        threading.Thread(target=read_ready, name=f"ready-{i}", daemon=True).start()
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
            if FaultKind.NETEM in self.sc.fault_kinds() and self.backend == "resilient":
                from resilient.chaos.netns import NetnsLab, netem_unavailable_reason

                self._netem_reason = netem_unavailable_reason()
                self.lab = NetnsLab(self.sc.world_size).open()  # NetnsUnavailable: see skip_reason
                host = self.lab.host_ip
            self.etcd = LocalEtcd(size=self.sc.etcd_members, host=host).start()
            self.store = self.etcd.access.open_store(self.etcd.endpoints)
            for c in range(self.sc.coordinators):
                self._start_coordinator(f"c{c}")
            for i in range(self.sc.world_size):
                self._start_worker(i, scenario_path)
            deadline = time.monotonic() + self.start_timeout
            for i, proc in self.workers.items():
                while not proc.ready.wait(0.05):
                    if not proc.alive() or time.monotonic() > deadline:
                        raise RunnerError(f"member {i} did not register within {self.start_timeout:.0f}s "
                                          f"(exit {proc.popen.poll()}):\n{proc.log_tail()}")
            watcher = EpochWatcher(self.store, self.job)
            try:
                watcher.wait_for(lambda e: len(e.members) == self.sc.world_size, max(1.0, deadline - time.monotonic()))
            except ResilientError as exc:
                tails = "\n".join(f"--- {p.name}\n{p.log_tail(10)}" for p in self.coordinators.values())
                raise RunnerError(f"no epoch with all {self.sc.world_size} members within "
                                  f"{self.start_timeout:.0f}s ({exc}):\n{tails}") from None
            self.t0 = time.time()
            tmp = self.records / "go.tmp"
            tmp.write_text(repr(self.t0))
            tmp.rename(self.records / "go")
            watcher.subscribe(self._on_epoch, replay=True)
            # time triggers and the duration count from op 0 (see _inject_timed)
            injector = threading.Thread(target=self._inject_timed, name="injector", daemon=True)
            injector.start()
            self._monitor()
            if self.start_failure is not None:
                raise StartFailed(self.start_failure)
            if self.on_finished is not None:
                self.on_finished(self)
            self._stop.set()
            injector.join(timeout=10)
        finally:
            self._stop.set()
            if watcher is not None:
                watcher.close()
            (self.records / "stop").write_text("")
            self._teardown()
        fired = {(e.kind, e.victim) for e in self.events}
        for f in self.faults:  # a planned fault that never fired proves nothing: say so
            if f.trigger.in_process and (f.kind.value, f.member) not in fired:
                self._record(FaultEvent(f.kind.value, self.sc.op_timeout_s, f"member {f.member}",
                                        skipped=f"{NEVER_FIRED}: the victim did not reach {f.trigger.describe()}"))
        with self._lock:
            unfired = [f for f in self.faults if not f.trigger.in_process and id(f) not in self._fired]
        ops_zero = self.ops_t0 if self.ops_t0 is not None else time.time()
        for f in unfired:  # e.g. the workload ended before its time came
            self._record(FaultEvent(f.kind.value, ops_zero + f.trigger.time_s - self.t0, f.target_text(),
                                    skipped=f"{NEVER_FIRED}: the run ended before {f.trigger.describe()} "
                                            f"(time triggers count from op 0)"))
        return RunLog(scenario=self.sc, seed=self.seed, records=self._read_records(), faults=sorted(
            self.events, key=lambda e: e.time_s), epochs=sorted(self.epochs, key=lambda e: e.number),
            ops_planned=self.sc.workload.ops if self.sc.workload.ops is not None else self.end_op,
            duration_s=time.time() - self.t0,
            ops_start_s=None if self.ops_t0 is None else self.ops_t0 - self.t0)

    def _name_the_end(self) -> None:
        """Duration is up: the op count is a few ops past the furthest member, so every
        member runs exactly the same ops (members read the ``end`` file before each op)."""
        if self.end_condition is not None:
            deadline = time.monotonic() + self.end_deadline_s
            while not self.end_condition(self) and time.monotonic() < deadline:
                if self._stop.wait(0.05):
                    return
        furthest, rate = -1, 0.0
        for i in range(self.sc.world_size):
            path = self.records / f"member-{i}.jsonl"
            if path.exists():
                starts = []
                for line in path.read_text().splitlines()[-64:]:
                    try:
                        rec = json.loads(line)
                        furthest = max(furthest, int(rec["seq"]))
                        if rec.get("start") is not None:
                            starts.append((float(rec["start"]), int(rec["seq"])))
                    except (ValueError, KeyError, TypeError):
                        pass
                if len(starts) >= 2 and starts[-1][0] > starts[0][0]:
                    rate = max(rate, (starts[-1][1] - starts[0][1]) / (starts[-1][0] - starts[0][0]))
        # Members check the end file before each op; one that started an op past the end
        # before the file appeared would wait forever for the others. So the margin covers
        # END_MARGIN_S of ops at the fastest member's rate (tiny ops run ~1000/s), at least
        # END_MARGIN_OPS.
        self.end_op = furthest + max(END_MARGIN_OPS, int(rate * END_MARGIN_S) + 1)
        tmp = self.records / "end.tmp"
        tmp.write_text(str(self.end_op))
        tmp.rename(self.records / "end")

    def _now(self) -> float:
        return time.time() - self.t0

    def _on_epoch(self, epoch) -> None:
        members = tuple(sorted(member_index(m) for m in epoch.members if m.startswith("m")))
        at = (epoch.published_at or time.time()) - self.t0
        with self._lock:
            if all(e.number != epoch.number for e in self.epochs):
                self.epochs.append(EpochEvent(epoch.number, max(at, 0.0), members))

    def _record(self, event: FaultEvent) -> None:
        with self._lock:
            self.events.append(event)
            if event.victim is not None and event.skipped is None:
                self.victims.add(event.victim)

    def _later(self, delay: float, action) -> None:
        def run() -> None:
            if not self._stop.wait(delay):
                action()
        threading.Thread(target=run, daemon=True).start()

    def _await_op0(self) -> float:
        """Wall time at which every member had started op 0 (the latest ``start`` of their
        op-0 records). A member that exited before op 0 is not waited for; after
        ``start_timeout`` the members seen so far count (the verifier reports the others'
        ops as lost). Returns early (with the current time) when the run is stopped."""
        deadline = time.monotonic() + self.start_timeout
        starts: dict[int, float] = {}
        while True:
            for i, proc in self.workers.items():
                if i not in starts:
                    t = _op0_start(self.records / f"member-{i}.jsonl")
                    if t is not None:
                        starts[i] = t
            with self._lock:
                victims = set(self.victims)
            gone = [i for i, p in self.workers.items() if i not in starts and not p.alive() and i not in victims]
            waiting = [i for i, p in self.workers.items() if i not in starts and p.alive()]
            late = waiting if time.monotonic() > deadline else []
            if gone or late:
                i = (gone or late)[0]
                proc = self.workers[i]
                what = (f"exited (code {proc.popen.poll()})" if gone else
                        f"had not started it after {self.start_timeout:.0f}s")
                with self._lock:
                    self.start_failure = (f"member {i} {what} before every member had started op 0 — start-up, "
                                          f"not the scenario, failed (an overloaded machine can starve a member "
                                          f"past its {self.sc.lease_ttl_s:g}s lease):\n{proc.log_tail()}")
                return time.time()
            if not waiting or self._stop.is_set():
                return max(starts.values(), default=time.time())
            time.sleep(0.01)

    def _inject_timed(self) -> None:
        """Wait until every member has started op 0, then name the end of a duration
        workload after ``duration_s`` and fire each time-triggered fault at
        ``time_s`` — both counted from that moment, so no fault lands before the first op
        (members take seconds to start on a loaded machine). A fault whose time never
        comes before the run ends is reported as never fired (the verifier counts it as
        vacuous, a failure)."""
        zero = self._await_op0()
        with self._lock:
            self.ops_t0 = zero
        if self._stop.is_set() or self.start_failure is not None:
            return
        if self.sc.workload.duration_s is not None:
            self._later(max(0.0, zero + self.sc.workload.duration_s - time.time()), self._name_the_end)
        for fault in sorted((f for f in self.faults if not f.trigger.in_process), key=lambda f: f.trigger.time_s):
            if self._stop.wait(max(0.0, zero + fault.trigger.time_s - time.time())):
                return
            with self._lock:
                self._fired.add(id(fault))
            try:
                self._inject(fault)
            except Exception as exc:  # a failed injection is reported, never silently lost
                self._record(FaultEvent(fault.kind.value, self._now(), fault.target_text(),
                                        skipped=f"injection failed: {exc}"))

    def _inject(self, fault: Fault) -> None:
        k, p, now = fault.kind, fault.params, self._now()
        if k in UNSUPPORTED:
            self._record(FaultEvent(k.value, now, fault.target_text(), skipped=UNSUPPORTED[k]))
        elif k is FaultKind.NETEM:
            self._inject_netem(fault, now)
        elif k in SHAPING_KINDS:
            self._inject_shaping(fault, now)
        elif k is FaultKind.KILL:
            proc = self.workers[p["member"]]
            self._record(FaultEvent(k.value, now, f"member {p['member']}", victim=p["member"]))
            _signal(proc, signal.SIGKILL)
        elif k is FaultKind.HANG:
            proc = self.workers[p["member"]]
            _signal(proc, signal.SIGSTOP)
            self._hung(p["member"], fault, now)
        elif k is FaultKind.ETCD_KILL:
            i = p["etcd_member"]
            self.etcd.kill(i)
            end = now + p["restart_after_s"] if p.get("restart_after_s") else None
            self._record(FaultEvent(k.value, now, f"etcd member {i}", end_s=end))
            if end is not None:
                self._later(p["restart_after_s"], lambda: self.etcd.restart(i, wait=False))
        elif k is FaultKind.COORDINATOR_KILL:
            from resilient.coordinator.election import current_leader

            leader = current_leader(self.store, self.job)
            proc = self.coordinators.get(leader or "")
            if proc is None or not proc.alive():
                self._record(FaultEvent(k.value, now, "coordinator leader", skipped=f"no live leader ({leader!r})"))
                return
            _signal(proc, signal.SIGKILL)
            end = now + p["restart_after_s"] if p.get("restart_after_s") else None
            self._record(FaultEvent(k.value, now, f"coordinator {leader} (leader)", end_s=end))
            if end is not None:
                self._later(p["restart_after_s"], lambda: self._start_coordinator(f"{leader}r"))

    def _shaping_file(self, member: int) -> Path:
        return self.records / f"shaping-{member}"

    def _set_shaping(self, member: int, key: int, items: str | None) -> None:
        """Add (``items``) or remove (``None``) one fault's shaping on ``member``; the file
        is replaced atomically so the member never reads half of it."""
        with self._lock:
            mine = self._shaping.setdefault(member, {})
            if items is None:
                mine.pop(key, None)
            else:
                mine[key] = items
            text = ",".join(mine.values())
            path = self._shaping_file(member)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.rename(path)

    def _inject_shaping(self, fault: Fault, now: float) -> None:
        k, p = fault.kind, fault.params
        if self.backend == "oracle":
            self._record(FaultEvent(k.value, now, fault.target_text(), skipped=ORACLE_NO_TRANSPORT))
            return
        per_member: dict[int, list[str]] = {}
        if k is FaultKind.SLOW:
            items = []
            if p.get("delay_ms"):
                items.append(f"delay={float(p['delay_ms']):g}ms")
            if p.get("bandwidth_mbit"):
                items.append(f"bw={float(p['bandwidth_mbit']) * 125000:.0f}B/s")
            per_member[p["member"]] = items or ["delay=0ms"]
        elif k is FaultKind.DROP_LINK:
            a, b = p["link"]
            per_member = {a: [f"drop={member_id(b)}"], b: [f"drop={member_id(a)}"]}
        else:  # partition: every member drops every member of the other groups
            groups = [list(g) for g in p["groups"]]
            for g in groups:
                others = [m for h in groups if h is not g for m in h]
                for m in g:
                    per_member[m] = [f"drop={member_id(o)}" for o in others]
        key = id(fault)
        for m, items in per_member.items():
            self._set_shaping(m, key, ",".join(items))
        dur = fault.duration_s
        self._record(FaultEvent(k.value, now, fault.target_text(), end_s=now + dur if dur else None))
        if dur:
            self._later(dur, lambda: [self._set_shaping(m, key, None) for m in per_member])

    def _inject_netem(self, fault: Fault, now: float) -> None:
        """``tc netem`` on the link between two members' namespaces, removed after
        ``duration_s``; recorded as skipped (with the probed reason) where it cannot be."""
        p = fault.params
        if self.backend == "oracle":
            self._record(FaultEvent(fault.kind.value, now, fault.target_text(), skipped=ORACLE_NO_TRANSPORT))
            return
        if self.lab is None or self._netem_reason is not None:
            self._record(FaultEvent(fault.kind.value, now, fault.target_text(),
                                    skipped=self._netem_reason or "the members are not in network namespaces"))
            return
        a, b = p["link"]
        self.lab.apply_netem(a, b, delay_ms=float(p.get("delay_ms") or 0), loss_pct=float(p.get("loss_pct") or 0))
        dur = fault.duration_s
        self._record(FaultEvent(fault.kind.value, now, fault.target_text(), end_s=now + dur if dur else None))
        if dur:
            self._later(dur, lambda: self._clear_netem(a, b))

    def _clear_netem(self, a: int, b: int) -> None:
        from resilient.chaos.netns import NetnsError

        try:
            lab = self.lab
            if lab is not None:
                lab.clear_netem(a, b)
        except NetnsError as exc:  # the run is ending and the lab going away: nothing to heal
            if not self._stop.is_set():
                print(f"chaos: could not remove netem from link {a}-{b}: {exc}", file=sys.stderr, flush=True)

    def _hung(self, member: int, fault: Fault, at: float) -> None:
        resume = fault.params.get("resume_after_s")
        self._record(FaultEvent("hang", at, f"member {member}", victim=member,
                                end_s=at + resume if resume else None))
        if resume:
            with self._lock:
                self._resuming.add(member)

            def resume_it() -> None:
                _signal(self.workers[member], signal.SIGCONT)
                with self._lock:
                    self._resuming.discard(member)
            self._later(resume, resume_it)

    def _monitor(self) -> None:
        """Watch members until every running member has finished or exited (a stopped one
        is not waited for), or until none progressed for ``op_timeout_s``."""
        from resilient.coordinator.membership import revoke_member

        in_process = {f.member: f for f in self.faults if f.trigger.in_process}
        seen_dead: set[int] = set()
        seen_stopped: set[int] = set()
        sizes: dict[int, int] = {}
        last_progress = time.monotonic()
        while True:
            with self._lock:
                victims = set(self.victims)
            for i, proc in self.workers.items():
                code = proc.popen.poll()
                if code is not None and i not in seen_dead:
                    seen_dead.add(i)
                    if i in self._metrics_servers:  # node-agent duty: drop its live gauges
                        from resilient.metrics import mark_worker_dead

                        mark_worker_dead(proc.pid, self._metrics_servers[i].path)
                    if code == -signal.SIGKILL and i not in victims and i in in_process:
                        self._record(FaultEvent("kill", self._now(), f"member {i}", victim=i))
                    if code != 0 and proc.lease_id is not None and self.sc.detection == "revoke":
                        # node-agent duty: revoke at once
                        try:
                            revoke_member(self.store, self.job, member_id(i), proc.lease_id,
                                          reason=f"exit {code}")
                        except ResilientError:
                            pass
                elif code is None and i not in seen_stopped and i in in_process and proc.stopped() \
                        and in_process[i].kind is FaultKind.HANG and i not in victims:
                    seen_stopped.add(i)
                    self._hung(i, in_process[i], self._now())
                size = _size(self.records / f"member-{i}.jsonl")
                if size != sizes.get(i):
                    sizes[i] = size
                    last_progress = time.monotonic()
            # live: running, not finished, not stopped (a resumed hang victim is waited for)
            # (and a stopped one whose SIGCONT is scheduled: what it does after it resumes counts)
            with self._lock:
                resuming = set(self._resuming)
            live = [i for i, p in self.workers.items() if p.alive() and (not p.stopped() or i in resuming)
                    and not (self.records / f"done-{i}").exists()]
            if not live or self.start_failure is not None:
                return
            if time.monotonic() - last_progress > self.sc.op_timeout_s:
                return  # nobody progressed within the op bound: the verifier reports the hangs
            time.sleep(0.01)

    def _teardown(self) -> None:
        workers = list(self.workers.values())
        deadline = time.monotonic() + 5  # finished members leave on the stop file
        for proc in workers:
            if (self.records / f"done-{proc.name.split('-')[1]}").exists():
                try:
                    proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        procs = workers + list(self.coordinators.values())
        for proc in procs:
            _signal(proc, signal.SIGCONT)
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.popen.wait(timeout=5)
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

    def _read_records(self) -> list[OpRecord]:
        out: list[OpRecord] = []
        for i in range(self.sc.world_size):
            path = self.records / f"member-{i}.jsonl"
            latest: dict[int, dict] = {}
            if path.exists():
                for line in path.read_text().splitlines():
                    try:
                        d = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by SIGKILL
                    latest[d["seq"]] = {**latest.get(d["seq"], {}), **d}
            for seq, d in sorted(latest.items()):
                end = d.get("end")
                out.append(OpRecord(member=i, seq=seq, start_s=d["start"] - self.t0,
                                    end_s=None if end is None else end - self.t0,
                                    contributors=tuple(d["contributors"]) if d.get("contributors") else None,
                                    epoch=d.get("epoch"), error=d.get("error"), check=d.get("check"),
                                    control=bool(d.get("control")),
                                    out_range=tuple(d["out_range"]) if d.get("out_range") else None,
                                    recovered=bool(d.get("recovered")),
                                    bytes_after_fault=d.get("bytes_after_fault")))
        return out


def _op0_start(path: Path) -> float | None:
    """The ``start`` wall time of op 0 in a member's record file, once it is there."""
    try:
        with open(path) as f:
            line = f.readline()
    except OSError:
        return None
    try:
        d = json.loads(line)
    except ValueError:
        return None  # not written yet, or written halfway
    return float(d["start"]) if d.get("seq") == 0 and "start" in d else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


#: How often :func:`run_scenario` starts a seed whose start-up failed (:class:`StartFailed`).
START_ATTEMPTS = 3


def run_scenario(scenario: Scenario, seed: int, workdir: str | os.PathLike | None = None,
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
