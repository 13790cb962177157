"""bench/gpu_check.py without a GPU: one JSON line per check with ``"gpu": false``, the GPU
checks reported as not run (``passed: null`` with the reason), the CPU staging check run
and passed, exit status 0. The script's ``main`` runs in-process (no second torch import)."""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from script_module import load_script  # noqa: E402
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def load_gpu_check() -> ModuleType:
    return load_script(SCRIPT, "gpu_check_under_test")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU exists here: run bench/gpu_check.py itself")
def test_gpu_check_without_a_gpu_prints_gpu_false_lines_and_exits_0(capsys):
    assert load_gpu_check().main(["--skip-compile"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_name = {r["check"]: r for r in lines}
    assert list(by_name) == ["kernels", "bandwidth", "interrupted", "staging", "host_staged_allreduce",
                             "host_staged_sigkill", "nccl_allreduce", "nccl_sigkill"]
    assert all(r["gpu"] is False for r in lines)
    assert by_name["staging"]["passed"] is True and by_name["staging"]["ops"] == "CpuOps"
    for name, r in by_name.items():
        if name != "staging":
            assert r["passed"] is None and r["skipped"], r


def test_gpu_check_refuses_unknown_check_names():
    with pytest.raises(SystemExit, match=r"unknown check\(s\) \['warp'\]"):
        load_gpu_check().main(["--only", "warp"])
