"""`helm test` check: the coordinator sees every worker of the release.

Runs ``resilient status --etcd ENDPOINTS --job JOB --json`` until the published epoch holds
at least ``--expect`` members and a coordinator leads, or until ``--timeout`` seconds have
passed. Exit 0 on success; 1 with a message naming what is missing (members, leader, or an
unreadable status) when the deadline passes. Standard library only.

Expected ``resilient status --json`` shape (the keys this check reads)::

    {"epoch": {"number": 7, "members": ["m-a", "m-b", ...]}, "leader": "coord-1", ...}

``epoch.members`` may also be a list of objects with an ``id`` key; ``leader`` may be a
string or an object (any non-empty value means a coordinator leads).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def evaluate(status: object, expect: int) -> tuple[bool, str]:
    """Whether ``status`` (parsed ``resilient status --json``) shows ``expect`` members and a leader."""
    if not isinstance(status, dict):
        return False, f"status output is a {type(status).__name__}, expected a JSON object"
    epoch = status.get("epoch")
    if not epoch:
        return False, "no epoch published yet (is the coordinator running and leading?)"
    if not isinstance(epoch, dict) or not isinstance(epoch.get("members"), list):
        return False, "status has no epoch.members list; is `resilient status --json` the matching version?"
    members = [m.get("id") if isinstance(m, dict) else m for m in epoch["members"]]
    if not status.get("leader"):
        return False, f"epoch {epoch.get('number')} exists but no coordinator leads"
    if len(members) < expect:
        return False, (f"epoch {epoch.get('number')} has {len(members)} of {expect} expected "
                       f"members: {', '.join(map(str, members)) or 'none'}")
    return True, f"epoch {epoch.get('number')} has {len(members)} members (expected >= {expect}); leader {status['leader']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", required=True, help="etcd endpoints host:port[,host:port...]")
    parser.add_argument("--job", required=True, help="job id (etcd prefix /resilient/<job>/)")
    parser.add_argument("--expect", type=int, required=True, help="members the epoch must hold")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to keep trying")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between tries")
    parser.add_argument("--status-cmd", default="resilient", help="the resilient command")
    args = parser.parse_args(argv)
    if args.expect < 1:
        parser.error(f"--expect {args.expect}: must be >= 1")

    cmd = [args.status_cmd, "status", "--etcd", args.etcd, "--job", args.job, "--json"]
    deadline = time.monotonic() + args.timeout
    reason = "not checked yet"
    while True:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                reason = f"`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
            else:
                try:
                    ok, reason = evaluate(json.loads(proc.stdout), args.expect)
                except json.JSONDecodeError as exc:
                    ok, reason = False, f"status output is not JSON ({exc})"
                if ok:
                    print(f"ok: {reason}")
                    return 0
        except subprocess.TimeoutExpired:
            reason = f"`{' '.join(cmd)}` did not answer before the deadline"
        except FileNotFoundError:
            print(f"fail: {args.status_cmd!r} not found in the image; install resilient-collectives",
                  file=sys.stderr)
            return 1
        if time.monotonic() + args.interval > deadline:
            print(f"fail after {args.timeout:.0f}s: {reason}", file=sys.stderr)
            return 1
        print(f"waiting: {reason}", flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
