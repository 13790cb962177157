"""Which data path an epoch's members use for CUDA tensors: host-staged or NCCL.

One responsibility: the pure decision, from one :class:`DeviceRecord` per member, with
the reason string the communicator logs. The rule:

* every member on the CPU -> ``tcp`` (today's path: TCP/shared memory, no staging);
* NCCL needs **every** member to have its **own** GPU: all members on CUDA, each with a
  known GPU UUID, no UUID twice (NCCL refuses two ranks on one GPU), every member able to
  load NCCL, more than one member, and NCCL not switched off (``prefer``) -> ``nccl``;
* otherwise -> ``host-staged`` (pinned host buffers over TCP/shared memory; works for any
  mix, including several ranks sharing one GPU), with the first reason NCCL is out.

``prefer="host-staged"`` forces staging; ``prefer="nccl"`` demands NCCL and raises
:class:`~resilient.errors.ConfigError` with the reason when it is impossible.

Records come from a member's own description (its member record's ``host``/``device``
and the :data:`UUID_LABEL` label) or from the small JSON record of
:meth:`DeviceRecord.to_json`. Failure behaviour: a malformed record raises
:class:`~resilient.errors.RecordError` naming the member and field (never pickle; every
field validated); nothing else raises except the ``prefer`` cases above.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Literal, Mapping, Sequence

from resilient.errors import ConfigError, RecordError

#: member-record label carrying the GPU UUID of a member on CUDA
UUID_LABEL = "resilient.gpu-uuid"
#: member-record label saying whether the member can load NCCL: ``"1"`` or ``"0"``
NCCL_LABEL = "resilient.nccl"
TransportKind = Literal["tcp", "host-staged", "nccl"]
Preference = Literal["auto", "host-staged", "nccl"]

_NAME = re.compile(r"^[A-Za-z0-9._:@/+-]{1,255}$")
_UUID = re.compile(r"^(GPU-|MIG-)?[0-9A-Fa-f-]{8,64}$")
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]{1,4})?)$")


@dataclass(frozen=True)
class DeviceRecord:
    """Where one member's tensors live: ``device`` ``cpu`` or ``cuda[:N]``, ``gpu_uuid``
    (CUDA only; None when unknown), whether it can load NCCL."""

    member: str
    host: str
    device: str
    gpu_uuid: str | None = None
    nccl: bool = False

    def __post_init__(self) -> None:
        where = f"device record of member {self.member!r}"
        for name, value in (("member", self.member), ("host", self.host)):
            if not isinstance(value, str) or not _NAME.match(value):
                raise RecordError(f"{where}: {name} {value!r} is not a name of 1..255 characters [A-Za-z0-9._:@/+-]",
                                  kind="device", key=name)
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise RecordError(f"{where}: device {self.device!r} is neither 'cpu' nor 'cuda[:N]'", kind="device", key="device")
        if self.gpu_uuid is not None and (not isinstance(self.gpu_uuid, str) or not _UUID.match(self.gpu_uuid)):
            raise RecordError(f"{where}: gpu_uuid {self.gpu_uuid!r} is not a GPU UUID (hex digits and dashes)",
                              kind="device", key="gpu_uuid")
        if self.gpu_uuid is not None and not self.on_cuda:
            raise RecordError(f"{where}: a gpu_uuid on a {self.device} member: report it only for CUDA",
                              kind="device", key="gpu_uuid")
        if not isinstance(self.nccl, bool):
            raise RecordError(f"{where}: nccl must be true or false, got {self.nccl!r}", kind="device", key="nccl")

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def from_member(cls, member: str, host: str, device: str, labels: Mapping[str, str],
                    nccl: bool | None = None) -> "DeviceRecord":
        """From a member record's fields: ``labels[UUID_LABEL]`` is the GPU UUID,
        ``labels[NCCL_LABEL]`` (``"1"``/``"0"``, absent: ``"0"``) whether NCCL loads there
        (``nccl`` given: that instead). RecordError naming the member and label on any
        other value."""
        if nccl is not None:
            return cls(member, host, device, labels.get(UUID_LABEL), nccl)
        flag = labels.get(NCCL_LABEL, "0")
        if flag not in ("0", "1"):
            raise RecordError(f"device record of member {member!r}: label {NCCL_LABEL}={flag!r} must be '1' or '0'",
                              kind="device", key=NCCL_LABEL)
        return cls(member, host, device, labels.get(UUID_LABEL), flag == "1")

    def labels(self) -> dict[str, str]:
        """The member-record labels that carry this record (:meth:`from_member` reads them;
        none for a CPU member, whose record is its ``device`` alone)."""
        if not self.on_cuda:
            return {}
        out = {NCCL_LABEL: "1" if self.nccl else "0"}
        if self.gpu_uuid is not None:
            out[UUID_LABEL] = self.gpu_uuid
        return out

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "DeviceRecord":
        """Parse and validate :meth:`to_json`'s output; :class:`RecordError` if malformed."""
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise RecordError(f"a device record is not UTF-8 JSON ({exc}); re-publish it with to_json()",
                              kind="device") from None
        if not isinstance(obj, dict) or set(obj) != {"member", "host", "device", "gpu_uuid", "nccl"}:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise RecordError(f"a device record must be an object with member, host, device, gpu_uuid, nccl; got {got}",
                              kind="device")
        return cls(obj["member"], obj["host"], obj["device"], obj["gpu_uuid"], obj["nccl"])


@dataclass(frozen=True)
class TransportChoice:
    """The decision and why (one line for the logs)."""

    kind: TransportKind
    reason: str


def _why_not_nccl(records: Sequence[DeviceRecord]) -> str | None:
    """The first reason NCCL cannot carry this epoch (None: it can)."""
    if len(records) < 2:
        return "a single member: nothing crosses a link"
    on_cpu = sorted(r.member for r in records if not r.on_cuda)
    if on_cpu:
        return f"members {', '.join(on_cpu)} have CPU tensors (NCCL needs every member on its own GPU)"
    unknown = sorted(r.member for r in records if r.gpu_uuid is None)
    if unknown:
        return f"members {', '.join(unknown)} did not report their GPU UUID (label {UUID_LABEL})"
    counts = Counter(r.gpu_uuid for r in records)
    shared = sorted(u for u, n in counts.items() if n > 1 and u is not None)
    if shared:
        u = shared[0]
        who = sorted(f"{r.member}@{r.host}" for r in records if r.gpu_uuid == u)
        more = f" (and {len(shared) - 1} more shared GPU(s))" if len(shared) > 1 else ""
        return f"{len(who)} members share GPU {u}: {', '.join(who)}{more}; NCCL refuses two ranks on one GPU"
    no_nccl = sorted(r.member for r in records if not r.nccl)
    if no_nccl:
        return f"members {', '.join(no_nccl)} cannot load NCCL (pip install -e '.[gpu]')"
    return None


def choose_transport(records: Sequence[DeviceRecord], prefer: Preference = "auto") -> TransportChoice:
    """The data path for one epoch (see the module docstring). ``records``: one per member.

    Raises :class:`ConfigError` for an empty or duplicated member list, an unknown
    ``prefer``, or ``prefer="nccl"`` where NCCL is impossible (the reason says why)."""
    if prefer not in ("auto", "host-staged", "nccl"):
        raise ConfigError(f"unknown transport preference {prefer!r}: use auto, host-staged or nccl")
    if not records:
        raise ConfigError("choose_transport needs one device record per member, got none")
    dup = sorted(m for m, n in Counter(r.member for r in records).items() if n > 1)
    if dup:
        raise ConfigError(f"members {', '.join(dup)} have more than one device record: pass one per member")
    if not any(r.on_cuda for r in records):
        if prefer == "nccl":
            raise ConfigError("NCCL was demanded but every member has CPU tensors: use the CPU path (prefer='auto')")
        return TransportChoice("tcp", f"all {len(records)} members have CPU tensors")
    why = _why_not_nccl(records)
    if prefer == "nccl" and why is not None:
        raise ConfigError(f"NCCL was demanded but cannot be used: {why}; use prefer='auto' or 'host-staged'")
    if prefer == "host-staged":
        return TransportChoice("host-staged", "host staging requested (prefer='host-staged')")
    if why is not None:
        return TransportChoice("host-staged", f"host-staged: {why}")
    hosts = len({r.host for r in records})
    return TransportChoice("nccl", f"nccl: each of the {len(records)} members has its own GPU "
                                   f"({len(records)} distinct UUIDs on {hosts} host(s))")
