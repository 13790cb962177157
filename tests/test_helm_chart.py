"""The Helm chart, rendered by the real Helm v4 engine and validated against Kubernetes schemas.

Rendering uses PyPI ``helm-python-sdk`` (``helm_python``: Helm's Go SDK behind a C ABI, no
helm binary); every manifest is validated with PyPI ``kubernetes-validate`` in strict mode
(unknown fields rejected) against the schemas of :data:`KUBE_VERSION`. The Prometheus
operator kinds are CRDs that kubernetes-validate has no schema for: they are in an explicit
allowlist and checked for their apiVersion, kind and required fields instead.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script  # noqa: E402
import yaml

helm = pytest.importorskip("helm_python", reason="pip install -e '.[dev]' (helm-python-sdk)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = ROOT / "helm" / "resilient"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*.yaml"))
#: Oldest Kubernetes minor the chart targets that kubernetes-validate ships schemas for
#: (Chart.yaml says kubeVersion >= 1.27; 1.30 has batch/v1 Indexed Jobs with the
#: job-completion-index pod label and policy/v1 PDBs).
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "demo", "ml"

#: CRD kinds without a Kubernetes schema: (apiVersion, kind) -> required spec fields.
CRD_ALLOWLIST: dict[tuple[str, str], tuple[str, ...]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints"),
    ("monitoring.coreos.com/v1", "PodMonitor"): ("selector", "podMetricsEndpoints"),
}
RECOMMENDED_LABELS = (
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
    "app.kubernetes.io/component", "app.kubernetes.io/managed-by", "helm.sh/chart",
)


@pytest.fixture(scope="module")
def chart():
    return helm.Chart.load(str(CHART_DIR))


def load_values(path: Path | None) -> dict:
    return yaml.safe_load(path.read_text()) if path else {}


def render(chart, values: dict | None = None) -> dict[str, list[dict]]:
    """template path -> parsed documents (empty renders dropped)."""
    out = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    docs: dict[str, list[dict]] = {}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        parsed = [d for d in yaml.safe_load_all(text) if d]
        if parsed:
            docs[path] = parsed
    return docs


def objects(chart, values: dict | None = None) -> list[dict]:
    return [d for docs in render(chart, values).values() for d in docs]


def one(objs: list[dict], kind: str, component: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (
        component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def env_of(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


VALUE_SETS = [None, *CI_VALUES]
VALUE_IDS = ["default", *[p.stem for p in CI_VALUES]]


def test_ci_value_sets_exist():
    assert len(CI_VALUES) >= 3, "helm/resilient/ci/ should hold a few value sets"


@pytest.mark.parametrize("values_file", VALUE_SETS, ids=VALUE_IDS)
def test_every_manifest_validates_against_kubernetes_schemas(chart, values_file):
    objs = objects(chart, load_values(values_file))
    assert objs, "the chart rendered nothing"
    validated = 0
    for obj in objs:
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key in CRD_ALLOWLIST:
            assert obj["metadata"].get("name"), f"{key} without metadata.name"
            for field in CRD_ALLOWLIST[key]:
                assert obj.get("spec", {}).get(field), f"{key[1]} {obj['metadata']['name']}: spec.{field} missing"
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
        validated += 1
    assert validated >= 5


def test_validator_rejects_a_broken_manifest(chart):
    """Proof the schema check can fail: an unknown field in a rendered Job is caught."""
    job = one(objects(chart), "Job")
    job["spec"]["template"]["spec"]["containers"][0]["gpuCount"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values_file", VALUE_SETS, ids=VALUE_IDS)
def test_lint_is_clean(values_file):
    report = helm.lint(str(CHART_DIR), load_values(values_file), strict=True)
    assert report["errors"] == [], report["messages"]


@pytest.mark.parametrize("values_file", VALUE_SETS, ids=VALUE_IDS)
def test_labels_and_selectors(chart, values_file):
    objs = objects(chart, load_values(values_file))
    for obj in objs:
        labels = obj["metadata"].get("labels", {})
        missing = [k for k in RECOMMENDED_LABELS if k not in labels]
        assert not missing, f"{obj['kind']}/{obj['metadata']['name']} lacks labels {missing}"
        assert len(obj["metadata"]["name"]) <= 63
    # Every Service selects the pods of some workload of this release.
    pod_labels = [o["spec"]["template"]["metadata"]["labels"] for o in objs
                  if o["kind"] in ("StatefulSet", "Deployment", "Job")]
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= pl.items() for pl in pod_labels), f"Service {svc['metadata']['name']} selects no pod"
    for wl in (o for o in objs if o["kind"] in ("StatefulSet", "Deployment")):
        assert wl["spec"]["selector"]["matchLabels"].items() <= wl["spec"]["template"]["metadata"]["labels"].items()


def test_default_etcd_statefulset(chart):
    objs = objects(chart)
    sts = one(objs, "StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in headless["spec"]["ports"]} == {2379, 2380}
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    env = env_of(sts["spec"]["template"]["spec"]["containers"][0])
    members = env["ETCD_INITIAL_CLUSTER"].split(",")
    assert members == [
        f"demo-resilient-etcd-{i}=http://demo-resilient-etcd-{i}.demo-resilient-etcd-headless.ml.svc.cluster.local:2380"
        for i in range(3)]
    assert env["ETCD_INITIAL_CLUSTER_STATE"] == "new"
    assert "ETCD_CLIENT_CERT_AUTH" not in env
    pdb = one(objs, "PodDisruptionBudget", "etcd")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_default_coordinator(chart):
    objs = objects(chart)
    dep = one(objs, "Deployment", "coordinator")
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    args = c["command"] + c["args"]
    assert args[:2] == ["resilient", "coordinator"]
    endpoints = args[args.index("--etcd") + 1].split(",")
    assert endpoints == [f"demo-resilient-etcd-{i}.demo-resilient-etcd-headless.ml.svc.cluster.local:2379" for i in range(3)]
    assert args[args.index("--job") + 1] == RELEASE
    assert args[args.index("--metrics-port") + 1] == "9401"
    # it listens on the pod's address, from the downward API
    assert args[args.index("--metrics-host") + 1] == "$(POD_IP)"
    assert env_of(c)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert c["ports"] == [{"name": "metrics", "containerPort": 9401}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_default_workers_indexed_job(chart):
    objs = objects(chart)
    job = one(objs, "Job", "worker")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == pod["subdomain"])
    assert svc["spec"]["clusterIP"] == "None"
    c = pod["containers"][0]
    assert c["command"] == ["resilient-run"]
    assert c["args"] == ["--metrics-port", "9400", "python", "/workspace/train.py"]
    env = env_of(c)
    assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "1"
    assert env["PET_RDZV_BACKEND"] == "etcd" and env["PET_RDZV_ID"] == RELEASE
    assert env["PET_MAX_RESTARTS"] == "3"
    # multi-node: the agent's published address and the workers' data-plane listener are
    # the pod IP (downward API), never the loopback default; POD_IP comes first so that
    # Kubernetes expands $(POD_IP) in the later variables
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["PET_LOCAL_ADDR"] == env["RESILIENT_HOST"] == "$(POD_IP)"
    names = [e["name"] for e in c["env"]]
    assert names.index("POD_IP") < names.index("RESILIENT_HOST") and names.index("POD_IP") < names.index("PET_LOCAL_ADDR")
    assert env["PET_RDZV_ENDPOINT"].startswith("demo-resilient-etcd-0.demo-resilient-etcd-headless.ml.svc")
    assert env["PET_NODE_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    # resilient-run makes its own multiprocess directory under /tmp (a writable emptyDir).
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/dev/shm"} <= mounts
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_default_has_no_monitors_but_a_dashboard(chart):
    objs = objects(chart)
    assert not [o for o in objs if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["resilient.json"])
    assert dashboard["uid"] == "resilient-overview" and len(dashboard["panels"]) >= 8


def test_helm_test_hook(chart):
    objs = objects(chart)
    hooks = [o for o in objs if o["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    pod = one(hooks, "Pod")
    cm = one(hooks, "ConfigMap")
    assert int(cm["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0, "script must exist before the pod"
    assert cm["data"]["check_workers.py"] == (CHART_DIR / "files" / "check_workers.py").read_text().rstrip("\n")
    c = pod["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--job") + 1] == RELEASE
    assert args[args.index("--expect") + 1] == "2"  # 2 nodes x 1 process
    assert pod["spec"]["restartPolicy"] == "Never"


def test_gpu_monitoring_values(chart):
    objs = objects(chart, load_values(CHART_DIR / "ci" / "gpu-monitoring-values.yaml"))
    c = one(objs, "Job", "worker")["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["resources"]["limits"]["memory"] == "512Gi"
    env = env_of(c)
    assert env["PET_NPROC_PER_NODE"] == "8" and env["NCCL_DEBUG"] == "WARN"
    assert env["RESILIENT_ETCD_CA_CERT"] == "/etc/resilient/etcd-tls/ca.crt"
    sts_env = env_of(one(objs, "StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0])
    assert sts_env["ETCD_CLIENT_CERT_AUTH"] == "true"
    assert sts_env["ETCD_LISTEN_CLIENT_URLS"].startswith("https://")
    assert all(m.split("=", 1)[1].startswith("https://") for m in sts_env["ETCD_INITIAL_CLUSTER"].split(","))
    sm = one(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchExpressions"][0]["values"] == ["coordinator", "etcd"]
    services = [o for o in objs if o["kind"] == "Service"
                and o["metadata"]["labels"]["app.kubernetes.io/component"] in ("coordinator", "etcd")
                and any(p["name"] == "metrics" for p in o["spec"]["ports"])]
    assert len(services) == 2, "coordinator and etcd client Services expose the monitored port"
    pm = one(objs, "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard"))
    assert cm["metadata"]["labels"]["team"] == "ml-infra"


def test_external_etcd_values(chart):
    objs = objects(chart, load_values(CHART_DIR / "ci" / "external-etcd-values.yaml"))
    assert not [o for o in objs if o["kind"] in ("StatefulSet", "PodDisruptionBudget")]
    assert not [o for o in objs if o["metadata"]["labels"].get("app.kubernetes.io/component") == "etcd"]
    env = env_of(one(objs, "Job", "worker")["spec"]["template"]["spec"]["containers"][0])
    assert env["PET_NNODES"] == "4:8"
    assert env["PET_RDZV_ID"] == "llm-pretrain"
    assert env["PET_RDZV_ENDPOINT"].split(",") == [f"etcd-{i}.etcd.infra.svc.cluster.local:2379" for i in range(3)]
    args = one([o for o in objs if o["kind"] == "Pod"], "Pod")["spec"]["containers"][0]["args"]
    assert args[args.index("--expect") + 1] == "8"  # minNodes 4 x 2 processes


# -- bad values ---------------------------------------------------------------------------

BAD_VALUES = [
    ({"coordinator": {"replicas": -1}}, "/coordinator/replicas", "minimum"),
    ({"etcd": {"replicas": -3}}, "/etcd/replicas", "minimum"),
    ({"workers": {"nodes": -2}}, "/workers/nodes", "minimum"),
    ({"workers": {"maxRestarts": -1}}, "/workers/maxRestarts", "minimum"),
    ({"replicaCount": 3}, "'replicaCount'", "additional properties"),
    ({"workers": {"gpus": 8}}, "'gpus'", "additional properties"),
    ({"etcd": {"persistence": {"sise": "1Gi"}}}, "'sise'", "additional properties"),
    ({"workers": {"nodes": "two"}}, "/workers/nodes", "integer"),
    ({"workers": {"restartPolicy": "Always"}}, "/workers/restartPolicy", "must be one of"),
    ({"coordinator": {"metricsPort": 70000}}, "/coordinator/metricsPort", "maximum"),
    ({"etcd": {"enabled": False}}, "/etcd/endpoints", "minItems"),
    ({"etcd": {"tls": {"enabled": True}}}, "/etcd/tls/existingSecret", "minLength"),
]


@pytest.mark.parametrize("values,key,constraint", BAD_VALUES, ids=[k for _, k, _ in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_key(chart, values, key, constraint):
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(info.value)
    assert key in message and constraint in message, message
    # The same check runs at lint (helm lint) time.
    assert any(key in e for e in helm.lint(str(CHART_DIR), values)["errors"])


def test_min_nodes_above_nodes_is_a_clear_error(chart):
    with pytest.raises(helm.HelmRenderError, match=r"workers.minNodes \(5\) is larger than workers.nodes \(2\)"):
        chart.render({"workers": {"minNodes": 5}}, name=RELEASE, namespace=NAMESPACE)


def test_values_file_matches_schema_keys(chart):
    """values.yaml documents every key the schema allows (no hidden knobs, no dead keys)."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())

    def walk(node: dict, sch: dict, path: str) -> None:
        if sch.get("additionalProperties") is not False:
            return
        allowed = set(sch["properties"]) - {"global"}
        assert set(node) == allowed, f"{path or '/'}: values.yaml keys {sorted(node)} vs schema {sorted(allowed)}"
        for k, v in node.items():
            # resources mirrors Kubernetes' ResourceRequirements: defaults set only some keys.
            if isinstance(v, dict) and k != "resources" and sch["properties"][k].get("type") == "object":
                walk(v, sch["properties"][k], f"{path}/{k}")

    walk(defaults, schema, "")


# -- the helm test script (pure logic) ------------------------------------------------------

def _check_workers():
    return load_script(CHART_DIR / "files" / "check_workers.py", "check_workers")


@pytest.mark.parametrize("status,expect,ok,fragment", [
    ({"epoch": {"number": 3, "members": ["a", "b"]}, "leader": "c0"}, 2, True, "2 members"),
    ({"epoch": {"number": 3, "members": [{"id": "a"}, {"id": "b"}, {"id": "c"}]}, "leader": {"id": "c0"}}, 2, True, "3 members"),
    ({"epoch": {"number": 3, "members": ["a"]}, "leader": "c0"}, 2, False, "1 of 2 expected members: a"),
    ({"epoch": {"number": 3, "members": ["a", "b"]}, "leader": None}, 2, False, "no coordinator leads"),
    ({"epoch": None, "leader": "c0"}, 2, False, "no epoch published"),
    ({"epoch": {"number": 1}, "leader": "c0"}, 1, False, "epoch.members"),
    ([], 1, False, "expected a JSON object"),
])
def test_check_workers_evaluate(status, expect, ok, fragment):
    got_ok, reason = _check_workers().evaluate(status, expect)
    assert got_ok is ok and fragment in reason, reason


def test_etcd_client_credentials_reach_every_client_pod(chart):
    """etcd.clientAuth.existingSecret: coordinator, workers and the test pod get the user
    from the Secret and the password as a file (docs/security.md); etcd pods do not."""
    objs = objects(chart, {"etcd": {"clientAuth": {"existingSecret": "train-etcd-user"}}})
    pods = [one(objs, "Deployment", "coordinator")["spec"]["template"]["spec"],
            one(objs, "Job", "worker")["spec"]["template"]["spec"],
            one([o for o in objs if o["kind"] == "Pod"], "Pod")["spec"]]
    for spec in pods:
        c = spec["containers"][0]
        env = env_of(c)
        assert env["RESILIENT_ETCD_USER"] == {"secretKeyRef": {"name": "train-etcd-user", "key": "username"}}
        assert env["RESILIENT_ETCD_PASSWORD_FILE"] == "/etc/resilient/etcd-auth/password"
        assert {"name": "etcd-auth", "mountPath": "/etc/resilient/etcd-auth", "readOnly": True} in c["volumeMounts"]
        vol = next(v for v in spec["volumes"] if v["name"] == "etcd-auth")
        assert vol["secret"]["secretName"] == "train-etcd-user" and vol["secret"]["defaultMode"] == 0o440
    sts = one(objs, "StatefulSet", "etcd")["spec"]["template"]["spec"]
    assert all(v["name"] != "etcd-auth" for v in sts.get("volumes", []))
    for o in objects(chart, {}):
        if o["kind"] in ("Deployment", "Job"):
            assert "RESILIENT_ETCD_USER" not in env_of(o["spec"]["template"]["spec"]["containers"][0])


def test_scale_values_put_grpc_proxies_between_agents_and_etcd(chart):
    """docs/scale.md: workers reach etcd through the proxy Service, the coordinator directly."""
    objs = objects(chart, load_values(CHART_DIR / "ci" / "scale-values.yaml"))
    proxy = one(objs, "Deployment", "etcd-proxy")
    assert proxy["spec"]["replicas"] == 4
    args = proxy["spec"]["template"]["spec"]["containers"][0]["args"]
    members = [f"http://demo-resilient-etcd-{i}.demo-resilient-etcd-headless.ml.svc.cluster.local:2379" for i in range(3)]
    assert f"--endpoints={','.join(members)}" in args
    svc = one(objs, "Service", "etcd-proxy")
    env = env_of(one(objs, "Job", "worker")["spec"]["template"]["spec"]["containers"][0])
    assert env["PET_RDZV_ENDPOINT"] == f"{svc['metadata']['name']}.ml.svc.cluster.local:2379"
    coord = one(objs, "Deployment", "coordinator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ",".join(m[len("http://"):] for m in members) in coord
    assert not [o for o in objects(chart) if o["metadata"]["labels"].get("app.kubernetes.io/component") == "etcd-proxy"]


def test_grpc_proxy_with_etcd_tls_is_a_clear_error(chart):
    with pytest.raises(helm.HelmRenderError, match="etcdGrpcProxy.enabled needs a plain-HTTP etcd"):
        chart.render({"etcdGrpcProxy": {"enabled": True}, "etcd": {"tls": {"enabled": True, "existingSecret": "s"}}},
                     name=RELEASE, namespace=NAMESPACE)
