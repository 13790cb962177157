"""Point-to-point send/recv of a Communicator: one op-sequence counter per ordered pair
in the ``P2P`` namespace (:mod:`.tags`), so the pair's messages match in call order and
never meet a collective's.

Failure behaviour: a wait longer than ``op_timeout`` reports the peer as suspect and keeps
waiting; a transport error (the peer died, an epoch aborted the transport) propagates. No
ledger: a failed send/recv is not resumed. A CUDA tensor is sent from (received into) a
host copy.
"""
from __future__ import annotations

from typing import Callable

import torch

from resilient.collectives import tags
from resilient.collectives.ops import digest
from resilient.transport.base import Transport


class PointToPoint:
    def __init__(self, member_id: str, transport: Transport, op_timeout: float | None,
                 on_suspect: Callable[[str, str], None]) -> None:
        self.member_id, self.transport, self.op_timeout, self.on_suspect = member_id, transport, op_timeout, on_suspect
        self._counts: dict[tuple[str, str], int] = {}

    def run(self, t: torch.Tensor, peer: str, tag: int, is_send: bool) -> None:
        """Send ``t`` to / receive it in place from ``peer`` with user tag ``tag``."""
        key = (self.member_id, peer) if is_send else (peer, self.member_id)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        seq = tags.p2p_seq(n)
        # the transports move host bytes: a CUDA tensor goes through a host copy
        buf = t if t.is_contiguous() and t.device.type == "cpu" else t.detach().contiguous().cpu()
        d = digest({"k": "p2p", "shape": list(t.shape), "dtype": str(t.dtype)})
        req = self.transport.isend(peer, buf, seq, tag, d) if is_send else self.transport.irecv(peer, buf, seq, tag, d)
        while not self.transport.wait([req], timeout=self.op_timeout):
            self.on_suspect(peer, f"point-to-point with {peer} waited more than {self.op_timeout}s")
        if not is_send and buf is not t:
            t.copy_(buf)
