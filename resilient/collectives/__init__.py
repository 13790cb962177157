"""Resumable collectives: :class:`Communicator`, :class:`Work`, the ledger and recovery."""
from __future__ import annotations

from typing import Any

__all__ = ["Communicator", "Work", "OpResult", "Policy"]


def __getattr__(name: str) -> Any:
    if name in ("Communicator", "OpResult"):
        from resilient.collectives import communicator

        return getattr(communicator, name)
    if name == "Work":
        from resilient.collectives.work import Work

        return Work
    if name == "Policy":
        from resilient.collectives.recovery import Policy

        return Policy
    raise AttributeError(name)
