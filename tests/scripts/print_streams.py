"""Test worker: prints 'out <local rank> <i>' to stdout and 'err <local rank> <i>' to stderr."""
import os
import sys

lr = os.environ["LOCAL_RANK"]
for i in range(3):
    print(f"out {lr} {i}", flush=True)
    print(f"err {lr} {i}", file=sys.stderr, flush=True)
