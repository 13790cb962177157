"""The end-of-job summary of ``resilient-run``: who died, when, and where the group shrank.

:func:`job_exit_code` decides the agent's exit code from the last incarnation of each
worker (pure); :func:`shrink_epoch` finds, in etcd, the membership epoch that removed a
member; :func:`format_summary` renders the lines the agent prints to stderr.

Exit code rules (default mode, without ``--fail-fast``):

* 0 when at least one worker of this node finished (exit code 0) and no worker's last
  incarnation exited with an error code: workers killed by a signal (SIGKILL, OOM killer)
  are deaths the survivors absorbed;
* 1 when a worker's last incarnation exited with a non-zero code of its own (a Python
  exception, ``sys.exit(3)``): a survivor that itself fails makes the job fail;
* 1 when no worker finished (every worker of the node died).

Failure behaviour: :func:`shrink_epoch` returns ``None`` when etcd cannot be read or no
published epoch removed the member yet (the summary then says so); it never raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable

from resilient.process_pool import describe_exit


@dataclass
class Death:
    """One worker incarnation that ended with a non-zero exit code or a signal."""

    local_rank: int
    rank: int
    pid: int
    exitcode: int
    restart_count: int
    member_id: str | None
    at: float
    restarted: bool = False
    epoch: int | None = None

    def how(self) -> str:
        return describe_exit(self.exitcode)


def job_exit_code(last_exit_codes: Iterable[int | None]) -> int:
    """The agent's exit code from each worker's last exit code (see the module docstring;
    ``None``: still running, counts as not finished)."""
    codes = list(last_exit_codes)
    if any(c is not None and c > 0 for c in codes):
        return 1
    return 0 if any(c == 0 for c in codes) else 1


def shrink_epoch(store: Any, job: str, member_id: str | None, max_scan: int = 256) -> int | None:
    """Number of the published epoch whose ``removed`` lists ``member_id`` (newest first,
    at most ``max_scan`` epochs back); ``None`` if there is none or etcd fails."""
    if store is None or not member_id:
        return None
    from resilient.coordinator import keys
    from resilient.coordinator.epoch import Epoch

    try:
        kv = store.get(keys.epoch(job))
        if kv is None:
            return None
        newest = Epoch.from_json(kv.value).number
        for n in range(newest, max(0, newest - max_scan), -1):
            rec = store.get(keys.epoch_record(job, n))
            if rec is None:
                continue
            e = Epoch.from_json(rec.value)
            if member_id in e.removed:
                return e.number
            if member_id in e.members:
                return None  # still a member in the newest epoch naming it: removal not published yet
    except Exception:  # noqa: BLE001 - a summary must not fail the job
        return None
    return None


def format_summary(deaths: list[Death], finished: list[int], errored: list[int], exit_code: int,
                   max_restarts: int, unfinished: list[int] | None = None,
                   left: list[tuple[int, str]] | None = None) -> str:
    """The lines printed at the end of a job in which some worker died or ended early
    (``unfinished``: exited 0 without finishing its script, :mod:`resilient.script_exit`;
    ``left``: (local rank, reason) of those that left early by design, with exit 0)."""
    sep = "=" * 60
    lines = [sep, f"resilient-run: job {'FINISHED' if exit_code == 0 else 'FAILED'} (exit code {exit_code})",
             "-" * 60]
    if deaths:
        lines.append("Workers that died (the survivors went on without them):")
    for i, d in enumerate(deaths):
        when = datetime.fromtimestamp(d.at).strftime("%Y-%m-%d_%H:%M:%S.%f")[:-3]
        shrank = f"epoch {d.epoch}" if d.epoch is not None else "no epoch published yet"
        then = (f"restarted as a joiner (restart {d.restart_count + 1} of {max_restarts})" if d.restarted
                else "not restarted")
        lines += [
            f"[{i}]:",
            f"  time      : {when}",
            f"  rank      : {d.rank} (local_rank: {d.local_rank}, restart {d.restart_count}, pid {d.pid})",
            f"  member    : {d.member_id or '<no etcd>'}",
            f"  cause     : {d.how()}",
            f"  shrank in : {shrank}",
            f"  then      : {then}",
        ]
    lines.append("-" * 60)
    early = dict(left or [])
    done = [lr for lr in finished if lr not in early]
    lines.append(f"finished (exit 0): local ranks {done or 'none'}")
    for lr, why in sorted(early.items()):
        lines.append(f"left before the end of its script, by design (exit 0): local rank {lr}: {why}")
    if errored:
        lines.append(f"failed with an error code: local ranks {errored} (the job fails)")
    if unfinished:
        lines.append(f"exited with code 0 before their script finished (os._exit?): local ranks {unfinished} "
                     "(the job fails)")
    if not finished:
        lines.append("no worker finished: every worker of this node died (the job fails)")
    lines.append(sep)
    return "\n".join(lines)
