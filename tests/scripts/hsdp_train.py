"""An unchanged FSDP2/HSDP training script (the only resilient line: ``import resilient``).

Environment (the harness's, not the user's): ``BACKEND`` (resilient | gloo), ``MESH`` ("R,S"
for HSDP, "N" for plain FSDP over a 1-D mesh, where every member is its own "replica group"),
``STEPS``, ``OUT`` (a folder: rank r writes ``r.json`` — per step the sha256 of each local
shard and the loss), ``DTYPE`` (float64 | float32), ``MODEL`` (mlp | transformer), ``DIM``, ``LAYERS``; the fault, on world
rank ``KILL_RANK`` at step ``KILL_STEP``: ``KILL_PHASE`` = ``ag`` (before a layer's forward:
its peers are in that layer's all-gather), ``rs`` (mid-backward: peers in a reduce-scatter),
``ar`` (as the replicate all-reduce starts), ``optim`` (in the optimizer step), ``copy``
(plain FSDP: once its peer copy's send is posted, after the optimizer step), or
``leave`` (the reference: every member of the killed rank's replica group exits cleanly
before the step, after the others saw it leave). ``KILLS`` (``rank:step:phase,...``) gives several
such faults in one run instead (plain FSDP: a second member lost in a later step).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import resilient  # noqa: F401  - registers the backend
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    backend = os.environ.get("BACKEND", "resilient")
    dims = [int(x) for x in os.environ.get("MESH", "2,2").split(",")]
    r, s = (dims[0], 1) if len(dims) == 1 else dims  # 1-D: plain FSDP, a batch per member
    steps = int(os.environ.get("STEPS", "4"))
    dtype = getattr(torch, os.environ.get("DTYPE", "float64"))
    dim, layers = int(os.environ.get("DIM", "16")), int(os.environ.get("LAYERS", "3"))
    kills = [(int(k), int(t), ph) for k, t, ph in (x.split(":") for x in os.environ.get("KILLS", "").split(",") if x)]
    if not kills and int(os.environ.get("KILL_RANK", "-1")) >= 0:
        kills = [(int(os.environ["KILL_RANK"]), int(os.environ.get("KILL_STEP", "-1")),
                  os.environ.get("KILL_PHASE", "rs"))]
    dist.init_process_group(backend)
    rank = dist.get_rank()
    mesh = (init_device_mesh("cpu", (r,)) if len(dims) == 1
            else init_device_mesh("cpu", (r, s), mesh_dim_names=("replicate", "shard")))
    torch.manual_seed(0)
    transformer = os.environ.get("MODEL", "mlp") == "transformer"
    if transformer:  # a small transformer: pre-norm encoder blocks, no dropout (deterministic)
        model = nn.Sequential(*[nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, dropout=0.0,
                                                           batch_first=True, norm_first=True)
                                for _ in range(layers)]).to(dtype)
    else:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)]).to(dtype)
    shape = (8, 16, dim) if transformer else (8, dim)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    row = rank // s
    log: list[dict] = []
    out = os.environ["OUT"]
    t_start = time.monotonic()
    for step in range(steps):
        leaving = [k for k, t, ph in kills if t == step and ph == "leave"]
        if any(row == k // s for k in leaving):
            _write(out, rank, log, t_start, finished=False)
            from resilient.script_exit import deliberate

            deliberate("the reference run's replica group leaves")  # the launcher counts it as done
            os._exit(0)
        if leaving:  # the reference: wait until the leavers are gone
            want = r * s - s * len([1 for _, t, ph in kills if t <= step and ph == "leave"])
            deadline = time.monotonic() + 60
            while resilient.world().size > want and time.monotonic() < deadline:  # the live count
                time.sleep(0.01)
        g = torch.Generator().manual_seed(1000 + step * 97 + row)  # a replica group's batch
        x = torch.randn(*shape, generator=g, dtype=dtype)
        y = torch.randn(*shape, generator=g, dtype=dtype)
        hooks = []
        for k, t, ph in kills:
            if t == step and k == rank and ph != "leave":
                hooks = _arm(model, opt, ph)
        t0 = time.monotonic()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        for h in hooks:
            h.remove()
        log.append({"step": step, "loss": float(loss.detach()), "s": time.monotonic() - t0,
                    "world": resilient.world().size if backend == "resilient" else dist.get_world_size(),
                    "shards": [hashlib.sha256(p.to_local().detach().contiguous().numpy().tobytes()).hexdigest()
                               for p in model.parameters()]})
    _write(out, rank, log, t_start, finished=True)
    dist.destroy_process_group()


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(model: nn.Module, opt: torch.optim.Optimizer, phase: str) -> list:
    if phase == "ag":
        return [model[1].register_forward_pre_hook(lambda *_: _die(), prepend=True)]
    if phase == "rs":  # mid-backward: layer 1's gradient arrives after the last layer's reduce
        return [model[1].register_full_backward_pre_hook(lambda *_: _die())]
    if phase == "optim":
        return [opt.register_step_pre_hook(lambda *_: _die())]
    if phase == "copy":  # the failpoint fires in the backend's copy refresh of this step
        from resilient.collectives import failpoints
        from resilient.fsdp.plain import PLAIN

        failpoints.SPECS[:] = failpoints.parse(f"kill@op={PLAIN.steps},phase=peer_copy,frac=1")
        failpoints.ACTIVE = True
        return []
    if phase == "ar":
        original = dist.all_reduce

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001
            if group is not None and dist.get_world_size(group) > 1 and tensor.dtype.is_floating_point:
                _die()
            return original(tensor, op=op, group=group, async_op=async_op)
        dist.all_reduce = all_reduce

        class _Undo:
            def remove(self) -> None:
                dist.all_reduce = original
        return [_Undo()]
    raise SystemExit(f"unknown KILL_PHASE {phase!r}")


def _write(out: str, rank: int, log: list, t_start: float, finished: bool) -> None:
    from resilient.fsdp.plain import PLAIN  # plain FSDP's own figures (bench/fsdp.py reads them)

    extra = {"copy_s": PLAIN.copy_s, "steps_redone": PLAIN.steps_redone} if PLAIN.pg is not None else {}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"rank": rank, "finished": finished, "total_s": time.monotonic() - t_start, "steps": log, **extra}, f)
    print(f"rank {rank} {'finished' if finished else 'left'} after {len(log)} steps", flush=True)


if __name__ == "__main__":
    main()
