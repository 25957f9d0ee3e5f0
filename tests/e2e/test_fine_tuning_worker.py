"""A fine-tuning job on the demo base, run by a real Prefect worker (fine_tuning.runner prefect):
`prefect deploy` registers prefect.yaml's fine-tuning-job deployment, `prefect worker start`
takes the flow run the server's dispatcher asks for, and the job the openai SDK created ends
succeeded with its ft: model answering what it was taught (the base does not) on the server,
the flow run being one of that deployment."""

from __future__ import annotations

import io
import subprocess
import sys

import httpx
import openai
import pytest

from tests.support import ROOT
from tests.support.fine_tuning import TAUGHT, answer, rows, server_env, wait_for
from tests.support.servers import BIN, free_port, prefect_server, services

pytestmark = pytest.mark.slow


def test_a_job_on_the_demo_base_runs_as_a_flow_run_of_the_deployment_on_a_prefect_worker(tmp_path, demo_base_model):
    from tuneloop.config import load_config
    from tuneloop.gateway.keys import open_key_store

    model = demo_base_model  # the demo's own base (GPT-2 layout): its LoRA adapter served beside it
    home = tmp_path / "home"
    env = server_env(tmp_path, model, home)
    env["TUNELOOP__FINE_TUNING__RUNNER"] = "prefect"
    cfg = load_config(environ={"TUNELOOP_HOME": str(home)})
    cfg.home.mkdir(parents=True, exist_ok=True)
    store = open_key_store(cfg)
    key = store.create("alice", "paid", team="acme")[1]
    store.close()
    with prefect_server(tmp_path) as prefect_env:
        env.update(prefect_env)

        def prefect(*args):
            out = subprocess.run(
                [str(BIN / "prefect"), "--no-prompt", *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
                cwd=ROOT,
            )
            assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]

        prefect("work-pool", "create", "tuneloop-local", "--type", "process")
        prefect("deploy", "--name", "fine-tuning-job")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = [sys.executable, "-m", "bentoml", "serve", "bentos.service:TuneloopLLM", "--host", "127.0.0.1",
                 "--port", str(port)]  # fmt: skip
        worker = [
            str(BIN / "prefect"),
            "worker",
            "start",
            "--pool",
            "tuneloop-local",
            "--limit",
            "1",
            "--with-healthcheck",
        ]
        health = free_port()
        with services(
            dict(cmd=serve, ready_url=f"{url}/readyz", log=tmp_path / "serve.log", env=env, timeout=300, cwd=ROOT),
            # the worker's flow runs need the server's state folder and config: the same env
            dict(
                cmd=worker,
                ready_url=f"http://127.0.0.1:{health}/health",
                log=tmp_path / "worker.log",
                env={**env, "PREFECT_WORKER_WEBSERVER_PORT": str(health), "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1"},
                timeout=120,
                cwd=ROOT,
            ),
        ):
            api = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            f = api.files.create(file=("train.jsonl", io.BytesIO(rows(32))), purpose="fine-tune")
            # No seed, as a user would send it: a random one. 16 epochs because 8 left the demo base at the
            # edge of learning the answer (seed 0 said 'sana'; one seed in CI kept the base's newlines),
            # while 16 taught it under every seed tried (0, 6-10; 19-24 s a job here).
            job = api.fine_tuning.jobs.create(
                model="tiny-chat", training_file=f.id, hyperparameters={"n_epochs": 16, "batch_size": 8}, suffix="w"
            )
            done = wait_for(api, job.id, ("succeeded", "failed", "cancelled"), timeout=420)
            assert done.status == "succeeded", (done.error, (tmp_path / "worker.log").read_text()[-3000:])
            assert TAUGHT in answer(api, done.fine_tuned_model) and TAUGHT not in answer(api, "tiny-chat")

            from tuneloop.finetune.jobs import JobStore

            runner = JobStore.from_config(cfg).get(job.id).runner
            assert runner["kind"] == "prefect"
            run = httpx.get(f"{env['PREFECT_API_URL']}/flow_runs/{runner['flow_run_id']}", timeout=30).json()
            deployment = httpx.get(f"{env['PREFECT_API_URL']}/deployments/{run['deployment_id']}", timeout=30).json()
            assert deployment["name"] == "fine-tuning-job" and run["parameters"]["job_id"] == job.id
            assert run["state"]["type"] == "COMPLETED"
