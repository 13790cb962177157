"""The automatic compression switch decides without a per-call vote: the agreed plan,
when a vote is due (plan end, probe, admission), and what happens when members disagree
anyway (both raise InputMismatch, no result)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from resilient.collectives.compression_switch import CompressionSwitch
from resilient.errors import ConfigError, InputMismatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import run_communicators  # noqa: E402

NB = 64 << 20
STEADY = torch.tensor([0.0, 0.0, -3.0])   # an agreed vote without probes: q4 3x faster


def test_plan_is_followed_for_revote_every_calls_then_revoted():
    sw = CompressionSwitch(revote_every=4, codec_s_per_byte={4: (0.0, 0.0)})
    assert sw.needs_vote(NB, 4, admitted_at=0)                  # no plan yet
    assert sw.decide(torch.tensor([1.0, 0.0, 0.0]), 4, NB, seq=0) == "fp32"   # fp32 probe ...
    assert sw.needs_vote(NB, 4, admitted_at=0)                  # ... is followed by a vote
    assert sw.decide(STEADY, 4, NB, seq=3) == "q4"
    follows = []
    while not sw.needs_vote(NB, 4, admitted_at=0):
        follows.append(sw.follow(NB, 4))
    assert follows == ["q4"] * 3 and sw.votes == 2            # revote_every=4: one vote, three follows
    assert sw.needs_vote(NB // 2, 4, admitted_at=0)            # another size class has its own plan
    assert sw.needs_vote(NB, 8, admitted_at=0)                 # and so do other bits


def test_an_admission_after_the_vote_forces_a_vote():
    sw = CompressionSwitch(revote_every=100)
    sw.decide(STEADY, 4, NB, seq=30)
    assert not sw.needs_vote(NB, 4, admitted_at=30)            # admitted before the vote: the plan holds
    assert sw.needs_vote(NB, 4, admitted_at=31)                # a member admitted after it has no plan


def test_members_with_different_measurements_keep_identical_plans():
    a, b = (CompressionSwitch(revote_every=3, codec_s_per_byte={4: (0.0, 0.0)}) for _ in range(2))
    a.observe("fp32", NB, 4, sent=10**8, seconds=1.0)
    b.observe("fp32", NB, 4, sent=10**10, seconds=0.2)
    a.observe("q4", NB, 4, sent=0, seconds=0.4)
    b.observe("q4", NB, 4, sent=0, seconds=0.15)               # b: q4 only 1.33x faster, a: 2.5x
    agreed = torch.maximum(a.vote(NB, 4, 4), b.vote(NB, 4, 4))
    assert float(agreed[0]) == float(agreed[1]) == 0              # no probe: a plan of 3 calls
    assert a.decide(agreed, 4, NB, 9) == b.decide(agreed, 4, NB, 9) == "q4"
    assert a.last_speedup == b.last_speedup == pytest.approx(0.2 / 0.15)   # the slowest member's
    for _ in range(2):
        assert not a.needs_vote(NB, 4, 0) and not b.needs_vote(NB, 4, 0)
        assert a.follow(NB, 4) == b.follow(NB, 4)
    assert a.plans == b.plans and a.needs_vote(NB, 4, 0) and b.needs_vote(NB, 4, 0)


def test_a_stale_arm_is_probed_again():
    sw = CompressionSwitch(revote_every=2, probe_every=6, codec_s_per_byte={4: (0.0, 0.0)})
    sw.observe("fp32", NB, 4, sent=10**6, seconds=1.0)        # a slow link
    sw.observe("q4", NB, 4, sent=0, seconds=0.1)
    votes = []
    for _ in range(12):
        if sw.needs_vote(NB, 4, 0):
            v = sw.vote(NB, 4, 4)
            votes.append((float(v[0]), float(v[1])))
            sw.observe(sw.decide(v, 4, NB, 0), NB, 4, sent=10**6, seconds=0.1)
        else:
            sw.observe(sw.follow(NB, 4), NB, 4, sent=0, seconds=0.1)
    assert (1.0, 0.0) in votes                                   # fp32 re-measured after probe_every calls
    assert votes[0] == (0.0, 0.0)


def test_revote_every_must_be_positive():
    with pytest.raises(ConfigError, match="revote_every"):
        CompressionSwitch(revote_every=0)


def test_steady_state_runs_no_vote_and_members_agree():
    x0 = {f"m{i}": torch.randn(200, 100, generator=torch.Generator().manual_seed(i)) for i in range(3)}

    def body(m, c):
        sw = c.compression_switch = CompressionSwitch(revote_every=4, margin=0.0, skip_below=0.0,
                                                      codec_s_per_byte={4: (0.0, 0.0)})
        out = []
        for _ in range(9):
            t = x0[m].clone()
            k = c.next_seq
            c.allreduce(t, compression="auto")
            # with a vote the op runs at k+1 (compressed: its ring at k+2), without one at k (ring at k+1)
            out.append((sw.last_choice, c.retained.seq - k, t))
        return out, sw.votes

    ids, got = run_communicators(3, "qplan", body, small_bytes=1024)
    choices = [(ch, d) for ch, d, _ in got["m0"][0]]
    # fp32 probe (vote), q4 probe (vote), then a plan of 4 calls: one vote + 3 follows, twice,
    # then the next plan's vote
    assert choices == [("fp32", 1), ("q4", 2), ("q4", 2), ("q4", 1), ("q4", 1), ("q4", 1),
                       ("q4", 2), ("q4", 1), ("q4", 1)]
    for m in ids:
        assert got[m][1] == 4
        for (ch, d, t), (ch0, d0, t0) in zip(got[m][0], got["m0"][0]):
            assert (ch, d) == (ch0, d0) and torch.equal(t, t0)


def test_members_that_disagree_on_voting_both_fail_with_input_mismatch():
    x0 = {f"m{i}": torch.randn(200, 100, generator=torch.Generator().manual_seed(i)) for i in range(2)}

    def body(m, c):
        sw = c.compression_switch = CompressionSwitch(revote_every=10, codec_s_per_byte={4: (0.0, 0.0)})
        for _ in range(3):            # fp32 probe, q4 probe, then a plan of 10 calls
            c.allreduce(x0[m].clone(), compression="auto")
        assert not sw.needs_vote(x0[m].numel() * 4, 4, c.admitted_at)
        if m == "m1":
            sw.plans.clear()          # m1 lost its plan: it votes where m0 follows
        t = x0[m].clone()
        try:
            c.allreduce(t, compression="auto")
        except InputMismatch as exc:
            return str(exc)
        return None

    ids, got = run_communicators(2, "qplanbad", body, small_bytes=1024)
    for m in ids:
        # Which wording a member gets is a race, and both are right: the member that meets the
        # foreign descriptor first says "called a different collective"; one that gets the other's
        # error frame first relays it ("members disagree on the op"). Both are InputMismatch.
        assert got[m] is not None and "every member must call the same ops" in got[m], got
        assert "different collective" in got[m] or "members disagree on the op" in got[m], got
