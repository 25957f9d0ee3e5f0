"""Start real services for tests on 127.0.0.1 (free ports), wait until ready, stop after."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tests.support import ROOT
from tuneloop.ports import free_port  # noqa: F401  (tests import it from here)

BIN = Path(sys.executable).parent


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} was ready:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise TimeoutError(f"{url} not ready after {timeout}s:\n{tail}")


def _start(cmd: list[str], log: Path, env: dict | None = None, cwd=None) -> subprocess.Popen:
    with open(log, "w") as fh:
        return subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True, cwd=cwd
        )


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def service(cmd: list[str], ready_url: str, log: Path, env: dict | None = None, timeout: float = 120, cwd=None):
    """Run cmd in its own process group; yield once ready_url answers; kill the group after."""
    with services(dict(cmd=cmd, ready_url=ready_url, log=log, env=env, timeout=timeout, cwd=cwd)) as (proc,):
        yield proc


@contextmanager
def services(*specs: dict):
    """Several services (each a dict of service()'s arguments) started side by side, so that
    their start-ups overlap; yields their processes once every one is ready."""
    procs: list[subprocess.Popen] = []
    try:
        for spec in specs:
            procs.append(_start(spec["cmd"], spec["log"], spec.get("env"), spec.get("cwd")))
        for proc, spec in zip(procs, specs):
            wait_http(spec["ready_url"], spec.get("timeout", 120), proc, spec["log"])
        yield tuple(procs)
    finally:
        for proc in procs:
            _stop(proc)


_prefect_template: Path | None = None


def prefect_home(path: Path) -> Path:
    """A PREFECT_HOME of a test's own (a CLI run's ephemeral server, or prefect_server()):
    a copy of one home whose database a real `prefect server start` migrated and filled
    with its block types, made once per session. A server on an empty home does that work
    first: ~10 s more per start here, paid by every test that isolates its Prefect state."""
    global _prefect_template
    if _prefect_template is None:
        template = Path(tempfile.mkdtemp(prefix="tuneloop-prefect-")) / "home"
        atexit.register(shutil.rmtree, template.parent, True)
        port = free_port()
        cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        env = {"PREFECT_HOME": str(template), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        with service(cmd, f"http://127.0.0.1:{port}/api/health", template.parent / "server.log", env=env, timeout=150):
            pass  # healthy = migrated and block types registered; stopped cleanly (the WAL checkpointed)
        _prefect_template = template
    shutil.copytree(_prefect_template, path)
    return path


@contextmanager
def prefect_server(tmp: Path):
    """A real `prefect server start` (SQLite in its own home) on a free port; yields the env
    that points clients at it."""
    port = free_port()
    env = {
        "PREFECT_HOME": str(prefect_home(tmp / "prefect-home")),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
    }
    cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with service(cmd, f"http://127.0.0.1:{port}/api/health", tmp / "prefect-server.log", env=env, timeout=150):
        yield env


@contextmanager
def mlflow_server(tmp: Path, backend_store_uri: str, workers: int = 2):
    """A real `mlflow server` on a free port: runs and registry in backend_store_uri, artifacts
    served over HTTP (`--serve-artifacts`, stored under tmp/mlflow-artifacts), Host header
    checked (`--allowed-hosts`, MLflow >= 3.5 refuses others); yields its URL."""
    port = free_port()
    cmd = [
        str(BIN / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--backend-store-uri",
        backend_store_uri,
        "--serve-artifacts",
        "--artifacts-destination",
        (tmp / "mlflow-artifacts").as_uri(),
        "--allowed-hosts",
        f"127.0.0.1:{port},localhost:{port}",
    ]
    url = f"http://127.0.0.1:{port}"
    with service(cmd, f"{url}/health", tmp / f"mlflow-server-{port}.log", timeout=180):
        yield url


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


@contextmanager
def redis_server(tmp: Path, port: int | None = None):
    """A real redis-server on 127.0.0.1 (no persistence); yields its URL. `make install`
    installs Debian's redis-server; a test that needs it skips, naming it, where it is absent."""
    import socket

    binary = shutil.which("redis-server")
    if binary is None:
        import pytest

        pytest.skip("redis-server is not installed (make install puts Debian's redis-server in place)")
    port = port or free_port()
    log = tmp / f"redis-{port}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _postgres_bin(name: str) -> str | None:
    import glob

    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    return found[-1] if found else shutil.which(name)


@contextmanager
def postgres_server(tmp: Path, databases: tuple[str, ...] = ()):
    """A real PostgreSQL (Debian's `postgresql` binaries, installed by `make install`) in a
    fresh cluster on a free port of 127.0.0.1, TCP only, trust auth for its one superuser
    `tuneloop`; creates `databases` and yields the SQLAlchemy base URL
    `postgresql+psycopg://tuneloop@127.0.0.1:<port>` (append `/<database>`).

    Postgres refuses to run as root: as root, the cluster belongs to the `postgres` system
    user (which the Debian package creates) and runs through `runuser`; it lives in its
    own folder under the system temp dir, since pytest's tmp folders are root-only (0700)."""
    import pwd

    import pytest

    initdb, postgres = _postgres_bin("initdb"), _postgres_bin("postgres")
    if not (initdb and postgres):
        pytest.skip("PostgreSQL is not installed (make install puts Debian's postgresql in place)")
    prefix: list[str] = []
    owner = None
    if os.getuid() == 0:
        runuser = shutil.which("runuser")
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            owner = None
        if runuser is None or owner is None:
            pytest.skip("running as root, and there is no `postgres` user or no runuser to start PostgreSQL as")
        prefix = [runuser, "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="tuneloop-pg-"))
    data = root / "data"
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    port = free_port()
    log = tmp / f"postgres-{port}.log"
    init = subprocess.run(
        prefix + [initdb, "-D", str(data), "-U", "tuneloop", "--auth=trust", "-E", "UTF8", "--no-sync"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"initdb failed:\n{init.stdout}{init.stderr}")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            prefix
            + [
                postgres,
                "-D",
                str(data),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-k",
                str(root),
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=root,
        )
    base = f"postgresql+psycopg://tuneloop@127.0.0.1:{port}"
    try:
        import psycopg

        deadline = time.time() + 60
        while True:
            try:
                conn = psycopg.connect(
                    f"host=127.0.0.1 port={port} user=tuneloop dbname=postgres", autocommit=True, connect_timeout=2
                )
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"postgres did not start:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.2)
        with conn:
            for name in databases:
                conn.execute(f'CREATE DATABASE "{name}"')
        yield base
    finally:
        # runuser passes SIGTERM on to postgres: a "smart" shutdown would wait for clients,
        # so ask for a fast one (SIGINT) first.
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def prometheus_server(tmp: Path, targets: list[str], rules: Path, interval: str = "1s"):
    """A real Prometheus (Debian's `prometheus`, installed by `make install`) on 127.0.0.1,
    scraping targets and evaluating rules every interval; yields its URL."""
    import yaml

    binary = shutil.which("prometheus")
    if binary is None:
        import pytest

        pytest.skip("prometheus is not installed (make install puts Debian's prometheus in place)")
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": interval, "evaluation_interval": interval},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {"job_name": "tuneloop-bento", "metrics_path": "/metrics", "static_configs": [{"targets": targets}]}
                ],
            }
        )
    )
    cmd = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with service(cmd, f"http://127.0.0.1:{port}/-/ready", tmp / "prometheus.log", timeout=60):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def hung_listener():
    """A TCP listener that accepts connections and never answers (a hung Redis); yields its URL."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
                held.append(conn)
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        sock.close()


# For the serving tests that test the engines, not the gateway (test_gateway*.py do that):
# no keys, no PII or content filter in front of the routes.
GATEWAY_OFF = {
    "TUNELOOP__GATEWAY__AUTH": "off",
    "TUNELOOP__GATEWAY__PII": "{mode: off, outputs: off}",
    "TUNELOOP__GATEWAY__FILTER": "{prompts: off, outputs: off}",
    "TUNELOOP__GATEWAY__CACHE": "{enabled: false}",  # else repeated greedy requests are answered from it
}


@contextmanager
def smollm2_served(model_dir: Path, tmp: Path):
    """`tuneloop serve` of configs/smollm2.yaml with default settings, the gateway off, on a free
    127.0.0.1 port, serving the converted SmolLM2 folder; yields the base URL (`.../v1`)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
    env.update(
        {
            "TUNELOOP_HOME": str(tmp / "home"),
            "BENTOML_HOME": str(tmp / "bentoml"),
            "TUNELOOP__MODEL__BASE_MODEL": "smollm2-135m-instruct",
            # the converted folder the caller made (the config's home is per test here)
            "TUNELOOP__SERVING__MODEL_DIR": str(model_dir),
            **GATEWAY_OFF,
        }
    )
    config = ROOT / "configs" / "smollm2.yaml"
    cmd = [sys.executable, "-m", "tuneloop.cli", "serve", "--config", str(config), "--port", str(port)]
    with service(cmd, f"http://127.0.0.1:{port}/readyz", tmp / "serve.log", env=env, timeout=400, cwd=ROOT):
        yield f"http://127.0.0.1:{port}/v1"


def run_ok(cmd: list[str], env: dict, timeout: float = 900, cwd=None) -> subprocess.CompletedProcess:
    """Run a command to its end; fail the test with the end of its output unless it exits 0."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return out


def last_json(stdout: str) -> dict:
    """The JSON object a `tuneloop ... --json` command prints after its progress lines."""
    return json.loads(stdout[stdout.index("{\n") :])
