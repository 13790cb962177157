"""A small elastic DDP training job: a 2-layer MLP fitting a synthetic regression target.

Run it like any torchrun script::

    resilient-run --standalone --nproc-per-node 4 examples/train.py --steps 60
    torchrun --standalone --nproc-per-node 4 examples/train.py --backend gloo --checkpoint /tmp/ck.pt

On the ``resilient`` backend (the default) it uses ``resilient.elastic.State`` (model,
optimizer, elastic sampler, step): ``state.sync()`` at every step boundary syncs joiners
and re-shards the sampler on membership changes; the model is a plain
``DistributedDataParallel(model)``: over the resilient backend its gradients are averaged
over the members that actually contributed without a hook of ours (``docs/ddp.md``), and
``resilient.ddp.contributors(ddp)`` is the step's member set. Each step prints one JSON line
``{"step", "loss", "rank", "world", "epoch", "contributors", "params_sha"}`` (also to
``--log FILE``), ``params_sha`` being a digest of the parameters' bytes after the step,
so identical replicas are checkable. With ``--backend gloo`` it is a plain torchrun
script that checkpoints every step to ``--checkpoint`` and resumes from it on restart
(what torchrun users must do).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

N_SAMPLES, BATCH, DIM = 4096, 16, 32


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(N_SAMPLES, 1, generator=g)


def params_sha(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--backend", default="resilient", choices=["resilient", "gloo"])
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--log", default="", help="also append the JSON lines to this file")
    ap.add_argument("--log-dir", default="", help="also write the JSON lines to <dir>/<pid>.jsonl")
    ap.add_argument("--checkpoint", default="", help="gloo only: checkpoint file (saved every step)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per step")
    ap.add_argument("--min-final-world", type=int, default=0,
                    help="keep training past --steps until a step has run with this many members again "
                         "(tests/demo: let a restarted worker rejoin before the end)")
    ap.add_argument("--exit-at-step", type=int, default=-1,
                    help="the worker launched with RANK=--exit-rank exits (code 17) at that step, first incarnation only")
    ap.add_argument("--exit-rank", type=int, default=-1)
    args = ap.parse_args(argv)

    import resilient  # noqa: F401 - registers the backend
    from resilient.ddp import contributors as step_contributors
    from resilient.elastic import ElasticSampler, State, TrainingFinished

    t_init = time.time()
    dist.init_process_group(args.backend)
    t_init_done = time.time()
    torch.manual_seed(int(os.environ.get("RANK", "0")))  # different inits: sync() aligns them
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x, y = dataset()
    log_path = args.log or (os.path.join(args.log_dir, f"{os.getpid()}.jsonl") if args.log_dir else "")
    log = open(log_path, "a") if log_path else None  # noqa: SIM115
    start_step = 0
    if args.backend == "resilient":
        ddp = DDP(model)  # exact over the contributors on the resilient backend; no hook needed
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        sampler = ElasticSampler(N_SAMPLES, BATCH, rank=dist.get_rank(), world_size=dist.get_world_size(), seed=7)
        state = State(model=model, optimizer=opt, sampler=sampler, step=0, last_world=0)

        @state.on_membership_change
        def _reshard(world) -> None:
            sampler.set_world(world.rank, world.size)
    else:
        ddp = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        if args.checkpoint and os.path.exists(args.checkpoint):
            ck = torch.load(args.checkpoint, weights_only=True)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            start_step = int(ck["step"])

    step = start_step
    while True:
        if args.backend == "resilient":
            received = state.syncs_received
            t_sync = time.time()
            try:
                changed = state.sync()
            except TrainingFinished as exc:  # restarted after the others were done
                print(f"[train] {exc}", flush=True)
                break
            step = state.step
            if changed and step > 0:  # the world changed or a joiner got the live state
                ev = {"event": "synced" if state.syncs_received != received else "world_changed", "step": step,
                      "params_sha": params_sha(model), "pid": os.getpid(), "t_sync_start": t_sync,
                      "sync_phases": {k: round(v, 4) for k, v in state.last_sync.items()},
                      "init_s": round(t_init_done - t_init, 3), "t_init_done": t_init_done,
                      "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "t": time.time()}
                print(json.dumps(ev), flush=True)
                if log:
                    log.write(json.dumps(ev) + "\n")
                    log.flush()
            if step >= args.steps and state.last_world >= args.min_final_world:
                break
            from resilient.live_world import world

            w = world()
            members_at_start = w.members
            sampler.set_world(w.rank, w.size) if (sampler.rank, sampler.world_size) != (w.rank, w.size) else None
            idx = sampler.step_indices()
        else:
            if step >= args.steps:
                break
            r, n = dist.get_rank(), dist.get_world_size()
            g = torch.Generator().manual_seed(step)
            perm = torch.randperm(N_SAMPLES, generator=g)[: n * BATCH]
            idx = perm[r * BATCH:(r + 1) * BATCH].tolist()
        if (step == args.exit_at_step and int(os.environ.get("RANK", "-1")) == args.exit_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            ev = {"event": "exit", "step": step, "pid": os.getpid(), "t": time.time(), "restart": 0}
            print(json.dumps(ev), flush=True)
            if log:
                log.write(json.dumps(ev) + "\n")
                log.flush()
            os._exit(17)  # a worker failure at a known step (used by bench/restart_vs_resume.py)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        opt.zero_grad()
        if idx:
            loss = torch.nn.functional.mse_loss(ddp(x[idx]), y[idx])
        else:  # nothing left for this rank in the plan: contribute zero gradients
            loss = (ddp(x[:1]) * 0).sum()
        loss.backward()
        opt.step()
        record = {"step": step, "loss": round(loss.item(), 6), "rank": dist.get_rank(), "world": dist.get_world_size(),
                  "params_sha": params_sha(model), "t": time.time(), "pid": os.getpid(),
                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        if args.backend == "resilient":
            contributors = step_contributors(ddp)
            ranks = [i for i, m in enumerate(members_at_start) if m in contributors]
            if sampler.world_size == len(members_at_start):
                sampler.record_step(ranks)
            if sampler.steps_left == 0:
                sampler.set_epoch(sampler.epoch + 1)
            state.step = step + 1
            state.last_world = len(members_at_start)  # synced like the rest: every member decides alike
            state.commit()
            record.update(epoch=w.epoch, member=w.member_id, contributors=sorted(contributors))
        else:
            step += 1
            if args.checkpoint and dist.get_rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                           args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            dist.barrier()
        line = json.dumps(record)
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()
    if args.backend == "resilient":
        state.finish()
    dist.destroy_process_group()
    if log:  # when this worker was done (bench/restart_vs_resume.py: did the job wait for a late joiner?)
        log.write(json.dumps({"event": "done", "pid": os.getpid(), "t": time.time(),
                              "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}) + "\n")
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
