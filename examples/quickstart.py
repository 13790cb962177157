"""The README's 30-second example: an allreduce on the resilient backend.

    resilient-run --standalone --nproc-per-node 4 examples/quickstart.py
"""
import torch
import torch.distributed as dist

import resilient  # registers the "resilient" backend with torch.distributed

dist.init_process_group("resilient")  # rank, world and etcd come from resilient-run
t = torch.full((4,), float(dist.get_rank()))
work = dist.all_reduce(t, async_op=True)
work.wait()
# every element is the exact sum over the members in work.contributors
print(f"rank {dist.get_rank()}/{dist.get_world_size()}: {t.tolist()} from {len(work.contributors)} members "
      f"(epoch {resilient.world().epoch})", flush=True)
dist.destroy_process_group()  # lingers until the peers finished the op (no barrier needed)
