"""A dropped link with no member dead (issue 5): real etcd + coordinator + 4 member
processes over TCP, the link m1<->m2 cut with the shaping transport's ``drop=`` (each
member re-reads its ``RESILIENT_SHAPING_FILE``).

* the link heals while an op is blocked on it: the op finishes exactly over the full set,
  in the same epoch (a live member is not removed), after both ends retried transfers;
* it never heals: every member's op raises ``PeerUnreachable`` naming a peer of the broken
  link within op_timeout + slack, never a silent hang; the members stay in the group.

Ops are gated by files the test writes (``gate-<seq>``), so the cut lands between ops."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import PY, ROOT, coordinator  # noqa: E402
from inputs import expected  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORLD, NUMEL = 4, 65536
IDS = [f"m{i}" for i in range(WORLD)]

WORKER = textwrap.dedent('''
    import json, os, sys, threading, time
    sys.path.insert(0, sys.argv[6]); sys.path.insert(0, os.path.join(sys.argv[6], "tests", "workers"))
    import numpy as np, torch
    from inputs import make_input
    import resilient
    from resilient.errors import ResilientError
    from resilient.transport.shaping import shaped_from_env
    from resilient.transport.tcp import TcpTransport
    etcd, job, mid, out, n_ops, op_timeout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[7])
    index = int(mid[1:])
    comm = resilient.connect(etcd, job, mid, world=4, timeout=60, ttl=2.0, op_timeout=op_timeout,
                             transport=shaped_from_env(TcpTransport(mid, job)))
    def report():  # the retry count, for the test to see that the cut bit
        last = -1
        while True:
            n = comm._op_transport.retries
            if n != last:
                with open(os.path.join(out, f"retries-{mid}.tmp"), "w") as f:
                    f.write(str(n))
                os.replace(os.path.join(out, f"retries-{mid}.tmp"), os.path.join(out, f"retries-{mid}"))
                last = n
            time.sleep(0.01)
    threading.Thread(target=report, daemon=True).start()
    with open(os.path.join(out, f"{mid}.jsonl"), "a") as log:
        for seq in range(n_ops):
            while not os.path.exists(os.path.join(out, f"gate-{seq}")):
                if sys.stdin.closed:
                    break
                time.sleep(0.01)
            x = make_input(index, seq, 0, 65536, "int64")
            rec = {"seq": seq, "ok": False}
            try:
                w = comm.allreduce(x)
                rec.update(ok=True, contributors=list(w.contributors), epoch=comm.epoch.number)
                np.save(os.path.join(out, f"{mid}.{seq}.npy"), x.numpy(), allow_pickle=False)
            except ResilientError as exc:
                rec.update(error=f"{type(exc).__name__}: {exc}", epoch=comm.epoch.number)
            log.write(json.dumps(rec) + "\\n"); log.flush()
            if not rec["ok"]:
                break
    sys.stdin.read()  # stay a member until the test says so (stdin EOF)
    comm.close()
    os._exit(0)
''')


class Group:
    def __init__(self, etcd: str, job: str, out: Path, n_ops: int, op_timeout: float) -> None:
        self.out = out
        (out / "worker.py").write_text(WORKER)
        self.procs: dict[str, subprocess.Popen] = {}
        for mid in IDS:
            (out / f"shaping-{mid}").write_text("")
            env = {"RESILIENT_SHAPING_FILE": str(out / f"shaping-{mid}"), "PYTHONPATH": str(ROOT)}
            import os
            self.procs[mid] = subprocess.Popen(
                [PY, str(out / "worker.py"), etcd, job, mid, str(out), str(n_ops), str(ROOT), str(op_timeout)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=open(out / f"{mid}.stderr", "w"),
                cwd=ROOT, env=dict(os.environ, **env))

    def records(self, mid: str) -> list[dict]:
        p = self.out / f"{mid}.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def retries(self, mid: str) -> int:
        p = self.out / f"retries-{mid}"
        return int(p.read_text() or 0) if p.exists() else 0

    def wait_for(self, what: str, cond, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            for mid, p in self.procs.items():
                assert p.poll() is None, f"{mid} exited early ({p.returncode}): {(self.out / f'{mid}.stderr').read_text()[-2000:]}"
            if time.monotonic() > deadline:
                tails = {m: (self.out / f"{m}.stderr").read_text()[-1500:] for m in IDS}
                raise AssertionError(f"timed out waiting for {what}: {tails}")
            time.sleep(0.02)

    def run_op(self, seq: int, timeout: float = 60.0) -> None:
        (self.out / f"gate-{seq}").write_text("")
        self.wait_for(f"op {seq}", lambda: all(len(self.records(m)) > seq for m in IDS), timeout)

    def cut(self, on: bool) -> None:
        (self.out / "shaping-m1").write_text("drop=m2" if on else "")
        (self.out / "shaping-m2").write_text("drop=m1" if on else "")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def exact(g: Group, mid: str, seq: int) -> None:
    exp = expected("sum", list(range(WORLD)), seq, 0, NUMEL, "int64")
    np.testing.assert_array_equal(np.load(g.out / f"{mid}.{seq}.npy", allow_pickle=False), exp.numpy())


def test_dropped_link_heals_and_the_op_finishes_exactly(etcd_session, job_name, tmp_path):
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=2.0):
        g = Group(etcd_session.endpoint_arg, job_name, tmp_path, n_ops=3, op_timeout=30.0)
        try:
            g.run_op(0, timeout=120)
            epoch0 = g.records("m0")[0]["epoch"]
            g.cut(True)
            time.sleep(0.3)  # precondition: past the shaping files' 0.2 s re-read interval
            (tmp_path / "gate-1").write_text("")
            g.wait_for("both ends of the cut link to retry", lambda: g.retries("m1") > 0 and g.retries("m2") > 0)
            assert not any(len(g.records(m)) > 1 for m in IDS), "an op finished across a cut link"
            g.cut(False)
            g.wait_for("op 1 after the link healed", lambda: all(len(g.records(m)) > 1 for m in IDS))
            g.run_op(2)
            for mid in IDS:
                for seq in range(3):
                    rec = g.records(mid)[seq]
                    assert rec["ok"], (mid, rec)
                    assert rec["contributors"] == IDS, (mid, rec)
                    assert rec["epoch"] == epoch0, f"{mid}: a live member was removed ({rec})"
                    exact(g, mid, seq)
        finally:
            g.close()


def test_persistent_cut_raises_peer_unreachable_on_every_member(etcd_session, job_name, tmp_path):
    op_timeout = 3.0
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=2.0):
        g = Group(etcd_session.endpoint_arg, job_name, tmp_path, n_ops=2, op_timeout=op_timeout)
        try:
            g.run_op(0, timeout=120)
            epoch0 = g.records("m0")[0]["epoch"]
            g.cut(True)
            time.sleep(0.3)  # precondition: past the shaping files' 0.2 s re-read interval
            t0 = time.monotonic()
            g.run_op(1, timeout=op_timeout + 30)
            took = time.monotonic() - t0
            for mid in IDS:
                rec = g.records(mid)[1]
                assert not rec["ok"], (mid, rec)
                assert rec["error"].startswith("PeerUnreachable:"), (mid, rec)
                assert "member m1" in rec["error"] or "member m2" in rec["error"], (mid, rec)
                assert rec["epoch"] == epoch0, f"{mid}: a live member was removed ({rec})"
            assert g.retries("m1") > 0 and g.retries("m2") > 0
            print(f"persistent cut surfaced after {took:.1f}s (op_timeout {op_timeout}s)")
        finally:
            g.close()
