"""The gateway's CPU a request in the server's process, without the engine's noise.

    python benchmarks/gateway_cpu.py                      # off, on and the attribution systems
    python benchmarks/gateway_cpu.py --systems off,on --reps 7

benchmarks/gateway.py measures what the gateway costs in throughput, which on two shared
cores moves by +-5-15 % from round to round: too coarse to see a change worth a few percent.
This one measures its cause. The server's ASGI app (the real routes, the real gateway with
Redis started here and the checks' own process) runs in this process with a replay model:
the model's own greedy answers to the workload's prompts, generated once, handed out in
12-token chunks (the coalescing of the served engine at the demo model's speed) with no
forward pass in between. Every system gets the same requests (chat, streamed, 16 in flight);
what is measured is the CPU of this process's main thread a request -- the event loop, where
the gateway's per-request work runs -- and of the whole process (the checks' reader and
writer threads). Best of --reps, systems interleaved; `over off` is what the gateway adds.
The client runs in the same thread, so a system's number includes the client's share of
parsing the gateway's headers (a few microseconds).

Systems: off (everything off), on (keys, limits in Redis, PII, rules + the classifier, as
benchmarks/gateway.py's `on`), on-no-checks (keys, limits and rules: no PII, no classifier),
on-no-pii, on-no-redis (limits in this process).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchmarks.gateway import train_filter  # noqa: E402
from benchmarks.serving import DATA, build_workload, resolve_model  # noqa: E402
from tests.support.servers import redis_server  # noqa: E402

OFF = {"auth": "off", "pii": {"mode": "off", "outputs": "off"}, "filter": {"prompts": "off", "outputs": "off"}}
CHUNK = 12  # tokens a chunk


class Replay:
    """A backend that answers every prompt with the model's own greedy answer to it, in chunks."""

    engine = "replay"

    def __init__(self, answers: dict[tuple[int, ...], list[int]]):
        self.answers = answers

    def submit(self, stream):
        ids = self.answers[tuple(stream.prompt_ids)][: stream.params.max_new_tokens]

        async def run():
            for i in range(0, len(ids), CHUNK):
                stream.emit(ids[i : i + CHUNK])
                await asyncio.sleep(0.002)
            stream.finish("length")

        stream.claimed = True
        asyncio.get_running_loop().create_task(run())


def answers_of(loaded, requests) -> dict[tuple[int, ...], list[int]]:
    import torch

    out = {}
    longest = max(r.max_tokens for r in requests)
    for r in requests:
        key = tuple(r.prompt_ids)
        if key not in out:
            ids = torch.tensor([r.prompt_ids])
            gen = loaded.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
            )
            out[key] = gen[0, len(r.prompt_ids) :].tolist()
    return out


async def drive(app, requests, key: str | None, concurrency: int) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    errors = 0
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://bench", headers=headers, timeout=60
    ) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(r):
            nonlocal errors
            async with sem:
                body = {
                    "model": "tiny",
                    "messages": r.messages,
                    "max_tokens": r.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "ignore_eos": True,
                }
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    data = b"".join([p async for p in resp.aiter_bytes()])
                    if resp.status_code != 200 or b'"error"' in data:
                        errors += 1
                        if errors == 1:
                            print(f"  error: HTTP {resp.status_code} {data[:300]!r}", flush=True)

        await asyncio.gather(*(one(r) for r in requests))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--systems", default="off,on,on-no-checks,on-no-pii,on-no-redis")
    parser.add_argument("--model-dir", type=Path, help="model folder (default: the bootstrap base model)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from tuneloop.serving.engine import load_model

    model_dir = resolve_model(args)
    loaded = load_model(model_dir, num_threads=1)
    requests = build_workload(args.data, loaded.tokenizer, args.num_requests, 8, 128, args.seed)
    print(f"generating the model's answers to {len({tuple(r.prompt_ids) for r in requests})} prompts...", flush=True)
    answers = answers_of(loaded, requests)
    work = Path(tempfile.mkdtemp(prefix="tuneloop-gateway-cpu-"))
    try:
        home = work / "home"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
        env.update({"TUNELOOP_HOME": str(home), "PREFECT_HOME": str(work / "prefect")})
        trained = train_filter(env)
        with redis_server(work) as url:
            # The classifier as served: the config's default alias, registered just now (or, without
            # the data, none: rules only, as a server without a trained classifier runs).
            on = {"redis_url": url, "checks_in": "process", "filter": {"on_missing_classifier": "rules_only"}}
            if trained:
                on["filter"]["on_missing_classifier"] = "fail"
            systems = {
                "off": OFF,
                "on": on,
                "on-no-checks": {**on, "pii": {"mode": "off", "outputs": "off"}, "filter": {"classifier": None}},
                "on-no-pii": {**on, "pii": {"mode": "off", "outputs": "off"}},
                "on-no-redis": {**on, "redis_url": None},
            }
            wanted = args.systems.split(",")
            unknown = sorted(set(wanted) - set(systems))
            if unknown:
                raise SystemExit(f"--systems: unknown {unknown} ({', '.join(systems)})")
            asyncio.run(run({n: systems[n] for n in wanted}, home, loaded, requests, answers, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def run(systems: dict, home: Path, loaded, requests, answers, args) -> None:
    from tests.support.serving import make_server
    from tuneloop.api.app import create_app
    from tuneloop.config import TuneloopConfig
    from tuneloop.gateway.pipeline import Gateway

    built = {}
    try:
        for name, gateway in systems.items():
            cfg = TuneloopConfig.model_validate(
                {"paths": {"home": str(home)}, "gateway": {**gateway, "cache": {"enabled": False}}}
            )
            g = Gateway.from_config(cfg)
            await g.warm_up()
            key = g.keys.create(f"bench-{name}", "enterprise")[1] if g.keys is not None else None
            app = create_app()
            app.state.gateway = g
            app.state.server = make_server(loaded, Replay(answers), max_concurrency=4 * args.concurrency)
            built[name] = (g, app, key)
            await drive(app, requests[:64], key, args.concurrency)  # warm
        gc.collect()
        gc.freeze()  # what is alive now stays out of the collections measured below
        main_ms: dict[str, list[float]] = {n: [] for n in built}
        proc_ms: dict[str, list[float]] = {n: [] for n in built}
        rng = random.Random(args.seed)
        for rep in range(1, args.reps + 1):
            order = list(built)
            rng.shuffle(order)
            for name in order:
                g, app, key = built[name]
                t, p = time.thread_time(), time.process_time()
                errors = await drive(app, requests, key, args.concurrency)
                t, p = time.thread_time() - t, time.process_time() - p
                main_ms[name].append(t / len(requests) * 1000)
                proc_ms[name].append(p / len(requests) * 1000)
                print(
                    f"rep {rep}/{args.reps}  {name}: main thread {main_ms[name][-1]:.3f} ms a request, process "
                    f"{proc_ms[name][-1]:.3f}{f', {errors} errors' if errors else ''}",
                    flush=True,
                )
        print("=" * 80)
        base = min(main_ms["off"]) if "off" in main_ms else None
        for name in built:
            over = "" if base is None else f", over off {min(main_ms[name]) - base:+.3f} ms"
            print(
                f" {name:14s} main thread {min(main_ms[name]):.3f} ms a request (best of {args.reps}{over}); "
                f"process {min(proc_ms[name]):.3f} ms"
            )
        print("=" * 80)
    finally:
        for g, _, _ in built.values():
            await g.close()


if __name__ == "__main__":
    main()
