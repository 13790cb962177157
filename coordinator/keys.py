"""The keyspace of one job, all under ``/resilient/<job>/`` (docs/design.md §2).

==============================  ===============================================  ==========
key                             value                                            lease
==============================  ===============================================  ==========
``members/<member_id>``         JSON :class:`~.membership.MemberInfo` + state    member's
``health/<member_id>``          JSON health record (:mod:`.health`)              member's
``suspects/<suspect>/<reporter>`` JSON {reason, at}: a peer's suspicion           none
``departed/<member_id>``        JSON {lease, reason, at}: written just before    none
                                a node agent revokes a member's lease
``epoch``                       JSON :class:`~.epoch.Epoch` (the current one)    none
``epochs/<n>/epoch``            the same JSON, kept for history                  none
``epochs/<n>/data/<name>/<m>``  raw bytes put by member ``m`` (rendezvous)       none
``leader``                      coordinator id of the leader                     leader's
``nodes/<node_id>``             JSON node record: one agent's ranks              node's
                                (:mod:`.directory`, docs/scale.md)
``snapshots/<n>/meta|<i>``      a chunked snapshot of epoch n's state            none
                                (:mod:`.delta`)
==============================  ===============================================  ==========

Only the coordinator leader writes ``epoch`` and ``epochs/<n>/epoch``; it deletes consumed
``suspects/`` and ``departed/`` entries and the data of epochs older than
:data:`EPOCHS_KEPT` in the same transaction that publishes an epoch.
"""
from __future__ import annotations

import re

from resilient.errors import ConfigError

ROOT = "/resilient"
EPOCHS_KEPT = 8
#: a whole job/member/data name (matched with ``fullmatch``: no trailing newline slips through)
_NAME = NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid job/member/data name, else raise ConfigError.

    The whole string must match (``fullmatch``): ``"ok\\n"``, ``"x/../y"`` and names with
    a ``/`` are refused, so no name can step outside its job's prefix."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(
            f"invalid {kind} {value!r}: use 1-128 characters from letters, digits, '.', '_' "
            f"and '-', starting with a letter or digit (it becomes part of etcd keys)"
        )
    return value


def root(job: str) -> str:
    return f"{ROOT}/{check_name('job name', job)}/"


def members(job: str) -> str:
    return root(job) + "members/"


def member(job: str, member_id: str) -> str:
    return members(job) + check_name("member id", member_id)


def health(job: str) -> str:
    return root(job) + "health/"


def health_of(job: str, member_id: str) -> str:
    return health(job) + check_name("member id", member_id)


def suspects(job: str) -> str:
    return root(job) + "suspects/"


def suspect(job: str, suspect_id: str, reporter_id: str) -> str:
    return f"{suspects(job)}{check_name('member id', suspect_id)}/{check_name('member id', reporter_id)}"


def departed(job: str) -> str:
    return root(job) + "departed/"


def departed_of(job: str, member_id: str) -> str:
    return departed(job) + check_name("member id", member_id)


def epoch(job: str) -> str:
    return root(job) + "epoch"


def epochs(job: str, number: int) -> str:
    return f"{root(job)}epochs/{int(number)}/"


def epoch_record(job: str, number: int) -> str:
    return epochs(job, number) + "epoch"


def epoch_data(job: str, number: int, name: str) -> str:
    return f"{epochs(job, number)}data/{check_name('data name', name)}/"


def epoch_data_of(job: str, number: int, name: str, member_id: str) -> str:
    return epoch_data(job, number, name) + check_name("member id", member_id)


def snapshots(job: str) -> str:
    return root(job) + "snapshots/"


def snapshot(job: str, number: int) -> str:
    """Zero-padded, so key order is number order (old snapshots go by one range delete)."""
    return f"{snapshots(job)}{int(number):020d}/"


def snapshot_meta(job: str, number: int) -> str:
    return snapshot(job, number) + "meta"


def snapshot_chunk(job: str, number: int, index: int) -> str:
    return f"{snapshot(job, number)}{int(index)}"


def nodes(job: str) -> str:
    return root(job) + "nodes/"


def node(job: str, node_id: str) -> str:
    return nodes(job) + check_name("node id", node_id)


def leader(job: str) -> str:
    return root(job) + "leader"


def last_segment(key: str) -> str:
    return key.rsplit("/", 1)[-1]
