"""Network-namespace labs (chaos/netns.py) and the ``netem`` scenario run in namespaces.

Real namespaces, veths, bridge, tc and sockets where this machine allows them (root and a
working ``ip netns add``, probed); otherwise each test is skipped with the probed reason.
Every test checks that what it made is gone afterwards (``ip netns list`` / ``ip link``)."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from resilient.chaos import netns
from resilient.chaos.netns import NetnsLab

REASON = netns.netns_unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")


def _netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(": ", 2)[1].split("@")[0] for line in out.splitlines()}


def _lab_names(lab: NetnsLab) -> tuple[set[str], set[str]]:
    return set(lab.namespaces), {lab.bridge, *lab.host_veths}


def _assert_gone(namespaces: set[str], links: set[str]) -> None:
    assert not namespaces & _netns_list(), namespaces & _netns_list()
    assert not links & _links(), links & _links()


ECHO_SERVER = textwrap.dedent("""\
    import socket, sys
    s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen()
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    c.sendall(b"echo:" + c.recv(64)); c.close()
    """)
CLIENT = textwrap.dedent("""\
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    c.sendall(sys.argv[3].encode()); print(c.recv(64).decode(), flush=True)
    """)


def _round_trip(lab: NetnsLab, client_ns: int, host: str, port: int, text: str) -> str:
    res = subprocess.run([*lab.exec_prefix(client_ns), sys.executable, "-c", CLIENT, host, str(port), text],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _start_echo_server(lab: NetnsLab, ns: int) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([*lab.exec_prefix(ns), sys.executable, "-c", ECHO_SERVER, lab.ips[ns]],
                            stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "the echo server in the namespace printed no port within 60 s"
    return proc, int(proc.stdout.readline())


def _host_echo_server(addr: str) -> tuple[threading.Thread, int]:
    srv = socket.socket()
    srv.bind((addr, 0))
    srv.listen()
    srv.settimeout(60)

    def serve() -> None:
        with srv:
            c, _ = srv.accept()
            with c:
                c.sendall(b"echo:" + c.recv(64))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t, srv.getsockname()[1]


# -- probes ---------------------------------------------------------------------------------


def test_probes_answer_none_or_a_reason_naming_the_cause():
    for reason in (REASON, netns.qdisc_unavailable_reason("netem"), netns.netem_unavailable_reason()):
        assert reason is None or (isinstance(reason, str) and len(reason) > 20)
    assert "not a qdisc kind" in netns.qdisc_unavailable_reason("Bad Kind!")


@needs_netns
def test_qdisc_probe_names_a_missing_kind_with_tc_error():
    # a real probe on a throw-away veth: a kind no kernel has
    reason = netns.qdisc_unavailable_reason("nosuchqdisc")
    assert reason.startswith("this kernel has no nosuchqdisc qdisc (tc: Specified qdisc kind is unknown)"), reason
    assert "modprobe sch_nosuchqdisc" in reason
    assert not {x for x in _links() if x.startswith("rzq")}, "the probe left its veth behind"


def test_lab_rejects_bad_sizes():
    from resilient.errors import ConfigError

    for n in (0, 251, "2"):
        with pytest.raises(ConfigError, match="namespaces"):
            NetnsLab(n)  # type: ignore[arg-type]


# -- the lab --------------------------------------------------------------------------------


@needs_netns
def test_lab_builds_namespaces_round_trips_tcp_and_tears_down():
    with NetnsLab(3) as lab:
        names, links = _lab_names(lab)
        assert names <= _netns_list() and links <= _links()
        assert all(len(x) <= netns.IFNAMSIZ for x in links | set(lab.ns_veths))
        assert len({lab.host_ip, *lab.ips}) == 4 and lab.subnet.is_private
        # namespace 0 -> namespace 1 through the bridge
        server, port = _start_echo_server(lab, 1)
        try:
            assert _round_trip(lab, 0, lab.ips[1], port, "hello-ns1") == "echo:hello-ns1"
        finally:
            server.wait(timeout=30)
        # namespace 2 -> the host's bridge IP (where etcd and coordinators listen)
        t, port = _host_echo_server(lab.host_ip)
        assert _round_trip(lab, 2, lab.host_ip, port, "hello-host") == "echo:hello-host"
        t.join(timeout=30)
        # a namespace has its own stack: the host's other addresses are not its own
        res = subprocess.run([*lab.exec_prefix(0), "ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, check=True)
        assert f"{lab.ips[0]}/" in res.stdout and lab.host_ip not in res.stdout
    _assert_gone(names, links)


@needs_netns
def test_lab_tears_down_after_an_error_inside():
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsLab(2) as lab:
            names, links = _lab_names(lab)
            assert names <= _netns_list()
            raise RuntimeError("boom")
    _assert_gone(names, links)


LEFTOVER = textwrap.dedent("""\
    import json, sys, time
    from resilient.chaos.netns import NetnsLab
    lab = NetnsLab(2).open()
    print(json.dumps({"ns": lab.namespaces, "links": [lab.bridge, *lab.host_veths]}), flush=True)
    sys.stdin.read()  # until killed
    """)


@needs_netns
def test_leftovers_of_a_killed_run_are_cleaned_and_live_labs_kept():
    proc = subprocess.Popen([sys.executable, "-c", LEFTOVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the lab process printed nothing within 60 s"
        made = json.loads(proc.stdout.readline())
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no teardown runs
        proc.wait(timeout=30)
    names, links = set(made["ns"]), set(made["links"])
    assert names <= _netns_list() and links <= _links(), "SIGKILL should have left the lab behind"
    with NetnsLab(1) as live:  # opening a lab cleans leftovers of dead PIDs first
        _assert_gone(names, links)
        mine = set(live.namespaces)
        assert not mine & set(netns.cleanup_leftovers())  # our own live lab is not a leftover
        assert mine <= _netns_list()


def _qdiscs(lab: NetnsLab, i: int) -> str:
    """``tc qdisc show`` of member ``i``'s veth, inside its namespace."""
    return subprocess.run([*lab.exec_prefix(i), "tc", "qdisc", "show", "dev", lab.ns_veths[i]],
                          capture_output=True, text=True, check=True).stdout


@needs_netns
def test_link_shaping_classifies_only_traffic_between_the_two_namespaces():
    reason = netns.u32_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with NetnsLab(3) as lab:
        # pfifo leaf: the same htb + u32 tree netem uses, on a kernel that may lack netem
        lab.shape_link(0, 1, ["pfifo"])
        t, port = _host_echo_server(lab.host_ip)
        assert _round_trip(lab, 0, lab.host_ip, port, "to-host") == "echo:to-host"
        t.join(timeout=30)
        server, port = _start_echo_server(lab, 2)
        assert _round_trip(lab, 0, lab.ips[2], port, "to-2") == "echo:to-2"
        server.wait(timeout=30)
        assert lab.class_packets(0, 1) == 0, "traffic to the host or namespace 2 went through the 0-1 class"
        server, port = _start_echo_server(lab, 1)
        assert _round_trip(lab, 0, lab.ips[1], port, "to-1") == "echo:to-1"
        server.wait(timeout=30)
        assert lab.class_packets(0, 1) > 0 and lab.class_packets(1, 0) > 0  # both directions
        lab.clear_link(0, 1)
        qdiscs = _qdiscs(lab, 0)
        assert "htb" not in qdiscs and "pfifo " not in qdiscs, qdiscs


@needs_netns
def test_apply_netem_where_the_kernel_has_it():
    reason = netns.netem_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with NetnsLab(2) as lab:
        lab.apply_netem(0, 1, delay_ms=10, loss_pct=1)
        for i in (0, 1):
            out = _qdiscs(lab, i)
            assert "netem" in out and "delay 10ms" in out and "loss 1%" in out, out
        lab.clear_netem(0, 1)
        assert "netem" not in _qdiscs(lab, 0)


# -- the netem scenario through the runner -------------------------------------------------


def test_skip_reason_names_the_probed_netns_cause(monkeypatch):
    from resilient.chaos import runner
    from resilient.chaos.scenario import find_scenario

    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr(netns, "netns_unavailable_reason", lambda: "`ip netns add` failed here (EPERM)")
    reason = runner.skip_reason(find_scenario("netem"))
    assert reason == ("scenario 'netem' places its members in network namespaces for tc netem: "
                      "`ip netns add` failed here (EPERM)")
    assert runner.skip_reason(find_scenario("kill-reduce-scatter")) is None


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_netem_scenario_runs_members_in_namespaces(tmp_path):
    from resilient.chaos.runner import ChaosRunner
    from resilient.chaos.scenario import find_scenario
    from resilient.chaos.verifier import verify
    from resilient.coordinator import keys
    from resilient.coordinator.membership import MemberInfo

    seen: dict = {}

    def on_finished(r: ChaosRunner) -> None:  # members, etcd and the lab are still up here
        seen["lab_ips"] = list(r.lab.ips)
        seen["namespaces"], seen["links"] = _lab_names(r.lab)
        seen["present"] = seen["namespaces"] <= _netns_list()
        seen["etcd"] = r.etcd.endpoints
        seen["addresses"] = {MemberInfo.from_json(kv.value).member_id: MemberInfo.from_json(kv.value).address
                             for kv in r.store.get_prefix(keys.members(r.job))}

    runner = ChaosRunner(find_scenario("netem"), 0, tmp_path / "wd", on_finished=on_finished)
    log = runner.run()
    verdict = verify(log)
    assert verdict.wrong == [] and verdict.hangs == [] and verdict.lost == [], verdict
    assert verdict.passed and verdict.ops > 0 and verdict.results_checked >= 4 * verdict.ops
    # every member ran inside its own namespace, its transport bound to that namespace's IP,
    # and etcd listened on the bridge's host IP
    assert seen["present"]
    assert {m: a.rsplit(":", 1)[0] for m, a in seen["addresses"].items()} == {
        f"m{i}": ip for i, ip in enumerate(seen["lab_ips"])}
    assert all(e.rsplit(":", 1)[0] == runner.etcd.host for e in seen["etcd"]) and runner.etcd.host != "127.0.0.1"
    _assert_gone(seen["namespaces"], seen["links"])
    [event] = [f for f in log.faults if f.kind == "netem"]
    reason = netns.netem_unavailable_reason()
    if reason is None:  # a kernel with netem: injected on link 0-1 and removed after 4 s
        assert event.skipped is None and event.end_s is not None and verdict.faults == 1
    else:
        assert event.skipped == reason and verdict.faults == 0
        if netns.qdisc_unavailable_reason("netem") is not None:
            assert reason.startswith("this kernel has no netem qdisc (tc: "), reason


# -- the two-host scenario through the runner ----------------------------------------------


@needs_netns
@pytest.mark.timeout(120)
def test_two_host_scenario_kills_a_member_mid_hierarchical_allreduce_and_stays_exact(tmp_path):
    """``two-host-kill``: 2 emulated hosts of 2 members (shared namespaces, htb-capped host
    link); member 3 is SIGKILLed at the start of op 2's cross-host reduce-scatter. Every
    output is exact, the first plan is hierarchical, the survivors' plan carries the
    unequal hosts' slots, and the host-to-host traffic went through the capped class."""
    reason = netns.u32_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from resilient.chaos.runner import ChaosRunner
    from resilient.chaos.scenario import find_scenario
    from resilient.chaos.verifier import verify
    from resilient.coordinator import keys
    from resilient.coordinator.epoch import Epoch

    seen: dict = {}

    def on_finished(r: ChaosRunner) -> None:  # members, etcd and the lab are still up here
        seen["namespaces"], seen["links"] = _lab_names(r.lab)
        seen["epochs"] = [Epoch.from_json(kv.value) for kv in r.store.get_prefix(keys.root(r.job) + "epochs/")
                          if kv.key.endswith("/epoch")]
        seen["packets"] = (r.lab.class_packets(0, 1), r.lab.class_packets(1, 0))
        seen["classes"] = subprocess.run([*r.lab.exec_prefix(0), "tc", "class", "show", "dev", r.lab.ns_veths[0]],
                                         capture_output=True, text=True, check=True).stdout

    sc = find_scenario("two-host-kill")
    log = ChaosRunner(sc, 0, tmp_path / "wd", on_finished=on_finished).run()
    verdict = verify(log)
    assert verdict.wrong == [] and verdict.hangs == [] and verdict.lost == [], verdict
    assert verdict.passed and verdict.faults == 1 and verdict.ops == sc.workload.ops
    epochs = sorted(seen["epochs"], key=lambda e: e.number)
    first, last = epochs[0], epochs[-1]
    assert {m: i.host for m, i in first.infos.items()} == {"m0": "host0", "m1": "host0", "m2": "host1", "m3": "host1"}
    assert first.plan["host_groups"] == [[0, 2], [2, 2]] and "host_slots" not in first.plan
    assert last.members == ("m0", "m1", "m2") and last.plan["host_slots"] == [[0, 1], [0, 0]]
    assert min(seen["packets"]) > 0 and "rate 200Mbit ceil 200Mbit" in seen["classes"], seen
    _assert_gone(seen["namespaces"], seen["links"])
