"""Pure logic of the torch backend's epoch-change records: the point-to-point sent marks
(resilient/collectives/p2p_marks.py) and the start markers that tell a restarted rank
from a starting one (resilient/torch_backend/start_markers.py), over an in-memory store."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from resilient.errors import DataLost, RecordError
from resilient.collectives import p2p_marks
from resilient.torch_backend import start_markers


def test_marks_round_trip_and_the_lost_message_rule():
    raw = p2p_marks.encode({"m-b": 3, "m-a": 0})
    assert p2p_marks.decode(raw) == {"m-a": 0, "m-b": 3}
    assert p2p_marks.lost_message("m-a", "m-b", 3, 3, 7) is None  # sent again in epoch 7
    err = p2p_marks.lost_message("m-a", "m-b", 2, 3, 7)
    assert isinstance(err, DataLost) and "#2 from m-a to m-b" in str(err) and "epoch 7" in str(err)


@pytest.mark.parametrize("raw", [b"not json", b'{"peers": ["m-a"], "sent": [1, 2]}', b'{"peers": ["m-a"], "sent": [-1]}',
                                 b'{"peers": ["m-a", "m-a"], "sent": [1, 2]}', b'{"peers": [3], "sent": [1]}'])
def test_a_malformed_marks_record_is_refused_by_name(raw):
    with pytest.raises(RecordError):
        p2p_marks.decode(raw, "epochs/3/data/p2p/m-a")


@dataclass
class _KV:
    key: str
    value: bytes


class _Store:
    def __init__(self) -> None:
        self.kv: dict[str, tuple[bytes, int | None]] = {}

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        self.kv[key] = (value.encode() if isinstance(value, str) else value, lease)
        return len(self.kv)

    def get_prefix(self, prefix: str) -> list[_KV]:
        return [_KV(k, v) for k, (v, _) in sorted(self.kv.items()) if k.startswith(prefix)]


def test_members_that_start_together_are_not_joiners_a_restarted_one_is():
    st = _Store()
    first = ["m-0", "m-1", "m-2"]
    for m in first[:2]:
        assert start_markers.started_without(st, "job", m, first) == []
        start_markers.mark_started(st, "job", m, first, lease=7)
    assert start_markers.started_without(st, "job", "m-2", first) == []   # started with them
    # m-2 died; its restart m-2b is in an epoch with m-0 and m-1, whose markers do not name it
    again = ["m-0", "m-1", "m-2b"]
    assert start_markers.started_without(st, "job", "m-2b", again) == ["m-0", "m-1"]
    assert start_markers.started_without(st, "other-job", "m-2b", again) == []


def test_a_malformed_start_marker_is_refused_by_name():
    st = _Store()
    st.put(start_markers._prefix("job") + "m-0", b'{"members": "m-1"}')
    with pytest.raises(RecordError):
        start_markers.started_without(st, "job", "m-1", ["m-0", "m-1"])


class _ShrinkingHost:
    """Just what PointToPoint's issue-time rank check reads (members, epoch number)."""

    def __init__(self, members: list[str]) -> None:
        self.members, self.member_id = members, members[0]
        self.epoch = type("E", (), {"number": 1})()


def test_a_rank_the_group_had_before_it_shrank_is_peer_lost_and_one_it_never_had_is_a_config_error():
    import torch
    from resilient.collectives.p2p import PointToPoint
    from resilient.errors import CollectiveError, ConfigError, PeerLost
    host = _ShrinkingHost(["m0", "m1", "m2", "m3"])
    p2p = PointToPoint(host)  # type: ignore[arg-type]
    host.members, host.epoch.number = ["m0", "m1", "m2"], 2   # m3 died: epoch 2 has 3 members
    with pytest.raises(PeerLost, match="shrank from 4 members") as exc:
        p2p.send(torch.zeros(2), 3, 0)
    assert isinstance(exc.value, CollectiveError) and exc.value.epoch == 2
    with pytest.raises(ConfigError, match="not in this 3-member group"):
        p2p.send(torch.zeros(2), 4, 0)   # never a rank of this group: the caller's mistake
