"""One worker of torchft's HSDP on the model of ``tests/scripts/hsdp_train.py``: the competitor
side of ``bench/fsdp.py``, run by it in a separate venv that has ``torchft-nightly``.

torchft's HSDP as torchtitan runs it: each replica group is its own ``gloo`` job (FSDP2
``fully_shard`` over its members), and the replicate dimension is the torchft ``Manager``'s
fault-tolerant all-reduce, called from FSDP's all-reduce hook; a step's update is applied
only when ``manager.should_commit()`` says every member of the group's all-reduces
succeeded, otherwise the step is thrown away and the next quorum leaves the dead group out.

Environment (set by ``bench/fsdp.py``): ``GROUP`` (replica group), ``RANK``/``WORLD_SIZE``
(inside the group), ``MASTER_ADDR``/``MASTER_PORT`` (the group's store),
``TORCHFT_LIGHTHOUSE``, ``STEPS``, ``DIM``, ``LAYERS``, ``OUT``, and the fault: ``KILL``
(this worker SIGKILLs itself mid-backward at step ``KILL_STEP``), ``FT_TIMEOUT_S`` (the
manager's collective and quorum timeout, the "tuned" knob). Writes ``OUT/<group>-<rank>.json``:
per step its wall seconds (quorum included) and whether it committed.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo


def main() -> None:
    group, rank = int(os.environ["GROUP"]), int(os.environ["RANK"])
    steps, dim, layers = int(os.environ["STEPS"]), int(os.environ["DIM"]), int(os.environ["LAYERS"])
    kill_step = int(os.environ.get("KILL_STEP", "-1")) if os.environ.get("KILL") == "1" else -1
    timeout = timedelta(seconds=float(os.environ.get("FT_TIMEOUT_S", "5")))
    dtype = torch.float64
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # start-up; the FT knob is the manager's
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, dropout=0.0,
                                                       batch_first=True, norm_first=True)
                            for _ in range(layers)]).to(dtype)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, load_state_dict=model.load_state_dict,
                      state_dict=model.state_dict, replica_id=f"group{group}", timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout, init_sync=False,
                      heartbeat_interval=timedelta(milliseconds=20))

    def all_reduce_hook(output: torch.Tensor) -> None:
        manager.allreduce(output).wait()

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
    log: list[dict] = []
    out = os.environ["OUT"]
    # every worker's manager heartbeats before the first quorum, so both groups are in it
    # (a group that joins later heals from a checkpoint of the other first: not the case measured)
    open(os.path.join(out, f"ready-{group}-{rank}"), "w").close()
    deadline = time.monotonic() + 120
    while len([n for n in os.listdir(out) if n.startswith("ready-")]) < int(os.environ["WORKERS"]):
        if time.monotonic() > deadline:
            raise SystemExit("the other workers did not start within 120 s")
        time.sleep(0.05)
    time.sleep(0.5)  # a few heartbeats (20 ms each) reach the lighthouse
    for step in range(steps):
        t0 = time.monotonic()
        manager.start_quorum()
        g = torch.Generator().manual_seed(1000 + step * 97 + group)  # a replica group's batch
        x = torch.randn(8, 16, dim, generator=g, dtype=dtype)
        y = torch.randn(8, 16, dim, generator=g, dtype=dtype)
        hook = None
        if kill_step >= 0:  # torchft's step (group 0's numbering; a healed group may skip ahead)
            manager.wait_quorum()
        if kill_step >= 0 and manager.current_step() == kill_step:  # mid-backward, as in bench/fsdp.py
            hook = model[1].register_full_backward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        committed = manager.should_commit()
        if committed:
            opt.step()
        opt.zero_grad()
        if hook is not None:
            hook.remove()
        log.append({"step": step, "ft_step": manager.current_step(), "s": time.monotonic() - t0, "committed": bool(committed),
                    "participants": manager.num_participants(),
                    "shards": [hashlib.sha256(p.to_local().detach().contiguous().numpy().tobytes()).hexdigest()
                               for p in model.parameters()]})
    with open(os.path.join(out, f"{group}-{rank}.json"), "w") as f:
        json.dump({"group": group, "rank": rank, "steps": log}, f)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
