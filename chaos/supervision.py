"""The processes of a chaos run: start one (own session, log under the workdir), read a
member's ``READY`` line, signal it by PID, and stop every one at the end.

Failure behaviour: a signal to a process that already exited is ignored; :func:`stop_all`
waits up to 5 s for finished members, sends SIGCONT + SIGTERM to everything, and SIGKILLs
what is still running 5 s later — it never leaves a process it was given behind.
Starting a process raises ``OSError`` from ``subprocess.Popen`` (e.g. no Python binary).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence


@dataclass
class Proc:
    """One process the runner started: a member, a coordinator. ``lease_id`` and
    ``ready`` are set when a member printed ``READY m<i> <lease_id> <pid>``."""

    name: str
    popen: subprocess.Popen[str]
    log_path: Path
    lease_id: int | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stopped(self) -> bool:
        """The process is in state ``T`` (SIGSTOPped)."""
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


def send_signal(proc: Proc, sig: int) -> None:
    """Send ``sig`` to ``proc`` if it is still running (by PID: only processes we started)."""
    if proc.alive():
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def spawn(name: str, args: Sequence[str], log_dir: Path, env: Mapping[str, str], pipe: bool = False,
          prefix: Sequence[str] = ()) -> Proc:
    """Start ``python ARGS`` (after ``prefix``, e.g. ``ip netns exec NS``, which execs
    python so the PID is the process's own) in its own session with environment ``env``;
    stderr (and stdout unless ``pipe``) goes to ``log_dir/NAME.log``."""
    log_path = log_dir / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen([*prefix, sys.executable, *args], stdout=subprocess.PIPE if pipe else log,
                                 stderr=log, env=dict(env), start_new_session=True, text=True)
    return Proc(name, popen, log_path)


def watch_ready(proc: Proc) -> None:
    """Read ``proc``'s stdout (it was spawned with ``pipe=True``) in a daemon thread and
    set ``proc.lease_id`` / ``proc.ready`` at its ``READY`` line."""
    stdout = proc.popen.stdout
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


def stop_all(members: Sequence[Proc], others: Sequence[Proc], finished: Callable[[Proc], bool]) -> None:
    """Stop every process: members that ``finished`` get 5 s to leave by themselves (on
    the stop file), then everything gets SIGCONT (stopped ones) and SIGTERM, and SIGKILL
    5 s later if still running."""
    deadline = _deadline(5)
    for proc in members:
        if finished(proc):
            _wait(proc, deadline)
    procs = [*members, *others]
    for proc in procs:
        send_signal(proc, signal.SIGCONT)
        send_signal(proc, signal.SIGTERM)
    deadline = _deadline(5)
    for proc in procs:
        if not _wait(proc, deadline):
            send_signal(proc, signal.SIGKILL)
            proc.popen.wait(timeout=5)


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds


def _wait(proc: Proc, deadline: float) -> bool:
    """Wait for ``proc`` until ``deadline`` (at least 0.1 s); True when it exited."""
    try:
        proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False
