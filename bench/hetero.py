"""Uneven members: speed-weighted batch shares vs uniform batches, demotion and eviction.

    python bench/hetero.py [--world 4] [--slow m3] [--slowdown 2] [--steps 12] [--global-batch 56]

A fresh real etcd, coordinator (``--straggler-policy demote``) and ``--world`` member
processes training one small linear model with ``DistributedDataParallel`` over the
resilient process group (:func:`resilient.ddp.weighted_ddp_comm_hook`) on an
:class:`~resilient.elastic.ElasticSampler`. Per-sample device time is modelled with a sleep
of ``--t-sample`` s per sample (4 ms by default), times ``--slowdown`` on member ``--slow``
(so the run measures the batch split, not this machine's shared CPU: at 2 ms per sample
the members' own ~3.5 ms of host CPU per step, four processes on two cores, is a quarter
of the modelled step; docs/hetero.md). Phases (``--phases``, in this order), one job:

* ``uniform``: ``global_batch / world`` samples each, ``--steps`` steps;
* ``weighted``: each member wrote its measured samples/s of the uniform phase
  (``rates/<member>``); the coordinator leader published ``shares`` (hysteresis,
  ``resilient.coordinator.shares``); rank 0 reads the record and broadcasts it, so every
  member applies the same sizes (``ElasticSampler.follow_shares``); ``--steps`` steps;
* ``evict``: the slow member gets 0 samples, the others split the batch (what eviction
  delivers at best; the member stays in the allreduce with a count of 0); ``--steps`` steps;
* ``demote``: uniform sizes again, and now every member writes health windows
  (:class:`~resilient.health_reporter.HealthReporter`, one per ``--report-s``): the
  coordinator's straggler detector finds the slow member (it is busy while the others
  wait on it), probes its ring link, then demotes it — an epoch whose roles make it a
  leaf (``algorithms/leaf.py``: off the ring, its input sent to a tree parent). The phase
  runs until ``--steps`` steps in a row ran in an epoch demoting ``--slow`` (every member
  reads the epoch of its step's allreduce, the same on every member, so all end the phase
  at the same step), at most ``--demote-max-steps``, else the bench fails with the
  detector's record. Health windows stop once the slow member is demoted, so the timed
  steps carry no etcd writes (without fresh windows the detector keeps its states).
  Last because the other phases must not be changed by it: before it no health window
  exists, so the policy cannot act in them. The sampler starts a new data epoch when less
  than one global batch is left (the detection takes ~100 steps).

Timed: every step of a phase but its first; in the demote phase the last ``--steps``
steps but their first (all in a demoting epoch: checked). Every step, every member
reports its gradient after the hook, the parameters before the step, its sample indices
and the epoch its allreduce ran in; the driver recomputes the gradient of the
contributors' samples in one process and reports the largest difference
(``grad_max_abs_err``). One JSON line: samples/s per phase, ``ratio_vs_uniform``,
``ratio_vs_demote``, ``ratio_vs_evict`` (weighted over each), the published shares and
sizes, ``demote`` (steps and seconds until the demotion, the timed epochs, the detector's
scores and states), ``grad_max_abs_err``, ``exactly_once`` (no sample twice in a data
epoch).

``--kill-step K`` SIGKILLs member ``--victim`` in the middle of step K's allreduce
(failpoint) and ``--stop-step`` SIGSTOPs it there instead (the tests use both): the
survivors' steps stay exact over their contributors and every sample of the data epoch is
processed exactly once.
Failure behaviour: a member that raises or hangs makes the run fail with its stderr; a
demotion that does not come fails it naming the detector's states.
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

PHASES = ("uniform", "weighted", "evict", "demote")
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
    from resilient.health_reporter import HealthReporter
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
        if phase in ("uniform", "demote"):
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
    rate_n, rate_s = 0, 0.0
    grads = grad_rows(args, sum(p.numel() for p in model.parameters()), max_steps(args), "w+")
    step = 0
    demote: dict = {}
    try:
        for phase in args.phases.split(","):
            if phase == "weighted":
                sh.write_rate(store, args.job, args.id, rate_n / rate_s, session.lease_id)
                comm.barrier()   # every rate is written before rank 0 waits for the shares
            apply_phase(phase, members)
            k = run = 0             # steps of this phase; demote: steps in a row run in an epoch demoting --slow
            reporter = None         # demote: this member's health reporter while the slow one is not demoted
            while True:
                if phase == "demote":
                    if reporter is None and not run:
                        reporter = HealthReporter(store, args.job, args.id, session.lease_id, transport.stats,
                                                  interval=args.report_s, min_ops=3)
                    if args.samples - sampler.processed < sum(sampler.sizes()):
                        sampler.set_epoch(sampler.epoch + 1)   # detection may outlast the data epoch
                idx = sampler.step_indices()
                state.set(len(idx))
                # before the allreduce: a victim killed in it still told its samples
                emit("batch", step=step, idx=idx, data_epoch=sampler.epoch)
                t0 = time.time()
                time.sleep(len(idx) * args.t_sample * slow)              # the device's per-sample time
                loss = loss_of(ddp, x_all[idx], y_all[idx])
                t_compute = time.time() - t0                              # this member's own work only
                loss.backward()                                           # the hook's allreduce
                t1 = time.time()
                if phase == "uniform" and k > 0:
                    rate_n, rate_s = rate_n + len(idx), rate_s + t_compute
                contributors = sorted(state.tracker.step_contributors())
                state.tracker.reset()
                # the epoch this step's allreduce ran in (the next op adopts a newer one at
                # its start; every member runs an op in the same epoch)
                epoch = engine.comm.epoch
                demoted = sorted(m for m, r in epoch.roles.items() if r == "demoted")
                # the gradient goes to row ``step`` of a file mapped shared (raw float64: too big
                # for the report line): a copy into the page cache, no write() in the timed
                # region, and a member SIGKILLed later still leaves its earlier rows
                torch.cat([p.grad.reshape(-1) for p in model.parameters()], out=grads[step])
                emit("step", step=step, phase=phase, k=k, idx=idx, members=list(members), contributors=contributors,
                     total=state.last_total, t0=t0, t1=t1, sizes=sampler.sizes(), epoch=epoch.number,
                     demoted=demoted, data_epoch=sampler.epoch)
                sampler.record_step([members.index(m) for m in contributors])
                opt.step()
                opt.zero_grad()
                step, k = step + 1, k + 1
                if phase == "demote":
                    if args.slow in demoted:
                        # demoted: no more health windows (no etcd write in the timed steps;
                        # without fresh windows the detector keeps its states)
                        demote.setdefault("first_step", step - 1)
                        run, reporter = run + 1, None
                    else:
                        run = 0
                        if reporter is not None:
                            reporter.op_done(epoch.number, t1 - t0 - t_compute)
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
                # every member ends a phase at the same step: the counts and the op's epoch agree
                if phase != "demote" and k == args.steps:
                    break
                if phase == "demote" and (run == args.steps or k >= args.demote_max_steps):
                    demote.update(steps=k, reached=run == args.steps)
                    break
    except Exception as exc:  # noqa: BLE001 - DDP may wrap the hook's error
        if not isinstance(exc, RemovedFromGroup) and "RemovedFromGroup" not in f"{type(exc).__name__} {exc}" \
                and "is not in epoch" not in str(exc):
            raise
        emit("removed", error=f"{type(exc).__name__}: {exc}"[:500])
        os._exit(0)
    emit("done", processed=sampler.processed, shares=shares_used, demote=demote)
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


def max_steps(args) -> int:
    """Rows of the gradient files: every phase's steps, the demote phase at its longest."""
    phases = args.phases.split(",")
    return args.steps * sum(p != "demote" for p in phases) + (args.demote_max_steps if "demote" in phases else 0)


def check_phases(text: str) -> list[str]:
    """``--phases`` as a list; raises SystemExit naming the rule it breaks."""
    phases = text.split(",")
    if not phases or any(p not in PHASES for p in phases) or len(set(phases)) != len(phases):
        raise SystemExit(f"--phases {text!r}: a comma-separated subset of {','.join(PHASES)}, each once")
    if "weighted" in phases and ("uniform" not in phases or phases.index("uniform") > phases.index("weighted")):
        raise SystemExit("--phases: weighted needs uniform before it (its shares come from the uniform steps' rates)")
    if "demote" in phases and phases[-1] != "demote":
        raise SystemExit("--phases: demote must be last (its health windows must not reach the other phases)")
    return phases


def run(args) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="resilient-hetero-") as out_dir:
        args.out_dir = out_dir
        return _run(args)


def _run(args) -> dict:
    from resilient.coordinator.health import read_scores

    victim_env = None
    if args.kill_step is not None or args.stop_step is not None:
        k = args.kill_step if args.kill_step is not None else args.stop_step
        action = "kill" if args.kill_step is not None else "stop"
        # op 0 barrier, one allreduce per step; the weighted phase adds a barrier and a broadcast
        phases = args.phases.split(",")
        weighted_from = phases.index("weighted") * args.steps if "weighted" in phases else None
        op = 1 + k + (2 if weighted_from is not None and k >= weighted_from else 0)
        victim_env = {"RESILIENT_FAILPOINTS": f"{action}@op={op},phase={args.fail_phase},frac=0.5"}
        if action == "stop":
            victim_env["HETERO_OWN_LEASE"] = "1"
    env_for = (lambda mid: victim_env if victim_env and mid == args.victim else {})
    cluster = BenchCluster(os.path.abspath(__file__), args.world, job="bench-hetero", ttl=args.ttl,
                           worker_args=["--slow", args.slow, "--slowdown", str(args.slowdown), "--steps", str(args.steps),
                                        "--global-batch", str(args.global_batch), "--samples", str(args.samples),
                                        "--t-sample", str(args.t_sample), "--width", str(args.width),
                                        "--phases", args.phases, "--demote-max-steps", str(args.demote_max_steps),
                                        "--report-s", str(args.report_s), "--out-dir", args.out_dir], env_for=env_for)
    # the coordinator's default policy, said explicitly: the demote phase's health windows
    # are what it acts on (the other phases write none)
    cluster.coordinator_args = ["--straggler-policy", "demote"]
    with cluster as cl:
        for m in cl.procs:
            cl.watch_exit(m)
        everyone = sorted(cl.procs)
        lines = Lines(cl)
        cl.send(everyone, "go")
        steps: dict[str, list[dict]] = {m: [] for m in everyone}
        batches: dict[tuple[int, str], list[int]] = {}
        finished: dict[str, dict] = {}
        total_steps = max_steps(args)
        faulty = args.kill_step is not None or args.stop_step is not None
        order = [m for m in everyone if not (faulty and m == args.victim)] + ([args.victim] if faulty else [])
        for m in order:
            if m == args.victim and args.stop_step is not None:
                # the survivors finished without it (its lease expired while stopped): let it see that
                cl.procs[m].send_signal(signal.SIGCONT)
            while True:
                ev = next_event(cl, lines, m, timeout=args.event_timeout)
                if ev is None:   # EOF: only the victim of --kill-step may end like that
                    if m != args.victim or args.kill_step is None:
                        raise SystemExit(f"member {m} exited early: {cl.stderr_tail(m)}")
                    break
                if ev["event"] == "batch":
                    batches[(ev["step"], m)] = [ev["data_epoch"], ev["idx"]]
                elif ev["event"] == "step":
                    steps[m].append(ev)
                elif ev["event"] in ("done", "removed"):
                    finished[m] = ev
                    break
        straggler = read_scores(cl.store, cl.job)   # the detector's states, for the report
        history = epoch_history(cl.store, cl.job)
        cl.send([m for m, f in finished.items() if f["event"] == "done"], "quit")
        demote = next((f["demote"] for f in finished.values() if f.get("demote")), None)
        if demote is not None and not demote["reached"]:
            raise SystemExit(f"the coordinator did not keep {args.slow} demoted for {args.steps} steps in a row within "
                             f"--demote-max-steps {args.demote_max_steps} steps of the demote phase (first demoted "
                             f"step: {demote.get('first_step')}); the straggler record: {straggler}")
        out = summarize(args, steps, finished, total_steps, batches, straggler)
        if "demote" in out:
            out["demote"]["epochs"] = history
        return out


def epoch_history(store, job: str) -> list[list]:
    """``[number, cause, demoted members]`` of every published epoch (the report shows
    the detector's probe and demotion as epochs); malformed records are left out."""
    from resilient.coordinator import keys
    from resilient.coordinator.epoch import Epoch
    from resilient.errors import RecordError

    out = []
    for kv in store.get_prefix(keys.root(job) + "epochs/"):
        if not kv.key.endswith("/epoch"):
            continue
        try:
            e = Epoch.from_json(kv.value, kv.key)
        except RecordError:
            continue
        out.append([e.number, e.cause, sorted(m for m, r in e.roles.items() if r == "demoted")])
    return sorted(out)


class Lines:
    """Every member's stdout read from the start by a thread of its own into a queue, so
    that no member blocks on a full pipe while the driver waits on another's events (the
    demote phase runs hundreds of steps: more lines than a pipe holds)."""

    def __init__(self, cl: BenchCluster) -> None:
        import queue
        import threading

        self.queues: dict[str, queue.Queue] = {m: queue.Queue() for m in cl.procs}
        for m, p in cl.procs.items():
            threading.Thread(target=self._pump, args=(p.stdout, self.queues[m]), daemon=True).start()

    @staticmethod
    def _pump(stream, q) -> None:
        for line in iter(stream.readline, ""):
            q.put(line)
        q.put("")   # EOF


def next_event(cl: BenchCluster, lines: Lines, mid: str, timeout: float) -> dict | None:
    """The next JSON line of ``mid`` (None at EOF). Raises SystemExit on a timeout or a
    line that is not JSON, with the member's stderr."""
    import queue

    try:
        line = lines.queues[mid].get(timeout=timeout)
    except queue.Empty:
        for m, p in cl.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        tails = "\n".join(f"--- {m} (exit {cl.procs[m].poll()}):\n{cl.stderr_tail(m, 12000)}" for m in sorted(cl.procs))
        raise SystemExit(f"member {mid} sent nothing within {timeout}s:\n{tails}") from None
    if not line:
        return None
    try:
        return json.loads(line)
    except ValueError:
        raise SystemExit(f"member {mid} printed {line!r}: {cl.stderr_tail(mid)}") from None


def summarize(args, steps: dict[str, list[dict]], finished: dict[str, dict], total_steps: int,
              batches: dict[tuple[int, str], list], straggler: dict | None = None) -> dict:
    """Check every step against one process: the reference model takes the same SGD steps
    with the reference gradients (the members' differ from them by rounding only).
    Timed: every step of a phase but its first (the warm-up); in the demote phase, the last
    ``--steps`` steps, which all ran in an epoch demoting ``--slow``, but their first.
    Raises AssertionError when members disagree on a step's contributors or epoch, or a
    contributor did not report its samples."""
    import torch

    x_all, y_all = dataset(args.samples, args.width)
    ref_model = make_model(args.width)
    by_step: dict[int, dict[str, dict]] = {}
    for m, evs in steps.items():
        for ev in evs:
            by_step.setdefault(ev["step"], {})[m] = ev
    demote_steps = sorted(s for s, evs in by_step.items() if next(iter(evs.values()))["phase"] == "demote")
    demote_timed = set(demote_steps[-(args.steps - 1):]) if args.steps > 1 else set()
    err = 0.0
    rows: dict[str, torch.Tensor] = {}
    short: dict[str, list[str]] = {}
    processed: list[tuple[int, int]] = []
    span: dict[str, list[float]] = {}
    samples: dict[str, int] = {}
    sizes: dict[str, list[int]] = {}
    demote_epochs: set[int] = set()
    for s in sorted(by_step):
        evs = by_step[s]
        first = next(iter(evs.values()))
        contributors = first["contributors"]
        if any(ev["contributors"] != contributors for ev in evs.values()):
            raise AssertionError(f"step {s}: members disagree on the contributors: {evs}")
        if any((ev["epoch"], ev["demoted"]) != (first["epoch"], first["demoted"]) for ev in evs.values()):
            raise AssertionError(f"step {s}: members ran it in different epochs: {evs}")
        # a contributor that died after its gradient was in (the victim) reported its batch only
        if not all((s, m) in batches for m in contributors):
            raise AssertionError(f"step {s}: a contributor did not report its samples")
        idx = [i for m in contributors for i in batches[(s, m)][1]]
        processed.extend((batches[(s, m)][0], i) for m in contributors for i in batches[(s, m)][1])
        missing = sorted(set(first["members"]) - set(contributors))
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
        phase = first["phase"]
        t0, t1 = min(ev["t0"] for ev in evs.values()), max(ev["t1"] for ev in evs.values())
        if (s in demote_timed) if phase == "demote" else first["k"] >= 1:   # the first step of each phase: warm-up
            if phase == "demote":
                if args.slow not in first["demoted"]:
                    raise AssertionError(f"step {s}: timed in the demote phase, but epoch {first['epoch']} "
                                         f"demotes {first['demoted']}, not {args.slow}")
                demote_epochs.add(first["epoch"])
            sp = span.setdefault(phase, [t0, t1])
            sp[0], sp[1] = min(sp[0], t0), max(sp[1], t1)
            samples[phase] = samples.get(phase, 0) + len(idx)
        sizes.setdefault(phase, first["sizes"])
    rate = {p: samples[p] / (span[p][1] - span[p][0]) for p in span if span[p][1] > span[p][0]}
    shares = next((f.get("shares") for f in finished.values() if f.get("shares")), None)

    def ratio(base: str) -> float | None:
        return round(rate["weighted"] / rate[base], 3) if "weighted" in rate and base in rate else None

    out = {
        "samples_per_s": {p: round(v, 2) for p, v in rate.items()},
        "ratio_vs_uniform": ratio("uniform"),
        "ratio_vs_demote": ratio("demote"),
        "ratio_vs_evict": ratio("evict"),
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
    if demote_steps:
        at = next(s for s in demote_steps if args.slow in next(iter(by_step[s].values()))["demoted"])
        start = min(ev["t0"] for ev in by_step[demote_steps[0]].values())
        out["demote"] = {
            # steps of the demote phase (uniform sizes, health windows written) before the
            # first step whose op ran in an epoch demoting --slow, and their wall time
            "detect_steps": at - demote_steps[0], "detect_s": round(min(ev["t0"] for ev in by_step[at].values()) - start, 3),
            "steps": len(demote_steps), "timed_epochs": sorted(demote_epochs),
            "straggler": (straggler or {}).get("members"),
        }
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
                    help="model outputs: (8+1)*width float64 gradients, > 64 KiB so the large-message allreduce runs "
                         "(on one host the direct shared-memory one; the ring elsewhere), not recursive doubling")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="the phases to run, in this order (a subset; weighted needs uniform before it, demote last)")
    ap.add_argument("--demote-max-steps", type=int, default=600,
                    help="demote phase: steps within which the coordinator must have demoted --slow and kept it "
                         "demoted for --steps steps in a row, else the bench fails saying so")
    ap.add_argument("--report-s", type=float, default=0.5,
                    help="demote phase: seconds per health window (resilient.health_reporter)")
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--fail-phase", default="rs",
                    help="failpoint phase of --kill-step/--stop-step (rd with a --width below ~900: recursive doubling)")
    ap.add_argument("--victim", default="m1")
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--stop-step", type=int, default=None)
    ap.add_argument("--ttl", type=float, default=30.0)
    ap.add_argument("--event-timeout", type=float, default=120.0, help="seconds to wait for a member's next report")
    args = ap.parse_args()
    check_phases(args.phases)
    if args.worker:
        worker(args)
        os._exit(0)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
