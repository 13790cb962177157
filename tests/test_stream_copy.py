"""The streaming copy (kernels/copy.py over the optional C extension kernels/stream_copy.c):
every byte lands, nothing outside the destination changes, what it cannot stream is
torch's ``copy_``, and the package still installs and copies without a C compiler."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from resilient.kernels import copy as stream

ROOT = Path(__file__).resolve().parents[1]
GUARD = 256
needs_ext = pytest.mark.skipif(not stream.STREAMING, reason="the C extension is not built in this environment")


def test_the_extension_is_built_where_a_compiler_is():
    """`make setup` installs the package with a C compiler on PATH here: the streaming
    copy must then be the one in use (a silently failed build would cost every large op)."""
    if platform.machine() != "x86_64" or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler or not x86-64: the fallback is the expected state")
    assert stream.STREAMING, "kernels/stream_copy.c was not built: run `pip install -e .` again and read its warning"


def _field(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@needs_ext
@given(n=st.integers(0, 700), d_off=st.integers(0, 127), s_off=st.integers(0, 127), seed=st.integers(0, 1 << 30))
@settings(max_examples=300, deadline=None)
def test_the_c_copy_writes_exactly_the_destination_at_any_alignment(n, d_off, s_off, seed):
    """Head (up to a 64-byte line), streamed body and tail: every byte copied, the
    guard bytes on both sides of the destination untouched."""
    src = _field(n + s_off + 1, seed)
    dst = _field(n + d_off + 2 * GUARD, seed + 1)
    before = dst.clone()
    at = GUARD + d_off
    stream._stream_copy.copy(dst.data_ptr() + at, src.data_ptr() + s_off, n)
    assert torch.equal(dst[at:at + n], src[s_off:s_off + n])
    assert torch.equal(dst[:at], before[:at]) and torch.equal(dst[at + n:], before[at + n:])


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.uint8])
@pytest.mark.parametrize("extra", [0, 1, 63, 4097])
def test_copy_into_streams_large_tensors_exactly(dtype, extra):
    n = stream.MIN_BYTES // torch.tensor([], dtype=dtype).element_size() + extra
    src = torch.randn(n).to(dtype) if dtype.is_floating_point else torch.randint(0, 100, (n,), dtype=dtype)
    big = torch.zeros(n + 3, dtype=dtype)
    dst = big[1:n + 1]   # not 64-byte aligned
    v0 = dst._version
    stream.copy_into(dst, src)
    assert torch.equal(dst, src) and big[0] == 0 and big[n + 1:].eq(0).all()
    assert dst._version > v0, "a streamed copy must bump the version counter like copy_"


@pytest.mark.parametrize("case", ["small", "strided", "dtype", "overlap", "shape"])
def test_what_cannot_stream_is_torchs_copy(case):
    """Each case gives exactly ``copy_``'s result or error (a conversion, a strided view,
    an overlapping move, another shape), with or without the extension."""
    n = stream.MIN_BYTES // 4 + 8
    src = torch.arange(n, dtype=torch.float32)
    if case == "small":
        dst, src = torch.zeros(16), src[:16]
    elif case == "strided":
        dst, src = torch.zeros(2 * n)[::2], src
    elif case == "dtype":
        dst = torch.zeros(n, dtype=torch.float64)
    elif case == "overlap":
        buf = torch.arange(n + 8, dtype=torch.float32)
        with pytest.raises(RuntimeError, match="single memory location"):
            buf[8:].copy_(buf[:n])
        with pytest.raises(RuntimeError, match="single memory location"):
            stream.copy_into(buf[8:], buf[:n])   # never streamed over its own source
        assert torch.equal(buf, torch.arange(n + 8, dtype=torch.float32))
        return
    else:   # same numel, other shape: copy_ broadcasts or raises, never reinterprets
        dst = torch.zeros(2, n // 2)
        with pytest.raises(RuntimeError):
            torch.zeros(2, n // 2).copy_(src)
        with pytest.raises(RuntimeError):
            stream.copy_into(dst, src)
        return
    want = dst.clone().copy_(src)
    stream.copy_into(dst, src)
    assert torch.equal(dst, want)


def test_a_tensor_that_requires_grad_gets_copys_error():
    dst = torch.zeros(stream.MIN_BYTES // 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        stream.copy_into(dst, torch.ones(stream.MIN_BYTES // 4))


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_the_setting_switches_streaming_off_and_a_bad_value_names_itself():
    probe = ("from resilient.kernels import copy as c; import torch; a = torch.ones(1 << 20); b = torch.zeros(1 << 20);"
             "c.copy_into(b, a); assert torch.equal(a, b); print(c.enabled())")
    off = _child(probe, RESILIENT_STREAM_COPY="0")
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr
    on = _child(probe, RESILIENT_STREAM_COPY="1")
    assert on.returncode == 0 and on.stdout.strip() == str(stream.STREAMING), on.stderr
    bad = _child(probe, RESILIENT_STREAM_COPY="maybe")
    assert bad.returncode != 0 and "RESILIENT_STREAM_COPY" in bad.stderr


def test_without_the_extension_copies_are_torchs():
    code = ("import sys; sys.modules['resilient.kernels._stream_copy'] = None\n"
            "from resilient.kernels import copy as c; import torch\n"
            "a = torch.arange(1 << 20, dtype=torch.float32); b = torch.zeros(1 << 20)\n"
            "c.copy_into(b, a); assert torch.equal(a, b) and not c.STREAMING and not c.enabled(); print('ok')")
    r = _child(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_setup_still_builds_without_a_c_compiler(tmp_path):
    """The extension is optional: with a compiler that fails, `build_ext` warns and
    succeeds (so `pip install -e .` on a machine without gcc installs the rest)."""
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "kernels").mkdir()
    for c in ("stream_copy.c", "qcodec.c"):   # both extensions are optional
        shutil.copy(ROOT / "kernels" / c, tmp_path / "kernels" / c)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "out")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CC": "false", "LDSHARED": "false"})
    assert r.returncode == 0, r.stdout + r.stderr
    for mod in ("_stream_copy", "_qcodec"):
        assert not list((tmp_path / "out").rglob(f"{mod}*")), "a failed compile must leave no module"
        assert f'building extension "resilient.kernels.{mod}" failed' in r.stdout + r.stderr   # and says so


@needs_ext
def test_inference_tensors_stream_too():
    """Under ``torch.inference_mode`` (no version counters) the streamed copy works like ``copy_``."""
    n = stream.MIN_BYTES // 4
    with torch.inference_mode():
        src, dst = torch.arange(n, dtype=torch.float32), torch.zeros(n)
        assert dst.is_inference()
        stream.copy_into(dst, src)
    assert torch.equal(dst, src)


@needs_ext
@given(n=st.integers(0, 700), d_off=st.integers(0, 127), d2_off=st.integers(0, 127), s_off=st.integers(0, 127),
       seed=st.integers(0, 1 << 30))
@settings(max_examples=300, deadline=None)
def test_the_two_destination_copy_writes_both_exactly(n, d_off, d2_off, s_off, seed):
    """``copy2``: both destinations get every byte and nothing beside them changes, at
    equal offsets modulo 16 (one streamed pass) and at unequal ones (two copies)."""
    src = _field(n + s_off + 1, seed)
    dst, dst2 = _field(n + d_off + 2 * GUARD, seed + 1), _field(n + d2_off + 2 * GUARD, seed + 2)
    b1, b2 = dst.clone(), dst2.clone()
    at1, at2 = GUARD + d_off, GUARD + d2_off
    stream._stream_copy.copy2(dst.data_ptr() + at1, dst2.data_ptr() + at2, src.data_ptr() + s_off, n)
    for d, b, at in ((dst, b1, at1), (dst2, b2, at2)):
        assert torch.equal(d[at:at + n], src[s_off:s_off + n])
        assert torch.equal(d[:at], b[:at]) and torch.equal(d[at + n:], b[at + n:])


@pytest.mark.parametrize("min_bytes", [0, stream.MIN_BYTES])
@pytest.mark.parametrize("layout", ["aligned", "misaligned-pair", "strided-second"])
def test_copy_into_two_destinations(min_bytes, layout):
    """``also``: both get ``src``, whether the pair streams in one pass (aligned alike),
    in two (4 bytes apart modulo 16), or a destination cannot stream at all."""
    n = stream.MIN_BYTES // 4 + 5
    src = torch.randn(n)
    if layout == "aligned":
        dst, also = torch.zeros(n), torch.zeros(n)
    elif layout == "misaligned-pair":
        dst, also = torch.zeros(n), torch.zeros(n + 1)[1:]
    else:
        dst, also = torch.zeros(n), torch.zeros(2 * n)[::2]
    v0, v1 = dst._version, also._version
    stream.copy_into(dst, src, also, min_bytes=min_bytes)
    assert torch.equal(dst, src) and torch.equal(also, src)
    assert dst._version > v0 and also._version > v1
