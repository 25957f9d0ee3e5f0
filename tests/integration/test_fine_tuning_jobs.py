"""Fine-tuning as an API, end to end: a real `bentoml serve` of a small model with its
dispatcher, a real Prefect server the job's flow run reports to, MLflow under the state
folder, driven by the official `openai` SDK as a team would:

upload a file, create a job, poll it to succeeded (its events and checkpoint), call the
`ft:` model and get what the training taught where the base says something else, while
another team gets 404 for the model, the job and the file; a second job cancelled while it
runs (its run stopped); the adapter-only version in MLflow (no merged weights) and the job's
flow run in Prefect."""

from __future__ import annotations

import io
import sys
import time

import httpx
import openai
import pytest

from tests.support import ROOT
from tests.support.fine_tuning import TAUGHT, answer, preference_rows, rows, server_env, wait_for
from tests.support.servers import free_port, prefect_server, service
from tests.support.serving_tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tuneloop.config import load_config
    from tuneloop.gateway.keys import open_key_store

    tmp = tmp_path_factory.mktemp("ftjobs")
    model = build_tiny_model(tmp / "model", context_length=256, architecture="llama")
    home = tmp / "home"
    env = server_env(tmp, model, home)
    # the free tier: a small daily training budget (and requests enough to poll)
    env["TUNELOOP__FINE_TUNING__TIERS__FREE__TRAINING_TOKENS_PER_DAY"] = "1000"
    env["TUNELOOP__GATEWAY__TIERS__FREE__REQUESTS_PER_MINUTE"] = "1000"
    cfg = load_config(environ={"TUNELOOP_HOME": str(home)})
    cfg.home.mkdir(parents=True, exist_ok=True)
    store = open_key_store(cfg)
    keys = {name: store.create(name, "paid", team=team)[1] for name, team in [("alice", "acme"), ("eve", "globex")]}
    keys["fay"] = store.create("fay", "free", team="initech")[1]
    store.close()
    with prefect_server(tmp) as prefect_env:
        env.update(prefect_env)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "bentoml", "serve", "bentos.service:TuneloopLLM", "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
        with service(cmd, f"{url}/readyz", tmp / "serve.log", env=env, timeout=300, cwd=ROOT) as proc:
            yield {
                "url": url,
                "keys": keys,
                "home": home,
                "env": env,
                "proc": proc,
                "cfg": cfg,
                "log": tmp / "serve.log",
            }


def client(served, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key=served["keys"][who], max_retries=0, timeout=60)


def test_a_team_fine_tunes_with_the_sdk_and_calls_its_model_that_no_other_team_sees(served):
    alice, eve = client(served, "alice"), client(served, "eve")
    base_answer = answer(alice, "tiny-chat")
    assert TAUGHT not in base_answer
    f = alice.files.create(file=("train.jsonl", io.BytesIO(rows(32))), purpose="fine-tune")
    started = time.time()
    job = alice.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=f.id,
        suffix="fruit",
        seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 8, "batch_size": 8}}},
    )
    assert job.status == "validating_files"
    done = wait_for(alice, job.id, ("succeeded", "failed", "cancelled"), timeout=300)
    seconds = time.time() - started
    assert done.status == "succeeded", done.error
    model = done.fine_tuned_model
    assert model == f"ft:tiny-chat:acme:fruit:{job.id}"
    assert done.trained_tokens and done.trained_tokens > 0 and done.finished_at >= done.created_at
    assert done.hyperparameters.n_epochs == 8 and done.hyperparameters.learning_rate_multiplier == 1.0
    events = [e for e in alice.fine_tuning.jobs.list_events(job.id, limit=100).data]
    messages = [e.message for e in events]
    assert any(m.startswith("New fine-tuned model created") for m in messages)
    assert any(e.type == "metrics" and "train_loss" in e.data for e in events)
    checkpoints = alice.fine_tuning.jobs.checkpoints.list(job.id).data
    assert len(checkpoints) == 1 and checkpoints[0].fine_tuned_model_checkpoint == model
    print(f"\njob {job.id}: succeeded in {seconds:.0f} s; events: {list(reversed(messages))}")

    # Called on the same endpoint, beside the base; what the training taught, the base never said.
    assert model in [m.id for m in alice.models.list().data]
    assert alice.models.retrieve(model).owned_by == "team:acme"
    tuned = answer(alice, model)
    assert TAUGHT in tuned, tuned
    assert answer(alice, "tiny-chat") == base_answer  # the base is untouched
    stream = alice.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks and all(c.model == model for c in chunks)

    # Another team: the model, the job and the file do not exist for it.
    assert model not in [m.id for m in eve.models.list().data]
    with pytest.raises(openai.NotFoundError):
        answer(eve, model)
    with pytest.raises(openai.NotFoundError):
        eve.models.retrieve(model)
    with pytest.raises(openai.NotFoundError):
        eve.fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        eve.files.content(f.id)

    # MLflow: an adapter-only version (the LoRA files and its base), tagged with the model id.
    from mlflow.tracking import MlflowClient

    cfg = served["cfg"]
    mlflow = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)
    versions = mlflow.search_model_versions(f"name='{cfg.mlflow.registered_model}-adapters'")
    (version,) = [v for v in versions if v.tags.get("tuneloop.ft_model") == model]
    files = {a.path for a in mlflow.list_artifacts(version.run_id, "adapter")}
    assert files == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/base.json"}
    assert version.tags["tuneloop.owner"] == "team:acme" and version.tags["tuneloop.base_version"] == "1"

    # Prefect: the job was a run of the training flow, with the job's id.
    env = served["env"]
    out = httpx.post(
        env["PREFECT_API_URL"] + "/flow_runs/filter", json={"flow_runs": {"tags": {"all_": []}}}, timeout=30
    ).json()
    assert any((r.get("parameters") or {}).get("job_id") == job.id for r in out), [r.get("parameters") for r in out]


def test_a_running_job_is_cancelled_and_its_run_stopped(served):
    import psutil

    alice = client(served, "alice")
    f = alice.files.create(file=("train.jsonl", io.BytesIO(rows(64))), purpose="fine-tune")
    job = alice.fine_tuning.jobs.create(
        model="tiny-chat", training_file=f.id, hyperparameters={"n_epochs": 50, "batch_size": 1}
    )
    wait_for(alice, job.id, ("running",), timeout=120)
    time.sleep(3)  # into its run
    from tuneloop.finetune.jobs import JobStore

    runner = JobStore.from_config(served["cfg"]).get(job.id).runner
    assert runner["kind"] == "embedded" and psutil.pid_exists(runner["pid"])
    cancelled = alice.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    deadline = time.time() + 60
    while time.time() < deadline and psutil.pid_exists(runner["pid"]):
        try:
            if psutil.Process(runner["pid"]).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    alive = psutil.pid_exists(runner["pid"]) and psutil.Process(runner["pid"]).status() != psutil.STATUS_ZOMBIE
    assert not alive, "the cancelled job's run is still running"
    time.sleep(2)
    again = alice.fine_tuning.jobs.retrieve(job.id)
    assert again.status == "cancelled" and again.fine_tuned_model is None  # a cancel is never overwritten
    # nothing of the run is left training: no process of it holds the job's id
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if job.id in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]


def test_a_job_over_its_teams_daily_training_tokens_fails_before_training(served):
    fay = client(served, "fay")  # the free tier here: 1,000 training tokens a day
    f = fay.files.create(file=("train.jsonl", io.BytesIO(rows(32))), purpose="fine-tune")
    job = fay.fine_tuning.jobs.create(model="tiny-chat", training_file=f.id, hyperparameters={"n_epochs": 8})
    done = wait_for(fay, job.id, ("succeeded", "failed", "cancelled"), timeout=120)
    assert done.status == "failed" and done.error.code == "training_tokens_limit_exceeded", done.error
    assert "of its tier's 1000" in done.error.message and done.trained_tokens is None
    messages = [e.message for e in fay.fine_tuning.jobs.list_events(job.id).data]
    assert not any(m.startswith("Training:") for m in messages), messages  # nothing was trained


def test_a_dpo_job_on_preference_pairs_moves_the_win_rate_on_held_out_pairs(served):
    alice = client(served, "alice")
    train = alice.files.create(file=("pairs.jsonl", io.BytesIO(preference_rows(32, seed=1))), purpose="fine-tune")
    held_out = alice.files.create(file=("held.jsonl", io.BytesIO(preference_rows(12, seed=2))), purpose="fine-tune")
    job = alice.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=train.id,
        validation_file=held_out.id,
        suffix="prefers",
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1, "n_epochs": 4, "batch_size": 8}}},
    )
    done = wait_for(alice, job.id, ("succeeded", "failed", "cancelled"), timeout=300)
    assert done.status == "succeeded", done.error
    assert done.method.type == "dpo" and done.method.dpo.hyperparameters.beta == 0.1
    created = next(
        e for e in alice.fine_tuning.jobs.list_events(job.id, limit=100).data if "New fine-tuned" in e.message
    )
    base, tuned = created.data["base"], created.data["metrics"]
    print(
        f"\nheld-out preference win rate: base {base['preference_win_rate']:.2f} -> {tuned['preference_win_rate']:.2f}"
    )
    assert tuned["preference_pairs"] == 12
    assert tuned["preference_win_rate"] >= base["preference_win_rate"] + 0.3 and tuned["preference_win_rate"] >= 0.9
    assert tuned["preference_margin"] > base["preference_margin"]
    # (the random base prefers the rejected word: its win rate starts low.) DPO moves the
    # preference, not what greedy decoding writes: the served fine-tune answers otherwise than the base.
    assert answer(alice, done.fine_tuned_model) != answer(alice, "tiny-chat")

    # a supervised job on a file of pairs, and a dpo job on chat rows: refused as their files are checked
    chat = alice.files.create(file=("chat.jsonl", io.BytesIO(rows(8))), purpose="fine-tune")
    wrong = alice.fine_tuning.jobs.create(model="tiny-chat", training_file=chat.id, method={"type": "dpo"})
    failed = wait_for(alice, wrong.id, ("failed", "succeeded"), timeout=60)
    assert failed.status == "failed" and failed.error.code == "invalid_training_file"
