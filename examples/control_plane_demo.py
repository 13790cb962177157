"""The control plane, live, in about 10 seconds (`make demo` runs the training demo).

What it does, all for real (no simulation):

1. ``resilient-run --standalone --nproc-per-node 4 --max-restarts 1 examples/train.py``
   starts a local etcd, a coordinator and 4 training processes (a small DDP model on
   synthetic data, gradients averaged with the resilient backend, state kept in
   ``resilient.elastic.State``);
2. at a random step it sends SIGKILL to one worker;
3. it reads the workers' per-step logs and tells what happened: the failure, how long the
   survivors took to continue, the gradient allreduce that was in flight finishing with
   the survivors, the worker restarted as a joiner and synced from a healthy member, and
   the loss curve continuing down — with the survivors' parameters bitwise identical at
   every step.

Everything it starts is stopped when it ends (resilient-run cleans up etcd and the
coordinator; the demo only signals processes it started, by PID).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 80


def say(msg: str = "") -> None:
    print(msg, flush=True)


def read_logs(d: Path) -> list[dict]:
    out = []
    for f in d.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def main() -> int:
    kill_step = random.randint(15, 30)
    with tempfile.TemporaryDirectory(prefix="resilient-demo-") as tmp:
        logs = Path(tmp)
        cmd = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())",
               "--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "--lease-ttl", "3",
               str(ROOT / "examples" / "train.py"), "--steps", str(STEPS), "--step-sleep", "0.1",
               "--log-dir", str(logs)]
        say("== resilient demo: 4 workers train a small model with DDP on the 'resilient' backend")
        say("   $ resilient-run --standalone --nproc-per-node 4 --max-restarts 1 examples/train.py --steps "
            f"{STEPS}")
        t_start = time.time()
        agent = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        try:
            victim = None
            deadline = time.monotonic() + 120
            while victim is None and time.monotonic() < deadline and agent.poll() is None:
                for r in read_logs(logs):
                    if r.get("rank") == 2 and r.get("step", -1) >= kill_step - 1 and "event" not in r:
                        victim = r
                        break
                time.sleep(0.02)
            if victim is None:
                say("!! training did not reach the kill step; resilient-run output:")
                say(agent.communicate(timeout=30)[0][-3000:] if agent.poll() is not None else "(still running)")
                return 1
            os.kill(victim["pid"], signal.SIGKILL)
            t_kill = time.time()
            say(f"\n== FAILURE: SIGKILL sent to worker rank 2 (pid {victim['pid']}, member {victim['member']}) "
                f"after it finished step {victim['step']}")
            output, _ = agent.communicate(timeout=150)
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)
                agent.wait(30)
        recs = read_logs(logs)
    steps = [r for r in recs if "event" not in r]
    dead = victim["member"]
    survivors = sorted({r["member"] for r in steps if r["restart"] == 0 and r["member"] != dead})
    after = sorted((r for r in steps if r["t"] > t_kill and r["member"] in survivors), key=lambda r: r["t"])
    say("\n-- what the node agent saw:")
    shown = 0
    for line in output.splitlines():
        if "[resilient-run]" in line and (f"pid {victim['pid']}" in line or dead in line
                                          or "restarting it as a joiner" in line):
            say("   " + line.strip())
            shown += 1
            if shown == 3:
                break
    if not after:
        say("!! the survivors did not continue")
        return 1
    first = after[0]
    say(f"\n== RECOVERY: the 3 survivors finished their next step {1000 * (first['t'] - t_kill):.0f} ms after the kill")
    in_flight = [r for r in steps if r["member"] in survivors and r["step"] == first["step"]]
    say(f"   step {first['step']} (in progress when the worker died): its gradient allreduce completed with "
        f"{len(in_flight[0]['contributors'])} of 4 contributors\n   ({', '.join(in_flight[0]['contributors'])}): "
        "the collectives resumed with the survivors, nothing restarted;\n   the gradient is the exact mean over "
        "those members, and the lost worker's samples go back to the sampler")
    synced = [r for r in recs if r.get("event") == "synced" and r.get("restart") == 1]
    if synced:
        s = synced[0]
        ref = next(r["params_sha"] for r in steps if r["step"] == s["step"] - 1 and r["member"] in survivors)
        say(f"\n== JOINER: resilient-run restarted the killed worker (restart 1, pid {s['pid']}); it joined at "
            f"step {s['step']}, {s['t'] - t_kill:.1f} s after the kill,\n   synced from a healthy member: its "
            f"parameters {s['params_sha']} {'==' if s['params_sha'] == ref else '!='} survivors' {ref}")
    by_step: dict[int, list[dict]] = {}
    for r in steps:
        by_step.setdefault(r["step"], []).append(r)
    identical = all(len({r["params_sha"] for r in rs}) == 1 for rs in by_step.values())
    say(f"\n== REPLICAS: parameters bitwise identical on every live worker after every one of the {len(by_step)} "
        f"steps: {identical}")
    say("\n== LOSS (mean over workers; world size in brackets):")
    for s in range(0, STEPS, 5):
        rs = by_step.get(s, [])
        if not rs:
            continue
        loss = sum(r["loss"] for r in rs) / len(rs)
        mark = "  <- kill" if s <= victim["step"] + 1 < s + 5 else ""
        say(f"   step {s:3d} [{len(rs)}] {loss:8.4f} " + "#" * int(min(60, loss * 100)) + mark)
    say(f"\n== done in {time.time() - t_start:.1f} s; resilient-run exited with code {agent.returncode}")
    return 0 if agent.returncode == 0 and identical else 1


if __name__ == "__main__":
    sys.exit(main())
