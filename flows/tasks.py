"""The training flow's steps that a fine-tuning job's run shares (flows/training.py,
flows/fine_tuning.py): each a one-line call into tuneloop/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tuneloop.config import TuneloopConfig
from tuneloop.data.dataset import prepare_dataset
from tuneloop.evaluation import evaluate_model
from tuneloop.evaluation import predictions as prediction_rows
from tuneloop.preference import preference_win_rate
from tuneloop.training.kubernetes import run_training
from tuneloop.validation import token_budget, validate_prepared


class ValidationFailed(Exception):
    """The data gate failed; the flow stops before training."""


@task(cache_policy=NO_CACHE)
def prepare_data(cfg: TuneloopConfig, data: Path | None, eval_data: Path | None):
    # The row policies run here, so the prepared folder (and its fingerprint) is what trains.
    prepared = prepare_dataset(cfg, train_path=data, eval_path=eval_data, budget=token_budget(cfg))
    get_run_logger().info(prepared.summary())
    return prepared


@task(cache_policy=NO_CACHE)
def validate_data(cfg: TuneloopConfig, prepared):
    report = validate_prepared(cfg, prepared)
    create_markdown_artifact(
        key="data-validation",
        markdown=f"# Data validation: {'passed' if report.success else 'FAILED'}\n\n```\n{report.summary()}\n```\n\n",
        description="Great Expectations gate on the training set",
    )
    if not report.success:
        raise ValidationFailed(report.summary())
    return report


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def train_candidate(spec, k8s=None, on_log=None):
    """A real multi-process job, here or as a Kubernetes TrainJob (training.kubernetes.compute);
    its log streams into this task's log (or to on_log). A retry resumes from the last checkpoint."""
    return run_training(spec, k8s, on_log=on_log or get_run_logger().info)


@task(cache_policy=NO_CACHE)
def evaluate(cfg: TuneloopConfig, model_ref: str, examples, label: str) -> tuple[dict[str, Any], list[dict]]:
    """(metrics, predictions): every eval row's expected and generated answer. On preference
    pairs (a dpo dataset) the chosen answer is the expected one, and the pairs' win rate and
    margin (tuneloop/preference.py) join the metrics."""
    result = evaluate_model(model_ref, examples, cfg.evaluation, progress=False)
    metrics = dict(result.metrics)
    if examples and all(ex.rejected is not None for ex in examples):
        metrics.update(preference_win_rate(model_ref, examples))
    get_run_logger().info(
        "%s: %s", label, json.dumps({k: v for k, v in metrics.items() if "/" not in k}, default=float)
    )
    return metrics, prediction_rows(result)
