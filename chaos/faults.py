"""The fault model of a chaos scenario and the interface every fault kind implements.

A :class:`Fault` is *what* happens (its :class:`FaultKind` and parameters) and *when*
(its :class:`Trigger`: at a wall time since the workload started, at an op sequence
number, or at a phase of an op and a fraction of that phase's progress).

A :class:`FaultKind` is one kind of fault in one place (``chaos/kinds/<name>.py``; the
registry in :mod:`resilient.chaos.kinds` finds it): the YAML fields it takes
(:attr:`~FaultKind.params`) and their cross-field validation (:meth:`~FaultKind.check`),
how the runner injects it (:meth:`~FaultKind.inject`, through the :class:`Injector` the
runner hands it), its Chaos Mesh export (:meth:`~FaultKind.chaos_mesh`) and what the
verifier expects of it (:attr:`~FaultKind.effect`).

This module is pure data and interfaces: nothing here sends a signal. For op- and
phase-triggered faults (kinds with a :attr:`~FaultKind.failpoint_action`) the runner hands
the victim a failpoint spec (:meth:`Fault.failpoint_spec`, the ``RESILIENT_FAILPOINTS``
format of ``resilient/collectives/failpoints.py``) so the process stops *itself* at the
exact point. Failure behaviour: :meth:`Fault.failpoint_spec` raises ``ValueError`` for a
fault that is not fired in-process; :meth:`FaultKind.check` raises the
:class:`~resilient.errors.ScenarioError` its :class:`ParseContext` builds.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping, Protocol

from resilient.errors import ScenarioError

if TYPE_CHECKING:  # types only: neither is imported at run time from here
    from resilient.chaos.mesh import MeshObject, Selectors
    from resilient.chaos.netns import NetnsLab


class Phase(str, enum.Enum):
    """Where inside an op a phase trigger fires. ``recovery`` means: while this member
    is finishing an op that a previous failure interrupted (kill during recovery)."""

    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    RECOVERY = "recovery"
    #: the levels of the hierarchical allreduce (members on two or more hosts, scenario
    #: ``hosts:``): reduce-scatter inside a host, across hosts, all-gather across, inside
    INTRA_RS = "intra_rs"
    CROSS_RS = "cross_rs"
    CROSS_AG = "cross_ag"
    INTRA_AG = "intra_ag"

    @property
    def failpoint_name(self) -> str:
        """The short name used in ``RESILIENT_FAILPOINTS`` (``rs``, ``ag``, ``recovery``,
        and the hierarchical levels under their own names)."""
        return {"reduce_scatter": "rs", "all_gather": "ag"}.get(self.value, self.value)


#: Phase spellings accepted in scenario files -> Phase.
PHASE_ALIASES: dict[str, Phase] = {
    "reduce_scatter": Phase.REDUCE_SCATTER, "rs": Phase.REDUCE_SCATTER,
    "all_gather": Phase.ALL_GATHER, "ag": Phase.ALL_GATHER,
    "recovery": Phase.RECOVERY,
    **{p.value: p for p in (Phase.INTRA_RS, Phase.CROSS_RS, Phase.CROSS_AG, Phase.INTRA_AG)},
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


ParamType = Literal["member", "int", "float", "link", "groups", "choice"]


@dataclass(frozen=True)
class ParamSpec:
    """One YAML parameter of a fault kind: its type, whether it is required, its bounds.

    Types: ``member`` (an index 0..world_size-1 or ``random``), ``int``, ``float``,
    ``link`` (two distinct member indices), ``groups`` (disjoint lists of member
    indices), ``choice`` (one of ``choices``)."""

    type: ParamType
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    exclusive_min: bool = False
    choices: tuple[str, ...] = ()
    help: str = ""


#: The ``member`` parameter most kinds take.
MEMBER = ParamSpec("member", required=True, help="member index 0..world_size-1, or 'random'")
#: The ``link`` parameter of link faults.
LINK = ParamSpec("link", required=True, help="[a, b]: two member indices")
#: How long a network fault lasts.
DURATION = ParamSpec("float", minimum=0, exclusive_min=True,
                     help="seconds the fault lasts; omitted: until the run ends")


#: Why a fault on the transport is skipped on the ``oracle`` backend.
ORACLE_NO_TRANSPORT = "the oracle backend has no transport to shape; run with the resilient backend"


def after_s(what: str) -> ParamSpec:
    """An optional positive number of seconds after which ``what`` happens."""
    return ParamSpec("float", minimum=0, exclusive_min=True, help=f"{what} after this many seconds")


@dataclass(frozen=True)
class ExpectedEffect:
    """What the verifier expects of an injected fault of a kind.

    ``excuses_victim``: the victim stops being a live member, so its unfinished ops are
    expected (kill, hang). ``victim_loses_data``: the victim's process is gone, so a
    ``DataLost`` naming it is the contract's allowed error (kill). ``may_evict``: a live
    member may legitimately be evicted, so members a later epoch removed are excused
    (network faults). ``recovery_timed``: the fault fails ops and the verifier times the
    recovery from it (``False``: it degrades instead, e.g. slow, netem)."""

    excuses_victim: bool = False
    victim_loses_data: bool = False
    may_evict: bool = False
    recovery_timed: bool = True


@dataclass(frozen=True)
class Fault:
    """One entry of a scenario's fault timeline.

    ``params`` holds the kind's parameters (see :attr:`FaultKind.params`); a member
    parameter may still be the string ``"random"`` until :meth:`resolve` picks one for a
    seed. ``line`` is the line of the fault in its scenario file (for messages).
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
        """How long the fault lasts (the kind's :attr:`~FaultKind.duration_param`), or
        ``None`` when it lasts until the run ends."""
        key = self.kind.duration_param
        value = self.params.get(key) if key is not None else None
        return None if value is None else float(value)

    def resolve(self, member: int) -> Fault:
        """This fault with ``member: random`` replaced by ``member``."""
        return Fault(self.kind, self.trigger, {**self.params, "member": member}, self.line)

    def failpoint_spec(self) -> str:
        """The ``RESILIENT_FAILPOINTS`` entry that makes the victim stop itself at the
        trigger, e.g. ``kill@op=3,phase=rs,frac=0.5``. Only for op-triggered faults of a
        kind with a failpoint action; raises ``ValueError`` otherwise (the runner injects
        those from outside)."""
        action = self.kind.failpoint_action
        if action is None or self.trigger.op is None:
            raise ValueError(f"{self.kind.name} at {self.trigger.describe()} is injected by the runner, "
                             "not a failpoint")
        spec = f"{action}@op={self.trigger.op}"
        if self.trigger.phase is not None:
            spec += f",phase={self.trigger.phase.failpoint_name},frac={self.trigger.progress:g}"
        return spec

    def describe(self) -> str:
        """One human line, e.g. ``kill member 1 at op 3 reduce_scatter 50%``."""
        return f"{self.kind.name} {self.target_text()}"

    def target_text(self) -> str:
        """:meth:`describe` without the kind: ``member 1 at op 3 reduce_scatter 50%``."""
        shown = self.kind.target_params
        extra = ", ".join(f"{k}={v}" for k, v in self.params.items() if k not in shown)
        return f"{self.kind.target(self.params)} at {self.trigger.describe()}" + (f" ({extra})" if extra else "")


class ParseContext(Protocol):
    """What :meth:`FaultKind.check` may read about the scenario being parsed."""

    @property
    def world_size(self) -> int: ...

    @property
    def etcd_members(self) -> int: ...

    @property
    def coordinators(self) -> int: ...

    @property
    def requires(self) -> tuple[str, ...]: ...

    def error(self, field: str, message: str) -> ScenarioError:
        """The error to raise for ``field`` of this fault: ``FILE:LINE: faults[i].FIELD:
        message``, at the field's line (the fault's line when the field is absent)."""
        ...


class Injector(Protocol):
    """What the runner offers :meth:`FaultKind.inject` (every signal goes to a process
    the runner started). Times are seconds since the run's ``t0``."""

    @property
    def backend(self) -> str:
        """``resilient`` (the collectives under test) or ``oracle`` (no transport)."""
        ...

    def now(self) -> float: ...

    def injected(self, fault: Fault, at: float, target: str | None = None, victim: int | None = None,
                 end_s: float | None = None) -> None:
        """Record that ``fault`` was injected at ``at`` (``target``: default
        :meth:`Fault.target_text`; ``victim``: the member it took out; ``end_s``: when it
        ends, ``None`` if it lasts)."""
        ...

    def skipped(self, fault: Fault, at: float, reason: str, target: str | None = None) -> None:
        """Record that ``fault`` could not be injected here, and why."""
        ...

    def later(self, delay_s: float, action: Callable[[], None]) -> None:
        """Run ``action`` after ``delay_s`` unless the run stops first."""
        ...

    def stopping(self) -> bool:
        """True once the run is ending (processes and the lab may be going away)."""
        ...

    def signal_member(self, member: int, sig: int) -> None:
        """Send ``sig`` to member ``member``'s process if it is still running."""
        ...

    def resume_later(self, member: int, delay_s: float) -> None:
        """SIGCONT the stopped member after ``delay_s``; until then the run waits for it."""
        ...

    def shape(self, fault: Fault, at: float, per_member: Mapping[int, list[str]]) -> None:
        """Write ``per_member`` shaping items (``delay=``, ``bw=``, ``drop=m<j>`` of
        :mod:`resilient.transport.shaping`) into each member's shaping file, record the
        fault, and remove the items again after its duration. Recorded as skipped on a
        backend without a transport."""
        ...

    def kill_etcd(self, index: int) -> None: ...

    def restart_etcd(self, index: int) -> None:
        """Start etcd member ``index`` again (does not wait for it to be healthy)."""
        ...

    def coordinator_leader(self) -> str | None:
        """The id of the current coordinator leader, read from etcd."""
        ...

    def kill_coordinator(self, cid: str) -> bool:
        """SIGKILL coordinator ``cid``; False when it is not running."""
        ...

    def start_coordinator(self, cid: str) -> None: ...

    @property
    def lab(self) -> NetnsLab | None:
        """The members' network namespaces (``needs_netns`` kinds), ``None`` on loopback."""
        ...

    @property
    def netem_unavailable(self) -> str | None:
        """Why ``tc netem`` cannot be applied on this kernel (probed), else ``None``."""
        ...


class FaultKind:
    """One kind of fault: subclass it in a module of ``chaos/kinds/`` (one per kind).

    Class attributes: :attr:`name` (the ``kind:`` in YAML), :attr:`params`,
    :attr:`failpoint_action` (set: op/phase triggers allowed, fired in the victim),
    :attr:`duration_param`, :attr:`effect`, :attr:`needs_netns`. Override
    :meth:`inject` (and :meth:`check`, :meth:`target`, :meth:`chaos_mesh` where the
    defaults do not fit)."""

    name: ClassVar[str]
    #: The YAML fields it takes besides ``kind`` and ``at``.
    params: ClassVar[Mapping[str, ParamSpec]] = {}
    #: ``RESILIENT_FAILPOINTS`` action (``kill``/``stop``) for op/phase triggers; ``None``:
    #: injected from outside the members, time triggers only.
    failpoint_action: ClassVar[Literal["kill", "stop"] | None] = None
    #: The parameter that says how long the fault lasts (``Fault.duration_s``).
    duration_param: ClassVar[str | None] = None
    effect: ClassVar[ExpectedEffect] = ExpectedEffect()
    #: Its scenario runs every member in its own network namespace.
    needs_netns: ClassVar[bool] = False
    #: Parameters :meth:`target` names (the others are listed after it).
    target_params: ClassVar[tuple[str, ...]] = ("member", "link", "groups")

    def check(self, params: dict[str, Any], ctx: ParseContext) -> dict[str, Any]:
        """Cross-field validation of parsed ``params`` (each field is already valid on
        its own); returns the params with defaults filled in. Raises
        ``ctx.error(field, message)``."""
        return params

    def target(self, params: Mapping[str, Any]) -> str:
        """What the fault hits, e.g. ``member 1``, ``link 0-2``, ``0,1 | 2,3``."""
        if "member" in params:
            return f"member {params['member']}"
        if "link" in params:
            return f"link {params['link'][0]}-{params['link'][1]}"
        if "groups" in params:
            return " | ".join(",".join(str(m) for m in g) for g in params["groups"])
        return ""

    def inject(self, fault: Fault, ctx: Injector) -> None:
        """Inject a time-triggered ``fault`` now and record it (``ctx.injected`` or
        ``ctx.skipped``). An exception is recorded by the runner as a failed injection."""
        raise NotImplementedError(f"fault kind {self.name!r} has no injection")

    def fired_in_process(self, fault: Fault, ctx: Injector, at: float) -> None:
        """The victim stopped itself at ``fault``'s failpoint (seen by the runner at
        ``at``): record it. Only for kinds with a :attr:`failpoint_action`."""
        ctx.injected(fault, at, target=f"member {fault.member}", victim=fault.member)

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject] | None:
        """The Chaos Mesh objects (``(kind, spec)``) that inject ``fault`` on the Helm
        chart's pods; ``None`` when Chaos Mesh cannot express it (the export then fails
        with a :class:`~resilient.errors.ScenarioError` naming the fault)."""
        return None

    def __repr__(self) -> str:
        return f"<fault kind {self.name}>"
