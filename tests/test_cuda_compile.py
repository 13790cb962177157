"""Every CUDA source of resilient.kernels compiles with nvcc for sm_80 and sm_90.

Skipped only where nvcc is missing (with that reason). At most two nvcc processes run at
a time (the CI machine has two cores). The cubins are also checked for every exported
kernel name the CuPy loader asks for, so a dtype/op that is missing from the source
fails here and not on a GPU.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from resilient.kernels import ReduceOp
from resilient.kernels import nvcc as nvcc_mod
from resilient.kernels.cupy_impl import DTYPES, kernel_name

ARCHS = nvcc_mod.DEFAULT_ARCHS
SOURCES = nvcc_mod.cuda_sources()
NVCC = nvcc_mod.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[str, str], tuple[nvcc_mod.CompileResult, Path]]:
    out = tmp_path_factory.mktemp("cubin")
    results = nvcc_mod.compile_all(SOURCES, ARCHS, jobs=2, out_dir=out)
    return {(r.source.name, r.arch): (r, out / f"{r.source.stem}.{r.arch}.cubin") for r in results}


def test_sources_exist():
    names = {p.name for p in SOURCES}
    assert {"reduce.cu", "gate.cu"} <= names


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", [p.name for p in SOURCES])
def test_source_compiles_without_warnings(compiled, source, arch):
    result, cubin = compiled[(source, arch)]
    assert result.ok, result.describe()
    assert cubin.stat().st_size > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_reduce_cubin_exports_every_kernel_the_loader_uses(compiled, arch):
    _, cubin = compiled[("reduce.cu", arch)]
    data = cubin.read_bytes()
    names = {kernel_name(op, dt) for op in ReduceOp for dt in set(DTYPES.values())}
    assert len(names) == 4 * 6
    missing = sorted(n for n in names if n.encode() + b"\0" not in data)
    assert not missing, f"kernels missing from reduce.cu [{arch}]: {missing}"


def test_gate_cubin_exports_the_gate(compiled):
    _, cubin = compiled[("gate.cu", "sm_90")]
    assert b"resilient_wait_gate\0" in cubin.read_bytes()


def test_broken_source_is_reported_not_raised(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    (result,) = nvcc_mod.compile_all([bad], ("sm_80",), jobs=1, out_dir=tmp_path)
    assert not result.ok and "undefined_name" in result.output
