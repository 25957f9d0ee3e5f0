"""MLflow tracking glue: where runs go, and the lineage every run carries.

Lineage = the resolved config, the dataset fingerprint, the validation result, the git
commit of this checkout and the versions of the packages that shaped the model.
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from tuneloop.config import REPO_ROOT, TuneloopConfig

LINEAGE_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "accelerate",
    "deepspeed",
    "peft",
    "mlflow",
    "prefect",
    "great-expectations",
    "bentoml",
)


def setup_mlflow(cfg: TuneloopConfig, experiment: str | None = None) -> str:
    """Point MLflow at the configured store; create the experiment (default mlflow.experiment); return its id."""
    import mlflow

    cfg.home.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(cfg.mlflow_tracking_uri)
    mlflow.set_registry_uri(cfg.mlflow_tracking_uri)
    name = experiment or cfg.mlflow.experiment
    exp = mlflow.get_experiment_by_name(name)
    if exp is None:
        exp_id = mlflow.create_experiment(name, artifact_location=cfg.mlflow_artifact_location)
    else:
        exp_id = exp.experiment_id
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def git_commit(repo: Path = REPO_ROOT) -> str:
    """The checkout's commit, with '-dirty' when there are uncommitted changes ('unknown' outside git)."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_versions(names: tuple[str, ...] = LINEAGE_PACKAGES) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: MLflow params are flat."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def log_lineage(cfg: TuneloopConfig, fingerprint: str, validation: dict[str, Any] | None) -> dict[str, str]:
    """Log config, data fingerprint, validation result, commit and versions to the active run."""
    import mlflow

    config = json.loads(cfg.model_dump_json())
    params = {k: str(v)[:500] for k, v in flatten(config).items() if not k.startswith("blessing.")}
    mlflow.log_params(params)
    mlflow.log_dict(config, "lineage/config.json")
    tags = {
        "tuneloop.dataset_fingerprint": fingerprint,
        "tuneloop.git_commit": git_commit(),
        "tuneloop.config_file": str(cfg.source or "embedded defaults"),
    }
    versions = package_versions()
    tags.update({f"tuneloop.version.{k}": v for k, v in versions.items()})
    if validation is not None:
        tags["tuneloop.validation"] = "passed" if validation.get("success") else "failed"
        mlflow.log_dict(validation, "lineage/validation.json")
    mlflow.log_dict(versions, "lineage/packages.json")
    mlflow.set_tags(tags)
    return tags


def numeric(metrics: dict) -> dict[str, float]:
    """The numbers of a metrics dict, as MLflow's log_metrics takes them (None and text dropped; bools as 0/1)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
