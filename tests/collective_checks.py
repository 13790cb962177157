"""Result checks of the multi-process collective tests (a :class:`collective_harness.Workers`
run), and the op table the SIGKILL tests share. Every expected value is computed here
independently (``workers/inputs.py``), never read back from the Communicator."""
from __future__ import annotations

import numpy as np

from collective_harness import Workers
from inputs import expected, make_input


def kill_ops(numel: int) -> list[dict]:
    """The ops a SIGKILL test runs: a float and an integer allreduce of ``numel`` (the
    victim dies in op 1), then a small one over the survivors."""
    return [
        {"k": "allreduce", "numel": numel, "dtype": "float64", "op": "sum"},
        {"k": "allreduce", "numel": numel, "dtype": "int64", "op": "sum"},
        {"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"},
    ]


def idx(mid: str) -> int:
    return int(mid[1:])


def check_allreduce(w: Workers, mid: str, seq: int, spec: dict) -> list[str]:
    """Op ``seq`` succeeded on ``mid`` with the reduction over the contributors it
    reports; returns them."""
    rec = w.records(mid)[seq]
    assert rec["ok"], rec
    contrib = rec["contributors"]
    exp = expected(spec.get("op", "sum"), [idx(m) for m in contrib], seq, w.seed, spec["numel"], spec["dtype"])
    got = w.output(mid, seq)
    if spec["dtype"].startswith("int"):
        # ints: exact (the op's own dtype wraps like the reference only for sum/prod of small values)
        np.testing.assert_array_equal(got.astype(np.int64), exp.numpy())
    else:
        tol = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[spec["dtype"]]
        np.testing.assert_allclose(got.astype(np.float64), exp.numpy(), rtol=tol, atol=tol * max(1, len(contrib)))
    return contrib


def check_fault_free(w: Workers, mid: str, seq: int, spec: dict, mids: list[str]) -> dict:
    """Op ``seq`` of a run without faults succeeded on ``mid`` with the exact result
    (every member a contributor); returns its record."""
    rec = w.records(mid)[seq]
    assert rec["ok"], rec
    world = len(mids)
    if spec["k"] == "allreduce":
        assert check_allreduce(w, mid, seq, spec) == mids
    elif spec["k"] == "broadcast":
        exp = make_input(spec["root"], seq, w.seed, spec["numel"], spec["dtype"]).numpy()
        np.testing.assert_array_equal(w.output(mid, seq), exp)
    elif spec["k"] == "allgather":
        exp = np.stack([make_input(i, seq, w.seed, spec["numel"], spec["dtype"]).numpy() for i in range(world)])
        np.testing.assert_array_equal(w.output(mid, seq), exp)
    elif spec["k"] == "reduce_scatter":
        c = idx(mid)
        exp = sum(make_input(i, seq * 100 + c, w.seed, spec["numel"], spec["dtype"]) for i in range(world))
        np.testing.assert_array_equal(w.output(mid, seq), exp.numpy())
    return rec


def check_fault_free_run(w: Workers, ops: list[dict]) -> dict[str, list[dict]]:
    """Every member of a run without faults finished every op of ``ops`` exactly
    (:func:`check_fault_free`), and all hold bitwise the same allreduce results; returns
    each member's records."""
    mids = list(w.procs)
    w.wait_done(mids, 120)
    recs = {mid: [check_fault_free(w, mid, seq, spec, mids) for seq, spec in enumerate(ops)] for mid in mids}
    assert_agree(w, mids, [seq for seq, spec in enumerate(ops) if spec["k"] == "allreduce"])
    return recs


def survivors_of_kill(w: Workers, victim: str) -> dict[str, list[dict]]:
    """After a run in which ``victim`` was SIGKILLed: every survivor finished every op
    without an error; returns each survivor's records."""
    survivors = [m for m in w.procs if m != victim]
    w.wait_done(list(w.procs), 120)
    assert w.procs[victim].wait(10) == -9
    recs = {mid: w.records(mid) for mid in survivors}
    for r in recs.values():
        assert all(x["ok"] for x in r), r
    return recs


def assert_agree(w: Workers, mids: list[str], seqs: list[int]) -> None:
    """Every member of ``mids`` holds bitwise the output of ``mids[0]`` for each op in ``seqs``."""
    for seq in seqs:
        first = w.output(mids[0], seq)
        for mid in mids[1:]:
            np.testing.assert_array_equal(w.output(mid, seq), first)
