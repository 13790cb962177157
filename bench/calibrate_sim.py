"""Calibrate bench/sim_store.py against the real etcd here: ``python bench/calibrate_sim.py``.

Starts a local etcd (:class:`~resilient.coordinator.local_etcd.LocalEtcd`, the Debian
etcd-server the tests use), fills it with ``--members`` member records (~300 B each, the
size the coordinator reads; the issue calibrates at <= 2,500 members), and times, through
the project's own :class:`~resilient.coordinator.store.Store` client, ``--samples`` of each:

* ``read``: a get of one small key; ``read_per_mb``: a range read of every member record,
  less ``read``, per MB returned;
* ``write``: a put of a small key; ``write_per_mb``: a put of a ``--big-kb`` value, less
  ``write``, per MB; ``txn``: a compare-and-put of two keys (the coordinator's epoch write);
* ``lease``: grant, time-to-live and revoke, pooled;
* ``watch``: a put seen by a prefix watch, less the put itself (etcd -> watcher delay;
  events that arrive before the put returns count as 0).

Each fitted value is the median (the sim adds one fixed latency per call); p90s are
reported too. Writes ``--out`` (default ``bench/sim_params.json``):
``{"v": 1, "fitted": {field: seconds}, "p90": {...}, "members", "samples", "loadavg",
"at"}``; :func:`load_params` validates such a file and bench/scale.py uses it when
present. The figures depend on this machine's load (it is recorded): recalibrate rather
than reuse a file from elsewhere.

Failure behaviour: etcd failing to start raises :class:`~resilient.errors.StoreUnavailable`
naming the cause; :func:`load_params` raises :class:`~resilient.errors.ConfigError` naming
the file, the field and the fix for a malformed file. Cleans up its etcd on every exit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.sim_store import Latency  # noqa: E402
from resilient.coordinator import LocalEtcd, Store  # noqa: E402
from resilient.coordinator.store import Compare, Put, WatchEvent  # noqa: E402
from resilient.errors import ConfigError  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sim_params.json")
#: the Latency fields a parameter file must carry
FIELDS = ("read", "read_per_mb", "write", "write_per_mb", "txn", "lease", "watch")


def _timed(fn: Callable[[], object], samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def measure(store: Store, members: int, samples: int, big_kb: int) -> dict[str, object]:
    """Time each operation ``samples`` times (see the module docstring); returns the
    ``fitted`` medians and the ``p90`` of each raw measurement, in seconds."""
    root = "/resilient/calibrate/"
    record = json.dumps({"member_id": "m", "host": "h" * 12, "local_rank": 0, "address": "10.0.0.1:29500",
                         "labels": {"rack": "rack0001"}, "pid": 1234, "device": "cuda:0", "lease": 1,
                         "pad": "x" * 120}).encode()
    for i in range(members):
        store.put(f"{root}members/m{i:06d}", record)
    listing_mb = members * len(record) / 1e6
    raw: dict[str, list[float]] = {}
    raw["read"] = _timed(lambda: store.get(f"{root}members/m000000"), samples)
    raw["range"] = _timed(lambda: store.get_prefix(f"{root}members/"), max(3, samples // 10))
    raw["write"] = _timed(lambda: store.put(f"{root}small", b"x" * 64), samples)
    big = b"y" * (big_kb * 1024)
    raw["big_write"] = _timed(lambda: store.put(f"{root}big", big), max(3, samples // 10))
    rev = [store.put(f"{root}epoch", b"0")]

    def txn() -> None:
        kv = store.get(f"{root}epoch")
        assert kv is not None
        t0 = time.perf_counter()
        store.txn([Compare(f"{root}epoch", "mod", "==", kv.mod_revision)],
                  [Put(f"{root}epoch", b"e" * 400), Put(f"{root}epochs/{rev[0]}", b"e" * 400)])
        txn_times.append(time.perf_counter() - t0)
        rev[0] += 1

    txn_times: list[float] = []
    for _ in range(samples):
        txn()
    raw["txn"] = txn_times
    lease_times: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter()
        lease = store.grant(5)
        t1 = time.perf_counter()
        store.lease_ttl(lease)
        t2 = time.perf_counter()
        store.revoke(lease)
        lease_times += [t1 - t0, t2 - t1, time.perf_counter() - t2]
    raw["lease"] = lease_times
    raw["watch"] = _watch(store, root, samples)
    store.delete_prefix(root)

    med = {k: statistics.median(v) for k, v in raw.items()}
    fitted = {
        "read": med["read"],
        "read_per_mb": max(0.0, (med["range"] - med["read"]) / listing_mb) if listing_mb else 0.0,
        "write": med["write"],
        "write_per_mb": max(0.0, (med["big_write"] - med["write"]) / (len(big) / 1e6)),
        "txn": med["txn"],
        "lease": med["lease"],
        "watch": med["watch"],
    }
    return {"fitted": fitted, "p90": {k: _p90(v) for k, v in raw.items()},
            "range_mb": round(listing_mb, 3), "big_write_mb": round(len(big) / 1e6, 3)}


def _watch(store: Store, root: str, samples: int) -> list[float]:
    """Per sample: (put issued -> the watch callback ran) less the put's own time."""
    seen = threading.Event()
    arrived = [0.0]

    def on_events(events: list[WatchEvent]) -> None:
        arrived[0] = time.perf_counter()
        seen.set()

    handle = store.watch_prefix(f"{root}watched", None, on_events)
    out: list[float] = []
    try:
        time.sleep(0.2)   # the watch stream is set up asynchronously; one warm-up event below
        for i in range(samples + 1):
            seen.clear()
            t0 = time.perf_counter()
            store.put(f"{root}watched", str(i).encode())
            t_put = time.perf_counter() - t0
            if not seen.wait(10.0):
                raise TimeoutError("the watch did not deliver a put within 10 s")
            if i:
                out.append(max(0.0, arrived[0] - t0 - t_put))
    finally:
        handle.cancel()
    return out


def load_params(path: str) -> Latency:
    """The :class:`~bench.sim_store.Latency` of a file :func:`main` wrote. Raises
    :class:`ConfigError` naming the field for a malformed file (rerun the calibration)."""
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read sim parameters {path}: {exc}; rerun bench/calibrate_sim.py") from exc
    fitted = body.get("fitted") if isinstance(body, dict) else None
    if not isinstance(fitted, dict) or body.get("v") != 1:
        raise ConfigError(f"{path} is not a version-1 sim parameter file (no 'fitted'); "
                          "rerun bench/calibrate_sim.py")
    vals: dict[str, float] = {}
    for name in FIELDS:
        v = fitted.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 10:
            raise ConfigError(f"{path}: fitted.{name} = {v!r} is not a number of seconds in [0, 10); "
                              "rerun bench/calibrate_sim.py")
        vals[name] = float(v)
    return Latency(**vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=2500, help="member records in the keyspace")
    ap.add_argument("--samples", type=int, default=200, help="timed calls per operation")
    ap.add_argument("--big-kb", type=int, default=1024, help="value size of the per-MB write sample, KiB")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    load0 = open("/proc/loadavg").read().split()[:3]
    with LocalEtcd() as etcd:
        store = Store(etcd.endpoints)
        try:
            got = measure(store, args.members, args.samples, args.big_kb)
        finally:
            store.close()
    body = {"v": 1, **got, "members": args.members, "samples": args.samples,
            "loadavg": {"before": load0, "after": open("/proc/loadavg").read().split()[:3]},
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.write("\n")
    load_params(args.out)   # what we wrote must read back
    print(json.dumps(body))


if __name__ == "__main__":
    main()
