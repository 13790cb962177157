"""The device-generic buffer operations (resilient.device): CPU implementation and the
CUDA implementation's behaviour where CUDA is missing. No GPU needed."""
from __future__ import annotations

import pytest
import torch

from resilient.device import CpuOps, CudaOps, DeviceOps, device_ops
from resilient.device.ops import COMPLETED
from resilient.errors import ConfigError


def test_cpu_ops_are_the_device_ops_of_cpu_tensors():
    ops = device_ops("cpu")
    assert isinstance(ops, CpuOps) and isinstance(ops, DeviceOps)
    assert ops.device == torch.device("cpu")


def test_accumulator_pieces_share_memory_and_reduce_then_mark():
    ops = CpuOps()
    acc = ops.empty(10, torch.float32)
    acc.fill_(1.0)
    red = ops.reducer(2)
    a, b = ops.view(acc, 0, 4), ops.view(acc, 4, 10)
    ops.reduce(red, 1, b, torch.full((6,), 2.0), "sum", mark=7)
    assert acc.tolist() == [1.0] * 4 + [3.0] * 6
    assert red.marks.finished(mark=7) == (1,)
    ops.reduce(red, 0, a, torch.full((4,), 5.0), "max", mark=7, after=COMPLETED)
    assert acc[:4].tolist() == [5.0] * 4 and red.marks.finished(mark=7) == (0, 1)


def test_failed_reduction_leaves_data_and_mark_alone():
    ops = CpuOps()
    acc = torch.zeros(4)
    red = ops.reducer(1)
    with pytest.raises(ConfigError):
        ops.reduce(red, 0, acc, torch.zeros(4, dtype=torch.float64), "sum", mark=1)
    assert red.marks.finished() == () and acc.tolist() == [0.0] * 4


def test_host_copies_are_synchronous_and_exact():
    ops = CpuOps()
    src = torch.arange(8, dtype=torch.int64)
    stage = ops.host_buffer(8, torch.int64)
    ev = ops.to_host(stage, src)
    assert ev.done() and torch.equal(stage, src)
    dst = ops.empty(8, torch.int64)
    assert ops.from_host(dst, stage).done() and torch.equal(dst, src)
    other = torch.zeros(8, dtype=torch.int64)
    ops.copy(other, src)
    assert torch.equal(other, src)


@pytest.mark.parametrize("start, end", [(-1, 2), (3, 2), (0, 11)])
def test_views_outside_the_buffer_are_refused(start, end):
    with pytest.raises(ConfigError, match="outside the buffer of 10"):
        CpuOps().view(torch.zeros(10), start, end)


def test_non_flat_buffers_and_mismatched_copies_are_refused():
    ops = CpuOps()
    with pytest.raises(ConfigError, match="flat contiguous"):
        ops.view(torch.zeros(2, 5), 0, 1)
    with pytest.raises(ConfigError, match="same size and dtype"):
        ops.to_host(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ConfigError, match="same size and dtype"):
        ops.copy(torch.zeros(3), torch.zeros(3, dtype=torch.int32))


def test_unsupported_device_types_are_refused():
    with pytest.raises(ConfigError, match="not supported"):
        device_ops("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device exists: bench/gpu_check.py covers CudaOps")
def test_cuda_ops_without_cuda_name_the_install_command():
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[gpu\]'"):
        CudaOps(0)
    with pytest.raises(ConfigError, match="GPU data path"):
        device_ops("cuda:0")
