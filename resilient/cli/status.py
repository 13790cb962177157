"""``resilient status``: members (id, host, state, lease seconds left), the epoch, its ring
and the coordinator leader of one job — a table, or JSON with ``--json``.

Member states: ``active`` (in the current epoch), ``demoted`` (in it, off the critical
path), ``joining`` (registered, admitted in the next epoch), ``evicted`` (a straggler out
of the epoch under ``--straggler-policy evict``; ``evicted_until``: wall time from which it
may be re-admitted), ``lost`` (in the epoch but its
lease is gone: the next epoch will drop it). ``straggler_score`` / ``straggler_state``
(``ok``, ``probe``, ``demoted``; null without a straggler policy): the coordinator's
latest verdict (coordinator/straggler.py) — the score is the fraction of an op the member
costs its peers beyond the median member.

Malformed records are skipped (``resilient.coordinator.records``): a corrupt ``epoch``
record shows as ``epoch: CORRUPT: <cause>`` (``epoch_error`` in ``--json``, ``epoch``
null) until the coordinator has published a valid epoch over it.

Also home of the etcd connection flags shared by the subcommands (``add_etcd_arguments``,
``store_from_args``); this module imports nothing heavy at top level.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - the etcd client is imported on use only
    from resilient.coordinator.store import Store


def add_etcd_arguments(parser: argparse.ArgumentParser) -> None:
    """``--etcd``, ``--job`` and the TLS/auth flags (defaults from RESILIENT_* env vars;
    see :mod:`resilient.coordinator.etcd_access`)."""
    from resilient.coordinator.etcd_access import add_arguments
    from resilient.settings import Settings

    settings = Settings.from_env()
    g = parser.add_argument_group("etcd")
    g.add_argument("--etcd", default=settings.etcd,
                   help="etcd endpoints host:port[,host:port...] (env RESILIENT_ETCD)")
    g.add_argument("--job", default=settings.job, help="job name (env RESILIENT_JOB)")
    add_arguments(g, legacy_spellings=True)
    g.add_argument("--etcd-timeout", type=float, default=10.0,
                   help="seconds to keep retrying an unreachable etcd before giving up (default 10)")


def store_from_args(args: argparse.Namespace) -> Store:
    """A :class:`~resilient.coordinator.store.Store` from the flags; ConfigError if
    ``--etcd``/``--job`` are missing."""
    from resilient.coordinator import keys
    from resilient.coordinator.etcd_access import EtcdAccess
    from resilient.errors import ConfigError

    if not args.etcd:
        raise ConfigError("no etcd endpoint: pass --etcd host:port[,host:port...] or set RESILIENT_ETCD")
    if not args.job:
        raise ConfigError("no job name: pass --job NAME or set RESILIENT_JOB")
    keys.check_name("job name", args.job)
    store: Store = EtcdAccess.from_args(args).open_store(args.etcd, retry_timeout=args.etcd_timeout)
    return store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def collect(store: Store, job: str) -> dict[str, Any]:
    """The status of ``job`` as a JSON-able dict (what ``--json`` prints)."""
    from resilient.coordinator.election import current_leader
    from resilient.coordinator.epoch import read_epoch_lenient
    from resilient.coordinator.health import read_scores
    from resilient.coordinator.membership import read_members

    members, _ = read_members(store, job)
    scores = read_scores(store, job).get("members") or {}
    epoch, _, epoch_error = read_epoch_lenient(store, job)
    in_epoch = set(epoch.members) if epoch else set()
    evicted = dict((epoch.plan.get("evicted") or {}) if epoch else {})
    rows = []
    ids = list(epoch.members) if epoch else []
    ids += sorted(m for m in members if m not in in_epoch)
    for mid in ids:
        entry = members.get(mid)
        info = entry[0] if entry else (epoch.infos.get(mid) if epoch else None)
        lease_left = None
        if entry is not None:
            ttl = store.lease_ttl(entry[1])
            lease_left = ttl[0] if ttl else None
        if entry is None or lease_left is None:
            state = "lost"
        elif mid not in in_epoch:   # evicted (--straggler-policy evict): listed in the epoch's plan
            state = "evicted" if mid in evicted else "joining"
        else:
            state = epoch.roles.get(mid, "active") if epoch is not None else "active"
        rows.append({
            "id": mid, "host": info.host if info else "", "local_rank": info.local_rank if info else None,
            "device": info.device if info else "", "address": info.address if info else "",
            "pid": info.pid if info else None, "state": state, "lease_left_s": lease_left,
            "straggler_score": (scores.get(mid) or {}).get("score"),
            "straggler_state": (scores.get(mid) or {}).get("state"),
            "evicted_until": (evicted.get(mid) or {}).get("until"),
        })
    return {
        "job": job,
        "leader": current_leader(store, job),
        "epoch": None if epoch is None else {
            "number": epoch.number, "members": list(epoch.members), "roles": epoch.roles,
            "cause": epoch.cause, "published_at": epoch.published_at, "trigger_at": epoch.trigger_at,
            "removed": list(epoch.removed), "added": list(epoch.added), "leader": epoch.leader,
        },
        "members": rows,
        # a malformed ``epoch`` record: its cause (the coordinator publishes over it)
        "epoch_error": None if epoch_error is None else str(epoch_error),
    }


def render_table(status: dict[str, Any]) -> str:
    lines = []
    e = status["epoch"]
    lines.append(f"job {status['job']}   leader: {status['leader'] or '(none)'}")
    if status.get("epoch_error"):
        lines.append(f"epoch: CORRUPT: {status['epoch_error']}")
    elif e is None:
        lines.append("epoch: none published yet")
    else:
        when = time.strftime("%H:%M:%S", time.localtime(e["published_at"]))
        extra = "".join(f", {k} {','.join(e[k])}" for k in ("removed", "added") if e[k])
        lines.append(f"epoch {e['number']} ({e['cause']}{extra}; published {when} by {e['leader']})")
        lines.append("ring: " + (" -> ".join(e["members"]) if e["members"] else "(empty)"))
    cols = ["MEMBER", "HOST", "RANK", "STATE", "LEASE_LEFT", "STRAGGLER", "ADDRESS"]
    table = [cols] + [[
        r["id"], r["host"], "" if r["local_rank"] is None else str(r["local_rank"]), r["state"],
        "-" if r["lease_left_s"] is None else f"{r['lease_left_s']:.0f}s",
        "-" if r.get("straggler_score") is None else f"{r['straggler_score']:+.2f} {r.get('straggler_state') or ''}",
        r["address"] or "-",
    ] for r in status["members"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines.append("")
    for row in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if len(table) == 1:
        lines.append("(no members registered)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    store = store_from_args(args)
    try:
        status = collect(store, args.job)
    finally:
        store.close()
    if args.json:
        print(json.dumps(status, indent=None, sort_keys=True))
    else:
        print(render_table(status))
    sys.stdout.flush()
    return 0
