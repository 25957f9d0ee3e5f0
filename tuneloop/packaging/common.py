"""What every packaging step shares: its error, the progress line, the time stamp, and the
environment of the bentoml processes it starts (build, infra validation, `tuneloop serve`)."""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from typing import Callable

from tuneloop.config import TuneloopConfig
from tuneloop.gateway.keys import PEPPER_ENV
from tuneloop.registry import ModelRegistry, ModelVersionInfo, RegistryError

log = logging.getLogger("tuneloop.packaging")


class PackagingError(Exception):
    """A packaging step that cannot be done; the message says what and why."""


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def say(progress: Callable[[str], None] | None, message: str) -> None:
    log.info(message)
    if progress is not None:
        progress(message)


def registry_version(cfg: TuneloopConfig, version: str | int | None) -> tuple[ModelRegistry, ModelVersionInfo]:
    """The registry and the version a packaging step works on: `version`, else the champion."""
    registry = ModelRegistry.from_config(cfg)
    if version is not None:
        try:
            return registry, registry.version(version)
        except RegistryError as exc:
            raise PackagingError(str(exc)) from None
    info = registry.champion()
    if info is None:
        raise PackagingError(
            f"model {registry.name!r} has no champion in {cfg.mlflow_tracking_uri}: "
            "promote a version first (or name one with --version)"
        )
    return registry, info


def deployment_env(cfg: TuneloopConfig) -> dict[str, str]:
    """Where a served bento finds this deployment's state: the state folder (API keys, the
    pepper file), MLflow (the content filter's classifier by alias), Redis and the key store
    when configured, and the pepper when it comes from the environment."""
    env = {"TUNELOOP_HOME": str(cfg.home), "TUNELOOP_MLFLOW_URI": cfg.mlflow_tracking_uri}
    if cfg.gateway.redis_url:
        env["TUNELOOP_REDIS_URL"] = cfg.gateway.redis_url
    if cfg.gateway.key_store_url:
        env["TUNELOOP__GATEWAY__KEY_STORE_URL"] = cfg.gateway.key_store_url
    if cfg.gateway.pepper_file:
        env["TUNELOOP__GATEWAY__PEPPER_FILE"] = str(cfg.resolve(cfg.gateway.pepper_file))
    if os.environ.get(PEPPER_ENV):
        env[PEPPER_ENV] = os.environ[PEPPER_ENV]
    return env


def bentoml_env(cfg: TuneloopConfig) -> dict[str, str]:
    """The environment for bentoml subprocesses: this config's store, offline, this
    deployment's state (deployment_env), and the caller's TUNELOOP_* / TUNELOOP__* overrides:
    the environment wins over the bento's packaged config, as it does over a config file
    (tuneloop/config.py), and the served worker validates them at start-up. Only
    TUNELOOP_CONFIG is not passed: a bento stands on the config packaged with it."""
    env = {k: v for k, v in os.environ.items() if k != "TUNELOOP_CONFIG"}
    env.update(deployment_env(cfg))
    env.update(
        BENTOML_HOME=str(cfg.bentoml_home),
        BENTOML_DO_NOT_TRACK="true",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env
