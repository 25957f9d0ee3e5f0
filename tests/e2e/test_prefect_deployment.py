"""prefect.yaml against a real Prefect server: the training deployment registers with its
weekly schedule and event trigger, the monitoring deployment with its hourly one, and a
`tuneloop.retrain.requested` event as the monitoring flow emits it starts a training run."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support import ROOT
from tests.support.servers import BIN, prefect_server

pytestmark = pytest.mark.slow


def py(code: str, env: dict) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def prefect(*args, env):
    out = subprocess.run(
        [str(BIN / "prefect"), "--no-prompt", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout


def test_training_deployment_schedule_and_event_trigger(tmp_path):
    with prefect_server(tmp_path) as env:
        prefect("work-pool", "create", "tuneloop-local", "--type", "process", env=env)
        prefect("deploy", "--all", env=env)

        info = json.loads(
            py(
                """
            import asyncio, json
            from prefect.client.orchestration import get_client
            async def main():
                async with get_client() as c:
                    d = await c.read_deployment_by_name("training/training")
                    autos = await c.read_automations()
                    f = await c.read_deployment_by_name("filter-training/filter-training")
                    m = await c.read_deployment_by_name("monitoring/monitoring")
                    print(json.dumps({
                        "filter": [f.entrypoint, [s.schedule.cron for s in f.schedules]],
                        "monitoring": [m.entrypoint, [s.schedule.cron for s in m.schedules]],
                        "collision": str(d.concurrency_options.collision_strategy) if d.concurrency_options else None,
                        "id": str(d.id), "pool": d.work_pool_name, "entrypoint": d.entrypoint,
                        "crons": [s.schedule.cron for s in d.schedules],
                        "params": d.parameters,
                        "expects": [sorted(a.trigger.expect) for a in autos],
                    }))
            asyncio.run(main())
        """,
                env,
            )
        )
        assert info["pool"] == "tuneloop-local"
        assert info["entrypoint"] == "flows/training.py:training_flow"
        assert info["crons"] == ["0 3 * * 1"]
        assert ["tuneloop.retrain.requested"] in info["expects"]
        assert info["filter"] == ["flows/filter.py:filter_training_flow", ["0 4 1 * *"]]
        assert info["monitoring"] == ["flows/monitoring.py:monitoring_flow", ["5 * * * *"]]
        assert "CANCEL_NEW" in info["collision"]  # a burst of retrain events runs one training

        # The monitoring flow's event starts a training run (no worker: it stays scheduled).
        py(
            """
            from tuneloop.config import load_config
            from flows.monitoring import emit
            emit("tuneloop.retrain.requested", {"data_path": "data/fresh.jsonl"}, load_config(None))
            print("sent")
        """,
            env,
        )
        deadline, runs = time.time() + 90, []
        while time.time() < deadline and not runs:
            runs = json.loads(
                py(
                    f"""
                import asyncio, json
                from prefect.client.orchestration import get_client
                from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
                async def main():
                    async with get_client() as c:
                        runs = await c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=["{info["id"]}"])))
                        print(json.dumps([r.parameters for r in runs if r.auto_scheduled is not True]))
                asyncio.run(main())
            """,
                    env,
                )
            )
            time.sleep(3)
        assert runs, "the retrain event did not start a training run within 90 s"
        assert runs[0]["data"] == "data/fresh.jsonl"
