"""The content filter's own flow: train -> evaluate vs baseline and champion -> bless -> promote.

Each task is a one-line call into tuneloop/gateway/filter_training.py. The classifier
is registered in MLflow as gateway.filter_training.registered_model and promoted with the
same blessing and alias rules as the LM (tuneloop/blessing.py, tuneloop/registry.py);
a server loads it by alias (gateway.filter.classifier, default tuneloop-filter@champion)
when it starts.

Run it with `tuneloop filter train`, or as the `filter-training` deployment in prefect.yaml.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tuneloop.config import TuneloopConfig, load_config
from tuneloop.gateway.filter_training import promote_filter, register_filter, train_filter
from tuneloop.gateway.filter_training import score_champion as score_filter_champion
from tuneloop.registry import PromotionConflict
from tuneloop.tracking import numeric, setup_mlflow


@task(cache_policy=NO_CACHE)
def train(cfg: TuneloopConfig, out_dir: Path, data: Path | None, eval_data: Path | None = None):
    return train_filter(cfg, out_dir, data, progress=get_run_logger().info, eval_data=eval_data)


@task(cache_policy=NO_CACHE)
def score_champion(cfg: TuneloopConfig, test_path: Path):
    return score_filter_champion(cfg, test_path)


@task(cache_policy=NO_CACHE)
def register_and_bless(cfg: TuneloopConfig, run_id: str, metrics: dict, champion_metrics, champion_version):
    return register_filter(cfg, run_id, metrics, champion_metrics, champion_version)


@task(cache_policy=NO_CACHE)
def promote(cfg: TuneloopConfig, version: str, blessing, champion_version):
    try:
        return promote_filter(cfg, version, blessing, champion_version), None
    except PromotionConflict as exc:
        get_run_logger().warning("promotion refused: %s", exc)
        return None, str(exc)


@flow(name="filter-training", log_prints=True)
def filter_training_flow(
    config_path: str | None = None, data: str | None = None, eval_data: str | None = None
) -> dict[str, Any]:
    import mlflow

    started = time.time()
    cfg = load_config(config_path)
    t = cfg.gateway.filter_training
    setup_mlflow(cfg, experiment=t.experiment)
    with mlflow.start_run(run_name="filter-training") as run:
        out_dir = cfg.home / "filter-runs" / run.info.run_id
        result = train(cfg, out_dir, Path(data) if data else None, Path(eval_data) if eval_data else None)
        mlflow.log_params(
            {
                "train_path": str(cfg.resolve(data or t.train_path)),
                "target_fpr": t.target_fpr,
                "test_fraction": t.test_fraction,
                "seed": t.seed,
                **result.params,
            }
        )
        mlflow.log_metrics(numeric(result.metrics))
        mlflow.log_metrics({f"baseline.{k}": v for k, v in numeric(result.baseline).items()})
        if result.external is not None:
            mlflow.log_param("external_eval_path", str(result.external_path))
            mlflow.log_metrics({f"external.{k}": v for k, v in numeric(result.external).items()})
        mlflow.log_artifact(str(result.plot), "report")
        mlflow.log_artifact(str(result.report), "report")
        mlflow.log_artifacts(str(result.model_dir), "model")
        champion_version, champion_metrics = score_champion(cfg, result.test_path)
        if champion_metrics:
            mlflow.log_metrics({f"champion.{k}": v for k, v in numeric(champion_metrics).items()})
        version, blessing = register_and_bless(
            cfg, run.info.run_id, numeric(result.metrics), champion_metrics, champion_version
        )
        promotion, refused = promote(cfg, version, blessing, champion_version) if blessing.blessed else (None, None)
        summary = {
            "run_id": run.info.run_id,
            "registered_model": t.registered_model,
            "version": version,
            "method": result.method,
            "metrics": result.metrics,
            "baseline": result.baseline,
            "external": result.external,
            "external_path": str(result.external_path) if result.external_path else None,
            "champion_before": champion_version,
            "champion_metrics": champion_metrics,
            "blessed": blessing.blessed,
            "reasons": blessing.reasons,
            "promoted": bool(promotion and promotion.promoted),
            "promotion_refused": refused,
            "champion_after": version if promotion and promotion.promoted else champion_version,
            "seconds": round(time.time() - started, 1),
        }
        mlflow.log_dict(summary, "summary.json")
    create_markdown_artifact(
        key="filter-training",
        description="Content-filter classifier vs baseline; blessing and promotion",
        markdown=result.report.read_text()
        + f"\n\nversion {version}: {'blessed' if blessing.blessed else 'NOT blessed'}"
        f" ({'; '.join(blessing.reasons)}); champion after: {summary['champion_after']}\n",
    )
    return summary
