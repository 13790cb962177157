"""The torch.distributed API as users call it, on the resilient backend, in real processes
over a real etcd + coordinator: every call over every dtype torch takes (results checked
on every rank against locally computed values), then the same call with the last rank
SIGKILLed half-way through its data movement (a failpoint): each survivor's result is
exact over ``work.contributors`` or the call raised a named CollectiveError. For
send/recv the sender dies before sending, and in a batch_isend_irecv ring it dies with its send
half-way: the receiver gets PeerLost naming the member, not a hang, and the transfers
between survivors go on in the new epoch.

One launch per call (4 ranks, ``init_process_group(rank=r, world_size=4)`` as mp.spawn
does it); the dtypes of a call share that launch (tests/workers/torch_api_worker.py). Two
calls' launches run side by side in one test, each with its own job and coordinator (their
waits for the lease expiry overlap: the file takes about half the time), and each is
checked on its own."""
from __future__ import annotations

import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from collective_harness import coordinator
from torch_proc_helpers import RankProcs

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "torch_api_worker.py"
WORLD = 4
CALLS = ["all_reduce", "reduce", "reduce_scatter_tensor", "all_reduce_coalesced", "reduce_scatter_tensor_coalesced",
         "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "gather", "scatter",
         "all_to_all_single", "all_to_all", "send_recv", "batch_isend_irecv", "objects", "gather_object",
         "scatter_object_list", "new_group", "rank"]
#: calls whose kill-phase op is a reduction: the survivors must finish it (no error allowed)
REDUCTIONS = {"all_reduce", "reduce", "reduce_scatter_tensor", "all_reduce_coalesced",
              "reduce_scatter_tensor_coalesced", "new_group"}


def _run(etcd: str, job: str, call: str, tmp: Path) -> tuple[dict, list[int], str]:
    out = tmp / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", RESILIENT_ETCD=etcd, RESILIENT_JOB=job,
               RESILIENT_LEASE_TTL="3", OMP_NUM_THREADS="1")
    for k in ("RESILIENT_MEMBER_ID", "RESILIENT_FAILPOINTS", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    with RankProcs(etcd, job) as procs:
        for r in range(WORLD):
            procs.start([sys.executable, str(WORKER), call, str(r), str(WORLD), str(tmp / "init"), str(out)],
                        env=env, cwd=ROOT, stderr=tmp / f"{r}.err")
        codes = procs.wait(120)
    logs = "\n".join(f"--- rank {r}\n" + (tmp / f"{r}.err").read_text()[-2500:] for r in range(WORLD))
    res = {int(f.stem): json.loads(f.read_text()) for f in out.glob("*.json")}
    return res, codes, logs


#: the calls two by two: each test launches both side by side
PAIRS = [tuple(CALLS[i:i + 2]) for i in range(0, len(CALLS), 2)]


def _run_with_coordinator(etcd: str, job: str, call: str, tmp: Path) -> tuple[dict, list[int], str]:
    tmp.mkdir()
    with coordinator(etcd, job, ttl=2.0):
        return _run(etcd, job, call, tmp)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("calls", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_call_every_dtype_then_a_kill_mid_call(calls, etcd_session, job_name, tmp_path):
    etcd = etcd_session.endpoint_arg
    with ThreadPoolExecutor(len(calls)) as ex:
        runs = {call: ex.submit(_run_with_coordinator, etcd, f"{job_name}-{i}", call, tmp_path / call)
                for i, call in enumerate(calls)}
        results = {call: f.result() for call, f in runs.items()}
    for call, (res, rcs, logs) in results.items():
        try:
            _check(call, res, rcs, logs)
        except AssertionError as exc:
            raise AssertionError(f"{call}: {exc}") from exc


def _check(call: str, res: dict, rcs: list[int], logs: str) -> None:
    """One call's launch: the victim was SIGKILLed, every survivor's checks passed and its
    kill-phase result is exact or a named error (see the module docstring)."""
    survivors = list(range(WORLD - 1))
    assert rcs[-1] == -signal.SIGKILL, (rcs, logs)
    assert sorted(res) == survivors, (rcs, logs)
    for r in survivors:
        d = res[r]
        assert "crash" not in d, d.get("crash", "") + logs
        failed = [c for c in d["checks"] if not c[1]]
        assert not failed, failed[:10]
        k = d["kill"]
        if call == "send_recv":  # rank 0 waited on a recv from the dead rank: a named error, no hang
            assert r != 0 or (not k["ok"] and k["error"]), (r, k)
        elif call == "batch_isend_irecv":  # rank 0's receive from the victim was cut: PeerLost, no hang
            if r == 0:  # PeerLost; or exact when the victim's bytes were all out before its kill
                # (a small dtype's message can leave in one write ahead of the failpoint)
                assert (not k["ok"] and k["error"] == "PeerLost") or (k["ok"] and k["exact"]), (r, k)
            elif r == 2 and k.get("at_issue"):
                # rank 2 issued its batch after it had adopted the epoch without the victim
                # (a loaded host: the victim dies at its own pace, 256 KiB into its send):
                # its send to rank 3, a rank the live group no longer has, is refused at issue
                # (p2p: a rank the group had before it shrank -> PeerLost), before anything moved
                assert k["error"] == "PeerLost" and "shrank from 4" in k["message"], (r, k)
                assert k["size_at_issue"] == WORLD - 1, (r, k)
            else:  # the transfers between survivors go on in the new epoch: exact (or a message
                # its sender finished just before the epoch change, gone with it: DataLost);
                # rank 2's send to the victim may not have finished: PeerLost
                assert (k["ok"] and k["exact"]) or k["error"] in ("DataLost",) + (("PeerLost",) if r == 2 else ()), (r, k)
        elif call in REDUCTIONS:
            assert k["ok"] and k["exact"], (r, k)
            if call == "new_group":  # the subgroup [1, 2, 3] lost rank 3; rank 0 is not in it
                assert r == 0 or set(k["contributors"]) in ({1, 2}, {1, 2, 3}), (r, k)
            else:
                assert set(k["contributors"]) in ({0, 1, 2}, {0, 1, 2, 3}), (r, k)
        else:  # copies: every piece, exact — or the piece of the dead rank exists nowhere (named)
            named = ("DataLost", "GroupChanged", "CollectiveAborted")
            if call in ("gather_object", "scatter_object_list"):
                # the victim died in op 1 (the data), so op 2's root holds a list for 4 ranks in a group
                # of 3: it raises GroupChanged, the others InputMismatch (composed._refuse)
                named += ("InputMismatch",)
            assert (k["ok"] and k["exact"]) or k["error"] in named, (r, k)
        assert k["size_after"] == WORLD - 1, (r, k)
    assert sum(len(res[r]["checks"]) for r in survivors) >= 4, "too few checks ran"
