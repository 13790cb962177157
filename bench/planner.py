"""Planner speed: ``python bench/planner.py --members N`` prints one JSON line
``{"members": N, "plan_ms": median, ...}`` (median of --runs runs; inputs built beforehand:
8 members per host, 32 hosts per rack, 5 % demoted)."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

from resilient.coordinator.planner import plan


@dataclass(frozen=True)
class Member:
    member_id: str
    host: str
    local_rank: int
    labels: dict = field(default_factory=dict)


def members(n: int, per_host: int = 8) -> list[Member]:
    out = [Member(f"w{i:07d}", f"node{i // per_host:06d}", i % per_host, {"rack": f"r{i // (per_host * 32):04d}"})
           for i in range(n)]
    # arrival order is not ring order
    return out[1::2] + out[0::2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    ms = members(args.members)
    demoted = {m.member_id for m in ms[:: 20]}
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        p = plan(ms, demoted)
        times.append((time.perf_counter() - t0) * 1000)
    assert len(p.ring) == args.members
    print(json.dumps({"members": args.members, "plan_ms": round(statistics.median(times), 2),
                      "min_ms": round(min(times), 2), "runs": args.runs, "demoted": len(demoted)}))


if __name__ == "__main__":
    main()
