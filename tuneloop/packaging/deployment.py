"""The deployment record: only a bento that passed infra validation is marked deployed.

    deploy_champion(cfg)   import -> build -> infra_validate -> mark deployed

conclude_deployment marks it: the `deployed.bento` tag on the MLflow version and
<home>/deployed.json (what `tuneloop serve` starts: serve_plan). A failed validation, or a
version that stopped being the champion while it was built, changes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tuneloop.config import REPO_ROOT, TuneloopConfig
from tuneloop.packaging.bento import build_bento, import_champion, packaged_serving_config
from tuneloop.packaging.common import PackagingError, deployment_env, now, say
from tuneloop.packaging.server import InfraValidation, ServeCommand, infra_validate, serve_command
from tuneloop.registry import ModelRegistry

DEPLOYED_FILE = "deployed.json"


@dataclass
class DeployResult:
    deployed: bool
    registered_model: str
    version: str
    model_tag: str | None = None
    bento_tag: str | None = None
    validation: InfraValidation | None = None
    reason: str = ""
    previous_bento: str | None = None  # what was deployed before (still deployed when this failed)
    seconds: dict[str, float] = field(default_factory=dict)  # per step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        v = f"{self.registered_model} v{self.version}"
        if self.deployed:
            return f"deployed {v} as bento {self.bento_tag} (model {self.model_tag})"
        keep = f"; still deployed: {self.previous_bento}" if self.previous_bento else "; nothing is deployed"
        return f"NOT deployed {v}: {self.reason}{keep}"


def _deployed_file(cfg: TuneloopConfig) -> Path:
    return cfg.home / DEPLOYED_FILE


def deployed(cfg: TuneloopConfig) -> dict[str, Any] | None:
    """The deployment record (<home>/deployed.json), or None when nothing was deployed."""
    path = _deployed_file(cfg)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PackagingError(f"{path}: unreadable deployment record ({exc}); deploy again to rewrite it") from None


def deployed_bento(cfg: TuneloopConfig) -> str | None:
    """The bento tag `tuneloop serve` should start, or None when nothing was deployed."""
    record = deployed(cfg)
    return record.get("bento_tag") if record else None


def serve_plan(cfg: TuneloopConfig, host: str = "127.0.0.1", port: int = 3000) -> ServeCommand:
    """What `tuneloop serve` runs, first match wins:

    1. the deployed bento (deployed.json): `bentoml serve <bento>`;
    2. the champion, not packaged yet: imported into the BentoML store, served from the
       source tree (`bentoml serve bentos.service:TuneloopLLM`) with serving.bento_model;
    3. bentos/ as configured (serving.model_dir or the base model).
    """
    bento = deployed_bento(cfg)
    if bento:
        command = serve_command(cfg, bento, host, port)
        command.what = f"deployed bento {bento}"
        return command
    env = {
        **os.environ,
        "BENTOML_HOME": str(cfg.bentoml_home),
        "BENTOML_DO_NOT_TRACK": "true",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if cfg.source is not None:
        env["TUNELOOP_CONFIG"] = str(Path(cfg.source).resolve())
    env.update(deployment_env(cfg))
    what = "bentos/ as configured (serving.model_dir or the base model)"
    try:
        model_tag, info = import_champion(cfg)
    except PackagingError:
        pass  # no champion yet
    else:
        serving = packaged_serving_config(cfg, model_tag, info)["serving"]
        env.update(
            {
                "TUNELOOP__SERVING__BENTO_MODEL": model_tag,
                "TUNELOOP_SERVE_MODEL_NAME": serving["model_name"],
                "TUNELOOP_SERVE_MODEL_VERSION": serving["model_version"],
                "TUNELOOP__SERVING__ALIASES": json.dumps(serving["aliases"]),
            }
        )
        what = f"champion {info.name} v{info.version} ({model_tag}) from bentos/, not packaged"
    argv = [sys.executable, "-m", "bentoml", "serve", "bentos.service:TuneloopLLM", "--host", host, "--port", str(port)]
    return ServeCommand(argv, env, REPO_ROOT, what)


def _record_deployment(cfg: TuneloopConfig, record: dict[str, Any]) -> None:
    path = _deployed_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader sees the old record or the new one


def not_champion_reason(cfg: TuneloopConfig, version: str | int) -> str | None:
    """Why `version` may not be deployed as the champion, or None when it is the champion."""
    now = ModelRegistry.from_config(cfg).champion()
    if now is not None and now.version == str(version):
        return None
    return (
        f"v{version} is not the champion (it is {'none' if now is None else 'v' + now.version}); "
        "deploy the champion instead"
    )


def conclude_deployment(
    cfg: TuneloopConfig,
    info,
    model_tag: str,
    bento_tag: str,
    validation: InfraValidation,
    require_champion: bool = True,
    target: str | None = None,
    previous_bento: str | None = None,
    seconds: dict[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DeployResult:
    """The last step: mark the bento deployed -- only if it passed infra validation and
    (require_champion) its version is still the champion. Otherwise nothing changes."""
    result = DeployResult(
        False,
        info.name,
        str(info.version),
        model_tag=model_tag,
        bento_tag=bento_tag,
        validation=validation,
        previous_bento=previous_bento,
        seconds=dict(seconds or {}),
    )
    if not validation.passed:
        result.reason = f"infra validation failed: {validation.reason} (server log: {validation.log_path})"
        say(progress, result.summary())
        return result
    if require_champion:
        # The champion may have moved while we built: never deploy a version that lost the title.
        result.reason = not_champion_reason(cfg, info.version) or ""
        if result.reason:
            say(progress, result.summary())
            return result
    ModelRegistry.from_config(cfg).mark_deployed(info.version, bento_tag)
    _record_deployment(
        cfg,
        {
            "bento_tag": bento_tag,
            "model_tag": model_tag,
            "registered_model": info.name,
            "version": str(info.version),
            "run_id": info.run_id,
            "target": target or cfg.bento.target,
            "bentoml_home": str(cfg.bentoml_home),
            "deployed_at": now(),
            "previous_bento": previous_bento,
        },
    )
    result.deployed = True
    result.reason = validation.reason
    say(progress, result.summary())
    return result


def deploy_champion(
    cfg: TuneloopConfig,
    version: str | int | None = None,
    target: str | None = None,
    timeout: float | None = None,
    require_champion: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> DeployResult:
    """Import, build, infra-validate; only a bento that passed is marked deployed.

    version None: the current champion. require_champion (default: version is None):
    refuse to mark a version that is no longer the champion when validation ends. A
    failed validation returns deployed=False with the reason and leaves the previous
    deployment (MLflow tag and deployed.json) as it was. Import and build errors raise
    PackagingError; registry errors raise RegistryError.
    """
    seconds: dict[str, float] = {}
    previous = deployed_bento(cfg)
    require_champion = version is None if require_champion is None else require_champion
    if require_champion and version is not None and (reason := not_champion_reason(cfg, version)):
        # No minutes spent building what would be refused at the end.
        return DeployResult(False, cfg.mlflow.registered_model, str(version), reason=reason, previous_bento=previous)
    t = time.perf_counter()
    model_tag, info = import_champion(cfg, version, progress)
    seconds["import"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    bento_tag = build_bento(cfg, model_tag, info, target, progress)
    seconds["build"] = round(time.perf_counter() - t, 1)
    validation = infra_validate(bento_tag, cfg, timeout, progress)
    seconds["infra_validation"] = validation.seconds
    return conclude_deployment(
        cfg,
        info,
        model_tag,
        bento_tag,
        validation,
        require_champion=require_champion,
        target=target,
        previous_bento=previous,
        seconds=seconds,
        progress=progress,
    )
