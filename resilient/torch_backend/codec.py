"""A pickle-free wire format for state dicts (model, optimizer, user fields).

``encode(obj) -> bytes`` accepts nested dicts (any hashable scalar keys: str, int, float,
bool, None), lists, tuples, str, int, float, bool, None and CPU tensors; ``decode(bytes)``
rebuilds it. Layout: 8-byte little-endian header length, a JSON header (the structure,
with tensors replaced by ``{"__t__": i}`` and a table of dtype/shape/offset), then the raw
tensor bytes. Nothing is unpickled: data that came over the network is only parsed as
JSON and copied into freshly allocated tensors. A malformed payload raises
:class:`~resilient.errors.FrameError` naming what is wrong; an unsupported object type in
``encode`` raises :class:`~resilient.errors.ConfigError` naming its path.
"""
from __future__ import annotations

import json
import struct
from typing import Any

import torch

from resilient.errors import ConfigError, FrameError

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)}


_ALIGN = 64  # tensor offsets in the payload are multiples of this (typed views need aligned storage)


def split(obj: Any) -> tuple[bytes, list[torch.Tensor], int]:
    """Serialise ``obj``'s structure only: returns ``(header, tensors, nbytes)`` where
    ``header`` is the JSON header :func:`encode` writes, ``tensors`` the (CPU, contiguous)
    tensors whose bytes follow it, in order, at the header's offsets, and ``nbytes`` the
    size of that tensor area. For streaming a state without building one big payload
    (``resilient.elastic``). Unsupported objects raise ConfigError naming their path."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                x = x.cpu()
            if str(x.dtype).replace("torch.", "") not in _DTYPES:
                raise ConfigError(f"state at {path}: tensor dtype {x.dtype} is not supported by the state codec")
            tensors.append(x.detach().contiguous())
            return {"__t__": len(tensors) - 1}
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise ConfigError(f"state at {path}: dict key {k!r} of type {type(k).__name__} is not supported")
                items.append([k, walk(v, f"{path}.{k}")])
            return {"__d__": items}
        if isinstance(x, tuple):
            return {"__u__": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if x is None or isinstance(x, (str, int, float, bool)):
            return x
        raise ConfigError(f"state at {path}: objects of type {type(x).__name__} cannot be synced; keep tensors, "
                          "numbers, strings, lists and dicts in State fields (or give the object state_dict()/"
                          "load_state_dict())")

    structure = walk(obj, "state")
    table, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        table.append([str(t.dtype).replace("torch.", ""), list(t.shape), offset, n])
        offset += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    header = json.dumps({"s": structure, "t": table}, separators=(",", ":")).encode()
    return header, tensors, offset


def pack_into(header: bytes, tensors: list[torch.Tensor], area: torch.Tensor) -> None:
    """Copy ``tensors`` (from :func:`split`) into ``area`` (a uint8 tensor of at least
    ``nbytes``) at the header's offsets: one memory copy per tensor, nothing else."""
    table = json.loads(header)["t"]
    for t, (_, _, off, n) in zip(tensors, table):
        if n:
            area[off:off + n].copy_(t.reshape(-1).view(torch.uint8))


def encode(obj: Any) -> bytes:
    """Serialise ``obj`` (see the module docstring)."""
    header, tensors, nbytes = split(obj)
    out = torch.zeros(8 + len(header) + nbytes, dtype=torch.uint8)
    raw = out.numpy()
    raw[:8] = memoryview(struct.pack("<Q", len(header)))
    raw[8:8 + len(header)] = memoryview(header)
    pack_into(header, tensors, out[8 + len(header):])
    return raw.tobytes()


#: Largest JSON header accepted, and most dimensions of one tensor.
MAX_HEADER_BYTES = 64 << 20
MAX_NDIM = 64
#: Largest element count of one tensor (zero-sized dimensions counted as 1), so that
#: shape and stride arithmetic cannot overflow 64 bits.
MAX_NUMEL = 2 ** 62


def _is_count(v: Any, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi


def _tensor_entry(entry: Any, base: int, total: int) -> tuple[torch.dtype, list[int], int, int]:
    """Check one tensor table entry *before* anything is allocated: known dtype, a
    shape of at most :data:`MAX_NDIM` non-negative dimensions, and a byte range
    ``[off, off + n)`` inside the payload with ``n`` = numel * element size exactly."""
    if not isinstance(entry, list) or len(entry) != 4:
        raise FrameError(f"state payload has a bad tensor entry {entry!r:.200}")
    dtype_name, shape, off, n = entry
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise FrameError(f"state payload tensor has an unknown dtype {dtype_name!r:.80}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_count(d, MAX_NUMEL) for d in shape):
        raise FrameError(f"state payload tensor has a bad shape {shape!r:.200} (at most {MAX_NDIM} "
                         "non-negative integer dimensions)")
    if not _is_count(off, total) or not _is_count(n, total) or base + off + n > total:
        raise FrameError(f"state payload tensor at offset {off!r:.40} (+{n!r:.40}) runs past the end "
                         f"({total} bytes)")
    numel, bound = 1, 1
    for d in shape:
        numel *= d
        bound *= max(d, 1)
        if bound > MAX_NUMEL:
            raise FrameError(f"state payload tensor shape {shape!r:.200} has more than 2**62 elements")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != n:
        raise FrameError(f"state payload tensor {dtype_name}{shape} does not have {n} bytes")
    return dtype, shape, off, n


def decode(payload: bytes | bytearray | memoryview) -> Any:
    """Rebuild what :func:`encode` serialised (see the module docstring). Every size in
    the header is checked against the payload's length (and :data:`MAX_HEADER_BYTES`,
    :data:`MAX_NDIM`, :data:`MAX_NUMEL`) before a tensor is allocated, so a hostile
    payload can make this allocate no more than its own length; it raises
    :class:`~resilient.errors.FrameError` and nothing else."""
    buf = memoryview(payload).cast("B")
    if len(buf) < 8:
        raise FrameError(f"state payload too short ({len(buf)} bytes)")
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if 8 + hlen > len(buf) or hlen > MAX_HEADER_BYTES:
        raise FrameError(f"state payload header length {hlen} exceeds the payload ({len(buf)} bytes) "
                         f"or {MAX_HEADER_BYTES} bytes")
    area = torch.frombuffer(bytearray(buf[8 + hlen:]), dtype=torch.uint8) if len(buf) > 8 + hlen else \
        torch.zeros(0, dtype=torch.uint8)
    return assemble(bytes(buf[8:8 + hlen]), area)


def assemble(header: bytes, area: torch.Tensor) -> Any:
    """Rebuild the object from a :func:`split` header and its tensor area (a uint8 tensor;
    the tensors returned are views of it, no copy). Every entry is checked against the
    area's length before anything is allocated (:func:`_tensor_entry`); a malformed header
    or an area too short for its table raises FrameError and nothing else."""
    if len(header) > MAX_HEADER_BYTES:
        raise FrameError(f"state payload header of {len(header)} bytes exceeds {MAX_HEADER_BYTES} bytes")
    try:
        parsed = json.loads(header)
        structure, table = parsed["s"], parsed["t"]
        if not isinstance(table, list):
            raise TypeError("the tensor table is not a list")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise FrameError(f"state payload header is not valid: {type(exc).__name__}: {exc}") from None
    tensors = []
    for entry in table:
        dtype, shape, off, n = _tensor_entry(entry, 0, area.numel())
        if off % _ALIGN == 0:
            t = area[off:off + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
        else:  # an unaligned offset (not written by split): copy out
            t = torch.empty(shape, dtype=dtype)
            if n:
                t.reshape(-1).view(torch.uint8).copy_(area[off:off + n])
        tensors.append(t)

    def build(x: Any) -> Any:
        if isinstance(x, dict):
            if "__t__" in x:
                return tensors[int(x["__t__"])]
            if "__d__" in x:
                return {k: build(v) for k, v in x["__d__"]}
            if "__u__" in x:
                return tuple(build(v) for v in x["__u__"])
            raise FrameError(f"state payload has an unknown node {sorted(x)}")
        if isinstance(x, list):
            return [build(v) for v in x]
        return x

    try:
        return build(structure)
    except (IndexError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise FrameError(f"state payload structure is not valid: {type(exc).__name__}: {exc}") from None
