"""What a member does when it gives up an op: tell the others with an ERROR frame
(:mod:`.error_frame`) so none waits for it, drop the op on the transport, and raise the
error the reason means.

Failure behaviour: the ERROR frames are posted best-effort by the transport (a member
without a link gets the relay of another); each method raises the op's
:class:`~resilient.errors.CollectiveError` (``InputMismatch``, ``GroupChanged`` or
``PeerUnreachable``) and never returns normally except :meth:`OpErrors.unreachable`.
"""
from __future__ import annotations

import json
from typing import Any, Callable, NoReturn, Protocol

from resilient.collectives.error_frame import ErrorFrame
from resilient.errors import GroupChanged, InputMismatch
from resilient.transport.base import OpMismatch, PeerReportedError, Transport


class Cancels(Protocol):
    def cancel_op(self, op_seq: int) -> None: ...


class OpErrors:
    """``members()``: the op's current members (who is told)."""

    def __init__(self, member_id: str, transport: Transport, op_transport: Cancels,
                 members: Callable[[], list[str]]) -> None:
        self.member_id, self.transport, self.op_transport, self.members = member_id, transport, op_transport, members

    def post(self, seq: int, frame: ErrorFrame, raw: bytes | None = None, members: list[str] | None = None) -> None:
        """Tell ``members`` (default: the op's) that this member gives up op ``seq``, and drop it."""
        self.transport.post_error(self.members() if members is None else members, seq,
                                  frame.encode() if raw is None else raw)
        self.op_transport.cancel_op(seq)

    def unreachable(self, seq: int, peer: str, reason: str) -> None:
        """A link to ``peer`` was given up: tell the members beyond it (they would wait for us)."""
        self.post(seq, ErrorFrame(self.member_id, unreachable=peer, reason=reason))

    def require_group_of(self, n0: int, members: list[str], seq: int, kind: str, what: str) -> None:
        """Ops with one buffer per member cannot run over a changed group: every member is
        told (so none waits) and the caller gets a CollectiveError saying what to do."""
        n = len(members)
        if n != n0:
            self.post(seq, ErrorFrame(self.member_id, f"the group changed from {n0} to {n} members",
                                      self.member_id, group_changed=(n0, n)), members=members)
            raise GroupChanged(f"{kind} #{seq}: the group changed from {n0} to {n} members before it "
                               f"started; call it again with one {what} per current member", n0, n)

    def mismatch(self, seq: int, desc: dict[str, Any], exc: OpMismatch | PeerReportedError) -> NoReturn:
        """This member saw a foreign descriptor (``OpMismatch``) or a peer reported one."""
        mine = json.dumps(desc, sort_keys=True)
        if isinstance(exc, OpMismatch):
            self.post(seq, ErrorFrame(self.member_id, desc, exc.peer))
            raise InputMismatch(
                f"collective #{seq}: member {exc.peer} called a different collective/shape/dtype/op than this member "
                f"({self.member_id}: {mine}); every member must call the same ops in the same order with matching "
                "inputs") from None
        frame = ErrorFrame.decode(exc.message, exc.peer)
        self.post(seq, frame, raw=exc.message)  # relay: reaches members without a direct link
        raise frame.error(seq, self.member_id, mine) from None
