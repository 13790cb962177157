"""What the compressed allreduce needs of the Communicator that runs it.

:mod:`.compressed` and :mod:`.compression_switch` run inside
:class:`~.communicator.Communicator` (it calls them from ``allreduce(compression=...)``),
so they must not import it back: they are typed against this protocol, which the
Communicator satisfies structurally (mypy checks it where the Communicator passes itself).

Failure behaviour: none here (a protocol); the members' own docstrings in
:mod:`.communicator` say what each raises.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from resilient.collectives.algorithms.select import Sizing
from resilient.collectives.group import EpochLike
from resilient.collectives.ledger import Ledger
from resilient.collectives.op_metrics import OpMetrics
from resilient.collectives.ops import OpResult, OpSpec
from resilient.collectives.recovery import Policy
from resilient.collectives.work import Work
from resilient.kernels import ReduceOp
from resilient.transport.base import Transport

__all__ = ["CompressionHost"]


class CompressionHost(Protocol):
    """The Communicator as the compressed allreduce sees it."""

    sizing: Sizing
    metrics: OpMetrics
    transport: Transport
    last_compression: dict[str, Any] | None
    #: the measured-link switch of ``compression="auto"`` (a ``CompressionSwitch``)
    compression_switch: Any

    @property
    def epoch(self) -> EpochLike: ...

    @property
    def size(self) -> int: ...

    @property
    def retained(self) -> Ledger | None: ...

    @property
    def admitted_at(self) -> int: ...

    def reduce_now(self, t: torch.Tensor, op: ReduceOp, desc: dict[str, Any], policy: Policy | str | None,
                   reserve: int = 1, seq: int | None = None, sizing: Sizing | None = None) -> OpResult: ...

    def run_op(self, desc: dict[str, Any], spec: OpSpec, policy: Policy | str | None = None,
               seq: int | None = None, reserve: int = 1) -> Ledger: ...

    def take_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False,
                  policy: Policy | str | None = None, compression: Any = None) -> Work: ...

    def reserve_seqs(self, count: int) -> int: ...
