"""One process of tests/test_torch_p2p_epochs.py: send/recv across a member's death.

    python tests/workers/p2p_epoch_worker.py RANK DIR

``init_process_group("resilient", rank=RANK, world_size=4)``; an exact int64 all_reduce
(so every member retains a ledger), then one message each way between pairs (values
checked). Then, with every rank's ``DIR/warm<r>`` written:

* rank 3 blocks in ``recv`` from rank 0 (which never sends): the test SIGKILLs it there;
* rank 0 posts an ``isend`` of 64 MiB to rank 1 (which does not receive yet: the transfer
  is under way across the death), an ``irecv`` from rank 3 (never sent) and an any-source
  ``irecv`` (``src=None``), writes ``DIR/posted0`` and waits: the irecv must fail with
  PeerLost (time and error recorded), the isend must complete, and the any-source receive
  must take rank 2's message, sent after the death (its receive on the victim left out;
  the one it left on rank 1 is taken over by rank 0's first receive from rank 1, a
  different shape: withdrawn and posted again, the ping-pongs' values exact);
* ranks 1 and 2 wait for ``DIR/killed`` (written by the test after the SIGKILL) and then
  for the coordinator's epoch without rank 3; rank 1's first op after the death is the
  64 MiB receive (value checked exactly), rank 2's is the send to rank 0, then a collective. (Waiting for the epoch
  is what makes the receive cross the change: posted right after the SIGKILL, it could run
  in the old epoch, the sender finish and the abort then cut the receiver's last bytes,
  which is DataLost by contract — seen once in CI.)

Then an all_reduce of ranks 0-2 (exact, 3 contributors): members that entered the new
epoch from point-to-point and one that entered it from the collective agree. Ranks 0
and 1 then exchange only send/recv (``ROUNDS`` ping-pongs, a ``batch_isend_irecv`` swap and
an isend/irecv of a non-contiguous tensor), every value checked exactly; a final barrier
of ranks 0-2. (Each pair keeps one order of point-to-point and collective ops: the
transport matches a pair's frames in posting order, collectives' and send/recv's alike.)
Writes ``DIR/<r>.json`` {"member", "checks": [[name, ok]], "peer_lost": {...}, "size"}.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import resilient  # noqa: F401 - registers the backend
from resilient.errors import PeerLost
from resilient.torch_backend import current_engine

RANK, DIR = int(sys.argv[1]), Path(sys.argv[2])
WORLD, VICTIM = 4, 3
ROUNDS = 20
BIG = 16 << 20  # int32s (64 MiB): more than a link holds, so it cannot finish before rank 1 reads


def wait_files(*names: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all((DIR / n).exists() for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {RANK}: {names} not all written within {timeout}s")
        time.sleep(0.01)


def main() -> None:
    dist.init_process_group("resilient", init_method=f"file://{DIR / 'init'}", rank=RANK, world_size=WORLD)
    eng = current_engine()
    print(f"LEASE {eng.member_id} {eng.session.lease_id}", flush=True)
    checks: list[tuple[str, bool]] = []
    res: dict[str, object] = {"member": eng.member_id, "checks": checks}
    t = torch.full((1000,), RANK + 1, dtype=torch.int64)
    dist.all_reduce(t)
    checks.append(("all_reduce", bool((t == 10).all())))
    for a, b in [(0, 1), (1, 0), (0, 3), (3, 0), (1, 3), (3, 1), (2, 3)]:
        if RANK == a:
            dist.send(torch.full((500,), 10 * a + b, dtype=torch.int64), b)
        elif RANK == b:
            got = torch.zeros(500, dtype=torch.int64)
            dist.recv(got, a)
            checks.append((f"warm {a}->{b}", bool((got == 10 * a + b).all())))
    (DIR / f"warm{RANK}").touch()
    wait_files(*(f"warm{r}" for r in range(WORLD)))
    victim_id = eng.comm.members[VICTIM]
    if RANK == VICTIM:
        dist.recv(torch.zeros(1), 0)  # never sent: SIGKILLed here
        raise AssertionError(f"rank {VICTIM} was not killed")
    if RANK == 0:
        big = torch.arange(BIG, dtype=torch.int32)
        w_big = dist.isend(big, 1)  # rank 1 receives only after the death: in flight across it
        w = dist.irecv(torch.zeros(4), VICTIM)
        got_any = torch.zeros(3, dtype=torch.int64)
        w_any = dist.irecv(got_any)  # any source: speculative receives on ranks 1, 2 and the victim
        (DIR / "posted0").touch()
        try:
            w.wait()
            res["peer_lost"] = {"error": None}
        except PeerLost as exc:
            res["peer_lost"] = {"error": type(exc).__name__, "peer": exc.peer, "epoch": exc.epoch,
                                "message": str(exc), "at": time.time()}
        w_big.wait()
        w_any.wait()  # rank 2 sends after the death; the victim's receive is left out
        checks.append(("any-source across the death",
                       w_any._source_rank() == 2 and got_any.tolist() == [2, 2, 2]))
    else:
        wait_files("killed")
        eng.watcher.wait_for(lambda e: victim_id not in e.members, 90.0)
    if RANK == 2:  # what rank 0's any-source receive, posted before the death, takes
        dist.send(torch.full((3,), 2, dtype=torch.int64), 0)
    if RANK == 1:  # its first op after the death: the receive the sender had under way
        got = torch.zeros(BIG, dtype=torch.int32)
        dist.recv(got, 0)
        checks.append(("in flight across the death", bool((got == torch.arange(BIG, dtype=torch.int32)).all())))
    s = torch.full((10,), RANK + 1, dtype=torch.int64)
    aw = dist.all_reduce(s, async_op=True)  # rank 2's first op after the death
    aw.wait()
    checks.append(("all_reduce after death", bool((s == 6).all()) and len(aw.contributors) == 3))
    if RANK == 2:
        dist.barrier()
        res["size"] = dist.get_world_size()
        (DIR / f"{RANK}.json").write_text(json.dumps(res))
        dist.destroy_process_group()
        return
    if RANK == 0:
        dist.send(torch.arange(7, dtype=torch.int64) + 100, 1)
    else:
        got7 = torch.zeros(7, dtype=torch.int64)
        dist.recv(got7, 0)
        checks.append(("send/recv after the all_reduce", got7.tolist() == list(range(100, 107))))
    peer = 1 - RANK
    for i in range(ROUNDS):
        x = torch.full((256 + i,), 1000 * i + RANK, dtype=torch.float64)
        got = torch.zeros_like(x)
        if RANK == 0:
            dist.send(x, peer)
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            dist.send(x, peer)
        checks.append((f"pingpong {i}", bool((got == 1000 * i + peer).all())))
    mine = torch.full((3000,), 7 + RANK, dtype=torch.int32)
    theirs = torch.zeros(3000, dtype=torch.int32)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, peer), dist.P2POp(dist.isend, mine, peer)]):
        w.wait()
    checks.append(("batch swap", bool((theirs == 7 + peer).all())))
    src = torch.arange(24, dtype=torch.float32).view(4, 6) * (RANK + 1)
    dst = torch.zeros(6, 4).t()  # non-contiguous receive
    ws = [dist.isend(src, peer), dist.irecv(dst, peer)]
    for w in ws:
        w.wait()
    checks.append(("non-contiguous", bool((dst == torch.arange(24, dtype=torch.float32).view(4, 6) * (peer + 1)).all())))
    dist.barrier()  # with rank 2's: the collectives still agree after the point-to-point epoch change
    res["size"] = dist.get_world_size()
    (DIR / f"{RANK}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
