"""Compile the CUDA sources of :mod:`resilient.kernels` with ``nvcc`` (no GPU needed).

At run time the sources are compiled by NVRTC through CuPy's ``RawModule`` (see
:mod:`resilient.kernels.cupy_impl`); this module is the ahead-of-time check that they are
valid CUDA for the architectures we target, used by ``tests/test_cuda_compile.py`` and
``bench/gpu_check.py``.

Failure behaviour: :func:`find_nvcc` returns ``None`` when ``nvcc`` is absent (callers skip
with that reason); a source that does not compile gives a :class:`CompileResult` with
``ok=False`` and nvcc's output, never an exception, so every failure is reported at once.
Each nvcc run is bounded by ``timeout`` seconds (a timed-out run is a failed result).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
DEFAULT_ARCHS: tuple[str, ...] = ("sm_80", "sm_90")


@dataclass(frozen=True)
class CompileResult:
    source: Path
    arch: str
    ok: bool
    output: str          # nvcc's stdout+stderr (warnings on success, errors on failure)
    seconds: float

    def describe(self) -> str:
        state = "ok" if self.ok else "FAILED"
        return f"{self.source.name} [{self.arch}] {state} in {self.seconds:.1f}s\n{self.output}".rstrip()


def cuda_sources(folder: Path = CUDA_DIR) -> list[Path]:
    """Every ``.cu`` file shipped with the kernels, sorted by name."""
    return sorted(folder.glob("*.cu"))


def find_nvcc() -> str | None:
    """Path of ``nvcc`` (PATH, then ``$CUDA_HOME/bin``, then /usr/local/cuda/bin), or None."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def compile_one(source: Path, arch: str, out_dir: Path, nvcc: str, timeout: float = 300.0) -> CompileResult:
    """``nvcc -cubin -arch=<arch>`` one source into ``out_dir``; never raises for nvcc errors."""
    import time

    out = out_dir / f"{source.stem}.{arch}.cubin"
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings", "-o", str(out), str(source)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        ok = proc.returncode == 0 and out.exists() and out.stat().st_size > 0
        output = (proc.stdout + proc.stderr).strip()
    except subprocess.TimeoutExpired:
        ok, output = False, f"nvcc did not finish within {timeout:.0f}s: {' '.join(cmd)}"
    return CompileResult(source, arch, ok, output, time.monotonic() - start)


def compile_all(
    sources: Iterable[Path] | None = None,
    archs: Sequence[str] = DEFAULT_ARCHS,
    jobs: int = 2,
    out_dir: Path | None = None,
    nvcc: str | None = None,
) -> list[CompileResult]:
    """Compile every (source, arch) pair, at most ``jobs`` nvcc processes at a time.

    Raises :class:`FileNotFoundError` naming the fix when ``nvcc`` cannot be found.
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found on PATH, $CUDA_HOME/bin or /usr/local/cuda/bin; install the CUDA toolkit")
    pairs = [(s, a) for s in (list(sources) if sources is not None else cuda_sources()) for a in archs]
    with tempfile.TemporaryDirectory(prefix="resilient-nvcc-") as tmp:
        target = out_dir or Path(tmp)
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(lambda p: compile_one(p[0], p[1], target, nvcc), pairs))
