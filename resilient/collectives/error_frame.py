"""``ErrorFrame``: the payload of the ERROR frame one member sends the others about an op,
and the exception each reason turns into on the receiving side.

Reasons: the op's descriptors disagree (``InputMismatch``), the group changed before an
op with one buffer per member (``GroupChanged``), a link to a live member was given up
(``PeerUnreachable``). Encoded as JSON (never pickle); :meth:`ErrorFrame.decode` reads a
malformed payload as an unexplained mismatch from ``peer`` (the frame's sender), so a
peer running another version still makes this member stop waiting, with a clear error.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from resilient.errors import PeerUnreachable
from resilient.errors import CollectiveError, GroupChanged, InputMismatch


@dataclass(frozen=True)
class ErrorFrame:
    """``sender`` gives up op ``seq``; ``descriptor``: its op descriptor (or a reason),
    ``peer``: the member whose frame it found foreign; ``group_changed``: (buffers, group
    size); ``unreachable``: the member whose link it gave up, ``reason`` why."""

    sender: str
    descriptor: Any = None
    peer: str | None = None
    group_changed: tuple[int, int] | None = None
    unreachable: str | None = None
    reason: str | None = None

    def encode(self) -> bytes:
        body: dict[str, Any] = {"from": self.sender}
        if self.unreachable is not None:
            body.update(unreachable=self.unreachable, reason=self.reason)
        else:
            body.update(descriptor=self.descriptor, peer=self.peer)
        if self.group_changed is not None:
            body["group_changed"] = list(self.group_changed)
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, raw: bytes, peer: str) -> "ErrorFrame":
        """The frame ``peer`` relayed (see the module docstring for malformed payloads)."""
        try:
            d = json.loads(raw.decode())
        except (ValueError, UnicodeDecodeError):
            d = None
        if not isinstance(d, dict):
            return cls(sender=peer)
        gc = d.get("group_changed")
        changed = ((int(gc[0]), int(gc[1])) if isinstance(gc, list) and len(gc) == 2
                   and all(isinstance(v, int) and not isinstance(v, bool) for v in gc) else None)
        un = d.get("unreachable")
        return cls(sender=str(d.get("from")), descriptor=d.get("descriptor"),
                   peer=None if d.get("peer") is None else str(d.get("peer")), group_changed=changed,
                   unreachable=str(un) if un else None,
                   reason=None if d.get("reason") is None else str(d.get("reason")))

    def error(self, seq: int, me: str, mine: str) -> CollectiveError:
        """The exception this frame means on member ``me`` whose own descriptor is ``mine``."""
        if self.group_changed:
            n0, n = self.group_changed
            return GroupChanged(
                f"collective #{seq}: member {self.sender} found that the group changed from {n0} to {n} members "
                f"before the op started; call it again with one buffer per current member", n0, n)
        if self.unreachable:
            return PeerUnreachable(self.unreachable, (
                f"collective #{seq}: member {self.sender} gave up on its link to member {self.unreachable}: "
                f"{self.reason}"))
        return InputMismatch(
            f"collective #{seq}: members disagree on the op — member {self.sender} ({self.descriptor}) "
            f"saw a different descriptor from member {self.peer}; this member ({me}) called "
            f"{mine}; every member must call the same ops in the same order with matching inputs")
