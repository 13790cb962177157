"""Run torch's own distributed tests (``DistributedTest._DistTestBase`` from the installed
wheel) against the resilient backend; the selection and the skips are in
tests/torch_suite_skips.txt. Started by tests/test_torch_suite.py with BACKEND=resilient,
WORLD_SIZE, TEMP_DIR, RESILIENT_ETCD and RESILIENT_JOB set (a coordinator runs for the job).

    python tests/torch_suite/run.py SKIPS_FILE RESULT_JSON [NAME ...]

``RESILIENT_TORCH_SUITE_SHARD=i/n`` runs every n-th test of the selection from the i-th
(the test runs two shards side by side); ``RESILIENT_TORCH_SUITE=full`` runs the whole selection; the default (``quick``, what
``make test`` runs) leaves out the QUICK-EXCLUDE variants of the rules file.

Each test forks WORLD_SIZE ranks (torch's MultiProcessTestCase), which call
``init_process_group("resilient", init_method=file://..., rank=r, world_size=n)``; when a
rank's test body ends, its engine is closed (lease revoked) so the next test's ranks form
the next epoch at once. Writes {"passed": [...], "failed": {name: text}, "skipped": {...}}.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import unittest

import torch.multiprocessing

import resilient  # noqa: F401 - registers the backend
from resilient.torch_backend import current_engine
from torch.testing._internal import common_distributed

# Before distributed_test is imported (its skip decorators read these sets at import):
# "plugin" makes torch treat the backend as available; "gpu" is torch's name for the
# backends whose *CPU* object-collective tests (broadcast_object_list, all_gather_object,
# gather_object, scatter_object_list, ...) run — their CUDA variants still skip on a machine
# without GPUs (skip_if_no_gpu / require_n_gpus).
common_distributed.DistTestCases.backend_feature["plugin"].add("resilient")
common_distributed.DistTestCases.backend_feature["gpu"].add("resilient")

from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402


def read_rules(path: str) -> tuple[list[str], dict[str, str], list[str], list[str], list[str]]:
    """(SELECT prefixes, SKIP name -> reason, UNSKIP names, QUICK-EXCLUDE substrings,
    QUICK-INCLUDE names: in the quick set although an exclusion matches them)."""
    select, skips, unskip, exclude, include = [], {}, [], [], []
    for line in open(path):
        line = line.strip()
        if line.startswith("SELECT "):
            select += line.split()[1:]
        elif line.startswith("SKIP "):
            name, _, reason = line[5:].partition("#")
            skips[name.strip()] = reason.strip()
        elif line.startswith("UNSKIP "):
            unskip.append(line[7:].partition("#")[0].strip())
        elif line.startswith("QUICK-EXCLUDE "):
            exclude += line.split()[1:]
        elif line.startswith("QUICK-INCLUDE "):
            include += line.split()[1:]
    return select, skips, unskip, exclude, include


def unskipped(fn):
    """``fn`` without torch's backend-name skip marks: unittest's skip wrappers are peeled
    (functools.wraps copies ``__unittest_skip__`` outwards), and torch's own
    ``skip_but_pass_in_sandcastle`` marks the function itself, so the result is a fresh
    wrapper without the mark."""
    while getattr(fn, "__unittest_skip__", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return fn(*args, **kwargs)

    run.__dict__.pop("__unittest_skip__", None)
    run.__dict__.pop("__unittest_skip_why__", None)
    return run


class TestResilient(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        # forked ranks inherit the imported torch (spawn would re-import it per rank per test)
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        try:
            super()._run(rank, test_name, file_name, pipe, **kwargs)
        finally:  # sys.exit(0) at the end of a test: leave the job now, not at lease expiry
            engine = current_engine()
            if engine is not None:
                engine.close()


def main() -> int:
    skips_file, out = sys.argv[1], sys.argv[2]
    select, skips, unskip, exclude, include = read_rules(skips_file)
    if os.environ.get("RESILIENT_TORCH_SUITE", "quick") == "full":
        exclude = []
    for name in unskip:  # CPU tests torch gates on another backend's name (see the rules file)
        setattr(TestResilient, name, unskipped(getattr(dt.DistributedTest._DistTestBase, name)))
    names = sorted(n for n in dir(dt.DistributedTest._DistTestBase)
                   if n.startswith("test_") and any(n.startswith(p) for p in select)
                   and (n in include or not any(x in n for x in exclude)))
    if len(sys.argv) > 3:
        names = [n for n in names if n in sys.argv[3:]]
    shard = os.environ.get("RESILIENT_TORCH_SUITE_SHARD", "")  # "i/n": every n-th test from the i-th
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        names = names[i::n]
    skipped = {n: skips[n] for n in names if n in skips}
    skipped.update({n: "CUDA variant: no GPU, and the backend is registered for cpu" for n in names
                    if "cuda" in n.lower() and n not in skipped})
    skipped.update({n: "skipped by torch for this backend" for n in names
                    if getattr(getattr(TestResilient, n), "__unittest_skip__", False) and n not in skipped})
    run = [n for n in names if n not in skipped]
    suite = unittest.TestSuite(TestResilient(n) for n in run)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stderr).run(suite)
    bad = {t.id().rsplit(".", 1)[-1]: text[-1500:] for t, text in result.failures + result.errors}
    torch_skipped = {t.id().rsplit(".", 1)[-1]: str(r) for t, r in result.skipped}
    skipped.update(torch_skipped)
    passed = [n for n in run if n not in bad and n not in torch_skipped]
    json.dump({"passed": passed, "failed": bad, "skipped": skipped}, open(out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
