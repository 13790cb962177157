"""The environment of one worker process: torchrun's variables plus resilient's.

torchrun's set (``LocalElasticAgent._start_workers`` and ``DefaultLogsSpecs.reify`` of torch
2.13, checked by ``tests/test_launcher_env.py`` against a real torchrun run): ``RANK``,
``LOCAL_RANK``, ``GROUP_RANK``, ``ROLE_RANK``, ``ROLE_NAME``, ``LOCAL_WORLD_SIZE``,
``WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_USE_AGENT_STORE`` (True: the agent of group rank 0 hosts the TCPStore at
MASTER_ADDR:MASTER_PORT, as torchrun's agent does), ``TORCHELASTIC_ERROR_FILE``,
``TORCHELASTIC_SIGNALS_TO_HANDLE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (1 unless set),
``OMP_NUM_THREADS`` (1 when more than one worker per node and the user did not set it),
``CUDA_VISIBLE_DEVICES`` (with ``--virtual-local-rank``), on top of the agent's own
environment.

resilient's: ``RESILIENT_ETCD`` (comma-separated endpoints), ``RESILIENT_JOB``,
``RESILIENT_LEASE_ID`` (decimal id of the etcd lease the agent granted for this worker;
the worker's ``MemberSession`` attaches to it and keeps it alive),
``RESILIENT_MEMBER_ID``, ``RESILIENT_LEASE_TTL`` (seconds), ``RESILIENT_JOINER`` (``1`` for
a restarted worker or one on a node admitted after the job started, else ``0``). Without
etcd (``--rdzv-backend static`` and no ``--etcd``) only ``RESILIENT_JOB`` and
``RESILIENT_JOINER`` are set.

Pure functions, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Placement:
    """Where this node sits in the job (the result of rendezvous)."""

    group_rank: int
    group_world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    joiner: bool = False  # this whole node joined a running job

    @property
    def world_size(self) -> int:
        return self.group_world_size * self.local_world_size

    def global_rank(self, local_rank: int) -> int:
        return self.group_rank * self.local_world_size + local_rank


@dataclass(frozen=True)
class ResilientIds:
    """Control-plane identifiers handed to one worker incarnation."""

    etcd: tuple[str, ...]
    job: str
    lease_id: int | None
    member_id: str | None
    lease_ttl: float


def agent_process_env(base: Mapping[str, str], nproc_per_node: int, signals_to_handle: str) -> dict[str, str]:
    """What torchrun changes in its own environment before starting workers."""
    env = dict(base)
    if "OMP_NUM_THREADS" not in env and nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals_to_handle
    return env


def worker_env(
    base: Mapping[str, str],
    placement: Placement,
    local_rank: int,
    role: str,
    restart_count: int,
    max_restarts: int,
    error_file: str,
    ids: ResilientIds | None,
    job: str,
    joiner: bool,
    virtual_local_rank: bool = False,
) -> dict[str, str]:
    """The full environment of one worker (``base`` is the agent's, see
    :func:`agent_process_env`). Raises ``ValueError`` when ``--virtual-local-rank`` asks for a
    GPU beyond ``CUDA_VISIBLE_DEVICES``."""
    env = dict(base)
    rank = placement.global_rank(local_rank)
    env.update({
        "RANK": str(rank),
        "GROUP_RANK": str(placement.group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(placement.local_world_size),
        "WORLD_SIZE": str(placement.world_size),
        "GROUP_WORLD_SIZE": str(placement.group_world_size),
        "ROLE_WORLD_SIZE": str(placement.world_size),
        "MASTER_ADDR": placement.master_addr,
        "MASTER_PORT": str(placement.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": placement.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "LOCAL_RANK": str(local_rank),
    })
    if virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        visible = base.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus = visible.split(",")
            if local_rank >= len(gpus):
                raise ValueError(
                    f"local rank {local_rank} exceeds the GPUs in CUDA_VISIBLE_DEVICES={visible}; "
                    "lower --nproc-per-node or widen CUDA_VISIBLE_DEVICES"
                )
            env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank].strip()
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    env["RESILIENT_JOB"] = job
    env["RESILIENT_JOINER"] = "1" if joiner else "0"
    if ids is not None:
        env["RESILIENT_ETCD"] = ",".join(ids.etcd)
        env["RESILIENT_JOB"] = ids.job
        env["RESILIENT_LEASE_TTL"] = f"{ids.lease_ttl:g}"
        if ids.lease_id is not None:
            env["RESILIENT_LEASE_ID"] = str(ids.lease_id)
        if ids.member_id is not None:
            env["RESILIENT_MEMBER_ID"] = ids.member_id
    return env
