"""Member ids of a chaos run: member index ``i`` is member id ``m<i>`` in etcd, in the
transport's shaping specs and in the records. Pure; :func:`member_index` raises
``ValueError`` for an id that is not ``m<digits>``."""
from __future__ import annotations


def member_id(index: int) -> str:
    return f"m{index}"


def member_index(mid: str) -> int:
    if not (mid.startswith("m") and mid[1:].isdigit()):
        raise ValueError(f"not a chaos member id (m<index>): {mid!r}")
    return int(mid[1:])
