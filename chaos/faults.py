"""Fault kinds and triggers of a chaos scenario (docs/design.md §6).

A :class:`Fault` is *what* happens (its :class:`FaultKind` and parameters) and *when*
(its :class:`Trigger`: at a wall time since the workload started, at an op sequence
number, or at a phase of an op and a fraction of that phase's progress).

This module is pure data: nothing here sends a signal. The runner injects faults; for
op- and phase-triggered ``kill``/``hang`` it hands the victim process a failpoint spec
(:meth:`Fault.failpoint_spec`, the ``RESILIENT_FAILPOINTS`` format of
``resilient/collectives/failpoints.py``) so the process stops *itself* at the exact point.

The per-kind parameter table :data:`KIND_PARAMS` is what the scenario parser validates
against, so adding a kind is one entry here plus its injection in the runner.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping


class FaultKind(str, enum.Enum):
    """Fault kinds users know from Chaos Mesh, Toxiproxy and etcd's robustness tests."""

    KILL = "kill"                          # SIGKILL a member
    HANG = "hang"                          # SIGSTOP a member, optional SIGCONT later
    SLOW = "slow"                          # delay / bandwidth cap on a member's transport
    DROP_LINK = "drop_link"                # cut one link between two members
    PARTITION = "partition"                # split members into groups that cannot talk
    ETCD_KILL = "etcd_kill"                # SIGKILL one member of a 3-member etcd cluster
    COORDINATOR_KILL = "coordinator_kill"  # SIGKILL the coordinator leader
    NETEM = "netem"                        # tc netem delay/loss between network namespaces (root)


class Phase(str, enum.Enum):
    """Where inside an op a phase trigger fires. ``recovery`` means: while this member
    is finishing an op that a previous failure interrupted (kill during recovery)."""

    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    RECOVERY = "recovery"

    @property
    def failpoint_name(self) -> str:
        """The short name used in ``RESILIENT_FAILPOINTS`` (``rs``, ``ag``, ``recovery``)."""
        return {"reduce_scatter": "rs", "all_gather": "ag", "recovery": "recovery"}[self.value]


#: Phase spellings accepted in scenario files -> Phase.
PHASE_ALIASES: dict[str, Phase] = {
    "reduce_scatter": Phase.REDUCE_SCATTER, "rs": Phase.REDUCE_SCATTER,
    "all_gather": Phase.ALL_GATHER, "ag": Phase.ALL_GATHER,
    "recovery": Phase.RECOVERY,
}


@dataclass(frozen=True)
class Trigger:
    """When a fault fires. Exactly one of ``time_s`` and ``op`` is set.

    ``op`` is the op sequence number (0-based, the same on every member). ``phase`` and
    ``progress`` (0..1, the fraction of that phase's steps done) refine an op trigger; an
    op trigger without a phase fires as the op starts.
    """

    time_s: float | None = None
    op: int | None = None
    phase: Phase | None = None
    progress: float = 0.0

    @property
    def in_process(self) -> bool:
        """True when only the victim process itself can fire it at the exact point."""
        return self.op is not None

    def describe(self) -> str:
        if self.time_s is not None:
            return f"t={self.time_s:g}s"
        text = f"op {self.op}"
        if self.phase is not None:
            text += f" {self.phase.value} {self.progress:.0%}"
        return text


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a fault kind: its type, whether it is required, its bounds."""

    type: str                      # "member" | "int" | "float" | "link" | "groups" | "choice"
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    exclusive_min: bool = False
    choices: tuple[str, ...] = ()
    help: str = ""


_MEMBER = ParamSpec("member", required=True, help="member index 0..world_size-1, or 'random'")
_DURATION = ParamSpec("float", minimum=0, exclusive_min=True, help="seconds the fault lasts; omitted: until the run ends")

#: Parameters each fault kind takes (besides ``kind`` and ``at``).
KIND_PARAMS: dict[FaultKind, dict[str, ParamSpec]] = {
    FaultKind.KILL: {"member": _MEMBER},
    FaultKind.HANG: {
        "member": _MEMBER,
        "resume_after_s": ParamSpec("float", minimum=0, exclusive_min=True, help="SIGCONT after this many seconds"),
    },
    FaultKind.SLOW: {
        "member": _MEMBER,
        "delay_ms": ParamSpec("float", minimum=0, help="added one-way delay per frame"),
        "bandwidth_mbit": ParamSpec("float", minimum=0, exclusive_min=True, help="bandwidth cap in Mbit/s"),
        "duration_s": _DURATION,
    },
    FaultKind.DROP_LINK: {"link": ParamSpec("link", required=True, help="[a, b]: two member indices"),
                          "duration_s": _DURATION},
    FaultKind.PARTITION: {"groups": ParamSpec("groups", required=True, help="[[0, 1], [2, 3]]: disjoint member groups"),
                          "duration_s": _DURATION},
    FaultKind.ETCD_KILL: {
        "etcd_member": ParamSpec("int", required=True, minimum=0, help="etcd member index 0..etcd_members-1"),
        "restart_after_s": ParamSpec("float", minimum=0, exclusive_min=True, help="restart it after this many seconds"),
    },
    FaultKind.COORDINATOR_KILL: {
        "target": ParamSpec("choice", choices=("leader",), help="which coordinator: the current leader"),
        "restart_after_s": ParamSpec("float", minimum=0, exclusive_min=True, help="restart it after this many seconds"),
    },
    FaultKind.NETEM: {
        "link": ParamSpec("link", required=True, help="[a, b]: two member indices"),
        "delay_ms": ParamSpec("float", minimum=0, help="tc netem delay"),
        "loss_pct": ParamSpec("float", minimum=0, maximum=100, help="tc netem loss, percent"),
        "duration_s": _DURATION,
    },
}

#: Kinds whose trigger may be an op / phase (fired in-process by a failpoint).
OP_TRIGGER_KINDS = frozenset({FaultKind.KILL, FaultKind.HANG})

#: Kinds whose victim stops being a live member (the verifier excuses its missing results).
VICTIM_KINDS = frozenset({FaultKind.KILL, FaultKind.HANG})

#: Kinds that may get a live member evicted by the coordinator (the verifier then excuses
#: the members a later epoch removed).
NETWORK_KINDS = frozenset({FaultKind.SLOW, FaultKind.DROP_LINK, FaultKind.PARTITION, FaultKind.NETEM})


@dataclass(frozen=True)
class Fault:
    """One entry of a scenario's fault timeline.

    ``params`` holds the kind's parameters (see :data:`KIND_PARAMS`); a member parameter
    may still be the string ``"random"`` until :meth:`resolve` picks one for a seed.
    ``line`` is the line of the fault in its scenario file (for messages).
    """

    kind: FaultKind
    trigger: Trigger
    params: Mapping[str, Any] = field(default_factory=dict)
    line: int = 0

    @property
    def member(self) -> int | None:
        m = self.params.get("member")
        return m if isinstance(m, int) else None

    @property
    def duration_s(self) -> float | None:
        for key in ("duration_s", "resume_after_s", "restart_after_s"):
            if self.params.get(key) is not None:
                return float(self.params[key])
        return None

    def resolve(self, member: int) -> "Fault":
        """This fault with ``member: random`` replaced by ``member``."""
        return Fault(self.kind, self.trigger, {**self.params, "member": member}, self.line)

    def failpoint_spec(self) -> str:
        """The ``RESILIENT_FAILPOINTS`` entry that makes the victim stop itself at the
        trigger, e.g. ``kill@op=3,phase=rs,frac=0.5``. Only for op-triggered kill/hang;
        raises ``ValueError`` otherwise (the runner injects those from outside)."""
        if self.kind not in OP_TRIGGER_KINDS or self.trigger.op is None:
            raise ValueError(f"{self.kind.value} at {self.trigger.describe()} is injected by the runner, not a failpoint")
        action = "kill" if self.kind is FaultKind.KILL else "stop"
        spec = f"{action}@op={self.trigger.op}"
        if self.trigger.phase is not None:
            spec += f",phase={self.trigger.phase.failpoint_name},frac={self.trigger.progress:g}"
        return spec

    def describe(self) -> str:
        """One human line, e.g. ``kill member 1 at op 3 reduce_scatter 50%``."""
        return f"{self.kind.value} {self.target_text()}"

    def target_text(self) -> str:
        """:meth:`describe` without the kind: ``member 1 at op 3 reduce_scatter 50%``."""
        p = self.params
        if "member" in p:
            who = f"member {p['member']}"
        elif "link" in p:
            who = f"link {p['link'][0]}-{p['link'][1]}"
        elif "groups" in p:
            who = " | ".join(",".join(str(m) for m in g) for g in p["groups"])
        elif "etcd_member" in p:
            who = f"etcd member {p['etcd_member']}"
        else:
            who = "coordinator leader" if self.kind is FaultKind.COORDINATOR_KILL else ""
        extra = ", ".join(f"{k}={v}" for k, v in p.items() if k not in ("member", "link", "groups", "etcd_member", "target"))
        return f"{who} at {self.trigger.describe()}" + (f" ({extra})" if extra else "")
