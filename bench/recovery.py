"""Resume vs restart after a SIGKILL in the middle of a large allreduce.

    python bench/recovery.py --world 4 --size 64M [--victim 2] [--phases rs,ag] [--op reduce_scatter]

For each phase (reduce-scatter ``rs``, all-gather ``ag``) a fresh real etcd, coordinator
and ``--world`` member processes. Ops: #0 allreduce (warm-up, connections), #1 barrier,
#2 the measured ``--size`` float32 SUM allreduce (``--op reduce_scatter``: a reduce-scatter
of ``--size`` per member, one input of ``size/world`` per member), during which member ``m<victim>``
SIGKILLs itself (failpoint ``kill@op=2,phase=<phase>,frac=0.5``). This script plays the
node agent: it sees the exit and revokes the dead member's lease at once. Then the
survivors run #3 barrier and #4 a fresh op of the same kind in the new epoch (the
reduce-scatter: one input per survivor): the from-scratch redo a restart would do. Both
run the algorithm the product selects (``algorithm``, ``redo_algorithm`` in the output). One JSON line per phase::

    {"phase", "recovery_s", "resent_fraction", "restart_s", ...}

(medians over ``--repeat`` fresh runs; each run's values are listed under ``runs``)

* ``recovery_s`` = kill (the agent sees the exit) -> op #2 complete on every survivor;
* ``restart_s`` = ``detect_s`` (kill -> the epoch without the victim is seen here) +
  the slowest survivor's time for op #4;
* ``resent_fraction`` = bytes the survivors sent in recovery (``Communicator.
  last_recovery["bytes_sent"]``, summed) / bytes they sent in op #4 (``TransportStats``);
  ``op_sent_fraction`` = all bytes the survivors sent during op #2 / op #4's bytes,
  for context. ``expected_resent`` is the planner's cost model (:func:`model_resent`,
  members in lockstep): what is possible, to compare with.
Each survivor also checks its result equals the reduction over the reported
contributors (inputs are ``member index + 1``), reported as ``exact``.
Failure behaviour: a survivor that raises or hangs makes the run fail with its stderr.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import BenchCluster, emit, join, parse_size, wait_go, worker_argparser  # noqa: E402


def worker(args) -> None:
    import torch

    from resilient.collectives.algorithms import select

    torch.set_num_threads(1)
    comm, transport, session, index = join(args, op_timeout=30.0)
    numel = args.size // 4
    emit("ready")
    wait_go()
    rs = args.op == "reduce_scatter"

    def measured() -> tuple[Any, torch.Tensor, str]:
        """The measured op (inputs ``index + 1``): its Work, its result, and the algorithm
        its epoch selects (read before it runs)."""
        members, n = list(comm.members), comm.size
        m = numel // args.world if rs else numel
        if rs:   # one input of size/world per member of the group now; the result is this member's chunk
            algo = select.per_member("reduce_scatter", members, comm.epoch, n, m, 4, comm.sizing).algorithm
            out = torch.empty(m)
            w = comm.reduce_scatter(out, [torch.full((m,), float(index + 1)) for _ in range(n)])
        else:
            algo = select.allreduce(members, comm.epoch, m, 4, comm.sizing)[1]
            out = torch.full((m,), float(index + 1))
            w = comm.allreduce(out)
        return w, out, type(algo).__name__

    x = torch.full((numel,), float(index + 1))
    comm.allreduce(x)                                     # op 0
    comm.barrier()                                        # op 1
    sent0 = transport.stats.bytes_sent
    t0 = time.perf_counter()
    w, x, algo = measured()                               # op 2 (victim dies in it)
    t_done = time.time()
    op_s = time.perf_counter() - t0
    op_bytes = transport.stats.bytes_sent - sent0
    rec = comm.last_recovery.as_dict() if comm.last_recovery and comm.last_recovery.seq == 2 else None
    contributors = list(w.contributors)
    expect = float(sum(int(m.lstrip("m")) + 1 for m in contributors))
    exact = bool(torch.all(x == expect).item())
    emit("op", t_done=t_done, op_s=op_s, op_bytes=op_bytes, recovery=rec, contributors=contributors, exact=exact,
         algorithm=algo)
    comm.barrier()                                        # op 3, new epoch
    sent0 = transport.stats.bytes_sent
    t0 = time.perf_counter()
    _, _, algo = measured()                               # op 4: from scratch among survivors
    emit("redo", seconds=time.perf_counter() - t0, bytes=transport.stats.bytes_sent - sent0, algorithm=algo)
    wait_go()
    comm.close()  # leaves the group, then closes the transport, the session and the store


def model_resent(n: int, phase: str, frac: float, victim: int, slices: int = 16) -> float:
    """The planner's cost model: members in lockstep, ``victim`` dies when every member
    has done ``frac`` of ``phase``; transfers of the plan / a from-scratch ring allreduce
    among the n-1 survivors (2(n-2) piece sends per piece). What is possible, to compare
    the measured ``resent_fraction`` with (docs/design.md §3: about 0.8 / 0.2 at n = 4)."""
    from resilient.collectives import recovery as rc

    done_total = int((n - 1) * slices * frac)
    step, done = divmod(done_total, slices)
    full = (1 << n) - 1
    held = [[0] * (n * slices) for _ in range(n)]
    for c in range(n):
        for k in range(slices):
            piece = c * slices + k
            rs_steps = n - 1 if phase == "ag" else step + (1 if k < done else 0)
            for j in range(rs_steps + 1):  # chunk c starts at member c; member c+j holds arc [c..c+j]
                held[(c + j) % n][piece] = rc.mask_of([(c + i) % n for i in range(j + 1)])
            if phase == "ag":
                for j in range(step + (1 if k < done else 0) + 1):
                    held[(c - 1 + j) % n][piece] = full
    members = [f"m{i}" for i in range(n)]
    ring = [m for i, m in enumerate(members) if i != victim]
    plan = rc.plan_recovery(members, ring, {members[i]: held[i] for i in range(n) if i != victim})
    return len(plan.transfers()) / (2 * (n - 2) * n * slices)


def ledger_state(cl: BenchCluster, epochs: list[int], survivors: list[str]) -> dict | None:
    """From the ledger statuses the survivors published for the recovery (epochs/<n>/data/
    ledger/<member>): how many pieces of op #2 no survivor held fully reduced, per chunk
    (the chunks whose loss forces the survivors' set in all-gather)."""
    from resilient.coordinator import EpochData
    from resilient.collectives.ledger import decode_status

    if not epochs:
        return None
    raw = EpochData(cl.store, cl.job, min(epochs)).get_all("ledger")
    masks = {}
    for m in survivors:
        if m in raw:
            st = decode_status(raw[m])
            for key in ("inflight", "retained"):
                if st.get(key) and st[key]["seq"] == 2:
                    masks[m] = (st[key]["masks"], (1 << st[key]["n_members"]) - 1)
                    break
    if not masks:
        return None
    n_pieces = len(next(iter(masks.values()))[0])
    full = next(iter(masks.values()))[1]
    chunks = full.bit_length()
    per_chunk = n_pieces // chunks
    missing: dict[str, int] = {}
    for q in range(n_pieces):
        if not any(ms[q] == full for ms, _ in masks.values()):
            missing[str(q // per_chunk)] = missing.get(str(q // per_chunk), 0) + 1
    return {"slices_per_chunk": per_chunk, "missing_by_chunk": missing}


def run_case(args, phase: str) -> dict:
    from resilient.coordinator import EpochWatcher

    victim = f"m{args.victim}"
    spec = f"kill@op=2,phase={phase},frac={args.frac}"
    env_for = (lambda mid: {"RESILIENT_FAILPOINTS": spec} if mid == victim else {})
    with BenchCluster(os.path.abspath(__file__), args.world, job=f"bench-recovery-{phase}",
                      worker_args=["--size", str(args.size), "--op", args.op, "--world", str(args.world)],
                      env_for=env_for) as cl:
        survivors = [m for m in sorted(cl.procs) if m != victim]
        watcher = EpochWatcher(cl.store, cl.job)
        epoch_seen: list[float] = []

        def watch_epoch() -> None:
            watcher.wait_for(lambda e: victim not in e.members, 600)
            epoch_seen.append(time.time())

        th = threading.Thread(target=watch_epoch, daemon=True)
        th.start()
        cl.watch_exit(victim)
        cl.send(sorted(cl.procs), "go")
        ops = cl.expect_all(survivors, "op", timeout=600)
        redo = cl.expect_all(survivors, "redo", timeout=600)
        th.join(10)
        if victim not in cl.exit_at:
            raise SystemExit(f"the victim {victim} did not die: is the failpoint {spec!r} reached?")
        t_kill = cl.exit_at[victim]
        detect_s = epoch_seen[0] - t_kill if epoch_seen else None
        recovery_s = max(o["t_done"] for o in ops.values()) - t_kill
        redo_s = max(r["seconds"] for r in redo.values())
        redo_bytes = sum(r["bytes"] for r in redo.values())
        recs = [o["recovery"] for o in ops.values()]
        resent = sum(r["bytes_sent"] for r in recs if r) if any(recs) else None
        held = ledger_state(cl, [o["recovery"]["epoch"] for o in ops.values() if o["recovery"]], survivors)
        cl.send(survivors, "quit")
        return {
            "phase": phase, "op": args.op,
            "algorithm": sorted({o["algorithm"] for o in ops.values()}),
            "redo_algorithm": sorted({r["algorithm"] for r in redo.values()}),
            "recovery_s": round(recovery_s, 4),
            # (None also when the redo moved next to nothing over the transport: a direct shared-memory redo)
            "resent_fraction": round(resent / redo_bytes, 4) if resent is not None and redo_bytes >= args.size // 100 else None,
            "restart_s": round((detect_s or 0.0) + redo_s, 4),
            "detect_s": round(detect_s, 4) if detect_s is not None else None,
            "redo_allreduce_s": round(redo_s, 4),
            "expected_resent": round(model_resent(args.world, phase, args.frac, args.victim), 4),
            "op_sent_fraction": round(sum(o["op_bytes"] for o in ops.values()) / redo_bytes, 4),
            "recovered_on": sorted(m for m, o in ops.items() if o["recovery"]),
            "recovery_protocol_s": max((r["seconds"] for r in recs if r), default=None),
            # where the slowest survivor's recovery went: ledger-status exchange, planning, execution
            "recovery_breakdown_s": {k: round(max((r.get(k, 0.0) for r in recs if r), default=0.0), 4)
                                     for k in ("status_s", "plan_s", "execute_s", "wait_recv_s", "wait_send_s", "reduce_s")},
            # per survivor: seconds after the kill at which it saw the abort, entered recovery,
            # adopted the epoch, had every ledger status, finished
            "timeline_after_kill_s": {m: {k: (round(v - t_kill, 4) if v else None) for k, v in o["recovery"]["timeline"].items()}
                                      for m, o in sorted(ops.items()) if o["recovery"] and o["recovery"].get("timeline")},
            "link_retries": sum(r.get("link_retries", 0) for r in recs if r),
            "plan_rounds": max((r.get("rounds", 0) for r in recs if r), default=None),
            # where each survivor's plan came from: "summaries" (it planned from every
            # survivor's) or "planner" (its slice, over the tree: RESILIENT_LEDGER_DIRECT_MAX)
            "plan_from": sorted({r.get("plan_from", "summaries") for r in recs if r}),
            "contributors": sorted({tuple(o["contributors"]) for o in ops.values()}),
            "exact": all(o["exact"] for o in ops.values()),
            "pieces_without_full_copy": held,
            "world": args.world, "size_bytes": args.size, "victim": victim, "failpoint": spec,
        }


def main() -> None:
    ap = worker_argparser(__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--size", default="64M", help="allreduce size (K/M/G suffixes)")
    ap.add_argument("--victim", type=int, default=2, help="index of the member that is killed")
    ap.add_argument("--frac", type=float, default=0.5, help="progress in the phase at which it is killed")
    ap.add_argument("--phases", default="rs,ag")
    ap.add_argument("--op", default="allreduce", choices=["allreduce", "reduce_scatter"],
                    help="the measured op (reduce_scatter: one input of size/world per member; phase rs only)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="fresh clusters per phase; recovery_s/restart_s/resent_fraction are their medians")
    args = ap.parse_args()
    args.size = parse_size(str(args.size))
    args.size -= args.size % 4
    if args.worker:
        worker(args)
        os._exit(0)
    if args.world < 3 or not 0 <= args.victim < args.world:
        raise SystemExit("--world must be >= 3 and --victim a member index below it")
    for phase in args.phases.split(","):
        runs = [run_case(args, phase.strip()) for _ in range(max(1, args.repeat))]
        print(json.dumps(summarize(runs)), flush=True)


def summarize(runs: list[dict]) -> dict:
    """Medians of the headline numbers over ``runs``; every run's own values listed."""
    def med(key: str):
        vals = [r[key] for r in runs if r[key] is not None]
        return round(statistics.median(vals), 4) if vals else None

    head = {"phase": runs[0]["phase"], "op": runs[0]["op"], "algorithm": runs[0]["algorithm"],
            "redo_algorithm": runs[0]["redo_algorithm"], "recovery_s": med("recovery_s"), "resent_fraction": med("resent_fraction"),
            "restart_s": med("restart_s"), "detect_s": med("detect_s"), "redo_allreduce_s": med("redo_allreduce_s"),
            "expected_resent": runs[0]["expected_resent"], "repeat": len(runs),
            "recovery_lt_restart": sum(r["recovery_s"] < r["restart_s"] for r in runs),
            "full_set_kept": sum(len(r["contributors"]) == 1 and len(r["contributors"][0]) == r["world"] for r in runs),
            "exact": all(r["exact"] for r in runs),
            "plan_from": sorted({p for r in runs for p in r["plan_from"]})}
    keep = ("recovery_s", "resent_fraction", "restart_s", "detect_s", "op_sent_fraction", "recovery_breakdown_s", "timeline_after_kill_s", "link_retries", "plan_rounds", "plan_from",
            "contributors", "pieces_without_full_copy")
    head["runs"] = [{k: r[k] for k in keep} for r in runs]
    for k in ("world", "size_bytes", "victim", "failpoint"):
        head[k] = runs[0][k]
    return head


if __name__ == "__main__":
    main()
