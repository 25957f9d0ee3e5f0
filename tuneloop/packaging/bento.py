"""The champion as a bento: import it into the BentoML model store (import_champion), then
`bentoml build` bentos/ around it with its packaged config and pinned packages (build_bento);
steps 1 and 2 of tuneloop/packaging/__init__.py, which also describes the image targets."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tuneloop.config import REPO_ROOT, TuneloopConfig
from tuneloop.packaging.common import PackagingError, bentoml_env, now, registry_version, say

BENTOS_DIR = REPO_ROOT / "bentos"
BENTOFILE = BENTOS_DIR / "bentofile.yaml"
# Where the packaged serving config sits inside the bento's sources; bentos/service.py
# looks for it next to itself.
PACKAGED_CONFIG = "bentos/packaged_config.yaml"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_VERSION = "12.8"
TARGETS = {
    # target -> (bento name, docker options)
    "cpu": ("tuneloop_llm", {"distro": "debian", "python_version": "3.11"}),
    "gpu": (
        "tuneloop_llm_cuda",
        {
            "distro": "debian",
            "python_version": "3.11",
            "cuda_version": CUDA_VERSION,
            # vLLM in its own venv (/opt/vllm), for bento.gpu_engine: vllm
            "setup_script": "bentos/setup_vllm.sh",
        },
    ),
}
GPU_VLLM_PYTHON = "/opt/vllm/bin/python"  # where bentos/setup_vllm.sh puts vLLM in the gpu image

# Label keys on the BentoML model and the bento: the way back to MLflow.
LABEL_MODEL = "mlflow.registered_model"
LABEL_VERSION = "mlflow.version"
LABEL_RUN = "mlflow.run_id"


# ---------------------------------------------------------------------------------------
# import: MLflow version -> BentoML model store


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


def import_champion(
    cfg: TuneloopConfig, version: str | int | None = None, progress: Callable[[str], None] | None = None
):
    """Import the champion (or `version`) into the BentoML model store.

    Returns (bento_model_tag, ModelVersionInfo). A second call for the same version
    returns the existing model without downloading again.
    """
    import bentoml
    from bentoml.exceptions import NotFound

    registry, info = registry_version(cfg, version)
    tag = model_tag_for(info)
    store = _model_store(cfg)
    try:
        existing = bentoml.models.get(tag, _model_store=store)
        say(progress, f"model {tag} already in the BentoML store ({existing.path})")
        return tag, info
    except NotFound:
        pass

    say(progress, f"importing {info.name} v{info.version} (run {info.run_id}) into the BentoML store as {tag}")
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
            "imported_at": now(),
        }
        with bentoml.models.create(tag, labels=labels, metadata=metadata, _model_store=store) as ref:
            shutil.copytree(local, ref.path, dirs_exist_ok=True)
    return tag, info


# ---------------------------------------------------------------------------------------
# bentoml build


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
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
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
            shutil.copytree(
                src, staging / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", Path(PACKAGED_CONFIG).name)
            )
        elif src.is_file():
            shutil.copy2(src, staging / top)


def build_bento(
    cfg: TuneloopConfig,
    model_tag: str,
    version_info,
    target: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> str:
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
            {"name": "UV_INDEX_STRATEGY", "value": "unsafe-best-match", "stage": "build"}
        ]

    cfg.home.mkdir(parents=True, exist_ok=True)
    say(progress, f"building bento {bento_name} ({target} image) around {model_tag}, {len(pins)} pinned packages")
    with tempfile.TemporaryDirectory(prefix="bento-build-", dir=cfg.home) as tmp:
        staging = Path(tmp)
        _stage_sources(staging, bentofile)
        (staging / PACKAGED_CONFIG).write_text(
            "# Written by tuneloop packaging (tuneloop/packaging/bento.py): the serving config of this bento.\n"
            + yaml.safe_dump(packaged_serving_config(cfg, model_tag, info, target), sort_keys=False)
        )
        (staging / "bentofile.yaml").write_text(yaml.safe_dump(bentofile, sort_keys=False))
        cmd = [
            sys.executable,
            "-m",
            "bentoml",
            "build",
            "-f",
            str(staging / "bentofile.yaml"),
            "-o",
            "tag",
            str(staging),
        ]
        proc = subprocess.run(cmd, cwd=staging, env=bentoml_env(cfg), capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    match = re.search(r"__tag__:(\S+)", out)
    if proc.returncode != 0 or not match:
        raise PackagingError(f"`bentoml build` failed (exit {proc.returncode}):\n{out[-3000:]}")
    bento_tag = match.group(1)
    say(
        progress, f"built bento {bento_tag}; Dockerfile: {bento_path(cfg, bento_tag) / 'env' / 'docker' / 'Dockerfile'}"
    )
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
