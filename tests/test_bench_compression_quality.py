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


def test_extra_steps_count_toward_the_arm_time_and_the_target_is_fp32_at_the_schedule_end():
    b = _bench()
    # schedule of 100 steps (end at step 99), 50 extra steps at the last learning rate
    fp32 = [(49, 20.0, 1.50), (99, 40.0, 1.40), (149, 60.0, 1.38)]   # target 1.40, not its later 1.38
    q4 = [(49, 8.0, 1.52), (99, 16.0, 1.402), (149, 24.0, 1.399)]   # reached only in the extra steps
    got = b.time_to_loss({"res_fp32": fp32, "res_q4": q4}, schedule_end=99)
    assert got["fp32_trace_loss"] == 1.4
    assert got["seconds_to_fp32_loss"] == {"res_fp32": 40.0, "res_q4": 24.0, "res_q8": None}
    assert got["steps_to_fp32_loss"] == {"res_fp32": 100, "res_q4": 150, "res_q8": None}
    assert got["time_to_fp32_loss_ratio"] == round(40 / 24, 3)


def test_hashed_ngram_ids_stay_in_the_table_and_see_the_third_character():
    import torch

    b = _bench()
    x = torch.tensor([[1, 2, 3, 4], [9, 2, 3, 4]])   # same last two characters at position 3 in both rows
    ids = b._ngram_ids(x, 1 << 16)
    assert ids.shape == (2, 4, 2) and int(ids.min()) >= 0 and int(ids.max()) < 1 << 16
    assert ids[0, 3, 0] == ids[1, 3, 0]   # bigram (4, 3): the same row
    assert ids[0, 2, 1] != ids[1, 2, 1]   # trigram (3, 2, 1) vs (3, 2, 9): different rows
