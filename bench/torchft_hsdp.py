"""torchft's HSDP on the same model and fault as ``bench/fsdp.py``: the competitor's side.

:func:`venv` uses this venv when it has torchft, or makes (once) a separate venv with ``torchft-nightly`` from the package index;
it shares this venv's torch through a ``.pth`` file, so the pinned CPU torch is used and no
CUDA build is downloaded. When the install fails (no index, no wheel for this Python), it
returns the reason and the bench prints the case as skipped with it.

:func:`run` starts torchft's lighthouse and ``groups x size`` workers
(``bench/torchft_hsdp_worker.py``, one gloo job per replica group, the replicate all-reduce
through the torchft Manager), kills one worker of group 1 mid-backward at ``kill_step``,
and returns group 0 rank 0's per-step log once group 0 finished. torchft is "tuned": the
lighthouse forms a quorum without a missing group after ``join_timeout_ms`` and drops a
group whose heartbeats stop for ``heartbeat_timeout_ms``; the manager's timeouts are
``ft_timeout_s``. The workers of group 1 that were not killed fail (torchelastic would
restart them; group 0 does not wait for that) and are ended here by PID.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "torchft_hsdp_worker.py"
PACKAGES = ["torchft-nightly", "opentelemetry-exporter-otlp-proto-http>=1.39.0", "opentelemetry-sdk>=1.39.0"]


def venv(path: Path) -> Path | str:
    """This interpreter when it imports torchft (``pip install -e '.[bench]'``, as
    ``bench/vs_torchft.py`` uses), else the python of a venv at ``path`` that does (made when
    missing); or why neither."""
    here = [sys.executable, "-c", "import torchft.manager"]
    if subprocess.run(here, capture_output=True).returncode == 0:
        return Path(sys.executable)
    path = path.resolve()
    py = path / "bin" / "python"
    probe = [str(py), "-c", "import torchft.manager, torch; print(torch.__version__)"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [[base, "-m", "venv", str(path)],
             [str(py), "-m", "pip", "install", "-q", "--no-deps", PACKAGES[0]],
             [str(py), "-m", "pip", "install", "-q", *PACKAGES[1:]]]
    for i, cmd in enumerate(steps):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return f"torchft-nightly could not be installed in {path} ({' '.join(cmd[2:5])}: " \
                   f"{(done.stderr or done.stdout).strip().splitlines()[-1:]})"
        if i == 0:  # this venv's torch (the pinned CPU build), not a download
            site = Path(subprocess.check_output([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                                text=True).strip())
            (site / "resilient_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    check = subprocess.run(probe, capture_output=True, text=True)
    if check.returncode != 0:
        return f"torchft does not import in {path}: {check.stderr.strip().splitlines()[-1:]}"
    return py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(py: Path, out: Path, *, groups: int, size: int, steps: int, kill_step: int, kill_rank: int, dim: int,
        layers: int, ft_timeout_s: float, join_timeout_ms: int, heartbeat_timeout_ms: int,
        timeout: float) -> dict[str, Any]:
    """One torchft HSDP job; returns ``{"steps": [...], "exit_codes": {...}}`` of group 0 rank 0
    (``steps`` empty when it did not finish, with ``error`` saying why)."""
    out.mkdir(parents=True)
    lighthouse = subprocess.Popen(
        [str(py), "-c", "import sys; from torchft._torchft import LighthouseServer as L; "
         f"s = L(bind='[::]:0', min_replicas=1, join_timeout_ms={join_timeout_ms}, quorum_tick_ms=10, "
         f"heartbeat_timeout_ms={heartbeat_timeout_ms}); print(s.address(), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        assert lighthouse.stdout is not None
        address = lighthouse.stdout.readline().strip()
        if not address:
            return {"steps": [], "error": "torchft's lighthouse did not start"}
        ports = [_free_port() for _ in range(groups)]
        for world in range(groups * size):
            g, r = divmod(world, size)
            env = {**os.environ, "GROUP": str(g), "RANK": str(r), "WORLD_SIZE": str(size), "LOCAL_RANK": str(r),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[g]), "TORCHFT_LIGHTHOUSE": address,
                   "STEPS": str(steps), "DIM": str(dim), "LAYERS": str(layers), "OUT": str(out),
                   "KILL": "1" if world == kill_rank else "0", "KILL_STEP": str(kill_step),
                   "FT_TIMEOUT_S": str(ft_timeout_s), "WORKERS": str(groups * size), "OMP_NUM_THREADS": "1"}
            procs[world] = subprocess.Popen([str(py), str(WORKER)], env=env, cwd=out,
                                            stdout=subprocess.DEVNULL, stderr=open(out / f"{world}.err", "w"))
        deadline = time.monotonic() + timeout
        for world in range(size):  # group 0
            procs[world].wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = {w: p.poll() for w, p in procs.items()}
        log = out / "0-0.json"
        if not log.exists():
            err = (out / "0.err").read_text()[-2000:]
            return {"steps": [], "exit_codes": codes, "error": f"group 0 rank 0 did not finish: {err}"}
        return {"steps": json.loads(log.read_text())["steps"], "exit_codes": codes}
    except subprocess.TimeoutExpired:
        return {"steps": [], "error": f"group 0 did not finish within {timeout} s"}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        if lighthouse.poll() is None:
            lighthouse.kill()
        lighthouse.wait()
