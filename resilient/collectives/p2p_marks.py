"""The point-to-point *sent marks* one member publishes when its send/recv ops move to a new
epoch, and the one rule that reads them.

One responsibility: say which messages of an ordered pair ``A -> B`` crossed an epoch
change. A transport drops every frame of an older epoch once it is configured for a newer
one (docs/internals.md, transports), so a message ``A`` finished sending in the old epoch
but ``B`` had not received when it moved on is gone, while one ``A`` had not finished is
sent again in the new epoch. When ``A``'s ops move to epoch ``e`` it puts, under
``epochs/<e>/data/p2p/<A>``, for every peer ``B`` the pair's first message number it had
not finished (``{"peers": [...], "sent": [...]}``); ``B`` reads it before posting its first
receive from ``A`` in ``e``: a receive numbered below the mark is lost
(:func:`lost_message`), one at or above it is posted and matched.

Failure behaviour: :func:`decode` validates the record like every etcd record (peers are
ids, marks non-negative 63-bit ints, one mark per peer) and raises
:class:`~resilient.errors.RecordError` naming the rule; nothing is unpickled.
"""
from __future__ import annotations

import json
from typing import Mapping

from resilient.coordinator import records
from resilient.errors import DataLost, RecordError

#: the blob name under ``epochs/<n>/data/``
BLOB = "p2p"


def encode(marks: Mapping[str, int]) -> bytes:
    """The record of ``marks`` (peer id -> first message number not finished)."""
    peers = sorted(marks)
    return json.dumps({"peers": peers, "sent": [int(marks[p]) for p in peers]}).encode()


def decode(raw: bytes, key: str = "") -> dict[str, int]:
    """Parse a marks record (see the module docstring for the rules and the error)."""
    f = records.fields("rendezvous", raw, key)
    peers, sent = f.names("peers", unique=True), f.ints("sent")
    if len(peers) != len(sent):
        raise RecordError(f"p2p marks record has {len(peers)} peers but {len(sent)} marks", "rendezvous", key)
    return dict(zip(peers, sent))


def lost_message(sender: str, receiver: str, n: int, mark: int, epoch: int) -> DataLost | None:
    """The error of receive ``n`` (of the pair ``sender -> receiver``) in ``epoch`` when
    ``sender`` finished that message in an older epoch (``n < mark``), else None."""
    if n >= mark:
        return None
    return DataLost(f"point-to-point message #{n} from {sender} to {receiver} was sent in an epoch before {epoch} "
                    f"and had not arrived when {receiver} moved to epoch {epoch} (the group changed under it): it "
                    "is lost; the pair's later messages are not affected")
