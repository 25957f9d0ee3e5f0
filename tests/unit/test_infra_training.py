"""Training on Kubernetes (tuneloop/training/kubernetes.py): rendering and submission.

Rendering: TrainJobs (Kubeflow Trainer v2.3, both runtimes) and PyTorchJobs (Training
Operator 1.9) for several shapes, validated against infra/k8s/crds/*.schema.json (pod
templates against the Kubernetes 1.33 core schemas), and what they run: the same module and
spec file as launch_training, the GPUs per node, the shared volume.

Submission: there is no cluster here, so FakeCluster stands in for the Kubernetes API (a
fault/stand-in, not the system under test): it accepts only bodies that validate against the
CRD schemas, moves the job through status conditions, serves the rank-0 pod and its log,
and on success writes train_result.json where the training's rank 0 would (the shared
volume, here a temporary folder). What is tested is our side: submit, follow conditions and
logs, fail clearly, delete when interrupted, and pick up the model.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from tuneloop.infra import validate_manifest
from tuneloop.training.kubernetes import (
    KINDS,
    KubeClients,
    TrainingK8sConfig,
    check_spec_paths,
    job_name,
    job_state,
    render_job,
    run_training,
    submit_training,
)
from tuneloop.training.launch import TrainingError, TrainSpec, training_command


def make_spec(root: str = "/shared/tuneloop", name: str = "cand-0", num_processes: int = 2) -> TrainSpec:
    return TrainSpec(
        name=name,
        base_model=f"{root}/models/tiny-base",
        train_path=f"{root}/datasets/d/train.jsonl",
        eval_path=f"{root}/datasets/d/eval.jsonl",
        output_dir=f"{root}/runs/r1/{name}",
        training={"max_steps": 10},
        deepspeed_config=None,
        num_processes=num_processes,
    )


SHAPES = [
    dict(api="trainjob", runtime="torch-distributed", nodes=1, gpus_per_node=1),
    dict(
        api="trainjob",
        runtime="torch-distributed",
        nodes=4,
        gpus_per_node=8,
        cpu_per_node="32",
        memory_per_node="480Gi",
        timeout_s=7200,
        service_account="tuneloop-flows",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    ),
    dict(api="trainjob", runtime="deepspeed-distributed", nodes=2, gpus_per_node=4),
    dict(api="trainjob", runtime="torch-distributed", nodes=2, gpus_per_node=0),
    dict(api="pytorchjob", nodes=1, gpus_per_node=2),
    dict(api="pytorchjob", nodes=3, gpus_per_node=8, timeout_s=3600, memory_per_node="200Gi"),
]


@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: f"{s['api']}-{s.get('runtime', '')}-{s['nodes']}x{s['gpus_per_node']}"
)
def test_rendered_jobs_validate_against_the_crd_schemas(shape):
    body = render_job(TrainingK8sConfig(compute="kubernetes", **shape), make_spec())
    assert validate_manifest(body) == []


def test_schemas_catch_mistakes():
    spec = make_spec()
    tj = render_job(TrainingK8sConfig(api="trainjob"), spec)
    bad = json.loads(json.dumps(tj))
    bad["spec"]["trainer"]["numNode"] = 2
    assert any("numNode" in e for e in validate_manifest(bad))
    bad = json.loads(json.dumps(tj))
    bad["spec"]["runtimeRef"]["kind"] = "ClusterTrainingRuntimes"
    assert validate_manifest(bad)
    bad = json.loads(json.dumps(tj))
    # Trainer v2.3 cannot patch a container's image through runtimePatches
    bad["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"
    ]["template"]["spec"]["containers"][0]["image"] = "x"
    assert validate_manifest(bad)
    pj = render_job(TrainingK8sConfig(api="pytorchjob", nodes=2), spec)
    bad = json.loads(json.dumps(pj))
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    assert validate_manifest(bad)  # the operator runs the container named pytorch
    bad = json.loads(json.dumps(pj))
    bad["spec"]["pytorchReplicaSpecs"]["Chief"] = bad["spec"]["pytorchReplicaSpecs"].pop("Worker")
    assert validate_manifest(bad)
    bad = json.loads(json.dumps(pj))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resource"] = {}
    assert validate_manifest(bad)  # the pod template is checked as a core PodTemplateSpec


def test_trainjob_runs_the_training_entry_point():
    spec = make_spec()
    cfg = TrainingK8sConfig(api="trainjob", runtime="torch-distributed", nodes=2, gpus_per_node=8)
    body = render_job(cfg, spec, image="registry.local/tuneloop:abc")
    trainer = body["spec"]["trainer"]
    assert body["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert trainer["image"] == "registry.local/tuneloop:abc"
    # what launch_training runs locally, after the launcher: -m tuneloop.training.train --spec <spec.json>
    local = training_command(spec, port=1234)
    assert trainer["command"][-4:] == local[-4:] == ["-m", "tuneloop.training.train", "--spec", str(spec.spec_path)]
    assert trainer["command"][:4] == ["python", "-u", "-m", "torch.distributed.run"]
    (patch,) = body["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    assert job["name"] == "node" and pod["containers"][0]["name"] == "node"
    assert pod["containers"][0]["volumeMounts"] == [{"name": "shared", "mountPath": "/shared"}]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "tuneloop-shared"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"

    ds = render_job(TrainingK8sConfig(api="trainjob", runtime="deepspeed-distributed", nodes=2, gpus_per_node=4), spec)
    cmd = ds["spec"]["trainer"]["command"]
    assert ds["spec"]["runtimeRef"]["name"] == "deepspeed-distributed"
    assert cmd[0] == "mpirun" and cmd[cmd.index("-np") + 1] == "8" and cmd[-4:] == local[-4:]
    names = [
        j["name"] for j in ds["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    ]
    assert names == ["launcher", "node"]

    cpu = render_job(TrainingK8sConfig(api="trainjob", nodes=2, gpus_per_node=0), make_spec(num_processes=3))
    assert cpu["spec"]["trainer"]["numProcPerNode"] == 3 and "resourcesPerNode" not in cpu["spec"]["trainer"]
    assert "tolerations" not in str(cpu["spec"]["runtimePatches"])


def test_pytorchjob_master_and_workers():
    spec = make_spec()
    body = render_job(TrainingK8sConfig(api="pytorchjob", nodes=3, gpus_per_node=8, timeout_s=600), spec)
    replicas = body["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    assert body["spec"]["nprocPerNode"] == "8" and body["spec"]["runPolicy"]["activeDeadlineSeconds"] == 600
    c = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert c["name"] == "pytorch" and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "--master_addr=$(MASTER_ADDR)" in c["command"] and c["command"][-1] == str(spec.spec_path)
    single = render_job(TrainingK8sConfig(api="pytorchjob", nodes=1), spec)
    assert set(single["spec"]["pytorchReplicaSpecs"]) == {"Master"}


def test_job_names_are_dns_labels():
    import re

    for name in ("cand-0", "Cand_1 with spaces", "x" * 80):
        n = job_name(make_spec(name=name))
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 40, n


def test_paths_must_be_on_the_shared_volume():
    cfg = TrainingK8sConfig(compute="kubernetes")
    check_spec_paths(cfg, make_spec())
    with pytest.raises(TrainingError, match="TUNELOOP_HOME under /shared"):
        check_spec_paths(cfg, make_spec(root="/work/.tuneloop"))
    with pytest.raises(TrainingError, match="shared-ish"):
        check_spec_paths(cfg, make_spec(root="/shared-ish/x"))  # a prefix is not a parent folder


def test_config_is_strict():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        TrainingK8sConfig(runtime="mpi")
    with pytest.raises(ValidationError):
        TrainingK8sConfig(node=2)
    assert TrainingK8sConfig().compute == "local"


# ---------------------------------------------------------------------------------------
# submission against a stand-in for the API server


class ApiError(Exception):
    def __init__(self, status):
        super().__init__(f"({status})")
        self.status = status


class FakeCluster:
    """Stands in for the Kubernetes API (CustomObjectsApi + CoreV1Api) of a cluster running the job.

    states: the status conditions the job shows on successive GETs; on reaching a Complete /
    Succeeded condition it writes train_result.json where the job's rank 0 would.
    """

    def __init__(self, spec: TrainSpec, states: list[list[dict]], log: str, result: dict | None = None):
        self.spec, self.states, self.log, self.result = spec, list(states), log, result
        self.created: list[dict] = []
        self.deleted: list[str] = []
        self.gets = 0

    # CustomObjectsApi
    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        errors = validate_manifest(body)
        if errors:
            raise ApiError(422)
        assert (group, version, plural) in {(k.group, k.version, k.plural) for k in KINDS.values()}
        assert body["metadata"]["namespace"] == namespace
        self.created.append(body)
        return json.loads(json.dumps(body))

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if name in self.deleted:
            raise ApiError(404)
        self.gets += 1
        conditions = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if any(c["type"] in ("Complete", "Succeeded") and c["status"] == "True" for c in conditions) and self.result:
            self.spec.result_path.parent.mkdir(parents=True, exist_ok=True)
            self.spec.result_path.write_text(json.dumps(self.result))
        return {**self.created[-1], "status": {"conditions": conditions}}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, propagation_policy=None):
        self.deleted.append(name)

    # CoreV1Api
    def list_namespaced_pod(self, namespace, label_selector):
        name = self.created[-1]["metadata"]["name"]
        assert f"={name}" in label_selector
        pod = SimpleNamespace(
            metadata=SimpleNamespace(name=f"{name}-node-0-0"), status=SimpleNamespace(phase="Running")
        )
        return SimpleNamespace(items=[pod])

    def read_namespaced_pod_log(self, name, namespace, container, follow=False, _preload_content=True, tail_lines=None):
        assert container in ("node", "pytorch")
        return io.BytesIO(self.log.encode())

    @property
    def clients(self) -> KubeClients:
        return KubeClients(custom=self, core=self)


def cond(kind, status="True", reason="", message=""):
    return {"type": kind, "status": status, "reason": reason, "message": message}


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_submit_follows_the_job_and_returns_the_model(tmp_path, api):
    spec = make_spec(root=str(tmp_path / "shared" / "tuneloop"))
    done = "Complete" if api == "trainjob" else "Succeeded"
    cluster = FakeCluster(
        spec,
        [[], [cond("Created")], [cond("Created"), cond(done, reason="Done")]],
        log="step 1 loss 2.0\nstep 2 loss 1.5\n",
        result={"eval_loss": 1.5, "loss_history": [[1, 2.0]]},
    )
    cfg = TrainingK8sConfig(
        compute="kubernetes",
        api=api,
        nodes=2,
        gpus_per_node=4,
        shared_mount_path=str(tmp_path / "shared"),
        poll_interval_s=0.01,
    )
    lines: list[str] = []
    result = submit_training(cfg, spec, on_log=lines.append, clients=cluster.clients, sleep=lambda s: None)
    assert result.train_result["eval_loss"] == 1.5 and result.model_dir == spec.model_dir
    assert json.loads(spec.spec_path.read_text())["name"] == "cand-0"  # the ranks read it from the shared volume
    assert cluster.gets == 3 and len(cluster.created) == 1
    assert "step 2 loss 1.5" in lines and any("submitted" in line for line in lines)
    assert cluster.deleted == [cluster.created[0]["metadata"]["name"]]  # delete_after: success


def test_a_failed_job_fails_clearly_and_stays(tmp_path):
    spec = make_spec(root=str(tmp_path / "shared" / "t"))
    cluster = FakeCluster(
        spec,
        [[cond("Created")], [cond("Failed", reason="BackoffLimitExceeded", message="node-0 exited with 1")]],
        log="loading\nRuntimeError: CUDA out of memory\n",
    )
    cfg = TrainingK8sConfig(compute="kubernetes", shared_mount_path=str(tmp_path / "shared"), poll_interval_s=0.01)
    with pytest.raises(TrainingError) as err:
        submit_training(cfg, spec, on_log=lambda line: None, clients=cluster.clients, sleep=lambda s: None)
    text = str(err.value)
    assert "BackoffLimitExceeded" in text and "node-0 exited with 1" in text and "CUDA out of memory" in text
    assert cluster.deleted == []  # kept for kubectl describe / logs


def test_interrupted_or_late_jobs_are_deleted(tmp_path):
    spec = make_spec(root=str(tmp_path / "shared" / "t"))
    cfg = TrainingK8sConfig(
        compute="kubernetes", shared_mount_path=str(tmp_path / "shared"), poll_interval_s=0.01, timeout_s=10
    )
    cluster = FakeCluster(spec, [[cond("Created")]], log="")

    def interrupt(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        submit_training(cfg, spec, on_log=lambda line: None, clients=cluster.clients, sleep=interrupt)
    assert len(cluster.deleted) == 1

    cluster = FakeCluster(spec, [[cond("Created")]], log="")
    now = iter(range(0, 10_000, 100))
    with pytest.raises(TrainingError, match="did not finish within 10 s"):
        submit_training(
            cfg, spec, on_log=lambda line: None, clients=cluster.clients, sleep=lambda s: None, clock=lambda: next(now)
        )
    assert len(cluster.deleted) == 1


def test_a_success_without_the_result_file_names_the_volume(tmp_path):
    spec = make_spec(root=str(tmp_path / "shared" / "t"))
    cluster = FakeCluster(spec, [[cond("Complete")]], log="", result=None)
    cfg = TrainingK8sConfig(compute="kubernetes", shared_mount_path=str(tmp_path / "shared"), poll_interval_s=0.01)
    with pytest.raises(TrainingError, match="tuneloop-shared mounted at"):
        submit_training(cfg, spec, on_log=lambda line: None, clients=cluster.clients, sleep=lambda s: None)


def test_an_invalid_body_never_reaches_the_cluster(tmp_path):
    spec = make_spec(root=str(tmp_path / "elsewhere"))
    cluster = FakeCluster(spec, [[]], log="")
    cfg = TrainingK8sConfig(compute="kubernetes", shared_mount_path=str(tmp_path / "shared"))
    with pytest.raises(TrainingError, match="not under the shared volume"):
        submit_training(cfg, spec, clients=cluster.clients)
    assert cluster.created == []


def test_job_state_reads_conditions():
    kind = KINDS["trainjob"]
    assert job_state({}, kind) == ("running", "")
    assert job_state({"status": {"conditions": [cond("Complete", "False"), cond("Suspended")]}}, kind)[0] == "running"
    assert job_state({"status": {"conditions": [cond("Failed", reason="DeadlineExceeded")]}}, kind) == (
        "failed",
        "DeadlineExceeded",
    )
    assert job_state({"status": {"conditions": [cond("Succeeded")]}}, KINDS["pytorchjob"])[0] == "succeeded"


def test_run_training_keeps_local_by_default(monkeypatch):
    import tuneloop.training.launch as launch

    called = []
    monkeypatch.setattr(launch, "launch_training", lambda spec, on_log: called.append(spec) or "local")
    assert run_training(make_spec(), None) == "local"
    assert run_training(make_spec(), TrainingK8sConfig()) == "local"
    assert len(called) == 2


def test_the_stand_in_speaks_the_real_clients_api():
    """FakeCluster's methods are the official client's (kubernetes 33.1.0), with the same parameters."""
    import inspect

    from kubernetes import client

    calls = {
        client.CustomObjectsApi: {
            "create_namespaced_custom_object": (["group", "version", "namespace", "plural", "body"], []),
            "get_namespaced_custom_object": (["group", "version", "namespace", "plural", "name"], []),
            "delete_namespaced_custom_object": (
                ["group", "version", "namespace", "plural", "name"],
                ["propagation_policy"],
            ),
        },
        client.CoreV1Api: {
            "list_namespaced_pod": (["namespace"], ["label_selector"]),
            "read_namespaced_pod_log": (["name", "namespace"], ["container", "follow", "tail_lines"]),
        },
    }
    for api, methods in calls.items():
        for method, (positional, keywords) in methods.items():
            real = getattr(api, method)
            params = [p for p in inspect.signature(real).parameters if p not in ("self", "kwargs")]
            assert params == positional, (method, params)
            doc = inspect.getdoc(real)
            for kw in keywords + ["_preload_content"] * (method == "read_namespaced_pod_log"):
                assert f" {kw}:" in doc, (method, kw)
            fake = inspect.signature(getattr(FakeCluster, method)).parameters
            assert list(fake)[1 : len(positional) + 1] == positional and set(keywords) <= set(fake), method
