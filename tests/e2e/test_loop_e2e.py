"""The closed loop, end to end, nothing mocked: a real Prefect server and process worker
running prefect.yaml's deployments, a real `tuneloop serve` of the champion's bento, the
request log, the monitoring flow, its event and the training deployment's trigger -- driven
by `tuneloop loop`, the demo's step 5 (tuneloop/demo.py).

Serve the champion -> traffic from the training distribution: the monitoring flow says no
drift -> shifted traffic + a feedback correction -> the monitoring flow emits
tuneloop.retrain.requested to the Prefect server -> the training deployment runs from its
trigger on the worker, on the base set + the feedback row, from the champion's weights -> a
new champion is promoted -> the running server answers as the new version, and a client
streaming throughout saw no error. (Cron schedules do not fire here: the loop runs the
monitoring flow itself; the retrain comes only from the real event trigger.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support import ROOT
from tests.support.servers import BIN, GATEWAY_OFF, last_json, prefect_server
from tests.support.servers import run_ok as run
from tuneloop.ports import stop_process_group

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TUNELOOP = str(BIN / "tuneloop")


def test_drift_retrains_promotes_and_the_running_server_moves_on(tmp_path, demo_base_model):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
    env.update(
        {
            "TUNELOOP_HOME": str(home),
            "TUNELOOP__BOOTSTRAP__OUTPUT_DIR": str(demo_base_model),
            "BENTOML_HOME": str(tmp_path / "bentoml"),
            "TUNELOOP__TRAINING__MAX_STEPS": "20",
            # every retrain of this test is blessed: what is tested is the loop, not the model
            "TUNELOOP__BLESSING__THRESHOLDS": "[{metric: eval_loss, value_threshold: {upper_bound: 1000}}]",
            "TUNELOOP__EVALUATION__BEHAVIOUR_SUITE": "null",  # blessing is relaxed above: no need to score it
            "TUNELOOP__MONITORING__DRIFT": "{min_requests: 20}",
            "TUNELOOP__MONITORING__SLO": "{min_requests: 1000}",
            "TUNELOOP__SERVING__COMPILE": "false",
            "TUNELOOP__SERVING__NUM_THREADS": "1",
            **GATEWAY_OFF,
        }
    )
    with prefect_server(tmp_path) as prefect_env:
        env.update(prefect_env)
        first = last_json(run([TUNELOOP, "train", "--json"], env).stdout)
        assert first["promoted"] and first["deployment"]["deployed"], first
        v1 = first["champion_after"]
        run([str(BIN / "prefect"), "--no-prompt", "work-pool", "create", "tuneloop-local", "--type", "process"], env)
        run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], env)
        worker_log = open(tmp_path / "worker.log", "w")
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "tuneloop-local"],
            env=env,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            loop = subprocess.run(
                [TUNELOOP, "loop", "--retrain", "trigger", "--requests", "30", "--json"],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=1500,
            )
        finally:
            stop_process_group(worker, term_wait=30)
    progress = loop.stderr[-4000:] + (tmp_path / "worker.log").read_text()[-3000:]
    assert loop.returncode == 0, progress
    out = last_json(loop.stdout)
    name = out["model"]
    assert out["served_before"] == f"{name}:{v1}"
    assert out["calm"]["judged"] and not out["calm"]["detected"], out["calm"]
    assert out["calm"]["events"] == []
    assert out["shifted"]["detected"] and "tuneloop.retrain.requested" in out["shifted"]["events"], out["shifted"]
    assert out["retrain"]["promoted"], progress

    from tuneloop.config import load_config
    from tuneloop.registry import ModelRegistry

    cfg = load_config(None, environ={"TUNELOOP_HOME": str(home)})
    champion = ModelRegistry.from_config(cfg).champion()
    assert champion.version != v1
    assert out["served_after"] == f"{name}:{champion.version}"
    assert not out["stream_failures"], out["stream_failures"][:3]
    # the stream went on across the swap: both versions answered it
    assert {f"{name}:{v1}", out["served_after"]} <= set(out["streamed_versions"]), out["streamed_versions"]
    lineage = sorted((home / "retrain").glob("*/lineage.json"))
    assert lineage and json.loads(lineage[-1].read_text())["feedback_rows"] == 1
    # the triggered run started from the champion's weights (monitoring.retrain_init_from)
    from mlflow.tracking import MlflowClient

    run_id = (
        MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)
        .get_model_version(champion.name, champion.version)
        .run_id
    )
    parent = (
        MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)
        .get_run(run_id)
        .data.tags.get("mlflow.parentRunId")
    )
    assert (
        MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)
        .get_run(parent)
        .data.params["init_from"]
        == f"champion v{v1}"
    )
