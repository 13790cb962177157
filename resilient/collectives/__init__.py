"""Resumable collectives: :class:`Communicator`, :class:`Work`, the ledger and recovery."""
from __future__ import annotations

from typing import Any

__all__ = ["Communicator", "Work", "OpResult", "Policy"]


def __getattr__(name: str) -> Any:
    if name == "Communicator":
        from resilient.collectives.communicator import Communicator

        return Communicator
    if name == "OpResult":
        from resilient.collectives.ops import OpResult

        return OpResult
    if name == "Work":
        from resilient.collectives.work import Work

        return Work
    if name == "Policy":
        from resilient.collectives.recovery import Policy

        return Policy
    raise AttributeError(name)
