"""Run a training job on a Kubernetes cluster instead of local processes.

The same job as tuneloop/training/launch.py -- a TrainSpec run by
`python -m tuneloop.training.train --spec spec.json` on every rank -- rendered as:

    api: trainjob    a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, Trainer v2.3)
                     on the ClusterTrainingRuntime `torch-distributed` (torchrun; the Trainer
                     injects PET_NNODES / PET_NPROC_PER_NODE / PET_NODE_RANK / PET_MASTER_*,
                     which torchrun reads) or `deepspeed-distributed` (mpirun over the
                     OpenMPI hostfile the Trainer writes);
    api: pytorchjob  a PyTorchJob (kubeflow.org/v1) for Training Operator 1.9 clusters: a Master
                     and nodes-1 Workers; the operator sets PET_* and MASTER_ADDR/PORT.

Each node gets `gpus_per_node` nvidia.com/gpu (processes per node = gpus_per_node, or
training.num_processes on CPU nodes). DeepSpeed ZeRO comes from the spec's deepspeed_config
as locally. Files travel through one ReadWriteMany volume that the flow's pod and every
training pod mount at the same path (`shared_mount_path`): the spec, the prepared data,
checkpoints and the saved model live under it (TUNELOOP_HOME there), so submit_training
reads the model rank 0 saved exactly where launch_training would.

submit_training creates the custom object with the official `kubernetes` client, follows its
status conditions and the rank-0 pod's log (streamed to on_log), deletes the job if the
caller is interrupted or the deadline passes, raises TrainingError with the job's reason and
the last log lines when it fails, and returns the same TrainResult as launch_training.

The settings are training.kubernetes (tuneloop/config.py: TrainingK8sConfig); the training
flow's one call is run_training, which launches locally unless compute is kubernetes.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Callable

from tuneloop.config import REPO_ROOT, TrainingK8sConfig
from tuneloop.training import launch
from tuneloop.training.launch import LOG_TAIL_LINES, TrainingError, TrainResult, TrainSpec

TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
PYTORCH_GROUP, PYTORCH_VERSION, PYTORCHJOB_PLURAL = "kubeflow.org", "v1", "pytorchjobs"
TRAINER_CONTAINER = "node"  # the Trainer runtimes' trainer container and replicated job
PYTORCH_CONTAINER = "pytorch"  # the Training Operator runs this container
GPU_RESOURCE = "nvidia.com/gpu"
MPI_HOSTFILE = "/etc/mpi/hostfile"  # written by the Trainer's MPI plugin (deepspeed-distributed)
RUNTIME_PATCH_MANAGER = "tuneloop.dev/training"
TRAIN_MODULE = "tuneloop.training.train"


# ---------------------------------------------------------------------------------------
# rendering


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:24] or "job"


def job_name(spec: TrainSpec, suffix: str | None = None) -> str:
    """`tl-<candidate>-<6 hex>`: a DNS label well under the 63 characters JobSet's pod names allow."""
    return f"tl-{_slug(spec.name)}-{suffix or uuid.uuid4().hex[:6]}"


def processes_per_node(cfg: TrainingK8sConfig, spec: TrainSpec) -> int:
    return cfg.gpus_per_node if cfg.gpus_per_node > 0 else max(1, spec.num_processes)


def _under(path: str, root: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(root))


def check_spec_paths(cfg: TrainingK8sConfig, spec: TrainSpec) -> None:
    """Every file the ranks read or write must be on the shared volume (or in the image's code)."""
    mount = cfg.shared_mount_path
    problems = []
    for what in ("output_dir", "train_path", "eval_path"):
        value = getattr(spec, what)
        if value is not None and not _under(value, mount):
            problems.append(f"{what} {value}")
    ds = spec.deepspeed_config
    if ds and not (_under(ds, mount) or _under(ds, str(REPO_ROOT))):  # the image's code is at the same path
        problems.append(f"deepspeed_config {spec.deepspeed_config}")
    if spec.base_model.startswith("/") and not _under(spec.base_model, mount):
        problems.append(f"base_model {spec.base_model}")
    if problems:
        raise TrainingError(
            f"training {spec.name} on Kubernetes: {', '.join(problems)} not under the shared volume "
            f"{cfg.shared_volume_claim} (mounted at {mount} in the flow's pod and the training pods); "
            f"set TUNELOOP_HOME under {mount}"
        )


def _train_args(spec: TrainSpec) -> list[str]:
    return ["-m", TRAIN_MODULE, "--spec", str(spec.spec_path)]


def _env() -> list[dict[str, str]]:
    return [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
        {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
    ]


def _resources(cfg: TrainingK8sConfig) -> dict[str, dict[str, Any]]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if cfg.cpu_per_node:
        requests["cpu"] = cfg.cpu_per_node
    if cfg.memory_per_node:
        requests["memory"] = limits["memory"] = cfg.memory_per_node
    if cfg.gpus_per_node:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = cfg.gpus_per_node
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _shared_volume(cfg: TrainingK8sConfig) -> tuple[dict, dict]:
    volume = {"name": "shared", "persistentVolumeClaim": {"claimName": cfg.shared_volume_claim}}
    mount = {"name": "shared", "mountPath": cfg.shared_mount_path}
    return volume, mount


def _metadata(name: str, spec: TrainSpec, namespace: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {
            "app.kubernetes.io/part-of": "tuneloop",
            "app.kubernetes.io/component": "training",
            "tuneloop.dev/candidate": _slug(spec.name),
        },
    }


def render_trainjob(
    cfg: TrainingK8sConfig, spec: TrainSpec, image: str | None = None, name: str | None = None
) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob that runs spec on cfg.nodes nodes."""
    name = name or job_name(spec)
    procs = processes_per_node(cfg, spec)
    if cfg.runtime == "torch-distributed":
        # torchrun takes nnodes / nproc_per_node / node_rank / master from the PET_* variables.
        command = ["python", "-u", "-m", "torch.distributed.run", *_train_args(spec)]
    else:
        command = [
            "mpirun",
            "--hostfile",
            MPI_HOSTFILE,
            "-np",
            str(cfg.nodes * procs),
            "-x",
            "PYTHONUNBUFFERED",
            "-x",
            "HF_HUB_OFFLINE",
            "-x",
            "TRANSFORMERS_OFFLINE",
            "python",
            "-u",
            *_train_args(spec),
        ]
    trainer: dict[str, Any] = {
        "image": image or cfg.image,
        "command": command,
        "env": _env(),
        "numNodes": cfg.nodes,
        "numProcPerNode": procs,
    }
    resources = _resources(cfg)
    if resources:
        trainer["resourcesPerNode"] = resources
    volume, mount = _shared_volume(cfg)
    pod = _scheduled({"volumes": [volume], "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": [mount]}]}, cfg)
    # deepspeed-distributed: the launcher and the nodes both run the training (runLauncherAsNode).
    jobs = ["node"] if cfg.runtime == "torch-distributed" else ["launcher", "node"]
    body: dict[str, Any] = {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "TrainJob",
        "metadata": _metadata(name, spec, cfg.namespace),
        "spec": {
            "runtimeRef": {"apiGroup": TRAINER_GROUP, "kind": "ClusterTrainingRuntime", "name": cfg.runtime},
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": RUNTIME_PATCH_MANAGER,
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {"name": job, "template": {"spec": {"template": {"spec": pod}}}} for job in jobs
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }
    if cfg.timeout_s:
        body["spec"]["activeDeadlineSeconds"] = int(cfg.timeout_s)
    return body


def _scheduled(pod: dict[str, Any], cfg: TrainingK8sConfig) -> dict[str, Any]:
    """A pod spec with where it may run: node selector, GPU tolerations, service account."""
    if cfg.node_selector:
        pod["nodeSelector"] = dict(cfg.node_selector)
    if cfg.gpus_per_node and cfg.tolerations:
        pod["tolerations"] = [dict(t) for t in cfg.tolerations]
    if cfg.service_account:
        pod["serviceAccountName"] = cfg.service_account
    return pod


def render_pytorchjob(
    cfg: TrainingK8sConfig, spec: TrainSpec, image: str | None = None, name: str | None = None
) -> dict[str, Any]:
    """A Training Operator 1.9 PyTorchJob: one Master and nodes-1 Workers."""
    name = name or job_name(spec)
    procs = processes_per_node(cfg, spec)
    volume, mount = _shared_volume(cfg)
    # The operator sets PET_NNODES / PET_NPROC_PER_NODE / PET_NODE_RANK (read by torchrun) and
    # MASTER_ADDR / MASTER_PORT (not PET_*: passed here; Kubernetes expands $(VAR) from the env).
    container: dict[str, Any] = {
        "name": PYTORCH_CONTAINER,
        "image": image or cfg.image,
        "command": [
            "python",
            "-u",
            "-m",
            "torch.distributed.run",
            "--master_addr=$(MASTER_ADDR)",
            "--master_port=$(MASTER_PORT)",
            *_train_args(spec),
        ],
        "env": _env(),
        "volumeMounts": [mount],
    }
    resources = _resources(cfg)
    if resources:
        container["resources"] = resources
    pod = _scheduled({"containers": [container], "volumes": [volume]}, cfg)

    def replica(n: int) -> dict[str, Any]:
        # Never + backoffLimit 0: a failure is final and reported; the flow's task retry resubmits,
        # resuming from the last checkpoint on the shared volume.
        return {"replicas": n, "restartPolicy": "Never", "template": {"spec": json.loads(json.dumps(pod))}}

    replicas = {"Master": replica(1)}
    if cfg.nodes > 1:
        replicas["Worker"] = replica(cfg.nodes - 1)
    run_policy: dict[str, Any] = {"cleanPodPolicy": "None", "backoffLimit": 0}
    if cfg.timeout_s:
        run_policy["activeDeadlineSeconds"] = int(cfg.timeout_s)
    return {
        "apiVersion": f"{PYTORCH_GROUP}/{PYTORCH_VERSION}",
        "kind": "PyTorchJob",
        "metadata": _metadata(name, spec, cfg.namespace),
        "spec": {"pytorchReplicaSpecs": replicas, "nprocPerNode": str(procs), "runPolicy": run_policy},
    }


def render_job(
    cfg: TrainingK8sConfig, spec: TrainSpec, image: str | None = None, name: str | None = None
) -> dict[str, Any]:
    render = render_trainjob if cfg.api == "trainjob" else render_pytorchjob
    return render(cfg, spec, image=image, name=name)


# ---------------------------------------------------------------------------------------
# submission


@dataclass
class KubeClients:
    """The two API groups used: custom objects (the job) and core (its pods and logs)."""

    custom: Any  # kubernetes.client.CustomObjectsApi
    core: Any  # kubernetes.client.CoreV1Api

    @classmethod
    def from_environment(cls) -> "KubeClients":
        """In a pod: its service account; elsewhere: the current kubeconfig context."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(custom=client.CustomObjectsApi(), core=client.CoreV1Api())


@dataclass(frozen=True)
class JobKind:
    group: str
    version: str
    plural: str
    succeeded: str  # condition types
    failed: str
    leader_selector: str  # label selector of the rank-0 pod, "{name}" filled in
    container: str


KINDS = {
    "trainjob": JobKind(
        TRAINER_GROUP,
        TRAINER_VERSION,
        TRAINJOB_PLURAL,
        "Complete",
        "Failed",
        "jobset.sigs.k8s.io/jobset-name={name},batch.kubernetes.io/job-completion-index=0",
        TRAINER_CONTAINER,
    ),
    "pytorchjob": JobKind(
        PYTORCH_GROUP,
        PYTORCH_VERSION,
        PYTORCHJOB_PLURAL,
        "Succeeded",
        "Failed",
        "training.kubeflow.org/job-name={name},training.kubeflow.org/replica-type=master",
        PYTORCH_CONTAINER,
    ),
}


def job_state(obj: dict[str, Any], kind: JobKind) -> tuple[str, str]:
    """("succeeded" | "failed" | "running", reason: message) from the job's status conditions."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("status") != "True":
            continue
        text = ": ".join(x for x in (cond.get("reason"), cond.get("message")) if x)
        if cond.get("type") == kind.failed:
            return "failed", text
        if cond.get("type") == kind.succeeded:
            return "succeeded", text
    return "running", ""


class _LogFollower(threading.Thread):
    """Streams the leader pod's log to on_log once the pod runs; keeps the last lines."""

    def __init__(
        self,
        clients: KubeClients,
        namespace: str,
        selector: str,
        container: str,
        on_log: Callable[[str], None],
        poll_s: float,
    ):
        super().__init__(daemon=True)
        self.clients, self.namespace, self.selector, self.container = clients, namespace, selector, container
        self.on_log, self.poll_s = on_log, poll_s
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.stop = threading.Event()
        self.pod: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set() and self.pod is None:
                pods = self.clients.core.list_namespaced_pod(self.namespace, label_selector=self.selector).items
                started = [p for p in pods if (p.status.phase or "Pending") in ("Running", "Succeeded", "Failed")]
                if started:
                    self.pod = started[0].metadata.name
                    break
                self.stop.wait(self.poll_s)
            if self.pod is None:
                return
            resp = self.clients.core.read_namespaced_pod_log(
                self.pod, self.namespace, container=self.container, follow=True, _preload_content=False
            )
            try:
                for raw in resp:
                    line = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw).rstrip()
                    if line:
                        self.tail.append(line)
                        self.on_log(line)
                    if self.stop.is_set():
                        break
            finally:
                getattr(resp, "release_conn", lambda: None)()
        except Exception as exc:  # noqa: BLE001 - a lost log stream must not fail the training
            self.error = f"{type(exc).__name__}: {exc}"


def submit_training(
    cfg: TrainingK8sConfig,
    spec: TrainSpec,
    on_log: Callable[[str], None] = print,
    clients: KubeClients | None = None,
    image: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> TrainResult:
    """Run spec as a TrainJob / PyTorchJob, wait for it, return what launch_training returns."""
    check_spec_paths(cfg, spec)
    spec.save()  # on the shared volume: every rank reads it
    body = render_job(cfg, spec, image=image)
    kind = KINDS[cfg.api]
    clients = clients or KubeClients.from_environment()
    ns = cfg.namespace
    created = clients.custom.create_namespaced_custom_object(kind.group, kind.version, ns, kind.plural, body)
    name = created["metadata"]["name"]
    what = f"{body['kind']} {ns}/{name}"
    on_log(
        f"[{spec.name}] submitted {what} ({cfg.nodes} node(s) x {processes_per_node(cfg, spec)} process(es), "
        f"image {body_image(body)})"
    )
    follower = _LogFollower(
        clients, ns, kind.leader_selector.format(name=name), kind.container, on_log, cfg.poll_interval_s
    )
    follower.start()
    # Our own deadline too: a job stuck Pending (no GPU nodes, image pull) never gets a Failed condition.
    deadline = clock() + cfg.timeout_s + 300 if cfg.timeout_s else None
    state, reason, outcome = "running", "", "failed"
    try:
        while True:
            try:
                obj = clients.custom.get_namespaced_custom_object(kind.group, kind.version, ns, kind.plural, name)
            except Exception as exc:  # noqa: BLE001 - the API's 404 when someone deleted the job
                if getattr(exc, "status", None) == 404:
                    raise TrainingError(f"training {spec.name}: {what} was deleted while it ran") from None
                raise
            state, reason = job_state(obj, kind)
            if state != "running":
                break
            if deadline is not None and clock() > deadline:
                raise TrainingError(
                    f"training {spec.name}: {what} did not finish within {cfg.timeout_s:.0f} s "
                    f"(+300 s to start); deleted"
                )
            sleep(cfg.poll_interval_s)
        follower.join(timeout=30)  # the rest of the log after the last poll
        if state == "failed":
            tail = list(follower.tail) or _pod_log_tail(clients, ns, follower.pod, kind.container)
            raise TrainingError(
                f"training {spec.name} failed: {what}: {reason or 'Failed'} (output_dir {spec.output_dir}); "
                f"last {len(tail)} log lines"
                + (f" of pod {follower.pod}" if follower.pod else "")
                + ":\n"
                + "\n".join(tail)
            )
        outcome = "succeeded"
    finally:
        follower.stop.set()
        if (
            cfg.delete_after == "always"
            or (cfg.delete_after == "success" and outcome == "succeeded")
            or state == "running"
        ):  # interrupted, timed out or lost: nothing keeps running
            _delete(clients, kind, ns, name, on_log, spec.name)
    try:
        result = json.loads(spec.result_path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainingError(
            f"training {spec.name}: {what} succeeded but {spec.result_path} is unreadable ({exc}): is "
            f"{cfg.shared_volume_claim} mounted at {cfg.shared_mount_path} in this pod too?"
        ) from None
    return TrainResult(model_dir=spec.model_dir, train_result=result, spec=spec)


def body_image(body: dict[str, Any]) -> str:
    if body["kind"] == "TrainJob":
        return body["spec"]["trainer"]["image"]
    return body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"]


def _pod_log_tail(clients: KubeClients, ns: str, pod: str | None, container: str) -> list[str]:
    if not pod:
        return []
    try:
        text = clients.core.read_namespaced_pod_log(pod, ns, container=container, tail_lines=LOG_TAIL_LINES)
    except Exception:  # noqa: BLE001 - best effort: the job's reason is reported anyway
        return []
    return [line for line in str(text).splitlines() if line.strip()]


def _delete(clients: KubeClients, kind: JobKind, ns: str, name: str, on_log: Callable[[str], None], label: str) -> None:
    try:
        clients.custom.delete_namespaced_custom_object(
            kind.group, kind.version, ns, kind.plural, name, propagation_policy="Foreground"
        )
        on_log(f"[{label}] deleted {ns}/{name}")
    except Exception as exc:  # noqa: BLE001 - already gone, or no permission: say so, don't mask the error
        if getattr(exc, "status", None) != 404:
            on_log(f"[{label}] could not delete {ns}/{name}: {exc}")


def run_training(spec: TrainSpec, k8s: TrainingK8sConfig | None, on_log: Callable[[str], None] = print) -> TrainResult:
    """launch_training or submit_training, as k8s.compute says (the flow's one call)."""
    if k8s is not None and k8s.compute == "kubernetes":
        return submit_training(k8s, spec, on_log=on_log)
    return launch.launch_training(spec, on_log=on_log)  # looked up at call time: tests stand in for it


__all__ = [
    "TrainingK8sConfig",
    "KubeClients",
    "render_job",
    "render_trainjob",
    "render_pytorchjob",
    "submit_training",
    "run_training",
    "job_state",
    "check_spec_paths",
    "job_name",
]
