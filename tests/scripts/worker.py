"""Test worker for resilient-run.

Writes its environment plus "PID" as JSON to $DUMP_DIR/<LOCAL_RANK>.<RESTART_COUNT>.json;
exits at once with $FAIL_CODE if $FAIL_LOCAL_RANK is its local rank; otherwise waits until
$STOP_FILE exists and exits 0. On SIGTERM/SIGINT it writes <...>.signal (the signal
number) next to its dump and exits 0.
"""
import json
import os
import signal
import sys
import time

lr = os.environ["LOCAL_RANK"]
base = os.path.join(os.environ["DUMP_DIR"], f"{lr}.{os.environ['TORCHELASTIC_RESTART_COUNT']}")


def on_signal(signum, _frame):
    with open(base + ".signal", "w") as f:
        f.write(str(signum))
    sys.exit(0)


signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
env = dict(os.environ, PID=str(os.getpid()))
with open(base + ".tmp", "w") as f:
    json.dump(env, f)
os.replace(base + ".tmp", base + ".json")
print(f"worker {lr} up", flush=True)
if os.environ.get("FAIL_LOCAL_RANK") == lr:
    sys.exit(int(os.environ.get("FAIL_CODE", "3")))
stop = os.environ.get("STOP_FILE", "/nonexistent")
while not os.path.exists(stop):
    time.sleep(0.05)
sys.exit(0)
