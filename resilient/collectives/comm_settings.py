"""``CommSettings``: everything a Communicator is built with besides its view and
transport (``Communicator.rejoin`` builds the next one from it). Pure data; a bad policy
name fails in ``Policy.parse`` when the Communicator is built."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from resilient.collectives.recovery import Policy


@dataclass(frozen=True)
class CommSettings:
    policy: Policy | str = Policy.DEFAULT
    op_timeout: float | None = 30.0
    small_bytes: int = 64 << 10
    slice_bytes: int = 2 << 20
    max_slices: int = 64
    recovery_timeout: float = 300.0
    epoch_timeout: float = 60.0
    ledger: bool = True
    health_reporter: Any = None
    metrics: Any = None
    hierarchical: bool = True
    staging: bool | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """The Communicator keyword arguments, shallow: the metrics and health reporter
        objects are passed on, not copied (``dataclasses.asdict`` would deep-copy them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
