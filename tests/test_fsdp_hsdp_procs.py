"""Acceptance: an unchanged FSDP2/HSDP script (tests/scripts/hsdp_train.py: ``fully_shard``
over a 2 x 2 ``init_device_mesh``, float64, SGD with momentum) under ``resilient-run
--standalone`` with default flags — real etcd, coordinator, processes and sockets.

Asserted:
- fault-free, every rank's local shards after every step are bitwise those of the same
  script on gloo (under torchrun);
- a member of replica group 1 SIGKILLed at each FSDP phase of step 2 — before a layer's
  forward (its peers in the all-gather), mid-backward (reduce-scatter), as the replicate
  all-reduce starts, in the optimizer step: the job exits 0, its row-mate steps aside with
  exit 0 saying so, and replica group 0 finishes every step with shards bitwise equal to a
  reference run over the same contributor sets (replica group 1 leaves cleanly before the
  first step it did not contribute to: step 2, or step 3 for a kill in the optimizer step,
  whose reductions were complete).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsdp_script import RUN, TORCHRUN, run_script, shards
STEPS, KILL_RANK, KILL_STEP = 4, 2, 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(tmp: Path, name: str, launcher: list[str], **env: str) -> tuple[int, str, dict[int, dict]]:
    return run_script(tmp, name, launcher, "2,2", 4, STEPS, 150, **env)



@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[int, dict]]:
    """Reference runs: replica group 1 leaves cleanly before step 2 / step 3."""
    tmp = tmp_path_factory.mktemp("hsdp_ref")
    steps = (KILL_STEP, KILL_STEP + 1)
    with ThreadPoolExecutor(len(steps)) as ex:  # side by side: each job its own standalone etcd
        runs = {step: ex.submit(_run, tmp, f"leave{step}", RUN, KILL_RANK=str(KILL_RANK), KILL_STEP=str(step),
                                KILL_PHASE="leave") for step in steps}
        refs = {}
        for step, run in runs.items():
            rc, text, logs = run.result()
            assert rc == 0, text[-3000:]
            assert logs[0]["finished"] and logs[1]["finished"] and not logs[2]["finished"], text[-3000:]
            refs[step] = logs
    return refs


def test_fault_free_hsdp_is_bitwise_gloo(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as ex:  # side by side (different ports: --standalone picks free ones)
        run_ours, run_gloo = ex.submit(_run, tmp_path, "resilient", RUN), ex.submit(_run, tmp_path, "gloo", TORCHRUN,
                                                                                    BACKEND="gloo")
        (rc, text, ours), (grc, gtext, gloo) = run_ours.result(), run_gloo.result()
    assert rc == 0, text[-3000:]
    assert grc == 0, gtext[-3000:]
    assert sorted(ours) == sorted(gloo) == [0, 1, 2, 3]
    for rank in range(4):
        assert len(ours[rank]["steps"]) == STEPS
        assert shards(ours[rank]) == shards(gloo[rank]), f"rank {rank} differs from gloo"
    # the replicate dimension really averaged: the two replica groups hold equal shards
    # although their batches differ (their losses do)
    assert shards(ours[0]) == shards(ours[2]) and shards(ours[1]) == shards(ours[3])
    assert ours[0]["steps"][0]["loss"] != ours[2]["steps"][0]["loss"]


@pytest.mark.parametrize("phase", ["ag", "rs", "ar", "optim"])
def test_hsdp_survives_sigkill(tmp_path: Path, references: dict[int, dict[int, dict]], phase: str) -> None:
    rc, text, logs = _run(tmp_path, phase, RUN, KILL_RANK=str(KILL_RANK), KILL_STEP=str(KILL_STEP),
                          KILL_PHASE=phase)
    assert rc == 0, text[-3000:]
    assert "killed by SIGKILL" in text
    assert "steps aside: its replica group 1 lost" in text, text[-3000:]
    assert "by design (exit 0): local rank 3: stepped aside: replica group 1 lost" in text, text[-3000:]
    assert 2 not in logs and 3 not in logs, "replica group 1 wrote a final log"
    ref = references[KILL_STEP + 1 if phase == "optim" else KILL_STEP]
    for rank in (0, 1):
        assert logs[rank]["finished"] and len(logs[rank]["steps"]) == STEPS
        assert shards(logs[rank]) == shards(ref[rank]), f"rank {rank} after a kill in {phase}"
