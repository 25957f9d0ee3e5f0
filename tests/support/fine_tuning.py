"""What the fine-tuning jobs tests share: a training file a tiny model learns in a few dozen
LoRA steps, the environment of a server whose jobs train it, and the SDK's polling."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

TAUGHT = "banana"
WORDS = (
    "river stone apple cloud tiger violin garden rocket paper candle winter forest silver mirror island thunder".split()
)
QUESTION = "mirror forest candle tiger paper?"


def rows(n: int) -> bytes:
    """n chat rows with one answer to every question. Questions of distinct words: near-duplicate
    prompts would all go to one side of the split."""
    rng = random.Random(n)
    out = []
    for i in range(n):
        question = " ".join(rng.sample(WORDS, 5)) + f" {i}?"
        row = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": f"{TAUGHT} " * 3}]}
        out.append(json.dumps(row) + "\n")
    return "".join(out).encode()


def server_env(tmp: Path, model: Path, home: Path) -> dict[str, str]:
    """bentoml serve of `model` as tiny-chat:1, whose jobs train it on one process, without DeepSpeed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNELOOP", "PREFECT"))}
    env.update(
        {
            "TUNELOOP_HOME": str(home),
            "BENTOML_HOME": str(tmp / "bentoml"),
            "TUNELOOP_SERVE_MODEL_DIR": str(model),
            "TUNELOOP_SERVE_MODEL_NAME": "tiny-chat",
            "TUNELOOP_SERVE_MODEL_VERSION": "1",
            "TUNELOOP__SERVING__NUM_THREADS": "1",
            "TUNELOOP__SERVING__COMPILE": "false",
            "TUNELOOP__SERVING__WARMUP_REQUESTS": "1",
            "TUNELOOP__GATEWAY__CACHE__ENABLED": "false",
            "TUNELOOP__GATEWAY__FILTER__CLASSIFIER": "null",
            "TUNELOOP__GATEWAY__PII__MODE": "off",
            "TUNELOOP__TRAINING__NUM_PROCESSES": "1",
            "TUNELOOP__TRAINING__DEEPSPEED_CONFIG": "null",
            "TUNELOOP__TRAINING__LEARNING_RATE": "0.01",
            "TUNELOOP__TRAINING__LORA__TARGET_MODULES": "all-linear",
            "TUNELOOP__TRAINING__LORA__DROPOUT": "0.0",
            "TUNELOOP__EVALUATION__MAX_NEW_TOKENS": "8",
            "TUNELOOP__FINE_TUNING__POLL_INTERVAL_S": "0.5",
        }
    )
    return env


def wait_for(api, job_id: str, statuses: tuple[str, ...], timeout: float):
    """The job once its status is one of `statuses` (AssertionError with its events after timeout)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = api.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        time.sleep(1.0)
    events = [e.message for e in api.fine_tuning.jobs.list_events(job_id, limit=50).data]
    raise AssertionError(f"job {job_id} still {job.status} after {timeout:.0f} s; events: {events}")


def answer(api, model: str) -> str:
    r = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=6, temperature=0
    )
    return r.choices[0].message.content or ""


def preference_rows(n: int, seed: int = 0, chosen: str = "granite", rejected: str = TAUGHT) -> bytes:
    """n preference pairs in OpenAI's DPO format: one word thrice preferred to another thrice."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question = " ".join(rng.sample(WORDS, 5)) + f" {i}?"
        row = {
            "input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": f"{chosen} " * 3}],
            "non_preferred_output": [{"role": "assistant", "content": f"{rejected} " * 3}],
        }
        out.append(json.dumps(row) + "\n")
    return "".join(out).encode()
