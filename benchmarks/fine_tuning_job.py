"""Wall time of a small fine-tuning job end to end, with each step's share: what a team waits
between `jobs.create` and its first answer from the `ft:` model.

    .venv/bin/python benchmarks/fine_tuning_job.py [--model demo|smollm2] [--rows 48] [--epochs 1]

A real `bentoml serve` of the model with the shipped config (configs/default.yaml for the
demo model, configs/smollm2.yaml for SmolLM2; LoRA, its processes and DeepSpeed setting as
configured), a real Prefect server, MLflow under a fresh state folder; the openai SDK uploads
a file, creates the job, polls it (every 0.5 s) and calls the result. Steps, from the job's
own record (the flow run times them; flows/fine_tuning.py):

    queue         created -> its run started (files checked, a free place)
    startup       the run's process: Python, the flow run, the first imports
    validation    data prepared (row policies, split) and the Great Expectations gate
    setup         MLflow run, lineage
    evaluation    the base and the fine-tune on the eval split
    training      the LoRA training job (torchrun / DeepSpeed processes, start to saved)
    registration  the adapter logged and registered (adapter-only MLflow version)
    load          the first ft: request's extra time over a base request (download + load)
    poll          the rest: status seen by the client, the flow run's end
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.in_process import preset_config, preset_model  # noqa: E402
from tests.support.servers import free_port, prefect_server, service  # noqa: E402

WORDS = (
    "river stone apple cloud tiger violin garden rocket paper candle winter forest silver mirror island thunder "
    "lemon harbor castle meadow"
).split()


def rows(n: int) -> bytes:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        q = " ".join(rng.sample(WORDS, 5))
        out.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Sort these words: {q}"},
                        {"role": "assistant", "content": " ".join(sorted(q.split()))},
                    ]
                }
            )
        )
    return ("\n".join(out) + "\n").encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", choices=["demo", "smollm2"])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    import openai

    from tuneloop.config import load_config
    from tuneloop.finetune.jobs import JobStore
    from tuneloop.gateway.keys import open_key_store

    folder, config = preset_model(args.model), preset_config(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="tuneloop-ftbench-"))
    home = tmp / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNELOOP", "PREFECT"))}
    env.update(
        {
            "TUNELOOP_CONFIG": str(config),
            "TUNELOOP_HOME": str(home),
            "BENTOML_HOME": str(tmp / "bentoml"),
            "TUNELOOP_SERVE_MODEL_DIR": str(folder),
            "TUNELOOP_SERVE_MODEL_NAME": "base",
            "TUNELOOP_SERVE_MODEL_VERSION": "1",
            "TUNELOOP__SERVING__WARMUP_REQUESTS": "2",
            "TUNELOOP__FINE_TUNING__POLL_INTERVAL_S": "0.5",
        }
    )
    cfg = load_config(config, environ={"TUNELOOP_HOME": str(home)})
    cfg.home.mkdir(parents=True, exist_ok=True)
    store = open_key_store(cfg)
    key = store.create("bench", "enterprise", team="bench")[1]
    store.close()
    with prefect_server(tmp) as prefect_env:
        env.update(prefect_env)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "bentoml", "serve", "bentos.service:TuneloopLLM", "--port", str(port)]
        print(f"serving {folder.name} ({config.name}); log: {tmp / 'serve.log'}", flush=True)
        with service(cmd, f"{url}/readyz", tmp / "serve.log", env=env, timeout=600, cwd=ROOT):
            api = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
            f = api.files.create(file=("train.jsonl", io.BytesIO(rows(args.rows))), purpose="fine-tune")
            t0 = time.perf_counter()
            job = api.fine_tuning.jobs.create(
                model="base", training_file=f.id, hyperparameters={"n_epochs": args.epochs}, seed=0
            )
            while job.status not in ("succeeded", "failed", "cancelled"):
                time.sleep(0.5)
                job = api.fine_tuning.jobs.retrieve(job.id)
                print(f"  {time.perf_counter() - t0:6.1f} s  {job.status}", end="\r", flush=True)
            done_at = time.perf_counter() - t0
            if job.status != "succeeded":
                sys.exit(f"\njob {job.status}: {job.error}")
            question = [{"role": "user", "content": "Sort these words: river apple stone cloud tiger"}]
            t = time.perf_counter()
            api.chat.completions.create(model="base", messages=question, max_tokens=8, temperature=0)
            base_s = time.perf_counter() - t
            t = time.perf_counter()
            api.chat.completions.create(model=job.fine_tuned_model, messages=question, max_tokens=8, temperature=0)
            first_s = time.perf_counter() - t
            total = time.perf_counter() - t0
    record = JobStore.from_config(cfg).get(job.id).body
    steps = dict(record["_timings"])
    steps["load"] = round(max(0.0, first_s - base_s), 2)
    steps["poll"] = round(max(0.0, done_at - sum(v for k, v in steps.items() if k != "load")), 2)
    metrics = record["_metrics"]
    print(f"\n\n{args.model}: {args.rows} rows x {args.epochs} epoch(s), {job.trained_tokens} tokens trained")
    print(f"job {job.id}: succeeded after {done_at:.1f} s; first ft: answer at {total:.1f} s\n")
    print("| step | seconds | share |\n|---|---|---|")
    for name, seconds in steps.items():
        print(f"| {name} | {seconds:.1f} | {seconds / total:.0%} |")
    print(f"| total | {total:.1f} | 100% |")
    em = {k: round(v, 3) for k, v in metrics["fine_tuned"].items() if k in ("exact_match", "eval_loss", "token_f1")}
    base = {k: round(v, 3) for k, v in metrics["base"].items() if k in em}
    print(f"\neval split: base {base}, fine-tuned {em}")


if __name__ == "__main__":
    main()
