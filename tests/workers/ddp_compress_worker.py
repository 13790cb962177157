"""One process of tests/test_compression_ddp_procs.py: elastic DDP training with the
compression hook (q4, error feedback) over the resilient backend.

    python tests/workers/ddp_compress_worker.py RANK WORLD DIR
    RESILIENT_JOINER=1 python tests/workers/ddp_compress_worker.py RANK WORLD DIR   # a restarted rank

A joiner waits for ``DIR/go`` before ``init_process_group`` (the test starts it early, so
its imports are done when the victim dies).

A 2-layer MLP, the same initial parameters everywhere, ``State(model, optimizer, ef)`` with
``sync()`` at every step boundary, SGD (lr 0.1, no momentum). Member ``m``'s batch at step
``s`` is a function of ``(m, s)``. Before each bucket's allreduce the hook's input
``x = grad + residual`` is written to ``DIR/x_<member>_<step>_<bucket>.bin`` (raw float32,
renamed into place: a file exists whole or not at all, and it exists before the op can
include the member). After each step one JSON line goes to ``DIR/<member>.jsonl``: the
step, the live world, the bucket's contributors, the agreed scales and layout, the
bucket's result, the parameter gradients in bucket order, the parameters after the step
(hex of the float32 bytes) and how many residuals the member had when the step began.
``DIR/member_<RANK>`` (``DIR/member_joiner``) holds the member id.

Training runs until the world has shrunk below WORLD and then run 4 steps at WORLD again
(a joiner trained with the survivors), or ``EF_STEPS`` steps (default 1500); the survivors
then write ``DIR/<member>.done``. Every ``State`` field is synced to a joiner, so the stop
is agreed.

``EF_MODE`` (tests/test_compression_ddp_modes_procs.py): ``adaptive`` —
``ErrorFeedback(adaptive=True)`` with a threshold (0.01) this model's q4 noise exceeds, so
the bits go 4 -> 8; ``auto`` — ``switch="auto"`` with a switch that probes q4 whatever the
link model says and picks it on any measured speedup (``margin=0``), votes every 3 calls
and probes fp32 again after 4, so training goes through both arms; its decisions are logged
(the switch's INFO lines on stderr). Each record then also holds whether the step's op ran
compressed, the switch's choice and the bits error feedback chose for the next step.
"""
import json
import os
import sys
import time
import zlib
from typing import Any
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient  # noqa: F401 - registers the backend
from resilient.ddp import ErrorFeedback, compression_hook
from resilient.elastic import State
from resilient.torch_backend import current_engine

RANK, WORLD, DIR = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
LR, MAX_STEPS = 0.1, int(os.environ.get("EF_STEPS", "1500"))
MODE = os.environ.get("EF_MODE", "")


# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects


def hexof(t: torch.Tensor) -> str:
    return t.detach().reshape(-1).contiguous().numpy().tobytes().hex()


def batch(member: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{member}/{step}".encode()))
    x = torch.randn(16, 16, generator=g)
    return x, x[:, :1].tanh()


def main() -> None:
    torch.set_num_threads(1)
    if os.environ.get("RESILIENT_JOINER") == "1":   # started early (imports done): join once told to
        deadline = time.monotonic() + 120
        while not (DIR / "go").exists():
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.02)
    dist.init_process_group("resilient", init_method=f"file://{DIR / f'init{os.getpid()}'}", rank=RANK,
                            world_size=WORLD)
    engine = current_engine()
    me = engine.member_id
    print(f"LEASE {me} {engine.session.lease_id}", flush=True)
    (DIR / ("member_joiner" if os.environ.get("RESILIENT_JOINER") == "1" else f"member_{RANK}")).write_text(me)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ddp = DDP(model)
    ef = ErrorFeedback(bits=4, bucket=64, min_numel=256, adaptive=MODE == "adaptive",
                       adaptive_threshold=0.01 if MODE == "adaptive" else 0.5,
                       switch="auto" if MODE == "auto" else None)
    if MODE == "auto":
        import logging

        from resilient.collectives.compression_switch import CompressionSwitch

        logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
        logging.getLogger("resilient.collectives.compression_switch").setLevel(logging.INFO)
        engine_comm().compression_switch = CompressionSwitch(margin=0.0, skip_below=0.0, revote_every=3,
                                                             probe_every=4, codec_s_per_byte={4: (0.0, 0.0)})
    step_box = [0]
    order: dict[str, list[int]] = {}

    def hook(state: ErrorFeedback, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        key = str(bucket.index())
        order[key] = [index[id(p)] for p in bucket.parameters()]
        x = state.input_for(key, bucket.buffer())
        path = DIR / f"x_{me}_{step_box[0]}_{key}.bin"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(x.numpy().tobytes())
        os.replace(tmp, path)
        return compression_hook(state, bucket)

    ddp.register_comm_hook(ef, hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = State(model=model, optimizer=opt, ef=ef, step=0, shrunk=0, regrown=0)
    log = open(DIR / f"{me}.jsonl", "a")  # noqa: SIM115
    while True:
        received = state.syncs_received
        state.sync()
        n = dist.get_world_size()
        if n < WORLD:
            state.shrunk = 1
        elif state.shrunk:
            state.regrown += 1
        if state.regrown > 4 or state.step >= MAX_STEPS:
            break
        step = step_box[0] = state.step
        res_n = len(ef.residuals)
        pre = hexof(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        opt.zero_grad()
        x, y = batch(me, step)
        before = engine_comm().last_compression
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        info = engine_comm().last_compression
        grads = [p.grad.reshape(-1) for p in model.parameters()]
        sw = engine_comm().compression_switch
        rec = {"step": step, "member": me, "world": n, "synced": state.syncs_received != received,
               "res_n": res_n, "pre": pre, "C": sorted(ef.tracker.step_contributors()),
               "buckets": {k: {"order": o, "grads": hexof(torch.cat([grads[i] for i in o]))} for k, o in order.items()},
               "compressed": info is not None and info is not before, "choice": sw.last_choice if sw else None,
               "next_bits": dict(ef.bucket_bits)}
        if info is not None:   # the last compressed op's (this step's when "compressed")
            rec.update({"scale_C": sorted(info["scale_contributors"]), "scales": hexof(info["scales"]),
                        "nb": info["members_bound"], "segs": [[s.start, s.end, s.bits] for s in info["segments"]],
                        "bucket": info["bucket"]})
        ef.tracker.reset()
        opt.step()
        rec["params"] = hexof(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        log.write(json.dumps(rec) + "\n")
        log.flush()
        state.step = step + 1
        state.commit()
        time.sleep(0.03)
    log.close()
    (DIR / f"{me}.done").touch()
    state.finish()
    dist.destroy_process_group()


def engine_comm() -> Any:
    """The engine's Communicator now (a new one after an admission rebuild)."""
    comm = current_engine().comm
    assert comm is not None
    return comm


if __name__ == "__main__":
    main()
