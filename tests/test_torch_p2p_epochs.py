"""Point-to-point across a member's death (issue 12, gap 1), in real processes with a real
etcd, coordinator and SIGKILL: 3 ranks started as ``init_process_group("resilient",
rank=r, world_size=3)``; rank 2 is SIGKILLed while blocked in a ``recv``; rank 0's pending
``irecv`` from it fails with PeerLost naming it and the new epoch within a deadline (rank 0
adopts the epoch from point-to-point, rank 1 from its all_reduce: the all_reduce and a
send/recv after it agree); then ranks 0 and 1 run only
send/recv (ping-pongs, a batch_isend_irecv swap, a non-contiguous receive), every value
exact, and a barrier + all_reduce afterwards still agree (the worker:
tests/workers/p2p_epoch_worker.py)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_proc_helpers import err_logs, start_worker, wait_files, wait_then_kill, worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "p2p_epoch_worker.py"
PEER_LOST_DEADLINE_S = 30.0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_send_recv_between_survivors_after_a_death_and_peer_lost_for_the_dead(etcd_session, job_name, tmp_path):
    from collective_harness import coordinator

    etcd = etcd_session.endpoint_arg
    env = worker_env(ROOT, etcd, job_name)
    procs: list[subprocess.Popen] = []

    with coordinator(etcd, job_name, ttl=2.0):
        try:
            for r in range(3):
                procs.append(start_worker([sys.executable, str(WORKER), str(r), str(tmp_path)], tmp_path / f"{r}.err",
                                          env, ROOT, etcd, job_name))
            wait_files(tmp_path, ["warm0", "warm1", "warm2", "posted0"], procs, 90)
            killed_at = time.time()
            procs[2].send_signal(signal.SIGKILL)
            (tmp_path / "killed").touch()
            wait_then_kill(procs[:2], 90)
            procs[2].wait(10)
        finally:
            wait_then_kill(procs, 1)
    assert [p.returncode for p in procs[:2]] == [0, 0], err_logs(tmp_path)
    res = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)}
    for r, d in res.items():
        bad = [name for name, ok in d["checks"] if not ok]
        assert not bad and len(d["checks"]) > 20, (r, bad, d["checks"])
        assert d["size"] == 2
    lost = res[0]["peer_lost"]
    assert lost["error"] == "PeerLost", lost
    assert lost["peer"] not in (res[0]["member"], res[1]["member"]) and lost["peer"] in lost["message"], lost
    assert f"epoch {lost['epoch']}" in lost["message"]
    assert lost["at"] - killed_at < PEER_LOST_DEADLINE_S, lost
