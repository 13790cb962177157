"""``dist.init_process_group("resilient")`` in real worker processes under ``resilient-run
--standalone`` (real etcd, coordinator, TCP transport): every supported ``torch.distributed``
op gives the right result on every rank; a member SIGKILLed while the others are in an
allreduce leaves an exact AVG over the reported contributors; afterwards
``dist.get_rank()/get_world_size()`` and ``resilient.world()`` report the live world."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from torch_proc_helpers import RankProcs, err_logs, worker_env

ROOT = Path(__file__).resolve().parents[1]
RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]

WORKER = r'''
import json, os, signal, sys
import torch, torch.distributed as dist
import resilient
from resilient.live_world import world
from resilient.errors import InputMismatch

out_dir = sys.argv[1]
if os.environ.get("RESILIENT_JOINER") == "1":
    sys.exit(0)  # the restarted victim: nothing to do here
dist.init_process_group("resilient")
r, n = dist.get_rank(), dist.get_world_size()
res = {"rank": r, "size": n, "member": world().member_id}
for name in ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]:
    t = torch.full((3000,), float(r + 1))
    dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
    res[name] = sorted(set(t.tolist()))
b = torch.full((5,), float(r)); dist.broadcast(b, 2); res["broadcast"] = sorted(set(b.tolist()))
gl = [torch.zeros(3) for _ in range(n)]; dist.all_gather(gl, torch.full((3,), float(r)))
res["all_gather"] = [g.tolist() for g in gl]
ag = torch.zeros(3 * n); dist.all_gather_into_tensor(ag, torch.full((3,), float(r))); res["all_gather_into_tensor"] = ag.tolist()
rs = torch.zeros(2); dist.reduce_scatter_tensor(rs, torch.arange(2 * n, dtype=torch.float32) + r)
res["reduce_scatter_tensor"] = rs.tolist()
dist.barrier()
if r == 0:
    dist.send(torch.tensor([42.0, 43.0]), 1)
if r == 1:
    t = torch.zeros(2); dist.recv(t, 0); res["recv"] = t.tolist()
w = dist.all_reduce(torch.ones(10), async_op=True); w.wait()
res["async_contributors"] = list(w.contributors)
red = torch.ones(1); dist.reduce(red, 0); res["reduce"] = red.item()
if r in (0, 2):
    dist.send(torch.full((3,), 10.0 * r), 1)
if r == 1:  # any source: the two senders, each message whole, in whatever order they came
    got = []
    for _ in range(2):
        t = torch.zeros(3); src = dist.recv(t); got.append([src, t.tolist()])
    res["any_source"] = sorted(got)
if r == 0:
    dist.send(torch.tensor([5, 6]), 1)  # int64 (2,): what rank 1's next any-source receive does not expect
if r == 1:
    try:
        dist.recv(torch.zeros(3))   # float32 (3,): the message that comes does not fit
    except InputMismatch as exc:
        res["any_misfit"] = str(exc)
    kept = torch.zeros(2, dtype=torch.int64); dist.recv(kept, 0); res["kept"] = kept.tolist()
dist.barrier()
# phase 2: rank 3 dies while the others are in an allreduce
if r == 3:
    os.kill(os.getpid(), signal.SIGKILL)
t = torch.full((100000,), float(r + 1))
w = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True); w.wait()
res["after_kill"] = {"values": sorted(set(t.tolist())), "contributors": list(w.contributors),
                     "rank": dist.get_rank(), "size": dist.get_world_size(), "world_members": list(world().members)}
json.dump(res, open(os.path.join(out_dir, f"{r}.json"), "w"))
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dist_ops_and_live_world_under_resilient_run(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    agent = subprocess.Popen(RUN + ["--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "--lease-ttl", "3",
                                    str(script), str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(30)
    assert agent.returncode == 0, log[-4000:]
    res = {int(f.stem): json.loads(f.read_text()) for f in out.glob("*.json")}
    assert sorted(res) == [0, 1, 2], log[-4000:]
    members = [None] * 4
    for r, d in res.items():
        members[r] = d["member"]
        assert d["size"] == 4
        assert (d["SUM"], d["AVG"], d["MIN"], d["MAX"], d["PRODUCT"]) == ([10.0], [2.5], [1.0], [4.0], [24.0])
        assert d["broadcast"] == [2.0]
        assert d["all_gather"] == [[float(i)] * 3 for i in range(4)]
        assert d["all_gather_into_tensor"] == [float(i) for i in range(4) for _ in range(3)]
        # chunk r of sum_k (arange(8) + k) = 4 * arange + 6
        assert d["reduce_scatter_tensor"] == [4.0 * (2 * r) + 6, 4.0 * (2 * r + 1) + 6]
        assert len(d["async_contributors"]) == 4
        assert d["reduce"] == (4.0 if r == 0 else 1.0)  # only dst gets the sum
    assert res[1]["recv"] == [42.0, 43.0]
    assert res[1]["any_source"] == [[0, [0.0] * 3], [2, [20.0] * 3]]
    assert "kept for the next receive" in res[1]["any_misfit"] and res[1]["kept"] == [5, 6]
    survivors = [res[r]["member"] for r in (0, 1, 2)]
    for r, d in res.items():
        k = d["after_kill"]
        assert sorted(k["contributors"]) == sorted(survivors)
        assert k["values"] == [2.0]  # (1 + 2 + 3) / 3: the mean over the contributors
        assert k["size"] == 3 and k["world_members"] == [m for m in k["world_members"] if m in survivors]
        assert k["rank"] == k["world_members"].index(d["member"])


SPLICE_WORKER = ROOT / "tests" / "workers" / "joiner_splice_worker.py"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_joiner_s_first_all_reduce_is_never_spliced_into_the_survivors_ops(etcd_session, job_name, tmp_path):
    """Issue 12 item 3, root cause of the restarted worker's wrong first all_reduce: the
    Communicator admitted a joiner at an op boundary — the survivors adopted the grown
    epoch at their next op seq and the joiner started there — so an unchanged script's
    op 0 on the joiner met the survivors' op k (same shape, dtype and op: nothing told
    them apart) and both got crc(survivors)*(k+1) + crc(joiner)*1. Now a Communicator
    never grows by itself (AdmittedView; joiners are admitted only where every member
    rebuilds at op seq 0, State.sync()). Here the joiner's gate is opened on purpose, so
    its op 0 really runs: the survivors' ops must stay exact over contributor sets that
    never include it, and the joiner's op must not return a value that is not the exact
    sum over the contributors it reports (with RESILIENT_TEST_OLD_ADMISSION=1, the old
    construction, both fail)."""
    from collective_harness import coordinator

    etcd = etcd_session.endpoint_arg
    env = worker_env(ROOT, etcd, job_name)
    procs = RankProcs(etcd, job_name)

    def start(role: str, rank: int, extra: dict[str, str]) -> None:
        procs.start([sys.executable, str(SPLICE_WORKER), role, str(rank), "3", str(tmp_path)],
                    env={**env, **extra}, cwd=ROOT, stderr=tmp_path / f"{role}{rank}.err")

    def logs() -> str:
        return err_logs(tmp_path, 2000)

    with coordinator(etcd, job_name, ttl=2.0), procs:
        for r in range(3):
            start("survivor", r, {})
        start("joiner", 3, {"RESILIENT_JOINER": "1"})  # registers once the survivors' epoch of 3 exists
        codes = procs.wait(120)
    assert codes == [0, 0, 0, 0], logs()
    res = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)}
    joiner = json.loads((tmp_path / "joiner.json").read_text())
    survivors = {d["member"] for d in res.values()}
    for r, d in res.items():
        assert len(d["ops"]) > 8, d
        for i, contributors, ok in d["ops"]:
            assert set(contributors) == survivors and ok, (r, i, contributors, ok, joiner)
    if joiner["state"] == "done":
        assert joiner["exact"], joiner
