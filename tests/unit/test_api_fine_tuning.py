"""/v1/fine_tuning/jobs in process through the gateway's hooks, with the official SDK: create
(hyperparameters "auto" kept until the run resolves them), list pages, retrieve, events,
cancel; a job seen only by its team's keys (404 for everyone else); refusals naming the
parameter; the team's tier bounding the jobs it may have waiting; the dispatcher's first
steps (files validated against the method: a DPO job on chat rows fails, its job queued
otherwise), the queue order across teams. The run itself (a real training flow, served
ft: model) is tests/integration/test_fine_tuning_jobs.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import openai
import pytest

from tests.support.gateway import bearer, gateway_config
from tests.support.serving import make_server, raw, sdk
from tuneloop.api.app import create_app
from tuneloop.files.local import LocalFileStore
from tuneloop.finetune.jobs import CANCELLED, FAILED, QUEUED, RUNNING, VALIDATING, JobStore
from tuneloop.finetune.runner import Dispatcher
from tuneloop.gateway.pipeline import Gateway


def chat_rows(n: int) -> bytes:
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})
        + "\n"
        for i in range(n)
    ).encode()


def run(loaded, tmp_path, test, **gateway):
    cfg = gateway_config(tmp_path, **gateway)

    async def main():
        gw = Gateway.from_config(cfg, load_classifier=False)
        app = create_app()
        app.state.gateway = gw
        app.state.files = files = LocalFileStore(tmp_path / "files", 2**20, 100)
        app.state.jobs = jobs = JobStore(tmp_path / "jobs.sqlite")
        app.state.fine_tuning_config = cfg
        # the engine this test needs is none: it only answers whether adapters can be served
        app.state.server = make_server(loaded, SimpleNamespace(engine="slots", supports_adapters=True))
        keys = {
            name: gw.keys.create(name, tier, team=team)[1]
            for name, tier, team in [("alice", "paid", "research"), ("eve", "paid", "sales"), ("fay", "free", "ops")]
        }
        try:
            return await test(app, files, jobs, keys, Dispatcher(cfg, jobs, files))
        finally:
            await gw.close()

    return asyncio.run(main())


def client(app, key):
    c = sdk(app)
    c.api_key = key
    return c


def test_jobs_through_the_sdk_are_their_teams_and_refusals_name_the_parameter(loaded, tmp_path):
    async def test(app, files, jobs, keys, dispatcher):
        alice, eve = client(app, keys["alice"]), client(app, keys["eve"])
        f = await alice.files.create(file=("train.jsonl", chat_rows(8)), purpose="fine-tune")
        job = await alice.fine_tuning.jobs.create(
            model="tiny", training_file=f.id, suffix="support-bot", seed=7, metadata={"ticket": "T-1"}
        )
        assert job.id.startswith("ftjob-") and job.status == VALIDATING and job.model == "tiny:3"
        assert job.organization_id == "team:research" and job.seed == 7 and job.fine_tuned_model is None
        assert job.method.type == "supervised" and job.method.supervised.hyperparameters.n_epochs == "auto"
        assert job.user_provided_suffix == "support-bot" and job.metadata == {"ticket": "T-1"}
        assert (
            "_base" not in (await raw(app).get(f"/v1/fine_tuning/jobs/{job.id}", headers=bearer(keys["alice"]))).json()
        )

        # dpo with its beta, given in OpenAI's method object
        dpo = await alice.fine_tuning.jobs.create(
            model="tiny",
            training_file=f.id,
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 2}}},
        )
        assert dpo.method.dpo.hyperparameters.beta == 0.2

        page = await alice.fine_tuning.jobs.list(limit=1)
        assert [j.id for j in page.data] == [dpo.id] and page.has_more
        assert [j.id async for j in await alice.fine_tuning.jobs.list(limit=1)] == [dpo.id, job.id]  # pages on
        assert (await alice.fine_tuning.jobs.retrieve(job.id)).id == job.id
        events = await alice.fine_tuning.jobs.list_events(job.id)
        assert events.data[0].message.startswith("Validating training file") and events.data[0].level == "info"

        # another team: as if it did not exist; and its list is empty
        for call in (eve.fine_tuning.jobs.retrieve, eve.fine_tuning.jobs.cancel, eve.fine_tuning.jobs.list_events):
            with pytest.raises(openai.NotFoundError):
                await call(job.id)
        assert [j async for j in await eve.fine_tuning.jobs.list()] == []
        with pytest.raises(openai.BadRequestError) as caught:  # nor may it train on the file
            await eve.fine_tuning.jobs.create(model="tiny", training_file=f.id)
        assert caught.value.body["param"] == "training_file"

        bad = [
            ({"model": "gpt-4o-mini", "training_file": f.id}, "model"),
            ({"model": "ft:tiny:research::ftjob-1", "training_file": f.id}, "model"),
            ({"model": "tiny", "training_file": f.id, "suffix": "no spaces!"}, "suffix"),
            ({"model": "tiny", "training_file": f.id, "integrations": [{"type": "wandb"}]}, "integrations"),
            ({"model": "tiny", "training_file": f.id, "method": {"type": "supervised", "dpo": {}}}, "method.dpo"),
        ]
        for body, param in bad:
            with pytest.raises(openai.BadRequestError) as caught:
                await alice.fine_tuning.jobs.create(**body)
            assert caught.value.body["param"] == param, (body, caught.value.body)
        r = await raw(app).post(
            "/v1/fine_tuning/jobs",
            headers=bearer(keys["alice"]),
            json={"model": "tiny", "training_file": f.id, "hyperparameters": {"n_epochs": 0}},
        )
        assert r.status_code == 400 and "n_epochs" in r.text
        r = await raw(app).post(f"/v1/fine_tuning/jobs/{job.id}/pause", headers=bearer(keys["alice"]))
        assert r.status_code == 400 and "cancel" in r.json()["error"]["message"]

        cancelled = await alice.fine_tuning.jobs.cancel(job.id)
        assert cancelled.status == CANCELLED and cancelled.finished_at is not None
        with pytest.raises(openai.BadRequestError) as caught:
            await alice.fine_tuning.jobs.cancel(job.id)
        assert "already cancelled" in caught.value.body["message"]
        assert (await alice.fine_tuning.jobs.list_events(job.id)).data[0].level == "warn"

    run(loaded, tmp_path, test)


def test_a_tier_bounds_the_jobs_a_team_may_have_waiting(loaded, tmp_path):
    async def test(app, files, jobs, keys, dispatcher):
        alice = client(app, keys["alice"])  # paid: 1 running + 4 waiting
        f = await alice.files.create(file=("train.jsonl", chat_rows(4)), purpose="fine-tune")
        made = [await alice.fine_tuning.jobs.create(model="tiny", training_file=f.id) for _ in range(5)]
        with pytest.raises(openai.RateLimitError) as caught:
            await alice.fine_tuning.jobs.create(model="tiny", training_file=f.id)
        assert caught.value.body["code"] == "jobs_limit_exceeded" and "allows 1 running and 4 waiting" in str(
            caught.value
        )
        eve = client(app, keys["eve"])  # another team's places are its own
        g = await eve.files.create(file=("train.jsonl", chat_rows(4)), purpose="fine-tune")
        assert (await eve.fine_tuning.jobs.create(model="tiny", training_file=g.id)).status == VALIDATING
        await alice.fine_tuning.jobs.cancel(made[0].id)  # a place comes back
        assert (await alice.fine_tuning.jobs.create(model="tiny", training_file=f.id)).status == VALIDATING
        assert (await alice.fine_tuning.jobs.retrieve(made[1].id)).status == VALIDATING


def test_the_dispatcher_validates_files_against_the_method_and_starts_teams_in_turn(loaded, tmp_path):
    async def test(app, files, jobs, keys, dispatcher):
        alice, eve = client(app, keys["alice"]), client(app, keys["eve"])
        f = await alice.files.create(file=("train.jsonl", chat_rows(4)), purpose="fine-tune")
        g = await eve.files.create(file=("train.jsonl", chat_rows(4)), purpose="fine-tune")
        a1 = await alice.fine_tuning.jobs.create(model="tiny", training_file=f.id)
        a2 = await alice.fine_tuning.jobs.create(model="tiny", training_file=f.id)
        wrong = await alice.fine_tuning.jobs.create(model="tiny", training_file=f.id, method={"type": "dpo"})
        e1 = await eve.fine_tuning.jobs.create(model="tiny", training_file=g.id)
        started = []
        dispatcher._launch = lambda job: started.append(job.id) or {"kind": "test"}  # what would run, not a run
        dispatcher.cfg = dispatcher.cfg.model_copy(
            update={"fine_tuning": dispatcher.cfg.fine_tuning.model_copy(update={"max_running": 2})}
        )
        await asyncio.to_thread(dispatcher.tick)
        failed = jobs.get(wrong.id)
        assert failed.status == FAILED and failed.body["error"]["code"] == "invalid_training_file"
        assert "preference rows" in failed.body["error"]["message"]
        # paid: one running a team; the second place goes to the other team, not alice's second job
        assert started == [a1.id, e1.id]
        assert [jobs.get(j).status for j in (a1.id, a2.id, e1.id)] == [RUNNING, QUEUED, RUNNING]
        await alice.fine_tuning.jobs.cancel(a1.id)
        jobs.update(e1.id, status="succeeded")
        await asyncio.to_thread(dispatcher.tick)
        assert started == [a1.id, e1.id, a2.id]
        events = [e.message for e in (await alice.fine_tuning.jobs.list_events(a2.id)).data]
        assert events[:3] == [
            "Fine-tuning job started",
            "Files validated, moving job to queued state",
            f"Validating training file: {f.id}",
        ]

    run(loaded, tmp_path, test)


def test_a_job_whose_server_died_with_its_run_fails_when_a_server_starts_again(tmp_path):
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tuneloop.config import TuneloopConfig
    from tuneloop.finetune.runner import HOST

    jobs = JobStore(tmp_path / "jobs.sqlite")
    body = {"model": "tiny:3", "training_file": "file-" + "0" * 32, "method": {"type": "supervised"}}
    gone, alive, elsewhere = (jobs.create("team:a", "paid", body) for _ in range(3))
    sleeper = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(60)  # {alive.id}"])
    try:
        jobs.update(gone.id, status=RUNNING, runner={"kind": "embedded", "host": HOST, "pid": os.getpid()})
        jobs.update(alive.id, status=RUNNING, runner={"kind": "embedded", "host": HOST, "pid": sleeper.pid})
        jobs.update(elsewhere.id, status=RUNNING, runner={"kind": "embedded", "host": "other-host", "pid": 1})
        deadline = time.time() + 10
        while time.time() < deadline and alive.id.encode() not in Path(f"/proc/{sleeper.pid}/cmdline").read_bytes():
            time.sleep(0.05)  # Popen may return before the child's exec
        Dispatcher(TuneloopConfig(), jobs, files=None)._fail_orphans()
        # this pid runs, but not that job's run: the job is gone; another host's job is its own
        assert jobs.get(gone.id).body["error"]["code"] == "run_crashed"
        assert [jobs.get(j.id).status for j in (alive, elsewhere)] == [RUNNING, RUNNING]
    finally:
        sleeper.kill()
