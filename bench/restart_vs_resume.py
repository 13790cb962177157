"""Time lost to one worker failure: torchrun's whole-job restart vs resilient's resume.

Runs the same script (examples/train.py, 4 workers, a small DDP model) four ways in this
one invocation and prints one JSON line:

* ``torchrun --standalone --max-restarts 1`` with gloo, fault-free, and with the worker of
  RANK 2 exiting at step ``--fail-step`` (user code checkpoints every step and resumes from
  the checkpoint, as torchrun users must);
* ``resilient-run --standalone --max-restarts 1`` on the resilient backend, fault-free and
  with the same failure (survivors resume; the worker restarts as a joiner and is synced).

``*_lost_s`` = wall time of the failing run minus the same launcher's fault-free wall time.
If torchrun does not recover (its restart round fails, e.g. gloo ``connectFullMesh``
refused — seen with torch 2.13), ``torchrun_recovered`` is false and ``torchrun_lost_s``
is measured for what its user then does: relaunch from the last checkpoint (failed run +
relaunch - fault-free). ``ratio`` = torchrun_lost_s / resilient_lost_s (null when
resilient lost no time); with ``--repeats N`` the values are medians, ``noise_s`` is the
largest fault-free spread, and when resilient_lost_s is within it ``ratio_lower_bound`` =
torchrun_lost_s / noise_s is reported instead of pretending to a precise ratio.
``resilient_joiner_rejoined`` says per run whether the restarted worker got back in
before the end (the survivors never wait for it). Every process a launcher started is
SIGKILLed by PID at the end if it is still alive (torchrun can leave hung workers).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "examples" / "train.py")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def run(cmd: list[str], timeout: float) -> tuple[float, int, str]:
    """Run a launcher; returns (wall seconds, exit code, output). Every process it spawned
    (seen while it ran: a launcher may leave hung workers behind when it gives up) is
    SIGKILLed by PID at the end if still alive (start time checked against PID reuse)."""
    seen: dict[int, str] = {}
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        rc = None
        while rc is None:
            kids, todo = _children(), [p.pid]
            while todo:
                for c in kids.get(todo.pop(), []):
                    if c not in seen:
                        st = _start_time(c)
                        if st is not None:
                            seen[c] = st
                    todo.append(c)
            try:
                rc = p.wait(0.2)
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 > timeout:
                    p.kill()
                    rc = 124
                    p.wait()
        wall = time.monotonic() - t0
        for pid, st in seen.items():
            if _start_time(pid) == st:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        out.seek(0)
        return wall, rc, out.read()


def last_step(out: str) -> int:
    best = -1
    for line in out.splitlines():
        i = line.find("{")
        if i < 0:
            continue
        try:
            rec = json.loads(line[i:])
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec and "event" not in rec:
            best = max(best, int(rec["step"]))
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fail-step", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds of simulated compute per step")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--repeats", type=int, default=1,
                    help="fault-free / failing runs of each launcher (medians; the fault-free spread is the noise)")
    args = ap.parse_args(argv)
    py = sys.executable
    common = [TRAIN, "--steps", str(args.steps), "--step-sleep", str(args.step_sleep)]
    fail = ["--exit-at-step", str(args.fail_step), "--exit-rank", "2"]
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1",
                "--nproc-per-node", str(args.nproc)]
    resil = [py, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())", "--standalone",
             "--max-restarts", "1", "--nproc-per-node", str(args.nproc)]
    res: dict = {"steps": args.steps, "fail_step": args.fail_step, "nproc": args.nproc}
    with tempfile.TemporaryDirectory(prefix="restart-vs-resume-") as tmp:
        ck = str(Path(tmp) / "ck.pt")
        def median(xs: list[float]) -> float:
            xs = sorted(xs)
            return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

        t_oks, t_fails, t_res, r_oks, r_fails, rejoined, recovered_all = [], [], [], [], [], [], []
        for i in range(args.repeats):
            t_ok, rc, out = run(torchrun + common + ["--backend", "gloo", "--checkpoint", f"{ck}.ok{i}"], args.timeout)
            assert rc == 0, f"fault-free torchrun run failed (rc {rc}):\n{out[-3000:]}"
            t_oks.append(t_ok)
            t_fail, rc, out = run(torchrun + common + ["--backend", "gloo", "--checkpoint", f"{ck}{i}"] + fail,
                                  args.timeout)
            t_fails.append(t_fail)
            recovered = rc == 0 and last_step(out) == args.steps - 1
            recovered_all.append(recovered)
            if not recovered:  # the user relaunches from the last checkpoint
                t_re, rc2, out2 = run(torchrun + common + ["--backend", "gloo", "--checkpoint", f"{ck}{i}"], args.timeout)
                assert rc2 == 0, f"torchrun relaunch from checkpoint failed (rc {rc2}):\n{out2[-3000:]}"
                t_res.append(t_re)
            else:
                t_res.append(0.0)
            r_ok, rc, out = run(resil + common, args.timeout)
            assert rc == 0, f"fault-free resilient-run failed (rc {rc}):\n{out[-3000:]}"
            r_oks.append(r_ok)
            r_fail, rc, out = run(resil + common + fail, args.timeout)
            assert rc == 0 and last_step(out) >= args.steps - 1, f"resilient-run with a failure did not finish:\n{out[-3000:]}"
            r_fails.append(r_fail)
            rejoined.append('"event": "synced"' in out)
        t_ok, r_ok = median(t_oks), median(r_oks)
        res.update(repeats=args.repeats, torchrun_fault_free_s=round(t_ok, 3),
                   torchrun_failed_run_s=round(median(t_fails), 3), torchrun_recovered=all(recovered_all),
                   torchrun_relaunch_s=round(median(t_res), 3),
                   torchrun_lost_s=round(median([f + r - t_ok for f, r in zip(t_fails, t_res)]), 3),
                   resilient_fault_free_s=round(r_ok, 3), resilient_failed_run_s=round(median(r_fails), 3),
                   resilient_lost_s=round(median([f - r_ok for f in r_fails]), 3),
                   resilient_joiner_rejoined=rejoined,
                   noise_s=round(max(max(t_oks) - min(t_oks), max(r_oks) - min(r_oks)), 3))
    lost = res["resilient_lost_s"]
    res["ratio"] = round(res["torchrun_lost_s"] / lost, 2) if lost > 0 else None
    if lost <= res["noise_s"] and res["noise_s"] > 0:  # below what this machine can resolve: a lower bound
        res["ratio_lower_bound"] = round(res["torchrun_lost_s"] / res["noise_s"], 2)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
