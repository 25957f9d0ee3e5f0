"""A running server follows the registry's champion (tuneloop/serving/hotswap.py): the
slots engine swaps a new version's weights in at a step boundary while clients stream, no
request fails or mixes two models, and the server then answers as the new version
(/v1/models, every response's `model`, the request log). A version of another
architecture is refused and the server keeps serving. Real MLflow registry (SQLite)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support import ROOT
from tests.support.serving import make_server, raw, reference
from tests.support.serving_tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tuneloop.serving.engine import load_model

    root = tmp_path_factory.mktemp("swap")
    a, b = build_tiny_model(root / "a", seed=0), build_tiny_model(root / "b", seed=1)
    other = build_tiny_model(root / "other", context_length=128, seed=2)  # another architecture (positions)
    return {
        "a": a,
        "b": b,
        "other": other,
        "loaded_a": load_model(a, num_threads=1),
        "loaded_b": load_model(b, num_threads=1),
    }


def test_slots_engine_swaps_weights_without_dropping_or_mixing_a_request(models):
    from tuneloop.serving.engine import GenerationStream, SamplingParams
    from tuneloop.serving.slots import SlotEngine

    la, lb = models["loaded_a"], models["loaded_b"]
    prompt = la.tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    want_a, want_b = reference(la, prompt, 12), reference(lb, prompt, 12)
    assert want_a != want_b
    import copy

    served = copy.deepcopy(la)  # the engine's model gets b's weights; la stays a
    engine = SlotEngine(served, num_slots=4)
    engine.launch()

    async def one(delay: float):
        await asyncio.sleep(delay)
        stream = GenerationStream(
            f"r{delay}", prompt, SamplingParams(max_new_tokens=12, temperature=0.0), asyncio.get_running_loop()
        )
        engine.submit(stream)
        ids = [t async for chunk in stream.events() for t in chunk]
        return ids, stream.finish_reason

    async def main():
        engine.ready.wait()
        first = [asyncio.ensure_future(one(0.0)) for _ in range(6)]  # more than the slots: some queue
        await asyncio.sleep(0.03)
        done = engine.swap_weights(lb.model.state_dict())
        later = [asyncio.ensure_future(one(0.02 * i)) for i in range(6)]  # arrive while it drains
        results = await asyncio.gather(*first, *later)
        assert await asyncio.to_thread(done.wait, 30)
        after = await one(0.0)
        return results, after

    try:
        results, after = asyncio.run(main())
    finally:
        engine.stop()
    assert engine.swap_error is None
    for ids, reason in results:
        assert reason in ("stop", "length")
        assert ids in (want_a, want_b), "a generation mixed the two models' weights"
    assert after[0] == want_b
    assert sum(ids == want_a for ids, _ in results) >= 1  # the running ones finished on the old weights
    with pytest.raises(ValueError, match="architecture"):
        from tuneloop.serving.engine import load_model

        engine.swap_weights(load_model(models["other"], num_threads=1).model.state_dict())


def test_the_server_follows_the_champion_while_a_client_streams(models, tmp_path):
    from mlflow.tracking import MlflowClient

    from tuneloop.api.app import create_app
    from tuneloop.config import TuneloopConfig
    from tuneloop.gateway.pipeline import Gateway
    from tuneloop.registry import ModelRegistry
    from tuneloop.requestlog.store import read_records
    from tuneloop.requestlog.writer import open_request_log
    from tuneloop.serving.hotswap import ChampionWatcher
    from tuneloop.serving.setup import ServedModel
    from tuneloop.serving.slots import SlotEngine

    cfg = TuneloopConfig.model_validate(
        {
            "paths": {"home": str(tmp_path)},
            "gateway": {
                "auth": "off",
                "pii": {"mode": "off", "outputs": "off"},
                "filter": {"prompts": "off", "outputs": "off"},
                "cache": {"enabled": False},
            },
            "request_log": {"texts": "omit"},
        }
    )
    name = cfg.mlflow.registered_model
    registry = ModelRegistry.from_config(cfg)
    client = MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)
    exp = client.create_experiment("swap", artifact_location=cfg.mlflow_artifact_location)

    def register(folder) -> str:
        return registry.register(client.create_run(exp).info.run_id, folder)

    v1 = register(models["a"])
    registry.promote(v1, None, "first", require_blessed=False)
    import copy

    served = copy.deepcopy(models["loaded_a"])
    engine = SlotEngine(served, num_slots=4)
    engine.launch()

    async def main():
        engine.ready.wait()
        app = create_app()
        app.state.gateway = Gateway.from_config(cfg, load_classifier=False)
        app.state.request_log = open_request_log(cfg)
        server = make_server(served, engine)
        server.served = ServedModel(name, v1, [f"{name}@champion"])
        app.state.server = server
        watcher = ChampionWatcher(cfg, server, engine, poll_s=0.2)
        assert ChampionWatcher.applies(cfg, server.served, engine) is None
        http = raw(app)
        body = {
            "model": f"{name}@champion",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Hello there"}],
        }
        assert not await watcher.check()  # the champion is what it serves

        stop, seen = asyncio.Event(), []

        async def streaming_client():
            while not stop.is_set():
                r = await http.post("/v1/chat/completions", json={**body, "stream": True})
                events = [line for line in r.text.splitlines() if line.startswith("data: {")]
                seen.append(
                    (r.status_code, "error" in r.text, events[0] and __import__("json").loads(events[0][6:])["model"])
                )

        clients = [asyncio.ensure_future(streaming_client()) for _ in range(3)]
        await asyncio.sleep(0.3)
        v2 = await asyncio.to_thread(register, models["b"])
        await asyncio.to_thread(registry.promote, v2, v1, "better", require_blessed=False)
        assert await watcher.check()  # swapped while the clients stream
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*clients)
        models_list = (await http.get("/v1/models")).json()["data"][0]["id"]
        answer = (await http.post("/v1/chat/completions", json=body)).json()
        v3 = await asyncio.to_thread(register, models["other"])
        await asyncio.to_thread(registry.promote, v3, v2, "another architecture", require_blessed=False)
        refused = await watcher.check()
        still = (await http.post("/v1/chat/completions", json=body)).json()["model"]
        await http.aclose()
        app.state.request_log.close()
        await app.state.gateway.close()
        return v1, v2, v3, seen, models_list, answer, refused, still, watcher

    try:
        v1, v2, v3, seen, models_list, answer, refused, still, watcher = asyncio.run(main())
    finally:
        engine.stop()
    assert seen and all(status == 200 and not err for status, err, _ in seen), seen
    versions = [m for _, _, m in seen]
    assert f"{name}:{v1}" in versions and f"{name}:{v2}" in versions, versions
    assert versions == sorted(versions, key=lambda m: m != f"{name}:{v1}")  # v1 until the swap, then v2 only
    assert models_list == f"{name}:{v2}" and answer["model"] == f"{name}:{v2}"
    assert not refused and still == f"{name}:{v2}" and v3 in watcher.skipped
    logged = {r["model_version"] for r in read_records(None, tmp_path) if r["route"] == "/v1/chat/completions"}
    assert logged == {v1, v2}


@pytest.mark.parametrize("engine_process", ["false", "true"], ids=["engine-thread", "engine-process"])
def test_bentoml_serve_follows_a_promotion_with_no_failed_request(models, tmp_path, engine_process):
    """The same through a real `bentoml serve` of a registered version: promote v2 in the
    registry while a client streams; the server reports v2 within the poll, no request fails.
    With the engine in its own process (serving.engine_process), the new weights cross into
    it and it answers as v2."""
    import json
    import sys
    import threading
    import time

    import httpx
    from mlflow.tracking import MlflowClient

    from tests.support.servers import GATEWAY_OFF, free_port, service
    from tuneloop.config import TuneloopConfig
    from tuneloop.registry import ModelRegistry

    home = tmp_path / "home"
    cfg = TuneloopConfig.model_validate({"paths": {"home": str(home)}})
    name = cfg.mlflow.registered_model
    registry = ModelRegistry.from_config(cfg)
    client = MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)
    exp = client.create_experiment("swap", artifact_location=cfg.mlflow_artifact_location)
    v1 = registry.register(client.create_run(exp).info.run_id, models["a"])
    registry.promote(v1, None, "first", require_blessed=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "TUNELOOP_HOME": str(home),
        "BENTOML_HOME": str(tmp_path / "bentoml"),
        "TUNELOOP_SERVE_MODEL_DIR": str(models["a"]),
        "TUNELOOP_SERVE_MODEL_NAME": name,
        "TUNELOOP_SERVE_MODEL_VERSION": v1,
        "TUNELOOP__SERVING__FOLLOW_CHAMPION_S": "1",
        "TUNELOOP__SERVING__COMPILE": "false",
        "TUNELOOP__SERVING__NUM_THREADS": "1",
        "TUNELOOP__SERVING__ENGINE_PROCESS": engine_process,
        "TUNELOOP__SERVING__DTYPE": "float32",
        **GATEWAY_OFF,
    }  # as the reference answers below
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
    body = {
        "model": name,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello there"}],
    }
    with service(cmd, f"{url}/readyz", tmp_path / "serve.log", env=env, timeout=240, cwd=ROOT):
        stop, seen = threading.Event(), []

        def streaming_client():
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    r = c.post(f"{url}/v1/chat/completions", json=body)
                    first = next(line for line in r.text.splitlines() if line.startswith("data: {"))
                    seen.append((r.status_code, '"error"' in r.text, json.loads(first[6:])["model"]))

        threads = [threading.Thread(target=streaming_client) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        v2 = registry.register(client.create_run(exp).info.run_id, models["b"])
        registry.promote(v2, v1, "better", require_blessed=False)
        deadline, serving = time.time() + 60, None
        while time.time() < deadline:
            serving = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            if serving == f"{name}:{v2}":
                break
            time.sleep(0.5)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        prompt = models["loaded_b"].tokenizer("Hello there", add_special_tokens=False)["input_ids"]
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=30,
            json={"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        answered = r.json()["choices"][0]["text"]
    assert serving == f"{name}:{v2}", (tmp_path / "serve.log").read_text()[-3000:]
    assert seen and all(status == 200 and not err for status, err, _ in seen), seen
    assert {m for _, _, m in seen} == {f"{name}:{v1}", f"{name}:{v2}"}
    assert f'tuneloop_model_info{{model="{name}:{v2}"}} 1.0' in metrics
    # v2's own answer, from the engine wherever it runs: b's greedy tokens, not a's
    decode = models["loaded_b"].tokenizer.decode
    want_a, want_b = (decode(reference(models[m], prompt, 8)) for m in ("loaded_a", "loaded_b"))
    assert want_a != want_b and answered == want_b, (answered, want_a, want_b)
