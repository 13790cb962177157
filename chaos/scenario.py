"""Chaos scenario files: the YAML schema, parsing and validation.

A scenario says how big the world is, what workload runs, for how long, with which seeds,
and the timeline of faults::

    name: kill-in-reduce-scatter
    description: member 1 is SIGKILLed halfway through op 3's reduce-scatter
    world_size: 4
    etcd_members: 1          # 1, or 3 for etcd member loss
    coordinators: 1          # >= 2 for coordinator leader loss
    seeds: 2                 # seeds a plain `chaos run` uses (0..seeds-1)
    op_timeout_s: 30         # an op not finished within this is a hang
    lease_ttl_s: 2
    requires: []             # [root] for netem and hosts
    hosts: 2                 # optional: members in 2 network namespaces ("hosts"), contiguous
    host_link_mbit: 200      # optional, with hosts: htb cap on the link between every two hosts
    workload:
      ops: 12                # or duration_s: 60
      mix:
        - {collective: allreduce, op: sum, dtype: int64, numel: 65536}
        - {collective: allreduce, op: avg, dtype: float32, numel: 65536, weight: 2}
    faults:
      - kind: kill
        member: 1
        at: {op: 3, phase: reduce_scatter, progress: 0.5}

A training-level workload replaces ``mix`` with ``script: examples/train.py`` (and
``args: [...]``); it runs under the launcher.

Parsing uses ``yaml.compose`` so every node keeps its line: any malformed file raises
:class:`~resilient.errors.ScenarioError` whose message starts ``FILE:LINE: FIELD:`` and
says what is wrong and how to fix it. Nothing is started by this module.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml
from yaml.constructor import SafeConstructor

from resilient.chaos import kinds
from resilient.chaos.faults import PHASE_ALIASES, Fault, FaultKind, ParamSpec, Trigger
from resilient.chaos.workload import COLLECTIVES, DTYPES, REDUCE_OPS, REDUCING, OpSpec
from resilient.errors import ScenarioError

BUILTIN_DIR = Path(__file__).resolve().parent / "scenarios"

REQUIREMENTS = ("root",)


@dataclass(frozen=True)
class Workload:
    """What the members run: ``ops`` ops (or for ``duration_s``) drawn from ``mix``, or a
    training ``script`` under the launcher."""

    mix: tuple[OpSpec, ...] = ()
    ops: int | None = None
    duration_s: float | None = None
    script: str | None = None
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    world_size: int
    workload: Workload
    faults: tuple[Fault, ...] = ()
    etcd_members: int = 1
    coordinators: int = 1
    seeds: int = 2
    op_timeout_s: float = 30.0
    lease_ttl_s: float = 2.0
    requires: tuple[str, ...] = ()
    source: str = "<string>"
    #: How a killed member's death reaches the coordinator: ``revoke`` (the runner revokes
    #: its lease the moment it sees the exit, as the node agent does) or ``ttl`` (nobody
    #: revokes; the lease expires after ``lease_ttl_s`` — the hang/node-loss path).
    detection: str = "revoke"
    #: emulated hosts (network namespaces; 0: none): member ``i`` is on host
    #: :meth:`host_of` ``(i)``, its members share the namespace (shared-memory links) and
    #: the ``host`` label; ``host_link_mbit`` caps the link between every two hosts (htb)
    hosts: int = 0
    host_link_mbit: float | None = None

    def host_of(self, member: int) -> int:
        """The emulated host of member index ``member`` (contiguous blocks; 0 without hosts)."""
        return member * self.hosts // self.world_size if self.hosts else 0

    def fault_kinds(self) -> set[FaultKind]:
        return {f.kind for f in self.faults}

    def needs_netns(self) -> bool:
        """Its members run in network namespaces: emulated ``hosts``, or a fault kind that
        needs one namespace per member (netem)."""
        return self.hosts > 1 or any(k.needs_netns for k in self.fault_kinds())


# ---------------------------------------------------------------------------------------
# node helpers: every error names FILE:LINE and the dotted field path


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self._construct = SafeConstructor()

    def error(self, node: yaml.Node | None, path: str, message: str) -> ScenarioError:
        line = node.start_mark.line + 1 if node is not None else 1
        return ScenarioError(f"{self.source}:{line}: {path or '(top level)'}: {message}")

    def mapping(self, node: yaml.Node, path: str, allowed: Iterable[str]) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, path, f"must be a mapping (key: value lines), got {_kind(node)}")
        allowed = list(allowed)
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for knode, vnode in node.value:
            key = self.scalar(knode)
            if not isinstance(key, str):
                raise self.error(knode, path, f"keys must be names, got {key!r}")
            where = f"{path}.{key}" if path else key
            if key in out:
                raise self.error(knode, where, "appears twice; keep one")
            if key not in allowed:
                hint = difflib.get_close_matches(key, allowed, n=1)
                fix = f"did you mean {hint[0]!r}?" if hint else f"allowed here: {', '.join(sorted(allowed))}"
                raise self.error(knode, where, f"unknown field; {fix}")
            out[key] = (knode, vnode)
        return out

    def scalar(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return _Composite(node)
        return self._construct.construct_object(node)

    def required(self, m: Mapping[str, tuple[yaml.Node, yaml.Node]], key: str, parent: yaml.Node, path: str,
                 what: str) -> yaml.Node:
        if key not in m:
            where = f"{path}.{key}" if path else key
            raise self.error(parent, where, f"missing required field; add `{key}: {what}`")
        node: yaml.Node = m[key][1]
        return node

    def integer(self, node: yaml.Node, path: str, minimum: int | None = None, maximum: int | None = None) -> int:
        v = self.scalar(node)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(node, path, f"must be an integer, got {_show(v)}")
        self._bounds(node, path, v, minimum, maximum, False)
        return v

    def number(self, node: yaml.Node, path: str, minimum: float | None = None, maximum: float | None = None,
               exclusive_min: bool = False) -> float:
        v = self.scalar(node)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(node, path, f"must be a number, got {_show(v)}")
        if v != v or v in (float("inf"), float("-inf")):
            raise self.error(node, path, f"must be a finite number, got {v}")
        self._bounds(node, path, v, minimum, maximum, exclusive_min)
        return float(v)

    def string(self, node: yaml.Node, path: str, choices: Iterable[str] | None = None) -> str:
        v = self.scalar(node)
        if not isinstance(v, str):
            raise self.error(node, path, f"must be a string, got {_show(v)}")
        if choices is not None:
            choices = list(choices)
            if v not in choices:
                hint = difflib.get_close_matches(v, choices, n=1)
                fix = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise self.error(node, path, f"{v!r} is not one of {', '.join(choices)}{fix}")
        return v

    def sequence(self, node: yaml.Node, path: str, min_len: int = 0) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, path, f"must be a list, got {_kind(node)}")
        if len(node.value) < min_len:
            raise self.error(node, path, f"needs at least {min_len} entr{'y' if min_len == 1 else 'ies'}")
        return list(node.value)

    def _bounds(self, node: yaml.Node, path: str, v: float, minimum: float | None, maximum: float | None,
                exclusive_min: bool) -> None:
        if minimum is not None and (v <= minimum if exclusive_min else v < minimum):
            raise self.error(node, path, f"must be {'>' if exclusive_min else '>='} {minimum:g}, got {v:g}")
        if maximum is not None and v > maximum:
            raise self.error(node, path, f"must be <= {maximum:g}, got {v:g}")


class _Composite:
    """Stands for a list/mapping where a scalar was expected (for error messages)."""

    def __init__(self, node: yaml.Node) -> None:
        self.node = node

    def __repr__(self) -> str:
        return _kind(self.node)


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"{node.value!r}"


def _show(v: Any) -> str:
    if isinstance(v, _Composite):
        return repr(v)
    if v is None:
        return "nothing (null)"
    return f"{type(v).__name__} {v!r}"


# ---------------------------------------------------------------------------------------

_TOP = ("name", "description", "world_size", "etcd_members", "coordinators", "seeds", "op_timeout_s",
        "lease_ttl_s", "detection", "requires", "workload", "faults", "hosts", "host_link_mbit")
_WORKLOAD = ("ops", "duration_s", "mix", "script", "args")
_OPSPEC = ("collective", "op", "dtype", "numel", "root", "weight")
_TRIGGER = ("time_s", "op", "phase", "progress")


def parse_scenario(text: str, source: str = "<string>") -> Scenario:
    """Parse and validate scenario YAML. Raises :class:`ScenarioError` naming the line and
    the field of the first problem (bad YAML, unknown field or fault kind, missing field,
    wrong type, out-of-range value, inconsistent fault)."""
    p = _Parser(source)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise ScenarioError(f"{source}:{line}: not valid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{source}:1: not valid YAML: {exc}") from None
    if root is None:
        raise ScenarioError(f"{source}:1: the file is empty; a scenario needs world_size, workload and faults")
    top = p.mapping(root, "", _TOP)

    world = p.integer(p.required(top, "world_size", root, "", "4"), "world_size", minimum=2)
    name = p.string(top["name"][1], "name") if "name" in top else Path(source).stem
    description = p.string(top["description"][1], "description") if "description" in top else ""
    etcd_members = p.integer(top["etcd_members"][1], "etcd_members", 1) if "etcd_members" in top else 1
    if etcd_members not in (1, 3, 5):
        raise p.error(top["etcd_members"][1], "etcd_members", f"must be 1, 3 or 5 (an odd quorum), got {etcd_members}")
    coordinators = p.integer(top["coordinators"][1], "coordinators", 1, 9) if "coordinators" in top else 1
    seeds = p.integer(top["seeds"][1], "seeds", 1) if "seeds" in top else 2
    op_timeout = p.number(top["op_timeout_s"][1], "op_timeout_s", 0, exclusive_min=True) if "op_timeout_s" in top else 30.0
    ttl = p.number(top["lease_ttl_s"][1], "lease_ttl_s", 0, exclusive_min=True) if "lease_ttl_s" in top else 2.0
    detection = p.string(top["detection"][1], "detection", ("revoke", "ttl")) if "detection" in top else "revoke"
    requires: list[str] = []
    if "requires" in top:
        for i, n in enumerate(p.sequence(top["requires"][1], "requires")):
            requires.append(p.string(n, f"requires[{i}]", REQUIREMENTS))

    workload = _parse_workload(p, p.required(top, "workload", root, "", "{ops: 10, mix: [...]}"), world)
    hosts, cap = _parse_hosts(p, top, world, requires)

    faults: list[Fault] = []
    if "faults" in top:
        for i, n in enumerate(p.sequence(top["faults"][1], "faults")):
            faults.append(_parse_fault(p, n, f"faults[{i}]", world, etcd_members, coordinators, requires))
    if hosts:
        for f in faults:
            if f.kind.needs_netns:
                raise p.error(top["hosts"][1], "hosts", f"{f.kind.name} (line {f.line}) needs one namespace per "
                              "member; remove `hosts:` or that fault")
    return Scenario(name=name, description=description, world_size=world, workload=workload,
                    faults=tuple(faults), etcd_members=etcd_members, coordinators=coordinators, seeds=seeds,
                    op_timeout_s=op_timeout, lease_ttl_s=ttl, requires=tuple(requires), source=source,
                    detection=detection, hosts=hosts, host_link_mbit=cap)


def _parse_hosts(p: _Parser, top: Mapping[str, tuple[yaml.Node, yaml.Node]], world: int,
                 requires: list[str]) -> tuple[int, float | None]:
    """``hosts`` (2..world_size; needs ``requires: [root]``) and ``host_link_mbit`` (needs
    ``hosts``)."""
    hosts = p.integer(top["hosts"][1], "hosts", 2, world) if "hosts" in top else 0
    if hosts and "root" not in requires:
        raise p.error(top["hosts"][1], "hosts", "emulated hosts are network namespaces: add `requires: [root]` "
                      "so runs without root skip the scenario with a clear message")
    cap = None
    if "host_link_mbit" in top:
        if not hosts:
            raise p.error(top["host_link_mbit"][0], "host_link_mbit", "caps the links between hosts; add `hosts: N`")
        cap = p.number(top["host_link_mbit"][1], "host_link_mbit", 0, 1e6, exclusive_min=True)
    return hosts, cap


def _parse_workload(p: _Parser, node: yaml.Node, world: int) -> Workload:
    w = p.mapping(node, "workload", _WORKLOAD)
    ops = p.integer(w["ops"][1], "workload.ops", 1) if "ops" in w else None
    duration = p.number(w["duration_s"][1], "workload.duration_s", 0, exclusive_min=True) if "duration_s" in w else None
    if ops is not None and duration is not None:
        raise p.error(w["duration_s"][0], "workload.duration_s", "give either ops or duration_s, not both")
    if ops is None and duration is None:
        raise p.error(node, "workload.ops", "missing required field; add `ops: N` or `duration_s: SECONDS`")
    if ("mix" in w) == ("script" in w):
        raise p.error(node, "workload.mix", "give exactly one of `mix: [...]` (collectives) or `script: FILE` (training)")
    if "script" in w:
        script = p.string(w["script"][1], "workload.script")
        args = tuple(p.string(n, f"workload.args[{i}]") for i, n in
                     enumerate(p.sequence(w["args"][1], "workload.args"))) if "args" in w else ()
        return Workload(ops=ops, duration_s=duration, script=script, args=args)
    if "args" in w:
        raise p.error(w["args"][0], "workload.args", "args go with `script:`, not with `mix:`")
    mix = tuple(_parse_opspec(p, n, f"workload.mix[{i}]", world)
                for i, n in enumerate(p.sequence(w["mix"][1], "workload.mix", min_len=1)))
    return Workload(mix=mix, ops=ops, duration_s=duration)


def _parse_opspec(p: _Parser, node: yaml.Node, path: str, world: int) -> OpSpec:
    m = p.mapping(node, path, _OPSPEC)
    coll = p.string(p.required(m, "collective", node, path, "allreduce"), f"{path}.collective", COLLECTIVES)
    dtype = p.string(m["dtype"][1], f"{path}.dtype", DTYPES) if "dtype" in m else "float32"
    numel = p.integer(m["numel"][1], f"{path}.numel", 1) if "numel" in m else 1024
    weight = p.number(m["weight"][1], f"{path}.weight", 0, exclusive_min=True) if "weight" in m else 1.0
    op = None
    if coll in REDUCING:
        op = p.string(m["op"][1], f"{path}.op", REDUCE_OPS) if "op" in m else "sum"
        if op == "avg" and not dtype.startswith("float"):
            raise p.error(m["op"][1], f"{path}.op", f"avg needs a floating dtype, not {dtype}; use sum or a float dtype")
    elif "op" in m:
        raise p.error(m["op"][0], f"{path}.op", f"{coll} does not reduce; remove `op`")
    root = 0
    if "root" in m:
        if coll != "broadcast":
            raise p.error(m["root"][0], f"{path}.root", f"only broadcast has a root; remove it from {coll}")
        root = p.integer(m["root"][1], f"{path}.root", 0, world - 1)
    return OpSpec(collective=coll, dtype=dtype, numel=numel, op=op, root=root, weight=weight)


@dataclass(frozen=True)
class _FaultContext:
    """:class:`~resilient.chaos.faults.ParseContext` of one fault: the scenario's sizes,
    and errors at the line of the named field of this fault (the fault's own line when
    the field is absent)."""

    parser: _Parser
    node: yaml.Node
    fields: Mapping[str, tuple[yaml.Node, yaml.Node]]
    path: str
    world_size: int
    etcd_members: int
    coordinators: int
    requires: tuple[str, ...]

    def error(self, field: str, message: str) -> ScenarioError:
        at = self.fields[field][1] if field in self.fields else self.node
        return self.parser.error(at, f"{self.path}.{field}", message)


def _parse_fault(p: _Parser, node: yaml.Node, path: str, world: int, etcd_members: int, coordinators: int,
                 requires: list[str]) -> Fault:
    if not isinstance(node, yaml.MappingNode):
        raise p.error(node, path, f"must be a mapping with `kind:` and `at:`, got {_kind(node)}")
    raw = {p.scalar(k): (k, v) for k, v in node.value}
    kind = kinds.get(p.string(p.required(raw, "kind", node, path, "kill"), f"{path}.kind", kinds.names()))
    spec = kind.params
    m = p.mapping(node, path, ("kind", "at", *spec))
    trigger = _parse_trigger(p, p.required(m, "at", node, path, "{time_s: 1.0} or {op: 3}"), f"{path}.at")
    if trigger.op is not None and kind.failpoint_action is None:
        raise p.error(m["at"][1], f"{path}.at.op", f"{kind.name} is injected from outside the members and can only "
                      "trigger at a time; use `at: {time_s: SECONDS}`")
    params: dict[str, Any] = {}
    for key, ps in spec.items():
        if key not in m:
            if ps.required:
                raise p.error(node, f"{path}.{key}",
                              f"missing required field for {kind.name}; add `{key}:` ({ps.help})")
            continue
        params[key] = _parse_param(p, m[key][1], f"{path}.{key}", ps, world)
    ctx = _FaultContext(p, node, m, path, world, etcd_members, coordinators, tuple(requires))
    params = kind.check(params, ctx)
    return Fault(kind=kind, trigger=trigger, params=params, line=node.start_mark.line + 1)


def _parse_trigger(p: _Parser, node: yaml.Node, path: str) -> Trigger:
    m = p.mapping(node, path, _TRIGGER)
    if ("time_s" in m) == ("op" in m):
        raise p.error(node, f"{path}.time_s", "give exactly one of `time_s: SECONDS` or `op: N`")
    if "time_s" in m:
        for key in ("phase", "progress"):
            if key in m:
                raise p.error(m[key][0], f"{path}.{key}", "phase/progress refine an op trigger; use `op: N` with it")
        return Trigger(time_s=p.number(m["time_s"][1], f"{path}.time_s", 0))
    op = p.integer(m["op"][1], f"{path}.op", 0)
    phase = None
    if "phase" in m:
        phase = PHASE_ALIASES[p.string(m["phase"][1], f"{path}.phase", list(PHASE_ALIASES))]
    progress = 0.0
    if "progress" in m:
        if phase is None:
            raise p.error(m["progress"][0], f"{path}.progress", "progress needs a `phase:` to be a fraction of")
        progress = p.number(m["progress"][1], f"{path}.progress", 0, 1)
    return Trigger(op=op, phase=phase, progress=progress)


def _parse_param(p: _Parser, node: yaml.Node, path: str, ps: ParamSpec, world: int) -> Any:
    if ps.type == "member":
        if isinstance(node, yaml.ScalarNode) and p.scalar(node) == "random":
            return "random"
        return p.integer(node, path, 0, world - 1)
    if ps.type == "int":
        return p.integer(node, path, None if ps.minimum is None else int(ps.minimum),
                         None if ps.maximum is None else int(ps.maximum))
    if ps.type == "float":
        return p.number(node, path, ps.minimum, ps.maximum, ps.exclusive_min)
    if ps.type == "choice":
        return p.string(node, path, ps.choices)
    if ps.type == "link":
        items = p.sequence(node, path)
        if len(items) != 2:
            raise p.error(node, path, f"a link is two member indices [a, b], got {len(items)} entries")
        a, b = (p.integer(n, f"{path}[{i}]", 0, world - 1) for i, n in enumerate(items))
        if a == b:
            raise p.error(node, path, f"a link joins two different members, got [{a}, {b}]")
        return (a, b)
    if ps.type == "groups":
        groups: list[tuple[int, ...]] = []
        seen: set[int] = set()
        for i, g in enumerate(p.sequence(node, path, min_len=2)):
            members = tuple(p.integer(n, f"{path}[{i}][{j}]", 0, world - 1)
                            for j, n in enumerate(p.sequence(g, f"{path}[{i}]", min_len=1)))
            dup = seen.intersection(members)
            if dup or len(set(members)) != len(members):
                raise p.error(g, f"{path}[{i}]", f"member {sorted(dup or members)[0]} is in more than one group; "
                              "groups must be disjoint")
            seen.update(members)
            groups.append(members)
        return tuple(groups)
    raise AssertionError(ps.type)  # pragma: no cover


# ---------------------------------------------------------------------------------------


def load_scenario(path: str | os.PathLike[str]) -> Scenario:
    """Parse the scenario file at ``path``. Raises :class:`ScenarioError` when it cannot be
    read or is malformed."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the scenario file: {exc.strerror}") from None
    return parse_scenario(text, str(path))


def builtin_names() -> list[str]:
    """Names of the built-in scenarios (the files under ``chaos/scenarios/``)."""
    return sorted(f.stem for f in BUILTIN_DIR.glob("*.yaml"))


def builtin_scenarios() -> list[Scenario]:
    return [load_scenario(BUILTIN_DIR / f"{n}.yaml") for n in builtin_names()]


def find_scenario(ref: str) -> Scenario:
    """A scenario by file path or built-in name. Raises :class:`ScenarioError` naming the
    built-ins when ``ref`` is neither."""
    if os.path.exists(ref):
        return load_scenario(ref)
    if ref in builtin_names():
        return load_scenario(BUILTIN_DIR / f"{ref}.yaml")
    hint = difflib.get_close_matches(ref, builtin_names(), n=1)
    raise ScenarioError(f"{ref}: no such file and no built-in scenario of that name"
                        + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + "; `resilient chaos list` shows the built-ins")


def resolve_faults(scenario: Scenario, seed: int) -> tuple[Fault, ...]:
    """The scenario's faults for one seed: each ``member: random`` becomes a concrete
    member chosen from ``seed`` (distinct victims where possible), and a trigger at a ring
    phase of op N (``reduce_scatter``/``all_gather``) in a mixed workload moves to the first
    op >= N whose collective has that phase for this seed (op N may be a barrier or a small
    recursive-doubling allreduce, where the fault could never fire); the others unchanged."""
    import dataclasses
    import random

    from resilient.chaos.workload import op_spec_for, ring_phases

    rng = random.Random(seed * 7919 + 17)
    used = {f.member for f in scenario.faults if f.member is not None}
    out = []
    for f in scenario.faults:
        if f.params.get("member") == "random":
            pool = [m for m in range(scenario.world_size) if m not in used] or list(range(scenario.world_size))
            m = rng.choice(pool)
            used.add(m)
            f = f.resolve(m)
        t = f.trigger
        mix = scenario.workload.mix
        if t.op is not None and t.phase is not None and t.phase.failpoint_name in ("rs", "ag") and len(mix) > 1:
            op = t.op
            while t.phase.failpoint_name not in ring_phases(op_spec_for(op, seed, mix)) and op < t.op + 1000:
                op += 1
            f = dataclasses.replace(f, trigger=dataclasses.replace(t, op=op))
        out.append(f)
    return tuple(out)
