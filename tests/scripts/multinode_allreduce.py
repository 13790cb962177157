"""One rank of the multi-node guide's check (tests/test_multinode_netns.py): an all_reduce
on the resilient backend across the nodes, its result written to $OUT_DIR/<rank>.json."""
import json
import os

import torch
import torch.distributed as dist

import resilient  # noqa: F401 - registers the "resilient" backend

dist.init_process_group("resilient")  # rank, world and etcd come from resilient-run
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
record = {"rank": rank, "world": world, "sum": t.tolist(), "host": os.environ.get("RESILIENT_HOST"),
          "master": os.environ.get("MASTER_ADDR")}
dist.destroy_process_group()
path = os.path.join(os.environ["OUT_DIR"], f"{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
