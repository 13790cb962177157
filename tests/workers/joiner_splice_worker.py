"""One process of tests/test_torch_backend_procs.py::test_a_joiner_s_first_all_reduce_is_never_spliced_into_the_survivors_ops.

    python tests/workers/joiner_splice_worker.py ROLE RANK WORLD DIR

An unchanged int64 ``all_reduce`` loop: op i of member m contributes
``crc32(m) * (i + 1)`` in every element, so the exact sum over any contributor set of one
op is known, and an op that mixed op i of one member with op j != i of another is not.

* ``survivor`` (``init_process_group(rank=RANK, world_size=WORLD)``): runs ops until one
  of them saw ``DIR/posted`` (the joiner's first op is posted; agreed by a SUM all_reduce
  of a flag after each op), then ``AFTER`` more; writes
  ``DIR/RANK.json`` {"member", "ops": [[i, contributors, exact]]} and exits.
* ``joiner``: once every survivor wrote ``DIR/upRANK`` (it is in the epoch of WORLD), a restarted worker (``RESILIENT_JOINER=1``) at rank RANK of WORLD + 1, with
  the not-admitted gate opened (``engine._open_gate()``) so that its first op really runs
  on its Communicator — what an unchanged script's first collective did before the gate.
  Posts its op 0, touches ``DIR/posted``, waits until every survivor wrote its file (all
  of their ops are over: the joiner's op could only ever have been part of one of them),
  writes ``DIR/joiner.json`` {"member", "state": "pending" | "done" | "error", ...} and exits.

``RESILIENT_TEST_OLD_ADMISSION=1`` builds every Communicator as the backend did before
the fix (no AdmittedView, ``joining`` detected from the epoch: survivors adopt a grown
epoch at their next op boundary and the joiner starts at their announced op seq), to show
that the test fails on that behaviour.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

import resilient  # noqa: F401 - registers the backend
from resilient.torch_backend import current_engine

ROLE, RANK, WORLD, DIR = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
AFTER = 8  # survivor ops after the joiner posted its first one


if os.environ.get("RESILIENT_TEST_OLD_ADMISSION") == "1":
    import resilient.connection as connection

    _connect = connection.connect

    def old_connect(*args, **kwargs):  # type: ignore[no-untyped-def]
        """The construction before the fix: no AdmittedView, ``joining`` from the epoch."""
        kwargs.pop("wrap_view", None)
        kwargs.pop("joining", None)
        return _connect(*args, **kwargs)

    connection.connect = old_connect


def value(member: str, i: int) -> int:
    return zlib.crc32(member.encode()) * (i + 1)


def op(member: str, i: int) -> tuple[dist.Work, torch.Tensor]:
    t = torch.full((20_000,), value(member, i), dtype=torch.int64)
    return dist.all_reduce(t, async_op=True), t


def exact(t: torch.Tensor, contributors: tuple[str, ...], i: int) -> bool:
    return bool((t == sum(value(m, i) for m in contributors)).all())


def survivor() -> None:
    dist.init_process_group("resilient", init_method=f"file://{DIR / 'init'}", rank=RANK, world_size=WORLD)
    me = current_engine().member_id
    print(f"LEASE {me} {current_engine().session.lease_id}", flush=True)
    (DIR / f"up{RANK}").touch()
    ops, after = [], None
    i = 0
    while after is None or i < after:
        work, t = op(me, i)
        work.wait()
        ops.append([i, list(work.contributors), exact(t, work.contributors, i)])
        # all survivors agree on when the joiner's op was posted: an all_reduce (SUM) of
        # whether each saw it, of the same shape, dtype and op as the data (a joiner op
        # spliced in here would be just as wrong: not a count of survivors)
        flag = torch.full((20_000,), int((DIR / "posted").exists()), dtype=torch.int64)
        fw = dist.all_reduce(flag, async_op=True)
        fw.wait()
        ops.append([f"flag {i}", list(fw.contributors), bool((flag == flag[0]).all()) and 0 <= int(flag[0]) <= WORLD])
        if after is None and int(flag[0]) > 0:
            after = i + 1 + AFTER
        i += 1
        time.sleep(0.02)
    (DIR / f"{RANK}.json").write_text(json.dumps({"member": me, "ops": ops}))


def joiner() -> None:
    deadline = time.monotonic() + 90
    while not all((DIR / f"up{r}").exists() for r in range(WORLD)) and time.monotonic() < deadline:
        time.sleep(0.01)  # register only once the survivors' epoch of WORLD exists (they wait for exactly WORLD)
    t0 = time.monotonic()
    dist.init_process_group("resilient", init_method=f"file://{DIR / 'init-j'}", rank=RANK, world_size=WORLD + 1)
    engine = current_engine()
    me = engine.member_id
    print(f"LEASE {me} {engine.session.lease_id}", flush=True)
    print(f"joiner admitted to an epoch in {time.monotonic() - t0:.2f}s", file=sys.stderr, flush=True)
    engine._open_gate()  # noqa: SLF001 - what an ungated joiner's first collective did
    work, t = op(me, 0)
    (DIR / "posted").touch()
    rec: dict = {"member": me, "state": "pending"}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all((DIR / f"{r}.json").exists() for r in range(WORLD)):
        if work.is_completed():
            break
        time.sleep(0.01)
    if work.is_completed():
        try:
            work.wait()
            rec.update(state="done", contributors=list(work.contributors), exact=exact(t, work.contributors, 0),
                       got=int(t[0]))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            rec.update(state="error", error=f"{type(exc).__name__}: {exc}"[:300])
    (DIR / "joiner.json").write_text(json.dumps(rec))


if __name__ == "__main__":
    survivor() if ROLE == "survivor" else joiner()
    sys.stdout.flush()
    os._exit(0)  # no shutdown handshake: the test revokes the leases
