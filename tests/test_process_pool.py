"""resilient.process_pool with real child processes: exit codes, waits, signals only to its
own children, stop (SIGTERM, then SIGKILL of the process group), and clean-up on errors."""
from __future__ import annotations

import os
import signal
import sys

import pytest
from cp_helpers import wait_until

from resilient.errors import ResilientTimeout
from resilient.process_pool import PIPE, ProcessPool, Spec, describe_exit, pid_state, signal_name

PY = sys.executable
SLEEPER = [PY, "-c", "import time; time.sleep(60)"]
# ignores SIGTERM, starts a grandchild (same process group) that ignores it too, then
# prints the grandchild's pid: both are ready to be signalled once that line is read
STUBBORN = [PY, "-c", (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(g.pid, flush=True)\n"
    "time.sleep(60)\n")]


def _gone(pid: int) -> bool:
    """No live process with this pid (a zombie awaiting its reaper counts as gone)."""
    return pid_state(pid) in (None, "Z", "X")


def test_wait_returns_each_childs_exit_code_with_its_own_argv_env_cwd_and_output_file(tmp_path):
    code = "import os, sys; print(os.environ['X'], os.getcwd()); sys.exit(int(os.environ['X']))"
    with ProcessPool() as pool:
        for i in range(3):
            (tmp_path / f"d{i}").mkdir()
            pool.start(Spec([PY, "-c", code], env={**os.environ, "X": str(i)}, cwd=tmp_path / f"d{i}",
                            stdout=tmp_path / f"{i}.out", name=f"w{i}"))
        assert pool.wait(timeout=60) == [0, 1, 2]
    for i in range(3):
        assert (tmp_path / f"{i}.out").read_text().split() == [str(i), str(tmp_path / f"d{i}")]


def test_wait_past_its_timeout_raises_resilient_timeout_naming_the_child_which_keeps_running():
    with ProcessPool() as pool:
        child = pool.start(Spec(SLEEPER, name="sleepy"))
        with pytest.raises(ResilientTimeout, match=rf"sleepy \(pid {child.pid}\)"):
            pool.wait(timeout=0.05)
        assert child.alive()
        assert pool.stop(grace=30) == [-signal.SIGTERM]


def test_wait_any_reports_every_exit_once_and_none_at_its_timeout():
    with ProcessPool() as pool:
        quick = pool.start(Spec([PY, "-c", "import sys; sys.exit(4)"]))
        slow = pool.start(Spec(SLEEPER))
        first = pool.wait_any(timeout=60)
        assert first is quick and first.returncode == 4   # exited before this wait began: not lost
        assert pool.wait_any(timeout=0.05) is None
        assert pool.signal(slow, signal.SIGKILL) is True
        assert pool.wait_any(timeout=60) is slow and slow.returncode == -signal.SIGKILL
        assert pool.wait_any(timeout=0) is None                 # each exit is reported once


def test_stop_kills_a_child_that_ignores_sigterm_and_its_process_group_after_the_grace():
    with ProcessPool() as pool:
        polite = pool.start(Spec(SLEEPER))
        stubborn = pool.start(Spec(STUBBORN, stdout=PIPE))
        assert stubborn.stdout is not None
        grandchild = int(stubborn.stdout.readline())
        assert pool.stop(grace=0.5) == [-signal.SIGTERM, -signal.SIGKILL]
        assert polite.returncode == -signal.SIGTERM and not pool.running()
        wait_until(lambda: _gone(grandchild), 30, "the grandchild in the killed process group to die")


def test_stop_wakes_a_stopped_child_so_it_handles_sigterm():
    with ProcessPool() as pool:
        child = pool.start(Spec([PY, "-c", "import sys, time; print('up', flush=True); time.sleep(60)"], stdout=PIPE))
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        pool.signal(child, signal.SIGSTOP)
        assert pool.stop(grace=30) == [-signal.SIGTERM]


def test_signal_goes_only_to_children_of_this_pool_and_not_to_exited_ones():
    with ProcessPool() as pool, ProcessPool() as other:
        theirs = other.start(Spec([PY, "-c", "pass"]))
        with pytest.raises(ValueError, match="not started by this pool"):
            pool.signal(theirs, signal.SIGTERM)
        with pytest.raises(ValueError, match="not started by this pool"):
            pool.by_pid(os.getpid())
        with pytest.raises(ValueError, match="no child with index 0"):
            pool.signal(0, signal.SIGTERM)
        other.wait(timeout=60)
        assert other.signal(0, signal.SIGTERM) is False


def test_leaving_the_block_by_an_exception_stops_every_child():
    with pytest.raises(KeyError):
        with ProcessPool() as pool:
            kids = pool.start_all([Spec(SLEEPER), Spec(SLEEPER, new_session=False)])
            raise KeyError("boom")
    assert [k.returncode for k in kids] == [-signal.SIGTERM, -signal.SIGTERM]


def test_a_child_that_cannot_start_raises_oserror_and_start_all_stops_those_already_started(tmp_path):
    with ProcessPool() as pool:
        with pytest.raises(OSError):
            pool.start_all([Spec(SLEEPER), Spec([str(tmp_path / "no-such-binary")])])
        assert [c.returncode for c in pool.children] == [-signal.SIGTERM]


def test_exit_descriptions():
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert signal_name(15) == "SIGTERM" and signal_name(99) == "signal 99"
