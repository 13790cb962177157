"""Compressed allreduce benchmark: 4 members in network namespaces, links capped with htb.

    sudo .venv/bin/python bench/compression.py [--caps 100,400,0] [--sizes 4,16,64] [--iters 3] [--no-kill]

Each member runs in its own namespace of a :class:`resilient.chaos.netns.NetnsLab`; its
egress is capped by an ``htb`` root class at ``cap`` MB/s (0 = uncapped). Arms, side by
side in one run per cap: gloo fp32, gloo with torch's fp16-hook semantics (cast to fp16,
allreduce, cast back, divide), resilient fp32, resilient q8 / q4 (the exact compressed
allreduce), and resilient ``compression="auto"`` (the switch).

**Every output of every resilient arm is checked bitwise**, on every member — the two
untimed warm-up calls per arm, every timed call, the switch's probes and every auto and
paired fp32 call (``bench/_compression_check.py``): a compressed output against
``fl32(sum_{i in C} s * q_i)`` over ``C = work.contributors``, with the scales recomputed
from the scale contributors' inputs (and compared with the agreed ones); an fp32 output
against the float ring's sum recomputed in the ring's own order (chunk ``c`` summed from
``members[c]`` around the ring: the fixed order that makes it bitwise identical on every
member). Each expected value is computed once per size; a check runs after its call has
stopped the timer. One JSON line per (cap, size): ``cap_mb_s`` (null uncapped),
``size_mib``, ``q4_vs_fp32``, ``q8_vs_fp32``, ``q4_vs_gloo_fp16``, ``switch_choice``,
``switch_loss`` (auto's time over the best arm's, minus 1; timed after the switch's probes,
in its steady state), ``switch_vs_fp32`` (auto over plain resilient fp32, the two timed
alternately call by call, ``max(paired_rounds, iters * 64 / size)`` rounds
(``--paired-rounds``, 15 by default: with 3 rounds the median of two identical ops differed
by up to 32 % at 64 MiB on this loaded 2-core machine); ``switch_vs_fp32_mean`` the same
from mean times, which include the votes), ``switch_votes`` (votes held in those calls: one
every ``revote_every`` = 64), ``switch_measured`` (per member, the seconds the switch's
probes measured for fp32 and q4: it picks q4 only when every member measured q4 faster by
its margin), ``exact`` (every checked output on every member was exact),
``outputs_checked`` (how many, all members together; ``check_failures`` names the first
mismatches when there are any), and the median seconds per arm.

**Kill cases** (on by default; ``--no-kill`` skips them): after the timed runs, for each of
``--kill-bits`` (4,8) and each phase of the compressed allreduce — ``scale`` (the scale
agreement's recursive doubling), ``rs`` and ``ag`` (the integer ring's reduce-scatter and
all-gather) — a fresh coordinator and 4 members run one ``--kill-size`` MiB (16) allreduce
at ``--kill-cap`` MB/s (100; uncapped with ``--loopback``) while member m2 SIGKILLs itself
at the phase's failpoint (``KILL_PHASES``; this driver revokes its lease the moment it
exits, as the node agent does). Every survivor checks its output as above, against its
reported contributors and scale contributors. One JSON line per case: ``case`` "kill",
``phase``, ``failpoint``, ``bits``, ``cap_mb_s``, ``size_mib``, ``victim``, ``killed``
(it died of SIGKILL), ``survivors``, ``contributors``, ``scale_contributors``,
``victim_in_sum``, ``recovered_ops``, ``identical`` (the survivors' outputs bitwise equal),
``exact`` (identical, one agreed contributor set, and every survivor's output exact),
``seconds`` (the op on the slowest survivor) and ``case_seconds`` (the whole case: start,
run, checks, teardown).

Every member runs torch with one intra-op thread (``torch.set_num_threads(1)``, what
``resilient-run`` sets for several workers per node), for every arm alike.

``--loopback --caps 0`` runs the uncapped case without namespaces (no root): every
member on 127.0.0.1. Otherwise it needs root (namespaces, tc) and etcd; every process,
namespace and the etcd it starts are ended here, by an error too. Figures depend on the
machine's load: report ``/proc/loadavg`` with them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import rank_worker_argparser  # noqa: E402
from _netcap import MemberLab, cap_egress, member_lab  # noqa: E402

from resilient.chaos.netns import NetnsLab  # noqa: E402

if TYPE_CHECKING:
    import torch

    from resilient.collectives import Communicator
PY = sys.executable
WORLD = 4

from resilient.process_pool import DEVNULL, PIPE, ProcessPool, Spec  # noqa: E402 - after the path insert


def _input(rank: int, numel: int, step: int) -> torch.Tensor:
    import torch

    g = torch.Generator().manual_seed(rank * 7919 + numel + step)
    return torch.randn(numel // 1024, 1024, generator=g)


def _timed(fn: Callable[[], Any], iters: int, check: Callable[[Any], object] | None = None) -> float:
    """Median seconds of ``iters`` calls of ``fn``; ``check(fn's result)`` after each call
    has stopped its timer (every output is checked, none of it timed)."""
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        r = fn()
        ts.append(time.perf_counter() - t0)
        if check is not None:
            check(r)
    return statistics.median(ts)


def _member(args: argparse.Namespace) -> Communicator:
    """Member ``m<rank>`` over a TCP transport bound to ``--ip``, registered on its own
    lease (announced as ``LEASE m<rank> <id>`` on stdout for the driver's
    :class:`LeaseReaper`), once the whole world is in the epoch. Its ``close()`` says
    goodbye and lingers until the peers finished the last op (or serves a recovery of it),
    as a worker's ``destroy_process_group`` does: a member that finished an op a peer still
    recovers must not leave before it has served its result."""
    import resilient
    from resilient.transport.tcp import TcpTransport

    mid = f"m{args.rank}"
    return resilient.connect(args.etcd, args.job, mid, world=WORLD, timeout=60, ttl=10,
                             transport=TcpTransport(mid, args.job, host=args.ip),
                             on_registered=lambda s: print(f"LEASE {mid} {s.lease_id}", flush=True),
                             op_timeout=120)


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from _compression_check import Checker

    # one intra-op thread per member, as resilient-run (and torchrun) set for several
    # workers per node: 4 members share this machine's cores, for every arm alike
    torch.set_num_threads(1)
    rank = args.rank
    sizes = [int(s) for s in args.sizes.split(",")]
    res: dict[int, dict[str, Any]] = {s: {} for s in sizes}   # size -> arm -> seconds (and the switch's facts)
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    dist.init_process_group("gloo", init_method=f"tcp://{args.ip0}:{args.gloo_port}", rank=rank, world_size=WORLD)
    for s in sizes:
        numel = s << 18
        x = _input(rank, numel, 0)
        t = x.clone()
        dist.all_reduce(t)  # warm-up (connections)

        def g32() -> None:
            t.copy_(x)
            dist.all_reduce(t)

        def g16() -> None:  # torch's fp16_compress_hook: cast, allreduce, cast back, divide
            h = x.to(torch.float16).div_(WORLD)
            dist.all_reduce(h)
            t.copy_(h)

        res[s]["gloo_fp32"] = _timed(g32, args.iters)
        res[s]["gloo_fp16"] = _timed(g16, args.iters)
    dist.destroy_process_group()

    comm = _member(args)
    for s in sizes:
        numel = s << 18
        x = _input(rank, numel, 0)
        t = x.clone()
        chk = Checker(lambda m: _input(int(m[1:]), numel, 0))
        for r in range(WORLD):   # the inputs the expected values are made of, before any op
            chk.input(f"m{r}")

        def check(w: Any, compressed: bool) -> None:
            """This call's output in ``t`` against its contract (outside every timer)."""
            L = comm.retained   # the ledger of the op that just finished (the ring's, compressed)
            if not compressed:
                chk.fp32(t, w.contributors, L)
            elif comm.last_compression is None or L is None or comm.last_compression["seq"] != L.seq:
                chk.fail("a compressed call left no record of its own")
            else:
                chk.compressed(t, w.contributors, comm.last_compression)

        for arm, comp in (("res_fp32", None), ("res_q8", "q8"), ("res_q4", "q4")):
            def run(comp: str | None = comp) -> Any:
                t.copy_(x)
                return comm.allreduce(t, compression=comp)

            def check_arm(w: Any, comp: str | None = comp) -> None:
                check(w, comp is not None)
            # two untimed calls first (checked like every other): the first fp32 call opens
            # the connections, the first compressed arm of a size faults in its q buffers
            # (two: last_compression holds the previous call's q), which cost q8 at 64 MiB up
            # to 1 s per call; and the first check of an arm computes its expected value
            for _ in range(2):
                check_arm(run())
            res[s][arm] = _timed(run, args.iters, check_arm)
        chk.release()   # every expected value is made (a fault-free run needs no other)
        choices = []

        def auto() -> Any:
            t.copy_(x)
            w = comm.allreduce(t, compression="auto")
            choices.append(comm.compression_switch.last_choice)
            return w

        def check_auto(w: Any) -> None:
            check(w, choices[-1] != "fp32")

        def fp32() -> Any:
            return comm.allreduce(t.copy_(x))

        def check_fp32(w: Any) -> None:
            check(w, False)
        sw = comm.compression_switch
        for _ in range(8):   # the probes (fp32 measures the link, then q4 if the model predicts a gain)
            if sw is not None and sw.plans and not sw.needs_vote(numel * 4, 4, comm.admitted_at):
                break
            check_auto(auto())
            sw = comm.compression_switch
        votes0 = sw.votes if sw is not None else 0
        # auto and plain fp32 alternate call by call, so a load change hits both alike;
        # max(paired_rounds, iters x (64 MiB / size)) rounds: a small op gets more (and its
        # share of the votes); a floor of rounds so that two medians of the same op agree
        fp32_t, auto_t = [], []
        for _ in range(max(args.paired_rounds, args.iters * max(1, 64 // s))):
            fp32_t.append(_timed(fp32, 1, check_fp32))
            auto_t.append(_timed(auto, 1, check_auto))
        res[s]["res_auto"] = statistics.median(auto_t)
        res[s]["res_fp32_paired"] = statistics.median(fp32_t)
        res[s]["res_auto_mean"], res[s]["res_fp32_paired_mean"] = statistics.mean(auto_t), statistics.mean(fp32_t)
        res[s]["switch_choice"] = choices[-1]
        sw = comm.compression_switch   # what its probes measured (size class of the op), per member
        c = (numel * 4).bit_length()
        res[s]["switch_measured"] = ({arm: round(sw.measured[(c, arm)], 4) for arm in ("fp32", "q4")
                                      if (c, arm) in sw.measured} if sw is not None else {})
        res[s]["switch_votes"] = (comm.compression_switch.votes - votes0) if comm.compression_switch else 0
        res[s]["exact"], res[s]["outputs_checked"] = chk.exact, chk.checked
        if chk.failures:
            res[s]["check_failures"] = chk.failures
    print(json.dumps({"rank": rank, "results": res}), flush=True)
    comm.close()
    return 0


#: a SIGKILL in each phase of one compressed allreduce (its ops: #0 the scale agreement,
#: recursive doubling of the bucket maxima; #1 the integer ring): phase -> failpoint
KILL_PHASES = {"scale": "kill@op=0,phase=rd,frac=0.5", "rs": "kill@op=1,phase=rs,frac=0.5",
               "ag": "kill@op=1,phase=ag,frac=0.5"}
VICTIM = 2


def kill_worker(args: argparse.Namespace) -> int:
    """One member of a kill case: one ``q<bits>`` allreduce of ``--kill-size`` MiB (the
    victim SIGKILLs itself at its failpoint); a survivor checks its output against
    ``fl32(sum_{i in C} s*q_i)`` recomputed from the inputs of its reported contributors
    (scales from its reported scale contributors) and prints one JSON line with a digest
    of the output bits (the driver compares the survivors')."""
    import hashlib

    import torch

    from _compression_check import Checker

    torch.set_num_threads(1)
    comm = _member(args)
    numel = args.kill_size << 18
    t = _input(args.rank, numel, 0)
    t0 = time.perf_counter()
    w = comm.allreduce(t, compression=f"q{args.bits}")
    seconds = time.perf_counter() - t0
    info = comm.last_compression
    assert info is not None   # the op ran compressed
    chk = Checker(lambda m: _input(int(m[1:]), numel, 0))
    chk.compressed(t, w.contributors, info)
    print(json.dumps({"rank": args.rank, "contributors": sorted(w.contributors),
                      "scale_contributors": sorted(info["scale_contributors"]),
                      "members_bound": info["members_bound"],
                      "recovered_ops": [] if comm.last_recovery is None else [comm.last_recovery.seq],
                      "exact": chk.exact, "failures": chk.failures, "seconds": round(seconds, 4),
                      "digest": hashlib.sha256(t.numpy().tobytes()).hexdigest()}), flush=True)
    comm.close()
    return 0


def _coordinator(pool: ProcessPool, etcd: str, job: str) -> None:
    pool.start(Spec([PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "coordinator",
                     "--etcd", etcd, "--job", job, "--ttl", "10", "--metrics-port", "-1",
                     "--log-level", "WARNING"], stdout=DEVNULL, stderr=DEVNULL, cwd=ROOT, name="coordinator"))


def run_kill(lab: MemberLab, etcd: str, mb_s: float, bits: int, phase: str,
             args: argparse.Namespace) -> dict[str, object]:
    """One kill case: a fresh coordinator and ``WORLD`` members, member ``m<VICTIM>``
    SIGKILLed at ``KILL_PHASES[phase]``; this driver plays the node agent (a
    :class:`LeaseReaper` revokes the victim's lease the moment it exits). Every process is
    ended by PID on the way out, by an error too."""
    import tempfile

    from resilient.launcher.lease_reaper import LeaseReaper

    job = f"compress-kill-{uuid.uuid4().hex[:8]}"
    victim = f"m{VICTIM}"
    t_case = time.monotonic()
    out: dict[str, list[str]] = {f"m{i}": [] for i in range(WORLD)}
    reaper = LeaseReaper(job, endpoints=etcd)
    with tempfile.TemporaryDirectory(prefix="bench-compression-kill-") as tmp, ProcessPool() as pool:
        try:
            _coordinator(pool, etcd, job)
            members = []
            for i in range(WORLD):
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                env.pop("RESILIENT_FAILPOINTS", None)
                if i == VICTIM:
                    env["RESILIENT_FAILPOINTS"] = KILL_PHASES[phase]
                cmd = [*lab.exec_prefix(i), PY, str(Path(__file__).resolve()), "--worker", "--kill-phase", phase,
                       "--rank", str(i), "--ip", lab.ips[i], "--etcd", etcd, "--job", job,
                       "--bits", str(bits), "--kill-size", str(args.kill_size)]
                c = pool.start(Spec(cmd, stdout=PIPE, stderr=Path(tmp) / f"m{i}.err", cwd=ROOT, env=env,
                                    name=f"m{i}"))
                reaper.watch(c, f"m{i}", failures_only=True, lines=out[f"m{i}"])
                members.append(c)
            codes = pool.wait(min(args.timeout, 300), members)
        finally:
            pool.stop(grace=0, sig=signal.SIGKILL)
            reaper.close()
            errs = {f"m{i}": (Path(tmp) / f"m{i}.err").read_text()[-3000:] for i in range(WORLD)
                    if (Path(tmp) / f"m{i}.err").exists()}
    survivors = [f"m{i}" for i in range(WORLD) if i != VICTIM]
    for m in survivors:
        if codes[int(m[1:])] != 0:
            raise RuntimeError(f"kill case {phase} q{bits}: survivor {m} failed ({codes[int(m[1:])]}): {errs.get(m)}")
    recs = {m: json.loads(out[m][-1]) for m in survivors}
    C = {tuple(r["contributors"]) for r in recs.values()}
    SC = {tuple(r["scale_contributors"]) for r in recs.values()}
    identical = len({r["digest"] for r in recs.values()}) == 1
    return {"case": "kill", "phase": phase, "failpoint": KILL_PHASES[phase], "bits": bits, "cap_mb_s": mb_s or None,
            "size_mib": args.kill_size, "victim": victim, "killed": codes[VICTIM] == -signal.SIGKILL,
            "survivors": survivors,
            "contributors": list(next(iter(C))) if len(C) == 1 else sorted(C),
            "scale_contributors": list(next(iter(SC))) if len(SC) == 1 else sorted(SC),
            "victim_in_sum": any(victim in c for c in C),
            # the ops each survivor finished by recovery (#0 the scale agreement, #1 the ring)
            "recovered_ops": sorted({k for r in recs.values() for k in r["recovered_ops"]}),
            "identical": identical,
            "exact": identical and len(C) == 1 and len(SC) == 1 and all(r["exact"] for r in recs.values()),
            "seconds": max(r["seconds"] for r in recs.values()),
            "case_seconds": round(time.monotonic() - t_case, 1),   # processes started, run, checked, ended
            **({} if identical and len(C) == 1 else
               {"per_survivor": {m: {"contributors": r["contributors"], "digest": r["digest"][:16],
                                     "recovered_ops": r["recovered_ops"]} for m, r in recs.items()}}),
            **({"check_failures": {m: r["failures"] for m, r in recs.items() if r["failures"]}}
               if any(r["failures"] for r in recs.values()) else {})}


def run_cap(lab: MemberLab, etcd: str, mb_s: float, args: argparse.Namespace) -> list[dict[str, object]]:
    job = f"compress-{uuid.uuid4().hex[:8]}"
    if isinstance(lab, NetnsLab):
        for i in range(WORLD):
            cap_egress(lab, i, mb_s)
    with ProcessPool() as pool:   # every process stopped by PID on the way out
        _coordinator(pool, etcd, job)
        procs = []
        port = 29500 + int(uuid.uuid4().int % 1000)
        for i in range(WORLD):
            cmd = [*lab.exec_prefix(i), PY, str(Path(__file__).resolve()), "--worker", "--rank", str(i),
                   "--ip", lab.ips[i], "--ip0", lab.ips[0], "--ifname", lab.ns_veths[i], "--gloo-port", str(port),
                   "--etcd", etcd, "--job", job, "--sizes", args.sizes, "--iters", str(args.iters),
                   "--paired-rounds", str(args.paired_rounds)]
            procs.append(pool.start(Spec(cmd, stdout=PIPE, stderr=PIPE, cwd=ROOT,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT)), name=f"m{i}")).popen)
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=args.timeout)
            if p.returncode != 0:
                raise RuntimeError(f"worker failed ({p.returncode}): {err[-3000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    lines = []
    for s in [int(x) for x in args.sizes.split(",")]:
        per = [o["results"][str(s)] for o in outs]
        t = {k: max(r[k] for r in per) for k in per[0] if k.startswith(("gloo", "res"))}  # slowest member
        best = min(t["res_fp32"], t["res_q4"])
        lines.append({"cap_mb_s": mb_s or None, "size_mib": s, "q4_vs_fp32": round(t["res_fp32"] / t["res_q4"], 3),
                      "q8_vs_fp32": round(t["res_fp32"] / t["res_q8"], 3),
                      "q4_vs_gloo_fp16": round(t["gloo_fp16"] / t["res_q4"], 3),
                      "switch_choice": per[0]["switch_choice"],
                      "switch_agreed": len({r["switch_choice"] for r in per}) == 1,
                      "switch_loss": round(t["res_auto"] / best - 1, 3),
                      "switch_vs_fp32": round(t["res_auto"] / t["res_fp32_paired"] - 1, 3),
                      "switch_vs_fp32_mean": round(t["res_auto_mean"] / t["res_fp32_paired_mean"] - 1, 3),
                      "switch_votes": max(r["switch_votes"] for r in per),
                      "switch_measured": [r.get("switch_measured") for r in per],
                      "exact": all(r["exact"] for r in per),
                      "outputs_checked": sum(r["outputs_checked"] for r in per),
                      "seconds": {k: round(v, 4) for k, v in t.items()},
                      **({"check_failures": [r.get("check_failures") for r in per]}
                         if any(r.get("check_failures") for r in per) else {})})
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = rank_worker_argparser(__doc__.splitlines()[0])
    ap.add_argument("--ip", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ip0", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ifname", default="", help=argparse.SUPPRESS)
    ap.add_argument("--gloo-port", type=int, default=29500, help=argparse.SUPPRESS)
    ap.add_argument("--caps", default="100,400,0", help="MB/s per member egress, 0 = uncapped")
    ap.add_argument("--sizes", default="4,16,64", help="MiB of float32 per allreduce")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--paired-rounds", type=int, default=15,
                    help="floor on the rounds of auto and plain fp32 timed alternately (switch_vs_fp32)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--loopback", action="store_true",
                    help="no namespaces (no root needed): members on 127.0.0.1, uncapped only (--caps 0)")
    ap.add_argument("--no-kill", action="store_true", help="skip the SIGKILL cases")
    ap.add_argument("--kill-phases", default=",".join(KILL_PHASES),
                    help="phases of the compressed allreduce a member is SIGKILLed in, one case each")
    ap.add_argument("--kill-bits", default="4,8", help="bit widths of the kill cases")
    ap.add_argument("--kill-cap", type=float, default=100, help="MB/s per member egress in the kill cases")
    ap.add_argument("--kill-size", type=int, default=16, help="MiB of float32 in the kill cases")
    ap.add_argument("--kill-phase", default="", help=argparse.SUPPRESS)
    ap.add_argument("--bits", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return kill_worker(args) if args.kill_phase else worker(args)
    phases = [] if args.no_kill else [x for x in args.kill_phases.split(",") if x]
    if any(x not in KILL_PHASES for x in phases):
        ap.error(f"--kill-phases: choose from {','.join(KILL_PHASES)}")
    kill_cap = 0.0 if args.loopback else args.kill_cap
    from resilient.coordinator.local_etcd import LocalEtcd

    if args.loopback and any(float(c) for c in args.caps.split(",") if c):
        ap.error("--loopback runs uncapped only: pass --caps 0")
    with member_lab(WORLD, args.loopback) as lab, LocalEtcd(host=lab.host_ip) as etcd:
        for cap in [float(c) for c in args.caps.split(",") if c]:
            for line in run_cap(lab, etcd.endpoint_arg, cap, args):
                print(json.dumps(line), flush=True)
        if phases and isinstance(lab, NetnsLab):
            for i in range(WORLD):
                cap_egress(lab, i, kill_cap)
        for bits in [int(b) for b in args.kill_bits.split(",") if b] if phases else []:
            for phase in phases:
                print(json.dumps(run_kill(lab, etcd.endpoint_arg, kill_cap, bits, phase, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
