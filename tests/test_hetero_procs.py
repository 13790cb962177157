"""Speed-weighted shares end to end (bench/hetero.py in a small configuration): a real
etcd, a real coordinator publishing shares from the members' rates, 4 member processes
training DDP with the weighted hook on an ElasticSampler, one member SIGKILLed or
SIGSTOPped in the middle of a step's allreduce. Every step's gradient is checked against
a one-process computation over exactly the contributors' samples, and every sample of the
data epoch is processed at most once (the dead member's samples of its last step are
served again to the survivors). And the demote phase: uniform batches while the members
write health windows, until the coordinator's straggler detector has demoted the slow
member (checked in the epoch of every timed step), the data epochs rolling over."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from script_module import load_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
#: the fault tests: a victim in the weighted phase; no demote phase (it waits for the detector)
NO_DEMOTE = ("--phases", "uniform,weighted,evict")


def run_bench(*extra: str) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "hetero.py"), "--steps", str(STEPS), "--t-sample", "0.002",
           "--samples", "600", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def check_exact(out: dict) -> None:
    assert out["steps_checked"] == 3 * STEPS + (out["demote"]["steps"] if "demote" in out else 0)
    assert out["grad_max_abs_err"] < 1e-9, out
    assert out["exactly_once"], out
    assert out["sizes"]["uniform"] == [14, 14, 14, 14]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_in_a_weighted_step_keeps_every_step_exact():
    kill = STEPS + 1  # the second step of the weighted phase
    out = run_bench("--victim", "m1", "--kill-step", str(kill), *NO_DEMOTE)
    check_exact(out)
    # the ring: step K goes on without m1. The direct shared-memory allreduce (the default on
    # one host): the failpoint fires after m1 published its input, so m1 still counts in step K
    # (its segment stays mapped) and step K + 1 is the first without it
    assert out["steps_without"] in ({str(kill): ["m1"]}, {str(kill + 1): ["m1"]}), out
    # the shares were re-published for the survivors: the slow member still gets less
    shares = out["shares"]
    assert sorted(shares) == ["m0", "m2", "m3"] and shares["m3"] < 0.8 * min(shares["m0"], shares["m2"]), shares


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigstop_past_the_lease_removes_the_member_and_the_rest_stay_exact():
    out = run_bench("--victim", "m2", "--stop-step", str(STEPS + 1), *NO_DEMOTE)
    check_exact(out)
    # one step (in the weighted phase, where it was stopped) completed without it
    (step, missing), = out["steps_without"].items()
    assert missing == ["m2"] and STEPS <= int(step) < 2 * STEPS, out
    assert out["removed"] == ["m2"], out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demote_phase_times_steps_in_an_epoch_that_demotes_the_slow_member():
    """Fault-free, every phase: the detector (fed only in the demote phase) demotes m3 and
    nobody else; the timed demote steps ran in an epoch demoting it (the bench checks each);
    every step exact, no sample twice in a data epoch (600 samples: the detection's steps
    roll the sampler into new data epochs)."""
    out = run_bench()
    check_exact(out)
    d = out["demote"]
    assert d["detect_steps"] >= 1 and d["steps"] == d["detect_steps"] + STEPS, d
    assert d["timed_epochs"], d
    assert {m: r["state"] for m, r in d["straggler"].items()} == {"m0": "ok", "m1": "ok", "m2": "ok",
                                                                   "m3": "demoted"}, d
    assert out["sizes"]["demote"] == [14, 14, 14, 14]
    assert out["processed"] > 600   # more than one data epoch
    assert set(out["samples_per_s"]) == {"uniform", "weighted", "evict", "demote"}
    assert out["ratio_vs_demote"] is not None


def test_phases_argument_rules():
    b = load_script(ROOT / "bench" / "hetero.py", "hetero_bench")
    assert b.check_phases("uniform,weighted,evict,demote") == list(b.PHASES)
    assert b.check_phases("uniform,demote") == ["uniform", "demote"]
    for bad in ("weighted,uniform", "demote,uniform", "uniform,uniform", "uniform,fast", "weighted"):
        with pytest.raises(SystemExit):
            b.check_phases(bad)
