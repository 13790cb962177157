"""Unit tests of the Communicator's pure parts: the op thread (order, errors, closing,
per-op metrics) and the choice of a compressed op body. The op loop and the recovery
path run in the multi-process tests (test_collectives_*.py)."""
from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from resilient.collectives.algorithms.select import Sizing
from resilient.collectives.compressed import Compression
from resilient.collectives.compression_switch import compressed_body
from resilient.collectives.op_metrics import OpMetrics
from resilient.collectives.op_thread import OpThread
from resilient.errors import ClosedError, ConfigError
from resilient.kernels import ReduceOp


class _Recorded:
    """A metrics registry that keeps what it was told."""

    def __init__(self) -> None:
        self.collectives: list[tuple[str, int]] = []

    def record_collective(self, kind: str, seconds: float, nbytes: int) -> None:
        assert seconds >= 0
        self.collectives.append((kind, nbytes))


def test_op_thread_runs_ops_in_call_order_on_one_thread_and_times_collectives() -> None:
    reg = _Recorded()
    ops = OpThread("m0", OpMetrics(reg, None), lambda: 3)
    gate, seen = threading.Event(), []
    first = ops.submit(lambda: (gate.wait(10), seen.append(threading.current_thread().name), "a")[-1],
                       True, "allreduce", 64)
    second = ops.submit(lambda: seen.append(threading.current_thread().name) or "b", True)
    assert not first.is_completed() and not second.is_completed()   # the second waits behind the first
    gate.set()
    assert second.result() == "b" and first.result() == "a"
    assert len(set(seen)) == 1 and seen[0].startswith("resilient-ops:m0")
    assert reg.collectives == [("allreduce", 64)]   # only ops with a kind are timed
    ops.close()


def test_op_thread_failed_op_fails_its_work_is_not_timed_and_close_refuses_new_ops() -> None:
    reg = _Recorded()
    ops = OpThread("m1", OpMetrics(reg, None), lambda: 0)

    def boom() -> None:
        raise ConfigError("bad input")

    with pytest.raises(ConfigError, match="bad input"):
        ops.submit(boom, False, "broadcast", 8)      # synchronous: raised at once
    work = ops.submit(boom, True, "broadcast", 8)
    assert isinstance(work.exception(), ConfigError)
    assert reg.collectives == []
    assert ops.close() is True and ops.close() is False
    with pytest.raises(ClosedError, match="closed"):
        ops.submit(lambda: None, False)


def test_compressed_body_none_when_exact_and_config_error_off_cpu_and_cuda() -> None:
    """Choosing the body reads only ``comm.sizing`` (the body runs later); a tensor off the
    CPU is staged whole through the host, and a device with no staging path is refused."""
    comm = cast(Any, SimpleNamespace(sizing=Sizing()))
    t = torch.ones(64, 64)
    assert compressed_body(comm, t, ReduceOp.SUM, None, None) is None
    assert compressed_body(comm, t, ReduceOp.SUM, "fp32", None) is None
    small = torch.ones(8)   # 1-D: the layout leaves it uncompressed
    assert compressed_body(comm, small, ReduceOp.SUM, "q8", None) is None
    assert compressed_body(comm, t, ReduceOp.SUM, Compression(bits=4), None) is not None
    with pytest.raises(ConfigError, match="use CPU or CUDA tensors"):
        compressed_body(comm, torch.empty(64, 64, device="meta"), ReduceOp.SUM, "q4", None)
    with pytest.raises(ConfigError):
        compressed_body(comm, t, ReduceOp.SUM, "q99", None)
