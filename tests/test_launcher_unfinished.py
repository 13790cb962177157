"""A worker that exits with code 0 without finishing its script (``os._exit(0)`` after
``import resilient``) fails the job, and the summary names its local rank; a script that
finishes, and one that never imports resilient, do not; one that leaves early by design
(``resilient.script_exit.deliberate``) keeps exit 0 and is named with its reason."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]
SCRIPT = textwrap.dedent("""\
    import os, sys
    if os.environ.get("IMPORT", "1") == "1":
        import resilient  # noqa: F401
    if os.environ["LOCAL_RANK"] == "1" and os.environ.get("EARLY") == "1":
        os._exit(0)   # ends the process with code 0 before the script's end
    if os.environ["LOCAL_RANK"] == "1" and os.environ.get("EARLY") == "deliberate":
        from resilient.script_exit import deliberate
        deliberate("stepped aside for the test")   # as resilient.fsdp.pause does
        os._exit(0)
    print(f"rank {os.environ['LOCAL_RANK']} done", flush=True)
    """)

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    import os

    return subprocess.run([*RUN, "--nproc-per-node", "2", "--no-node-lease", str(script)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=90, cwd=tmp_path)


def test_os_exit_zero_midway_fails_the_job_naming_the_rank(tmp_path: Path) -> None:
    out = _run(tmp_path, EARLY="1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rank 0 done" in out.stdout and "rank 1 done" not in out.stdout
    assert "local rank 1 (pid" in out.stderr and "did not finish its script" in out.stderr
    assert "exited with code 0 before their script finished (os._exit?): local ranks [1]" in out.stderr


def test_finished_scripts_and_scripts_without_resilient_pass(tmp_path: Path) -> None:
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "did not finish" not in out.stderr
    out = _run(tmp_path, EARLY="1", IMPORT="0")   # not judged: it never imported resilient
    assert out.returncode == 0, out.stderr


def test_deliberate_early_exit_keeps_exit_zero_and_is_named_with_its_reason(tmp_path: Path) -> None:
    out = _run(tmp_path, EARLY="deliberate")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 done" in out.stdout and "rank 1 done" not in out.stdout
    assert "finished (exit 0): local ranks [0]" in out.stderr, out.stderr
    assert ("left before the end of its script, by design (exit 0): local rank 1: stepped aside for the test"
            in out.stderr), out.stderr
