"""Per-op observations of a Communicator: the metrics registry and the health reporter.

Failure behaviour: never fails an op — an error of either is logged at debug level and
dropped.
"""
from __future__ import annotations

import logging
from typing import Any

from resilient.collectives.ledger import Ledger
from resilient.collectives.recovery_report import RecoveryReport

log = logging.getLogger(__name__)


class OpMetrics:
    """``metrics``: a :class:`resilient.metrics` registry or None; ``health_reporter``:
    an object with ``op_done(epoch, seconds)`` or None."""

    def __init__(self, metrics: Any, health_reporter: Any) -> None:
        self.metrics, self.health_reporter = metrics, health_reporter

    def op_finished(self, kind: str, seconds: float, nbytes: int, epoch: int) -> None:
        """Per op (never per slice)."""
        if self.metrics is not None:
            try:
                self.metrics.record_collective(kind, seconds, nbytes)
            except Exception as exc:  # noqa: BLE001
                log.debug("metrics: %s", exc)
        if self.health_reporter is not None:
            try:
                self.health_reporter.op_done(epoch, seconds)
            except Exception as exc:  # noqa: BLE001
                log.debug("health reporter: %s", exc)

    def op_resumed(self, rep: RecoveryReport, L: Ledger, n_members: int) -> None:
        """One finished recovery: time, bytes resent and bytes saved versus redoing the op
        from scratch (2(n-1)/n of the op's bytes each)."""
        if self.metrics is None:
            return
        n = max(1, n_members)
        scratch = int(2 * (n - 1) / n * L.inp.numel() * L.inp.element_size())
        try:
            self.metrics.record_op_resumed(rep.seconds, rep.bytes_sent, max(0, scratch - rep.bytes_sent))
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %s", exc)

    def compression_decision(self, choice: str) -> None:
        if self.metrics is not None:
            try:
                self.metrics.record_compression_decision(choice)
            except Exception as exc:  # noqa: BLE001 - metrics never fail an op
                log.debug("metrics: %s", exc)
