"""Test worker: writes its environment as JSON to $DUMP_DIR/<LOCAL_RANK>.<RESTART_COUNT>.json
(or prints one JSON line when DUMP_DIR is unset), then exits with $EXIT_CODE (default 0)."""
import json
import os
import sys

env = dict(os.environ)
out = os.environ.get("DUMP_DIR")
if out:
    name = f"{env.get('LOCAL_RANK')}.{env.get('TORCHELASTIC_RESTART_COUNT')}.json"
    tmp = os.path.join(out, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(env, f, sort_keys=True)
    os.replace(tmp, os.path.join(out, name))
else:
    print(json.dumps(env, sort_keys=True), flush=True)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
