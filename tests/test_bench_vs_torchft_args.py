"""bench/vs_torchft.py's argument parsing and lost-time arithmetic (the bench itself is not
run by the tests: it needs torchft and minutes)."""
from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_script(ROOT / "bench" / "vs_torchft.py", "vs_torchft_bench")


def test_quick_defaults_custom_sizes_and_bad_arguments():
    b = _bench()
    a = b.parse_args(["--quick"])
    assert (a.size, a.case, a.steps, a.kill_step) == (["small"], ["start", "allreduce"], 16, 6)
    a = b.parse_args(["--size", "2:256:0.1", "--case", "allreduce", "--steps", "30"])
    assert b.SIZES["2:256:0.1"] == (2, 256, 0.1) and a.case == ["allreduce"] and a.kill_step == 10
    assert b.parse_args(["--worker", "torchft", "--case", "start"]).case == "start"
    with pytest.raises(SystemExit):
        b.parse_args(["--size", "huge"])
    with pytest.raises(SystemExit):
        b.parse_args(["--steps", "10", "--kill-step", "9"])


def test_lost_seconds_counts_only_the_extra_time_of_committed_steps():
    b = _bench()
    # steps every 0.5 s, except step 7 took 2.0 s (a failure) and step 8 was logged twice
    t, recs = 0.0, []
    for s in range(1, 13):
        t += 2.0 if s == 7 else 0.5
        recs.append({"step": s, "t": t})
    recs.append({"step": 8, "t": recs[7]["t"] + 0.1})  # a later record of the same step is ignored
    recs.append({"event": "admit", "step": 9, "t": 99.0})
    assert b.median_step(recs) == 0.5
    assert b.lost_seconds(recs, 0.5, 3) == pytest.approx(1.5)
    assert b.lost_seconds(recs, 0.5, 40) is None


def test_steady_step_is_the_mean_of_the_steps_neither_the_kill_nor_the_admission_touched():
    b = _bench()
    # right-skewed step times (every 4th step slow), the kill at step 10 (3 slow steps in a
    # world of 2), the joiner back at step 20 (its first 3 steps slow)
    t, recs = 0.0, []
    for s in range(1, 31):
        dt = 1.0 if s in (11, 12, 13, 20, 21, 22) else (0.7 if s % 4 == 0 else 0.5)
        t += dt
        recs.append({"step": s, "t": t, "world": 2 if 11 <= s < 20 else 3})
    recs.append({"event": "admit", "step": 19, "t": 0.0})
    kept = [0.7 if s % 4 == 0 else 0.5 for s in range(4, 31) if s not in (11, 12, 13, 20, 21, 22)]
    assert b.steady_step(recs, 10) == pytest.approx(sum(kept) / len(kept))
    assert b.median_step(recs) == 0.5  # the median misses the slow quarter: x27 steps it adds up
    # what the failure cost: 6 steps of 1.0 s instead of the steady mean
    m = b.steady_step(recs, 10)
    expected = sum(1.0 - m for s in range(11, 31) if s in (11, 12, 13, 20, 21, 22)) + sum(
        (0.7 if s % 4 == 0 else 0.5) - m for s in range(8, 31) if s not in (11, 12, 13, 20, 21, 22))
    assert b.lost_seconds(recs, m, 7) == pytest.approx(expected)
