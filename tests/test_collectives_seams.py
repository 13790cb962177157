"""The Communicator's seams as pure logic (no sockets, no etcd): the tag/namespace
registry, the typed error frame, the epoch plan validated once, the buffer pool, the
algorithm selection and its capabilities, the recovery report's JSON form."""
from __future__ import annotations

import json

import pytest
import torch

from resilient.collectives import tags
from resilient.collectives.algorithms.leaf import LeafPath
from resilient.collectives.algorithms.recursive_doubling import RecursiveDoubling
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.algorithms import select
from resilient.collectives.buffers import BufferPool
from resilient.collectives.error_frame import ErrorFrame
from resilient.collectives.recovery_report import RecoveryReport, Timeline
from resilient.errors import PeerUnreachable
from resilient.coordinator.epoch import Epoch, EpochPlan
from resilient.errors import GroupChanged, InputMismatch, RecordError
from resilient.transport import base as transport_base


def test_every_algorithm_has_its_own_tag_space_and_namespaces_do_not_compare():
    assert len(set(tags.SPACES.values())) == len(tags.SPACES)
    for cls, space in ((RingReduceScatterAllgather, tags.RING), (RecursiveDoubling, tags.RECURSIVE_DOUBLING)):
        assert cls.SPACE == space
    assert tags.tag(3, 5, tags.LEAF) != tags.tag(3, 5, tags.STATUS_EXCHANGE)
    assert tags.namespace_of(tags.p2p_seq(7)) == tags.P2P and tags.namespace_of(12) == tags.COLLECTIVE
    assert not tags.same_namespace(tags.control_seq(1), 1) and tags.same_namespace(tags.p2p_seq(1), tags.p2p_seq(9))
    assert tags.control_seq(4) == transport_base.control_seq(4)   # the transport's own helper agrees
    with pytest.raises(ValueError, match="out of range"):
        tags.tag(0, 1 << 28)


@pytest.mark.parametrize("frame, err", [
    (ErrorFrame("m1", {"k": "allreduce"}, "m2"), InputMismatch),
    (ErrorFrame("m1", "the group changed from 3 to 2 members", "m1", group_changed=(3, 2)), GroupChanged),
    (ErrorFrame("m1", unreachable="m3", reason="link down 30 s"), PeerUnreachable),
])
def test_an_error_frame_round_trips_into_the_error_it_means(frame, err):
    back = ErrorFrame.decode(frame.encode(), "m1")
    assert back == frame
    exc = back.error(7, "m0", "{}")
    assert type(exc) is err and "#7" in str(exc) and "m1" in str(exc)
    if err is PeerUnreachable:
        assert exc.peer == "m3"


def test_a_malformed_error_frame_is_a_mismatch_naming_its_sender():
    for raw in (b"\xff", b"[1, 2]", json.dumps({"from": "x", "group_changed": [True, "a"]}).encode()):
        exc = ErrorFrame.decode(raw, "m4").error(2, "m0", "{}")
        assert isinstance(exc, InputMismatch), raw


def test_the_epoch_plan_is_typed_once_and_still_reads_as_the_record():
    plan = {"tree_parent": [-1, 0, 0], "host_groups": [[0, 3]], "leaf_deadline_ms": 25.0, "demoted": ["c"],
            "shard_weights": [1, 2.5], "extra": "kept"}
    e = Epoch.from_json(Epoch(4, ("a", "b", "c"), plan=plan).to_json())
    p = e.plan
    assert isinstance(p, EpochPlan)
    assert (p.tree_parent, p.host_groups, p.leaf_deadline_s, p.demoted, p.shard_weights) == (
        (-1, 0, 0), ((0, 3),), 0.025, ("c",), (1.0, 2.5))
    assert p["extra"] == "kept" and p.get("evicted") is None and dict(p) == plan
    assert EpochPlan.of({"leaf_deadline_ms": float("nan"), "tree_parent": "x"}).leaf_deadline_s is None
    bad = json.loads(e.to_json())
    bad["plan"]["tree_parent"] = [-1, 0]   # one parent short
    with pytest.raises(RecordError, match="tree_parent"):
        Epoch.from_json(json.dumps(bad).encode())


def test_the_buffer_pool_reuses_only_its_own_large_buffers():
    pool = BufferPool()
    big = pool.take(1 << 18, torch.float32)   # 1 MiB
    pool.release(big)
    assert pool.take(1 << 18, torch.float32).data_ptr() == big.data_ptr()
    foreign = torch.empty(1 << 18)
    pool.release(foreign)
    assert pool.take(1 << 18, torch.float32).data_ptr() != foreign.data_ptr()
    small = pool.take(16, torch.float32)
    pool.release(small)
    assert pool.take(16, torch.float32).data_ptr() != small.data_ptr()


def test_selection_picks_by_size_and_plan_and_the_leaf_path_asks_capabilities():
    members = ["a", "b", "c", "d"]
    sizing = select.Sizing(small_bytes=1024, slice_bytes=1024, max_slices=4)
    flat = Epoch(1, tuple(members))
    pieces, algo = select.allreduce(members, flat, 16, 4, sizing)
    assert isinstance(algo, RecursiveDoubling) and pieces == [(0, 16)]
    pieces, algo = select.allreduce(members, flat, 4096, 4, sizing)
    assert isinstance(algo, RingReduceScatterAllgather) and len(pieces) == 4 * algo.slices
    demoted = Epoch(2, tuple(members), roles={"d": "demoted"}, plan={"tree_parent": [-1, 0, 0, 1]})
    _, algo = select.allreduce(members, demoted, 4096, 4, sizing)
    assert isinstance(algo, LeafPath) and algo.leaves == {"d": "b"} and algo.inner.capabilities.forward_ring_only
    assert not RecursiveDoubling().capabilities.forward_ring_only
    lay = select.per_member("reduce_scatter", members, flat, 4, 8, 4, sizing)
    assert lay.owner == [0, 1, 2, 3] and lay.pieces[1] == (8, 16)


def test_the_recovery_report_has_the_keys_of_the_old_dict():
    rep = RecoveryReport(seq=3, epoch=5, seconds=0.5, status_s=0.1, plan_s=0.01, execute_s=0.3, rounds=2,
                         transfers=6, bytes_sent=1024, link_retries=0, contributors=["a", "b"],
                         timeline=Timeline(None, 1.0, 1.1, 1.2, 1.5), wait_recv_s=0.2, extra={"other_s": 0.0})
    d = rep.as_dict()
    assert {"seq", "epoch", "seconds", "bytes_sent", "contributors", "timeline", "wait_recv_s", "other_s"} <= set(d)
    assert d["timeline"]["done"] == 1.5 and json.loads(json.dumps(d)) == d
