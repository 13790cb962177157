"""One chaos member process: runs the verifying workload and records every op.

    python -m resilient.chaos.worker --scenario FILE --member I --seed S --etcd EP --job J
        --records DIR [--backend resilient|oracle] [--pace-s SEC] [--oracle-bug contributors]

Protocol with the runner (all files under ``--records``, JSON text, never pickle):

1. registers member ``m<I>`` on a lease and prints ``READY m<I> <lease_id> <pid>``;
2. waits for the file ``go`` (the runner writes the workload's start wall time ``t0``
   into it once the first epoch holds every member);
3. runs ops ``0..ops-1`` — for a ``duration_s`` workload, until the runner writes the
   file ``end`` holding the op count (a few ops past the furthest member when the
   duration is up, so every member runs the same ops) — and appends one JSON line per op to ``member-<I>.jsonl``: ``seq``,
   ``start``/``end`` (wall time; ``end`` null if it raised), ``contributors`` (member
   indices), ``epoch``, ``error``, and ``check`` — the output compared right here with
   :func:`resilient.chaos.workload.compare` (numpy only, independent of the collectives):
   ``"ok"`` or the mismatch. A ``start`` line is written *before* each op, so an op that
   never returns (a hang, a SIGKILL) is visible to the verifier;
4. after the last op writes the file ``done-<I>`` and keeps its lease until the runner
   writes ``stop`` (so leaving never looks like a failure to the coordinator), then exits
   0, revoking its lease; it exits 3 when removed from the group.

Backends: ``resilient`` drives :class:`resilient.collectives.Communicator` (the thing
under test; op/phase failpoints come from ``RESILIENT_FAILPOINTS`` inside it).
``oracle`` computes every result from the workload itself and fires kill/stop failpoints
at op starts — it exercises the runner, injector and verifier end to end with real
processes and signals, and with ``--oracle-bug contributors`` it reports a wrong
contributor set, so the whole pipeline is shown to fail when the contract is broken.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from resilient.chaos.members import member_id, member_index
from resilient.chaos.scenario import Scenario, load_scenario
from resilient.chaos.workload import OpSpec, compare, expected_output, make_input, op_spec_for

if TYPE_CHECKING:  # types only: torch is imported by the resilient backend itself
    import numpy as np

    from resilient.collectives import Communicator
    from resilient.connection import ConnectedCommunicator
    from resilient.coordinator.epoch import EpochWatcher
    from resilient.coordinator.membership import MemberSession

#: What one op delivered: the result (None for a barrier), contributor member ids, and
#: the ``[start, stop)`` slice a reduce_scatter result holds.
OpResult = tuple["np.ndarray | None", tuple[str, ...], "tuple[int, int] | None"]


_PARENT = os.getppid()


def _orphaned() -> bool:
    """The runner that started us is gone (SIGKILLed): stop instead of running on."""
    return os.getppid() != _PARENT


def _failpoints(member: int) -> dict[int, str]:
    """``op -> action`` of op-triggered failpoints for the oracle backend (phase ignored)."""
    out: dict[int, str] = {}
    for entry in filter(None, os.environ.get("RESILIENT_FAILPOINTS", "").split(";")):
        action, _, rest = entry.partition("@")
        fields = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
        if "op" in fields and fields.get("phase") != "recovery":
            out[int(fields["op"])] = action
    return out


def _take_op_start_failpoints() -> dict[int, str]:
    """Remove phase-less entries (``kill@op=N``: fire as op N starts) from
    ``RESILIENT_FAILPOINTS`` and return them as ``op -> action``: the worker fires those
    itself; the rest (with a phase) are left for :mod:`resilient.collectives.failpoints`,
    which must be imported only after this ran."""
    keep, out = [], {}
    for entry in filter(None, (e.strip() for e in os.environ.get("RESILIENT_FAILPOINTS", "").split(";"))):
        action, _, rest = entry.partition("@")
        fields = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
        if "phase" in fields:
            keep.append(entry)
        elif "op" in fields:
            out[int(fields["op"])] = action
    os.environ["RESILIENT_FAILPOINTS"] = ";".join(keep)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", required=True)
    p.add_argument("--member", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--etcd", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--records", required=True)
    p.add_argument("--backend", choices=("resilient", "oracle"), default="resilient")
    p.add_argument("--pace-s", type=float, default=0.02, help="oracle: seconds per op")
    p.add_argument("--oracle-bug", choices=("contributors",), default=None)
    p.add_argument("--bug", choices=("full-contributors",), default=None,
                   help="resilient: DELIBERATELY BROKEN BUILD for the checker's self-test — report the op's full "
                        "original member set instead of the contributors the communicator's ledger reported")
    p.add_argument("--comm-op-timeout", type=float, default=10.0,
                   help="resilient: seconds a peer wait lasts before the peer is reported suspect, and a broken link to a live member is given up (PeerUnreachable); above the longest drop_link of the built-in scenarios")
    p.add_argument("--fail-start-once", metavar="PATH", default=None,
                   help="test hook: the first member to create PATH exits 3 after `go`, before op 0 (a start-up "
                        "failure the runner must retry, not count against the scenario)")
    p.add_argument("--metrics", action="store_true",
                   help="resilient: record rank metrics (PROMETHEUS_MULTIPROC_DIR names where) via the Communicator")
    args = p.parse_args(argv)

    sc = load_scenario(args.scenario)
    records = Path(args.records)
    out = open(records / f"member-{args.member}.jsonl", "a", buffering=1)
    progress = {"seq": 0}
    if args.backend == "oracle":
        return _main_oracle(args, sc, out, records, progress)
    op_start = _take_op_start_failpoints()  # before resilient.collectives parses the rest
    from resilient.connection import connect
    from resilient.errors import Cancelled
    from resilient.transport.shaping import shaped_from_env

    started = []

    def registered(session: MemberSession) -> None:  # READY, then the runner's go (before the epoch wait)
        print(f"READY {session.member_id} {session.lease_id} {os.getpid()}", flush=True)
        if not _await_go(records):
            raise SystemExit(2)
        _fail_start_once(args)
        started.append(True)

    kwargs: dict[str, Any] = {}
    if args.metrics:
        from resilient.metrics import rank_metrics

        kwargs["metrics"] = rank_metrics()
    # RESILIENT_HOST, RESILIENT_HOST_LABEL (connect reads them): the runner places a member in a network namespace
    # (and, for a scenario with `hosts:`, on an emulated host)
    # and names its address there; RESILIENT_ETCD_* TLS/credentials come from the runner too
    epoch_timeout = max(60.0, sc.op_timeout_s)
    try:
        comm = connect(args.etcd, args.job, member_id(args.member), timeout=epoch_timeout, ttl=sc.lease_ttl_s,
                       wrap_transport=shaped_from_env, on_registered=registered,
                       op_timeout=args.comm_op_timeout, epoch_timeout=epoch_timeout, **kwargs)
        return _run_ops_resilient(args, sc, out, comm, records, progress, op_start)
    except (Exception, Cancelled) as exc:  # record why, and exit now: lingering threads must not keep us alive
        if not started:  # failed before the go (etcd unreachable, ...): not a run, nothing to record
            raise
        _record_crash(out, progress, exc)
        os._exit(1)


def _main_oracle(args: argparse.Namespace, sc: Scenario, out: TextIO, records: Path,
                 progress: dict[str, int]) -> int:
    """The ``oracle`` backend's member: a session and an epoch watcher, no data plane."""
    from resilient.coordinator.epoch import EpochWatcher
    from resilient.coordinator.etcd_access import open_store_from_env
    from resilient.coordinator.membership import MemberInfo, MemberSession

    store = open_store_from_env(args.etcd)  # RESILIENT_ETCD_* TLS/credentials from the runner
    session = MemberSession.register(store, args.job, MemberInfo(member_id=member_id(args.member), address=""),
                                     ttl=sc.lease_ttl_s)
    watcher = EpochWatcher(store, args.job)
    print(f"READY {session.member_id} {session.lease_id} {os.getpid()}", flush=True)
    if not _await_go(records):
        return 2
    _fail_start_once(args)
    try:
        return _run_ops(args, sc, out, session, watcher, records, progress)
    except Exception as exc:  # record why, and exit now: lingering threads must not keep us alive
        _record_crash(out, progress, exc)
        os._exit(1)


def _await_go(records: Path) -> bool:
    """Wait (at most 120 s) for the runner's ``go`` file; False (said on stderr) when it
    does not come or the runner died."""
    go = records / "go"
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline or _orphaned():
            print("no go file from the runner within 120 s (or the runner died)", file=sys.stderr)
            return False
        time.sleep(0.01)
    return True


def _fail_start_once(args: argparse.Namespace) -> None:
    """The ``--fail-start-once PATH`` test hook: the first member to create PATH exits 3."""
    if args.fail_start_once:
        try:
            os.close(os.open(args.fail_start_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            print("test hook --fail-start-once: exiting before op 0", file=sys.stderr, flush=True)
            os._exit(3)
        except FileExistsError:
            pass


def _record_crash(out: TextIO, progress: dict[str, int], exc: BaseException) -> None:
    out.write(json.dumps({"seq": progress["seq"], "start": time.time(), "end": None,
                          "error": f"{type(exc).__name__}: {exc}"}) + "\n")
    out.flush()
    import traceback

    traceback.print_exc()
    sys.stderr.flush()


def _run_one(comm: Communicator, spec: OpSpec, x: np.ndarray, member: int) -> OpResult:
    """Run one op on the real communicator. Returns ``(result numpy array or None,
    contributor member ids, out_range or None)``. Exceptions propagate."""
    import numpy as np
    import torch

    if spec.collective == "allreduce":
        t = torch.from_numpy(x.copy())
        w = comm.allreduce(t, op=spec.op or "sum")
        return t.numpy(), w.contributors, None
    if spec.collective == "reduce_scatter":
        n, rank = comm.size, comm.rank
        m = -(-spec.numel // n)
        padded = np.zeros(n * m, dtype=x.dtype)
        padded[:spec.numel] = x
        ins = [torch.from_numpy(padded[c * m:(c + 1) * m].copy()) for c in range(n)]
        out = torch.empty(m, dtype=ins[0].dtype)
        w = comm.reduce_scatter(out, ins, op=spec.op or "sum")
        start, stop = min(rank * m, spec.numel), min((rank + 1) * m, spec.numel)
        return out.numpy()[:stop - start], w.contributors, (start, stop)
    if spec.collective == "allgather":
        t = torch.from_numpy(x.copy())
        outs = [torch.empty_like(t) for _ in range(comm.size)]
        w = comm.allgather(outs, t)
        return torch.cat(outs).numpy(), w.contributors, None
    if spec.collective == "broadcast":
        # the scenario's root if it is still a member, else the first member (every
        # member sees the same member list between ops)
        members = comm.members
        root = member_id(spec.root) if member_id(spec.root) in members else members[0]
        t = torch.from_numpy(x.copy())
        w = comm.broadcast(t, root=members.index(root))
        return t.numpy(), w.contributors, None
    if spec.collective == "barrier":
        w = comm.barrier()
        return None, w.contributors, None
    raise ValueError(f"unknown collective {spec.collective!r}")


def _run_one_retrying(comm: Communicator, spec: OpSpec, x: np.ndarray, member: int, seq: int,
                      attempts: int = 3) -> OpResult:
    """:func:`_run_one`, called again when the op raised ``GroupChanged`` — what a careful
    program does: ops with one buffer per member are sized from ``comm.size`` before the
    call, and an epoch adopted at the op's boundary can change it; every member raises it
    for the same op, so every member calls again (with buffers for the current group).

    A call again takes the Communicator's next sequence number, so the workload's op
    ``seq`` and the Communicator's drift apart; scenario failpoints name workload ops, so
    before every attempt the failpoints of op ``seq`` are pointed at the sequence number
    this attempt will run as."""
    from resilient.collectives import failpoints
    from resilient.errors import GroupChanged

    for attempt in range(attempts):
        if failpoints.ACTIVE:
            for fp in failpoints.SPECS:
                if fp.__dict__.setdefault("workload_op", fp.op) == seq:
                    fp.op = comm.next_seq
        try:
            return _run_one(comm, spec, x, member)
        except GroupChanged:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _run_ops_resilient(args: argparse.Namespace, sc: Scenario, out: TextIO, comm: ConnectedCommunicator,
                       records: Path, progress: dict[str, int], op_start: dict[int, str]) -> int:
    """The ``resilient`` backend: every op through a real
    :class:`~resilient.collectives.Communicator` over etcd + TCP (+ shaping), built by
    :func:`resilient.connect`."""
    from resilient.errors import Cancelled, RemovedFromGroup

    transport, session, watcher = comm.transport, comm.session, comm.watcher
    end_file, end = records / "end", sc.workload.ops
    seq, rc = -1, 0
    while True:
        seq += 1
        if end is None and end_file.exists():
            end = int(end_file.read_text())
        if end is not None and seq >= end:
            break
        if _orphaned():
            os._exit(4)
        start = time.time()
        progress["seq"] = seq
        out.write(json.dumps({"seq": seq, "start": start}) + "\n")
        action = op_start.get(seq)
        if action is not None:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        spec = op_spec_for(seq, args.seed, sc.workload.mix)
        x = make_input(args.member, seq, args.seed, spec)
        original = tuple(member_index(m) for m in comm.members)
        sent0 = transport.stats.bytes_sent
        try:
            result, contributors, out_range = _run_one_retrying(comm, spec, x, args.member, seq)
        except RemovedFromGroup as exc:
            out.write(json.dumps({"seq": seq, "start": start, "end": None,
                                  "error": f"RemovedFromGroup: {exc}"}) + "\n")
            rc = 3
            break
        except (Exception, Cancelled) as exc:  # an op that raised is a lost op: record it, go on with the next
            out.write(json.dumps({"seq": seq, "start": start, "end": None,
                                  "error": f"{type(exc).__name__}: {exc}"}) + "\n")
            continue
        end_t = time.time()
        reported = tuple(member_index(m) for m in contributors)
        if args.bug == "full-contributors" and spec.collective != "broadcast":
            reported = original  # the deliberately broken build: ledger contributor tracking ignored
        check = "ok"
        if result is not None:
            try:
                mismatch = compare(result, expected_output(spec, seq, args.seed, reported, out_range), spec.dtype)
            except ValueError as exc:
                mismatch = None
                check = str(exc)
            if mismatch is not None:
                check = mismatch.reason
                if mismatch.index is not None:
                    check += f"; first at [{mismatch.index}]: got {mismatch.got!r}, expected {mismatch.want!r}"
        rec = comm.last_recovery if comm.last_recovery and comm.last_recovery.seq == seq else None
        current = watcher.current()
        out.write(json.dumps({
            "seq": seq, "start": start, "end": end_t, "contributors": list(reported),
            "epoch": current.number if current else None, "check": check,
            "out_range": list(out_range) if out_range else None, "recovered": rec is not None,
            "bytes_after_fault": rec.bytes_sent if rec else None,
            "bytes_sent": transport.stats.bytes_sent - sent0,
            "recovery_s": rec.seconds if rec else None}) + "\n")
    out.close()
    (records / f"done-{args.member}").write_text("")
    stop_file = records / "stop"  # stay a member: peers may still need our retained ledger
    while rc == 0 and not stop_file.exists() and not session.lost.is_set() and not _orphaned():
        time.sleep(0.02)
    try:
        comm.close()  # leaves the group (revokes the lease), then transport, watcher, session, store
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # lingering transport / watch threads must not keep a finished member alive


def _run_ops(args: argparse.Namespace, sc: Scenario, out: TextIO, session: MemberSession, watcher: EpochWatcher,
             records: Path, progress: dict[str, int]) -> int:
    fps = _failpoints(args.member)
    end_file, end = records / "end", sc.workload.ops
    world = tuple(range(sc.world_size))
    seq = -1
    while True:
        seq += 1
        if end is None and end_file.exists():  # duration workloads: the runner names the end
            end = int(end_file.read_text())
        if end is not None and seq >= end:
            break
        if _orphaned():
            return 4
        if session.lost.is_set():
            out.write(json.dumps({"seq": seq, "start": time.time(), "end": None, "error": "RemovedFromGroup"}) + "\n")
            return 3
        start = time.time()
        progress["seq"] = seq
        out.write(json.dumps({"seq": seq, "start": start}) + "\n")
        action = fps.get(seq)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        spec = op_spec_for(seq, args.seed, sc.workload.mix)
        make_input(args.member, seq, args.seed, spec)  # what a real member would feed
        contributors = (spec.root,) if spec.collective == "broadcast" else world
        value = expected_output(spec, seq, args.seed, contributors).value
        result = None if value is None else value.astype(spec.dtype)  # delivered in the op's dtype
        bug = args.oracle_bug == "contributors" and seq >= 1 and len(contributors) > 1
        reported = contributors[:-1] if bug else contributors
        mismatch = compare(result, expected_output(spec, seq, args.seed, reported), spec.dtype)
        time.sleep(max(0.0, start + args.pace_s - time.time()))
        current = watcher.current()
        out.write(json.dumps({"seq": seq, "start": start, "end": time.time(), "contributors": list(reported),
                              "epoch": current.number if current else None,
                              "check": "ok" if mismatch is None else mismatch.reason}) + "\n")
    out.close()
    (records / f"done-{args.member}").write_text("")
    stop_file = records / "stop"
    while not stop_file.exists() and not session.lost.is_set() and not _orphaned():
        time.sleep(0.02)
    watcher.close()
    session.close(revoke=True, reason="finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
