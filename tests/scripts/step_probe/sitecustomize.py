"""Test probe, loaded by Python at start-up (``PYTHONPATH`` has this directory) in the
workers of tests/test_ddp_unchanged.py; the training script itself is unchanged.

With ``$STEP_PROBE_DIR`` set in a worker process (``$RANK`` set), registers torch's global
optimizer step post-hook: after every ``optimizer.step()`` it appends the parameters (as
float lists) to ``$STEP_PROBE_DIR/<pid>.jsonl`` with the rank and restart count, then sleeps
``$STEP_PROBE_SLEEP`` seconds (stands for the compute of a real model, so a test can kill
a worker mid-training)."""
import os

if os.environ.get("STEP_PROBE_DIR") and os.environ.get("RANK") is not None:
    import json
    import time

    import torch.optim.optimizer as _optim

    _path = os.path.join(os.environ["STEP_PROBE_DIR"], f"{os.getpid()}.jsonl")
    _sleep = float(os.environ.get("STEP_PROBE_SLEEP", "0"))
    _steps = [0]

    def _after_step(optimizer, args, kwargs):
        params = [p.detach().reshape(-1).tolist() for g in optimizer.param_groups for p in g["params"]]
        rec = {"rank": int(os.environ["RANK"]), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
               "step": _steps[0], "params": params}
        _steps[0] += 1
        with open(_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if _sleep:
            time.sleep(_sleep)

    _optim.register_optimizer_step_post_hook(_after_step)
