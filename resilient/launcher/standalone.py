"""``--standalone``: a local etcd and a resilient coordinator for one node's job.

:class:`StandaloneControlPlane` starts a real ``etcd`` on free loopback ports
(:class:`~resilient.coordinator.local_etcd.LocalEtcd`) and one coordinator process,
``python -c 'resilient.cli.main()' coordinator --etcd <endpoints> --job <job>
--min-members <nproc> --metrics-host 127.0.0.1 --metrics-port 0`` (the same
as ``resilient coordinator ...``, without relying on the console script being on PATH),
in its own session so signals meant for the agent's terminal do not reach it first.

The etcd runs with authentication on (``LocalEtcd(auth=True)``): its generated root
password sits in a 0600 file in etcd's private 0700 directory, and the coordinator (and,
through the launcher, every worker) gets ``RESILIENT_ETCD_USER`` and
``RESILIENT_ETCD_PASSWORD_FILE`` in its environment — never on a command line, which any
local user can read. So another local user can reach the loopback port but can read
nothing (not the epoch's transport token) and write nothing (docs/security.md).
:meth:`stop` stops the coordinator (SIGTERM, then SIGKILL after a grace period) and etcd,
by PID, and removes etcd's data directory; the agent calls it on every exit path.

Failure behaviour: etcd not on PATH -> ``ConfigError`` saying how to install it; etcd not
healthy in time -> ``StoreUnavailable`` with its log tail; a coordinator that exits during
start-up -> ``ResilientError`` with its output. If the coordinator dies later the agent
logs it; workers keep running but membership changes are not published until it is back.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading

from resilient.coordinator.etcd_access import EtcdAccess
from resilient.coordinator.local_etcd import LocalEtcd, die_with_parent
from resilient.errors import ResilientError, ResilientTimeout
from resilient.process_pool import STDOUT, Child, ProcessPool, Spec

log = logging.getLogger(__name__)

_COORDINATOR_MAIN = "import sys; from resilient.cli import main; sys.exit(main(sys.argv[1:]))"


def coordinator_command(etcd: str, job: str, min_members: int = 1) -> list[str]:
    """``resilient coordinator`` for this job; its /metrics on a free loopback port
    (several standalone jobs may share a host; nothing of a standalone job listens
    beyond 127.0.0.1)."""
    return [sys.executable, "-c", _COORDINATOR_MAIN, "coordinator", "--etcd", etcd, "--job", job,
            "--min-members", str(min_members), "--metrics-host", "127.0.0.1", "--metrics-port", "0"]


class StandaloneControlPlane:
    """Local etcd + coordinator, stopped by :meth:`stop` (also on ``with`` exit)."""

    def __init__(self, job: str, min_members: int = 1, startup_check_s: float = 1.0) -> None:
        self.job = job
        self.min_members = min_members
        self.etcd = LocalEtcd(auth=True)
        self._pool = ProcessPool()
        self.coordinator: Child | None = None
        self.coordinator_log = ""
        self._startup_check_s = startup_check_s

    @property
    def endpoints(self) -> list[str]:
        return self.etcd.endpoints

    @property
    def access(self) -> EtcdAccess:
        """The credentials of the local etcd (user and password file)."""
        return self.etcd.access

    def start(self) -> "StandaloneControlPlane":
        self.etcd.start()
        try:
            fd, self.coordinator_log = tempfile.mkstemp(prefix="resilient-coordinator-", suffix=".log")
            os.close(fd)
            argv = coordinator_command(self.etcd.endpoint_arg, self.job, self.min_members)
            preexec = None
            if threading.current_thread() is threading.main_thread():
                # the coordinator dies with the agent, even a SIGKILLed one (its etcd does too)
                argv, preexec = die_with_parent(argv)
            self.coordinator = self._pool.start(Spec(
                argv, env={**os.environ, **self.access.child_env()}, stdout=self.coordinator_log, stderr=STDOUT,
                name="standalone coordinator", preexec_fn=preexec,
            ))
            try:
                (code,) = self._pool.wait(self._startup_check_s, [self.coordinator])
            except ResilientTimeout:
                pass   # still running after the start-up check: up
            else:
                raise ResilientError(f"the standalone coordinator exited with code {code} "
                                     f"during start-up:\n{self._log_tail()}")
        except BaseException:
            self.stop()
            raise
        log.info("standalone control plane: etcd %s, coordinator pid %d (log %s); etcd user %s, password "
                 "file %s (for `resilient status`: RESILIENT_ETCD_USER / RESILIENT_ETCD_PASSWORD_FILE)",
                 self.etcd.endpoint_arg, self.coordinator.pid, self.coordinator_log, self.access.user,
                 self.access.password_file)
        return self

    def _log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.coordinator_log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the coordinator and etcd started here (by PID) and remove their files."""
        self.coordinator = None
        self._pool.stop(grace_s)
        self.etcd.stop()
        if self.coordinator_log:
            try:
                os.unlink(self.coordinator_log)
            except OSError:
                pass

    def __enter__(self) -> "StandaloneControlPlane":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
