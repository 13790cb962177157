"""bench/compression_quality.py's time-to-loss arithmetic and arguments (the bench itself
is not run by the tests: it trains for minutes, and ``--cap-mb-s`` needs root)."""
from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_script(ROOT / "bench" / "compression_quality.py", "compression_quality_bench")


def test_ratio_is_fp32_time_to_its_final_loss_over_the_arm_time_to_that_loss():
    b = _bench()
    fp32 = [(24, 10.0, 2.0), (49, 20.0, 1.5), (74, 30.0, 1.40), (99, 40.0, 1.41)]  # final 1.41 first at 30 s
    q4 = [(24, 5.0, 1.9), (49, 10.0, 1.41), (74, 15.0, 1.39), (99, 20.0, 1.38)]
    q8 = [(24, 8.0, 2.0), (49, 16.0, 1.43), (74, 24.0, 1.42), (99, 32.0, 1.42)]  # never <= 1.41
    got = b.time_to_loss({"res_fp32": fp32, "res_q4": q4, "res_q8": q8})
    assert got["fp32_trace_loss"] == 1.41
    assert got["seconds_to_fp32_loss"] == {"res_fp32": 30.0, "res_q4": 10.0, "res_q8": None}
    assert got["time_to_fp32_loss_ratio"] == 3.0
    assert got["time_to_fp32_loss_ratio_q8"] is None   # not reached: no figure, not a stand-in
    # the 1 % key: both arms to 1.01 x 1.41 = 1.4241
    assert got["seconds_to_within_1pct"] == {"res_fp32": 30.0, "res_q4": 10.0, "res_q8": 24.0}
    assert got["time_to_within_1pct_ratio"] == 3.0 and got["time_to_within_1pct_ratio_q8"] == 1.25
    assert got["train_seconds"] == {"res_fp32": 40.0, "res_q4": 20.0, "res_q8": 32.0}


def test_missing_compressed_arm_gives_null_ratios():
    got = _bench().time_to_loss({"res_fp32": [(0, 1.0, 3.0)]})
    assert got["time_to_fp32_loss_ratio"] is None and got["time_to_within_1pct_ratio_q8"] is None


def test_bad_eval_every_is_refused():
    with pytest.raises(SystemExit):
        _bench().main(["--eval-every", "0"])
