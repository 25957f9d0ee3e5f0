"""A registry with a champion to package: what the packaging tests and the deploy flow's start from."""

from __future__ import annotations

from pathlib import Path

from tests.support.serving_tiny_model import build_tiny_model
from tuneloop.config import load_config
from tuneloop.registry import ModelRegistry


def registry_with_champion(root: Path) -> dict:
    """A config whose home holds an MLflow registry with a tiny model promoted to champion."""
    from mlflow.tracking import MlflowClient

    config = root / "tuneloop.yaml"
    # One torch thread and two warm-up requests: the machine is small and shared.
    config.write_text(f"paths: {{home: {root / 'home'}}}\nserving: {{warmup_requests: 2, num_threads: 1}}\n")
    cfg = load_config(config, environ={})
    cfg.home.mkdir(parents=True)
    client = MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)
    experiment = client.create_experiment("packaging", artifact_location=cfg.mlflow_artifact_location)
    model_dir = build_tiny_model(root / "tiny")
    registry = ModelRegistry.from_config(cfg)
    run = client.create_run(experiment)
    v1 = registry.register(run.info.run_id, model_dir)
    registry.promote(v1, None, "test champion", require_blessed=False)
    return {
        "cfg": cfg,
        "config": config,
        "client": client,
        "experiment": experiment,
        "registry": registry,
        "model_dir": model_dir,
        "root": root,
        "v1": v1,
        "run1": run.info.run_id,
    }
