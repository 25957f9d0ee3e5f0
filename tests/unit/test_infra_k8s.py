"""infra/k8s: the kustomize overlays render, every manifest validates, and the parts fit together.

Rendering: tuneloop/infra.py's renderer always; where kubectl is installed, `kubectl
kustomize` too, and both must give the same manifests. Validation: built-in kinds against the
Kubernetes 1.33 OpenAPI schemas (kubernetes-validate, strict), ServiceMonitor against
infra/k8s/crds/servicemonitor.schema.json. Then what no schema can see: probes and shutdown
timing against the serving config, selectors and ports that must meet, the HPA's metric
against the one the server exports and the one prometheus-adapter serves, which pods the
NetworkPolicies leave reachable from outside the namespace, secrets referenced by name only,
every $(VAR) defined, every TUNELOOP_* variable accepted by the config schema, MLflow's flags
parsed by MLflow's own CLI.
"""

from __future__ import annotations

import copy
import shutil
import subprocess

import pytest
import yaml

from tuneloop.config import ServingConfig, load_config
from tuneloop.infra import (
    K8S_DIR,
    K8S_VERSION,
    KustomizeError,
    container_var_refs,
    manifest_key,
    render_kustomization,
    strategic_merge,
    validate_manifest,
)
from tuneloop.packaging.bento import TARGETS

OVERLAYS = ["cpu", "gpu"]
NAMESPACE = "tuneloop"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render_kustomization(K8S_DIR / "overlays" / request.param)


def find(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(docs):
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(doc):
    return doc["spec"]["template"]["spec"]["containers"]


def bento(docs):
    return find(docs, "Deployment", "tuneloop-api")


def bento_container(docs):
    (c,) = [c for c in containers(bento(docs)) if c["name"] == "bento"]
    return c


def env_value(container, name):
    values = [e.get("value") for e in container.get("env", []) if e["name"] == name]
    assert len(values) <= 1, f"{name} set twice"
    return values[0] if values else None


# ---------------------------------------------------------------------------------------
# rendering


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: the Python renderer alone")
@pytest.mark.parametrize("name", OVERLAYS)
def test_python_renderer_matches_kubectl_kustomize(name):
    path = K8S_DIR / "overlays" / name
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True).stdout
    theirs = {manifest_key(d): d for d in yaml.safe_load_all(out) if d}
    ours = {manifest_key(d): d for d in render_kustomization(path)}
    assert set(ours) == set(theirs)
    for key in ours:
        assert ours[key] == theirs[key], key


def test_renderer_strategic_merge_follows_kustomize():
    base = {
        "spec": {
            "containers": [
                {
                    "name": "x",
                    "image": "a",
                    "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                    "ports": [{"containerPort": 1}],
                },
                {"name": "y", "image": "b"},
            ],
            "tolerations": [{"key": "a"}],
            "nodeSelector": {"a": "1", "b": "2"},
        }
    }
    patch = {
        "spec": {
            "containers": [
                {"name": "z", "image": "c"},
                {
                    "name": "x",
                    "env": [{"name": "C", "value": "3"}, {"name": "B", "value": "22"}],
                    "ports": [{"containerPort": 2}],
                },
            ],
            "tolerations": [{"key": "b"}],
            "nodeSelector": {"b": None, "c": "3"},
        }
    }
    out = strategic_merge(base, patch)
    # kustomize (kubectl 1.32, kustomize 5.5): the patch's items first, in its order, then the rest.
    assert [c["name"] for c in out["spec"]["containers"]] == ["z", "x", "y"]
    x = out["spec"]["containers"][1]
    assert x["env"] == [{"name": "C", "value": "3"}, {"name": "B", "value": "22"}, {"name": "A", "value": "1"}]
    assert x["ports"] == [{"containerPort": 2}, {"containerPort": 1}] and x["image"] == "a"
    assert out["spec"]["tolerations"] == [{"key": "b"}]  # no merge key: replaced
    assert out["spec"]["nodeSelector"] == {"a": "1", "c": "3"}  # null deletes
    assert base["spec"]["containers"][0]["env"][1]["value"] == "2"  # the input is not changed


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(KustomizeError, match="namePrefix"):
        render_kustomization(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("configMapGenerator: [{name: a, literals: [k=v]}]\n")
    with pytest.raises(KustomizeError, match="disableNameSuffixHash"):
        render_kustomization(tmp_path)
    (tmp_path / "d.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\ndata: {k: v}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [d.yaml]\npatches: [{path: p.yaml}]\n")
    with pytest.raises(KustomizeError, match="matches no resource"):
        render_kustomization(tmp_path)


# ---------------------------------------------------------------------------------------
# validation


def test_every_manifest_validates(overlay):
    name, docs = overlay
    errors = [e for d in docs for e in validate_manifest(d)]
    assert not errors, "\n".join(errors)
    kinds = {d["kind"] for d in docs}
    assert {
        "Namespace",
        "Deployment",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "ConfigMap",
        "PersistentVolumeClaim",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    } <= kinds


def test_validation_catches_typos(overlay):
    _, docs = overlay
    dep = copy.deepcopy(bento(docs))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    assert validate_manifest(dep)
    sm = copy.deepcopy(find(docs, "ServiceMonitor", "tuneloop-api"))
    sm["spec"]["endpoints"][0]["paht"] = "/metrics"
    assert validate_manifest(sm)
    sm = copy.deepcopy(find(docs, "ServiceMonitor", "tuneloop-api"))
    sm["spec"]["endpoints"][0]["interval"] = "15 seconds"
    assert validate_manifest(sm)
    del sm["spec"]["selector"]
    assert any("selector" in e for e in validate_manifest(sm))
    assert validate_manifest({"apiVersion": "example.com/v1", "kind": "Unknown", "metadata": {"name": "x"}})


def test_stated_kubernetes_version_is_shipped():
    import kubernetes_validate.utils as kv

    assert K8S_VERSION.rsplit(".", 1)[0] in [v.rsplit(".", 1)[0] for v in kv.all_versions()]


def test_namespace_and_labels(overlay):
    _, docs = overlay
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tuneloop", manifest_key(d)
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == NAMESPACE, manifest_key(d)
    for rb in (d for d in docs if d["kind"] == "RoleBinding"):
        assert all(s["namespace"] == NAMESPACE for s in rb["subjects"])
        find(docs, "Role", rb["roleRef"]["name"])
        for s in rb["subjects"]:
            find(docs, "ServiceAccount", s["name"])


# ---------------------------------------------------------------------------------------
# serving


def test_serving_probes_and_graceful_shutdown(overlay):
    _, docs = overlay
    dep = bento(docs)
    c = bento_container(docs)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert {"name": "http", "containerPort": 3000} in c["ports"]
    strategy = dep["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    # preStop: endpoints drop the pod while /readyz is still green; then every stream (at most
    # serving.request_timeout_s) must finish before SIGKILL.
    sleep_s = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep_s >= 5
    timeout = env_value(c, "TUNELOOP__SERVING__REQUEST_TIMEOUT_S")
    longest_stream = float(timeout) if timeout is not None else ServingConfig().request_timeout_s
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > sleep_s + longest_stream
    # start-up (load, compile, warm-up) is covered by the startup probe, not killed by liveness
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_service_pdb_servicemonitor_and_hpa_meet_the_pods(overlay):
    _, docs = overlay
    dep = bento(docs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(dep["spec"]["selector"], pod_labels)
    svc = find(docs, "Service", "tuneloop-api")
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels)
    port_names = {p["name"] for p in bento_container(docs)["ports"]}
    assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])
    pdb = find(docs, "PodDisruptionBudget", "tuneloop-api")
    assert selects(pdb["spec"]["selector"], pod_labels)
    sm = find(docs, "ServiceMonitor", "tuneloop-api")
    assert selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    hpa = find(docs, "HorizontalPodAutoscaler", "tuneloop-api")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", "tuneloop-api")
    # with maxUnavailable 1 and at least 2 replicas, a drain always leaves one serving
    assert pdb["spec"]["maxUnavailable"] == 1 and hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]


def test_scrape_job_label_is_the_one_rules_and_dashboard_use(overlay):
    _, docs = overlay
    svc = find(docs, "Service", "tuneloop-api")
    sm = find(docs, "ServiceMonitor", "tuneloop-api")
    job = svc["metadata"]["labels"][sm["spec"]["jobLabel"]]
    rules = (K8S_DIR.parent.parent / "monitoring" / "prometheus" / "rules.yml").read_text()
    assert f'up{{job="{job}"}}' in rules


def test_autoscaling_on_queue_depth_through_prometheus_adapter(overlay):
    from prometheus_client import CollectorRegistry

    from tuneloop.serving.metrics import ServingMetrics

    _, docs = overlay
    hpa = find(docs, "HorizontalPodAutoscaler", "tuneloop-api")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods", "queue depth per pod, not CPU/GPU utilisation"
    name = metric["pods"]["metric"]["name"]
    assert metric["pods"]["target"]["type"] == "AverageValue"
    # the server exports it (tuneloop/serving/metrics.py) ...
    registry = CollectorRegistry()
    ServingMetrics("m:1", "slots", registry=registry)
    exported = {m.name for m in registry.collect()}
    assert name in exported and name == "tuneloop_num_requests_waiting"
    # ... and prometheus-adapter serves it under that name, per pod and namespace
    values = yaml.safe_load((K8S_DIR / "prometheus-adapter" / "values.yaml").read_text())
    import re

    served = []
    for rule in values["rules"]["custom"]:
        series = rule["seriesQuery"].split("{")[0]
        if re.search(rule["name"]["matches"], series):
            served.append(re.sub(rule["name"]["matches"], rule["name"]["as"], series))
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    assert name in served


def test_overlay_images_are_the_bento_targets():
    for overlay, target in (("cpu", "cpu"), ("gpu", "gpu")):
        docs = render_kustomization(K8S_DIR / "overlays" / overlay)
        image = bento_container(docs)["image"]
        # containerize_command names the image after the bento: tuneloop_llm(_cuda) -> tuneloop-llm(-cuda)
        assert image.split(":")[0] == TARGETS[target][0].replace("_", "-"), (overlay, image)
        assert ":" in image


def test_gpu_overlay():
    docs = render_kustomization(K8S_DIR / "overlays" / "gpu")
    c = bento_container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] >= 1
    pod = bento(docs)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    env = {e["name"]: e.get("value") for e in c["env"]}
    cfg = load_config(environ={k: v for k, v in env.items() if k.startswith("TUNELOOP__SERVING__") and v})
    assert cfg.serving.engine == "vllm"
    cpu = render_kustomization(K8S_DIR / "overlays" / "cpu")
    assert "nvidia.com/gpu" not in str(bento_container(cpu)["resources"])
    assert env_value(bento_container(cpu), "TUNELOOP__SERVING__ENGINE") is None  # the default engine
    # torch threads match the CPU request (its default is every core of the node)
    cc = bento_container(cpu)
    assert int(env_value(cc, "TUNELOOP__SERVING__NUM_THREADS")) == int(cc["resources"]["requests"]["cpu"])


# ---------------------------------------------------------------------------------------
# configuration and secrets


def test_secrets_by_reference_only(overlay):
    _, docs = overlay
    assert not [d for d in docs if d["kind"] == "Secret"], "no Secret with values in the manifests"
    examples = yaml.safe_load_all((K8S_DIR / "secrets.example.yaml").read_text())
    example_keys = {d["metadata"]["name"]: set(d["stringData"]) for d in examples}
    refs = []
    for w in workloads(docs):
        for c in containers(w):
            for e in c.get("env", []):
                assert "value" in e or "valueFrom" in e
                if "secretKeyRef" in e.get("valueFrom", {}):
                    refs.append(e["valueFrom"]["secretKeyRef"])
    assert refs
    for ref in refs:
        assert ref["key"] in example_keys.get(ref["name"], set()), ref
    # the example file is not part of any kustomization
    for path in K8S_DIR.rglob("kustomization.yaml"):
        assert "secrets.example" not in path.read_text()


def _pod_envs(docs):
    for w in workloads(docs):
        for c in containers(w):
            yield f"{w['metadata']['name']}/{c['name']}", c


def test_every_var_reference_is_defined_before_use(overlay):
    _, docs = overlay
    for where, c in _pod_envs(docs):
        defined: list[str] = []
        for e in c.get("env", []):
            for ref in container_var_refs(e.get("value", "")):
                assert ref in defined, f"{where}: env {e['name']} uses $({ref}) before it is defined"
            defined.append(e["name"])
        for text in [*c.get("command", []), *c.get("args", [])]:
            for ref in container_var_refs(text):
                assert ref in defined, f"{where}: $({ref}) in the command is not in its env"


def test_tuneloop_environment_is_accepted_by_the_config_schema(overlay):
    _, docs = overlay
    checked = 0
    for _where, c in _pod_envs(docs):
        env = {}
        for e in c.get("env", []):
            value = e.get("value", "secret-value")
            for ref in container_var_refs(value):
                value = value.replace(f"$({ref})", env.get(ref, "x"))
            env[e["name"]] = value
        tuneloop = {k: v for k, v in env.items() if k.startswith("TUNELOOP_") and k != "TUNELOOP_KEY_PEPPER"}
        if tuneloop:
            checked += 1
            cfg = load_config(environ=tuneloop)  # raises ConfigError on an unknown section/key or a bad value
            if "TUNELOOP__REQUEST_LOG__URL" in tuneloop:
                import sqlalchemy

                assert cfg.request_log.url.startswith("postgresql+psycopg://")
                for url in (cfg.request_log.url, cfg.gateway.key_store_url):
                    sqlalchemy.create_engine(url)  # its driver (psycopg, in requirements.lock) imports; no connection
    assert checked


def test_mlflow_server_flags_parse_and_allow_the_hosts_clients_use(overlay):
    from mlflow.cli import server
    from mlflow.server.security_utils import is_allowed_host_header, is_health_endpoint

    _, docs = overlay
    c = containers(find(docs, "Deployment", "mlflow"))[0]
    assert c["command"] == ["mlflow"] and c["args"][0] == "server"
    ctx = server.make_context("server", list(c["args"][1:]))  # MLflow's own CLI parses them
    assert ctx.params["serve_artifacts"] is True
    assert ctx.params["backend_store_uri"].startswith("postgresql://")
    assert ctx.params["artifacts_destination"].startswith("s3://")
    allowed = [h.strip() for h in ctx.params["allowed_hosts"].split(",")]
    for host in ("mlflow:5000", "mlflow.tuneloop.svc.cluster.local:5000", "localhost:5000"):
        assert is_allowed_host_header(allowed, host), host
    assert not is_allowed_host_header(allowed, "evil.example.com:5000")
    probe = c["readinessProbe"]["httpGet"]["path"]
    assert is_health_endpoint(probe)  # kubelet's Host header is the pod IP: the probe path is exempt


def test_postgres_creates_the_databases_the_urls_name(overlay):
    _, docs = overlay
    sql = (K8S_DIR / "base" / "postgres" / "create-databases.sql").read_text()
    ss = find(docs, "StatefulSet", "postgres")
    pg = containers(ss)[0]
    created = {env_value(pg, "POSTGRES_DB")} | {
        line.split()[2].rstrip(";") for line in sql.splitlines() if line.upper().startswith("CREATE DATABASE")
    }
    import re

    used = set()
    for _, c in _pod_envs(docs):
        for text in [*(e.get("value", "") for e in c.get("env", [])), *c.get("args", [])]:
            used |= set(re.findall(r"@postgres:5432/(\w+)", text))
    assert used and used <= created, used - created
    assert ss["spec"]["serviceName"] == "postgres"
    svc = find(docs, "Service", "postgres")
    assert svc["spec"]["clusterIP"] == "None"
    init = find(docs, "ConfigMap", "postgres-init")
    assert init["data"]["create-databases.sql"] == sql


# ---------------------------------------------------------------------------------------
# network policies


def selects(selector, labels) -> bool:
    """A Kubernetes LabelSelector against a label set."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def reachable_from_outside(policies, labels, port) -> bool:
    """Could a pod in another namespace open `port` on a pod with `labels` (NetworkPolicy semantics)?"""
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and selects(p["spec"]["podSelector"], labels)
    ]
    if not selecting:
        return True  # no policy isolates the pod
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and not any(p.get("port") in (port, None) for p in rule["ports"]):
                continue
            peers = rule.get("from")
            if not peers:
                return True  # every source
            for peer in peers:
                if "ipBlock" in peer:
                    return True
                ns = peer.get("namespaceSelector")
                if ns is not None and ns.get("matchLabels", {}).get("kubernetes.io/metadata.name") != NAMESPACE:
                    return True
                # a podSelector alone: this namespace only
    return False


def test_only_the_api_is_reachable_from_outside_the_namespace(overlay):
    _, docs = overlay
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    seen = []
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        for c in containers(w):
            for p in c.get("ports", []):
                outside = reachable_from_outside(policies, labels, p["containerPort"])
                seen.append((w["metadata"]["name"], p["containerPort"], outside))
    assert ("tuneloop-api", 3000, True) in seen
    assert [s for s in seen if s[2]] == [("tuneloop-api", 3000, True)], seen
    # pods no manifest here declares (flow-run Jobs, TrainJob ranks) are closed too
    assert not reachable_from_outside(policies, {"prefect.io/flow-run-id": "x"}, 8080)
    assert not reachable_from_outside(policies, {"jobset.sigs.k8s.io/jobset-name": "tl-cand-0"}, 29500)
    # a policy that lets everything in would be noticed
    open_all = {"spec": {"podSelector": {}, "ingress": [{}]}}
    assert reachable_from_outside(policies + [open_all], {"app.kubernetes.io/name": "postgres"}, 5432)
