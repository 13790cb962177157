"""Reduction operators shared by every kernel implementation."""
from __future__ import annotations

import enum

from resilient.errors import ConfigError


class ReduceOp(str, enum.Enum):
    """Reduction operators. ``AVG`` sums during the reduction; the collective divides by
    the size of the contributor set it reports, once, at the end."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            raise ConfigError(f"unknown reduce op {op!r}; expected one of {[o.value for o in cls]}") from None
