"""The README's 30-second example runs as printed, under the real launcher."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_under_resilient_run_standalone():
    readme = (ROOT / "README.md").read_text()
    assert "resilient-run --standalone --nproc-per-node 4 examples/quickstart.py" in readme
    launcher = Path(sys.executable).parent / "resilient-run"
    proc = subprocess.run(
        [str(launcher), "--standalone", "--nproc-per-node", "4", str(ROOT / "examples" / "quickstart.py")],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # four processes share one stdout: lines may interleave, so match anywhere
    lines = re.findall(r"rank (\d)/4: \[([^\]]*)\] from (\d) members \(epoch (\d+)\)", proc.stdout)
    assert sorted(int(r) for r, *_ in lines) == [0, 1, 2, 3], proc.stdout[-3000:] + proc.stderr[-3000:]
    for _, values, n, _ in lines:
        assert values == "6.0, 6.0, 6.0, 6.0" and n == "4"  # 0+1+2+3 from all four


def test_world_is_callable_from_the_package_root():
    import resilient

    assert callable(resilient.world)
    import resilient.live_world  # importing the module must not shadow the function

    assert callable(resilient.world)
