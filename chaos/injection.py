"""Fault injection of a chaos run: the :class:`~resilient.chaos.faults.Injector` the
runner hands each fault kind (signals to the processes it started, the members' shaping
files, etcd members, coordinators, the network-namespace lab, timers) and the
:class:`FaultLog` of what was injected.

What each kind does with it is in its own file (``chaos/kinds/<kind>.py``).

Failure behaviour: :meth:`RunInjector.inject` never raises — an exception from a kind's
injection is recorded as a skipped fault (``injection failed: ...``), never silently
lost. Timers (:meth:`RunInjector.later`) do nothing once the run stops.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from resilient.chaos.faults import ORACLE_NO_TRANSPORT, Fault
from resilient.chaos.records import write_atomic
from resilient.chaos.supervision import Proc, send_signal
from resilient.chaos.verifier import FaultEvent

if TYPE_CHECKING:
    from resilient.chaos.netns import NetnsLab
    from resilient.coordinator.local_etcd import LocalEtcd
    from resilient.coordinator.store import Store


def shaping_file(records: Path, member: int) -> Path:
    """The member's ``RESILIENT_SHAPING_FILE`` (re-read by its transport within 0.2 s)."""
    return records / f"shaping-{member}"


class FaultLog:
    """What was injected, shared by the injector, the member monitor and the run
    (thread-safe): the fault events, the members they took out (victims), the stopped
    members a SIGCONT is scheduled for, and the time-triggered faults whose time came."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[FaultEvent] = []
        self._victims: set[int] = set()
        self._resuming: set[int] = set()
        self._fired: set[int] = set()  # id() of time-triggered faults

    def record(self, event: FaultEvent) -> None:
        with self._lock:
            self._events.append(event)
            if event.victim is not None and event.skipped is None:
                self._victims.add(event.victim)

    def events(self) -> list[FaultEvent]:
        with self._lock:
            return list(self._events)

    def victims(self) -> set[int]:
        with self._lock:
            return set(self._victims)

    def resuming(self) -> set[int]:
        with self._lock:
            return set(self._resuming)

    def set_resuming(self, member: int, scheduled: bool) -> None:
        with self._lock:
            (self._resuming.add if scheduled else self._resuming.discard)(member)

    def mark_fired(self, fault: Fault) -> None:
        with self._lock:
            self._fired.add(id(fault))

    def fired(self, fault: Fault) -> bool:
        with self._lock:
            return id(fault) in self._fired


@dataclass
class RunInjector:
    """The runner's :class:`~resilient.chaos.faults.Injector`. Times are seconds since
    ``t0`` (wall time)."""

    backend: str
    t0: float
    log: FaultLog
    stop: threading.Event
    records: Path
    workers: Mapping[int, Proc]
    coordinators: Mapping[str, Proc]
    etcd: LocalEtcd
    store: Store
    job: str
    new_coordinator: Callable[[str], None]  # starts coordinator `cid`
    lab: NetnsLab | None = None
    netem_unavailable: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _shaping: dict[int, dict[int, str]] = field(default_factory=dict)  # member -> {fault id: spec items}

    def inject(self, fault: Fault) -> None:
        """Fire time-triggered ``fault`` now (see the module docstring)."""
        self.log.mark_fired(fault)
        try:
            fault.kind.inject(fault, self)
        except Exception as exc:  # a failed injection is reported, never silently lost
            self.skipped(fault, self.now(), f"injection failed: {exc}")

    def fired_in_process(self, fault: Fault) -> None:
        """The victim of op-triggered ``fault`` stopped itself (seen just now)."""
        fault.kind.fired_in_process(fault, self, self.now())

    # -- Injector ------------------------------------------------------------------------

    def now(self) -> float:
        return time.time() - self.t0

    def injected(self, fault: Fault, at: float, target: str | None = None, victim: int | None = None,
                 end_s: float | None = None) -> None:
        self.log.record(FaultEvent(fault.kind.name, at, fault.target_text() if target is None else target,
                                   victim=victim, end_s=end_s))

    def skipped(self, fault: Fault, at: float, reason: str, target: str | None = None) -> None:
        self.log.record(FaultEvent(fault.kind.name, at, fault.target_text() if target is None else target,
                                   skipped=reason))

    def later(self, delay_s: float, action: Callable[[], None]) -> None:
        def run() -> None:
            if not self.stop.wait(delay_s):
                action()
        threading.Thread(target=run, daemon=True).start()

    def stopping(self) -> bool:
        return self.stop.is_set()

    def signal_member(self, member: int, sig: int) -> None:
        send_signal(self.workers[member], sig)

    def resume_later(self, member: int, delay_s: float) -> None:
        self.log.set_resuming(member, True)

        def resume() -> None:
            send_signal(self.workers[member], signal.SIGCONT)
            self.log.set_resuming(member, False)
        self.later(delay_s, resume)

    def shape(self, fault: Fault, at: float, per_member: Mapping[int, list[str]]) -> None:
        if self.backend == "oracle":
            self.skipped(fault, at, ORACLE_NO_TRANSPORT)
            return
        key = id(fault)
        for m, items in per_member.items():
            self._set_shaping(m, key, ",".join(items))
        dur = fault.duration_s
        self.injected(fault, at, end_s=at + dur if dur else None)
        if dur:
            def heal() -> None:
                for m in per_member:
                    self._set_shaping(m, key, None)
            self.later(dur, heal)

    def _set_shaping(self, member: int, key: int, items: str | None) -> None:
        """Add (``items``) or remove (``None``) one fault's shaping on ``member``."""
        with self._lock:
            mine = self._shaping.setdefault(member, {})
            if items is None:
                mine.pop(key, None)
            else:
                mine[key] = items
            write_atomic(shaping_file(self.records, member), ",".join(mine.values()))

    def kill_etcd(self, index: int) -> None:
        self.etcd.kill(index)

    def restart_etcd(self, index: int) -> None:
        self.etcd.restart(index, wait=False)

    def coordinator_leader(self) -> str | None:
        from resilient.coordinator.election import current_leader

        return current_leader(self.store, self.job)

    def start_coordinator(self, cid: str) -> None:
        self.new_coordinator(cid)

    def kill_coordinator(self, cid: str) -> bool:
        proc = self.coordinators.get(cid)
        if proc is None or not proc.alive():
            return False
        send_signal(proc, signal.SIGKILL)
        return True
