"""The reference drift is measured against: the user texts the champion was trained on,
kept with its model version (an artifact of the training run the version points to), so a
new champion brings its own reference and a rollback brings the old one back."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from tuneloop.data.dataset import prepare_dataset
from tuneloop.monitoring.texts import example_text
from tuneloop.registry import ModelRegistry

ARTIFACT_DIR = "monitoring"
ARTIFACT = f"{ARTIFACT_DIR}/reference.jsonl"


def reference_texts(examples, n: int, seed: int = 0) -> list[str]:
    texts = [t for t in (example_text(ex) for ex in examples) if t]
    return texts if len(texts) <= n else random.Random(seed).sample(texts, n)


def log_reference(run_id: str, examples, n: int, tracking_uri: str) -> int:
    """Store up to n training user texts with the run (what the registered version points to)."""
    from mlflow.tracking import MlflowClient

    texts = reference_texts(examples, n)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reference.jsonl"
        path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
        MlflowClient(tracking_uri, registry_uri=tracking_uri).log_artifact(run_id, str(path), ARTIFACT_DIR)
    return len(texts)


def load_reference(cfg) -> tuple[list[str], dict]:
    """(texts, where they came from) for the current champion; without a champion (or one
    trained before references were kept), the configured training set, and it says so."""
    registry = ModelRegistry.from_config(cfg)
    champion = registry.champion()
    if champion is not None and champion.run_id:
        from mlflow.tracking import MlflowClient

        try:
            with tempfile.TemporaryDirectory() as tmp:
                local = MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri).download_artifacts(
                    champion.run_id, ARTIFACT, tmp
                )
                texts = [
                    json.loads(line)["text"]
                    for line in Path(local).read_text(encoding="utf-8").splitlines()
                    if line.strip()
                ]
            return texts, {
                "source": "champion",
                "model": champion.name,
                "version": champion.version,
                "run_id": champion.run_id,
            }
        except Exception:  # noqa: BLE001 - an older version without the artifact
            pass
    prepared = prepare_dataset(cfg)
    texts = reference_texts(prepared.train, cfg.monitoring.drift.reference_rows)
    return texts, {
        "source": "data.train_path",
        "path": str(cfg.resolve(cfg.data.train_path)),
        "version": champion.version if champion else None,
        "note": "the champion has no stored reference" if champion else "no champion yet",
    }
