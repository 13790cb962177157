"""The DDP compression hook (q4 with error feedback) in real worker processes over the
resilient backend, with a real etcd, coordinator and SIGKILL (the worker:
tests/workers/ddp_compress_worker.py). One run, two tests:

* a worker SIGKILLed mid-training: at every step the survivors' parameters are bitwise
  identical, every bucket result is bitwise ``fl32(sum_{i in C} s*q_i) / |C|`` recomputed
  here from the inputs the contributors wrote before the op and the agreed scales, and
  every parameter update is SGD's on that gradient (replayed here, bitwise);
* the killed worker restarted as a joiner (``RESILIENT_JOINER=1``): ``State.sync()`` gives
  it the survivors' parameters exactly and zero residuals, and from then on all three
  train with identical parameters, the joiner among the contributors."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from collective_harness import coordinator
from ddp_compress_records import by_step, floats, records, reference
from resilient.process_pool import Child
from torch_proc_helpers import RankProcs, err_logs, wait_files, worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "ddp_compress_worker.py"
WORLD, KILL_AFTER, LR = 3, 2, 0.1


@pytest.fixture(scope="module")
def run(etcd_session, tmp_path_factory) -> dict[str, Any]:
    """The scenario, once: 3 ranks train, rank 2 is SIGKILLed after step KILL_AFTER, then
    restarted as a joiner; the survivors stop 4 steps after it is in."""
    d = tmp_path_factory.mktemp("ddpq")
    etcd, job = etcd_session.endpoint_arg, f"ddpq-{time.monotonic_ns() % 10**8}"
    ranks, procs = RankProcs(etcd, job), list[Child]()
    # the victim leaves at once (its lease is revoked when it exits); a longer TTL only
    # keeps a loaded machine's late keep-alives from removing a live member
    env = {**worker_env(ROOT, etcd, job), "RESILIENT_LEASE_TTL": "6"}

    def start(rank: int, name: str, extra: dict[str, str]) -> Child:
        p = ranks.start([sys.executable, str(WORKER), str(rank), str(WORLD), str(d)], env={**env, **extra},
                        cwd=ROOT, stderr=d / f"{name}.err")
        procs.append(p)
        return p

    with coordinator(etcd, job, ttl=2.0), ranks:
        for r in range(WORLD):
            start(r, str(r), {})
        joiner = start(2, "joiner", {"RESILIENT_JOINER": "1"})   # waits for DIR/go
        wait_files(d, [f"member_{r}" for r in range(WORLD)], procs, 90)
        ids = [(d / f"member_{r}").read_text() for r in range(WORLD)]
        victim, survivors = ids[2], ids[:2]
        deadline = time.monotonic() + 90
        while not any(r["step"] >= KILL_AFTER for r in records(d).get(victim, [])):
            assert all(p.alive() for p in procs), err_logs(d)
            assert time.monotonic() < deadline, f"{victim} logged no step {KILL_AFTER} within 90 s:\n{err_logs(d)}"
            time.sleep(0.02)
        procs[2].signal(signal.SIGKILL)
        procs[2].wait(10)
        (d / "go").touch()
        wait_files(d, [f"{m}.done" for m in survivors], [procs[0], procs[1], joiner], 120)
        codes = ranks.pool.wait(60, [procs[0], procs[1], joiner])
    assert codes == [0, 0, 0], err_logs(d)
    recs = records(d)
    joiner_id = (d / "member_joiner").read_text()
    return {"dir": d, "recs": recs, "victim": victim, "survivors": survivors, "joiner": joiner_id}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_survivors_of_a_sigkill_train_on_bitwise_identical_and_exact(run):
    d, victim = run["dir"], run["victim"]
    steps_of = by_step(run["recs"])
    assert sorted(steps_of) == list(range(max(steps_of) + 1))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = list(model.parameters())
    shrunk = False
    for s, rs in sorted(steps_of.items()):
        assert len({r["params"] for r in rs}) == 1, f"step {s}: members' parameters differ"
        rec = rs[0]
        assert len(rec["buckets"]) == 1 and all(r["C"] == rec["C"] and r["scales"] == rec["scales"] for r in rs)
        ((key, b),) = rec["buckets"].items()
        ref = reference(d, rec, key)
        assert torch.equal(floats(b["grads"]), ref), f"step {s}: the bucket is not the exact mean over {rec['C']}"
        # replay SGD from the recorded parameters with the reference gradient
        with torch.no_grad():
            flat = floats(rec["pre"])
            pos = 0
            for p in params:
                p.copy_(flat[pos:pos + p.numel()].view_as(p))
                pos += p.numel()
            pos = 0
            grads = {}
            for i in b["order"]:
                grads[i] = ref[pos:pos + params[i].numel()].view_as(params[i])
                pos += params[i].numel()
            for i, p in enumerate(params):
                p.grad = grads[i].clone()
        opt.step()
        assert torch.cat([p.detach().reshape(-1) for p in params]).numpy().tobytes().hex() == rec["params"], s
        if s > 0:
            assert rec["pre"] == steps_of[s - 1][0]["params"], f"step {s} did not start from step {s - 1}'s parameters"
        shrunk |= rec["world"] == WORLD - 1 and victim not in rec["C"] and len(rec["C"]) == WORLD - 1
    last_victim = max(r["step"] for r in run["recs"][victim])
    assert last_victim >= KILL_AFTER and shrunk, "the survivors never trained without the killed worker"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_joiner_after_the_death_gets_the_state_and_trains_identically(run):
    recs, joiner = run["recs"], run["joiner"]
    steps_of = by_step(recs)
    mine = recs[joiner]
    first = mine[0]
    assert first["synced"] and first["res_n"] == 0, first      # state received; residuals start at zero
    assert first["pre"] == steps_of[first["step"] - 1][0]["params"]   # the survivors' parameters, exactly
    assert all(r["res_n"] > 0 for m in run["survivors"] for r in recs[m] if r["step"] == first["step"])
    assert len(mine) >= 3
    for r in mine:
        assert r["world"] == WORLD and joiner in r["C"] and len(r["C"]) == WORLD, r["C"]
        assert {x["params"] for x in steps_of[r["step"]]} == {r["params"]}
