"""`resilient chaos list|check|run|k8s` as a real command, and the Chaos Mesh export:
the output parses as YAML with the right kinds, actions and label selectors."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from resilient.chaos.k8s import INDEX_LABEL, to_manifests
from resilient.chaos.scenario import builtin_names, find_scenario

CLI = [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_chaos_list_prints_every_builtin_on_one_line():
    p = _cli("chaos", "list")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == builtin_names()
    assert all(len(ln.split(None, 1)) == 2 for ln in lines)  # name + description


def test_chaos_check_reports_line_and_field_for_a_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("world_size: 4\nworkload: {ops: 3, mix: [{collective: allreduce}]}\n"
                   "faults:\n  - {kind: explode, member: 1, at: {time_s: 1}}\n")
    p = _cli("chaos", "check", str(bad))
    assert p.returncode == 2
    assert f"{bad}:4: faults[0].kind: 'explode' is not one of" in p.stderr
    ok = _cli("chaos", "check", "kill-reduce-scatter", "soak")
    assert ok.returncode == 0 and ok.stdout.count(": ok: ") == 2


def test_chaos_run_unknown_name_is_a_clear_error():
    p = _cli("chaos", "run", "kill-reduce-scater")
    assert p.returncode == 2 and "did you mean 'kill-reduce-scatter'" in p.stderr


def test_chaos_run_rejects_zero_seeds():
    p = _cli("chaos", "run", "soak", "--seeds", "0")
    assert p.returncode == 2 and "must be at least 1" in p.stderr


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _chaos_objects(docs: list[dict]) -> list[tuple[str, dict]]:
    """(kind, spec) of every chaos object, inside a Workflow or standalone."""
    out = []
    for d in docs:
        assert d["apiVersion"] == "chaos-mesh.org/v1alpha1"
        if d["kind"] == "Workflow":
            for t in d["spec"]["templates"]:
                if t["templateType"] in ("PodChaos", "NetworkChaos", "StressChaos"):
                    key = t["templateType"][0].lower() + t["templateType"][1:]
                    out.append((t["templateType"], t[key]))
        else:
            out.append((d["kind"], d["spec"]))
    return out


def test_chaos_k8s_soak_is_one_timed_workflow(tmp_path):
    out = tmp_path / "soak.yaml"
    p = _cli("chaos", "k8s", "soak", "--namespace", "ml", "--release", "r1", "-o", str(out))
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    docs = _docs(text)
    assert [d["kind"] for d in docs] == ["Workflow"]
    wf = docs[0]
    names = {t["name"]: t for t in wf["spec"]["templates"]}
    entry = names[wf["spec"]["entry"]]
    assert entry["templateType"] == "Parallel"
    for branch in entry["children"]:  # every branch waits, then injects
        steps = names[branch]["children"]
        assert names[steps[0]]["templateType"] == "Suspend" and names[steps[0]]["deadline"].endswith("s")
    objs = _chaos_objects(docs)
    actions = {(k, s["action"]) for k, s in objs}
    assert {("PodChaos", "pod-kill"), ("NetworkChaos", "delay"), ("NetworkChaos", "partition")} <= actions
    for _, spec in objs:
        labels = spec["selector"]["labelSelectors"]
        assert labels["app.kubernetes.io/name"] == "resilient" and labels["app.kubernetes.io/instance"] == "r1"
        assert labels["app.kubernetes.io/component"] in ("worker", "coordinator", "etcd")
        assert spec["selector"]["namespaces"] == ["ml"]
    comps = {s["selector"]["labelSelectors"]["app.kubernetes.io/component"] for _, s in objs}
    assert comps == {"worker", "coordinator", "etcd"}
    # op-triggered kills/hang cannot be timed by Chaos Mesh: named as failpoints instead
    assert text.count("RESILIENT_FAILPOINTS=") == 3


def test_k8s_kill_selects_the_worker_by_completion_index():
    sc = find_scenario("coordinator-leader-loss")
    docs, failpoints = to_manifests(sc, flat=True)
    assert not failpoints
    kinds = [(d["kind"], d["spec"]["action"], d["spec"]["selector"]["labelSelectors"]["app.kubernetes.io/component"])
             for d in docs]
    assert kinds == [("PodChaos", "pod-kill", "coordinator"), ("PodChaos", "pod-kill", "worker")]
    assert docs[1]["spec"]["selector"]["labelSelectors"][INDEX_LABEL] == "1"


def test_k8s_partition_and_drop_link_target_the_other_side():
    (part,), _ = to_manifests(find_scenario("partition"), flat=True)
    spec = part["spec"]
    assert (part["kind"], spec["action"], spec["direction"], spec["duration"]) == ("NetworkChaos", "partition",
                                                                                 "both", "3s")
    assert spec["selector"]["expressionSelectors"] == [{"key": INDEX_LABEL, "operator": "In",
                                                        "values": ["0", "1", "2"]}]
    assert spec["target"]["selector"]["labelSelectors"][INDEX_LABEL] == "3"
    (drop,), _ = to_manifests(find_scenario("drop-link"), flat=True)
    assert drop["spec"]["selector"]["labelSelectors"][INDEX_LABEL] == "1"
    assert drop["spec"]["target"]["selector"]["labelSelectors"][INDEX_LABEL] == "2"


def test_k8s_op_triggered_only_scenario_yields_failpoints():
    docs, failpoints = to_manifests(find_scenario("kill-reduce-scatter"))
    assert docs == [] and len(failpoints) == 1
    assert failpoints[0].member == 1 and failpoints[0].env == "RESILIENT_FAILPOINTS=kill@op=3,phase=rs,frac=0.5"


@pytest.mark.parametrize("name", builtin_names())
def test_k8s_every_builtin_renders_valid_yaml(name):
    from resilient.chaos.k8s import render

    for flat in (False, True):
        docs = _docs(render(find_scenario(name), "default", "rel", flat))
        for d in docs:
            assert d["metadata"]["namespace"] == "default"
            assert len(d["metadata"]["name"]) <= 63
        for kind, spec in _chaos_objects(docs):
            assert kind in ("PodChaos", "NetworkChaos", "StressChaos") and spec["mode"] in ("one", "all")
