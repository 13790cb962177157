"""docs/multinode.md, run as written on two "hosts": two network namespaces on a bridge.

Host A (namespace 0) runs etcd (listening on its veth address only), ``resilient
coordinator`` and one ``resilient-run --rdzv-backend etcd --local-addr <A>``; host B
(namespace 1) runs the other agent with ``--local-addr <B>``. A namespace has only its
loopback and its veth, so every byte between the hosts — etcd, the TCPStore, the ranks'
data plane — crosses the veths. Asserted: both agents exit 0; each rank's all_reduce
sum is 1 + 2 over a world of 2; each rank's RESILIENT_HOST is its host's address and the
workers' MASTER_ADDR is one of the two host addresses (never loopback).

Needs root and working ``ip netns`` (probed; skipped with the reason otherwise). Every
process is stopped by PID and the lab removed, also on failure; the file is ``serial``
(tests/conftest.py): it makes namespaces, veths and a bridge."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_util import ROOT, SCRIPTS, private_tmpdir, wait_for
from resilient.chaos.netns import NetnsLab, netns_unavailable_reason
from resilient.coordinator.local_etcd import etcd_binary

REASON = netns_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")

BIN = os.path.dirname(sys.executable)
SCRIPT = os.path.join(SCRIPTS, "multinode_allreduce.py")


class Host:
    """Processes started in one namespace, each in its own session with its output in a
    file; :meth:`stop` ends them by PID (``ip netns exec`` execs, so the PID is the command's)."""

    def __init__(self, lab: NetnsLab, i: int, logs: Path) -> None:
        self.prefix, self.addr, self.logs = lab.exec_prefix(i), lab.ips[i], logs
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.tmp = private_tmpdir()

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*self.prefix, *argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=dict(os.environ, TMPDIR=self.tmp, **(env or {})))
        self.procs.append((proc, log))
        return proc

    def stop(self) -> None:
        for proc, _ in reversed(self.procs):  # agents (they stop their workers) before etcd
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _output(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


@pytest.mark.timeout(120)
def test_two_hosts_all_reduce_over_their_veth_addresses(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    with NetnsLab(2) as lab:
        a, b = Host(lab, 0, tmp_path), Host(lab, 1, tmp_path)
        try:
            etcd = f"{a.addr}:2379"  # a namespace has its own ports: the guide's fixed ones are free
            a.start("etcd", [etcd_binary(), "--name", "a", "--data-dir", str(tmp_path / "etcd"),
                             "--listen-client-urls", f"http://{etcd}", "--advertise-client-urls", f"http://{etcd}",
                             "--listen-peer-urls", f"http://{a.addr}:2380",
                             "--initial-advertise-peer-urls", f"http://{a.addr}:2380",
                             "--initial-cluster", f"a=http://{a.addr}:2380"])
            a.start("coordinator", [os.path.join(BIN, "resilient"), "coordinator", "--etcd", etcd, "--job", "train",
                                    "--min-members", "2", "--metrics-port", "-1"])
            agents = []
            for host, name in ((a, "agent-a"), (b, "agent-b")):
                agents.append((host.start(name, [
                    os.path.join(BIN, "resilient-run"), "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd,
                    "--rdzv-id", "train", "--nnodes", "2", "--nproc-per-node", "1", "--local-addr", host.addr,
                    SCRIPT], {"OUT_DIR": str(out), "PYTHONPATH": ROOT}), tmp_path / f"{name}.log"))

            def finished() -> bool:
                for proc, log in agents:
                    rc = proc.poll()
                    assert rc in (None, 0), f"an agent exited {rc}:\n{_output(log)}"
                return all(proc.poll() == 0 for proc, _ in agents)

            wait_for(finished, 90, "both agents to finish the all_reduce and exit 0", interval=0.1)
        finally:
            b.stop()
            a.stop()
    results = sorted((json.loads(p.read_text()) for p in out.glob("*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == [3.0] * 4 for r in results), results
    assert sorted(r["host"] for r in results) == sorted([a.addr, b.addr])
    assert {r["master"] for r in results} <= {a.addr, b.addr} and len({r["master"] for r in results}) == 1
