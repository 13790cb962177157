"""The worker environment under resilient-run equals torchrun's for the same flags.

Both launchers run tests/scripts/dump_env.py (real processes) in the same clean base
environment; each worker writes its environment as JSON. Compared key by key, except:

* ``RESILIENT_*``: ours, present only under resilient-run (checked separately).
* ``TORCHELASTIC_ERROR_FILE``: contains random temp-dir names (``torchelastic_<random>/
  <run id>_<random>``); compared after replacing those random parts, so the layout
  (``attempt_<n>/<local rank>/error.json``) must still match.
* with ``--standalone`` only: ``TORCHELASTIC_RUN_ID`` (a fresh uuid4 per run in both) and
  ``MASTER_PORT`` (a free port picked per run in both); checked to be a uuid / a port.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest

from resilient.coordinator.local_etcd import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DUMP = os.path.join(ROOT, "tests", "scripts", "dump_env.py")
VENV_BIN = os.path.dirname(sys.executable)
pytestmark = pytest.mark.slow


def _base_env(dump_dir: str) -> dict[str, str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "DUMP_DIR": dump_dir,
        "PYTHONPATH": ROOT,
        "TMPDIR": os.path.dirname(dump_dir),
    }
    return env


def _run(cmd: list[str], dump_dir: str, nproc: int) -> dict[int, dict[str, str]]:
    """Run ``cmd``; collect and remove the workers' dumps (both launchers use one DUMP_DIR)."""
    os.makedirs(dump_dir, exist_ok=True)
    proc = subprocess.run(cmd, env=_base_env(dump_dir), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd[:3]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    out = {}
    for lr in range(nproc):
        path = os.path.join(dump_dir, f"{lr}.0.json")
        with open(path) as f:
            out[lr] = json.load(f)
        os.unlink(path)
    return out


def _normalize_error_file(path: str, run_id: str) -> str:
    return re.sub(rf"/torchelastic_[^/]+/{re.escape(run_id)}_[^/]+/", "/torchelastic_X/RUNID_X/", path)


def _compare(torch_env: dict, ours: dict, variable: set[str]) -> None:
    ours_plain = {k: v for k, v in ours.items() if not k.startswith("RESILIENT_")}
    assert set(ours_plain) == set(torch_env), (
        f"only under torchrun: {sorted(set(torch_env) - set(ours_plain))}; "
        f"only under resilient-run: {sorted(set(ours_plain) - set(torch_env))}"
    )
    for key in sorted(torch_env):
        if key in variable:
            continue
        if key == "TORCHELASTIC_ERROR_FILE":
            a = _normalize_error_file(torch_env[key], torch_env["TORCHELASTIC_RUN_ID"])
            b = _normalize_error_file(ours[key], ours["TORCHELASTIC_RUN_ID"])
            assert a == b, (a, b)
            assert a.endswith(f"/attempt_0/{torch_env['LOCAL_RANK']}/error.json")
            continue
        assert ours[key] == torch_env[key], f"{key}: torchrun {torch_env[key]!r} != resilient-run {ours[key]!r}"


def test_static_rendezvous_env_equals_torchrun(tmp_path):
    port = free_port()
    flags = ["--nproc-per-node", "2", "--master-port", str(port), "--max-restarts", "3", "--role", "trainer"]
    torch_env = _run([sys.executable, "-m", "torch.distributed.run", *flags, DUMP], str(tmp_path / "dump"), 2)
    ours = _run([os.path.join(VENV_BIN, "resilient-run"), *flags, DUMP], str(tmp_path / "dump"), 2)
    for lr in range(2):
        _compare(torch_env[lr], ours[lr], variable=set())
        assert ours[lr]["RESILIENT_JOINER"] == "0"
        assert "RESILIENT_LEASE_ID" not in ours[lr]  # no etcd with static rendezvous and no --etcd


def test_standalone_env_equals_torchrun(tmp_path):
    flags = ["--standalone", "--nproc_per_node=2", "--max_restarts=1"]
    torch_env = _run([sys.executable, "-m", "torch.distributed.run", *flags, DUMP], str(tmp_path / "dump"), 2)
    ours = _run([os.path.join(VENV_BIN, "resilient-run"), *flags, DUMP], str(tmp_path / "dump"), 2)
    for lr in range(2):
        _compare(torch_env[lr], ours[lr], variable={"TORCHELASTIC_RUN_ID", "MASTER_PORT"})
        for env in (torch_env[lr], ours[lr]):
            uuid.UUID(env["TORCHELASTIC_RUN_ID"])
            assert 0 < int(env["MASTER_PORT"]) < 65536
        # ours on top: control plane ids for the library
        assert ours[lr]["RESILIENT_JOB"] == ours[lr]["TORCHELASTIC_RUN_ID"]
        host, _, p = ours[lr]["RESILIENT_ETCD"].rpartition(":")
        assert host == "127.0.0.1" and p.isdigit()
        assert int(ours[lr]["RESILIENT_LEASE_ID"]) > 0
        assert ours[lr]["RESILIENT_MEMBER_ID"]
        assert float(ours[lr]["RESILIENT_LEASE_TTL"]) == 5.0
    assert ours[0]["RESILIENT_LEASE_ID"] != ours[1]["RESILIENT_LEASE_ID"]
    assert ours[0]["RESILIENT_MEMBER_ID"] != ours[1]["RESILIENT_MEMBER_ID"]


def test_pet_environment_defaults(tmp_path):
    """PET_NPROC_PER_NODE / PET_MAX_RESTARTS configure resilient-run as they do torchrun."""
    dump_dir = str(tmp_path / "pet")
    os.makedirs(dump_dir)
    env = _base_env(dump_dir) | {"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "2",
                                 "PET_MASTER_PORT": str(free_port())}
    proc = subprocess.run([os.path.join(VENV_BIN, "resilient-run"), DUMP], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(os.listdir(dump_dir))
    assert files == ["0.0.json", "1.0.json", "2.0.json"]
    with open(os.path.join(dump_dir, "2.0.json")) as f:
        e = json.load(f)
    assert (e["WORLD_SIZE"], e["TORCHELASTIC_MAX_RESTARTS"], e["MASTER_PORT"]) == ("3", "2", env["PET_MASTER_PORT"])


def test_standalone_under_a_tmpdir_too_deep_for_a_unix_socket(tmp_path):
    """A TMPDIR whose ``resilient-agent-XXXXXXXX/agent.sock`` would pass the 107-byte unix
    socket limit (a deep pytest ``tmp_path``: the failure that once stopped CI) runs: the
    node agent's channel goes under /tmp, private, and is removed when the job ends."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    dump_dir = str(deep / "dump")
    os.makedirs(dump_dir)
    assert len(os.fsencode(os.path.join(str(deep), "resilient-agent-xxxxxxxx", "agent.sock"))) > 107
    ours = _run([os.path.join(VENV_BIN, "resilient-run"), "--standalone", "--nproc_per_node=2", DUMP], dump_dir, 2)
    socks = {ours[lr]["RESILIENT_AGENT_SOCKET"] for lr in range(2)}
    assert len(socks) == 1, socks
    sock = socks.pop()
    assert sock.startswith("/tmp/resilient-agent-") and sock.endswith("/agent.sock"), sock
    assert not os.path.exists(os.path.dirname(sock)), f"{sock}: the run directory outlived the job"
