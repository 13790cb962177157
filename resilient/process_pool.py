"""The child processes this process started: start them, signal them, wait for them, stop
them and reap every one.

One responsibility: a :class:`ProcessPool` owns the children it started (an argv, an
environment, a working directory and stdio per child, optionally in a session and process
group of its own) and nothing else: it signals only those children, by PID (or by their
own process group when they have one), and it reaps each of them exactly once. The node
agent of ``resilient-run``, the chaos runner, the benchmarks and the multi-process tests
all start their processes through it.

Each child gets one waiter thread that blocks in ``wait()``; when the child exits the
thread records its exit code and the time and wakes :meth:`ProcessPool.wait` /
:meth:`ProcessPool.wait_any` (no polling: an exit is seen at once).

Exit codes are ``subprocess``'s: ``>= 0`` the code the child exited with, ``< 0`` minus
the signal that killed it; :func:`describe_exit` and :func:`signal_name` word them.

Failure behaviour:

* a child that cannot be started (no such binary, bad cwd) raises the ``OSError`` of
  ``subprocess.Popen`` from :meth:`ProcessPool.start`; nothing is left running for it;
* a child that dies before :meth:`~ProcessPool.start` returns is still a child: its exit
  is reported by the waits like any other (never lost, never reported twice);
* :meth:`~ProcessPool.wait` past its timeout raises :class:`~resilient.errors.ResilientTimeout`
  naming the children still running (they keep running); :meth:`~ProcessPool.wait_any`
  returns ``None`` at its timeout (it is meant for supervision loops that poll);
* :meth:`~ProcessPool.stop` sends SIGTERM (or the signal given) and SIGCONT (so a
  SIGSTOPped child handles it), waits ``grace`` seconds, then SIGKILLs what is left (its
  whole process group when it has its own) and reaps it: a child that ignores SIGTERM is
  killed after ``grace``. Only a child stuck in the kernel (state ``D``) can outlive the
  SIGKILL; after 30 s more ``stop`` raises ``ResilientTimeout`` naming it;
* leaving a ``with ProcessPool()`` block, by an exception too, stops every child;
* signalling a child that already exited does nothing and returns ``False``; a child of
  another pool (or a PID this pool did not start) raises ``ValueError``.
"""
from __future__ import annotations

import logging
import os
import signal as _signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Mapping, Sequence, Union

from resilient.errors import ResilientTimeout

log = logging.getLogger(__name__)

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT

#: Where a child's stdout/stderr goes: ``None`` (this process's), ``PIPE``, ``DEVNULL``,
#: ``STDOUT`` (stderr only), a path (opened here in append mode, closed once the child has
#: it), or an open file / file descriptor owned by the caller.
Output = Union[None, int, IO[Any], str, "os.PathLike[str]"]

#: Time a SIGKILLed child gets to be reaped before :meth:`ProcessPool.stop` gives up.
KILL_REAP_S = 30.0


def signal_name(signum: int) -> str:
    """``9`` -> ``"SIGKILL"`` (``"signal 99"`` for a number with no name)."""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """``3`` -> ``"exited with code 3"``, ``-9`` -> ``"killed by SIGKILL"``."""
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    return f"exited with code {returncode}"


def pid_state(pid: int) -> str | None:
    """The kernel's one-letter state of any process (``R``, ``S``, ``T`` stopped, ``Z``
    zombie...) from ``/proc``; ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Spec:
    """How to start one child. ``env`` is its whole environment (``None``: this process's);
    ``new_session`` puts it in a session and process group of its own (signals for this
    process's terminal do not reach it, and :meth:`ProcessPool.stop` SIGKILLs its group)."""

    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    cwd: str | os.PathLike[str] | None = None
    stdin: int | IO[Any] | None = DEVNULL
    stdout: Output = None
    stderr: Output = None
    new_session: bool = True
    name: str = ""
    preexec_fn: Callable[[], None] | None = None


class Child:
    """One started process. ``returncode`` and ``exit_time`` (``time.time()``) are set by
    its waiter thread when it has been reaped; ``stdin``/``stdout``/``stderr`` are the
    text pipes asked for with ``PIPE`` (else ``None``)."""

    def __init__(self, pool: ProcessPool, index: int, spec: Spec, popen: subprocess.Popen[str]) -> None:
        self.pool, self.index, self.spec, self.popen = pool, index, spec, popen
        self.name = spec.name or f"child{index}"
        self.pid = popen.pid
        self.returncode: int | None = None   # set under the pool's lock: what the waits wait for
        self.exit_time: float | None = None

    @property
    def stdin(self) -> IO[str] | None:
        return self.popen.stdin

    @property
    def stdout(self) -> IO[str] | None:
        return self.popen.stdout

    @property
    def stderr(self) -> IO[str] | None:
        return self.popen.stderr

    def alive(self) -> bool:
        """Not yet reaped (a zombie not yet collected by its waiter counts as alive)."""
        return self.returncode is None

    def signal(self, sig: int) -> bool:
        """:meth:`ProcessPool.signal` of this child."""
        return self.pool.signal(self, sig)

    def wait(self, timeout: float | None = None) -> int:
        """:meth:`ProcessPool.wait` for this child alone: its exit code."""
        (rc,) = self.pool.wait(timeout, [self])
        return rc

    def state(self) -> str | None:
        """The kernel's one-letter state (``R``, ``S``, ``T`` stopped, ``Z``...), ``None``
        once reaped or unreadable."""
        return None if self.returncode is not None else pid_state(self.pid)

    def stopped(self) -> bool:
        """The child is SIGSTOPped (state ``T``)."""
        return self.state() == "T"

    def __repr__(self) -> str:
        how = "running" if self.returncode is None else describe_exit(self.returncode)
        return f"<Child {self.name} pid {self.pid} {how}>"


class ProcessPool:
    """The children started by this process (see the module docstring)."""

    def __init__(self) -> None:
        self._children: list[Child] = []
        self._cond = threading.Condition()
        self._exited: deque[Child] = deque()    # reaped, not yet reported by wait_any

    # -- starting -------------------------------------------------------------------------

    def start(self, spec: Spec) -> Child:
        """Start one child; ``OSError`` if it cannot be started."""
        opened: list[IO[Any]] = []
        try:
            stdout = _open(spec.stdout, opened)
            stderr = _open(spec.stderr, opened)
            popen = subprocess.Popen(
                list(spec.argv), env=None if spec.env is None else dict(spec.env), cwd=spec.cwd,
                stdin=spec.stdin, stdout=stdout, stderr=stderr, start_new_session=spec.new_session,
                preexec_fn=spec.preexec_fn, text=True, bufsize=1,
            )
        finally:
            for f in opened:   # the child has its own copy
                f.close()
        with self._cond:
            child = Child(self, len(self._children), spec, popen)
            self._children.append(child)
        threading.Thread(target=self._reap, args=(child,), name=f"reap-{child.name}", daemon=True).start()
        return child

    def start_all(self, specs: Iterable[Spec]) -> list[Child]:
        """Start each spec in order; if one fails to start, stop those already started and
        re-raise."""
        started: list[Child] = []
        try:
            for spec in specs:
                started.append(self.start(spec))
        except BaseException:
            self.stop(children=started)
            raise
        return started

    def _reap(self, child: Child) -> None:
        rc = child.popen.wait()
        with self._cond:
            child.exit_time, child.returncode = time.time(), rc
            self._exited.append(child)
            self._cond.notify_all()

    # -- looking -------------------------------------------------------------------------

    @property
    def children(self) -> list[Child]:
        """Every child started here, in start order (``children[i].index == i``)."""
        with self._cond:
            return list(self._children)

    def running(self) -> list[Child]:
        return [c for c in self.children if c.alive()]

    def child(self, which: Child | int) -> Child:
        """The child itself, or the one with start index ``which``; ``ValueError`` for a
        child of another pool or an index out of range."""
        if isinstance(which, Child):
            if which.pool is not self:
                raise ValueError(f"{which!r} was not started by this pool")
            return which
        with self._cond:
            if not 0 <= which < len(self._children):
                raise ValueError(f"no child with index {which} (this pool started {len(self._children)})")
            return self._children[which]

    def by_pid(self, pid: int) -> Child:
        """The child with this PID; ``ValueError`` if this pool did not start it."""
        for c in self.children:
            if c.pid == pid:
                return c
        raise ValueError(f"pid {pid} was not started by this pool")

    # -- signalling ----------------------------------------------------------------------

    def signal(self, which: Child | int, sig: int, group: bool = False) -> bool:
        """Send ``sig`` to one child (with ``group``, to its process group, if it has its
        own session); ``False`` when it has already exited."""
        c = self.child(which)
        if c.popen.poll() is not None or c.returncode is not None:
            return False
        try:
            if group and c.spec.new_session:
                os.killpg(c.pid, sig)
            else:
                os.kill(c.pid, sig)
        except ProcessLookupError:
            return False
        return True

    # -- waiting -------------------------------------------------------------------------

    def wait(self, timeout: float | None = None, children: Sequence[Child] | None = None) -> list[int]:
        """Wait until every child (or each of ``children``) is reaped; their exit codes in
        order. ``ResilientTimeout`` after ``timeout`` seconds, naming those still running."""
        targets = self.children if children is None else [self.child(c) for c in children]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                left = [c for c in targets if c.returncode is None]
                if not left:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ResilientTimeout(
                        f"{len(left)} child process(es) still running after {timeout}s: "
                        + ", ".join(f"{c.name} (pid {c.pid})" for c in left))
                self._cond.wait(remaining)
        return [c.returncode for c in targets if c.returncode is not None]

    def wait_any(self, timeout: float | None = None) -> Child | None:
        """The next child to have exited that no earlier ``wait_any`` returned (each exit
        is reported once, in the order the children were reaped); ``None`` after
        ``timeout`` seconds without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._exited:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._exited.popleft()

    # -- stopping ------------------------------------------------------------------------

    def stop(self, grace: float = 5.0, sig: int | None = _signal.SIGTERM,
             children: Sequence[Child] | None = None) -> list[int]:
        """Send ``sig`` (and SIGCONT) to every running child (or each of ``children``), give
        them ``grace`` seconds, SIGKILL the rest (their process group if they have one) and
        reap them all; their exit codes in order. ``sig=None``: send nothing first (the
        children were asked to leave another way, e.g. stdin closed). See the module
        docstring for failures."""
        targets = self.children if children is None else [self.child(c) for c in children]
        for c in targets:
            if sig is not None and self.signal(c, sig, group=sig == _signal.SIGKILL) \
                    and sig not in (_signal.SIGKILL, _signal.SIGCONT):
                self.signal(c, _signal.SIGCONT)
        if sig == _signal.SIGKILL:
            return self.wait(KILL_REAP_S, targets)
        try:
            return self.wait(grace, targets)
        except ResilientTimeout:
            pass
        for c in targets:
            if c.alive():
                log.warning("%s (pid %d) did not exit within %gs%s; SIGKILL", c.name, c.pid, grace,
                            "" if sig is None else f" of {signal_name(sig)}")
                self.signal(c, _signal.SIGKILL, group=True)
        return self.wait(KILL_REAP_S, targets)

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _open(out: Output, opened: list[IO[Any]]) -> int | IO[Any] | None:
    """A path -> a file opened for appending (noted in ``opened``); anything else as is."""
    if isinstance(out, (str, os.PathLike)):
        f = open(out, "ab")
        opened.append(f)
        return f
    return out
