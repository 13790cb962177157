"""Watching the members of a chaos run: when every member has started op 0 (time
triggers' zero), and afterwards their exits, stops and progress until the run is over.

Like a node agent, the monitor revokes the lease of a member whose process died (unless
the scenario says ``detection: ttl``) and drops its live metrics gauges; it reports a
victim that stopped itself at its failpoint to the injector.

Failure behaviour: :meth:`MemberMonitor.await_op0` returns a start-up failure (a member
that no fault touched left, or had not started op 0 after ``start_timeout``) instead of
raising; :meth:`MemberMonitor.watch` returns when no live member is left, when the
start-up failed, or when no member progressed for ``op_timeout_s`` (the verifier then
reports the unfinished ops as hangs). A lease that cannot be revoked is left to expire.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from resilient.chaos import records
from resilient.chaos.faults import Fault
from resilient.chaos.injection import FaultLog, RunInjector
from resilient.chaos.members import member_id
from resilient.chaos.supervision import Proc
from resilient.errors import ResilientError

if TYPE_CHECKING:
    from resilient.chaos.scenario import Scenario
    from resilient.coordinator.store import Store


@dataclass
class MemberMonitor:
    """Watches ``workers`` (member index -> process) of one run of ``scenario``."""

    scenario: Scenario
    workers: Mapping[int, Proc]
    records: Path
    log: FaultLog
    stop: threading.Event
    start_timeout: float

    def await_op0(self) -> tuple[float, str | None]:
        """``(zero, failure)``: the wall time at which every member had started op 0 (the
        latest ``start`` of their op-0 records), and why start-up failed (``None`` when
        it did not). A member that exited before op 0 is not waited for; after
        ``start_timeout`` the members seen so far count. Returns early (with the current
        time) when the run is stopped."""
        deadline = time.monotonic() + self.start_timeout
        starts: dict[int, float] = {}
        while True:
            for i in self.workers:
                if i not in starts:
                    t = records.op0_start(self.records, i)
                    if t is not None:
                        starts[i] = t
            victims = self.log.victims()
            gone = [i for i, p in self.workers.items() if i not in starts and not p.alive() and i not in victims]
            waiting = [i for i, p in self.workers.items() if i not in starts and p.alive()]
            late = waiting if time.monotonic() > deadline else []
            if gone or late:
                i = (gone or late)[0]
                proc = self.workers[i]
                what = (f"exited (code {proc.popen.poll()})" if gone else
                        f"had not started it after {self.start_timeout:.0f}s")
                return time.time(), (f"member {i} {what} before every member had started op 0 — start-up, not the "
                                     f"scenario, failed (an overloaded machine can starve a member past its "
                                     f"{self.scenario.lease_ttl_s:g}s lease):\n{proc.log_tail()}")
            if not waiting or self.stop.is_set():
                return max(starts.values(), default=time.time()), None
            time.sleep(0.01)

    def watch(self, faults: Sequence[Fault], injector: RunInjector, store: Store, job: str,
              metrics_dirs: Mapping[int, str], start_failed: Callable[[], bool]) -> None:
        """Watch members until every running member has finished or exited (a stopped one
        is not waited for, unless its SIGCONT is scheduled), the start-up failed, or none
        progressed for ``op_timeout_s``. ``metrics_dirs``: member -> its node-agent
        multiprocess directory."""
        from resilient.coordinator.membership import revoke_member

        in_process = {f.member: f for f in faults if f.trigger.in_process}
        seen_dead: set[int] = set()
        seen_stopped: set[int] = set()
        sizes: dict[int, int] = {}
        last_progress = time.monotonic()
        while True:
            victims = self.log.victims()
            for i, proc in self.workers.items():
                code = proc.popen.poll()
                fault = in_process.get(i)
                if code is not None and i not in seen_dead:
                    seen_dead.add(i)
                    if i in metrics_dirs:  # node-agent duty: drop its live gauges
                        from resilient.metrics import mark_worker_dead

                        mark_worker_dead(proc.pid, metrics_dirs[i])
                    if code == -signal.SIGKILL and i not in victims and fault is not None \
                            and fault.kind.failpoint_action == "kill":
                        injector.fired_in_process(fault)
                    if code != 0 and proc.lease_id is not None and self.scenario.detection == "revoke":
                        try:  # node-agent duty: revoke at once
                            revoke_member(store, job, member_id(i), proc.lease_id, reason=f"exit {code}")
                        except ResilientError:
                            pass
                elif code is None and i not in seen_stopped and fault is not None and i not in victims \
                        and fault.kind.failpoint_action == "stop" and proc.stopped():
                    seen_stopped.add(i)
                    injector.fired_in_process(fault)
                size = records.size(self.records, i)
                if size != sizes.get(i):
                    sizes[i] = size
                    last_progress = time.monotonic()
            # live: running, not finished, not stopped (a resumed hang victim is waited for)
            # (and a stopped one whose SIGCONT is scheduled: what it does after it resumes counts)
            resuming = self.log.resuming()
            live = [i for i, p in self.workers.items() if p.alive() and (not p.stopped() or i in resuming)
                    and not (self.records / f"done-{i}").exists()]
            if not live or start_failed():
                return
            if time.monotonic() - last_progress > self.scenario.op_timeout_s:
                return  # nobody progressed within the op bound: the verifier reports the hangs
            time.sleep(0.01)
