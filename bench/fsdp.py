"""Sharded training survives a SIGKILL: HSDP (2 x 4) and plain FSDP (8 x 1) on the resilient backend.

Eight workers under ``resilient-run --standalone`` run the unchanged FSDP2 script
``tests/scripts/hsdp_train.py`` (``MODEL=transformer``: ``--layers`` pre-norm encoder blocks
of width ``--dim``, float64, SGD with momentum, ``fully_shard`` per block over a
``("replicate", "shard")`` mesh). World rank ``--kill-rank`` (replica group 1) SIGKILLs
itself mid-backward at step ``--kill-step`` of ``--steps``. The reference run is the same
job where replica group 1 leaves cleanly before that step: every step of it has the
contributor sets the failing run must deliver.

Printed, one JSON object per case (keys ``case, lost_s, steps_redone, params_exact,
peer_copy_overhead`` and more):

- ``params_exact``: every surviving rank's local shards after every step equal the
  reference's bitwise (sha256 of the float64 bytes);
- ``lost_s``: on world rank 0, the extra seconds of the steps from the kill on over the
  same steps of the reference (the same membership): ``sum(t[k] - t_ref[k] for k in
  kill..kill+2)``; ``step_s``: the reference's median step time before the kill (all eight
  workers), and ``lost_steps`` = ``lost_s / step_s`` (the target is at most 2);
- ``steps_redone``: steps whose replicate all-reduces were redone (the log lines of
  :mod:`resilient.fsdp.step_ledger`);
- ``peer_copy_overhead``: plain FSDP's in-memory peer copy, as the fault-free step time with
  copies over the step time of the same job without them (``RESILIENT_FSDP_PEER_COPY=0``),
  minus one: ``--ab-rounds`` pairs of fault-free jobs of ``--ab-steps`` steps, the two
  sides in turns, the medians of their pooled steps on world rank 0 (the first three of
  each job left out); ``peer_copy_s``: the
  median time of the copy and its commit, measured inside the step; ``null`` for HSDP
  (it needs no copy: a healthy replica group holds every shard);
- ``survivors_restarted``: always 0 (no survivor is restarted; the launcher's summary).

- ``lost_vs_steady_s``: the rule both systems are measured by, side by side:
  ``sum(t[kill..kill+3]) - committed * t_steady`` on world rank 0, ``committed`` the steps of
  that window whose update was applied and ``t_steady`` the median step after it (the
  membership after the loss).

``torchft_hsdp``: torchft's HSDP (``bench/torchft_hsdp.py``) on the same model, batches and
kill, in a separate venv with ``torchft-nightly`` (``--torchft-venv``, made on first use
from the package index, sharing this venv's torch); skipped with the reason when it cannot
be installed. torchft is tuned: its lighthouse drops a group after 100 ms without
heartbeats (20 ms apart) and the manager's timeout is each of ``--ft-timeouts`` (below
about 0.4 s its quorum itself times out here); the best is reported, the others listed.
``lost_ratio`` = torchft's ``lost_vs_steady_s`` / ours.

``fsdp_8x1``: plain FSDP, ``fully_shard`` over a 1-D mesh of the eight workers (each its
own batch), the same model and kill; the reference run is the job in which the killed rank
leaves cleanly before that step; ``hosted``: the survivors that took over the lost shards
(the buddy, 1). The fault-free jobs with and without peer copies give ``peer_copy_overhead``.

Run: ``.venv/bin/python bench/fsdp.py`` (about 9 minutes on 2 cores; writes
``bench/results/fsdp.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import torchft_hsdp  # noqa: E402  (bench/ is not a package)

SCRIPT = ROOT / "tests" / "scripts" / "hsdp_train.py"
RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]


def _run(out: Path, args: argparse.Namespace, phase: str | None, mesh: str = "2,4", steps: int | None = None,
         **extra: str) -> tuple[int, str, dict[int, dict[str, Any]]]:
    out.mkdir(parents=True)
    env = {**os.environ, **extra, "MESH": mesh, "MODEL": "transformer", "DIM": str(args.dim), "LAYERS": str(args.layers),
           "STEPS": str(steps or args.steps), "OUT": str(out)}
    if phase is not None:
        env.update(KILL_RANK=str(args.kill_rank), KILL_STEP=str(args.kill_step), KILL_PHASE=phase)
    proc = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "8", str(SCRIPT)], env=env, cwd=out,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    logs = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    return proc.returncode, proc.stdout, logs


def lost_vs_steady(steps: list[dict[str, Any]], k: int, window: int = 4) -> float | None:
    """Seconds the window ``k .. k+window-1`` took beyond its applied steps at the steady
    step time after it (``None`` when the log is too short)."""
    if len(steps) < k + window + 3:
        return None
    steady = float(statistics.median(s["s"] for s in steps[k + window:]))
    part = steps[k:k + window]
    return round(float(sum(s["s"] for s in part)) - sum(1 for s in part if s.get("committed", True)) * steady, 4)


def _torchft(args: argparse.Namespace, tmp: Path, ours: float | None) -> dict[str, Any]:
    py = torchft_hsdp.venv(Path(args.torchft_venv))
    if isinstance(py, str):
        return {"case": "torchft_hsdp", "skipped": py}
    runs = []
    for i, t in enumerate(float(x) for x in args.ft_timeouts.split(",")):
        got = torchft_hsdp.run(py, tmp / f"torchft-{i}", groups=2, size=4, steps=args.steps, kill_step=args.kill_step,
                               kill_rank=args.kill_rank, dim=args.dim, layers=args.layers, ft_timeout_s=t,
                               join_timeout_ms=100, heartbeat_timeout_ms=100, timeout=args.timeout)
        steps = got["steps"]
        runs.append({"ft_timeout_s": t, "lost_vs_steady_s": lost_vs_steady(steps, args.kill_step),
                     "discarded_steps": sum(1 for s in steps if not s["committed"]),
                     "step_s": round(statistics.median(s["s"] for s in steps[3:args.kill_step]), 4) if steps else None,
                     **({"error": got["error"][-300:]} if "error" in got else {})})
    ok = [r for r in runs if r["lost_vs_steady_s"] is not None and "error" not in r]
    if not ok:
        return {"case": "torchft_hsdp", "skipped": "no torchft run finished", "runs": runs}
    best = min(ok, key=lambda r: r["lost_vs_steady_s"])
    return {"case": "torchft_hsdp", "lost_s": best["lost_vs_steady_s"], "lost_vs_steady_s": best["lost_vs_steady_s"],
            "ft_timeout_s": best["ft_timeout_s"], "discarded_steps": best["discarded_steps"],
            "step_s": best["step_s"], "steps_redone": 0, "params_exact": None, "peer_copy_overhead": None,
            "lost_ratio": round(best["lost_vs_steady_s"] / ours, 2) if ours else None, "runs": runs,
            "load": os.getloadavg()[0]}


def _lost(got: dict[int, dict[str, Any]], ref: dict[int, dict[str, Any]], k: int) -> tuple[float, float]:
    """(``lost_s``, the reference's median step before the kill) on world rank 0."""
    times = [s["s"] for s in got.get(0, {"steps": []})["steps"]]
    ref_times = [s["s"] for s in ref.get(0, {"steps": []})["steps"]]
    m = statistics.median(ref_times[3:k]) if len(ref_times) > k else float("nan")
    lost = (sum(times[k:k + 3]) - sum(ref_times[k:k + 3])) if min(len(times), len(ref_times)) >= k + 3 \
        else float("nan")
    return lost, m


def _plain(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Plain FSDP over 8 members: the same kill, the shards' peer copies (docs/fsdp.md)."""
    k = args.kill_step
    rc_ref, _text_ref, ref = _run(tmp / "plain-reference", args, "leave", mesh="8")
    rc, text, got = _run(tmp / "plain-kill", args, "rs", mesh="8")
    # the overhead: fault-free jobs with copies and without (RESILIENT_FSDP_PEER_COPY=0), in
    # turns (the shared machine's load drifts), pooled steady steps of world rank 0
    ab: dict[str, list[float]] = {"on": [], "off": []}
    ab_ok = True
    for i in range(args.ab_rounds):
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            extra = {"RESILIENT_FSDP_PEER_COPY": "0"} if side == "off" else {}
            rc_ab, _t, logs = _run(tmp / f"plain-ab-{i}-{side}", args, None, mesh="8", steps=args.ab_steps, **extra)
            ab_ok = ab_ok and rc_ab == 0
            ab[side] += [st["s"] for st in logs.get(0, {"steps": []})["steps"]][3:]
    healthy = [r for r in range(8) if r != args.kill_rank]
    exact = (rc == 0 and rc_ref == 0 and all(r in got and r in ref for r in healthy)
             and all([s["shards"] for s in got[r]["steps"]] == [s["shards"] for s in ref[r]["steps"]] for r in healthy))
    lost, m = _lost(got, ref, k)
    copy_s = ref.get(0, {}).get("copy_s", [])[3:k]
    copy = statistics.median(copy_s) if copy_s else float("nan")
    m_on = statistics.median(ab["on"]) if ab_ok and ab["on"] else float("nan")
    m_off = statistics.median(ab["off"]) if ab_ok and ab["off"] else float("nan")
    out = {
        "case": "fsdp_8x1", "exit_code": rc, "params_exact": exact, "lost_s": round(lost, 4), "step_s": round(m, 4),
        "lost_steps": round(lost / m, 2) if m == m and m > 0 else None,
        "steps_redone": got.get(0, {}).get("steps_redone"),
        "peer_copy_s": round(copy, 5), "step_s_with_copy": round(m_on, 4), "step_s_without_copy": round(m_off, 4),
        "peer_copy_overhead": round((m_on - m_off) / m_off, 4) if m_off == m_off and m_off > 0 else None,
        "ab_steps_per_side": len(ab["on"]),
        "survivors_restarted": 0, "hosted": len(re.findall(r"hosts the shards of the lost", text)),
        "steps": args.steps, "kill_step": k, "model": f"transformer {args.layers}x{args.dim} float64",
        "load": os.getloadavg()[0], "machine": f"{os.cpu_count()} CPUs, loopback",
    }
    if rc != 0 or not exact:
        out["log_tail"] = text[-3000:]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: .venv/bin/python bench/fsdp.py --steps 60 --kill-step 30")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-step", type=int, default=30)
    ap.add_argument("--kill-rank", type=int, default=5, help="a world rank of replica group 1 (ranks 4-7)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--ab-rounds", type=int, default=2,
                    help="fault-free plain FSDP jobs with and without peer copies, in turns, for the overhead")
    ap.add_argument("--ab-steps", type=int, default=40, help="steps of each of those jobs")
    ap.add_argument("--torchft-venv", default=str(ROOT / ".torchft-venv"),
                    help="venv with torchft-nightly for the side-by-side case (made when missing)")
    ap.add_argument("--ft-timeouts", default="0.5,1,2", help="torchft manager timeouts to try (seconds)")
    ap.add_argument("--no-torchft", action="store_true", help="skip torchft's side of the comparison")
    ap.add_argument("--no-write", action="store_true", help="do not write bench/results/fsdp.json")
    args = ap.parse_args()
    if not 4 <= args.kill_rank < 8 or not 0 < args.kill_step < args.steps - 5:
        ap.error("--kill-rank must be in replica group 1 (4-7) and --kill-step leave 5 steps after it")
    results = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        rc_ref, text_ref, ref = _run(Path(tmp) / "reference", args, "leave")
        rc, text, got = _run(Path(tmp) / "kill", args, "rs")
        plain = _plain(args, Path(tmp))
        ours_steady = lost_vs_steady(got.get(0, {"steps": []})["steps"], args.kill_step)
        ft = ({"case": "torchft_hsdp", "skipped": "--no-torchft"} if args.no_torchft
              else _torchft(args, Path(tmp), ours_steady))
    healthy = range(4)
    exact = (rc == 0 and rc_ref == 0 and all(r in got and r in ref for r in healthy)
             and all([s["shards"] for s in got[r]["steps"]] == [s["shards"] for s in ref[r]["steps"]] for r in healthy))
    times = [s["s"] for s in got.get(0, {"steps": []})["steps"]]
    ref_times = [s["s"] for s in ref.get(0, {"steps": []})["steps"]]
    k = args.kill_step
    m = statistics.median(ref_times[3:k]) if len(ref_times) > k else float("nan")
    lost = (sum(times[k:k + 3]) - sum(ref_times[k:k + 3])) if min(len(times), len(ref_times)) >= k + 3 \
        else float("nan")
    results.append({
        "case": "hsdp_2x4", "exit_code": rc, "params_exact": exact, "lost_s": round(lost, 4), "step_s": round(m, 4),
        "lost_steps": round(lost / m, 2) if m == m and m > 0 else None, "lost_vs_steady_s": ours_steady,
        "steps_redone": len(re.findall(r"replicate all-reduces were redone", text)) // 4,
        "peer_copy_overhead": None, "survivors_restarted": 0,
        "stepped_aside": len(re.findall(r"steps aside: its replica group 1", text)),
        "steps": args.steps, "kill_step": k, "model": f"transformer {args.layers}x{args.dim} float64",
        "load": os.getloadavg()[0], "machine": f"{os.cpu_count()} CPUs, loopback",
        "command": " ".join(["python bench/fsdp.py", *sys.argv[1:]]),
    })
    results.append(plain)
    results.append(ft)
    for r in results:
        print(json.dumps(r))
    exact = exact and bool(plain.get("params_exact"))
    if not args.no_write and exact:
        from results_file import write

        write("fsdp", " ".join([".venv/bin/python bench/fsdp.py", *sys.argv[1:]]), load_before,
              headline(results, args), results)
    if rc != 0:
        print(text[-4000:], file=sys.stderr)
    return 0 if exact else 1


def headline(results: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, str]]:
    """The README's lines for this bench (from one run's results)."""
    h, plain, ft = results
    k = args.kill_step
    out = [{"claim": f"HSDP 2 × 4, SIGKILL mid-backward at step {k} of {args.steps}",
            "figure": f"exit 0, no survivor restarted, every step bitwise the reference's; {h['lost_s']} s "
                      f"lost = {h['lost_steps']} fault-free steps"},
           {"claim": "plain FSDP 8 × 1, the same SIGKILL, shards kept in a peer's memory",
            "figure": f"exit 0, no restart, every step bitwise the reference's; {plain['lost_s']} s lost = "
                      f"{plain['lost_steps']} fault-free steps; the copies cost "
                      f"{round(100 * plain['peer_copy_overhead'], 1)} % of a step"}]
    if ft.get("lost_ratio"):
        out.append({"claim": "time lost to that SIGKILL, side by side with torchft's HSDP (tuned)",
                    "figure": f"{h['lost_vs_steady_s']} s vs torchft {ft['lost_vs_steady_s']} s "
                              f"({ft['lost_ratio']}× less; torchft discards the step)"})
    return out


if __name__ == "__main__":
    sys.exit(main())
