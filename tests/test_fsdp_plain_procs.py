"""Acceptance: plain FSDP (one replica group, ``fully_shard`` over a 1-D
``init_device_mesh``) survives a SIGKILL with no checkpoint — the unchanged script
tests/scripts/hsdp_train.py under ``resilient-run --standalone``, real etcd, coordinator,
processes and sockets; float64, SGD with momentum, each member its own batch.

Asserted:
- fault-free on 2 members, every rank's shards after every step are bitwise those of the
  same script on gloo (the peer copies change nothing);
- a kill at each phase, two per run of 4 members: world rank 2 SIGKILLed in step 2, then
  rank 3, its host, in step 3 — before a layer's forward (its peers in the all-gather) and
  mid-backward (reduce-scatter) in one run, in the optimizer step and once its peer copy's
  send is posted (the ``peer_copy`` failpoint) in the other. Each job exits 0, no survivor
  restarts, rank 3 hosts rank 2's shards, then rank 0 (rank 3's buddy) hosts both from
  rank 3's copy, which carried rank 2's on; every survivor's shards after every step are
  bitwise those of a reference run in which rank 2 left cleanly before step 2 and rank 3
  before step 3 (the same contributor sets);
- the reference really ran those steps on 3 and then 2 members.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fsdp_script import RUN, TORCHRUN, run_script, shards
STEPS, WORLD = 5, 4
#: (world rank, step) of the two losses of each run, and the two runs' phases for them
LOSSES = ((2, 2), (3, 3))
RUNS = {"ag+rs": ("ag", "rs"), "optim+copy": ("optim", "copy")}
SURVIVORS = (0, 1)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(tmp: Path, name: str, launcher: list[str], n: int = WORLD, **env: str) -> tuple[int, str, dict[int, Any]]:
    return run_script(tmp, name, launcher, str(n), n, STEPS, 200, **env)



def _kills(phases: tuple[str, str]) -> str:
    return ",".join(f"{rank}:{step}:{phase}" for (rank, step), phase in zip(LOSSES, phases))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, dict[int, Any]]]:
    """The reference and the two kill runs, one at a time: four processes (more, beside
    another test file's, starve the lease-TTL tests there)."""
    tmp = tmp_path_factory.mktemp("fsdp_plain")
    jobs = {"leave": _kills(("leave", "leave")), **{name: _kills(phases) for name, phases in RUNS.items()}}
    return {name: _run(tmp, name, RUN, KILLS=kills) for name, kills in jobs.items()}


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


def test_reference_runs_the_later_steps_without_the_leavers(runs: dict[str, tuple[int, str, dict[int, Any]]]) -> None:
    rc, text, ref = runs["leave"]
    assert rc == 0, text[-3000:]
    assert "hosts the shards of the lost" in text
    for rank in SURVIVORS:
        assert ref[rank]["finished"] and len(ref[rank]["steps"]) == STEPS
        assert [s["world"] for s in ref[rank]["steps"]] == [4, 4, 3, 2, 2]
    assert ref[2]["finished"] is False and len(ref[2]["steps"]) == 2
    assert ref[3]["finished"] is False and len(ref[3]["steps"]) == 3


@pytest.mark.parametrize("name", RUNS)
def test_plain_fsdp_survives_two_sigkills(runs: dict[str, tuple[int, str, dict[int, Any]]], name: str) -> None:
    rc, text, logs = runs[name]
    ref = runs["leave"][2]
    assert rc == 0, text[-3000:]
    assert "killed by SIGKILL" in text and text.count(": not restarted") == 2, text[-3000:]
    hosting = set(re.findall(r"(g0-l\d+)-\S+ hosts the shards of the lost (g0-l\d+)-", text))
    assert hosting == {("g0-l3", "g0-l2"), ("g0-l0", "g0-l3"), ("g0-l0", "g0-l2")}, text[-3000:]
    assert 2 not in logs and 3 not in logs, "a killed rank wrote a final log"
    for rank in SURVIVORS:
        assert logs[rank]["finished"] and len(logs[rank]["steps"]) == STEPS, text[-3000:]
        assert shards(logs[rank]) == shards(ref[rank]), f"rank {rank} after kills in {RUNS[name]}"
    # the step a loss cut through is redone; a loss before the step's first reduction is not
    assert logs[0]["steps_redone"] == sum(0 if phase == "ag" else 1 for phase in RUNS[name])
