"""Acceptance: plain FSDP (one replica group, ``fully_shard`` over a 1-D
``init_device_mesh``) survives a SIGKILL with no checkpoint — the unchanged script
tests/scripts/hsdp_train.py under ``resilient-run --standalone``, real etcd, coordinator,
processes and sockets; float64, SGD with momentum, each member its own batch.

Asserted:
- fault-free on 2 members, every rank's shards after every step are bitwise those of the
  same script on gloo (the peer copies change nothing);
- world rank 2 of 4 SIGKILLed in step 2 at each phase — before a layer's forward (its peers
  in the all-gather), mid-backward (reduce-scatter), in the optimizer step, and once its peer
  copy's send is posted (the ``peer_copy`` failpoint): the job exits 0, no survivor
  restarts, its buddy hosts its shards from the peer copy, and every survivor's shards
  after every step are bitwise those of a reference run in which rank 2 left cleanly
  before step 2 (the same contributor sets: step 2 and later without rank 2's batch);
- the reference really differs from the fault-free run from step 2 on (the loss is felt).
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fsdp_script import RUN, TORCHRUN, run_script, shards
STEPS, KILL_RANK, KILL_STEP, WORLD = 4, 2, 2, 4
PHASES = ("ag", "rs", "optim", "copy")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(tmp: Path, name: str, launcher: list[str], n: int = WORLD, **env: str) -> tuple[int, str, dict[int, Any]]:
    return run_script(tmp, name, launcher, str(n), n, STEPS, 200, **env)



@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, dict[int, Any]]]:
    """The reference, the fault-free run and one run per kill phase, one at a time: four
    processes (more, beside another test file's, starve the lease-TTL tests there)."""
    tmp = tmp_path_factory.mktemp("fsdp_plain")
    kill = {"KILL_RANK": str(KILL_RANK), "KILL_STEP": str(KILL_STEP)}
    jobs: dict[str, dict[str, str]] = {"leave": {**kill, "KILL_PHASE": "leave"}, "fault_free": {},
                                       **{p: {**kill, "KILL_PHASE": p} for p in PHASES}}
    return {name: _run(tmp, name, RUN, **env) for name, env in jobs.items()}


def test_fault_free_plain_fsdp_is_bitwise_gloo(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as ex:
        ours, gloo = ex.submit(_run, tmp_path, "resilient", RUN, 2), ex.submit(_run, tmp_path, "gloo", TORCHRUN, 2,
                                                                               BACKEND="gloo")
        (rc, text, got), (grc, gtext, ref) = ours.result(), gloo.result()
    assert rc == 0, text[-3000:]
    assert grc == 0, gtext[-3000:]
    for rank in (0, 1):
        assert len(got[rank]["steps"]) == STEPS
        assert shards(got[rank]) == shards(ref[rank]), f"rank {rank} differs from gloo"
        assert len(got[rank]["copy_s"]) == STEPS, "a peer copy committed after every step"


def test_reference_feels_the_loss(runs: dict[str, tuple[int, str, dict[int, Any]]]) -> None:
    (rc, text, ref), (frc, ftext, free) = runs["leave"], runs["fault_free"]
    assert rc == 0, text[-3000:]
    assert frc == 0, ftext[-3000:]
    assert "hosts the shards of the lost" in text
    for rank in (0, 1, 3):
        assert ref[rank]["finished"] and len(ref[rank]["steps"]) == STEPS
        assert shards(ref[rank])[:KILL_STEP] == shards(free[rank])[:KILL_STEP]
        assert shards(ref[rank])[KILL_STEP] != shards(free[rank])[KILL_STEP]
    assert ref[KILL_RANK]["finished"] is False


@pytest.mark.parametrize("phase", PHASES)
def test_plain_fsdp_survives_sigkill(runs: dict[str, tuple[int, str, dict[int, Any]]], phase: str) -> None:
    rc, text, logs = runs[phase]
    ref = runs["leave"][2]
    assert rc == 0, text[-3000:]
    assert "killed by SIGKILL" in text and "not restarted" in text
    hosting = re.search(r"(g0-l\d+)-\S+ hosts the shards of the lost (g0-l\d+)-", text)
    assert hosting and hosting.groups() == (f"g0-l{KILL_RANK + 1}", f"g0-l{KILL_RANK}"), text[-3000:]
    assert KILL_RANK not in logs, "the killed rank wrote a final log"
    for rank in (0, 1, 3):
        assert logs[rank]["finished"] and len(logs[rank]["steps"]) == STEPS, text[-3000:]
        assert shards(logs[rank]) == shards(ref[rank]), f"rank {rank} after a kill in {phase}"
    # the step the loss cut through is redone; a loss before the step's first reduction is not
    assert logs[0]["steps_redone"] == (0 if phase == "ag" else 1)
