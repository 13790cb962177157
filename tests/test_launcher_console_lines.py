"""Workers under resilient-run share the agent's console; every line a worker that imports
resilient prints arrives whole, never split by a sibling's line (resilient/console_lines.py).

Under ``python -u`` (how resilient-run and torchrun start workers) ``print`` is two writes,
the text and the newline; four workers printing at once interleaved hundreds of lines of
12,000 here before the fix."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]
SCRIPT = textwrap.dedent("""\
    import os, sys
    import resilient  # noqa: F401
    r = os.environ["LOCAL_RANK"]
    for i in range(3000):
        print(f"w{r} line {i} " + "x" * 40)
    print(f"w{r} err {r}", file=sys.stderr)
    """)
LINE = re.compile(r"^w[0-3] line \d+ x{40}$")

pytestmark = pytest.mark.timeout(120)


def test_concurrent_workers_lines_arrive_whole(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    out = subprocess.run([*RUN, "--nproc-per-node", "4", "--no-node-lease", str(script)],
                         env=dict(os.environ), capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    broken = [ln for ln in lines if not LINE.match(ln)]
    assert not broken, f"{len(broken)} of {len(lines)} lines split or joined, e.g. {broken[:3]}"
    for r in range(4):   # every worker's every line, once
        got = sorted(int(ln.split()[2]) for ln in lines if ln.startswith(f"w{r} "))
        assert got == list(range(3000)), f"worker {r}: {len(got)} lines"
        assert f"w{r} err {r}\n" in out.stderr


def test_streams_are_left_alone_outside_resilient_run() -> None:
    code = "import sys, resilient; print(sys.stdout.write_through, sys.stdout.line_buffering)"
    env = {k: v for k, v in os.environ.items() if k != "RESILIENT_EXIT_MARKER"}
    out = subprocess.run([sys.executable, "-u", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr
