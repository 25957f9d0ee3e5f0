"""The closed loop, end to end, nothing mocked: a real Prefect server and process worker
running prefect.yaml's deployments, a real `tuneloop serve` of the champion's bento, the
request log, the monitoring deployment, its event and the training deployment's trigger.

Serve the champion -> traffic from the training distribution: `tuneloop monitor` says no
drift -> shifted traffic + a feedback correction -> the monitoring deployment (run by the
worker) emits tuneloop.retrain.requested -> the training deployment runs from its trigger
on the base set + the feedback row -> a new champion is promoted -> the running server
answers as the new version, and a client streaming throughout saw no error. (Cron schedules
do not fire here: the test runs the monitoring deployment itself.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.servers import BIN, GATEWAY_OFF, free_port, prefect_server, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
ROOT = Path(__file__).resolve().parents[1]
TUNELOOP = str(BIN / "tuneloop")
INJECTIONS = ROOT.parent / "shared" / "data" / "prompt-injections" / "train.parquet"


def run(cmd, env, timeout=900) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return out


def last_json(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{\n"):])


@pytest.mark.skipif(not INJECTIONS.exists(), reason=f"{INJECTIONS} is absent (the shifted traffic)")
def test_drift_retrains_promotes_and_the_running_server_moves_on(tmp_path, demo_base_model):
    import httpx
    import openai
    import pandas as pd

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
    env.update({
        "TUNELOOP_HOME": str(home), "TUNELOOP__BOOTSTRAP__OUTPUT_DIR": str(demo_base_model),
        "BENTOML_HOME": str(tmp_path / "bentoml"),
        "TUNELOOP__TRAINING__MAX_STEPS": "40",
        # every retrain of this test is blessed: what is tested is the loop, not the model
        "TUNELOOP__BLESSING__THRESHOLDS": "[{metric: eval_loss, value_threshold: {upper_bound: 1000}}]",
        "TUNELOOP__MONITORING__DRIFT": "{min_requests: 20}", "TUNELOOP__MONITORING__SLO": "{min_requests: 1000}",
        "TUNELOOP__SERVING__FOLLOW_CHAMPION_S": "1", "TUNELOOP__SERVING__COMPILE": "false",
        "TUNELOOP__SERVING__NUM_THREADS": "1", **GATEWAY_OFF,
    })
    with prefect_server(tmp_path) as prefect_env:
        env.update(prefect_env)
        first = last_json(run([TUNELOOP, "train", "--json"], env).stdout)
        assert first["promoted"] and first["deployment"]["deployed"], first
        v1 = first["champion_after"]
        run([str(BIN / "prefect"), "--no-prompt", "work-pool", "create", "tuneloop-local", "--type", "process"], env)
        run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], env)
        worker_log = open(tmp_path / "worker.log", "w")
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "tuneloop-local"], env=env,
                                  stdout=worker_log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve_log = open(tmp_path / "serve.log", "w")
        server = subprocess.Popen([TUNELOOP, "serve", "--port", str(port)], env=env, stdout=serve_log,
                                  stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        stop, streamed, failures = threading.Event(), [], []
        try:
            wait_http(f"{url}/readyz", 240, server, tmp_path / "serve.log")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            name = client.models.list().data[0].id.split(":")[0]
            assert client.models.list().data[0].id == f"{name}:{v1}"

            sample = [json.loads(line)["messages"] for line in (ROOT / "data" / "sample" / "train.jsonl").read_text()
                      .splitlines() if line.strip()]

            def streaming_client():  # traffic of the training distribution, streamed, all along
                rng = random.Random(1)
                while not stop.is_set():
                    try:
                        chunks = list(client.chat.completions.create(
                            model=name, max_tokens=8, stream=True, messages=rng.choice(sample)[:-1]))
                        streamed.append(chunks[0].model)
                    except Exception as exc:  # noqa: BLE001 - what the test counts
                        failures.append(repr(exc))
                    time.sleep(0.5)

            streamer = threading.Thread(target=streaming_client)
            streamer.start()

            for messages in random.Random(0).sample(sample, 40):
                client.chat.completions.create(model=name, max_tokens=4, messages=messages[:-1])
            calm = last_json(run([TUNELOOP, "monitor", "--since", "30m", "--json"], env).stdout)
            assert calm["drift"]["judged"] and not calm["drift"]["detected"], calm["drift"]
            assert calm["events"] == []

            shifted_since = datetime.now(timezone.utc).isoformat()
            df = pd.read_parquet(INJECTIONS)
            ids = []
            for text in df[df.label == 0].text.astype(str).sample(40, random_state=0):
                raw = client.chat.completions.with_raw_response.create(
                    model=name, max_tokens=4, messages=[{"role": "user", "content": text[:300]}])
                ids.append(raw.headers["x-request-id"])
            client.post("/feedback", body={"request_id": ids[0], "rating": -1, "correction": "Positive"},
                        cast_to=object)
            time.sleep(1.5)  # one flush interval: the log has them
            run([str(BIN / "prefect"), "--no-prompt", "deployment", "run", "monitoring/monitoring",
                 "--param", f"since={shifted_since}"], env)

            deadline, serving = time.time() + 900, None
            while time.time() < deadline:
                serving = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                if serving != f"{name}:{v1}":
                    break
                assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                time.sleep(3)
            time.sleep(2)
        finally:
            stop.set()
            if "streamer" in locals():
                streamer.join(60)
            for proc in (server, worker):
                try:
                    os.killpg(proc.pid, 15)
                    proc.wait(30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(proc.pid, 9)
    log_tail = (tmp_path / "worker.log").read_text()[-4000:]
    assert serving != f"{name}:{v1}", f"the server still serves v{v1}\n{log_tail}"
    from components.config import load_config
    from components.registry import ModelRegistry

    cfg = load_config(None, environ={"TUNELOOP_HOME": str(home)})
    champion = ModelRegistry.from_config(cfg).champion()
    assert serving == f"{name}:{champion.version}" and champion.version != v1
    assert not failures, failures[:3]
    assert f"{name}:{v1}" in streamed and serving in streamed  # the stream went on across the swap
    lineage = sorted((home / "retrain").glob("*/lineage.json"))
    assert lineage and json.loads(lineage[-1].read_text())["feedback_rows"] == 1
