"""The training flow: validate -> train candidates -> evaluate -> bless -> promote -> deploy.

Each task is a one-line call into tuneloop/; this file only decides order, retries,
what is logged where, and when to stop. Nothing is promoted from a failed run: a failed
validation raises before any training, and promotion is the last step.

Run it with `tuneloop train`, or as the `training` deployment in prefect.yaml.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.fine_tuning import run_job
from flows.tasks import evaluate, prepare_data, train_candidate, validate_data
from tuneloop.behaviour import run_suites
from tuneloop.blessing import bless
from tuneloop.bootstrap import ensure_base_model
from tuneloop.config import TuneloopConfig, load_config
from tuneloop.monitoring.reference import log_reference
from tuneloop.privacy import redact
from tuneloop.registry import ModelRegistry, PromotionConflict
from tuneloop.report import write_report
from tuneloop.tracking import log_lineage, setup_mlflow
from tuneloop.training.launch import candidate_specs

# training keys logged as trained.* params of each candidate (its schedule, however chosen)
RECIPE_KEYS = (
    "max_steps",
    "learning_rate",
    "save_steps",
    "warmup_ratio",
    "per_device_batch_size",
    "lora",
    "early_stopping",
    "method",
)


@task(cache_policy=NO_CACHE)
def prepare_base_model(cfg: TuneloopConfig) -> str:
    return ensure_base_model(cfg)


@task(cache_policy=NO_CACHE)
def check_behaviour(cfg: TuneloopConfig, model_ref: str, label: str, examples) -> dict[str, Any]:
    """The behavioural suites (evaluation.behaviour_suite(s)) whose task the eval split is of,
    on one model: tuneloop.behaviour.run_suites' dict (with the skipped suites and why)."""
    result = run_suites(model_ref, [cfg.resolve(p) for p in cfg.evaluation.suites], cfg.evaluation, examples)
    for skip in result["skipped"]:
        get_run_logger().info("%s: behaviour suite %s skipped: %s", label, skip["suite"], skip["reason"])
    if result["ran"]:
        passed = len(result["cases"]) - len(result["failures"])
        get_run_logger().info(
            "%s: behaviour suites %s: %d/%d passed", label, result["suite"], passed, len(result["cases"])
        )
    return result


@task(cache_policy=NO_CACHE)
def champion_snapshot(cfg: TuneloopConfig):
    """The champion as seen before evaluation: promotion later compares-and-sets against it."""
    registry = ModelRegistry.from_config(cfg)
    champ = registry.champion()
    if champ is None:
        return None, None
    return champ.version, registry.download(champ.version)


@task(cache_policy=NO_CACHE)
def register_and_bless(
    cfg: TuneloopConfig,
    run_id: str,
    model_dir: str,
    metrics: dict,
    champion_metrics,
    champion_version,
    tags,
    not_applicable=None,
):
    """Register the challenger and record the TFX-style blessing on its version."""
    registry = ModelRegistry.from_config(cfg)
    version = registry.register(run_id, model_dir, tags=tags)
    registry.set_challenger(version)
    blessing = bless(
        metrics,
        champion_metrics,
        cfg.blessing.thresholds,
        baseline_version=champion_version,
        not_applicable=not_applicable,
    )
    registry.record_blessing(version, blessing)
    return version, blessing


@task(cache_policy=NO_CACHE)
def promote(cfg: TuneloopConfig, version: str, blessing, champion_version):
    """Compare-and-set against the champion seen before evaluation; returns (promotion, refusal)."""
    try:
        promotion = ModelRegistry.from_config(cfg).promote(
            version,
            expected_champion=champion_version,
            reason="blessed: " + "; ".join(blessing.reasons),
            actor="training-flow",
        )
        return promotion, None
    except PromotionConflict as exc:  # someone else promoted meanwhile: never double-promote
        get_run_logger().warning("promotion refused: %s", exc)
        return None, str(exc)


def with_init_from(cfg: TuneloopConfig, init_from: str) -> TuneloopConfig:
    """cfg with training.init_from set, validated like the key it overrides. Only the keys the
    file set stay set: training.recipe auto chooses the others, and a full dump would make
    them all explicit (a drift-triggered retrain then ran with LoRA's defaults, r 8 on q/v)."""
    return cfg.model_copy(
        update={
            "training": cfg.training.model_validate(
                {**cfg.training.model_dump(exclude_unset=True), "init_from": init_from}
            )
        }
    )


def _first_wrong(rows: list[dict], limit: int = 5) -> list[dict]:
    wrong = [r for r in rows if not r["label_match"]][:limit]
    return [{"id": r["id"], "expected": redact(r["expected"]), "generated": redact(r["generated"])} for r in wrong]


@flow(name="training", log_prints=True)
def training_flow(
    config_path: str | None = None,
    data: str | None = None,
    eval_data: str | None = None,
    init_from: str | None = None,
    job_id: str | None = None,
) -> dict[str, Any]:
    """Fine-tune candidates on N processes, evaluate against base and champion, bless, promote,
    then package the new champion as a bento and infra-validate it (flows/deploy.py).

    init_from: "base" or "champion" (default training.init_from); a drift-triggered retrain
    passes the monitoring event's choice (monitoring.retrain_init_from).
    job_id: a fine-tuning job of the API (/v1/fine_tuning/jobs): the same steps on the job's
    files from the base it names, registered as a LoRA adapter, never promoted (flows/fine_tuning.py)."""
    import mlflow

    started = time.time()
    cfg = load_config(config_path)
    if job_id:
        return run_job(cfg, job_id)
    if init_from:
        cfg = with_init_from(cfg, init_from)
    logger = get_run_logger()
    base_ref = prepare_base_model(cfg)
    prepared = prepare_data(cfg, Path(data) if data else None, Path(eval_data) if eval_data else None)
    validation = validate_data(cfg, prepared)  # raises ValidationFailed: nothing trained

    setup_mlflow(cfg)
    champion_version, champion_dir = champion_snapshot(cfg)
    with mlflow.start_run(run_name=f"training-{prepared.fingerprint[:8]}") as parent:
        tags = log_lineage(cfg, prepared.fingerprint, validation.to_dict())
        if validation.report_path:  # the gate's own page: reads offline, unlike the GX site
            mlflow.log_artifact(str(validation.report_path), "lineage")
        run_root = cfg.runs_dir / parent.info.run_id
        metrics_table: dict[str, dict] = {}
        histories: dict[str, list] = {}
        behaviour: dict[str, dict] = {}  # model label -> behavioural results, for the report
        predictions: dict[str, list] = {}  # model label -> every eval row's answer, for the report

        def assess(model_ref: str, label: str) -> dict[str, Any]:
            """Eval-split metrics, plus the behaviour_* metrics when a suite of this task ran, so
            selection, blessing thresholds and MLflow see them like any other metric."""
            metrics, predictions[label] = evaluate(cfg, model_ref, prepared.eval, label)
            if cfg.evaluation.suites:
                behaviour[label] = check_behaviour(cfg, model_ref, label, prepared.eval)
                metrics = {**metrics, **behaviour[label]["metrics"]}
            return metrics

        metrics_table["base"] = assess(base_ref, "base")  # a bad suite file fails here, before training
        if champion_dir is not None:
            metrics_table[f"champion v{champion_version}"] = assess(champion_dir, f"champion v{champion_version}")

        start_from = champion_dir if cfg.training.init_from == "champion" and champion_dir else None
        logger.info("candidates start from %s", f"the champion v{champion_version}" if start_from else "the base model")
        mlflow.log_param("init_from", f"champion v{champion_version}" if start_from else "base")
        if start_from and cfg.training.continued:  # the continued run's schedule (training.continued)
            mlflow.log_param("continued", json.dumps(cfg.training.continued, sort_keys=True))
        candidates = []
        for spec in candidate_specs(cfg, prepared.dir, run_root, start_from=start_from):
            with mlflow.start_run(run_name=spec.name, nested=True) as child:
                result = train_candidate(spec, cfg.training.kubernetes)
                histories[spec.name] = result.train_result.get("loss_history", [])
                for step, loss in histories[spec.name]:
                    mlflow.log_metric("train_loss", loss, step=int(step))
                mlflow.log_params({f"candidate.{k}": v for k, v in spec.overrides.items()} or {"candidate": "default"})
                trained = result.train_result
                # The schedule this candidate really ran (training.recipe auto chooses it), what
                # was chosen and why, and which checkpoint became the model.
                mlflow.log_params(
                    {
                        "recipe": cfg.training.recipe,
                        **{
                            f"trained.{k}": json.dumps(v) if isinstance(v, (dict, list)) else v
                            for k, v in spec.training.items()
                            if k in RECIPE_KEYS
                        },
                    }
                )
                if trained.get("notes"):
                    mlflow.log_text("\n".join(trained["notes"]) + "\n", "lineage/recipe.txt")
                for k in ("best_step", "best_eval_loss", "last_eval_loss", "global_step"):
                    if trained.get(k) is not None:
                        mlflow.log_metric(f"training.{k}", float(trained[k]))
                metrics = assess(str(result.model_dir), spec.name)
                mlflow.log_metrics(metrics)
                metrics_table[spec.name] = metrics
                candidates.append((spec, result, metrics, child.info.run_id))

        key = cfg.training.selection_metric
        better = max if cfg.training.selection_higher_is_better else min
        spec, result, metrics, child_run = better(candidates, key=lambda c: c[2].get(key, float("nan")))
        logger.info("challenger: %s (%s=%.4f)", spec.name, key, metrics.get(key, float("nan")))
        mlflow.log_metrics({f"challenger.{k}": v for k, v in metrics.items()})

        champion_metrics = metrics_table.get(f"champion v{champion_version}") if champion_version else None
        skipped = behaviour.get(spec.name, {}).get("skipped", [])
        not_applicable = (
            {"behaviour_": "; ".join(f"suite {x['suite']} skipped: {x['reason']}" for x in skipped)}
            if skipped and not behaviour[spec.name]["ran"]
            else None
        )
        version, blessing = register_and_bless(
            cfg,
            child_run,
            str(result.model_dir),
            metrics,
            champion_metrics,
            champion_version,
            {**tags, "tuneloop.candidate": spec.name, "tuneloop.parent_run": parent.info.run_id},
            not_applicable,
        )
        # What the monitoring flow compares served prompts with, kept with this version.
        log_reference(child_run, prepared.train, cfg.monitoring.drift.reference_rows, cfg.mlflow_tracking_uri)
        report_paths = write_report(
            run_root / "report",
            histories,
            metrics_table,
            blessing,
            behaviour=behaviour or None,
            challenger=spec.name,
            predictions=predictions,
            notes=result.train_result.get("notes"),
        )
        for name, p in report_paths.items():
            mlflow.log_artifact(str(p), "report/predictions" if name.startswith("predictions:") else "report")
        create_markdown_artifact(
            key="training-report",
            markdown=report_paths["summary"].read_text(),
            description="Candidates vs base vs champion, blessing decision",
        )
        create_table_artifact(
            key="training-metrics",
            table=[
                {"model": name, **{k: round(float(v), 4) for k, v in m.items()}} for name, m in metrics_table.items()
            ],
        )
        # Promotion is the last step of the run: nothing before it can fail after it.
        promotion, refused = promote(cfg, version, blessing, champion_version) if blessing.blessed else (None, None)
        summary = {
            "run_id": parent.info.run_id,
            "dataset_fingerprint": prepared.fingerprint,
            "challenger": {"name": spec.name, "version": version, "metrics": metrics},
            "base": metrics_table["base"],
            "champion_before": champion_version,
            "init_from": f"champion v{champion_version}" if start_from else "base",
            "blessed": blessing.blessed,
            "reasons": blessing.reasons,
            "behaviour_failures": [c["name"] for c in behaviour.get(spec.name, {}).get("failures", [])],
            "behaviour_skipped": skipped,
            # The first wrong answers, as the report shows them (every row: report/predictions/).
            "wrong_answers": _first_wrong(predictions.get(spec.name, [])),
            "report": str(report_paths["summary"]),
            "promoted": bool(promotion and promotion.promoted),
            "promotion_refused": refused,
            "champion_after": promotion.version if promotion and promotion.promoted else champion_version,
            "seconds": round(time.time() - started, 1),
            "recipe_notes": result.train_result.get("notes") or [],
            "best_step": result.train_result.get("best_step"),
        }
        mlflow.log_dict(summary, "summary.json")

    if summary["promoted"]:
        # Package the new champion and prove it serves; a failed bento leaves the old one deployed.
        from flows.deploy import deploy_champion_flow

        deployment = deploy_champion_flow(config_path=config_path, version=str(version), raise_on_failure=False)
        summary["deployment"] = {k: deployment.get(k) for k in ("deployed", "bento_tag", "reason", "previous_bento")}

    return summary
