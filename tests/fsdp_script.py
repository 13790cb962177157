"""Runs tests/scripts/hsdp_train.py — the unchanged FSDP2 script of the FSDP tests — under a
launcher and reads what each rank wrote (tests/test_fsdp_hsdp_procs.py,
tests/test_fsdp_plain_procs.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hsdp_train.py"
RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def run_script(tmp: Path, name: str, launcher: list[str], mesh: str, nproc: int, steps: int, timeout: float,
               **env: str) -> tuple[int, str, dict[int, Any]]:
    """One job (``--standalone``, ``nproc`` workers, output in ``tmp/name``): its exit code,
    its console and each rank's log; the launcher is killed if it outlives ``timeout``."""
    out = tmp / name
    out.mkdir()
    full = {**os.environ, "MESH": mesh, "STEPS": str(steps), "OUT": str(out), **env}
    proc = subprocess.Popen([*launcher, "--standalone", "--nproc-per-node", str(nproc), str(SCRIPT)], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    return proc.returncode, text, logs


def shards(log: dict[str, Any]) -> list[list[str]]:
    """Per step, the sha256 of each of the rank's local shards."""
    return [s["shards"] for s in log["steps"]]
