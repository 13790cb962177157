"""One process of tests/test_torch_restart_outside_launcher.py: a rank restarted with a plain
``init_process_group("resilient", rank=RANK, world_size=3)`` (no resilient-run, no
RESILIENT_JOINER) while its peers are past their start.

    python tests/workers/restart_worker.py RANK DIR          # a rank of the job
    RESTARTED=1 python tests/workers/restart_worker.py RANK DIR   # the restarted rank

A rank runs an int64 ``all_reduce`` loop (op i of member m contributes ``crc32(m) * (i + 1)``,
so the exact sum over the contributors each op reports is known), touching ``DIR/up<RANK>``
after its first op, until an op's flag sum says ``DIR/stop`` exists, then 3 more; writes
``DIR/<RANK>.json`` {"member", "ops": [[i, contributors, exact]]}.

The restarted rank touches ``DIR/restarted_init`` once ``init_process_group`` returned, then
runs the same script's first ``all_reduce``: the backend must end it (exit 0, saying why on
stderr) before anything returns; if the op returns, it writes ``DIR/restarted.json`` and
exits 3.

Diagnostics: SIGUSR1 dumps every thread's stack to stderr (the test sends it to a rank
that did not finish in time); ``RESILIENT_LOG_LEVEL`` (e.g. DEBUG) turns on the package's
logging to stderr with timestamps.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

import resilient  # noqa: F401 - registers the backend
from resilient.torch_backend import current_engine

RANK, DIR = int(sys.argv[1]), Path(sys.argv[2])


def value(member: str, i: int) -> int:
    return zlib.crc32(member.encode()) * (i + 1)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if os.environ.get("RESILIENT_LOG_LEVEL"):
        logging.basicConfig(level=os.environ["RESILIENT_LOG_LEVEL"].upper(),
                            format=f"%(asctime)s r{RANK} %(threadName)s %(name)s %(levelname)s %(message)s")
    dist.init_process_group("resilient", init_method=f"file://{DIR / f'init{os.getpid()}'}", rank=RANK, world_size=3)
    eng = current_engine()
    me = eng.member_id
    print(f"LEASE {me} {eng.session.lease_id}", flush=True)
    if os.environ.get("RESTARTED") == "1":
        (DIR / "restarted_init").write_text(me)
        t = torch.full((1000,), value(me, 0), dtype=torch.int64)
        dist.all_reduce(t)
        (DIR / "restarted.json").write_text(json.dumps({"member": me, "values": sorted(set(t.tolist()))}))
        sys.exit(3)
    ops: list[tuple[int, list[str], bool]] = []
    i, left = 0, None
    while left is None or left > 0:
        t = torch.full((1000,), value(me, i), dtype=torch.int64)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        ops.append((i, list(w.contributors), bool((t == sum(value(m, i) for m in w.contributors)).all())))
        if i == 0:
            (DIR / f"up{RANK}").touch()
        flag = torch.tensor([1 if (DIR / "stop").exists() else 0])
        dist.all_reduce(flag)
        if left is None and flag.item() > 0:
            left = 3
        elif left is not None:
            left -= 1
        i += 1
    (DIR / f"{RANK}.json").write_text(json.dumps({"member": me, "ops": ops}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
