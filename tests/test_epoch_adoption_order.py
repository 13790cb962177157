"""Growing epochs are adopted one by one, each at the op seq the group agreed for it
(issue 16): a member whose next op boundary comes after a later epoch is already out
must still switch to the earlier one where the others did, or it runs that op in another
epoch than they do (frames of the other epoch are parked: the op hangs). In-process,
the trackers of two members over one shared blob store; no sockets."""
from __future__ import annotations

import threading

from resilient.collectives.epochs import EpochTracker
from static_group import Info, StaticEpoch, StaticView


class _View(StaticView):
    """StaticView whose current epoch the test moves forward."""

    def wait_for(self, pred, timeout):
        if pred(self.epoch):
            return self.epoch
        raise TimeoutError("no such epoch")


class _Transport:
    def __init__(self) -> None:
        self.configured: list[int] = []

    def abort(self, reason: str) -> None:
        raise AssertionError(f"no epoch here removes a member: {reason}")

    def configure(self, epoch: int, token: str, addresses: dict[str, str]) -> None:
        self.configured.append(epoch)

    def join_carrier(self) -> None:
        return None   # no join side channel: the per-member joinseq keys (RESILIENT_JOIN_TREE=1 too)


def _epoch(n: int) -> StaticEpoch:
    return StaticEpoch(n, ("a", "b"), f"t{n}", {"a": Info("x:1"), "b": Info("x:2")},
                       cause="initial" if n == 1 else "health")


def _op(tr: EpochTracker) -> tuple[int, int]:
    """One op boundary: (its seq, the epoch it runs in)."""
    seq, _ = tr.reserve(None, 1)
    return seq, tr.epoch.number


def test_a_member_that_sees_a_later_epoch_first_still_adopts_the_earlier_one_where_the_group_does():
    blobs: dict = {"lock": threading.Condition()}
    views = {m: _View(m, _epoch(1), blobs) for m in "ab"}
    trs = {m: EpochTracker(views[m], _Transport(), _Transport(), 5.0, None) for m in "ab"}
    for t in trs.values():
        t.start(False)
    ran: dict[str, list[tuple[int, int]]] = {m: [_op(trs[m]) for _ in range(5)] for m in "ab"}   # ops 0-4 in epoch 1

    def deliver(n: int) -> None:
        for m in "ab":
            views[m].epoch = _epoch(n)
            trs[m].on_epoch(views[m].epoch)   # the watch thread: announces the next op seq

    deliver(2)                      # both announce op 5 for epoch 2
    ran["a"].append(_op(trs["a"]))  # a: adopts epoch 2 at op 5
    deliver(3)                      # a announces op 6 for epoch 3, b (still before op 5) op 5
    ran["b"].append(_op(trs["b"]))  # b must run op 5 in epoch 2 as well, not in epoch 1
    for m in "ab":
        ran[m].append(_op(trs[m]))  # op 6: both in epoch 3
    assert ran["a"] == ran["b"]
    assert ran["a"][5:] == [(5, 2), (6, 3)]
    assert [t.op_transport.configured for t in trs.values()] == [[1, 2, 3], [1, 2, 3]]
