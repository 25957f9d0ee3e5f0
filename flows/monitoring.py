"""The monitoring flow: a window of the request log against the champion's reference and
the SLOs, every hour (prefect.yaml: `monitoring`), or now with `tuneloop monitor`.

One task calls tuneloop/monitoring/run.py (which reads, computes and writes); this flow
logs the result to MLflow (experiment tuneloop-monitoring: scores as metrics, the Evidently
report and the summary as artifacts), publishes it as Prefect artifacts (markdown + a link
to the report), and emits the events run.py decided on:
  tuneloop.retrain.requested  drift: payload carries the scores, the window and the data
                              path (base training set + validated feedback rows) that the
                              `training` deployment's trigger passes to the training flow;
  tuneloop.slo.breached       an SLO breach (alerting; retraining does not fix latency).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tuneloop.config import load_config
from tuneloop.monitoring.run import monitor, summary_markdown
from tuneloop.requestlog.store import parse_since
from tuneloop.tracking import numeric, setup_mlflow

EXPERIMENT = "tuneloop-monitoring"


def emit(event: str, payload: dict, cfg) -> None:
    from prefect.events import emit_event

    emit_event(
        event=event,
        resource={
            "prefect.resource.id": f"tuneloop.model.{cfg.mlflow.registered_model}",
            "prefect.resource.name": cfg.mlflow.registered_model,
        },
        payload=payload,
    )


@task(cache_policy=NO_CACHE)
def monitor_window(cfg, since: str | None, until: str | None) -> dict:
    return monitor(
        cfg, parse_since(since), parse_since(until), emit=lambda e, p: emit(e, p, cfg), progress=get_run_logger().info
    )


@flow(name="monitoring", log_prints=True)
def monitoring_flow(
    config_path: str | None = None, since: str | None = None, until: str | None = None
) -> dict[str, Any]:
    import mlflow

    cfg = load_config(config_path)
    result = monitor_window(cfg, since, until)
    setup_mlflow(cfg, experiment=EXPERIMENT)
    with mlflow.start_run(run_name=f"monitoring-{result['window']['until'][:16]}") as run:
        mlflow.log_params(
            {
                "since": result["window"]["since"],
                "until": result["window"]["until"],
                "reference_version": result["reference"].get("version"),
                "reference_source": result["reference"].get("source"),
            }
        )
        metrics = {
            "requests": result["window"]["requests"],
            "drift_detected": float(result["drift"]["detected"]),
            **{f"drift.{k}": v for k, v in result["drift"]["scores"].items()},
            **{f"slo.{k}": v for k, v in numeric(result["slo"]["values"]).items()},
        }
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None})
        mlflow.log_artifacts(result["dir"], "monitoring")
        result["mlflow_run_id"] = run.info.run_id
    create_markdown_artifact(
        key="monitoring", markdown=summary_markdown(result), description="Drift and service health of the last window"
    )
    if result["report"]:
        create_link_artifact(
            key="drift-report",
            link=f"file://{result['report']}",
            description="Evidently drift report (also in MLflow, experiment tuneloop-monitoring)",
        )
    return result
