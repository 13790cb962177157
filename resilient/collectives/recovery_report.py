"""``RecoveryReport``: what the last recovery of an op did (``Communicator.last_recovery``),
for benchmarks, the chaos verifier and tests.

Pure data; nothing here fails. :meth:`RecoveryReport.as_dict` is the JSON form (the keys
the old ``last_recovery`` dict had: ``seq``, ``epoch``, ``seconds``, ``bytes_sent``, ...).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Timeline:
    """Wall-clock times (``time.time()``) of one recovery's steps; ``aborted``: when the
    watch thread last aborted the transport (None: it did not)."""

    aborted: float | None
    entered: float
    epoch: float
    statuses: float
    done: float


@dataclass(frozen=True)
class RecoveryReport:
    """Op ``seq`` finished by recovery in epoch ``epoch``: durations (s) of the whole
    recovery and its status exchange, plan and execution; the plan's rounds and transfers;
    the transfer waits; bytes this member sent and link retries meanwhile; the members the
    result is over; ``plan_from``: ``"summaries"`` (this member planned from every
    survivor's ledger summary: up to ``RESILIENT_LEDGER_DIRECT_MAX`` survivors, or through
    etcd) or ``"planner"`` (its slice of the plan came from the planner, over the tree)."""

    seq: int
    epoch: int
    seconds: float
    status_s: float
    plan_s: float
    execute_s: float
    rounds: int
    transfers: int
    bytes_sent: int
    link_retries: int
    contributors: list[str]
    timeline: Timeline
    wait_recv_s: float = 0.0
    wait_send_s: float = 0.0
    reduce_s: float = 0.0
    plan_from: str = "summaries"
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready dict (``extra`` merged in at the top level)."""
        d = asdict(self)
        d.update(d.pop("extra"))
        return d
