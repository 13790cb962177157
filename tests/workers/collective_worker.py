"""A real member process running collectives for the multi-process tests and benches.

    python tests/workers/collective_worker.py --etcd E --job J --id m2 --world 4 --out DIR
        --ops '[{"k": "allreduce", "numel": 1000, "dtype": "float32", "op": "sum"}, ...]'

Registers a MemberSession (short TTL), waits for an epoch with ``--world`` members,
builds a Communicator over the etcd group view and a TCP transport, runs the ops with
inputs from ``inputs.make_input(member index, seq, seed)`` (an op's ``override``
maps a member id to fields of that member's call only) and writes, per op,
``DIR/<id>.<seq>.npy`` (allow_pickle=False; bfloat16/float16 as float32) and a JSON line
in ``DIR/<id>.jsonl``: {seq, ok, error, contributors, seconds; allreduce: algorithm (the
one the epoch selects, when the op's ledger pieces are its layout, else null); reduce_scatter:
the same, and op_members, chunk (the op's members and this member's index among them)}. Exit 0, or 4 when it
raised RemovedFromGroup. Failpoints come from RESILIENT_FAILPOINTS, an emulated host label
(``MemberInfo.host``) from RESILIENT_TEST_HOST.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ops", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttl", type=float, default=2.0)
    ap.add_argument("--op-timeout", type=float, default=30.0)
    ap.add_argument("--policy", default="default")
    ap.add_argument("--join", action="store_true",
                    help="register later than the others: wait to be admitted, start at the group's next op")
    args = ap.parse_args()

    import faulthandler
    import signal

    import numpy as np
    import torch

    from resilient.device.whole import COUNTS as WHOLE

    faulthandler.register(signal.SIGUSR1, all_threads=True)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inputs import make_input

    import resilient
    from resilient.errors import RemovedFromGroup, ResilientError

    if os.environ.get("RESILIENT_TEST_LOG"):  # e.g. INFO: the library's log on this worker's stderr
        import logging

        logging.basicConfig(level=os.environ["RESILIENT_TEST_LOG"], format="%(asctime)s %(name)s: %(message)s")
    index = int(args.id.lstrip("m"))
    # RESILIENT_TRANSPORT: auto (shm on one host) | tcp; RESILIENT_TEST_HOST: an emulated
    # host label (hierarchical tests); a joiner waits only to be in an epoch
    comm = resilient.connect(args.etcd, args.job, args.id, world=None if args.join else args.world, timeout=60,
                             ttl=args.ttl, host_label=os.environ.get("RESILIENT_TEST_HOST"),
                             op_timeout=args.op_timeout, policy=args.policy, joining=True if args.join else None)
    watcher = comm.watcher
    print(f"LEASE {args.id} {comm.session.lease_id}", flush=True)  # the harness revokes it when we exit
    ops = json.loads(args.ops)
    rc = 0
    first = comm.next_seq  # a joiner starts at the group's next op
    with open(os.path.join(args.out, f"{args.id}.jsonl"), "a") as log:
        print(f"READY {args.id} {os.getpid()} {first}", flush=True)
        for seq, spec in enumerate(ops):
            if seq < first:
                continue
            spec = {**spec, **spec.get("override", {}).get(args.id, {})}  # this member's own fields, if any
            if spec["k"] == "wait_world":  # block until the group has n members, then a barrier
                watcher.wait_for(lambda e: len(e.members) >= spec["n"], 60)
                spec = {"k": "barrier"}
            elif spec["k"] == "wait_gone":  # block until an epoch is without it, then a barrier
                watcher.wait_for(lambda e: spec["id"] not in e.members, 60)
                spec = {"k": "barrier"}
            elif spec["k"] == "wait_member":  # block until an epoch (any, even one superseded at once) has it
                seen = threading.Event()
                unsubscribe = watcher.subscribe(lambda e: seen.set() if spec["id"] in e.members else None, replay=True)
                seen.wait(60)
                unsubscribe()
                spec = {"k": "barrier"}
            t0 = time.monotonic()
            rec = {"seq": seq, "ok": False, "error": None, "contributors": None}
            try:
                k = spec["k"]
                numel, dtype = spec.get("numel", 1), spec.get("dtype", "float32")
                n_in = spec.get("numel_override", {}).get(args.id, numel)
                x = make_input(index, seq, args.seed, n_in, dtype)
                if k == "allreduce" and "bits" in spec:  # the exact compressed allreduce
                    from resilient.collectives.compressed import Compression

                    comp = Compression(bits=spec["bits"], bucket=spec.get("bucket", 1024),
                                       segments=((0, n_in, spec["bits"]),))
                    w = comm.allreduce(x, op=spec.get("op", "sum"), async_op=True, compression=comp)
                    w.wait()
                    out = x
                    lc = comm.last_compression
                    rec["compression"] = {"scale_contributors": list(lc["scale_contributors"]),
                                          "members_bound": lc["members_bound"]}
                    np.save(os.path.join(args.out, f"{args.id}.{seq}.scales.npy"), lc["scales"].numpy(), allow_pickle=False)
                elif k == "allreduce":
                    w = comm.allreduce(x, op=spec.get("op", "sum"), async_op=True)
                    w.wait()
                    out = x
                elif k == "reduce_scatter":
                    n = comm.size
                    ins = [make_input(index, seq * 100 + c, args.seed, n_in, dtype) for c in range(n)]
                    out = torch.empty(n_in, dtype=x.dtype)
                    w = comm.reduce_scatter(out, ins, op=spec.get("op", "sum"), async_op=True)
                    w.wait()
                elif k == "allgather":
                    outs = [torch.empty(n_in, dtype=x.dtype) for _ in range(comm.size)]
                    w = comm.allgather(outs, x, async_op=True)
                    w.wait()
                    out = torch.stack(outs)
                elif k == "broadcast":
                    w = comm.broadcast(x, root=spec.get("root", 0), async_op=True)
                    w.wait()
                    out = x
                elif k == "barrier":
                    w = comm.barrier(async_op=True)
                    w.wait()
                    out = torch.zeros(0)
                else:
                    raise SystemExit(f"unknown op {k}")
                rec.update(ok=True, contributors=list(w.contributors), members=comm.members,
                           recovery=comm.last_recovery.as_dict() if comm.last_recovery and comm.last_recovery.seq == seq else None)
                kept = comm.retained
                rec["staged_posts"] = kept.staged_posts if kept is not None and kept.seq == seq else None
                if k == "allreduce" and "bits" not in spec and kept is not None and kept.seq == seq:
                    # the algorithm the epoch selects, when the op's ledger has exactly its layout
                    from resilient.collectives.algorithms import select

                    pieces, algo = select.allreduce(list(kept.members), comm.epoch, n_in, x.element_size(), comm.sizing)
                    rec["algorithm"] = type(algo).__name__ if pieces == kept.pieces else None
                if k == "reduce_scatter" and kept is not None and kept.seq == seq:
                    # the op's members and this member's chunk (its index among them), and the
                    # algorithm the epoch selects, when the op's ledger has exactly its layout
                    from resilient.collectives.algorithms import select

                    lay = select.per_member(k, list(kept.members), comm.epoch, len(kept.members), n_in,
                                            x.element_size(), comm.sizing)
                    rec.update(op_members=list(kept.members), chunk=kept.me,
                               algorithm=type(lay.algorithm).__name__ if lay.pieces == kept.pieces else None)
                rec["whole_staged"] = WHOLE.d2h   # whole-tensor host copies so far (resilient/device/whole.py)
                arr = out.to(torch.float32) if out.dtype in (torch.float16, torch.bfloat16) else out
                np.save(os.path.join(args.out, f"{args.id}.{seq}.npy"), arr.numpy(), allow_pickle=False)
            except RemovedFromGroup as exc:
                rec["error"] = f"RemovedFromGroup: {exc}"
                rc = 4
            except ResilientError as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["seconds"] = time.monotonic() - t0
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if rc:
                break
    print(f"DONE {args.id}", flush=True)
    if rc == 0:
        sys.stdin.read()  # stay a member (peers may still need our retained result) until told to go
        comm.close(linger=0.0, leave=True)  # serves a recovery already under way, then revokes
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
