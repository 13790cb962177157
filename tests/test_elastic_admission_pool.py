"""A rebuilt Communicator (a joiner's admission: ``CommunicatorEngine.rebuild``) takes over
the free pooled buffers of the one it replaces (``Communicator.adopt_buffer_pool``), so
the survivors' first bulk ops after an admission reuse memory already faulted in instead
of allocating (and page-faulting) it again. Real Communicators over real TCP transports on
loopback (tests/static_group.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import run_communicators  # noqa: E402


def test_rebuilt_communicator_reuses_the_old_ones_free_buffers_and_stays_exact(job_name):
    from resilient.collectives.communicator import Communicator

    numel = 1 << 19  # 2 MiB of float32: pooled (>= 1 MiB), ring path

    def body(member: str, comm: Communicator) -> tuple[bool, bool, bool]:
        rank = comm.rank
        for _ in range(3):
            comm.allreduce(torch.full((numel,), float(rank + 1)))
        free = {b.data_ptr() for b in comm._buffers.free_buffers()}  # noqa: SLF001
        comm.close()
        fresh = Communicator(comm.view, comm.transport, op_timeout=20)
        try:
            fresh.adopt_buffer_pool(comm)
            t = torch.full((numel,), float(rank + 1))
            fresh.allreduce(t)
            retained = fresh.retained
            reused = retained is not None and retained.out.data_ptr() in free   # the op's output buffer
            return bool(free), reused, bool(torch.all(t == 3.0))
        finally:
            fresh.close()

    _, out = run_communicators(2, job_name, body)
    assert all(v == (True, True, True) for v in out.values()), out
