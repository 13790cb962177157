"""Test script: an unchanged torch.distributed loop of int64 all_reduce (SUM) ops.

Each member contributes, to op i, ``crc32(member id) * (i + 1)`` in every element (so the
exact sum over any contributor set is known); after each op it checks the result against
the sum over ``work.contributors`` and exits 3 on a mismatch. ``$OPS`` ops, ``$OP_SLEEP``
seconds apart; prints ``ok <n> ops`` at the end."""
import os
import sys
import time
import zlib

import torch
import torch.distributed as dist

import resilient  # noqa: F401

dist.init_process_group("resilient")
me = os.environ["RESILIENT_MEMBER_ID"]
n_ops, pause = int(os.environ.get("OPS", "40")), float(os.environ.get("OP_SLEEP", "0.05"))
for i in range(n_ops):
    t = torch.full((50_000,), zlib.crc32(me.encode()) * (i + 1), dtype=torch.int64)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    want = sum(zlib.crc32(m.encode()) for m in work.contributors) * (i + 1)
    if not bool((t == want).all()):
        print(f"WRONG op {i}: got {t[0].item()} want {want} over {work.contributors}", flush=True)
        sys.exit(3)
    time.sleep(pause)
print(f"ok {n_ops} ops", flush=True)
dist.destroy_process_group()
