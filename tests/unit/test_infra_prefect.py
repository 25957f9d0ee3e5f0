"""The Kubernetes work pool's base job template (infra/k8s/base/prefect/base-job-template.json).

Prefect's server accepts it (its own WorkPoolCreate validation: every placeholder is a
declared variable); Prefect's own templating (BaseJobConfiguration.from_template_and_values,
what every worker calls) renders it with a deployment's job variables; the env and command
steps prefect-kubernetes 0.8's worker applies next (env dict -> list before the template's
own entries, command string -> args list, generateName) are repeated here, since that package
is not installed; the resulting Job validates strictly against Kubernetes 1.33. The GPU limit
is a job variable wired into the container's resources, and absent when unset.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from typing import Any

import pytest

from tuneloop.infra import K8S_DIR, render_kustomization, validate_manifest

TEMPLATE_PATH = K8S_DIR / "base" / "prefect" / "base-job-template.json"


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return json.loads(TEMPLATE_PATH.read_text())


def render(template: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    from prefect.workers.base import BaseJobConfiguration

    class KubernetesLike(BaseJobConfiguration):
        job_manifest: dict[str, Any]
        job_watch_timeout_seconds: int | None = None
        pod_watch_timeout_seconds: int = 60
        stream_output: bool = True

    class NoServer:
        """The template names no blocks or Prefect variables: nothing may call the API."""

        def __getattr__(self, name):
            raise AssertionError(f"the template needed the Prefect API ({name})")

    cfg = asyncio.run(KubernetesLike.from_template_and_values(template, values, client=NoServer()))
    manifest = json.loads(json.dumps(cfg.job_manifest))
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    # prefect-kubernetes: the worker's env (a dict) goes first, then the template's list.
    worker_env = [{"name": k, "value": v} for k, v in {**cfg.env, "PREFECT__FLOW_RUN_ID": "abc"}.items()]
    names = {e["name"] for e in worker_env}
    container["env"] = worker_env + [e for e in container.get("env", []) if e["name"] not in names]
    if isinstance(container.get("args"), str):
        container["args"] = shlex.split(container["args"])
    container.setdefault("args", ["prefect", "flow-run", "execute"])
    if manifest["metadata"].get("generateName") in (None, "-", "None-"):
        manifest["metadata"]["generateName"] = "prefect-job-"
    return manifest


def test_prefect_server_accepts_the_template(template):
    from prefect.server.schemas.actions import WorkPoolCreate

    pool = WorkPoolCreate(name="tuneloop-k8s", type="kubernetes", base_job_template=template)
    assert pool.base_job_template["variables"]["properties"]["gpu_limit"]["type"] == "integer"
    broken = json.loads(json.dumps(template))
    broken["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["priorityClassName"] = "{{ priority }}"
    with pytest.raises(ValueError, match="priority"):
        WorkPoolCreate(name="x", type="kubernetes", base_job_template=broken)


def test_every_variable_is_used(template):
    text = json.dumps(template["job_configuration"])
    unused = [v for v in template["variables"]["properties"] if "{{ " + v + " }}" not in text]
    assert not unused


def test_gpu_limit_is_wired_into_the_job(template):
    job = render(
        template,
        {
            "name": "training-run",
            "gpu_limit": 2,
            "image": "registry.local/tuneloop:1",
            "node_selector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "env": {"EXTRA": "1"},
        },
    )
    assert validate_manifest(job) == []
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["image"] == "registry.local/tuneloop:1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert job["metadata"]["generateName"] == "training-run-" and job["metadata"]["namespace"] == "tuneloop"
    env = [e["name"] for e in c["env"]]
    assert env.index("EXTRA") < env.index("TUNELOOP_HOME")
    # the template's $(VAR) references come after the variables they use
    for i, e in enumerate(c["env"]):
        for ref in ("POSTGRES_USER", "POSTGRES_PASSWORD"):
            if f"$({ref})" in e.get("value", ""):
                assert ref in env[:i]


def test_unset_variables_drop_their_keys(template):
    job = render(template, {})
    assert validate_manifest(job) == []
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert pod["serviceAccountName"] == "tuneloop-flows"
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["ttlSecondsAfterFinished"] == 86400


def test_flow_run_pods_share_the_training_volume(template, tmp_path):
    from tuneloop.training.kubernetes import TrainingK8sConfig

    job = render(template, {})
    pod = job["spec"]["template"]["spec"]
    (mount,) = pod["containers"][0]["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    k8s = TrainingK8sConfig()
    assert volume["persistentVolumeClaim"]["claimName"] == k8s.shared_volume_claim
    assert mount["mountPath"] == k8s.shared_mount_path
    home = next(e["value"] for e in pod["containers"][0]["env"] if e["name"] == "TUNELOOP_HOME")
    assert home.startswith(k8s.shared_mount_path + "/")
    docs = render_kustomization(K8S_DIR / "overlays" / "cpu")
    assert any(
        d["kind"] == "PersistentVolumeClaim"
        and d["metadata"]["name"] == k8s.shared_volume_claim
        and d["spec"]["accessModes"] == ["ReadWriteMany"]
        for d in docs
    )
    sa = template["variables"]["properties"]["service_account_name"]["default"]
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == sa)
    assert {"trainer.kubeflow.org", "kubeflow.org"} <= {g for r in role["rules"] for g in r["apiGroups"]}


def test_worker_deployment_mounts_the_template(template):
    docs = render_kustomization(K8S_DIR / "overlays" / "cpu")
    worker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "prefect-worker")
    c = worker["spec"]["template"]["spec"]["containers"][0]
    path = c["command"][c["command"].index("--base-job-template") + 1]
    assert c["command"][c["command"].index("--type") + 1] == "kubernetes"
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in worker["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    assert json.loads(cm["data"][path.rsplit("/", 1)[1]]) == template
    api = next(e["value"] for e in c["env"] if e["name"] == "PREFECT_API_URL")
    server = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "prefect-server")
    assert api == f"http://prefect-server:{server['spec']['ports'][0]['port']}/api"
