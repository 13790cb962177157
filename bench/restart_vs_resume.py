"""Time lost to one worker failure: torchrun's whole-job restart vs resilient's resume.

Runs the same script (examples/train.py, 4 workers, a small DDP model) four ways per
repeat and prints one JSON line:

* ``torchrun --standalone --max-restarts 1`` with gloo, fault-free, and with the worker of
  RANK 2 exiting at step ``--fail-step`` (user code checkpoints every step and resumes from
  the checkpoint, as torchrun users must);
* ``resilient-run --standalone --max-restarts 1`` on the resilient backend, fault-free and
  with the same failure (survivors resume; the worker restarts as a joiner and is synced).

Time lost = wall time of the failing run minus that run's fault-free wall time (issue 4).
Three estimates are reported, the first two from the failing run's own step log:

* ``*_lost_s`` (the headline, used by ``ratio``): from the failing run's **own** step log
  (``--log-dir``; every worker logs each step's end time). The run's fault-free wall time
  is estimated as head + (steps - 1) x median step interval + tail, head/tail being this
  run's launch -> end of step 0 and end of the last step -> launcher exit, so
  ``lost = (end of last step - end of step 0) - (steps - 1) x median step interval``
  (the extra time of the steps around the failure) ``+ tail_wait`` (how long after the
  last member that trained to the end the job still waited for a worker, e.g. a joiner
  that came back after training ended; from the workers' ``done`` log events). This
  cancels the run-to-run noise of whole wall times on a loaded machine. For torchrun
  without recovery the "run" is the failed launch followed by the relaunch from the
  checkpoint, so the failed launch's teardown and the relaunch's start-up are inside the
  step span (the relaunch starts the moment the failed launch exits: no human delay).
* ``*_lost_window_s``: only the step intervals a disturbance can lengthen — ``WINDOW``
  (3) intervals from the failure step and from every step where a worker logged a world
  change or a sync (resilient: the joiner's registration epoch and its admission/state
  transfer; torchrun: none, the failure step's interval already spans teardown, relaunch
  and checkpoint load) — each minus the median interval, plus ``tail_wait``. Its floor is
  the same sum over the same steps of the paired fault-free run (``*_window_floor_s``,
  largest magnitude ``*_window_resolution_s``); ``ratio_window`` and
  ``ratio_window_lower_bound`` as below. It leaves out diffuse costs (e.g. the joiner's
  start-up competing for CPU), which ``*_lost_s`` includes.
* ``*_lost_wall_s``: median failing wall time minus median fault-free wall time of
  separate runs (the issue's first definition; noisy: ``noise_s`` is the largest spread
  of fault-free wall times).

The estimator's own floor is measured by applying it to the fault-free runs
(``*_lost_fault_free_s``, ideally 0 but positive under load: step times are skewed, so
their sum exceeds steps x median; its largest magnitude is ``*_resolution_s``);
``*_lost_net_s`` = ``*_lost_s`` minus the median floor.
``ratio`` = torchrun_lost_s / resilient_lost_s, or null when resilient_lost_s is not above
resilient_resolution_s; ``ratio_lower_bound`` = (torchrun_lost_s - torchrun_resolution_s)
/ (resilient_lost_s + resilient_resolution_s) is always printed: what is claimable.
If torchrun does not recover (its restart round fails, e.g. gloo ``connectFullMesh``
refused — seen with torch 2.13), ``torchrun_recovered`` is false and its lost time is
for what its user then does: relaunch from the last checkpoint.

Also printed: the fault-free per-step times (``*_step_s``) and [head, tail] seconds
(``*_head_tail_s``: launch -> end of step 0, end of the last step -> exit), ``resilient_failure_step_extra_s``
(extra time of the step during which the worker died: detection + new epoch + recovery
of the in-flight allreduce), ``resilient_exit_to_step_end_s`` (worker exit -> survivors
finished that step), ``resilient_join_step_extra_s`` (extra time of the step at which
the joiner was admitted and synced), ``resilient_joiner_back_s`` (worker exit -> joiner
synced), ``resilient_joiner_startup_excess_s`` (per run [excess seconds, steps] of the
survivors' steps during the joiner's start-up outside the windows: a bound on diffuse
costs, noise included), ``resilient_joiner_rejoined`` per run, and ``os.getloadavg()`` at start and end.
With ``--repeats N`` values are medians (``*_runs_s``: each run). A failing torchrun launch
still running after ``--hang-timeout`` is killed and listed as ``hung`` in
``torchrun_failed_runs``; such runs leave torchrun's medians when another run did not hang
(conservative: their lost time is the watchdog's choice). Every process a launcher started is SIGKILLed by
PID at the end if it is still alive (torchrun can leave hung workers).

Failure behaviour: a fault-free run, a torchrun relaunch or a resilient failing run that
does not finish raises ``RuntimeError`` with the output's tail (no JSON is printed).
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
from dataclasses import dataclass, field
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


@dataclass
class Launch:
    """One launcher invocation: wall-clock start/end (``time.time()``, comparable with the
    workers' log timestamps), exit code, output, and the workers' log records."""

    t_start: float
    t_end: float
    rc: int
    out: str
    recs: list[dict] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return self.t_end - self.t_start


def read_logs(log_dir: Path) -> list[dict]:
    """Every JSON record of every ``<pid>.jsonl`` in ``log_dir`` (a line cut short skipped)."""
    recs = []
    for f in sorted(log_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                recs.append(rec)
    return recs


def run(cmd: list[str], timeout: float, log_dir: Path | None = None) -> Launch:
    """Run a launcher (``--log-dir log_dir`` appended when given). Every process it spawned
    (seen while it ran: a launcher may leave hung workers behind when it gives up) is
    SIGKILLed by PID at the end if still alive (start time checked against PID reuse)."""
    if log_dir is not None:
        log_dir.mkdir(parents=True)
        cmd = cmd + ["--log-dir", str(log_dir)]
    seen: dict[int, str] = {}
    with tempfile.TemporaryFile("w+") as out:
        t_start, t0 = time.time(), time.monotonic()
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
        t_end = t_start + (time.monotonic() - t0)
        for pid, st in seen.items():
            if _start_time(pid) == st:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        out.seek(0)
        text = out.read()
        if log_dir is not None:
            log_dir.with_suffix(".out").write_text(text)
        return Launch(t_start, t_end, rc, text, read_logs(log_dir) if log_dir is not None else [])


def keep_runs(src: Path, dst: Path) -> None:
    """Copy every run's worker logs (``<run>/<pid>.jsonl``) and output (``<run>.out``) to ``dst``."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for d in src.iterdir():
        if d.is_dir():
            shutil.copytree(d, dst / d.name, dirs_exist_ok=True)
        elif d.suffix == ".out":
            shutil.copy(d, dst / d.name)


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


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def step_ends(recs: list[dict]) -> dict[int, float]:
    """Step -> when the last member that logged it finished it."""
    ends: dict[int, float] = {}
    for r in recs:
        if "event" not in r and "step" in r:
            ends[int(r["step"])] = max(ends.get(int(r["step"]), 0.0), float(r["t"]))
    return ends


def in_run_estimate(launches: list[Launch], steps: int) -> dict:
    """Lost time of one run (one launch, or a failed launch + its relaunch) from its own
    step log, see the module docstring. Raises RuntimeError when a step end is missing."""
    per = [step_ends(la.recs) for la in launches]
    intervals = [e[s] - e[s - 1] for e in per for s in sorted(e) if s - 1 in e]
    if 0 not in per[0] or steps - 1 not in per[-1] or not intervals:
        raise RuntimeError(f"step log incomplete: steps {[sorted(e) for e in per]} (need 0 and {steps - 1})")
    m = median(intervals)
    first, last = per[0][0], per[-1][steps - 1]
    # did the job wait, after the members that trained to the end were done, for another worker?
    final = launches[-1].recs
    trained = {r["pid"] for r in final if "event" not in r and r.get("step") == steps - 1}
    done = {r["pid"]: r["t"] for r in final if r.get("event") == "done"}
    done_trained = [t for pid, t in done.items() if pid in trained]
    tail_wait = max(0.0, max(done.values()) - max(done_trained)) if done_trained else 0.0
    ends: dict[int, float] = {}
    for e in per:  # a step logged again by a later launch (re-run after a restore) counts there
        ends.update(e)
    return {"lost_s": (last - first) - (steps - 1) * m + tail_wait, "step_s": m, "tail_wait_s": tail_wait,
            "head_s": first - launches[0].t_start, "tail_s": launches[-1].t_end - last, "ends": ends}


WINDOW = 3  # step intervals from each disturbance on (the step it hit and the next two)


def window_steps(launches: list[Launch], fail_step: int, steps: int) -> set[int]:
    """The steps whose interval a disturbance can lengthen: ``WINDOW`` steps from the failure
    step on, and from every step where a worker logged a world change or a sync (the joiner's
    registration epoch, its admission and state transfer)."""
    starts = {fail_step} | {int(r["step"]) for la in launches for r in la.recs
                            if r.get("event") in ("world_changed", "synced") and "step" in r}
    return {s + j for s in starts for j in range(WINDOW) if 1 <= s + j < steps}


def window_lost(est: dict, window: set[int]) -> float:
    """Extra time of the step intervals in ``window`` (each over the run's median step
    interval) plus the run's tail wait: the disturbances' cost, without the noise of the
    other steps. A missing step end contributes nothing."""
    e, m = est["ends"], est["step_s"]
    return sum(e[s] - e[s - 1] - m for s in window if s in e and s - 1 in e) + est["tail_wait_s"]


def resilient_breakdown(la: Launch, fail_step: int, m: float, window: set[int]) -> dict:
    """Where a failing resilient run's time went (see the module docstring); None where
    the event did not happen (e.g. the joiner came back after training ended)."""
    ends = step_ends(la.recs)
    exit_t = next((r["t"] for r in la.recs if r.get("event") == "exit"), None)
    synced = [r for r in la.recs if r.get("event") == "synced" and r.get("restart", 0) >= 1]
    out: dict = {"failure_step_extra_s": None, "exit_to_step_end_s": None, "join_step_extra_s": None,
                 "joiner_back_s": None, "rejoined": bool(synced), "startup_excess_s": None, "startup_steps": None}
    if fail_step in ends and fail_step - 1 in ends:
        out["failure_step_extra_s"] = ends[fail_step] - ends[fail_step - 1] - m
        if exit_t is not None:
            out["exit_to_step_end_s"] = ends[fail_step] - exit_t
    if synced:
        js = int(synced[0]["step"])
        if js in ends and js - 1 in ends:
            out["join_step_extra_s"] = ends[js] - ends[js - 1] - m
        if exit_t is not None:
            out["joiner_back_s"] = float(synced[0]["t"]) - exit_t
            # steps the survivors ran while the joiner started up, outside the windows:
            # what its start-up cost them diffusely (CPU), mixed with the load's noise
            during = [s for s in ends if s - 1 in ends and s not in window and exit_t < ends[s] <= synced[0]["t"]]
            out["startup_excess_s"] = sum(ends[s] - ends[s - 1] - m for s in during)
            out["startup_steps"] = len(during)
    return out


def _med(xs: list, nd: int = 3):
    xs = [x for x in xs if x is not None]
    return round(median(xs), nd) if xs else None


def _check(la: Launch, what: str, steps: int | None = None) -> None:
    if la.rc != 0 or (steps is not None and last_step(la.out) < steps - 1):
        raise RuntimeError(f"{what} failed (rc {la.rc}, last step {last_step(la.out)}):\n{la.out[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300,
                    help="training steps: enough that the restarted joiner (seconds of start-up on a loaded "
                         "machine) gets back in before the end; if not, the job's wait for it is counted")
    ap.add_argument("--fail-step", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds of simulated compute per step")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per launcher run")
    ap.add_argument("--hang-timeout", type=float, default=120,
                    help="a failing torchrun launch still running after this many seconds is killed and "
                         "counted as hung (the user's watchdog); such runs leave the torchrun_lost_s median "
                         "when any run did not hang")
    ap.add_argument("--keep", default="", help="copy every run's output and worker logs to this directory")
    ap.add_argument("--repeats", type=int, default=1,
                    help="fault-free / failing runs of each launcher (values are medians)")
    args = ap.parse_args(argv)
    if not 1 <= args.fail_step < args.steps - 1:
        ap.error(f"--fail-step {args.fail_step} must be in 1..{args.steps - 2} (--steps {args.steps}): "
                 "there must be steps before and after the failure")
    if args.nproc < 3:
        ap.error(f"--nproc {args.nproc}: rank 2 is the one that fails, so at least 3 workers are needed")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    py = sys.executable
    common = [TRAIN, "--steps", str(args.steps), "--step-sleep", str(args.step_sleep)]
    fail = ["--exit-at-step", str(args.fail_step), "--exit-rank", "2"]
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1",
                "--nproc-per-node", str(args.nproc)]
    resil = [py, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())", "--standalone",
             "--max-restarts", "1", "--nproc-per-node", str(args.nproc)]
    res: dict = {"steps": args.steps, "fail_step": args.fail_step, "nproc": args.nproc,
                 "step_sleep": args.step_sleep, "repeats": args.repeats,
                 "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    t_ok, t_fail, t_re, t_rec, t_lost, t_floor, t_step, t_outcome = [], [], [], [], [], [], [], []
    r_ok, r_fail, r_lost, r_floor, r_step, r_tailwait, r_bd = [], [], [], [], [], [], []
    t_ht: list[tuple[float, float]] = []
    t_win, t_win_floor, r_win, r_win_floor = [], [], [], []
    r_ht: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="restart-vs-resume-") as tmp:
        d = Path(tmp)
        for i in range(args.repeats):
            ck = ["--backend", "gloo", "--checkpoint", str(d / f"ck{i}.pt")]
            la = run(torchrun + common + ["--backend", "gloo", "--checkpoint", str(d / f"ok{i}.pt")],
                     args.timeout, d / f"t-ok{i}")
            _check(la, "fault-free torchrun run", args.steps)
            est_t_ok = est = in_run_estimate([la], args.steps)
            t_ok.append(la.wall), t_floor.append(est["lost_s"]), t_step.append(est["step_s"])
            t_ht.append((est["head_s"], est["tail_s"]))

            la = run(torchrun + common + ck + fail, min(args.timeout, args.hang_timeout), d / f"t-fail{i}")
            launches = [la]
            recovered = la.rc == 0 and last_step(la.out) == args.steps - 1
            t_rec.append(recovered)
            t_outcome.append("recovered" if recovered else "hung" if la.rc == 124 else f"exited {la.rc}")
            if not recovered:  # the user relaunches from the last checkpoint
                la2 = run(torchrun + common + ck, args.timeout, d / f"t-re{i}")
                _check(la2, "torchrun relaunch from the checkpoint", args.steps)
                launches.append(la2)
            t_fail.append(la.wall)
            t_re.append(launches[-1].wall if not recovered else 0.0)
            est = in_run_estimate(launches, args.steps)
            t_lost.append(est["lost_s"])
            win = window_steps(launches, args.fail_step, args.steps)
            t_win.append(window_lost(est, win)), t_win_floor.append(window_lost(est_t_ok, win))

            la = run(resil + common, args.timeout, d / f"r-ok{i}")
            _check(la, "fault-free resilient-run", args.steps)
            est_r_ok = est = in_run_estimate([la], args.steps)
            r_ok.append(la.wall), r_floor.append(est["lost_s"]), r_step.append(est["step_s"])
            r_ht.append((est["head_s"], est["tail_s"]))

            la = run(resil + common + fail, args.timeout, d / f"r-fail{i}")
            _check(la, "resilient-run with a failure", args.steps)
            est = in_run_estimate([la], args.steps)
            r_fail.append(la.wall), r_lost.append(est["lost_s"]), r_tailwait.append(est["tail_wait_s"])
            win = window_steps([la], args.fail_step, args.steps)
            r_bd.append(resilient_breakdown(la, args.fail_step, est["step_s"], win))
            r_win.append(window_lost(est, win)), r_win_floor.append(window_lost(est_r_ok, win))
        if args.keep:
            keep_runs(d, Path(args.keep))
    t_res = max(abs(x) for x in t_floor)
    r_res = max(max(abs(x) for x in r_floor), 0.001)  # log timestamps: ms at best
    not_hung = [x for x, o in zip(t_lost, t_outcome) if o != "hung"]
    tl, rl = median(not_hung or t_lost), median(r_lost)
    res.update(
        torchrun_step_s=_med(t_step, 4), resilient_step_s=_med(r_step, 4),
        torchrun_head_tail_s=[_med([h for h, _ in t_ht]), _med([t for _, t in t_ht])],
        resilient_head_tail_s=[_med([h for h, _ in r_ht]), _med([t for _, t in r_ht])],
        torchrun_recovered=all(t_rec), torchrun_failed_runs=t_outcome,
        torchrun_lost_s=round(tl, 3), torchrun_lost_runs_s=[round(x, 3) for x in t_lost],
        torchrun_lost_fault_free_s=[round(x, 3) for x in t_floor], torchrun_resolution_s=round(t_res, 3),
        torchrun_lost_net_s=round(tl - median(t_floor), 3),
        resilient_lost_s=round(rl, 3), resilient_lost_runs_s=[round(x, 3) for x in r_lost],
        resilient_lost_fault_free_s=[round(x, 3) for x in r_floor], resilient_resolution_s=round(r_res, 3),
        resilient_lost_net_s=round(rl - median(r_floor), 3),
        resilient_failure_step_extra_s=_med([b["failure_step_extra_s"] for b in r_bd]),
        resilient_exit_to_step_end_s=_med([b["exit_to_step_end_s"] for b in r_bd]),
        resilient_join_step_extra_s=_med([b["join_step_extra_s"] for b in r_bd]),
        resilient_joiner_back_s=_med([b["joiner_back_s"] for b in r_bd]),
        resilient_joiner_startup_excess_s=[None if b["startup_excess_s"] is None else
                                           [round(b["startup_excess_s"], 3), b["startup_steps"]] for b in r_bd],
        resilient_tail_wait_s=_med(r_tailwait),
        resilient_joiner_rejoined=[b["rejoined"] for b in r_bd],
        torchrun_fault_free_s=_med(t_ok), torchrun_failed_run_s=_med(t_fail), torchrun_relaunch_s=_med(t_re),
        torchrun_lost_wall_s=round(median([f + r for f, r in zip(t_fail, t_re)]) - median(t_ok), 3),
        resilient_fault_free_s=_med(r_ok), resilient_failed_run_s=_med(r_fail),
        resilient_lost_wall_s=round(median(r_fail) - median(r_ok), 3),
        noise_s=round(max(max(t_ok) - min(t_ok), max(r_ok) - min(r_ok)), 3) if args.repeats > 1 else None,
    )
    tw = median([x for x, o in zip(t_win, t_outcome) if o != "hung"] or t_win)
    rw = median(r_win)
    tw_res = max(abs(x) for x in t_win_floor)
    rw_res = max(max(abs(x) for x in r_win_floor), 0.001)
    res.update(
        torchrun_lost_window_s=round(tw, 3), torchrun_lost_window_runs_s=[round(x, 3) for x in t_win],
        torchrun_window_floor_s=[round(x, 3) for x in t_win_floor], torchrun_window_resolution_s=round(tw_res, 3),
        resilient_lost_window_s=round(rw, 3), resilient_lost_window_runs_s=[round(x, 3) for x in r_win],
        resilient_window_floor_s=[round(x, 3) for x in r_win_floor], resilient_window_resolution_s=round(rw_res, 3),
        ratio_window=round(tw / rw, 1) if rw > rw_res else None,
        ratio_window_lower_bound=round(max(tw - tw_res, 0.0) / (max(rw, 0.0) + rw_res), 1),
    )
    res["ratio"] = round(tl / rl, 1) if rl > r_res else None
    res["ratio_lower_bound"] = round(max(tl - t_res, 0.0) / (max(rl, 0.0) + r_res), 1)
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
