"""Acceptance: an unchanged pytorch/examples-style DDP script (examples/ddp_torchrun.py: no
resilient call but the import and the backend name) under ``resilient-run --standalone``
with default flags (real etcd, coordinator, processes, sockets), one worker SIGKILLed
mid-training.

Asserted: the job exits 0 and its summary names the dead worker; after every step, every
survivor's parameters equal a reference the test computes from the example's own data,
model and sampler and the step's contributor set (from ``RESILIENT_OP_LOG``): plain SGD on
the mean gradient over exactly the contributors (not sum / launch size, which the test
checks it would tell apart). With ``--max-restarts 1`` the restarted worker, which this
script cannot sync, is not admitted: it exits 0 saying why, the job exits 0 and the
survivors are still exact.

The parameters are read by a test probe that Python loads at start-up
(tests/scripts/step_probe/sitecustomize.py: torch's global optimizer step post-hook); the
script is not changed for the test."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from script_module import load_script  # noqa: E402
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_torchrun.py"
PROBE = ROOT / "tests" / "scripts" / "step_probe"
RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]
NPROC, DATASET, BATCH, EPOCHS, LR = 4, 256, 16, 4, 0.05
STEPS_PER_EPOCH = DATASET // NPROC // BATCH
STEPS = EPOCHS * STEPS_PER_EPOCH
KILL_RANK, KILL_AFTER = 2, 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _example():
    return load_script(EXAMPLE, "ddp_torchrun_example")


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by the kill
    return out


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what} (launcher rc {proc.poll()})")


def _batches(mod, dataset, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches of every step, as the example's DistributedSampler yields them."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    out = []
    sampler = DistributedSampler(dataset, num_replicas=NPROC, rank=rank)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        out.extend(DataLoader(dataset, batch_size=BATCH, shuffle=False, sampler=sampler))
    return out


def _reference(contributor_ranks: list[list[int]], divide_by: int | None = None) -> list[torch.Tensor]:
    """Parameters after each step: SGD on the mean gradient over the step's contributors
    (``divide_by``: divide the sum by this instead, DDP's default with a static size)."""
    mod = _example()
    dataset, model, _ = mod.load_train_objs(DATASET, LR)
    batches = {r: _batches(mod, dataset, r) for r in range(NPROC)}
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach().double()
    out = []
    for step, ranks in enumerate(contributor_ranks):
        total = torch.zeros_like(theta)
        for r in ranks:
            torch.nn.utils.vector_to_parameters(theta.float(), model.parameters())
            model.zero_grad()
            x, y = batches[r][step]
            torch.nn.functional.mse_loss(model(x), y).backward()
            total += torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        theta = theta - LR * total / (divide_by or len(ranks))
        out.append(theta.clone())
    return out


def _launch(tmp: Path, script: list[str], flags: list[str], env_extra: dict[str, str], kill_after: int,
            nproc: int = NPROC) -> tuple[int, str, list[dict]]:
    """Run ``resilient-run --standalone`` on ``script``; SIGKILL the worker of launch rank
    KILL_RANK once the op log shows it finished ``kill_after`` allreduces. Returns the exit
    code, the agent's output and the op log."""
    oplog = tmp / "ops.jsonl"
    env = dict(os.environ, PYTHONPATH=f"{PROBE}{os.pathsep}{ROOT}", RESILIENT_OP_LOG=str(oplog),
               OMP_NUM_THREADS="1", **env_extra)
    for var in ("PET_FAIL_FAST", "RESILIENT_FAIL_FAST", "PET_MAX_RESTARTS"):
        env.pop(var, None)
    log = open(tmp / "agent.log", "w")  # noqa: SIM115
    agent = subprocess.Popen(RUN + ["--standalone", "--nproc-per-node", str(nproc), "--lease-ttl", "3", *flags,
                                    *script], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        def victim():
            ops = [r for r in _read_jsonl(oplog) if r["rank"] == KILL_RANK and r["kind"] == "allreduce"]
            return ops[0]["pid"] if len(ops) >= kill_after else None

        os.kill(_wait(victim, 150, f"rank {KILL_RANK} to finish {kill_after} allreduces", agent), signal.SIGKILL)
        rc = agent.wait(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        log.close()
        for p in {r["pid"] for r in _read_jsonl(oplog)}:
            try:
                os.kill(p, signal.SIGKILL)  # only workers of this run (pids from its op log)
            except ProcessLookupError:
                pass
    return rc, (tmp / "agent.log").read_text(), _read_jsonl(oplog)


def _run(tmp: Path, *flags: str) -> tuple[int, str, list[dict], dict[int, list[dict]]]:
    probe = tmp / "probe"
    probe.mkdir()
    rc, out, ops = _launch(tmp, [str(EXAMPLE), str(EPOCHS), "1", "--dataset_size", str(DATASET), "--batch_size",
                                 str(BATCH), "--lr", str(LR)], list(flags),
                           {"STEP_PROBE_DIR": str(probe), "STEP_PROBE_SLEEP": "0.15"}, KILL_AFTER)
    steps = {int(f.stem): _read_jsonl(f) for f in probe.glob("*.jsonl")}
    return rc, out, ops, steps


def _check_survivors_exact(out: str, ops: list[dict], steps: dict[int, list[dict]]) -> None:
    rank_of = {r["member"]: r["rank"] for r in ops}
    survivors = {pid: recs for pid, recs in steps.items() if len(recs) == STEPS}
    assert {recs[0]["rank"] for recs in survivors.values()} == set(range(NPROC)) - {KILL_RANK}, (steps.keys(), out)
    per_step: list[list[int]] | None = None
    for pid in survivors:
        mine = [r for r in ops if r["pid"] == pid and r["kind"] == "allreduce"]
        assert len(mine) == STEPS and all("contributors" in r for r in mine), mine  # one bucket per step
        sets = [sorted(rank_of[m] for m in r["contributors"]) for r in mine]
        assert per_step is None or sets == per_step, "survivors disagree on a step's contributors"
        per_step = sets
    assert per_step[0] == list(range(NPROC)) and per_step[-1] == [0, 1, 3], per_step
    ref = _reference(per_step)
    for pid, recs in survivors.items():
        for step, rec in enumerate(recs):
            got = torch.tensor([v for p in rec["params"] for v in p], dtype=torch.float64)
            assert torch.allclose(got, ref[step], rtol=1e-5, atol=1e-6), \
                (f"rank {rec['rank']} step {step}: params differ from the contributor-mean reference by "
                 f"{(got - ref[step]).abs().max().item():.3g}")
    # the check can tell the contributor mean from DDP's static division (sum / launch size)
    static = _reference(per_step, divide_by=NPROC)
    assert (static[-1] - ref[-1]).abs().max().item() > 1e-4


def test_unchanged_ddp_script_sigkill_default_flags_exit_0_exact(tmp_path):
    rc, out, ops, steps = _run(tmp_path)
    assert rc == 0, out
    assert "job FINISHED (exit code 0)" in out and "killed by SIGKILL" in out and "shrank in : epoch" in out
    assert "the agent vouches for" in out, out   # the default: the node agent
    _check_survivors_exact(out, ops, steps)


def test_unchanged_ddp_script_max_restarts_1_joiner_not_admitted_exits_0(tmp_path):
    """With --no-node-lease (a lease per worker, the path before the node agent became the
    default; the other tests here run under the node agent)."""
    rc, out, ops, steps = _run(tmp_path, "--max-restarts", "1", "--no-node-lease")
    assert rc == 0, out
    assert "the agent vouches for" not in out, out   # no node lease, no channel
    assert "restarted as a joiner (restart 1 of 1)" in out, out
    assert "is not admitted to the running job" in out and "exits with code 0" in out, out
    # the restarted incarnation exited 0, named in the summary as a deliberate early leave
    assert "local rank 2 left before the end of its script: joiner not admitted" in out, out
    assert "by design (exit 0): local rank 2: joiner not admitted" in out, out
    # the joiner ran no collective: every logged op of a restarted incarnation is absent
    restarted = {pid for pid, recs in steps.items() if recs and recs[0]["restart"] == 1}
    assert not restarted and not any(r["member"].split("-a")[1].startswith("1-") for r in ops), ops[-3:]
    _check_survivors_exact(out, ops, steps)


def test_plain_allreduce_loop_joiner_never_gets_a_wrong_result(tmp_path):
    """The user's int64 all_reduce loop: a worker SIGKILLed (large ops, so mostly mid-op),
    restarted with --max-restarts 1. Every op on every process checks its result against
    the exact sum over the contributors it reports (the script exits 3 otherwise); the
    restarted worker runs no op at all (not admitted, exit 0); the job exits 0."""
    rc, out, ops = _launch(tmp_path, [str(ROOT / "tests" / "scripts" / "allreduce_loop.py")], ["--max-restarts", "1"],
                           {"OPS": "40", "OP_SLEEP": "0.03"}, kill_after=8)
    assert rc == 0, out
    assert "WRONG" not in out and out.count("ok 40 ops") == NPROC - 1, out
    assert "is not admitted to the running job" in out and "restarted as a joiner" in out, out
    assert "killed by SIGKILL" in out and "shrank in : epoch" in out, out
    sizes = {len(r["contributors"]) for r in ops if r["kind"] == "allreduce"}
    assert sizes == {NPROC, NPROC - 1}, sizes  # the group shrank during the run
