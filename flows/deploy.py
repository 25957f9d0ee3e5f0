"""The deploy flow: champion -> BentoML model -> bento -> infra validation -> deployed.

Each task is a one-line call into tuneloop/packaging/; this file decides retries,
logging and the Prefect artifact. Nothing is marked deployed unless the built bento
answered a completion and a chat completion from the real `bentoml serve`.

The training flow calls `deploy_champion_flow(config_path, version=<promoted version>)`
after a promotion (a subflow); `tuneloop package` calls the component directly.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tuneloop.config import TuneloopConfig, load_config
from tuneloop.packaging.bento import bento_path, build_bento, containerize_command, import_champion
from tuneloop.packaging.deployment import DeployResult, conclude_deployment, deployed_bento, not_champion_reason
from tuneloop.packaging.server import infra_validate as validate_bento


class DeploymentFailed(Exception):
    """The bento did not pass infra validation (or the champion moved); nothing was deployed."""


# An MLflow or file-system hiccup is worth one more try; the import is idempotent.
@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def import_model(cfg: TuneloopConfig, version: str | None):
    return import_champion(cfg, version, progress=get_run_logger().info)


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def build(cfg: TuneloopConfig, model_tag: str, info, target: str | None) -> str:
    return build_bento(cfg, model_tag, info, target, progress=get_run_logger().info)


# No retries: a bento that fails validation is an answer, not a glitch.
@task(cache_policy=NO_CACHE)
def infra_validate(cfg: TuneloopConfig, bento_tag: str):
    return validate_bento(bento_tag, cfg, progress=get_run_logger().info)


@task(cache_policy=NO_CACHE)
def conclude(
    cfg: TuneloopConfig,
    info,
    model_tag: str,
    bento_tag: str,
    validation,
    require_champion: bool,
    target: str | None,
    previous: str | None,
):
    return conclude_deployment(
        cfg, info, model_tag, bento_tag, validation, require_champion, target, previous, progress=get_run_logger().info
    )


def deployment_markdown(cfg: TuneloopConfig, result) -> str:
    v = result.validation

    def code(x) -> str:
        return f"`{x}`" if x else "-"

    rows = [
        ("result", "**deployed**" if result.deployed else "**NOT deployed**"),
        ("model", f"{result.registered_model} v{result.version}"),
        ("BentoML model", code(result.model_tag)),
        ("bento", code(result.bento_tag)),
        ("infra validation", f"{'passed' if v.passed else 'failed'}: {v.reason}" if v else "not run"),
        ("still deployed" if not result.deployed else "previously deployed", code(result.previous_bento)),
        ("seconds", ", ".join(f"{k} {s}" for k, s in result.seconds.items()) or "-"),
    ]
    md = [f"# Deployment: {result.registered_model} v{result.version}", "", "| | |", "|---|---|"]
    md += [f"| {k} | {val} |" for k, val in rows]
    if not result.deployed:
        md += ["", f"Reason: {result.reason}"]
        if v is not None:
            md += ["", "Server log (end):", "", "```", v.log_tail[-2500:], "```"]
    else:
        dockerfile = bento_path(cfg, result.bento_tag) / "env" / "docker" / "Dockerfile"
        md += [
            "",
            "Serve it: `tuneloop serve`, or",
            "",
            "```",
            f"BENTOML_HOME={cfg.bentoml_home} bentoml serve {result.bento_tag}",
            "```",
            "",
            f"Image (needs Docker; Dockerfile: `{dockerfile}`):",
            "",
            "```",
            containerize_command(cfg, result.bento_tag),
            "```",
        ]
    return "\n".join(md)


@flow(name="deploy-champion", log_prints=True)
def deploy_champion_flow(
    config_path: str | None = None, version: str | None = None, target: str | None = None, raise_on_failure: bool = True
) -> dict[str, Any]:
    """Package the champion (or `version`) as a bento, prove it serves, mark it deployed.

    With a version given (the training flow passes the one it promoted) it is still only
    deployed while it is the champion. Raises DeploymentFailed after writing the artifact
    when nothing was deployed (unless raise_on_failure is False); returns the result.
    """
    cfg = load_config(config_path)
    previous = deployed_bento(cfg)
    reason = not_champion_reason(cfg, version) if version is not None else None
    if reason:  # promoted, then replaced before we got here: nothing to build
        result = DeployResult(False, cfg.mlflow.registered_model, str(version), reason=reason, previous_bento=previous)
    else:
        t = time.perf_counter()
        model_tag, info = import_model(cfg, version)
        t_import, t = time.perf_counter() - t, time.perf_counter()
        bento_tag = build(cfg, model_tag, info, target)
        t_build = time.perf_counter() - t
        validation = infra_validate(cfg, bento_tag)
        result = conclude(cfg, info, model_tag, bento_tag, validation, True, target, previous)
        result.seconds = {
            "import": round(t_import, 1),
            "build": round(t_build, 1),
            "infra_validation": validation.seconds,
        }
    create_markdown_artifact(
        key="deployment",
        markdown=deployment_markdown(cfg, result),
        description="Champion packaged as a bento and infra-validated",
    )
    if not result.deployed and raise_on_failure:
        raise DeploymentFailed(result.summary())
    return result.to_dict()
