"""Fine-tuned models as adapter-only MLflow versions, and their `ft:` model ids.

A job's result is a LoRA adapter of the base it was trained on, registered as a version of
the registered model `<mlflow.registered_model>-adapters`: the adapter's files (PEFT's
adapter_config.json + adapter_model.safetensors, a few MB) and `base.json` naming its base
(registered name and version, and the folder it was trained from), never a merged copy. The
version's tags say whose it is and which model id calls it:

    ft:<base name>:<team>:<suffix>:<job id>

Servers find adapters here (AdapterCatalog): the versions of their own base, visible to the
owner that trained them only; a new one is seen on its first request, on every replica.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tuneloop.serving.lora import AdapterRef

TAG_MODEL = "tuneloop.ft_model"
TAG_OWNER = "tuneloop.owner"
TAG_BASE_NAME = "tuneloop.base_name"
TAG_BASE_VERSION = "tuneloop.base_version"
TAG_JOB = "tuneloop.job"
TAG_KIND = "tuneloop.kind"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
SUFFIX = re.compile(r"^[A-Za-z0-9_-]{0,64}$")


def adapters_model_name(cfg) -> str:
    return f"{cfg.mlflow.registered_model}-adapters"


def team_of(owner: str) -> str:
    """The owner's name as a model id shows it: "team:acme" -> "acme", "key:k1" -> "k1"."""
    return owner.split(":", 1)[-1] or "anonymous"


def ft_model_id(base_name: str, owner: str, suffix: str | None, job_id: str) -> str:
    return f"ft:{base_name}:{team_of(owner)}:{suffix or ''}:{job_id}"


def is_ft_id(model: str) -> bool:
    return model.startswith("ft:")


@dataclass(frozen=True)
class AdapterVersion:
    model_id: str
    owner: str
    base_name: str
    base_version: str
    job_id: str
    version: str  # the MLflow version of the adapters' registered model
    source: str
    created: int


def register_adapter(
    cfg, run_id: str, adapter_dir: Path, model_id: str, owner: str, base: dict[str, Any], job_id: str
) -> str:
    """Log the adapter (with base.json) under the run and register it; returns the version."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    adapter_dir = Path(adapter_dir)
    missing = [f for f in ADAPTER_FILES if not (adapter_dir / f).exists()]
    if missing:
        raise FileNotFoundError(f"{adapter_dir}: not a saved LoRA adapter (missing {', '.join(missing)})")
    staged = adapter_dir.parent / "adapter-registered"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for name in ADAPTER_FILES:
        shutil.copy2(adapter_dir / name, staged / name)
    (staged / "base.json").write_text(json.dumps({**base, "model_id": model_id}, indent=2))
    client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)
    client.log_artifacts(run_id, str(staged), "adapter")
    name = adapters_model_name(cfg)
    try:
        client.create_registered_model(name, description="tuneloop fine-tuning jobs' LoRA adapters (adapter-only)")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    run = client.get_run(run_id)
    tags = {
        TAG_KIND: "lora-adapter",
        TAG_MODEL: model_id,
        TAG_OWNER: owner,
        TAG_BASE_NAME: str(base["name"]),
        TAG_BASE_VERSION: str(base["version"]),
        TAG_JOB: job_id,
    }
    mv = client.create_model_version(
        name, source=f"{run.info.artifact_uri.rstrip('/')}/adapter", run_id=run_id, tags=tags
    )
    return str(mv.version)


class AdapterCatalog:
    """The registry's adapters, read at most every `ttl_s` (and at once for an id not seen
    yet), each adapter's files downloaded once into `cache_dir`. `base()` names the base the
    server serves now, (name, version): after a hot swap, adapters of the old one are not served."""

    def __init__(self, cfg, base: Callable[[], tuple[str, str]], ttl_s: float = 5.0):
        # mlflow imported here, once, on the thread that builds the server: two first imports
        # racing on request threads broke its protobuf registry ("Depends on file
        # 'databricks.proto', but it has not been loaded") and /v1/models answered 500.
        import mlflow.artifacts  # noqa: F401
        from mlflow.exceptions import MlflowException  # noqa: F401
        from mlflow.tracking import MlflowClient  # noqa: F401

        self.cfg = cfg
        self.base = base
        self.ttl_s = ttl_s
        self.cache_dir = cfg.home / "adapters"
        self._versions: dict[str, AdapterVersion] = {}
        self._read_at = 0.0
        self._lock = threading.Lock()

    def _read(self) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.cfg.mlflow_tracking_uri, registry_uri=self.cfg.mlflow_tracking_uri)
        try:
            found = client.search_model_versions(f"name='{adapters_model_name(self.cfg)}'", max_results=10_000)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            found = []
        versions = {}
        for mv in found:
            tags = mv.tags or {}
            if TAG_MODEL not in tags:
                continue
            versions[tags[TAG_MODEL]] = AdapterVersion(
                model_id=tags[TAG_MODEL],
                owner=tags.get(TAG_OWNER, ""),
                base_name=tags.get(TAG_BASE_NAME, ""),
                base_version=tags.get(TAG_BASE_VERSION, ""),
                job_id=tags.get(TAG_JOB, ""),
                version=str(mv.version),
                source=mv.source,
                created=int((mv.creation_timestamp or 0) / 1000),
            )
        self._versions, self._read_at = versions, time.monotonic()

    def _fresh(self, force: bool = False) -> dict[str, AdapterVersion]:
        with self._lock:
            if force or time.monotonic() - self._read_at > self.ttl_s:
                self._read()
            return self._versions

    def _on_base(self, version: AdapterVersion) -> bool:
        name, number = self.base()
        return version.base_name == name and version.base_version == str(number)

    def visible(self, owner: str | None) -> list[AdapterVersion]:
        """The adapters of the served base that `owner` may call (its own), oldest first."""
        mine = [v for v in self._fresh().values() if v.owner == owner and self._on_base(v)]
        return sorted(mine, key=lambda v: (v.created, v.model_id))

    def find(self, model_id: str, owner: str | None) -> AdapterVersion | None:
        """The owner's adapter of this id on the served base; None for another owner's or an
        unknown id. One of another base version raises LookupError saying so (to its owner)."""
        versions = self._fresh()
        if model_id not in versions:
            versions = self._fresh(force=True)  # trained since the last read: every replica sees it at once
        version = versions.get(model_id)
        if version is None or version.owner != owner:
            return None
        if not self._on_base(version):
            name, number = self.base()
            raise LookupError(
                f"the model {model_id!r} was trained on {version.base_name}:{version.base_version}; this server "
                f"serves {name}:{number}, which it cannot run as that fine-tune"
            )
        return version

    def ref(self, version: AdapterVersion) -> AdapterRef:
        """The adapter's files, downloaded once (atomically) into the cache."""
        import mlflow.artifacts

        target = self.cache_dir / f"v{version.version}"
        if not all((target / f).exists() for f in ADAPTER_FILES):
            staging = self.cache_dir / f".v{version.version}-{time.monotonic_ns()}"
            staging.mkdir(parents=True, exist_ok=True)
            local = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=version.source, dst_path=str(staging), tracking_uri=self.cfg.mlflow_tracking_uri
                )
            )
            try:
                local.rename(target)
            except OSError:  # another request put it there first
                pass
            shutil.rmtree(staging, ignore_errors=True)
        return AdapterRef(name=version.model_id, path=str(target))
