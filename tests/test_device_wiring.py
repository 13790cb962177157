"""How the collectives pick their data path per tensor device (pure logic, no sockets):
which ops stage through the host, which algorithms may stage (the others run on whole
host copies), and the torch backend's device registration. A CUDA tensor cannot be made
on a machine without a GPU: the CUDA branches are reached through the device object."""
from __future__ import annotations

import pytest
import torch

from resilient.collectives.algorithms import select
from resilient.collectives.algorithms.base import Capabilities, OpContext
from resilient.collectives.algorithms.chain import ChainBroadcastWithBarrier
from resilient.collectives.algorithms.recursive_doubling import RecursiveDoubling
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.ledger import Ledger
from resilient.collectives.ops import as_tensor, ledger_on_device, on_device
from resilient.device import CpuOps
from resilient.errors import ConfigError
from resilient.settings import Settings

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


class NotStaged:
    """An algorithm without the staged capability (as the leaf and hierarchical paths)."""

    capabilities = Capabilities()

    def run(self, ctx: OpContext) -> None:
        raise AssertionError("not run in these tests")

    def final_order(self, n_members: int, index: int, n_pieces: int) -> list[int]:
        return list(range(n_pieces))


def ledger(numel: int = 1000, dtype: torch.dtype = torch.float64) -> Ledger:
    return Ledger(3, "allreduce", ("a", "b"), 0, 1, 0, torch.zeros(numel, dtype=dtype),
                  torch.zeros(numel, dtype=dtype), [(0, numel)])


def test_cpu_ops_go_direct_unless_staging_is_forced_and_cuda_ops_always_stage():
    plain, forced = select.Sizing(), select.Sizing(staging=True, stage_bytes=4096)
    assert plain.stage_elems(CPU, 8) == 0
    assert forced.stage_elems(CPU, 8) == 512 and forced.stage_elems(CPU, 3) == 1365
    assert plain.stage_elems(CUDA, 4) == (1 << 20) // 4      # CUDA stages whatever the setting
    assert plain.for_device(CPU) is plain
    assert plain.for_device(CUDA).hierarchical is False and plain.for_device(CUDA).small_bytes == plain.small_bytes


@pytest.mark.parametrize("algo", [RingReduceScatterAllgather(2), RecursiveDoubling(), ChainBroadcastWithBarrier(0, 1)])
def test_the_flat_algorithms_stage_when_forced(algo):
    L, got = ledger_on_device(ledger(), algo, CPU, select.Sizing(staging=True, stage_bytes=800))
    assert got is algo and isinstance(L.ops, CpuOps) and L.stage_elems == 100


def test_an_algorithm_that_cannot_stage_runs_on_whole_host_copies_when_staged():
    from resilient.device.whole import COUNTS

    plain = ledger()
    inp, out = plain.inp, plain.out
    L, _ = ledger_on_device(plain, NotStaged(), CPU, select.Sizing())
    assert L.stage_elems == 0 and L.inp is inp and L.out is out          # plain CPU: direct
    forced = ledger()
    forced.inp.copy_(torch.arange(1000, dtype=torch.float64))
    before, caller_inp = COUNTS.d2h, forced.inp
    L, _ = ledger_on_device(forced, NotStaged(), CPU, select.Sizing(staging=True))
    assert L.stage_elems == 0 and isinstance(L.ops, CpuOps) and COUNTS.d2h == before + 2
    assert L.inp is not caller_inp and torch.equal(L.inp, torch.arange(1000, dtype=torch.float64))


def test_a_tensor_on_another_device_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"on meta; the communicator takes CPU or CUDA tensors: move it with \.cpu\(\)"):
        as_tensor(torch.empty(3, device="meta"), "allreduce tensor")
    t = torch.ones(3)
    assert as_tensor(t, "x") is t


def test_a_cpu_op_body_is_run_as_is():
    def body() -> object:
        raise AssertionError("not called")
    assert on_device(torch.ones(1), body) is body   # type: ignore[arg-type]


def test_resilient_staging_setting():
    assert Settings.from_env({}).staging is False
    assert Settings.from_env({"RESILIENT_STAGING": "1"}).staging is True
    with pytest.raises(ConfigError, match="RESILIENT_STAGING"):
        Settings.from_env({"RESILIENT_STAGING": "maybe"})


def test_the_torch_backend_registers_cuda_and_names_what_takes_cuda_tensors():
    import torch.distributed as dist

    import resilient  # noqa: F401 - registers the backend
    from resilient.torch_backend.process_group import CUDA_OPS, UnsupportedOperation, _check_cpu

    assert dist.Backend.backend_capability["resilient"] == ["cpu", "cuda"]
    with pytest.raises(UnsupportedOperation, match="CUDA tensors are supported by all_reduce") as info:
        _check_cpu([torch.empty(2, device="meta")], "gather")
    assert CUDA_OPS in str(info.value)
    with pytest.raises(UnsupportedOperation, match="use CPU or CUDA tensors"):
        _check_cpu([torch.empty(2, device="meta")], "all_reduce", cuda=True)
    _check_cpu([torch.ones(2)], "all_reduce", cuda=True)   # CPU is always fine
