"""The processes of a chaos run: start one (own session, log under the workdir) in the
run's :class:`~resilient.process_pool.ProcessPool`, read a member's ``READY`` line, signal
it by PID, and stop every one at the end.

Failure behaviour: a signal to a process that already exited is ignored; :func:`stop_all`
waits up to 5 s for finished members, then stops everything through the pool (SIGTERM +
SIGCONT, SIGKILL of what still runs 5 s later) — it never leaves a process behind.
Starting a process raises ``OSError`` (e.g. no Python binary).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from resilient.errors import ResilientTimeout
from resilient.process_pool import PIPE, Child, ProcessPool, Spec


@dataclass
class Proc:
    """One process the runner started: a member, a coordinator. ``lease_id`` and
    ``ready`` are set when a member printed ``READY m<i> <lease_id> <pid>``."""

    name: str
    child: Child
    log_path: Path
    lease_id: int | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def popen(self) -> subprocess.Popen[str]:
        return self.child.popen

    def alive(self) -> bool:
        return self.child.alive()

    def stopped(self) -> bool:
        """The process is in state ``T`` (SIGSTOPped)."""
        return self.child.stopped()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""


def send_signal(proc: Proc, sig: int) -> None:
    """Send ``sig`` to ``proc`` if it is still running (by PID: only processes we started)."""
    proc.child.pool.signal(proc.child, sig)


def spawn(pool: ProcessPool, name: str, args: Sequence[str], log_dir: Path, env: Mapping[str, str],
          pipe: bool = False, prefix: Sequence[str] = ()) -> Proc:
    """Start ``python ARGS`` (after ``prefix``, e.g. ``ip netns exec NS``, which execs
    python so the PID is the process's own) in its own session with environment ``env``;
    stderr (and stdout unless ``pipe``) goes to ``log_dir/NAME.log``."""
    log_path = log_dir / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    child = pool.start(Spec([*prefix, sys.executable, *args], env=env, stdout=PIPE if pipe else log_path,
                            stderr=log_path, name=name))
    return Proc(name, child, log_path)


def watch_ready(proc: Proc) -> None:
    """Read ``proc``'s stdout (it was spawned with ``pipe=True``) in a daemon thread and
    set ``proc.lease_id`` / ``proc.ready`` at its ``READY`` line."""
    stdout = proc.child.stdout
    if stdout is None:
        raise ValueError(f"{proc.name} was started without pipe=True; its READY line cannot be read")

    def read() -> None:
        for line in stdout:
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "READY":
                proc.lease_id = int(parts[2])
                proc.ready.set()
        stdout.close()

    threading.Thread(target=read, name=f"ready-{proc.name}", daemon=True).start()


def stop_all(pool: ProcessPool, members: Sequence[Proc], finished: Callable[[Proc], bool]) -> None:
    """Stop every process of the run: members that ``finished`` get 5 s to leave by
    themselves (on the stop file), then everything gets SIGTERM (and SIGCONT, for stopped
    ones), and SIGKILL 5 s later if still running."""
    try:
        pool.wait(5, [p.child for p in members if finished(p)])
    except ResilientTimeout:
        pass
    pool.stop(grace=5, sig=signal.SIGTERM)
