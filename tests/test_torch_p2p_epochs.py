"""Point-to-point across a member's death, in real processes with a real
etcd, coordinator and SIGKILL: 4 ranks started as ``init_process_group("resilient",
rank=r, world_size=4)``; rank 3 is SIGKILLed while blocked in a ``recv``. Rank 0's pending
``irecv`` from it fails with PeerLost naming it and the new epoch within a deadline; its
64 MiB ``isend`` to rank 1, under way across the death, is posted again in the new epoch
and arrives exactly; its any-source ``irecv``, posted before the death, takes the message
rank 2 sends after it (sender rank reported); every survivor enters the new epoch from
point-to-point, and the all_reduce after it is exact over the 3 survivors; then ranks 0 and 1 run
only send/recv (ping-pongs, a batch_isend_irecv swap, a non-contiguous receive), every
value exact, and a barrier afterwards still agrees (the worker:
tests/workers/p2p_epoch_worker.py)."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from torch_proc_helpers import RankProcs, err_logs, wait_files, worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "p2p_epoch_worker.py"
PEER_LOST_DEADLINE_S = 30.0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_send_recv_between_survivors_after_a_death_and_peer_lost_for_the_dead(etcd_session, job_name, tmp_path):
    from collective_harness import coordinator

    etcd = etcd_session.endpoint_arg
    env = worker_env(ROOT, etcd, job_name)
    ranks = RankProcs(etcd, job_name)

    with coordinator(etcd, job_name, ttl=2.0), ranks:
        procs = [ranks.start([sys.executable, str(WORKER), str(r), str(tmp_path)], env=env, cwd=ROOT,
                             stderr=tmp_path / f"{r}.err") for r in range(4)]
        wait_files(tmp_path, ["warm0", "warm1", "warm2", "warm3", "posted0"], procs, 90)
        killed_at = time.time()
        procs[3].signal(signal.SIGKILL)
        (tmp_path / "killed").touch()
        ranks.pool.wait(90, procs[:3])
        procs[3].wait(10)
    assert [p.returncode for p in procs[:3]] == [0, 0, 0], err_logs(tmp_path)
    res = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1, 2)}
    for r, d in res.items():
        bad = [name for name, ok in d["checks"] if not ok]
        assert not bad and len(d["checks"]) >= (2 if r == 2 else 20), (r, bad, d["checks"])
        assert d["size"] == 3
    assert ("in flight across the death", True) in map(tuple, res[1]["checks"])
    assert ("any-source across the death", True) in map(tuple, res[0]["checks"])
    lost = res[0]["peer_lost"]
    assert lost["error"] == "PeerLost", lost
    assert lost["peer"] not in {d["member"] for d in res.values()} and lost["peer"] in lost["message"], lost
    assert f"epoch {lost['epoch']}" in lost["message"]
    assert lost["at"] - killed_at < PEER_LOST_DEADLINE_S, lost
