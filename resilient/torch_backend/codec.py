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
    struct.pack_into("<Q", raw, 0, len(header))
    raw[8:8 + len(header)] = memoryview(header)
    pack_into(header, tensors, out[8 + len(header):])
    return raw.tobytes()


def decode(payload: bytes | bytearray | memoryview) -> Any:
    """Rebuild what :func:`encode` serialised (see the module docstring)."""
    buf = memoryview(payload).cast("B")
    if len(buf) < 8:
        raise FrameError(f"state payload too short ({len(buf)} bytes)")
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if 8 + hlen > len(buf):
        raise FrameError(f"state payload header length {hlen} exceeds the payload ({len(buf)} bytes)")
    area = torch.frombuffer(bytearray(buf[8 + hlen:]), dtype=torch.uint8) if len(buf) > 8 + hlen else \
        torch.zeros(0, dtype=torch.uint8)
    return assemble(bytes(buf[8:8 + hlen]), area)


def assemble(header: bytes, area: torch.Tensor) -> Any:
    """Rebuild the object from a :func:`split` header and its tensor area (a uint8 tensor;
    the tensors returned are views of it, no copy). A malformed header or an area too short
    for its table raises FrameError."""
    try:
        parsed = json.loads(header)
        structure, table = parsed["s"], parsed["t"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FrameError(f"state payload header is not valid: {exc}") from None
    tensors = []
    for entry in table:
        try:
            dtype_name, shape, off, n = entry
            dtype = _DTYPES[dtype_name]
            count = 1
            for d in shape:
                count *= int(d)
        except (ValueError, KeyError, TypeError):
            raise FrameError(f"state payload has a bad tensor entry {entry!r}") from None
        if not isinstance(off, int) or not isinstance(n, int) or off < 0 or n < 0 or off + n > area.numel():
            raise FrameError(f"state payload tensor at offset {off} (+{n}) runs past the end")
        if count < 0 or count * torch.empty(0, dtype=dtype).element_size() != n:
            raise FrameError(f"state payload tensor {dtype_name}{shape} does not have {n} bytes")
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
    except (IndexError, TypeError, ValueError) as exc:
        raise FrameError(f"state payload structure is not valid: {exc}") from None
