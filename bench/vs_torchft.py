"""Time lost to one SIGKILLed replica: resilient vs torchft, same model, data and buckets.

Three data-parallel replicas (one process each) train the same model (``--layers`` square
``Linear`` layers, SGD with momentum, so the state is twice the gradient bytes), with
``--compute`` seconds of synthetic compute per step (a sleep: the cores here are shared)
plus the real forward/backward, DDP buckets of ``--bucket-mb``. Everything on loopback:

* **resilient**: ``resilient-run --standalone --nproc-per-node 3 --max-restarts 1``, the
  ``resilient`` backend, ``resilient.ddp`` hook, ``resilient.elastic.State`` (``sync()``
  each step, ``commit()`` after it); the killed worker comes back as a joiner.
* **torchft** (PyPI ``torchft-nightly``, ``pip install -e '.[bench]'``): its Rust
  lighthouse (``torchft_lighthouse``, bound to 127.0.0.1), one ``Manager`` per replica
  (replica group of one, its own TCPStore), ``torchft.DistributedDataParallel``,
  ``torchft.Optimizer``, ``ProcessGroupGloo``; the killed replica is restarted at once
  by this driver (as torchelastic would) and heals from a peer. A restarted replica of
either system runs one local forward/backward before it joins (no collective), so its
first real step is not a cold one. Two configurations:
  ``default`` (lighthouse CLI defaults: join 60 s, quorum tick 100 ms, heartbeat timeout
  5 s; Manager heartbeat every 100 ms; gloo timeout 60 s) and ``tuned`` (the most
  aggressive values in torchft's own tests/examples: join 100 ms, quorum tick 10 ms,
  heartbeat timeout 200 ms every 50 ms, gloo timeout 1 s). The Manager's own op timeout
  stays at its 60 s default in both (torchft documents no smaller value).

Cases: the replica launched as rank 1 SIGKILLs itself (a) ``start``: at the start of step
``--kill-step``, before its forward pass; (b) ``allreduce``: ``--kill-delay`` seconds after
its first gradient bucket entered the allreduce at that step. Sizes: ``small`` (1 layer of
512, ~1 MiB of gradients, 0.05 s compute) and ``realistic`` (4 layers of 2048, 64 MiB of
gradients, 128 MiB of state, 0.5 s compute), or ``--size layers:dim:compute``.

Lost seconds, each system from its own step logs (every replica logs each committed
step's end time), on the replica launched as rank 0 (a survivor):
``lost = (t[last step] - t[kill_step - 3]) - (last - (kill_step - 3)) * m``, ``m`` being the
failing run's own mean step interval over the steps the failure and the admission did not
touch (steps after the third, less the 3 from the kill on and the 3 from the joiner's
return: its fault-free step time; ``steady_step``; ``*_lost_median_s`` uses the median of
all its steps instead, as earlier versions did), the extra time
of the steps around the failure, the joiner's admission included (a run goes on past
``--steps`` committed steps until the restarted replica has trained 3 steps in the full
world, at most 400 steps more; a discarded torchft step is not a committed one).
``*_lost_vs_fault_free_s``: the same with ``m`` from a separate fault-free run
(``*_step_s``; biased on a loaded machine, where a world of 2 steps faster). ``ratio`` =
torchft lost / resilient lost. Also printed: fault-free step times, resilient's joiner
admission (``admission_extra_s``: extra time of the survivors' step during which the
joiner was admitted; ``admission_phases``: ``State.last_sync``), whether the joiner was
back before the end, and ``os.getloadavg()`` before and after each case. The machine may
be shared: figures are indicative.

One JSON line per (size, case) on stdout. ``--quick``: small size only, fewer steps.
Every process started here is ended here by PID (its own session) at the end of a run.
Failure behaviour: a run that does not finish within ``--run-timeout`` is killed and
reported with ``"hung": true``; its ``lost_s`` is then what it had lost by then against
the fault-free step time (``lost_is_lower_bound``), and a ratio over it a lower bound; torchft not installed -> SystemExit
naming the extra to install.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from resilient.errors import ResilientTimeout
from resilient.process_pool import STDOUT, Child, ProcessPool, Spec

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"small": (1, 512, 0.05), "realistic": (4, 2048, 0.5)}
REPLICAS = 3
VICTIM = 1
BATCH = 8
FULL_STEPS = 3  # steps with the joiner back before a run may end
MAX_EXTRA = 400  # steps past --steps after which a run ends even if the joiner is not back

TORCHFT = {
    "default": {"join_timeout_ms": 60000, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 5000,
                "heartbeat_interval_ms": 100, "gloo_timeout_s": 60.0},
    "tuned": {"join_timeout_ms": 100, "quorum_tick_ms": 10, "heartbeat_timeout_ms": 200,
              "heartbeat_interval_ms": 50, "gloo_timeout_s": 1.0},
}


# -- worker side ------------------------------------------------------------------------

def _model(layers: int, dim: int) -> Any:
    import torch

    torch.manual_seed(0)  # the same initial model everywhere
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])


def _batch(step: int, rank: int, dim: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(BATCH, dim, generator=g)


class _Log:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a")  # noqa: SIM115

    def write(self, **rec: Any) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def _kill_self(log: _Log | None = None) -> None:
    if log is not None:
        log.write(event="kill", t=time.time())
    os.kill(os.getpid(), signal.SIGKILL)


def _start_barrier(log_dir: str, replica: int, timeout: float = 180.0) -> None:
    """Every first-incarnation torchft replica waits here until all are built, so the first
    quorum has all of them (else a late one joins later and skips steps)."""
    Path(log_dir, f"ready-{replica}").touch()
    deadline = time.monotonic() + timeout
    while len(list(Path(log_dir).glob("ready-*"))) < REPLICAS:
        if time.monotonic() > deadline:
            raise SystemExit(f"torchft replica {replica}: the others were not ready within {timeout:.0f}s")
        time.sleep(0.01)


class _Killer:
    """Arms the victim's SIGKILL: at a step's start, or ``delay`` s into its allreduce."""

    def __init__(self, case: str, step: int, delay: float, armed: bool) -> None:
        self.case, self.step, self.delay, self.armed = case, step, delay, armed
        self.current = -1
        self.log: _Log | None = None

    def at_step_start(self, step: int) -> None:
        self.current = step
        if self.armed and self.case == "start" and step == self.step:
            _kill_self(self.log)

    def at_bucket(self) -> None:
        if self.armed and self.case == "allreduce" and self.current == self.step:
            self.armed = False
            threading.Timer(self.delay, _kill_self, args=(self.log,)).start()


def _warm_up(model: Any, dim: int) -> None:
    """A restarted replica runs one local forward/backward (no DDP, no collective) before
    it joins, so its first real step is not a cold one the others would wait for (both
    systems alike)."""
    model(_batch(0, 0, dim)).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)


def _done(a: argparse.Namespace, step: int, full_after: int) -> bool:
    """Stop after ``--steps`` committed steps once the joiner has trained FULL_STEPS steps
    in the full world (so its admission is inside the measured span), or at the cap."""
    return step >= a.steps + MAX_EXTRA or (step >= a.steps and full_after >= FULL_STEPS)


def worker_resilient(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import resilient  # noqa: F401
    from resilient.ddp import ContributorTracker, _NoRebuildReducer, ddp_comm_hook  # noqa: PLC2701
    from resilient.elastic import State, TrainingFinished

    dist.init_process_group("resilient")
    launch_rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    killer = _Killer(a.case, a.kill_step, a.kill_delay, launch_rank == VICTIM and restart == 0 and a.case != "none")
    model = _model(a.layers, a.dim)
    if restart:
        _warm_up(model, a.dim)
    ddp = DDP(model, init_sync=False, forward_sync_buffers=False, bucket_cap_mb=a.bucket_mb)
    tracker = ContributorTracker()

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations it finds
        killer.at_bucket()
        return ddp_comm_hook(state, bucket)

    ddp.register_comm_hook(tracker, hook)
    ddp.reducer = _NoRebuildReducer(ddp.reducer)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    state = State(model=model, optimizer=opt, step=0, full_after=0)
    log = killer.log = _Log(os.path.join(a.log_dir, f"resilient-{launch_rank}-{restart}-{os.getpid()}.jsonl"))
    while True:
        t_a = time.monotonic()
        try:
            changed = state.sync()
        except TrainingFinished:
            break
        if changed and ("rebuild_s" in state.last_sync or "stream_s" in state.last_sync):
            log.write(event="admit", step=state.step, t=time.time(), phases=state.last_sync)
        if _done(a, state.step, state.full_after):
            break
        killer.at_step_start(state.step)
        t_b = time.monotonic()
        time.sleep(a.compute)
        tracker.reset()
        opt.zero_grad()
        t_c = time.monotonic()
        ddp(_batch(state.step, dist.get_rank(), a.dim)).pow(2).mean().backward()
        t_d = time.monotonic()
        opt.step()
        t_e = time.monotonic()
        world = dist.get_world_size()
        if state.step > a.kill_step and world == REPLICAS:
            state.full_after += 1  # every member counts alike (the group is agreed at sync())
        state.step += 1
        state.commit()
        ph = [t_b - t_a, t_c - t_b, t_d - t_c, t_e - t_d, time.monotonic() - t_e]
        log.write(step=state.step, t=time.time(), world=world, ph=[round(x, 4) for x in ph])
    state.finish()
    dist.destroy_process_group()
    return 0


def worker_torchft(a: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    cfg = TORCHFT[a.config]
    restart = int(os.environ.get("BENCH_RESTART", "0"))
    killer = _Killer(a.case, a.kill_step, a.kill_delay, a.replica == VICTIM and restart == 0 and a.case != "none")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = _model(a.layers, a.dim)
    inner = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    full_after = [0]  # steps after the kill with every replica in the quorum (healed with the state)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        full_after[0] = int(sd["full_after"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict(), "full_after": full_after[0]}

    if restart:
        _warm_up(model, a.dim)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=cfg["gloo_timeout_s"]))
    manager = Manager(pg=pg, min_replica_size=2, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"replica{a.replica}", store_addr="127.0.0.1", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=a.lighthouse, hostname="127.0.0.1",
                      heartbeat_interval=timedelta(milliseconds=cfg["heartbeat_interval_ms"]))
    real_allreduce = manager.allreduce

    def allreduce(*args: Any, **kw: Any) -> Any:
        killer.at_bucket()
        return real_allreduce(*args, **kw)

    manager.allreduce = allreduce  # type: ignore[method-assign]
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=a.bucket_mb)
    opt = Optimizer(manager, inner)
    log = killer.log = _Log(os.path.join(a.log_dir, f"torchft-{a.replica}-{restart}-{os.getpid()}.jsonl"))
    if not restart:
        _start_barrier(a.log_dir, a.replica)
    while not _done(a, manager.current_step(), full_after[0]):
        step = manager.current_step()
        killer.at_step_start(step)
        t_a = time.monotonic()
        opt.zero_grad()  # starts the quorum (async, overlapping the forward pass)
        t_b = time.monotonic()
        time.sleep(a.compute)
        t_c = time.monotonic()
        ddp(_batch(step, a.replica, a.dim)).pow(2).mean().backward()
        t_d = time.monotonic()
        opt.step()  # applied only if should_commit()
        t_e = time.monotonic()
        world = manager.num_participants()
        ph = [t_b - t_a, t_c - t_b, t_d - t_c, t_e - t_d, 0.0]
        if manager.current_step() > step and step > a.kill_step and world == REPLICAS:
            full_after[0] += 1
        log.write(step=manager.current_step(), t=time.time(), world=world, ph=[round(x, 4) for x in ph])
    manager.shutdown(wait=False)
    return 0


# -- driver side ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(cmd: list[str], out: Path, env: dict | None = None) -> Spec:
    """``cmd`` in its own session, stdout and stderr to the file ``out``."""
    return Spec(cmd, cwd=ROOT, env=env, stdout=out, stderr=STDOUT)


def _worker_args(a: argparse.Namespace, case: str, log_dir: Path, layers: int, dim: int, compute: float) -> list[str]:
    return ["--case", case, "--steps", str(a.steps), "--kill-step", str(a.kill_step), "--kill-delay",
            str(a.kill_delay), "--layers", str(layers), "--dim", str(dim), "--compute", str(compute),
            "--bucket-mb", str(a.bucket_mb), "--log-dir", str(log_dir)]


def run_resilient(a: argparse.Namespace, case: str, log_dir: Path, size: tuple) -> bool:
    cmd = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())",
           "--standalone", "--nproc-per-node", str(REPLICAS), "--max-restarts", "1", __file__,
           "--worker", "resilient", *_worker_args(a, case, log_dir, *size)]
    pool = ProcessPool()
    pool.start(_spec(cmd, log_dir / "launcher.out"))
    try:
        pool.wait(a.run_timeout)
        return True
    except ResilientTimeout:
        return False
    finally:
        pool.stop(grace=0, sig=signal.SIGKILL)   # its whole session, by PID


def run_torchft(a: argparse.Namespace, case: str, log_dir: Path, size: tuple, config: str) -> bool:
    cfg = TORCHFT[config]
    port = _free_port()
    lh_bin = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    pool = ProcessPool()
    pool.start(_spec([lh_bin, "--bind", f"127.0.0.1:{port}", "--min_replicas", "2",
                      "--join_timeout_ms", str(cfg["join_timeout_ms"]), "--quorum_tick_ms", str(cfg["quorum_tick_ms"]),
                      "--heartbeat_timeout_ms", str(cfg["heartbeat_timeout_ms"])], log_dir / "lighthouse.out"))
    env = dict(os.environ, TORCHFT_USE_OTEL="false", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))

    def start(i: int, restart: int) -> Child:
        cmd = [sys.executable, __file__, "--worker", "torchft", "--replica", str(i), "--config", config,
               "--lighthouse", f"http://127.0.0.1:{port}", *_worker_args(a, case, log_dir, *size)]
        return pool.start(_spec(cmd, log_dir / f"replica{i}-{restart}.out", env=dict(env, BENCH_RESTART=str(restart))))

    try:
        workers = {i: start(i, 0) for i in range(REPLICAS)}
        restarted = False
        deadline = time.monotonic() + a.run_timeout
        while (ended := pool.wait_any(max(0.0, deadline - time.monotonic()))) is not None:
            if not restarted and ended is workers[VICTIM] and ended.returncode != 0:
                workers[VICTIM] = start(VICTIM, 1)  # restarted at once, as torchelastic would
                restarted = True
            if not any(c.alive() for c in workers.values()):
                return True
        return False
    finally:
        pool.stop(grace=0, sig=signal.SIGKILL)   # every session started here, by PID


def _records(log_dir: Path, prefix: str) -> list[dict]:
    recs = []
    for f in sorted(log_dir.glob(f"{prefix}-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    return recs


def step_intervals(recs: list[dict]) -> dict[int, float]:
    """Committed step -> seconds since the previous committed step (first record per step)."""
    first: dict[int, float] = {}
    for r in sorted((r for r in recs if "step" in r and "event" not in r), key=lambda r: r["t"]):
        first.setdefault(r["step"], r["t"])
    return {s: first[s] - first[s - 1] for s in first if s - 1 in first}


def median_step(recs: list[dict], skip: int = 3) -> float | None:
    iv = [v for s, v in step_intervals(recs).items() if s > skip]
    return statistics.median(iv) if iv else None


def steady_step(recs: list[dict], kill_step: int, skip: int = 3, window: int = 3) -> float | None:
    """Mean interval of the committed steps (after the ``skip`` first) that neither failure
    nor admission touched: the ``window`` steps from the kill on, and the ``window`` steps
    from the first one after the kill with the full world back. A mean, not a median:
    step times are right-skewed, and ``lost_seconds`` subtracts ``m`` once per step of a
    span of 40-60 steps, so a median's bias (a few ms) would add up to more than the
    loss measured, and differently for runs of different lengths."""
    iv = step_intervals(recs)
    worlds = {r["step"]: r.get("world") for r in recs if "step" in r and "event" not in r}
    back = min((st for st, w in worlds.items() if st > kill_step + 1 and w == REPLICAS), default=None)
    hit = set(range(kill_step + 1, kill_step + 1 + window))
    if back is not None:
        hit |= set(range(back, back + window))
    vals = [v for st, v in iv.items() if st > skip and st not in hit]
    return statistics.fmean(vals) if vals else None


def lost_seconds(recs: list[dict], m: float, s_from: int) -> float | None:
    """(t[last] - t[s_from]) - (last - s_from) * m over one replica's committed steps."""
    first: dict[int, float] = {}
    for r in sorted((r for r in recs if "step" in r and "event" not in r), key=lambda r: r["t"]):
        first.setdefault(r["step"], r["t"])
    if s_from not in first:
        return None
    last = max(first)
    return (first[last] - first[s_from]) - (last - s_from) * m


def measure(a: argparse.Namespace, system: str, case: str, size: tuple, tmp: Path) -> dict:
    """One run; returns the survivor's (launch rank 0) records and every replica's."""
    d = tmp / f"{system}-{case}-{size[0]}x{size[1]}"
    d.mkdir(parents=True)
    if system == "resilient":
        ok = run_resilient(a, case, d, size)
    else:
        ok = run_torchft(a, case, d, size, system.split("-", 1)[1])
    prefix = system.split("-")[0]
    all_recs = _records(d, prefix)
    rank0 = []
    for f in sorted(d.glob(f"{prefix}-0-*.jsonl")):
        rank0 += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return {"ok": ok, "rank0": rank0, "all": all_recs, "dir": str(d)}


def bench_case(a: argparse.Namespace, size_name: str, size: tuple, case: str, tmp: Path,
               ff: dict[str, float | None]) -> dict:
    load0 = os.getloadavg()
    out: dict[str, Any] = {"size": size_name, "case": case, "layers": size[0], "dim": size[1], "compute_s": size[2],
                           "grad_mib": round(size[0] * (size[1] * size[1] + size[1]) * 4 / 2**20, 1),
                           "bucket_mb": a.bucket_mb, "replicas": REPLICAS, "steps": a.steps, "kill_step": a.kill_step}
    if case == "allreduce":
        out["kill_delay_s"] = a.kill_delay
    s_from = a.kill_step - 3
    for system in a.systems:
        key = system.replace("-", "_")
        ff_run = None
        if system not in ff:
            ff_run = measure(a, system, "none", size, tmp)
            ff[system] = median_step(ff_run["rank0"]) if ff_run["ok"] else None
        # case "none" is the fault-free run itself (a second one would reuse its directory)
        run = ff_run if case == "none" and ff_run is not None else measure(a, system, case, size, tmp)
        m, med = ff[system], median_step(run["rank0"])
        own = steady_step(run["rank0"], a.kill_step) if case != "none" else med
        out[f"{key}_step_s"] = None if m is None else round(m, 4)
        out[f"{key}_failing_run_step_s"] = None if own is None else round(own, 4)
        ok = run["ok"] and own is not None
        out[f"{key}_lost_s"] = _r(lost_seconds(run["rank0"], own, s_from)) if ok else None
        out[f"{key}_lost_median_s"] = _r(lost_seconds(run["rank0"], med, s_from)) if ok and med else None
        out[f"{key}_lost_vs_fault_free_s"] = _r(lost_seconds(run["rank0"], m, s_from)) if m else None
        if not ok and m:  # did not finish: what it had lost when it was stopped (a lower bound)
            out[f"{key}_lost_s"] = out[f"{key}_lost_vs_fault_free_s"]
            out[f"{key}_lost_is_lower_bound"] = True
        if not run["ok"]:
            out[f"{key}_hung"] = True
        kills = [r["t"] for r in run["all"] if r.get("event") == "kill"]
        if case != "none" and not kills:
            out[f"{key}_not_killed"] = True  # the victim never reached the kill point: no failure measured
        back = [r for r in run["all"] if "step" in r and "event" not in r and r.get("world") == REPLICAS
                and kills and r["t"] > kills[0]]
        out[f"{key}_joiner_back"] = bool(back)
        if system == "resilient":
            admits = [r for r in run["rank0"] if r.get("event") == "admit"]
            iv = step_intervals(run["rank0"])
            if admits and own is not None:
                s = admits[-1]["step"] + 1
                out["resilient_admission_extra_s"] = _r(iv[s] - own) if s in iv else None
                out["resilient_admission_phases"] = {k: round(v, 4) for k, v in admits[-1]["phases"].items()}
            joiner_admits = [r for r in run["all"] if r.get("event") == "admit" and "stream_s" in r.get("phases", {})]
            if joiner_admits:
                ph = joiner_admits[-1]["phases"]
                out["resilient_joiner_stream_s"] = round(ph["stream_s"] - ph.get("admitted_s", 0.0), 4)
    for cfg in ("default", "tuned"):
        t, r = out.get(f"torchft_{cfg}_lost_s"), out.get("resilient_lost_s")
        out[f"ratio_vs_{cfg}"] = _r(t / r) if (t is not None and r is not None and r > 0) else None
    r, t = out.get("resilient_step_s"), out.get("torchft_tuned_step_s")
    out["step_time_vs_torchft_tuned"] = _r(r / t) if (r and t) else None
    out["loadavg"] = [list(load0), list(os.getloadavg())]
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small size only, 16 steps, kill at step 6")
    ap.add_argument("--size", action="append", default=[],
                    help="small | realistic | LAYERS:DIM:COMPUTE_S (repeatable; default: small and realistic)")
    ap.add_argument("--case", action="append", default=[], choices=["start", "allreduce", "none"],
                    help="kill case (repeatable; default: start and allreduce)")
    ap.add_argument("--steps", type=int, default=0, help="committed steps per run (default 40, quick 16)")
    ap.add_argument("--kill-step", type=int, default=0, help="step at which rank 1 is killed (default 10, quick 6)")
    ap.add_argument("--kill-delay", type=float, default=0.02,
                    help="case allreduce: seconds after the victim's first bucket entered the allreduce")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (both systems)")
    ap.add_argument("--run-timeout", type=float, default=180.0, help="seconds before a run counts as hung")
    ap.add_argument("--systems", default="resilient,torchft-default,torchft-tuned",
                    help="comma-separated subset of resilient,torchft-default,torchft-tuned")
    ap.add_argument("--keep", action="store_true", help="keep the run logs (path printed on stderr)")
    # worker mode (internal)
    ap.add_argument("--worker", choices=["resilient", "torchft"], help=argparse.SUPPRESS)
    ap.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=sorted(TORCHFT), default="tuned", help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("--compute", type=float, default=0.05, help=argparse.SUPPRESS)
    ap.add_argument("--log-dir", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.case = a.case[-1] if a.case else "none"
        return a
    a.steps = a.steps or (16 if a.quick else 40)
    a.kill_step = a.kill_step or (6 if a.quick else 10)
    if not 4 <= a.kill_step < a.steps - 3:
        ap.error(f"--kill-step {a.kill_step} must be >= 4 and leave >= 3 steps before --steps {a.steps}")
    a.size = a.size or (["small"] if a.quick else ["small", "realistic"])
    for s in a.size:
        if s not in SIZES:
            try:
                layers, dim, comp = s.split(":")
                SIZES[s] = (int(layers), int(dim), float(comp))
            except ValueError:
                ap.error(f"--size {s!r}: use small, realistic or LAYERS:DIM:COMPUTE_S (e.g. 4:2048:0.5)")
    a.case = a.case or ["start", "allreduce"]
    a.systems = [x for x in a.systems.split(",") if x]
    bad = [x for x in a.systems if x not in ("resilient", "torchft-default", "torchft-tuned")]
    if bad or not a.systems:
        ap.error(f"--systems {bad or a.systems}: pick from resilient, torchft-default, torchft-tuned")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker == "resilient":
        return worker_resilient(a)
    if a.worker == "torchft":
        return worker_torchft(a)
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise SystemExit("bench/vs_torchft.py needs torchft: pip install -e '.[bench]' (torchft-nightly)") from None
    tmp = Path(tempfile.mkdtemp(prefix="vs_torchft-"))
    try:
        for size_name in a.size:
            ff: dict[str, float | None] = {}
            for case in a.case:
                print(json.dumps(bench_case(a, size_name, SIZES[size_name], case, tmp, ff)), flush=True)
    finally:
        if a.keep:
            print(f"logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
