"""Packaging against the real thing: an MLflow sqlite registry holding a champion, the
BentoML store under tmp_path, `bentoml build`, and infra validation with the real
`bentoml serve`. A broken champion fails validation, is not marked deployed, and the
bento deployed before stays deployed. The same as a Prefect flow: tests/e2e/test_deploy_flow.py."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT
from tests.support.packaging import registry_with_champion
from tuneloop.config import load_config
from tuneloop.packaging import bento, common, deployment, server
from tuneloop.ports import free_port
from tuneloop.registry import TAG_DEPLOYED_BENTO

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return registry_with_champion(tmp_path_factory.mktemp("packaging"))


def test_pinned_packages_follow_requirements_to_installed_versions():
    from importlib import metadata

    pins = bento.pinned_packages(["transformers", "bentoml"])
    by_name = dict(p.split("==") for p in pins)
    assert by_name["transformers"] == metadata.version("transformers")
    # Requirements of requirements, pinned too.
    assert by_name["huggingface_hub"] == metadata.version("huggingface_hub")
    assert by_name["starlette"] == metadata.version("starlette")
    assert all("==" in p for p in pins) and len(pins) == len(set(pins))
    with pytest.raises(common.PackagingError, match="not installed"):
        bento.pinned_packages(["surely-not-a-package-tuneloop"])


@pytest.mark.slow  # creates an MLflow database: ~10 s
def test_no_champion_is_a_clear_error(tmp_path):
    cfg = load_config(None, environ={"TUNELOOP_HOME": str(tmp_path)})
    with pytest.raises(common.PackagingError, match="no champion"):
        bento.import_champion(cfg)


@pytest.mark.slow
def test_deploy_champion_then_a_broken_champion_is_refused(setup, monkeypatch):
    import bentoml

    cfg, registry = setup["cfg"], setup["registry"]
    assert deployment.deployed_bento(cfg) is None

    # ---- before any deployment `tuneloop serve` runs the champion from the source tree
    port = free_port()
    plan = deployment.serve_plan(cfg, port=port)
    assert "champion tuneloop-chat v1" in plan.what and "bentos.service:TuneloopLLM" in plan.argv
    from tuneloop.gateway.keys import open_key_store

    _, key = open_key_store(cfg).create("packaging-test", "paid")  # `tuneloop keys create`, as a user would
    check = server.check_server(
        plan, port, setup["root"] / "serve-source.log", 180, "source", headers={"Authorization": f"Bearer {key}"}
    )
    print(f"\nserving the champion from source: {check.reason}")
    assert check.passed, check.reason + "\n" + check.log_tail

    # ---- a good champion: imported, built, validated by the real server, deployed
    started = time.perf_counter()
    steps: list[str] = []
    result = deployment.deploy_champion(cfg, progress=steps.append)
    print(
        f"deploy v1: {result.seconds} ({time.perf_counter() - started:.1f} s in all); "
        f"ready after {result.validation.seconds_to_ready} s"
    )
    assert result.deployed, result.reason + "\n" + result.validation.log_tail
    assert result.version == setup["v1"] and result.registered_model == "tuneloop-chat"
    assert result.validation.passed and result.validation.completion is not None
    assert any("infra validation" in s for s in steps)
    # The demo model (GPT-2) is served by the slots engine's fused forward, which compiles
    # nothing; bento.validation_compile (default false) keeps the validation uncompiled for
    # models served by transformers' forward.
    assert "forward: fused; torch.compile: off" in (setup["root"] / "serve-source.log").read_text()
    assert "torch.compile: off" in Path(result.validation.log_path).read_text()
    bento_v1 = result.bento_tag
    assert bento_v1.startswith("tuneloop_llm:")
    assert registry.version(setup["v1"]).tags[TAG_DEPLOYED_BENTO] == bento_v1
    assert deployment.deployed_bento(cfg) == bento_v1
    assert deployment.deployed(cfg)["model_tag"] == result.model_tag
    assert deployment.serve_plan(cfg, port=port).what == f"deployed bento {bento_v1}"

    # ---- the environment wins over the packaged config, in the served worker too: with Redis
    # hung and TUNELOOP__GATEWAY__ON_REDIS_ERROR=closed, the deployed bento refuses (503)
    # instead of serving without limits (the override was dropped before: 711 of 711 passed)
    import httpx

    from tests.support.servers import hung_listener, service

    with hung_listener() as hung:
        monkeypatch.setenv("TUNELOOP__GATEWAY__ON_REDIS_ERROR", "closed")
        monkeypatch.setenv("TUNELOOP_REDIS_URL", hung)
        monkeypatch.setenv("TUNELOOP__GATEWAY__CACHE__ENABLED", "false")  # a nested key
        plan = deployment.serve_plan(load_config(setup["config"]), port=port)
        assert plan.what == f"deployed bento {bento_v1}" and plan.env["TUNELOOP__GATEWAY__ON_REDIS_ERROR"] == "closed"
        with service(
            plan.argv,
            f"http://127.0.0.1:{port}/readyz",
            setup["root"] / "serve-env.log",
            env=plan.env,
            timeout=180,
            cwd=plan.cwd,
        ):
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                timeout=30,
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tuneloop-chat", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            )
        assert r.status_code == 503 and "Redis" in r.json()["error"]["message"], r.text
        monkeypatch.delenv("TUNELOOP__GATEWAY__ON_REDIS_ERROR")
        monkeypatch.delenv("TUNELOOP_REDIS_URL")
        monkeypatch.delenv("TUNELOOP__GATEWAY__CACHE__ENABLED")

    # The model in the BentoML store points back to MLflow.
    store = bento._model_store(cfg)
    model = bentoml.models.get(result.model_tag, _model_store=store)
    assert model.info.labels == {
        bento.LABEL_MODEL: "tuneloop-chat",
        bento.LABEL_VERSION: setup["v1"],
        bento.LABEL_RUN: setup["run1"],
        "project": "tuneloop",
    }
    assert (Path(model.path) / "config.json").exists()
    assert model.info.metadata["mlflow_aliases"] == ["champion"]

    # The bento: references that model, carries its serving config, pinned packages, a CPU image.
    bento_dir = bento.bento_path(cfg, bento_v1)
    info = yaml.safe_load((bento_dir / "bento.yaml").read_text())
    assert info["labels"][bento.LABEL_VERSION] == setup["v1"]
    assert info["labels"][bento.LABEL_RUN] == setup["run1"]
    assert [m["tag"] for m in info["services"][0]["models"]] == [result.model_tag]
    served = yaml.safe_load((bento_dir / "src" / bento.PACKAGED_CONFIG).read_text())["serving"]
    assert served["bento_model"] == result.model_tag and served["model_version"] == setup["v1"]
    assert served["aliases"] == ["tuneloop-chat@champion"]
    requirements = (bento_dir / "env" / "python" / "requirements.txt").read_text().splitlines()
    from importlib import metadata

    assert f"transformers=={metadata.version('transformers')}" in requirements
    assert any(r.startswith("torch==") and r.endswith("+cpu") for r in requirements)
    assert (bento_dir / "env" / "docker" / "Dockerfile").read_text().count("FROM python:3.11-slim") == 1

    # Importing the same version again reuses the stored model.
    t = time.perf_counter()
    assert bento.import_champion(cfg)[0] == result.model_tag
    assert time.perf_counter() - t < 5

    # ---- a broken champion: its weights file is garbage
    broken = setup["root"] / "broken"
    shutil.copytree(setup["model_dir"], broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(b"this is not a safetensors file" * 100)
    run = setup["client"].create_run(setup["experiment"])
    v2 = registry.register(run.info.run_id, broken)
    registry.promote(v2, setup["v1"], "broken on purpose", require_blessed=False)

    started = time.perf_counter()
    failed = deployment.deploy_champion(cfg, timeout=240)
    print(f"deploy broken v2: {failed.seconds} ({time.perf_counter() - started:.1f} s in all): {failed.reason}")
    assert not failed.deployed and failed.version == v2
    assert "infra validation failed" in failed.reason and "SafetensorError" in failed.reason
    assert failed.validation.seconds < 100  # the crash is the answer: no waiting for the timeout
    assert "SafetensorError" in failed.validation.log_tail
    assert failed.previous_bento == bento_v1 and bento_v1 in failed.summary()
    # Not marked deployed; the previous bento stays the deployed one.
    assert TAG_DEPLOYED_BENTO not in registry.version(v2).tags
    assert registry.version(setup["v1"]).tags[TAG_DEPLOYED_BENTO] == bento_v1
    assert deployment.deployed_bento(cfg) == bento_v1


@pytest.mark.slow
def test_gpu_bento_describes_a_cuda_image(setup):
    cfg = setup["cfg"]
    model_tag, info = bento.import_champion(cfg, setup["v1"])
    t = time.perf_counter()
    tag = bento.build_bento(cfg, model_tag, info, target="gpu")
    print(f"\ngpu bento built in {time.perf_counter() - t:.1f} s")
    assert tag.startswith("tuneloop_llm_cuda:")
    bento_dir = bento.bento_path(cfg, tag)
    dockerfile = (bento_dir / "env" / "docker" / "Dockerfile").read_text()
    assert "FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04" in dockerfile
    requirements = (bento_dir / "env" / "python" / "requirements.txt").read_text()
    assert "+cpu" not in requirements and "download.pytorch.org" not in requirements
    # the gateway's and request log's libraries are in the image, not only on this machine
    for package in ("mlflow==", "redis==", "presidio_analyzer==", "sentence_transformers==", "psycopg=="):
        assert package in requirements.lower().replace("-", "_"), package
    # vLLM in its own venv, and the packaged config serves with it
    assert "RUN /home/bentoml/bento/env/docker/setup_script" in dockerfile
    assert "/opt/vllm/bin/pip install" in (bento_dir / "env" / "docker" / "setup_script").read_text()
    packaged = yaml.safe_load((bento_dir / "src" / "bentos" / "packaged_config.yaml").read_text())
    assert packaged["serving"]["engine"] == "vllm" and packaged["serving"]["vllm_python"] == "/opt/vllm/bin/python"
    assert "bentoml containerize " + tag in bento.containerize_command(cfg, tag)


def test_a_model_that_stops_at_once_passes_the_answer_check():
    """A champion whose greedy first token is end-of-text (seen from `make demo`: the
    fine-tuned chat model answers a bare "Hello" completion with <|im_end|>) is working:
    OpenAI shapes, prompt read, finish_reason "stop", no text, 0 completion tokens."""
    usage = {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}
    assert server._answered("", {"finish_reason": "stop"}, {"usage": usage})
    assert server._answered("hi", {"finish_reason": "length"}, {"usage": {**usage, "completion_tokens": 1}})
    # but not an empty answer cut by length, a missing usage, or an unread prompt
    assert not server._answered("", {"finish_reason": "length"}, {"usage": usage})
    assert not server._answered("", {"finish_reason": "stop"}, {})
    assert not server._answered("", {"finish_reason": "stop"}, {"usage": {**usage, "prompt_tokens": 0}})
    assert not server._answered(None, {"finish_reason": "stop"}, {"usage": usage})


def test_a_validation_server_dies_with_the_process_that_started_it(tmp_path):
    """The loop test stopped its Prefect worker while a deploy was validating a bento: the
    flow run died and its `bentoml serve` (own session, stopped only by check_server's
    finally) served on as an orphan, 1 GB for the rest of the suite. Killed the same way
    here: a process in check_server, SIGKILLed, and the server it started must go too."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    port = free_port()
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
from pathlib import Path
from tuneloop.packaging.server import ServeCommand, check_server
command = ServeCommand(argv=[{sys.executable!r}, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
                                 env=dict(__import__("os").environ), cwd=Path({str(tmp_path)!r}))
check_server(command, {port}, Path({str(tmp_path / "serve.log")!r}), 120, "orphan-test")
""",
        ],
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)
        [server] = psutil.Process(parent.pid).children()
        time.sleep(1.0)  # listening, and waiting for a /readyz that the stand-in never answers 200
        assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()

    def gone() -> bool:
        try:
            return not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = not gone()
    if alive:
        os.killpg(server.pid, signal.SIGKILL)
    assert not alive, "the validation server outlived the process that started it"
