"""A stand-alone member process: registers one member, keeps its lease alive, and waits.

Used by the tests, ``bench/control_plane.py`` and ``examples/demo.py`` wherever a *real*
member process is needed (to SIGKILL or SIGSTOP it)::

    python -m resilient.coordinator.member_process --etcd HOST:PORT --job J --id m0 [--ttl 2]
        [--lease-id N] [--host H] [--local-rank R] [--label rack=r1 ...]

Prints ``READY <member_id> <lease_id> <pid>`` once registered. SIGTERM/SIGINT: leave
cleanly (revoke the lease) and exit 0. If the lease is found gone (e.g. after being
SIGSTOPped past its TTL and resumed) it prints ``LOST <member_id>`` and exits 3.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--etcd", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--ttl", type=float, default=5.0)
    p.add_argument("--lease-id", type=int, default=None, help="attach to this lease (granted by an agent)")
    p.add_argument("--host", default=None)
    p.add_argument("--local-rank", type=int, default=0)
    p.add_argument("--address", default="")
    p.add_argument("--label", action="append", default=[], help="topology label key=value")
    args = p.parse_args(argv)

    from resilient.coordinator.membership import MemberInfo, MemberSession
    from resilient.coordinator.etcd_access import open_store_from_env

    labels = dict(kv.split("=", 1) for kv in args.label)
    store = open_store_from_env(args.etcd)  # RESILIENT_ETCD_* TLS/credentials
    info = MemberInfo(member_id=args.id, local_rank=args.local_rank, address=args.address, labels=labels,
                      **({"host": args.host} if args.host else {}))
    session = MemberSession.register(store, args.job, info, ttl=args.ttl, lease_id=args.lease_id)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    session.on_lost(stop.set)
    print(f"READY {session.member_id} {session.lease_id} {__import__('os').getpid()}", flush=True)
    while not stop.wait(0.2):
        pass
    if session.lost.is_set():
        print(f"LOST {session.member_id}", flush=True)
        return 3
    session.close(revoke=True, reason="terminated")
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
