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
import sys
import time
from pathlib import Path

from resilient.chaos.scenario import load_scenario
from resilient.chaos.workload import compare, expected_output, make_input, op_spec_for


_PARENT = os.getppid()


def _orphaned() -> bool:
    """The runner that started us is gone (SIGKILLed): stop instead of running on."""
    return os.getppid() != _PARENT


def member_id(index: int) -> str:
    return f"m{index}"


def member_index(mid: str) -> int:
    return int(mid[1:])


def _failpoints(member: int) -> dict[int, str]:
    """``op -> action`` of op-triggered failpoints for the oracle backend (phase ignored)."""
    out: dict[int, str] = {}
    for entry in filter(None, os.environ.get("RESILIENT_FAILPOINTS", "").split(";")):
        action, _, rest = entry.partition("@")
        fields = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
        if "op" in fields and fields.get("phase") != "recovery":
            out[int(fields["op"])] = action
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
    args = p.parse_args(argv)

    from resilient.coordinator.epoch import EpochWatcher
    from resilient.coordinator.membership import MemberInfo, MemberSession
    from resilient.coordinator.store import Store

    sc = load_scenario(args.scenario)
    records = Path(args.records)
    out = open(records / f"member-{args.member}.jsonl", "a", buffering=1)
    mid = member_id(args.member)
    store = Store(args.etcd)
    session = MemberSession.register(store, args.job, MemberInfo(member_id=mid), ttl=sc.lease_ttl_s)
    watcher = EpochWatcher(store, args.job)
    print(f"READY {mid} {session.lease_id} {os.getpid()}", flush=True)
    go = records / "go"
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline or _orphaned():
            print("no go file from the runner within 120 s (or the runner died)", file=sys.stderr)
            return 2
        time.sleep(0.01)
    if args.backend != "oracle":
        raise SystemExit("the resilient backend needs resilient.collectives.Communicator, which is not built yet")

    progress = {"seq": 0}
    try:
        return _run_ops(args, sc, out, session, watcher, records, progress)
    except Exception as exc:  # record why, and exit now: lingering threads must not keep us alive
        out.write(json.dumps({"seq": progress["seq"], "start": time.time(), "end": None,
                              "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _run_ops(args, sc, out, session, watcher, records: Path, progress: dict) -> int:
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
