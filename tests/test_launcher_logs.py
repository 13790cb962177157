"""--log-dir / --redirects / --tee / --local-ranks-filter behave as torchrun's.

Both launchers run tests/scripts/print_streams.py with the same flags; the files under
--log-dir (paths relative to the run directory, whose name has a random suffix in both)
and the worker lines on the console must be identical.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from launcher_util import RESILIENT_RUN, ROOT, SCRIPTS
from resilient.coordinator.local_etcd import free_port
from resilient.launcher.logs import Std, parse_std

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(SCRIPTS, "print_streams.py")
_WORKER_TOKEN = re.compile(r"(\[[^\]\n]*\]:)?((?:out|err) \d \d)")


def _run(cmd: list[str], log_dir: str) -> tuple[dict[str, str], list[str], list[str]]:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", RESILIENT_LOG_LEVEL="ERROR")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    (run_dir,) = os.listdir(log_dir)
    assert run_dir.startswith("job1_")
    files = {}
    for dirpath, _, names in os.walk(os.path.join(log_dir, run_dir)):
        for n in names:
            path = os.path.join(dirpath, n)
            with open(path) as f:
                files[os.path.relpath(path, os.path.join(log_dir, run_dir))] = f.read()

    def lines(text: str) -> list[str]:
        # Worker lines with their prefix, if any. Two workers writing to one inherited
        # stream can interleave within a line ("err 1 0err 0 0", seen from torchrun under
        # load), so tokens are found anywhere, not per line.
        return sorted("".join(m) for m in _WORKER_TOKEN.findall(text))

    return files, lines(p.stdout), lines(p.stderr)


@pytest.mark.parametrize("flags", [
    ["--redirects", "3"],
    ["--tee", "3"],
    ["--redirects", "0:1,1:2", "--tee", "1:1"],
    ["--tee", "3", "--local-ranks-filter", "1"],
    ["--local-ranks-filter", "0"],
    ["--tee", "1", "--duplicate-stdout-filters", "out 1,,x,out 0 2"],
])
def test_log_files_and_console_match_torchrun(tmp_path, flags):
    common = ["--nproc-per-node", "2", "--rdzv-id", "job1", *flags]
    t_dir, o_dir = str(tmp_path / "torchrun"), str(tmp_path / "ours")
    with ThreadPoolExecutor(2) as ex:  # the two launchers side by side (independent runs)
        theirs = ex.submit(_run, [sys.executable, "-m", "torch.distributed.run", "--master-port",
                                  str(free_port()), "--log-dir", t_dir, *common, SCRIPT], t_dir)
        ours = ex.submit(_run, [RESILIENT_RUN, "--master-port", str(free_port()), "--log-dir", o_dir,
                                *common, SCRIPT], o_dir)
        (torch_files, t_out, t_err), (our_files, o_out, o_err) = theirs.result(), ours.result()
    assert our_files == torch_files
    assert (o_out, o_err) == (t_out, t_err)


def test_parse_std_accepts_torchrun_syntax_only():
    assert parse_std("3") is Std.ALL
    assert parse_std("0:1,1:2") == {0: Std.OUT, 1: Std.ERR}
    for bad in ("4", "a", "0:1,", "1=2"):
        with pytest.raises(ValueError, match="--redirects"):
            parse_std(bad)
