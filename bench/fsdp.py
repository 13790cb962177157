"""Sharded training survives a SIGKILL: HSDP (2 x 4) over the resilient backend.

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
- ``peer_copy_overhead``: the in-memory peer copy of plain FSDP; ``null`` here (HSDP needs
  none: a healthy replica group holds every shard);
- ``survivors_restarted``: always 0 (no survivor is restarted; the launcher's summary).

The plain-FSDP case (8 x 1, shards copied to a peer) and torchft's HSDP side by side are
printed as ``{"case": ..., "skipped": why}``: docs/fsdp.md says what is built.

Run: ``.venv/bin/python bench/fsdp.py`` (about 3 minutes on 2 cores; writes
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

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hsdp_train.py"
RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]


def _run(out: Path, args: argparse.Namespace, phase: str | None) -> tuple[int, str, dict[int, dict]]:
    out.mkdir(parents=True)
    env = {**os.environ, "MESH": "2,4", "MODEL": "transformer", "DIM": str(args.dim), "LAYERS": str(args.layers),
           "STEPS": str(args.steps), "OUT": str(out)}
    if phase is not None:
        env.update(KILL_RANK=str(args.kill_rank), KILL_STEP=str(args.kill_step), KILL_PHASE=phase)
    proc = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "8", str(SCRIPT)], env=env, cwd=out,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    logs = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    return proc.returncode, proc.stdout, logs


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
    ap.add_argument("--no-write", action="store_true", help="do not write bench/results/fsdp.json")
    args = ap.parse_args()
    if not 4 <= args.kill_rank < 8 or not 0 < args.kill_step < args.steps - 5:
        ap.error("--kill-rank must be in replica group 1 (4-7) and --kill-step leave 5 steps after it")
    results = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        rc_ref, text_ref, ref = _run(Path(tmp) / "reference", args, "leave")
        rc, text, got = _run(Path(tmp) / "kill", args, "rs")
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
        "lost_steps": round(lost / m, 2) if m == m and m > 0 else None,
        "steps_redone": len(re.findall(r"replicate all-reduces were redone", text)) // 4,
        "peer_copy_overhead": None, "survivors_restarted": 0,
        "stepped_aside": len(re.findall(r"steps aside: its replica group 1", text)),
        "steps": args.steps, "kill_step": k, "model": f"transformer {args.layers}x{args.dim} float64",
        "load": os.getloadavg()[0], "machine": f"{os.cpu_count()} CPUs, loopback",
        "command": "python bench/fsdp.py " + " ".join(sys.argv[1:]),
    })
    results.append({"case": "fsdp_8x1", "skipped": "plain FSDP's in-memory peer copies are not built (docs/fsdp.md)"})
    results.append({"case": "torchft_hsdp", "skipped": "torchft's HSDP side by side is not built (docs/fsdp.md)"})
    for r in results:
        print(json.dumps(r))
    if not args.no_write and exact:
        sys.path.insert(0, str(ROOT / "bench"))
        from results_file import write

        h = results[0]
        write("fsdp", ".venv/bin/python bench/fsdp.py " + " ".join(sys.argv[1:]), load_before, [{
            "claim": f"HSDP 2 × 4, SIGKILL mid-backward at step {k} of {args.steps}",
            "figure": f"exit 0, no survivor restarted, every step bitwise the reference's; {h['lost_s']} s lost = "
                      f"{h['lost_steps']} fault-free steps"}], results)
    if rc != 0:
        print(text[-4000:], file=sys.stderr)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
