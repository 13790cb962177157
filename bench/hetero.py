"""Uneven members: speed-weighted batch shares vs uniform batches vs leaving the slow one out.

    python bench/hetero.py [--world 4] [--slow m3] [--slowdown 2] [--steps 12] [--global-batch 56]

A fresh real etcd, coordinator and ``--world`` member processes training one small linear
model with ``DistributedDataParallel`` over the resilient process group
(:func:`resilient.ddp.weighted_ddp_comm_hook`) on an :class:`~resilient.elastic.ElasticSampler`.
Per-sample device time is modelled with a sleep of ``--t-sample`` s per sample (4 ms by
default), times ``--slowdown`` on member ``--slow`` (so the run measures the batch split, not
this machine's shared CPU: at 2 ms per sample the members' own ~3.5 ms of host CPU per step,
four processes on two cores, is a quarter of the modelled step; docs/hetero.md). Phases, ``--steps`` global steps each, in one job:

* ``uniform``: ``global_batch / world`` samples each (what a member slow per sample gets
  today; ``--straggler-policy demote`` moves it to a leaf of the collective but leaves its
  compute, so *demote* is measured by this phase: docs/straggler.md, "no gain for a member
  that is late rather than slow");
* ``weighted``: each member wrote its measured samples/s of the uniform phase
  (``rates/<member>``); the coordinator leader published ``shares`` (hysteresis,
  ``resilient.coordinator.shares``); rank 0 reads the record and broadcasts it, so every
  member applies the same sizes (``ElasticSampler.follow_shares``);
* ``evict``: the slow member gets 0 samples, the others split the batch (what eviction
  delivers at best; the member stays in the allreduce with a count of 0).

Every step, every member reports its gradient after the hook, the parameters before the
step and its sample indices; the driver recomputes the gradient of the contributors'
samples in one process and reports the largest difference (``grad_max_abs_err``). One
JSON line: samples/s per phase, ``ratio_vs_uniform`` (= ``ratio_vs_demote``, see above),
``ratio_vs_evict``, the published shares and sizes, ``grad_max_abs_err``, ``exactly_once``.

``--kill-step K`` SIGKILLs member ``--victim`` in the middle of step K's allreduce
(failpoint) and ``--stop-step`` SIGSTOPs it there instead (the tests use both): the
survivors' steps stay exact over their contributors and every sample of the data epoch is
processed exactly once.
Failure behaviour: a member that raises or hangs makes the run fail with its stderr.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import BenchCluster, emit, join, wait_go, worker_argparser  # noqa: E402

PHASES = ("uniform", "weighted", "evict")
DIM = 8
LR = 0.01


def dataset(n: int, width: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    # float64: the gradient check is about the weighting, not float32 rounding
    x = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    y = x @ torch.randn(DIM, width, generator=g, dtype=torch.float64) + 0.1 * torch.randn(
        n, width, generator=g, dtype=torch.float64)
    return x, y


def make_model(width: int):
    """The same initial parameters in every process (seeded)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(DIM, width, dtype=torch.float64)


def loss_of(model, x, y):
    pred = model(x)
    return ((pred - y) ** 2).sum() / max(len(x), 1)  # local mean (0 for no samples)


def worker(args) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from resilient.coordinator import shares as sh
    from resilient.ddp import SampleCount, make_weighted
    from resilient.elastic import ElasticSampler
    from resilient.errors import RemovedFromGroup
    from resilient.torch_backend.communicator_engine import CommunicatorEngine
    from resilient.torch_backend.process_group import ResilientProcessGroup

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1)  # the driver asks for stacks when a member hangs
    if os.environ.get("HETERO_OWN_LEASE"):
        # the member to be SIGSTOPped keeps a lease of its own (5 s): while it is stopped
        # nobody renews it, so it expires and the coordinator removes the member
        args.lease_id = None
    comm, transport, session, _ = join(args, op_timeout=30.0)
    store, watcher = comm.view.store, comm.view.watcher
    engine = CommunicatorEngine(comm, watcher, session, args.id)
    world = engine.world()
    pg = ResilientProcessGroup(engine, world.rank, world.size)
    model = make_model(args.width)
    ddp = DDP(model, process_group=pg, init_sync=False, forward_sync_buffers=False)
    state = SampleCount(pg)
    make_weighted(ddp, state)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x_all, y_all = dataset(args.samples, args.width)
    bs = args.global_batch // args.world
    sampler = ElasticSampler(args.samples, bs, world.rank, world.size, shuffle=True, seed=7)
    slow = args.slowdown if args.id == args.slow else 1.0
    emit("ready")
    wait_go()
    comm.barrier()                                                    # op 0
    shares_used: dict | None = None

    def apply_phase(phase: str, members: tuple[str, ...]) -> None:
        nonlocal shares_used
        if phase == "uniform":
            sampler.set_batch_sizes(None)
        elif phase == "weighted":
            # rank 0's copy of the published record, broadcast: every member the same sizes
            vec = torch.zeros(len(members), dtype=torch.float64)
            if members.index(args.id) == 0:
                rec = wait_shares(store, args.job, members)
                vec = torch.tensor([rec["members"].get(m, 0.0) for m in members], dtype=torch.float64)
            comm.broadcast(vec, root=0)
            shares_used = {m: float(v) for m, v in zip(members, vec.tolist())}
            sampler.follow_shares(shares_used, members, args.global_batch)
        else:  # evict: the slow member's share 0
            rest = [m for m in members if m != args.slow]
            sizes = dict(zip(rest, sh.batch_sizes({m: 1.0 for m in rest}, rest, args.global_batch)))
            sampler.set_batch_sizes([sizes.get(m, 0) for m in members])

    members = world.members
    phase_of = [p for p in PHASES for _ in range(args.steps)]
    rate_n, rate_s = 0, 0.0
    grads = grad_rows(args, sum(p.numel() for p in model.parameters()), len(phase_of), "w+")
    try:
        for step, phase in enumerate(phase_of):
            if step == 0 or phase != phase_of[step - 1]:
                if phase == "weighted":
                    sh.write_rate(store, args.job, args.id, rate_n / rate_s, session.lease_id)
                    comm.barrier()   # every rate is written before rank 0 waits for the shares
                apply_phase(phase, members)
            idx = sampler.step_indices()
            state.set(len(idx))
            emit("batch", step=step, idx=idx)   # before the allreduce: a victim killed in it still told its samples
            t0 = time.time()
            time.sleep(len(idx) * args.t_sample * slow)              # the device's per-sample time
            loss = loss_of(ddp, x_all[idx], y_all[idx])
            t_compute = time.time() - t0                              # this member's own work only
            loss.backward()                                           # the hook's allreduce
            t1 = time.time()
            if phase == "uniform" and step > 0:
                rate_n, rate_s = rate_n + len(idx), rate_s + t_compute
            contributors = sorted(state.tracker.step_contributors())
            state.tracker.reset()
            # the gradient goes to row ``step`` of a file mapped shared (raw float64: too big
            # for the report line): a copy into the page cache, no write() in the timed
            # region, and a member SIGKILLed later still leaves its earlier rows
            torch.cat([p.grad.reshape(-1) for p in model.parameters()], out=grads[step])
            emit("step", step=step, phase=phase, idx=idx, members=list(members), contributors=contributors,
                 total=state.last_total, t0=t0, t1=t1, sizes=sampler.sizes())
            sampler.record_step([members.index(m) for m in contributors])
            opt.step()
            opt.zero_grad()
            # A member left: re-shard the rest at this boundary. Decided from the step's
            # contributor set, which every member's hook reports identically — not from
            # engine.world(), which follows each process's own etcd watch: a member that
            # finished the step's allreduce before the epoch without the victim was
            # published would still see the old world, skip the broadcast below and call
            # the next step's allreduce while the others broadcast (different ops: they
            # never exchange a byte, so nobody sees a mismatch and both sides wait).
            if set(contributors) != set(members):
                members = tuple(m for m in members if m in contributors)
                sampler.set_world(members.index(args.id), len(members))
                apply_phase(phase, members)
    except Exception as exc:  # noqa: BLE001 - DDP may wrap the hook's error
        if not isinstance(exc, RemovedFromGroup) and "RemovedFromGroup" not in f"{type(exc).__name__} {exc}" \
                and "is not in epoch" not in str(exc):
            raise
        emit("removed", error=f"{type(exc).__name__}: {exc}"[:500])
        os._exit(0)
    emit("done", processed=sampler.processed, shares=shares_used)
    wait_go()
    comm.close()
    session.close(revoke=True, reason="bench done")
    transport.close()


def wait_shares(store, job: str, members: tuple[str, ...], timeout: float = 30.0) -> dict:
    """The ``shares`` record once it reflects every member's current rate (the publisher
    would not change it: within hysteresis). Raises TimeoutError naming what is missing."""
    from resilient.coordinator import shares as sh

    deadline = time.monotonic() + timeout
    rec = None
    while time.monotonic() < deadline:
        rates = sh.read_rates(store, job)
        rec = sh.read_shares(store, job)
        if rec is not None and all(m in rates for m in members) and sorted(rec["members"]) == sorted(members) \
                and sh.compute_shares(rates, members, rec["members"]) is None:
            return rec
        time.sleep(0.05)
    raise TimeoutError(f"no shares record for {list(members)} within {timeout}s (last: {rec}); is the coordinator up?")


def grad_rows(args, numel: int, steps: int, mode: str):
    """Member ``args.id``'s (or, reading, ``args.grad_of``'s) gradients, one float64 row
    per step, in a file of ``args.out_dir`` mapped shared (``mode`` ``w+`` creates it)."""
    import numpy as np
    import torch

    mid = args.id if mode == "w+" else args.grad_of
    mm = np.memmap(os.path.join(args.out_dir, f"{mid}.grad"), dtype=np.float64, mode=mode, shape=(steps, numel))
    return torch.from_numpy(mm)


def reference_grad(model, idx: list[int], x_all, y_all):
    """The gradient of the mean loss over ``idx`` at ``model``'s parameters, in one process."""
    import torch

    model.zero_grad()
    loss_of(model, x_all[idx], y_all[idx]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def run(args) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="resilient-hetero-") as out_dir:
        args.out_dir = out_dir
        return _run(args)


def _run(args) -> dict:
    victim_env = None
    if args.kill_step is not None or args.stop_step is not None:
        k = args.kill_step if args.kill_step is not None else args.stop_step
        action = "kill" if args.kill_step is not None else "stop"
        # op 0 barrier, one allreduce per step; the weighted phase adds a barrier and a broadcast
        op = 1 + k + (2 if k >= args.steps else 0)
        victim_env = {"RESILIENT_FAILPOINTS": f"{action}@op={op},phase={args.fail_phase},frac=0.5"}
        if action == "stop":
            victim_env["HETERO_OWN_LEASE"] = "1"
    env_for = (lambda mid: victim_env if victim_env and mid == args.victim else {})
    with BenchCluster(os.path.abspath(__file__), args.world, job="bench-hetero", ttl=args.ttl,
                      worker_args=["--slow", args.slow, "--slowdown", str(args.slowdown), "--steps", str(args.steps),
                                   "--global-batch", str(args.global_batch), "--samples", str(args.samples),
                                   "--t-sample", str(args.t_sample), "--width", str(args.width),
                                   "--out-dir", args.out_dir], env_for=env_for) as cl:
        for m in cl.procs:
            cl.watch_exit(m)
        everyone = sorted(cl.procs)
        cl.send(everyone, "go")
        steps: dict[str, list[dict]] = {m: [] for m in everyone}
        batches: dict[tuple[int, str], list[int]] = {}
        finished: dict[str, dict] = {}
        total_steps = len(PHASES) * args.steps
        faulty = args.kill_step is not None or args.stop_step is not None
        order = [m for m in everyone if not (faulty and m == args.victim)] + ([args.victim] if faulty else [])
        for m in order:
            if m == args.victim and args.stop_step is not None:
                # the survivors finished without it (its lease expired while stopped): let it see that
                cl.procs[m].send_signal(signal.SIGCONT)
            while True:
                ev = next_event(cl, m, timeout=args.event_timeout)
                if ev is None:   # EOF: only the victim of --kill-step may end like that
                    if m != args.victim or args.kill_step is None:
                        raise SystemExit(f"member {m} exited early: {cl.stderr_tail(m)}")
                    break
                if ev["event"] == "batch":
                    batches[(ev["step"], m)] = ev["idx"]
                elif ev["event"] == "step":
                    steps[m].append(ev)
                elif ev["event"] in ("done", "removed"):
                    finished[m] = ev
                    break
        cl.send([m for m, f in finished.items() if f["event"] == "done"], "quit")
        return summarize(args, steps, finished, total_steps, batches)


def next_event(cl: BenchCluster, mid: str, timeout: float) -> dict | None:
    """The next JSON line of ``mid`` (None at EOF). Raises SystemExit on a timeout or a
    line that is not JSON, with the member's stderr."""
    import threading

    out: list[str] = []
    th = threading.Thread(target=lambda: out.append(cl.procs[mid].stdout.readline()), daemon=True)
    th.start()
    th.join(timeout)
    if not out:
        for m, p in cl.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        tails = "\n".join(f"--- {m} (exit {cl.procs[m].poll()}):\n{cl.stderr_tail(m, 12000)}" for m in sorted(cl.procs))
        raise SystemExit(f"member {mid} sent nothing within {timeout}s:\n{tails}")
    if not out[0]:
        return None
    try:
        return json.loads(out[0])
    except ValueError:
        raise SystemExit(f"member {mid} printed {out[0]!r}: {cl.stderr_tail(mid)}") from None


def summarize(args, steps: dict[str, list[dict]], finished: dict[str, dict], total_steps: int,
              batches: dict[tuple[int, str], list[int]]) -> dict:
    """Check every step against one process: the reference model takes the same SGD steps
    with the reference gradients (the members' differ from them by rounding only)."""
    import torch

    x_all, y_all = dataset(args.samples, args.width)
    ref_model = make_model(args.width)
    by_step: dict[int, dict[str, dict]] = {}
    for m, evs in steps.items():
        for ev in evs:
            by_step.setdefault(ev["step"], {})[m] = ev
    err = 0.0
    rows: dict[str, torch.Tensor] = {}
    short: dict[str, list[str]] = {}
    processed: list[int] = []
    span: dict[str, list[float]] = {}
    samples: dict[str, int] = {}
    sizes: dict[str, list[int]] = {}
    for s in sorted(by_step):
        evs = by_step[s]
        contributors = next(iter(evs.values()))["contributors"]
        if any(ev["contributors"] != contributors for ev in evs.values()):
            raise AssertionError(f"step {s}: members disagree on the contributors: {evs}")
        # a contributor that died after its gradient was in (the victim) reported its batch only
        idx = ([i for m in contributors for i in batches[(s, m)]]
               if all((s, m) in batches for m in contributors) else None)
        if idx is None:
            raise AssertionError(f"step {s}: a contributor did not report its samples")
        processed.extend(idx)
        missing = sorted(set(next(iter(evs.values()))["members"]) - set(contributors))
        if missing:
            short[str(s)] = missing
        ref = reference_grad(ref_model, idx, x_all, y_all)
        for m in evs:
            if m not in rows:
                args.grad_of = m
                rows[m] = grad_rows(args, ref.numel(), total_steps, "c")
            got = rows[m][s]
            err = max(err, float((got - ref).abs().max()))
        with torch.no_grad():
            for p in ref_model.parameters():
                p -= LR * p.grad
        phase = next(iter(evs.values()))["phase"]
        t0, t1 = min(ev["t0"] for ev in evs.values()), max(ev["t1"] for ev in evs.values())
        if s % args.steps >= 1:   # the first step of each phase is its warm-up
            sp = span.setdefault(phase, [t0, t1])
            sp[0], sp[1] = min(sp[0], t0), max(sp[1], t1)
            samples[phase] = samples.get(phase, 0) + len(idx)
        sizes.setdefault(phase, next(iter(evs.values()))["sizes"])
    rate = {p: samples[p] / (span[p][1] - span[p][0]) for p in span if span[p][1] > span[p][0]}
    shares = next((f.get("shares") for f in finished.values() if f.get("shares")), None)
    out = {
        "samples_per_s": {p: round(v, 2) for p, v in rate.items()},
        "ratio_vs_uniform": round(rate["weighted"] / rate["uniform"], 3) if "weighted" in rate and "uniform" in rate else None,
        "ratio_vs_evict": round(rate["weighted"] / rate["evict"], 3) if "weighted" in rate and "evict" in rate else None,
        "shares": {m: round(v, 4) for m, v in shares.items()} if shares else None,
        "sizes": sizes,
        "grad_max_abs_err": err,
        "steps_checked": len(by_step),
        "exactly_once": len(processed) == len(set(processed)),
        "processed": len(processed),
        "steps_without": short,
        "removed": sorted(m for m, f in finished.items() if f["event"] == "removed"),
        "world": args.world, "slow": args.slow, "slowdown": args.slowdown, "global_batch": args.global_batch,
        "t_sample": args.t_sample, "steps_per_phase": args.steps,
    }
    out["ratio_vs_demote"] = out["ratio_vs_uniform"]
    return out


def main() -> None:
    ap = worker_argparser(__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--slow", default="m3", help="the member that is slower per sample")
    ap.add_argument("--slowdown", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=12, help="global steps per phase")
    ap.add_argument("--global-batch", type=int, default=56)
    ap.add_argument("--samples", type=int, default=4096, help="samples in the data epoch")
    ap.add_argument("--t-sample", type=float, default=0.004,
                    help="modelled device seconds per sample (default 4 ms: a 56 ms uniform step; at 2 ms the "
                         "members' own ~3.5 ms of host CPU per step, four processes on this 2-core machine, "
                         "is a quarter of the modelled step and the ratio measures the shared CPU)")
    ap.add_argument("--width", type=int, default=1200,
                    help="model outputs: (8+1)*width float64 gradients, > 64 KiB so the ring (not recursive doubling) runs")
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--fail-phase", default="rs",
                    help="failpoint phase of --kill-step/--stop-step (rd with a --width below ~900: recursive doubling)")
    ap.add_argument("--victim", default="m1")
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--stop-step", type=int, default=None)
    ap.add_argument("--ttl", type=float, default=30.0)
    ap.add_argument("--event-timeout", type=float, default=120.0, help="seconds to wait for a member's next report")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        os._exit(0)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
