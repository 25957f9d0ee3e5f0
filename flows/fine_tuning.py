"""A fine-tuning job (/v1/fine_tuning/jobs) as a run of the training flow.

`training_flow(job_id=...)` comes here: the same tasks as a retrain (data preparation, the
Great Expectations gate, a DeepSpeed/torchrun training, evaluation against the base, the
blessing rules' report, MLflow lineage), on the team's uploaded file, starting from the
served base the job named, always LoRA; the result is registered as an adapter-only version
(tuneloop/finetune/adapters.py), never promoted or deployed. Each step writes the job's
events; the job ends succeeded with its `ft:` model id, or failed with OpenAI's error object.

The embedded runner starts it as `python -m flows.run_job JOB_ID [--config FILE]`.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from flows.tasks import ValidationFailed, evaluate, prepare_data, train_candidate, validate_data
from tuneloop.blessing import bless
from tuneloop.config import TuneloopConfig
from tuneloop.files import open_file_store
from tuneloop.finetune.adapters import ft_model_id, register_adapter
from tuneloop.finetune.jobs import RUNNING, JobStore
from tuneloop.finetune.runner import limits_for
from tuneloop.tracking import log_lineage, setup_mlflow
from tuneloop.training.launch import candidate_specs

AUTO_EPOCHS = 3  # OpenAI's default for a small file


class JobFailed(Exception):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def resolve_hyperparameters(cfg: TuneloopConfig, method: dict[str, Any]) -> dict[str, Any]:
    """The job's hyperparameters with "auto" resolved (as the job reports them)."""
    kind = method["type"]
    given = dict((method.get(kind) or {}).get("hyperparameters") or {})
    out = {
        "n_epochs": AUTO_EPOCHS if given.get("n_epochs", "auto") == "auto" else int(given["n_epochs"]),
        "batch_size": (
            cfg.training.per_device_batch_size
            if given.get("batch_size", "auto") == "auto"
            else int(given["batch_size"])
        ),
        "learning_rate_multiplier": (
            1.0 if given.get("learning_rate_multiplier", "auto") == "auto" else float(given["learning_rate_multiplier"])
        ),
    }
    if kind == "dpo":
        out["beta"] = cfg.training.dpo.beta if given.get("beta", "auto") == "auto" else float(given["beta"])
    return out


def job_config(cfg: TuneloopConfig, job, train_rows: int, hp: dict[str, Any]) -> tuple[TuneloopConfig, int]:
    """cfg for this job's training (LoRA, the schedule from its hyperparameters; cfg's base is the
    served model already) and its steps."""
    t = cfg.training
    per_step = hp["batch_size"] * t.num_processes * t.gradient_accumulation_steps
    steps = max(1, hp["n_epochs"] * math.ceil(train_rows / per_step))
    training = t.model_validate(
        {
            **t.model_dump(exclude_unset=True),
            "method": "lora",
            "objective": "dpo" if job.body["method"]["type"] == "dpo" else "sft",
            "dpo": {**t.dpo.model_dump(), **({"beta": hp["beta"]} if "beta" in hp else {})},
            "recipe": "manual",
            "candidates": [],
            "continued": {},
            "init_from": "base",
            "per_device_batch_size": hp["batch_size"],
            "learning_rate": t.learning_rate * hp["learning_rate_multiplier"],
            "max_steps": steps,
            "save_steps": steps,
            "seed": job.body["seed"],
        }
    )
    update = {
        "training": training,
        "evaluation": cfg.evaluation.model_copy(update={"suites": []}),  # the team's task, not ours
    }
    return cfg.model_copy(update=update), steps


def run_job(cfg: TuneloopConfig, job_id: str) -> dict[str, Any]:
    store = JobStore.from_config(cfg)
    job = store.get(job_id)
    if job.status != RUNNING:
        get_run_logger().warning("job %s is %s: nothing to run", job_id, job.status)
        return {"job_id": job_id, "status": job.status}
    started = time.time()
    try:
        return _run(cfg, store, job, started)
    except JobFailed as exc:
        store.fail(job_id, exc.code, str(exc), exc.param)
        raise
    except Exception as exc:
        if isinstance(exc, ValidationFailed):
            store.fail(
                job_id, "invalid_training_file", f"the training data failed the data gate: {exc}", "training_file"
            )
        else:
            store.fail(job_id, "training_failed", f"{type(exc).__name__}: {exc}"[:3000])
        raise


def _run(cfg: TuneloopConfig, store: JobStore, job, started: float) -> dict[str, Any]:
    import mlflow

    logger = get_run_logger()
    job_dir = cfg.home / "fine_tuning" / "runs" / job.id
    shutil.rmtree(job_dir, ignore_errors=True)
    (job_dir / "data").mkdir(parents=True)
    # The job's own copies: the team may delete its files while the job runs.
    files = open_file_store(cfg)
    paths = {}
    for param in ("training_file", "validation_file"):
        if job.body.get(param):
            with files.path(job.body[param], job.owner) as src:
                paths[param] = job_dir / "data" / f"{param}.jsonl"
                shutil.copyfile(src, paths[param])
    hp = resolve_hyperparameters(cfg, job.body["method"])
    store.event(job.id, "Preparing the training data")
    clock = Phases()
    # The served model is the base: its tokenizer counts and renders the rows from here on.
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"base_model": job.body["_base"]["path"]})})
    prepared = prepare_data(cfg, paths["training_file"], paths.get("validation_file"))
    store.event(
        job.id, f"Training data prepared: {len(prepared.train)} rows to train, {len(prepared.eval)} to evaluate"
    )
    cfg, steps = job_config(cfg, job, len(prepared.train), hp)
    validation = validate_data(cfg, prepared)
    clock.mark("validation")
    kind = job.body["method"]["type"]
    store.update(
        job.id,
        hyperparameters={k: hp[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier")},
        method={"type": kind, kind: {"hyperparameters": hp}},
    )
    # The team's training tokens today (fine_tuning.tiers: training_tokens_per_day), before training.
    day = int(time.time()) // 86400 * 86400
    used = store.trained_tokens_since(job.owner, day)
    budget = limits_for(cfg, job.tier).training_tokens_per_day
    estimate = _estimate_tokens(prepared, hp["n_epochs"])
    if used + estimate > budget:
        raise JobFailed(
            "training_tokens_limit_exceeded",
            f"this job would train ~{estimate} tokens; the team trained {used} today of its tier's {budget} "
            "(fine_tuning.tiers: training_tokens_per_day)",
        )
    store.update(job.id, _estimated_tokens=estimate)

    setup_mlflow(cfg)
    with mlflow.start_run(run_name=f"fine-tuning-{job.id}") as run:
        tags = log_lineage(cfg, prepared.fingerprint, validation.to_dict())
        mlflow.set_tags({"tuneloop.job": job.id, "tuneloop.owner": job.owner, "tuneloop.kind": "fine-tuning-job"})
        mlflow.log_params({f"hp.{k}": v for k, v in hp.items()} | {"method": kind, "max_steps": steps})
        base_ref = job.body["_base"]["path"]
        store.event(job.id, "Evaluating the base model")
        clock.mark("setup")
        base_metrics, _ = evaluate(cfg, base_ref, prepared.eval, "base")
        clock.mark("evaluation")
        spec = candidate_specs(cfg, prepared.dir, job_dir / "run")[0]

        def on_log(line: str) -> None:
            logger.info(line)
            if line.startswith("[train] step ") and "loss=" in line:
                step = int(line.split()[2].split("/")[0])
                values = dict(p.split("=", 1) for p in line.split()[3:] if "=" in p)
                data = {"step": step, "total_steps": steps}
                if "loss" in values:
                    data["train_loss"] = float(values["loss"])
                if "eval_loss" in values:
                    data["valid_loss"] = float(values["eval_loss"])
                store.event(
                    job.id,
                    f"Step {step}/{steps}: " + ", ".join(f"{k}={v}" for k, v in values.items()),
                    type="metrics",
                    data=data,
                )

        store.event(job.id, f"Training: {steps} steps, LoRA on {spec.training.get('lora', {})}")
        result = train_candidate(spec, cfg.training.kubernetes, on_log=on_log)
        clock.mark("training")
        trained = result.train_result
        for step, loss in trained.get("loss_history", []):
            mlflow.log_metric("train_loss", loss, step=int(step))
        store.event(job.id, "Evaluating the fine-tuned model")
        metrics, predictions = evaluate(cfg, str(result.model_dir), prepared.eval, job.id)
        clock.mark("evaluation")
        mlflow.log_metrics({f"base.{k}": v for k, v in base_metrics.items()} | metrics)
        blessing = bless(metrics, base_metrics, cfg.blessing.thresholds, baseline_version="base")
        mlflow.log_dict({"blessed": blessing.blessed, "reasons": blessing.reasons}, "blessing.json")
        mlflow.log_dict({"rows": predictions[:200]}, "predictions.json")
        adapter_dir = Path(trained.get("adapter_dir") or Path(spec.output_dir) / "adapter")
        model_id = ft_model_id(job.body["_base"]["name"], job.owner, job.body.get("user_provided_suffix"), job.id)
        version = register_adapter(cfg, run.info.run_id, adapter_dir, model_id, job.owner, job.body["_base"], job.id)
        clock.mark("registration")
        tokens = int(trained.get("train_tokens") or estimate)
        store.checkpoint(
            job.id,
            int(trained.get("global_step") or steps),
            model_id,
            {
                "step": float(trained.get("global_step") or steps),
                "train_loss": float(trained.get("train_loss") or float("nan")),
                "valid_loss": float(trained.get("eval_loss") or float("nan")),
                "full_valid_loss": float(trained.get("eval_loss") or float("nan")),
            },
        )
        store.event(
            job.id, f"New fine-tuned model created: {model_id}", data={"metrics": metrics, "base": base_metrics}
        )
        store.update(
            job.id,
            expect=(RUNNING,),
            status="succeeded",
            fine_tuned_model=model_id,
            trained_tokens=tokens,
            _mlflow={"run_id": run.info.run_id, "adapters_version": version, **tags},
            _metrics={"fine_tuned": metrics, "base": base_metrics, "blessed": blessing.blessed},
            _timings={
                "queue": round(job.runner.get("started", job.body["created_at"]) - job.body["created_at"], 2),
                "startup": round(started - job.runner.get("started", started), 2),  # the run's process and imports
            }
            | clock.seconds,
        )
        store.event(job.id, "The job has successfully completed")
    return {
        "job_id": job.id,
        "fine_tuned_model": model_id,
        "metrics": metrics,
        "base": base_metrics,
        "seconds": round(time.time() - started, 1),
    }


class Phases:
    """Seconds spent in each named phase of the run (a phase named twice adds up)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._at = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self._at, 2)
        self._at = now


def _estimate_tokens(prepared, epochs: int) -> int:
    """Tokens the job trains: the prepared rows' characters / 4 (a token is ~4 characters of
    English), times epochs; what the tier's daily budget is checked against before training."""
    chars = 0
    for ex in prepared.train:
        chars += len(ex.prompt or "") + len(ex.completion or "")
        chars += sum(len(str(m.get("content") or "")) for m in ex.messages or [])
        chars += len(str((ex.rejected or {}).get("content") or ""))
    return max(1, chars // 4) * epochs
