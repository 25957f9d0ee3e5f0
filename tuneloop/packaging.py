"""Packaging: the MLflow champion as a built, infra-validated BentoML bento.

    deploy_champion(cfg)   import -> build -> infra_validate -> mark deployed

1. import_champion: the champion's files (from the MLflow registry) become a model in the
   BentoML model store under cfg.bentoml_home, tagged `<registered name>:v<version>-<run>`,
   with labels pointing back to MLflow (registered model, version, run id). Idempotent:
   the same MLflow version is imported once.
2. build_bento: `bentoml build` of bentos/ from a staging copy that adds
   bentos/packaged_config.yaml -- the serving section with `bento_model` (which makes the
   bento reference the model), the served name (= registered name), version and aliases.
   bentos/service.py reads that file when it sits next to it. Python packages are pinned
   to the exact versions installed here (the bentofile's packages and everything they
   require), `lock_packages: false`, so the build needs no network.
3. infra_validate (TFX's InfraValidator): `bentoml serve <bento>` on a free local port,
   wait for /readyz, one /v1/completions and one /v1/chat/completions, stop it.
4. Only a bento that passed is recorded: the `deployed.bento` tag on the MLflow version
   and <home>/deployed.json (what `tuneloop serve` starts). A failed one changes nothing.

Images. A bento describes its Docker image; two variants (`target`, config bento.target):
  cpu  -- bento `tuneloop_llm`: python:3.11-slim (debian), torch's CPU wheel
          (`torch==<v>+cpu` from https://download.pytorch.org/whl/cpu; the image installs
          with uv, so the build-stage env UV_INDEX_STRATEGY=unsafe-best-match lets every
          other pin come from PyPI).
  gpu  -- bento `tuneloop_llm_cuda`: docker.cuda_version 12.8 (nvidia/cuda:12.8.1-cudnn-
          runtime-ubuntu24.04), torch's default PyPI wheel (the CUDA build; its nvidia-*
          runtime wheels come pinned by torch itself). The image brings CUDA; the serving
          engine decides the device (tuneloop/serving/engine.py).
The Dockerfile is generated inside the bento (<bento>/env/docker/Dockerfile). Building
the image needs a Docker daemon (none on this machine) and the package indexes:

    BENTOML_HOME=<home>/bentoml bentoml containerize tuneloop_llm:<bento version> -t tuneloop-llm:<bento version>
    docker run --rm -p 3000:3000 tuneloop-llm:<bento version>                        # cpu
    docker run --rm --gpus all -p 3000:3000 tuneloop-llm-cuda:<bento version>       # gpu

(containerize_command() prints the first line for a given bento.) The bento references
its model in the store; containerize copies it into the image, and `bentoml export
<bento> x.bento` gives a self-contained archive for another machine.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import yaml

from tuneloop.config import REPO_ROOT, TuneloopConfig
from tuneloop.ports import die_with_parent, free_port, stop_process_group

log = logging.getLogger(__name__)

BENTOS_DIR = REPO_ROOT / "bentos"
BENTOFILE = BENTOS_DIR / "bentofile.yaml"
# Where the packaged serving config sits inside the bento's sources; bentos/service.py
# looks for it next to itself.
PACKAGED_CONFIG = "bentos/packaged_config.yaml"
DEPLOYED_FILE = "deployed.json"

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_VERSION = "12.8"
TARGETS = {
    # target -> (bento name, docker options)
    "cpu": ("tuneloop_llm", {"distro": "debian", "python_version": "3.11"}),
    "gpu": ("tuneloop_llm_cuda", {"distro": "debian", "python_version": "3.11", "cuda_version": CUDA_VERSION,
                                  # vLLM in its own venv (/opt/vllm), for bento.gpu_engine: vllm
                                  "setup_script": "bentos/setup_vllm.sh"}),
}
GPU_VLLM_PYTHON = "/opt/vllm/bin/python"  # where bentos/setup_vllm.sh puts vLLM in the gpu image

# Label keys on the BentoML model and the bento: the way back to MLflow.
LABEL_MODEL = "mlflow.registered_model"
LABEL_VERSION = "mlflow.version"
LABEL_RUN = "mlflow.run_id"


class PackagingError(Exception):
    """A packaging step that cannot be done; the message says what and why."""


@dataclass
class InfraValidation:
    passed: bool
    bento_tag: str
    reason: str  # why it failed, or a one-line summary of what passed
    seconds_to_ready: float | None = None
    seconds: float = 0.0
    completion: str | None = None  # what the bento answered
    chat: str | None = None
    log_path: str | None = None
    log_tail: str = ""


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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _say(progress: Callable[[str], None] | None, message: str) -> None:
    log.info(message)
    if progress is not None:
        progress(message)


# ---------------------------------------------------------------------------------------
# 1. MLflow version -> BentoML model store


def bentoml_name(name: str) -> str:
    """A BentoML tag name (lowercase letters, digits, '-', '_', '.') for an MLflow model name."""
    safe = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._")
    if not safe:
        raise PackagingError(f"cannot make a BentoML model name from MLflow model name {name!r}")
    return safe


def model_tag_for(info) -> str:
    """`<name>:v<version>-<run id prefix>`: one tag per MLflow version, and a new registry
    that reuses version numbers (a fresh database) never collides with an old import."""
    run = (info.run_id or "norun")[:8].lower()
    return f"{bentoml_name(info.name)}:v{info.version}-{run}"


def _model_store(cfg: TuneloopConfig):
    # The store is passed explicitly: BentoML fixes BENTOML_HOME once per process, and one
    # process (a Prefect worker, a test session) may serve several configs.
    from bentoml._internal.models.model import ModelStore

    path = cfg.bentoml_home / "models"
    path.mkdir(parents=True, exist_ok=True)
    return ModelStore(str(path))


def _version_info(cfg: TuneloopConfig, version: str | int | None):
    from tuneloop.registry import ModelRegistry

    registry = ModelRegistry.from_config(cfg)
    if version is not None:
        return registry, registry.version(version)
    info = registry.champion()
    if info is None:
        raise PackagingError(
            f"model {registry.name!r} has no champion in {cfg.mlflow_tracking_uri}: "
            "promote a version first (or name one with --version)"
        )
    return registry, info


def import_champion(cfg: TuneloopConfig, version: str | int | None = None,
                    progress: Callable[[str], None] | None = None):
    """Import the champion (or `version`) into the BentoML model store.

    Returns (bento_model_tag, ModelVersionInfo). A second call for the same version
    returns the existing model without downloading again.
    """
    import bentoml
    from bentoml.exceptions import NotFound

    registry, info = _version_info(cfg, version)
    tag = model_tag_for(info)
    store = _model_store(cfg)
    try:
        existing = bentoml.models.get(tag, _model_store=store)
        _say(progress, f"model {tag} already in the BentoML store ({existing.path})")
        return tag, info
    except NotFound:
        pass

    _say(progress, f"importing {info.name} v{info.version} (run {info.run_id}) into the BentoML store as {tag}")
    cfg.home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="download-", dir=cfg.home) as tmp:
        local = registry.download(info.version, tmp)
        if not (local / "config.json").exists():
            raise PackagingError(
                f"{info.uri} ({info.source}): not a Hugging Face model folder (no config.json); cannot package it"
            )
        labels = {
            LABEL_MODEL: info.name,
            LABEL_VERSION: str(info.version),
            LABEL_RUN: info.run_id or "",
            "project": "tuneloop",
        }
        metadata = {
            "mlflow_tracking_uri": registry.tracking_uri,
            "mlflow_source": info.source,
            "mlflow_aliases": list(info.aliases),
            "mlflow_tags": dict(info.tags),
            "imported_at": _now(),
        }
        with bentoml.models.create(tag, labels=labels, metadata=metadata, _model_store=store) as ref:
            shutil.copytree(local, ref.path, dirs_exist_ok=True)
    return tag, info


# ---------------------------------------------------------------------------------------
# 2. bentoml build


def _bentofile() -> dict[str, Any]:
    try:
        return yaml.safe_load(BENTOFILE.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PackagingError(f"{BENTOFILE}: cannot read the bentofile: {exc}") from None


def pinned_packages(names: list[str]) -> list[str]:
    """`name==version` for the named packages and everything they require, as installed here.

    Walks the installed distributions' metadata (markers evaluated for this interpreter,
    extras followed), so the bento installs exactly what was tested, with no resolver run.
    """
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    top = [Requirement(n) for n in names]
    top_names = {canonicalize_name(r.name) for r in top}
    pins: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(r.name, frozenset(r.extras)) for r in top]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if key[0] in top_names:
                raise PackagingError(f"package {name!r} (named in {BENTOFILE}) is not installed here") from None
            continue  # a requirement whose marker matched but is absent: nothing to pin
        pins[canonicalize_name(dist.metadata["Name"])] = f"{dist.metadata['Name']}=={dist.version}"
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return [pins[k] for k in sorted(pins)]


def _packages_for(target: str, names: list[str]) -> tuple[list[str], list[str]]:
    """(pins, extra index urls) for an image target."""
    pins = pinned_packages(names)
    extra_index: list[str] = []
    for i, pin in enumerate(pins):
        name, version = pin.split("==")
        if name.lower() != "torch":
            continue
        public = version.split("+")[0]
        if target == "cpu":
            # The CPU wheel: no CUDA libraries in the image (~200 MB instead of ~3 GB).
            pins[i] = f"torch=={public}+cpu"
            extra_index.append(TORCH_CPU_INDEX)
        else:
            pins[i] = f"torch=={public}"  # PyPI's Linux wheel is the CUDA build
    return pins, extra_index


def packaged_serving_config(cfg: TuneloopConfig, model_tag: str, info, target: str = "cpu") -> dict[str, Any]:
    """The config the bento carries: this config's serving section, bound to the imported model
    (a gpu bento with bento.gpu_engine vllm: the vLLM engine from the image's /opt/vllm)."""
    serving = cfg.serving.model_dump(mode="json")
    if target == "gpu" and cfg.bento.gpu_engine == "vllm":
        serving.update(engine="vllm", vllm_python=GPU_VLLM_PYTHON)
    serving.update(
        bento_model=model_tag,
        model_dir=None,
        model_name=info.name,
        model_version=str(info.version),
        aliases=[f"{info.name}@{alias}" for alias in sorted(info.aliases)],
    )
    # The bento carries its gateway policy too (tiers, PII, filter); where state lives (home,
    # MLflow, key store, Redis) is the deployment's: deployment_env() says it at serve time.
    return {"serving": serving, "gateway": cfg.gateway.model_dump(mode="json")}


def _stage_sources(staging: Path, bentofile: dict[str, Any]) -> None:
    # The top folders the bentofile includes (bentos/, tuneloop/, configs/); bentoml
    # itself applies include/exclude to the copy.
    tops = sorted({pattern.split("/")[0] for pattern in bentofile.get("include", [])})
    for top in tops:
        src = REPO_ROOT / top
        if src.is_dir():
            shutil.copytree(src, staging / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc",
                                                                                Path(PACKAGED_CONFIG).name))
        elif src.is_file():
            shutil.copy2(src, staging / top)


def deployment_env(cfg: TuneloopConfig) -> dict[str, str]:
    """Where a served bento finds this deployment's state: the state folder (API keys, the
    pepper file), MLflow (the content filter's classifier by alias), Redis and the key store
    when configured, and the pepper when it comes from the environment."""
    from tuneloop.gateway.keys import PEPPER_ENV

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


def _subprocess_env(cfg: TuneloopConfig) -> dict[str, str]:
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


def build_bento(cfg: TuneloopConfig, model_tag: str, version_info, target: str | None = None,
                progress: Callable[[str], None] | None = None) -> str:
    """`bentoml build` bentos/ around the imported model; returns the bento tag.

    target: "cpu" or "gpu" (the Docker image the bento describes; default cfg.bento.target).
    """
    target = target or cfg.bento.target
    if target not in TARGETS:
        raise PackagingError(f"unknown bento target {target!r}: expected one of {sorted(TARGETS)}")
    bento_name, docker = TARGETS[target]
    bentofile = _bentofile()
    names = (bentofile.get("python") or {}).get("packages") or []
    pins, extra_index = _packages_for(target, names)
    info = version_info
    bentofile.update(
        name=bento_name,
        include=list(bentofile.get("include", [])) + [PACKAGED_CONFIG],
        labels={
            **(bentofile.get("labels") or {}),
            LABEL_MODEL: info.name,
            LABEL_VERSION: str(info.version),
            LABEL_RUN: info.run_id or "",
            "bento_model": model_tag,
            "target": target,
        },
        python={"packages": pins, "lock_packages": False, **({"extra_index_url": extra_index} if extra_index else {})},
        docker={**(bentofile.get("docker") or {}), **docker},
    )
    if extra_index:
        # The image installs with uv, whose default takes each package from the first index
        # that has it: the torch index also carries numpy, sympy, ... but not our pinned
        # versions. Best match across indexes keeps every pin installable (Docker build only).
        bentofile["envs"] = list(bentofile.get("envs") or []) + [
            {"name": "UV_INDEX_STRATEGY", "value": "unsafe-best-match", "stage": "build"}]

    cfg.home.mkdir(parents=True, exist_ok=True)
    _say(progress, f"building bento {bento_name} ({target} image) around {model_tag}, {len(pins)} pinned packages")
    with tempfile.TemporaryDirectory(prefix="bento-build-", dir=cfg.home) as tmp:
        staging = Path(tmp)
        _stage_sources(staging, bentofile)
        (staging / PACKAGED_CONFIG).write_text(
            "# Written by tuneloop packaging (tuneloop/packaging.py): the serving config of this bento.\n"
            + yaml.safe_dump(packaged_serving_config(cfg, model_tag, info, target), sort_keys=False)
        )
        (staging / "bentofile.yaml").write_text(yaml.safe_dump(bentofile, sort_keys=False))
        cmd = [sys.executable, "-m", "bentoml", "build", "-f", str(staging / "bentofile.yaml"), "-o", "tag", str(staging)]
        proc = subprocess.run(cmd, cwd=staging, env=_subprocess_env(cfg), capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    match = re.search(r"__tag__:(\S+)", out)
    if proc.returncode != 0 or not match:
        raise PackagingError(f"`bentoml build` failed (exit {proc.returncode}):\n{out[-3000:]}")
    bento_tag = match.group(1)
    _say(progress, f"built bento {bento_tag}; Dockerfile: {bento_path(cfg, bento_tag) / 'env' / 'docker' / 'Dockerfile'}")
    return bento_tag


def bento_path(cfg: TuneloopConfig, bento_tag: str) -> Path:
    """The built bento's folder in the store (bentos/<name>/<version>)."""
    name, _, version = bento_tag.partition(":")
    return cfg.bentoml_home / "bentos" / name / version


def containerize_command(cfg: TuneloopConfig, bento_tag: str, image: str | None = None) -> str:
    """The command that builds the bento's Docker image (needs a Docker daemon)."""
    name, _, version = bento_tag.partition(":")
    image = image or f"{name.replace('_', '-')}:{version}"
    return f"BENTOML_HOME={cfg.bentoml_home} bentoml containerize {bento_tag} -t {image}"


# ---------------------------------------------------------------------------------------
# 3. infra validation: the real server, a real request


@dataclass
class ServeCommand:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    what: str = ""  # what it serves, in words


def serve_command(cfg: TuneloopConfig, bento_tag: str, host: str = "127.0.0.1", port: int = 3000) -> ServeCommand:
    """How to start a built bento against this config's BentoML store."""
    argv = [sys.executable, "-m", "bentoml", "serve", bento_tag, "--host", host, "--port", str(port)]
    cfg.home.mkdir(parents=True, exist_ok=True)
    return ServeCommand(argv, _subprocess_env(cfg), cfg.home, f"bento {bento_tag}")


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# Lines a server that will never get ready writes: BentoML's own when the service's
# __init__ raised (model that does not load), and bentos/service.py's when warm-up failed.
STARTUP_FAILURES = ("Application startup failed", "warm-up failed")


def startup_failure(text: str) -> str | None:
    """Why a server failed to start, from its output, or None while no failure is there.

    The exception line of the first failure: ServingSetupError's where the service raised
    one (it names what to fix), else the last one raised before BentoML gave up.
    """
    at = min((i for i in (text.find(m) for m in STARTUP_FAILURES) if i >= 0), default=-1)
    if at < 0:
        return None
    errors = re.findall(r"^([A-Za-z_][\w.]*(?:Error|Exception)\b.*)$", text[:at], flags=re.MULTILINE)
    if not errors:
        return next(m for m in STARTUP_FAILURES if m in text)
    chosen = next((e for e in errors if re.match(r"[\w.]*ServingSetupError\b", e)), errors[-1])
    return re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=\w+:)", "", chosen)[:500]  # no module path


def _startup_failure(log_path: Path) -> str | None:
    return startup_failure(_tail(log_path, 200_000))


def _check_answers(client, base: str) -> tuple[str, str, str]:
    """One completion and one chat completion; returns (model id, completion, chat) or raises ValueError."""
    r = client.get(f"{base}/v1/models")
    if r.status_code != 200:
        raise ValueError(f"GET /v1/models answered {r.status_code}: {r.text[:300]}")
    models = r.json().get("data") or []
    if not models or not models[0].get("id"):
        raise ValueError(f"GET /v1/models listed no model: {r.text[:300]}")
    model = models[0]["id"]

    r = client.post(f"{base}/v1/completions",
                    json={"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
    if r.status_code != 200:
        raise ValueError(f"POST /v1/completions answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    choice = (body.get("choices") or [{}])[0]
    if body.get("object") != "text_completion" or not _answered(choice.get("text"), choice, body):
        raise ValueError(f"POST /v1/completions: not an OpenAI completion with an answer: {r.text[:300]}")
    completion = choice["text"]

    r = client.post(f"{base}/v1/chat/completions",
                    json={"model": model, "messages": [{"role": "user", "content": "Hello"}],
                          "max_tokens": 8, "temperature": 0})
    if r.status_code != 200:
        raise ValueError(f"POST /v1/chat/completions answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    if (body.get("object") != "chat.completion" or message.get("role") != "assistant"
            or not _answered(message.get("content"), choice, body)):
        raise ValueError(f"POST /v1/chat/completions: not an OpenAI chat completion with an answer: {r.text[:300]}")
    return model, completion, message["content"]


def _answered(text: str | None, choice: dict, body: dict) -> bool:
    """Text came back -- or the model read the prompt and chose to stop at once: an
    end-of-text first token is a working model, not a broken server. (The stop token is
    not part of the text, nor of usage.completion_tokens, so that answer has 0 tokens.)"""
    usage = body.get("usage") or {}
    if not isinstance(text, str) or "total_tokens" not in usage or usage.get("prompt_tokens", 0) < 1:
        return False
    return bool(text) or choice.get("finish_reason") == "stop"


def infra_validate(bento_tag: str, cfg: TuneloopConfig, timeout: float | None = None,
                   progress: Callable[[str], None] | None = None) -> InfraValidation:
    """Start the built bento with `bentoml serve` on a free local port, ask it one
    completion and one chat completion, stop it. Never raises for a bad bento: the
    result says passed or failed, why, and the end of the server's log."""
    port = free_port()
    log_dir = cfg.home / "infra-validation"
    log_dir.mkdir(parents=True, exist_ok=True)
    _say(progress, f"infra validation: `bentoml serve {bento_tag}` on 127.0.0.1:{port}")
    command = serve_command(cfg, bento_tag, port=port)
    if not cfg.bento.validation_compile:
        command.env["TUNELOOP__SERVING__COMPILE"] = "false"  # bento.validation_compile (config.py says why)
    headers = _validation_key(cfg, log_dir / f"keys-{port}", command.env)
    try:
        return check_server(command, port, log_dir / f"{bento_tag.replace(':', '-')}.log",
                            timeout or cfg.bento.validation_timeout_s, label=bento_tag, headers=headers)
    finally:
        shutil.rmtree(log_dir / f"keys-{port}", ignore_errors=True)


def _validation_key(cfg: TuneloopConfig, folder: Path, env: dict[str, str]) -> dict[str, str]:
    """A throwaway key store with one key for the validation run (the deployment's own store
    gets no validation keys); the request headers that carry it."""
    if cfg.gateway.auth == "off":
        return {}
    import secrets as _secrets

    from tuneloop.gateway.keys import PEPPER_ENV, KeyStore

    pepper = _secrets.token_hex(32)
    url = f"sqlite:///{folder / 'keys.db'}"
    tiers = cfg.gateway.tiers
    tier = max(tiers, key=lambda t: (tiers[t].requests_per_minute, tiers[t].tokens_per_minute))
    store = KeyStore(url, pepper.encode(), cfg.gateway.key_prefix, tiers=list(tiers))
    _, key = store.create("infra-validation", tier)
    store.close()
    env.update({"TUNELOOP__GATEWAY__KEY_STORE_URL": url, PEPPER_ENV: pepper})
    return {"Authorization": f"Bearer {key}"}


def check_server(command: ServeCommand, port: int, log_path: Path, timeout: float, label: str,
                 headers: dict[str, str] | None = None) -> InfraValidation:
    """Run a serve command until /readyz, check the OpenAI answers, always stop it."""
    import httpx

    started = time.perf_counter()
    base = f"http://127.0.0.1:{port}"

    def result(passed: bool, reason: str, **kw) -> InfraValidation:
        return InfraValidation(passed, label, reason, seconds=round(time.perf_counter() - started, 1),
                               log_path=str(log_path), log_tail=_tail(log_path), **kw)

    with open(log_path, "w") as fh:
        # its own group: stopping it stops its workers; and it stops if this process is killed first
        proc = subprocess.Popen(die_with_parent(command.argv), cwd=command.cwd, env=command.env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client(timeout=60, headers=headers) as client:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    return result(False, f"the server exited (code {proc.returncode}) before it was ready")
                crashed = _startup_failure(log_path)
                if crashed:
                    # BentoML restarts a crashed worker forever; one crash is the answer.
                    return result(False, f"the service failed to start: {crashed}")
                if time.monotonic() > deadline:
                    return result(False, f"not ready after {timeout:.0f} s (GET /readyz never answered 200)")
                try:
                    if client.get(f"{base}/readyz", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass  # not listening yet
                time.sleep(0.5)
            ready = round(time.perf_counter() - started, 1)
            try:
                model, completion, chat = _check_answers(client, base)
            except (ValueError, httpx.HTTPError) as exc:
                return result(False, f"ready after {ready} s, but {exc}", seconds_to_ready=ready)
        return result(True, f"ready after {ready} s; {model} answered a completion and a chat completion",
                      seconds_to_ready=ready, completion=completion, chat=chat)
    finally:
        stop_process_group(proc)


@dataclass
class ServeOutcome:
    exit_code: int
    failure: str | None = None  # the one-line reason when the server could not start


def run_server(command: ServeCommand, host: str, port: int, out=None) -> ServeOutcome:
    """Run a serve command in the foreground until it ends; what `tuneloop serve` does.

    Its output passes through. When the service cannot start (a model that does not load,
    a failed warm-up), BentoML would restart its worker forever: the first failure ends the
    server instead, with its reason. SIGINT / SIGTERM go to the server's process group, so
    it drains and stops as it would on its own. Once /readyz answers 200 one line says so.
    """
    import threading
    import urllib.request
    from collections import deque

    out = out or sys.stdout
    proc = subprocess.Popen(command.argv, cwd=command.cwd, env=command.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True, errors="replace")

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.perf_counter()

    def announce_ready() -> None:
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        print(f"tuneloop: ready after {time.perf_counter() - started:.0f} s; "
                              f"OpenAI API on {url}/v1", file=out, flush=True)
                        return
            except OSError:
                pass
            time.sleep(0.5)

    threading.Thread(target=announce_ready, name="readyz-watch", daemon=True).start()
    recent: deque[str] = deque(maxlen=400)  # enough for the traceback before BentoML's line
    failure = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            recent.append(line)
            if any(marker in line for marker in STARTUP_FAILURES):
                failure = startup_failure("".join(recent))
                break
    finally:
        if failure is not None or proc.poll() is None:  # failed, or we are leaving early
            stop_process_group(proc)
        proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure is not None:
        return ServeOutcome(1, failure)
    return ServeOutcome(proc.returncode if proc.returncode >= 0 else 128 - proc.returncode)


# ---------------------------------------------------------------------------------------
# 4. deploy


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
    env = {**os.environ, "BENTOML_HOME": str(cfg.bentoml_home), "BENTOML_DO_NOT_TRACK": "true",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
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
        env.update({
            "TUNELOOP__SERVING__BENTO_MODEL": model_tag,
            "TUNELOOP_SERVE_MODEL_NAME": serving["model_name"],
            "TUNELOOP_SERVE_MODEL_VERSION": serving["model_version"],
            "TUNELOOP__SERVING__ALIASES": json.dumps(serving["aliases"]),
        })
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
    from tuneloop.registry import ModelRegistry

    now = ModelRegistry.from_config(cfg).champion()
    if now is not None and now.version == str(version):
        return None
    return (f"v{version} is not the champion (it is {'none' if now is None else 'v' + now.version}); "
            "deploy the champion instead")


def conclude_deployment(cfg: TuneloopConfig, info, model_tag: str, bento_tag: str, validation: InfraValidation,
                        require_champion: bool = True, target: str | None = None,
                        previous_bento: str | None = None, seconds: dict[str, float] | None = None,
                        progress: Callable[[str], None] | None = None) -> DeployResult:
    """The last step: mark the bento deployed -- only if it passed infra validation and
    (require_champion) its version is still the champion. Otherwise nothing changes."""
    from tuneloop.registry import ModelRegistry

    result = DeployResult(False, info.name, str(info.version), model_tag=model_tag, bento_tag=bento_tag,
                          validation=validation, previous_bento=previous_bento, seconds=dict(seconds or {}))
    if not validation.passed:
        result.reason = f"infra validation failed: {validation.reason} (server log: {validation.log_path})"
        _say(progress, result.summary())
        return result
    if require_champion:
        # The champion may have moved while we built: never deploy a version that lost the title.
        result.reason = not_champion_reason(cfg, info.version) or ""
        if result.reason:
            _say(progress, result.summary())
            return result
    ModelRegistry.from_config(cfg).mark_deployed(info.version, bento_tag)
    _record_deployment(cfg, {
        "bento_tag": bento_tag,
        "model_tag": model_tag,
        "registered_model": info.name,
        "version": str(info.version),
        "run_id": info.run_id,
        "target": target or cfg.bento.target,
        "bentoml_home": str(cfg.bentoml_home),
        "deployed_at": _now(),
        "previous_bento": previous_bento,
    })
    result.deployed = True
    result.reason = validation.reason
    _say(progress, result.summary())
    return result


def deploy_champion(cfg: TuneloopConfig, version: str | int | None = None, target: str | None = None,
                    timeout: float | None = None, require_champion: bool | None = None,
                    progress: Callable[[str], None] | None = None) -> DeployResult:
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
    return conclude_deployment(cfg, info, model_tag, bento_tag, validation,
                               require_champion=require_champion,
                               target=target, previous_bento=previous, seconds=seconds, progress=progress)
