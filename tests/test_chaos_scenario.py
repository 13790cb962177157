"""Scenario files: every malformed file gets an error naming its line and field; every
built-in scenario parses; the built-ins cover every fault kind and the named cases."""
from __future__ import annotations

import re
import textwrap

import pytest

from resilient.chaos import kinds
from resilient.chaos.faults import Phase
from resilient.chaos.scenario import builtin_names, builtin_scenarios, find_scenario, parse_scenario, resolve_faults
from resilient.errors import ConfigError, ScenarioError

GOOD = textwrap.dedent("""\
    name: t
    world_size: 4
    workload:
      ops: 5
      mix:
        - {collective: allreduce, op: sum, dtype: int64, numel: 64}
    faults:
      - kind: kill
        member: 1
        at: {op: 2, phase: rs, progress: 0.5}
    """)


def _error(text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(textwrap.dedent(text), "s.yaml")
    return str(info.value)


def _line_and_field(msg: str) -> tuple[int, str]:
    m = re.match(r"s\.yaml:(\d+): ([^:]+):", msg)
    assert m, f"error does not start with FILE:LINE: FIELD: -> {msg!r}"
    return int(m.group(1)), m.group(2)


def test_good_scenario_parses_with_its_values():
    s = parse_scenario(GOOD, "s.yaml")
    assert (s.name, s.world_size, s.workload.ops) == ("t", 4, 5)
    (f,) = s.faults
    assert f.kind is kinds.get("kill") and f.member == 1 and f.line == 8
    assert f.trigger.op == 2 and f.trigger.phase is Phase.REDUCE_SCATTER and f.trigger.progress == 0.5
    assert f.failpoint_spec() == "kill@op=2,phase=rs,frac=0.5"


def test_scenario_error_is_a_config_error():
    assert issubclass(ScenarioError, ConfigError)


def test_bad_yaml_names_the_line():
    msg = _error("""\
        world_size: 4
        workload:
          ops: 5
          mix: [ {collective: allreduce
        faults: []
        """)
    assert msg.startswith("s.yaml:5:") and "not valid YAML" in msg


def test_unknown_fault_kind_names_line_and_field_and_suggests():
    msg = _error(GOOD.replace("kind: kill", "kind: kil"))
    assert _line_and_field(msg) == (8, "faults[0].kind")
    assert "'kil'" in msg and "did you mean 'kill'" in msg


def test_missing_field_names_the_mapping_line_and_the_field():
    msg = _error(GOOD.replace("    member: 1\n", ""))
    assert _line_and_field(msg) == (8, "faults[0].member")
    assert "missing required field" in msg


def test_missing_world_size_names_the_field():
    msg = _error(GOOD.replace("world_size: 4\n", ""))
    assert _line_and_field(msg)[1] == "world_size" and "missing" in msg


def test_wrong_type_names_line_and_field():
    msg = _error(GOOD.replace("ops: 5", "ops: five"))
    assert _line_and_field(msg) == (4, "workload.ops")
    assert "must be an integer" in msg and "'five'" in msg


def test_bool_is_not_an_integer():
    msg = _error(GOOD.replace("member: 1", "member: true"))
    assert _line_and_field(msg) == (9, "faults[0].member")


def test_negative_time_names_line_and_field():
    text = GOOD.replace("at: {op: 2, phase: rs, progress: 0.5}", "at: {time_s: -1.5}")
    msg = _error(text)
    assert _line_and_field(msg) == (10, "faults[0].at.time_s")
    assert "must be >= 0" in msg and "-1.5" in msg


def test_unknown_field_suggests_the_close_one():
    msg = _error(GOOD.replace("world_size: 4", "world_size: 4\nop_timeout: 3"))
    assert _line_and_field(msg) == (3, "op_timeout") and "did you mean 'op_timeout_s'" in msg


def test_member_out_of_range():
    msg = _error(GOOD.replace("member: 1", "member: 4"))
    assert _line_and_field(msg) == (9, "faults[0].member") and "<= 3" in msg


def test_op_trigger_on_an_external_fault_is_rejected():
    text = GOOD + "  - {kind: drop_link, link: [0, 1], at: {op: 3}}\n"
    msg = _error(text)
    assert _line_and_field(msg) == (11, "faults[1].at.op") and "time_s" in msg


def test_etcd_kill_needs_three_members():
    text = GOOD + "  - {kind: etcd_kill, etcd_member: 0, at: {time_s: 1}}\n"
    msg = _error(text)
    assert _line_and_field(msg) == (11, "faults[1].kind") and "etcd_members: 3" in msg


def test_netem_needs_requires_root():
    text = GOOD + "  - {kind: netem, link: [0, 1], delay_ms: 5, at: {time_s: 1}}\n"
    msg = _error(text)
    assert _line_and_field(msg) == (11, "faults[1].kind") and "requires: [root]" in msg


def test_partition_groups_must_be_disjoint():
    text = GOOD + "  - kind: partition\n    groups: [[0, 1], [1, 2]]\n    at: {time_s: 1}\n"
    msg = _error(text)
    assert _line_and_field(msg) == (12, "faults[1].groups[1]") and "disjoint" in msg


def test_avg_on_integers_is_rejected():
    msg = _error(GOOD.replace("op: sum", "op: avg"))
    assert _line_and_field(msg) == (6, "workload.mix[0].op") and "floating dtype" in msg


def test_duplicate_key_is_rejected():
    msg = _error(GOOD.replace("world_size: 4", "world_size: 4\nworld_size: 5"))
    assert _line_and_field(msg) == (3, "world_size") and "twice" in msg


def test_empty_file():
    with pytest.raises(ScenarioError, match=r"s\.yaml:1: the file is empty"):
        parse_scenario("", "s.yaml")


def test_every_builtin_parses():
    names = builtin_names()
    assert len(names) >= 12
    for s in builtin_scenarios():
        assert s.name and s.description, s.source
        assert s.faults, f"{s.name} injects no fault"
        for seed in range(5):
            for f in resolve_faults(s, seed):
                assert f.member is None or 0 <= f.member < s.world_size


def test_builtins_cover_every_fault_kind_and_the_named_cases():
    scenarios = {s.name: s for s in builtin_scenarios()}
    covered = set().union(*(s.fault_kinds() for s in scenarios.values()))
    assert covered == set(kinds.builtin())
    phases = {f.trigger.phase for s in scenarios.values() for f in s.faults}
    assert {Phase.REDUCE_SCATTER, Phase.ALL_GATHER, Phase.RECOVERY} <= phases
    two = scenarios["two-kills-one-op"]
    assert len({f.trigger.op for f in two.faults}) == 1 and len(two.faults) == 2
    assert scenarios["etcd-member-loss"].etcd_members == 3
    assert scenarios["coordinator-leader-loss"].coordinators >= 2
    assert scenarios["netem"].requires == ("root",)
    assert len(scenarios["soak"].fault_kinds()) >= 5


def test_random_members_resolve_deterministically_per_seed():
    s = find_scenario("soak")
    assert resolve_faults(s, 3) == resolve_faults(s, 3)
    victims = {tuple(f.member for f in resolve_faults(s, seed) if f.member is not None) for seed in range(5)}
    assert len(victims) > 1  # seeds choose different victims


def test_find_scenario_unknown_name_suggests():
    with pytest.raises(ScenarioError, match="did you mean 'soak'"):
        find_scenario("soa")


def test_phase_triggers_land_on_an_op_that_has_that_phase():
    # soak's mix has barriers, broadcasts and small (recursive-doubling) allreduces: a
    # phase trigger at such an op could never fire, so it moves to the next op that has it
    from resilient.chaos.scenario import resolve_faults
    from resilient.chaos.workload import op_spec_for, ring_phases

    sc = find_scenario("soak")
    declared = [f.trigger.op for f in sc.faults if f.trigger.phase is not None]
    moved = 0
    for seed in range(10):
        phased = [f for f in resolve_faults(sc, seed) if f.trigger.phase is not None]
        assert len(phased) == len(declared)
        for f, op in zip(phased, declared):
            spec = op_spec_for(f.trigger.op, seed, sc.workload.mix)
            assert f.trigger.phase.failpoint_name in ring_phases(spec), (seed, f.trigger, spec)
            assert op <= f.trigger.op < op + 50
            moved += f.trigger.op != op
    assert moved > 0  # the mix really does put phase-less ops at the declared numbers


def test_hosts_place_members_in_contiguous_blocks_and_need_root():
    sc = parse_scenario("hosts: 2\nhost_link_mbit: 50\nrequires: [root]\n" + GOOD.replace("phase: rs", "phase: cross_rs"))
    assert sc.hosts == 2 and sc.host_link_mbit == 50.0 and sc.needs_netns()
    assert [sc.host_of(i) for i in range(4)] == [0, 0, 1, 1]
    assert sc.faults[0].failpoint_spec().startswith("kill@op=2,phase=cross_rs,")
    assert not parse_scenario(GOOD).needs_netns() and parse_scenario(GOOD).host_of(3) == 0
    msg = _error("hosts: 2\n" + GOOD)
    assert _line_and_field(msg) == (1, "hosts") and "requires: [root]" in msg
    msg = _error("host_link_mbit: 50\n" + GOOD)
    assert _line_and_field(msg) == (1, "host_link_mbit") and "hosts: N" in msg
    assert _line_and_field(_error("hosts: 5\nrequires: [root]\n" + GOOD)) == (1, "hosts")   # > world_size
    netem = "  - {kind: netem, link: [0, 1], delay_ms: 5, at: {time_s: 1}}\n"
    msg = _error("hosts: 2\nrequires: [root]\n" + GOOD + netem)
    assert _line_and_field(msg) == (1, "hosts") and "one namespace per member" in msg
