"""A rank restarted outside resilient-run (issue 12, gap 2), in real processes with a real
etcd, coordinator and SIGKILL: 3 ranks started as ``init_process_group("resilient",
rank=r, world_size=3)`` run an exact int64 all_reduce loop; rank 2 is SIGKILLed and started
again the same way (no RESILIENT_JOINER). Its ``init_process_group`` returns (gated as a
joiner), its first all_reduce ends the process with exit 0 and a message naming why and
the fix — never a hang, never a value — and the survivors' every op stays the exact sum
over contributors that never include it (the worker: tests/workers/restart_worker.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torch_proc_helpers import revoke_lease_on_exit, wait_then_kill

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "restart_worker.py"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_rank_restarted_with_plain_init_process_group_is_gated_not_spliced(etcd_session, job_name, tmp_path):
    from collective_harness import coordinator

    etcd = etcd_session.endpoint_arg
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", RESILIENT_ETCD=etcd, RESILIENT_JOB=job_name,
               RESILIENT_LEASE_TTL="2", OMP_NUM_THREADS="1")
    for k in ("RESILIENT_MEMBER_ID", "RESILIENT_FAILPOINTS", "RANK", "WORLD_SIZE", "RESILIENT_JOINER", "RESTARTED"):
        env.pop(k, None)
    procs: list[subprocess.Popen] = []

    def start(rank: int, name: str, extra: dict[str, str]) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, str(WORKER), str(rank), str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=open(tmp_path / f"{name}.err", "w"),  # noqa: SIM115
                             text=True, env={**env, **extra}, cwd=ROOT)
        procs.append(p)
        threading.Thread(target=revoke_lease_on_exit, args=(p, etcd, job_name), daemon=True).start()
        return p

    def logs() -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp_path.glob("*.err")))

    with coordinator(etcd, job_name, ttl=2.0):
        try:
            for r in range(3):
                start(r, str(r), {})
            deadline = time.monotonic() + 90
            while not all((tmp_path / f"up{r}").exists() for r in range(3)):
                assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, logs()
                time.sleep(0.02)
            procs[2].send_signal(signal.SIGKILL)
            procs[2].wait(10)
            again = start(2, "restarted", {"RESTARTED": "1"})
            again.wait(timeout=90)  # TimeoutExpired: it hung
            (tmp_path / "stop").touch()
            wait_then_kill(procs[:2], 90)
        finally:
            wait_then_kill(procs, 1)
    err = (tmp_path / "restarted.err").read_text()
    assert again.returncode == 0 and not (tmp_path / "restarted.json").exists(), logs()
    assert (tmp_path / "restarted_init").exists(), err  # init_process_group returned
    assert "is not admitted to the running job" in err and "state.sync()" in err, err
    restarted = (tmp_path / "restarted_init").read_text()
    assert [p.returncode for p in procs[:2]] == [0, 0], logs()
    for r in (0, 1):
        d = json.loads((tmp_path / f"{r}.json").read_text())
        assert len(d["ops"]) > 3
        for i, contributors, exact in d["ops"]:
            assert exact and restarted not in contributors and len(contributors) in (2, 3), (r, i, contributors)
