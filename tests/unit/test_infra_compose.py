"""infra/compose.yaml, checked without a Docker engine (none on this machine).

The file against the Compose Specification's JSON schema (as vendored by check-jsonschema
0.39.0), then what the schema cannot see: every service has an image or a build whose
Dockerfile and COPY sources exist; depends_on names services; host ports are unique;
bind mounts name files in the repository and named volumes are declared; every ${VAR} is in
infra/.env.example (and nothing there is unused); after interpolating that file, the
services' TUNELOOP_* variables pass the config schema, MLflow's flags pass MLflow's CLI,
Prometheus scrapes the bento service with the rules mounted where its config names them, and
Grafana's provisioning points at the Prometheus service and the mounted dashboards.
"""

from __future__ import annotations

import json
import re
import subprocess
from importlib import resources
from pathlib import Path, PurePosixPath

import pytest
import yaml

from tuneloop.config import REPO_ROOT, load_config

INFRA = REPO_ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"
ENV_EXAMPLE = INFRA / ".env.example"
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?[-?+][^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(node, env):
    """Compose's variable interpolation ($$ is a literal $)."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, str):
        parts = node.split("$$")
        return "$".join(VAR.sub(lambda m: env[m.group(1) or m.group(2)], p) for p in parts)
    return node


@pytest.fixture(scope="module")
def compose(raw, env_example) -> dict:
    return interpolate(raw, env_example)


def referenced_vars(node) -> set[str]:
    text = json.dumps(node).replace("$$", "")
    return {m.group(1) or m.group(2) for m in VAR.finditer(text)}


def test_matches_the_compose_spec_schema(raw):
    import jsonschema

    path = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(path.read_text())
    cls = jsonschema.validators.validator_for(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in cls(schema).iter_errors(raw)]
    assert not errors, "\n".join(errors)
    broken = json.loads(json.dumps(raw))
    broken["services"]["bento"]["depends_onn"] = ["redis"]
    assert list(cls(schema).iter_errors(broken))


def test_the_stack(compose):
    assert {
        "postgres",
        "minio",
        "redis",
        "mlflow",
        "prefect-server",
        "prefect-worker",
        "bento",
        "prometheus",
        "grafana",
    } <= set(compose["services"])
    assert compose["services"]["minio"]["image"].startswith("minio/minio:")


def test_images_builds_and_dockerfiles(compose):
    for name, svc in compose["services"].items():
        assert "image" in svc or "build" in svc, name
        if "build" not in svc:
            assert ":" in svc["image"] and not svc["image"].endswith(":latest"), f"{name}: pin the image"
            continue
        context = (INFRA / svc["build"]["context"]).resolve()
        dockerfile = context / svc["build"]["dockerfile"]
        assert dockerfile.is_file(), name
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (context / src).exists(), f"{dockerfile.name}: COPY {src}"
            if line.startswith("FROM "):
                assert ":" in line, f"{dockerfile.name}: pin the base image"


def test_depends_on_and_ports(compose):
    services = compose["services"]
    host_ports = []
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        for dep, how in deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps):
            assert dep in services and dep != name, f"{name} depends on {dep}"
            if how.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, which has no healthcheck"
            if how.get("condition") == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} must run once"
        for port in svc.get("ports", []):
            host, _, container = str(port).rpartition(":")
            assert host and container.isdigit(), f"{name}: {port}"
            host_ports.append(host)
    assert len(host_ports) == len(set(host_ports)), host_ports


def test_volumes_exist(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith((".", "/")):
                assert (INFRA / source).resolve().exists(), f"{name}: {source} is not in the repository"
                assert (INFRA / source).resolve().is_relative_to(REPO_ROOT), f"{name}: {source} outside the repo"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert used == declared, declared - used


def test_env_vars_are_in_env_example(raw, env_example):
    used = referenced_vars(raw)
    assert used, "no variables?"
    assert used <= set(env_example), used - set(env_example)
    assert set(env_example) <= used, set(env_example) - used
    ignored = subprocess.run(["git", "check-ignore", "-q", str(INFRA / ".env")], cwd=REPO_ROOT)
    assert ignored.returncode == 0, "infra/.env must be git-ignored"


def service_env(svc) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_tuneloop_environment_is_accepted_by_the_config_schema(compose):
    checked = 0
    for _name, svc in compose["services"].items():
        env = {k: v for k, v in service_env(svc).items() if k.startswith("TUNELOOP_") and k != "TUNELOOP_KEY_PEPPER"}
        if env:
            cfg = load_config(environ=env)
            assert cfg.mlflow_tracking_uri == "http://mlflow:5000" and cfg.gateway.redis_url == "redis://redis:6379/0"
            checked += 1
    assert checked == 2  # the worker (flows) and the bento


def test_mlflow_command(compose):
    from mlflow.cli import server
    from mlflow.server.security_utils import is_allowed_host_header

    cmd = compose["services"]["mlflow"]["command"]
    assert cmd[:2] == ["mlflow", "server"]
    ctx = server.make_context("server", cmd[2:])
    assert ctx.params["serve_artifacts"] is True
    assert (
        ctx.params["backend_store_uri"].startswith("postgresql://")
        and "@postgres:5432/mlflow" in ctx.params["backend_store_uri"]
    )
    allowed = ctx.params["allowed_hosts"].split(",")
    assert is_allowed_host_header(allowed, "mlflow:5000") and is_allowed_host_header(allowed, "localhost:5000")
    env = service_env(compose["services"]["mlflow"])
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"


def _mount_target(svc, source_suffix: str) -> str:
    for vol in svc["volumes"]:
        source, target = vol.split(":")[:2]
        if source.endswith(source_suffix):
            return target
    raise AssertionError(f"{source_suffix} is not mounted")


def test_prometheus_scrapes_the_bento_with_the_rules(compose):
    prom = compose["services"]["prometheus"]
    config_target = _mount_target(prom, "compose/prometheus.yml")
    assert config_target == "/etc/prometheus/prometheus.yml"  # the image's default --config.file
    config = yaml.safe_load((INFRA / "compose" / "prometheus.yml").read_text())
    rules_target = _mount_target(prom, "monitoring/prometheus/rules.yml")
    assert config["rule_files"] == [rules_target]
    (job,) = config["scrape_configs"]
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in compose["services"] and f"{port}:{port}" in compose["services"][host]["ports"]
    assert job["metrics_path"] == "/metrics"
    # the job name the rules' replica-down alert selects
    assert f'up{{job="{job["job_name"]}"}}' in (REPO_ROOT / "monitoring/prometheus/rules.yml").read_text()


def test_grafana_provisioning_is_wired(compose):
    graf = compose["services"]["grafana"]
    assert _mount_target(graf, "monitoring/grafana/provisioning") == "/etc/grafana/provisioning"
    dashboards_target = _mount_target(graf, "monitoring/grafana/dashboards")
    provisioning = REPO_ROOT / "monitoring" / "grafana" / "provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "tuneloop.yml").read_text())["providers"]
    assert provider["options"]["path"] == dashboards_target
    assert list((REPO_ROOT / "monitoring/grafana/dashboards").glob("*.json"))
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    url = re.match(r"https?://([^:/]+):(\d+)", source["url"])
    host, port = url.group(1), url.group(2)
    assert host in compose["services"] and any(str(p).endswith(f":{port}") for p in compose["services"][host]["ports"])


def test_postgres_init_is_the_kubernetes_one(compose):
    target = _mount_target(compose["services"]["postgres"], "create-databases.sql")
    assert PurePosixPath(target).parent == PurePosixPath("/docker-entrypoint-initdb.d")
    assert Path(INFRA / "k8s/base/postgres/create-databases.sql").is_file()
    text = json.dumps(compose["services"])
    for db in re.findall(r"@postgres:5432/(\w+)", text):
        assert (
            db == "mlflow" or f"CREATE DATABASE {db};" in (INFRA / "k8s/base/postgres/create-databases.sql").read_text()
        )
