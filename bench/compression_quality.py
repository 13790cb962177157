"""Training quality with compressed gradients: a character-level transformer, 4 workers.

    .venv/bin/python bench/compression_quality.py [--steps 600] [--seeds 3] [--kill] [--model small]
    sudo .venv/bin/python bench/compression_quality.py --cap-mb-s 100 --arms res_fp32,res_q8,res_q4,gloo_fp16 \
        --seeds 1 --steps 300 --extra-steps 60

The text is CPython's ``pydoc_data/topics.py`` (757 KB of the language reference; it
ships with every CPython — ``LICENSE.txt`` if it is missing); the last 10 % is held out.
``--model hashed`` (the default) adds a table of 65 536 hashed bigram/trigram embeddings to
the 2-layer transformer: 4.3 M parameters, 16.4 MiB of gradient per step, about the same
compute as the transformer alone — a model whose step a 100 MB/s link dominates, as in
data-parallel training on accelerators (see :func:`_model`); ``--model small`` is the
transformer alone (398 KiB per step, compute-bound on this CPU). Adam is torch's fused one.
Arms, one after the other with the same initial weights and batches: resilient fp32 (the
contributor-mean hook), resilient q8 and q4 with error feedback
(:func:`resilient.ddp.compression_hook`), and over gloo torch's PowerSGD (rank 2) and fp16
hooks. The PowerSGD arm's DDP has one bucket: torch's hook waits for its next allreduce
inside a future callback, which gloo runs on one of its two worker threads, so two
buckets' chains at once deadlock (see docs/compression.md). Every worker of every arm
``gc.freeze()``s after setup (``--no-gc-freeze``: not), and reports its seconds in the
cyclic collector (``gc_seconds``: each arm's slowest worker). Adam with a warm-up and a cosine decay of the learning rate to 5 % of its peak,
so the loss reaches a plateau at the end instead of being measured on a steep slope.
Real processes, a real etcd and coordinator; ``--kill`` SIGKILLs member 3 at mid-run,
30 % into the reduce-scatter of the step's first gradient bucket (the integer ring in
the compressed arms, the float ring in fp32: the same op of the same step in every arm).

**Noise.** Two runs of the same arm whose batches are drawn with different seeds differ
too. ``--seeds K`` runs the fp32 arm with K batch seeds and reports their spread, so a
compressed arm's deviation can be read against fp32's own; the final held-out loss is
the mean over ``--eval-windows`` fixed windows of the held-out text (every 8th
character of it a window start, up to that count).

Reported (one JSON line): ``fp32_loss`` (final held-out loss, seed 0), ``q4_loss_rel``,
``q8_loss_rel``, ``powersgd_loss_rel``, ``fp16_loss_rel`` (loss / fp32 loss - 1, same
seed), ``fp32_seed_rel`` (each other seed's fp32 loss relative to seed 0) and
``fp32_seed_spread`` (the largest |rel| of those), ``q4_within_1pct`` /
``q8_within_0_5pct`` (the issue's bounds on |rel|), ``params_identical`` (every resilient
arm: the survivors' parameters bitwise equal at the end), ``survivors`` per arm and
``time_to_fp32_loss_ratio`` (below).

**Links.** By default every worker is on 127.0.0.1 (uncapped). ``--cap-mb-s MB`` runs
every arm's 4 workers in network namespaces of one
:class:`resilient.chaos.netns.NetnsLab`, each one's egress capped by an ``htb`` root
class at MB MB/s, exactly as bench/compression.py does (the shared code is
bench/_netcap.py); etcd listens on the lab's bridge. It needs root; the namespaces,
veths, etcd and every process started are removed on the way out, by an error too.

**Time to loss.** Every ``--eval-every`` K steps (default 25) and at the last step each
worker logs (step, training seconds, held-out loss on ``--trace-windows`` fixed windows,
default 256); the seconds leave out the evaluations themselves. From rank 0's log:
``time_to_fp32_loss_ratio`` = (fp32's seconds to reach its trace loss at the end of the
``--steps`` schedule) / (q4's seconds to reach that same loss), ``..._q8`` for q8: null
when the arm never reaches it within the run. ``--extra-steps E``: *every* arm, fp32
included, trains E more steps after the schedule at its last (floor) learning rate, and
a compressed arm's hit may fall in them (its time counts every step up to the hit:
``steps_to_fp32_loss``); the quality figures (``*_loss_rel``) stay at the schedule's end. ``time_to_within_1pct_ratio`` (``..._q8``) is a separate figure: both
arms' seconds to reach 1.01 x fp32's final trace loss (the issue's 1 % bound).
``seconds_to_fp32_loss``, ``seconds_to_within_1pct`` and ``train_seconds`` give the
times behind the ratios, ``fp32_trace_loss`` the target (the trace's estimate; the
final ``fp32_loss`` uses ``--eval-windows``), ``grad_kib`` what each step allreduces.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

from resilient.launcher.lease_reaper import LeaseReaper
from resilient.process_pool import DEVNULL, PIPE, ProcessPool, Spec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import rank_worker_argparser  # noqa: E402
from _netcap import MemberLab, capped_lab  # noqa: E402
if TYPE_CHECKING:
    import torch

PY = sys.executable
WORLD = 4
CTX, BATCH = 32, 16
Trace = Sequence[Sequence[float]]   # (step, training seconds, held-out loss) points


class ArmResult(TypedDict):
    """One worker's JSON line at the end of an arm."""

    rank: int
    arm: str
    trace: list[list[float]]
    final: float
    sha: str
    gc_s: float   #: seconds this worker spent in Python's cyclic garbage collector while training


def _text() -> bytes:
    import sysconfig

    for name in ("pydoc_data/topics.py", "LICENSE.txt"):
        for base in (sysconfig.get_paths()["stdlib"], os.path.dirname(os.__file__)):
            p = Path(base) / name
            if p.exists():
                return p.read_bytes()
    return Path(os.__file__).read_bytes()  # fallback: os.py itself


#: ``--model`` choices: rows of the hashed bigram/trigram table (0: none); the default
#: is the acceptance run's configuration
MODELS = {"small": 0, "hashed": 1 << 16}
DEFAULT_MODEL = "hashed"
D_MODEL = 64
#: the PowerSGD arm's DDP bucket cap (MiB): larger than any model's gradient, so one bucket
POWERSGD_BUCKET_MB = 256


def _model(name: str = DEFAULT_MODEL) -> torch.nn.Module:
    """The character-level transformer (2 layers, d = 64, 4 heads, causal). ``"hashed"``
    adds a table of ``MODELS["hashed"]`` hashed bigram and trigram embeddings (each
    position adds the rows of its last two and three characters, as fastText-style hash
    embeddings do): 4.2 M more parameters, 16 MiB of gradient per step but almost no more
    compute, so a 100 MB/s link is this model's bottleneck as it is for real
    data-parallel training on accelerators (this CPU computes ~100x slower than one).
    ``"small"``: the transformer alone (398 KiB per step, compute-bound here)."""
    import torch

    rows = MODELS[name]

    class CharLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(256, D_MODEL)
            self.ngram = torch.nn.Embedding(rows, D_MODEL) if rows else None
            self.pos = torch.nn.Parameter(torch.zeros(CTX, D_MODEL))
            layer = torch.nn.TransformerEncoderLayer(D_MODEL, 4, 128, dropout=0.0, batch_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.out = torch.nn.Linear(D_MODEL, 256)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(CTX), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x) + self.pos
            if self.ngram is not None:
                h = h + self.ngram(_ngram_ids(x, rows)).sum(2)
            h = self.enc(h, mask=self.mask, is_causal=True)
            out: torch.Tensor = self.out(h)
            return out

    torch.manual_seed(0)
    model = CharLM()
    if model.ngram is not None:
        torch.nn.init.normal_(model.ngram.weight, std=0.02)
    return model


def _ngram_ids(x: torch.Tensor, rows: int) -> torch.Tensor:
    """(batch, ctx, 2) row ids in ``[0, rows)`` (a power of two): the hashed bigram and
    trigram ending at each position (multiplicative hashing, the top bits of the 32-bit
    product; characters before the window count as 0)."""
    import torch

    shift = 32 - (rows.bit_length() - 1)
    p1 = torch.nn.functional.pad(x, (1, 0))[:, :-1]
    p2 = torch.nn.functional.pad(x, (2, 0))[:, :-2]
    bi = ((x * 256 + p1) * 2654435761 % (1 << 32)) >> shift
    tri = ((((x * 256 + p1) * 256 + p2) + (1 << 24)) * 2246822519 % (1 << 32)) >> shift
    return torch.stack([bi, tri], 2)


def _windows(data: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    x = torch.stack([data[i:i + CTX] for i in idx]).long()
    y = torch.stack([data[i + 1:i + CTX + 1] for i in idx]).long()
    return x, y


def _batch(data: torch.Tensor, step: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    g = torch.Generator().manual_seed(step * 101 + rank + seed * 7_000_003)
    return _windows(data, torch.randint(0, len(data) - CTX - 1, (BATCH,), generator=g).tolist())


def _heldout(model: torch.nn.Module, data: torch.Tensor, windows: int) -> float:
    """Mean cross-entropy over ``windows`` fixed windows of the held-out text (starts
    every 8th character, spread over all of it)."""
    import torch

    starts = list(range(0, len(data) - CTX - 1, 8))
    step = max(1, len(starts) // windows)
    starts = starts[::step][:windows]
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(0, len(starts), 256):
            x, y = _windows(data, starts[k:k + 256])
            total += float(torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1),
                                                             reduction="sum"))
            count += y.numel()
    return total / count


def _lr(step: int, steps: int, peak: float = 3e-3, warmup: int = 20, floor: float = 0.05) -> float:
    """Linear warm-up, then cosine decay from ``peak`` to ``floor * peak`` at the last step."""
    import math

    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - 1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def worker(args: argparse.Namespace) -> int:
    import gc
    import hashlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    raw = torch.frombuffer(bytearray(_text()), dtype=torch.uint8)
    cut = int(len(raw) * 0.9)
    train, held = raw[:cut], raw[cut:]
    rank, arm = args.rank, args.arm
    arm, _, seed_s = arm.partition("@s")   # res_fp32@s1: the fp32 arm with batch seed 1
    seed = int(seed_s or 0)
    model = _model(args.model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, fused=True)   # one kernel: 2 ms, not 30, at 2.2 M
    total = args.steps + args.extra_steps   # the extra steps run at the schedule's last learning rate
    kill_step = args.steps // 2 if (args.kill and rank == WORLD - 1 and arm.startswith("res")) else None
    closers = []
    if arm.startswith("gloo"):
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname   # lo, or this namespace's veth
        dist.init_process_group("gloo", init_method=f"tcp://{args.ip0}:{args.port}", rank=rank, world_size=WORLD)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if arm == "gloo_powersgd":
            # one DDP bucket: torch's PowerSGD hook waits, inside a future callback, for
            # the next allreduce of its chain, and gloo runs callbacks on its 2 worker
            # threads; with DDP's default buckets (1 MiB first, 25 MiB after: 2 at this
            # model) both threads block in unpack_uncompressed_tensors_and_allreduce_ps
            # waiting for P allreduces that no thread is left to run (stacks dumped
            # with faulthandler) and the 4 workers hang. One bucket: one chain at a time.
            ddp = DDP(model, bucket_cap_mb=POWERSGD_BUCKET_MB)
            ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2,
                                                               start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
        else:
            ddp = DDP(model)
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        from resilient.collectives import Communicator
        from resilient.collectives.group import EtcdGroupView
        from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store
        from resilient.ddp import ContributorTracker, ErrorFeedback, compression_hook, ddp_comm_hook
        from resilient.torch_backend.communicator_engine import CommunicatorEngine
        from resilient.torch_backend.process_group import ResilientProcessGroup
        from resilient.transport.tcp import TcpTransport

        mid = f"m{rank}"
        store = Store(args.etcd)
        tr = TcpTransport(mid, args.job, host=args.ip)
        session = MemberSession.register(store, args.job, MemberInfo(member_id=mid, address=tr.address), ttl=2.0)
        print(f"LEASE {mid} {session.lease_id}", flush=True)  # the driver revokes it if we are killed
        watcher = EpochWatcher(store, args.job)
        watcher.wait_for(lambda e: len(e.members) == WORLD and mid in e.members, 60)
        comm = Communicator(EtcdGroupView(store, args.job, session, watcher), tr, op_timeout=30)
        pg = ResilientProcessGroup(CommunicatorEngine(comm, watcher, session, mid), rank, WORLD)
        ddp = DDP(model, process_group=pg, init_sync=False, forward_sync_buffers=False)
        if arm == "res_fp32":
            ddp.register_comm_hook((pg, ContributorTracker()), ddp_comm_hook)
        else:
            ef = ErrorFeedback(bits=int(arm[-1]), group=pg) if args.bucket is None else \
                ErrorFeedback(bits=int(arm[-1]), bucket=args.bucket, group=pg)
            ddp.register_comm_hook(ef, compression_hook)
        closers = [comm.close, session.close, watcher.close, tr.close, store.close]
    trace = []   # (step, training seconds so far, held-out loss on trace_windows windows)
    evals = 0.0   # seconds spent evaluating: not training time, left out of the trace's clock
    gc_s = [0.0, 0.0]   # seconds in the cyclic collector during training; the start of a collection
    if args.gc_freeze:
        # setup's objects (torch modules, the etcd/grpc clients) to the permanent generation:
        # every full collection during training would traverse them again; every arm alike
        gc.collect()
        gc.freeze()

    def _gc_clock(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            gc_s[1] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_s[1]

    gc.callbacks.append(_gc_clock)
    t0 = time.perf_counter()
    final = float("nan")
    for step in range(total):
        if kill_step is not None and step == kill_step:
            from resilient.collectives import failpoints

            # die 30 % into the reduce-scatter of this step's first bucket: its integer ring
            # (the op after the scale agreement) in the compressed arms, its ring in fp32
            first = comm.next_seq + (0 if arm == "res_fp32" else 1)
            failpoints.SPECS.append(failpoints.Spec("kill", first, "rs", 0.3))
            failpoints.ACTIVE = True
        for group in opt.param_groups:
            group["lr"] = _lr(min(step, args.steps - 1), args.steps)
        x, y = _batch(train, step, rank, seed)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]  # torch 2.13's Tensor.backward is unannotated
        opt.step()
        if step % args.eval_every == args.eval_every - 1 or step in (args.steps - 1, total - 1):
            e0 = time.perf_counter()   # the time-to-loss trace: the same windows at every point
            trace.append((step, e0 - t0 - evals, _heldout(model, held, args.trace_windows)))
            if step == args.steps - 1:   # the final loss: at the schedule's end, more windows
                final = _heldout(model, held, args.eval_windows)
            evals += time.perf_counter() - e0
    sha = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    gc.callbacks.remove(_gc_clock)
    print(json.dumps({"rank": rank, "arm": args.arm, "trace": trace, "final": final, "sha": sha,
                      "gc_s": round(gc_s[0], 3)}), flush=True)
    if arm.startswith("gloo"):
        dist.destroy_process_group()
    for c in closers:
        try:
            c()
        except Exception:  # noqa: BLE001 - leaving
            pass
    os._exit(0)


def run_arm(arm: str, etcd: str, lab: MemberLab, args: argparse.Namespace) -> list[ArmResult]:
    job = f"cq-{uuid.uuid4().hex[:8]}"
    port = 20000 + uuid.uuid4().int % 20000
    outs: list[list[str]] = [[] for _ in range(WORLD)]
    reaper = LeaseReaper(job, endpoints=etcd)   # the node agent's fast path when a worker is killed
    with ProcessPool() as pool:   # on the way out, by an error too: every process stopped by PID
        if arm.startswith("res"):
            pool.start(Spec([PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())",
                             "coordinator", "--etcd", etcd, "--job", job, "--ttl", "2", "--metrics-port", "-1",
                             "--log-level", "WARNING"], stdout=DEVNULL, stderr=DEVNULL, cwd=ROOT, name="coordinator"))
        workers = []
        for i in range(WORLD):
            cmd = [*lab.exec_prefix(i), PY, str(Path(__file__).resolve()), "--worker", "--rank", str(i),
                   "--arm", arm, "--etcd", etcd, "--job", job, "--port", str(port), "--steps", str(args.steps), "--extra-steps", str(args.extra_steps),
                   "--ip", lab.ips[i], "--ip0", lab.ips[0], "--ifname", lab.ns_veths[i],
                   "--eval-windows", str(args.eval_windows), "--eval-every", str(args.eval_every),
                   "--trace-windows", str(args.trace_windows), "--model", args.model,
                   "--gc-freeze" if args.gc_freeze else "--no-gc-freeze"] + (["--kill"] if args.kill else []) \
                + ([] if args.bucket is None else ["--bucket", str(args.bucket)])
            err = DEVNULL if not args.worker_logs else str(Path(args.worker_logs) / f"{arm}-m{i}.err")
            child = pool.start(Spec(cmd, stdout=PIPE, stderr=err, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                    name=f"m{i}"))
            reaper.watch(child, failures_only=True, lines=outs[i])
            workers.append(child)
        try:
            pool.wait(args.timeout, workers)
        finally:
            reaper.close(10)
    res = []
    for lines in outs:
        for line in lines:
            if line.startswith("{"):
                res.append(cast(ArmResult, json.loads(line)))   # our own workers' lines
    return res


def _default_bucket() -> int:
    from resilient.ddp import ErrorFeedback

    return ErrorFeedback().bucket


def _time_to(trace: Trace, target: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first trace point with held-out loss <= ``target``
    (None: never)."""
    for step, t, loss in trace:
        if loss <= target:
            return int(step), float(t)
    return None


def _ratio(a: tuple[int, float] | None, b: tuple[int, float] | None) -> float | None:
    return round(a[1] / b[1], 3) if a is not None and b is not None and b[1] else None


def time_to_loss(traces: dict[str, Trace], bound: float = 0.01, schedule_end: int | None = None) -> dict[str, object]:
    """The time-to-loss keys from each arm's trace (every point the same held-out windows).

    ``time_to_fp32_loss_ratio`` (q4; ``..._q8`` for q8): fp32's training seconds to its
    trace loss at ``schedule_end`` (the trace point of that step; None: its last point)
    over the compressed arm's seconds to reach that same loss anywhere in its trace (the
    extra steps after the schedule included) — None when the arm never gets there.
    ``time_to_within_1pct_ratio`` (``..._q8``): the same with the target ``(1 + bound)`` x
    that loss for both arms (the issue's 1 % bound), a separate figure, not a stand-in for
    the first. ``steps_to_fp32_loss``: the step of each arm's hit. Needs ``traces["res_fp32"]``."""
    fp32 = traces["res_fp32"]
    target = next((pt[2] for pt in fp32 if pt[0] == schedule_end), fp32[-1][2])
    loose = target * (1 + bound)
    hit: dict[str, tuple[int, float] | None] = {"res_fp32": _time_to(fp32, target)}
    near: dict[str, tuple[int, float] | None] = {"res_fp32": _time_to(fp32, loose)}
    ratios: dict[str, float | None] = {}
    for arm, suffix in (("res_q4", ""), ("res_q8", "_q8")):
        tr = traces.get(arm)
        hit[arm] = _time_to(tr, target) if tr else None
        near[arm] = _time_to(tr, loose) if tr else None
        ratios[f"time_to_fp32_loss_ratio{suffix}"] = _ratio(hit["res_fp32"], hit[arm])
        ratios[f"time_to_within_1pct_ratio{suffix}"] = _ratio(near["res_fp32"], near[arm])
    return {"fp32_trace_loss": round(target, 4), **ratios,
            "seconds_to_fp32_loss": {a: None if h is None else round(h[1], 2) for a, h in hit.items()},
            "steps_to_fp32_loss": {a: None if h is None else h[0] + 1 for a, h in hit.items()},
            "seconds_to_within_1pct": {a: None if h is None else round(h[1], 2) for a, h in near.items()},
            "train_seconds": {a: round(tr[-1][1], 2) for a, tr in traces.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = rank_worker_argparser(__doc__.splitlines()[0])
    ap.add_argument("--arm", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=600, help="the learning-rate schedule's steps (the quality figures: at its end)")
    ap.add_argument("--extra-steps", type=int, default=0,
                    help="E: every arm, fp32 too, trains E more steps at the schedule's last learning rate; "
                         "the time to fp32's loss (at the schedule's end) may be found in them")
    ap.add_argument("--seeds", type=int, default=3, help="fp32 runs with this many batch seeds (its own spread)")
    ap.add_argument("--ip", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--ip0", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--ifname", default="lo", help=argparse.SUPPRESS)
    ap.add_argument("--eval-windows", type=int, default=2048, help="held-out windows of the final loss")
    ap.add_argument("--eval-every", type=int, default=25, help="K: the time-to-loss trace's held-out loss every K steps")
    ap.add_argument("--trace-windows", type=int, default=256, help="held-out windows of each trace point")
    ap.add_argument("--cap-mb-s", type=float, default=0.0,
                    help="run every arm's 4 workers in network namespaces, each one's egress capped with htb "
                         "at this many MB/s (as bench/compression.py; needs root). 0: loopback, uncapped")
    ap.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL,
                    help="hashed: + 4.2 M hashed bigram/trigram embeddings (4.3 M parameters, 16.4 MiB of "
                         "gradient per step: link-bound at 100 MB/s); small: the 102 k-parameter transformer "
                         "alone (compute-bound)")
    ap.add_argument("--kill", action="store_true", help="SIGKILL member 3 mid-run in the resilient arms")
    ap.add_argument("--bucket", type=int, default=None,
                    help="elements per quantization scale in the compressed arms (default: ErrorFeedback's)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="gc.freeze() in every worker of every arm after setup (default: on; "
                         "--no-gc-freeze: the interpreter's default collector)")
    ap.add_argument("--worker-logs", default="", help="a folder: each worker's stderr appended to ARM-mI.err there")
    ap.add_argument("--arms", default="res_fp32,res_q8,res_q4,gloo_powersgd,gloo_fp16",
                    help="comma-separated subset (res_fp32 is needed as the reference)")
    args = ap.parse_args(argv)
    if args.eval_every < 1:
        ap.error("--eval-every needs K >= 1")
    if args.steps < 1 or args.extra_steps < 0:
        ap.error("--steps needs >= 1 and --extra-steps >= 0")
    if args.worker:
        return worker(args)
    from resilient.coordinator.local_etcd import LocalEtcd

    arms = args.arms.split(",") + [f"res_fp32@s{k}" for k in range(1, args.seeds)]
    got: dict[str, list[ArmResult]] = {}
    with capped_lab(WORLD, args.cap_mb_s) as lab, LocalEtcd(host=lab.host_ip) as etcd:
        for arm in arms:
            got[arm] = run_arm(arm, etcd.endpoint_arg, lab, args)
            print(json.dumps({"arm": arm, "final_loss": got[arm][0]["final"] if got[arm] else None,
                              "survivors": len(got[arm])}), file=sys.stderr, flush=True)
    final = {a: got[a][0]["final"] for a in arms if got[a]}
    fp32 = final["res_fp32"]
    identical = all(len({r["sha"] for r in got[a]}) == 1 for a in arms if a.startswith("res"))

    def rel(a: str) -> float | None:
        return round(final[a] / fp32 - 1, 4) if a in final else None

    seed_rel = [rel(f"res_fp32@s{k}") for k in range(1, args.seeds)]
    q4, q8 = rel("res_q4"), rel("res_q8")
    print(json.dumps({
        "steps": args.steps, "extra_steps": args.extra_steps, "model": args.model, "kill": args.kill, "fp32_loss": round(fp32, 4),
        "q4_loss_rel": q4, "q8_loss_rel": q8, "powersgd_loss_rel": rel("gloo_powersgd"),
        "fp16_loss_rel": rel("gloo_fp16"), "fp32_seed_rel": seed_rel,
        "fp32_seed_spread": max((abs(r) for r in seed_rel if r is not None), default=None),
        "q4_within_1pct": None if q4 is None else abs(q4) <= 0.01,
        "q8_within_0_5pct": None if q8 is None else abs(q8) <= 0.005,
        "params_identical": identical, "survivors": {a: len(got[a]) for a in arms},
        "eval_tokens": args.eval_windows * CTX, "grad_kib": sum(p.numel() for p in _model(args.model).parameters()) * 4 // 1024, "bucket": args.bucket or _default_bucket(),
        "gc_freeze": args.gc_freeze, "gc_seconds": {a: max(r.get("gc_s", 0.0) for r in got[a]) for a in arms if got[a]},
        "cap_mb_s": args.cap_mb_s or None, "eval_every": args.eval_every, "trace_windows": args.trace_windows,
        **time_to_loss({a: got[a][0]["trace"] for a in arms if got[a]}, schedule_end=args.steps - 1),
        "link": "loopback (uncapped)" if not args.cap_mb_s else f"htb {args.cap_mb_s:g} MB/s per member egress, netns"}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
