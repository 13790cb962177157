"""A rank restarted outside resilient-run (issue 12, gap 2), in real processes with a real
etcd, coordinator and SIGKILL: 3 ranks started as ``init_process_group("resilient",
rank=r, world_size=3)`` run an exact int64 all_reduce loop; rank 2 is SIGKILLed and started
again the same way (no RESILIENT_JOINER). Its ``init_process_group`` returns (gated as a
joiner), its first all_reduce ends the process with exit 0 and a message naming why and
the fix — never a hang, never a value — and the survivors' every op stays the exact sum
over contributors that never include it (the worker: tests/workers/restart_worker.py)."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from collective_harness import coordinator
from resilient.errors import ResilientTimeout
from resilient.process_pool import Child
from torch_proc_helpers import RankProcs, err_logs, wait_files, worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "restart_worker.py"


def wait_or_dump(ranks: RankProcs, procs: list[Child], tmp_path: Path) -> None:
    """Wait 90 s for ``procs`` to exit; past that, SIGUSR1 (the worker's faulthandler) dumps
    the stacks of those still running into their .err and the test fails showing them."""
    try:
        ranks.pool.wait(90, procs)
    except ResilientTimeout as e:
        hung = [p for p in procs if p.alive()]
        for p in hung:
            p.signal(signal.SIGUSR1)
        time.sleep(1)  # let faulthandler write (diagnostics only, after the failure)
        pytest.fail(f"{e}\n{err_logs(tmp_path, tail=20000)}")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_rank_restarted_with_plain_init_process_group_is_gated_not_spliced(etcd_session, job_name, tmp_path):
    etcd = etcd_session.endpoint_arg
    ranks, env, procs = RankProcs(etcd, job_name), worker_env(ROOT, etcd, job_name), list[Child]()

    def start(rank: int, name: str, extra: dict[str, str]) -> Child:
        p = ranks.start([sys.executable, str(WORKER), str(rank), str(tmp_path)], env={**env, **extra}, cwd=ROOT,
                        stderr=tmp_path / f"{name}.err")
        procs.append(p)
        return p

    with coordinator(etcd, job_name, ttl=2.0), ranks:
        for r in range(3):
            start(r, str(r), {})
        wait_files(tmp_path, [f"up{r}" for r in range(3)], procs, 90)
        procs[2].signal(signal.SIGKILL)
        procs[2].wait(10)
        again = start(2, "restarted", {"RESTARTED": "1"})
        wait_or_dump(ranks, [again], tmp_path)  # it hung
        (tmp_path / "stop").touch()
        wait_or_dump(ranks, procs[:2], tmp_path)
    err = (tmp_path / "restarted.err").read_text()
    assert again.returncode == 0 and not (tmp_path / "restarted.json").exists(), err_logs(tmp_path)
    assert (tmp_path / "restarted_init").exists(), err  # init_process_group returned
    assert "is not admitted to the running job" in err and "state.sync()" in err, err
    restarted = (tmp_path / "restarted_init").read_text()
    assert [p.returncode for p in procs[:2]] == [0, 0], err_logs(tmp_path)
    for r in (0, 1):
        d = json.loads((tmp_path / f"{r}.json").read_text())
        assert len(d["ops"]) > 3
        for i, contributors, exact in d["ops"]:
            assert exact and restarted not in contributors and len(contributors) in (2, 3), (r, i, contributors)
