"""monitoring/ against the real thing: promtool checks the rules and the scrape config; a
real Prometheus scrapes a real `bentoml serve` under traffic and evaluates the rules (the
recording rules carry values, the drift alert fires from the monitoring gauges the bento
exports), and every Grafana panel's expression is a query Prometheus accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from tests.support import ROOT
from tests.support.servers import GATEWAY_OFF, free_port, prometheus_server, service
from tests.support.serving_tiny_model import build_tiny_model

RULES = ROOT / "monitoring" / "prometheus" / "rules.yml"


def promtool(*args) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (make install puts Debian's prometheus in place)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_rules_and_config():
    rules = promtool("check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS" in rules.stdout
    config = promtool("check", "config", str(ROOT / "monitoring" / "prometheus" / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr


def query(url: str, expr: str) -> dict:
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10) as r:
        return json.loads(r.read())


def test_prometheus_scrapes_the_bento_and_evaluates_the_rules(tmp_path):
    import httpx

    sys.path.insert(0, str(ROOT / "monitoring" / "grafana"))
    from build_dashboard import expressions

    home = tmp_path / "home"
    (home / "monitoring").mkdir(parents=True)
    (home / "monitoring" / "latest.json").write_text(
        json.dumps(
            {
                "time": "2026-12-01T00:00:00+00:00",
                "drift_detected": True,
                "drift_judged": True,
                "scores": {"embeddings": 0.93, "text_length": 0.7},
                "slo": {"ttft_p95_s": 0.2},
                "slo_breached": [],
            }
        )
    )
    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    env = {
        "TUNELOOP_HOME": str(home),
        "BENTOML_HOME": str(tmp_path / "bentoml"),
        "TUNELOOP_SERVE_MODEL_DIR": str(model),
        "TUNELOOP_SERVE_MODEL_NAME": "tiny-chat",
        "TUNELOOP_SERVE_MODEL_VERSION": "4",
        "TUNELOOP__SERVING__COMPILE": "false",
        "TUNELOOP__SERVING__NUM_THREADS": "1",
        **GATEWAY_OFF,
    }
    cmd = [
        sys.executable,
        "-m",
        "bentoml",
        "serve",
        "bentos.service:TuneloopLLM",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    url = f"http://127.0.0.1:{port}"
    with (
        service(cmd, f"{url}/readyz", tmp_path / "serve.log", env=env, timeout=240, cwd=ROOT),
        prometheus_server(tmp_path, [f"127.0.0.1:{port}"], RULES) as prom,
    ):
        with httpx.Client(timeout=30) as client:
            deadline = time.time() + 90
            tokens = []
            while time.time() < deadline:
                for i in range(4):
                    r = client.post(
                        f"{url}/v1/chat/completions",
                        json={
                            "model": "tiny-chat",
                            "max_tokens": 8,
                            "messages": [{"role": "user", "content": f"hi {i}"}],
                        },
                    )
                    assert r.status_code == 200
                tokens = query(prom, "tuneloop:output_tokens:rate_5m")["data"]["result"]
                alerts = query(prom, 'ALERTS{alertname="TuneloopDriftDetected",alertstate="firing"}')["data"]["result"]
                if tokens and float(tokens[0]["value"][1]) > 0 and alerts:
                    break
                time.sleep(2)
        assert tokens and float(tokens[0]["value"][1]) > 0, "the recording rule has no value"
        assert alerts, "the drift alert did not fire from the exported monitoring gauges"
        version = query(prom, "max by (model) (tuneloop_model_info) == 1")["data"]["result"]
        assert [v["metric"]["model"] for v in version] == ["tiny-chat:4"]
        up = query(prom, 'up{job="tuneloop-bento"}')["data"]["result"]
        assert float(up[0]["value"][1]) == 1
        for expr in expressions():
            body = query(prom, expr)
            assert body["status"] == "success", (expr, body)
        rules = json.loads(urllib.request.urlopen(f"{prom}/api/v1/rules", timeout=10).read())["data"]["groups"]
        assert all(r.get("health") == "ok" for g in rules for r in g["rules"]), rules
