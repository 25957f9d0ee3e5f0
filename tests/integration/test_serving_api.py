"""The real thing: `bentoml serve bentos.service:TuneloopLLM` on a free port, driven by the
official `openai` SDK (sync, async, streaming), for all three engines.

Covers: completions and chat completions, typed SDK exceptions (400, 404, 429), a
schemathesis run over the served spec (no 5xx, OpenAI-shaped errors), internal routes
unreachable from outside, 256
concurrent requests with zero errors (the BentoML 1.4.40 in-process client bug must not
surface), batching observed in /metrics, greedy output equal to single-request
`generate`, the OpenAPI spec, readiness after warm-up, and a disconnecting client
freeing its slot.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.openapi_fuzz import fuzz_openai_routes
from tests.support.servers import GATEWAY_OFF, free_port, service
from tests.support.serving_tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world", "The quick brown fox jumps over", "Tokens are generated one at a time;", "x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-served"))


def serve(model_dir: Path, tmp: Path, engine: str, **serving):
    """Start `bentoml serve` with the given serving settings; context manager yielding the base URL."""
    port = free_port()
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "BENTOML_HOME": str(tmp / "bentoml"),
        "TUNELOOP_HOME": str(tmp / "home"),
        "TUNELOOP_SERVE_MODEL_DIR": str(model_dir),
        "TUNELOOP_SERVE_ENGINE": engine,
        "TUNELOOP_SERVE_MODEL_NAME": "tiny-chat",
        "TUNELOOP_SERVE_MODEL_VERSION": "7",
        "TUNELOOP__SERVING__ALIASES": "[tiny-chat@champion]",
        "TUNELOOP__SERVING__NUM_THREADS": "1",  # the machine has 2 shared cores; leave one to the clients
        "TUNELOOP__SERVING__DTYPE": "float32",  # answers are compared with float32 `generate`
        **GATEWAY_OFF,
        **{f"TUNELOOP__SERVING__{k.upper()}": str(v) for k, v in serving.items()},
    }
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
    url = f"http://127.0.0.1:{port}"
    return url, service(cmd, f"{url}/readyz", tmp / f"serve-{engine}-{port}.log", env=env, timeout=180, cwd=ROOT)


@pytest.fixture(scope="module", params=["adaptive", "continuous", "slots"])
def server(request, model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"serve-{request.param}")
    url, ctx = serve(model_dir, tmp, request.param, max_batch_size=32)
    started = time.perf_counter()
    with ctx:
        print(f"\n{request.param}: ready in {time.perf_counter() - started:.1f} s")
        yield request.param, url


def sync_client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def async_client(url, connections=300):
    import httpx
    import openai

    http = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections), timeout=300
    )
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http)


def metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels) -> float:
    """Sum of the samples of one metric whose labels include the given ones."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(got.get(k) == str(v) for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def batches_over_one(text: str, engine: str) -> float:
    return sample(text, "tuneloop_batch_size_count", engine=engine) - sample(
        text, "tuneloop_batch_size_bucket", engine=engine, le="1.0"
    )


# ---------------------------------------------------------------------------------------


def test_models_completions_and_chat_sync(server):
    engine, url = server
    client = sync_client(url)
    ids = [m.id for m in client.models.list().data]
    # the served model by its names, then the embedding model (/v1/embeddings)
    assert ids == ["tiny-chat:7", "tiny-chat@champion", "tiny-chat", "all-MiniLM-L6-v2"]

    comp = client.completions.create(
        model="tiny-chat:7", prompt="Hello world", max_tokens=8, temperature=0, user="test-user"
    )
    assert comp.object == "text_completion" and comp.model == "tiny-chat:7"
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.prompt_tokens > 0
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + comp.usage.completion_tokens
    assert comp.system_fingerprint == f"tuneloop-{engine}"

    chat = client.chat.completions.create(
        model="tiny-chat@champion",
        max_tokens=6,
        seed=3,
        temperature=0.8,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}],
    )
    assert chat.model == "tiny-chat:7"  # asked by alias, answered with the version actually serving
    again = client.chat.completions.create(
        model="tiny-chat@champion",
        max_tokens=6,
        seed=3,
        temperature=0.8,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}],
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == again.choices[0].message.content  # seeded


def test_streaming_sync_and_async(server):
    engine, url = server
    client = sync_client(url)
    full = client.completions.create(model="tiny-chat", prompt="Hello world", max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny-chat",
            prompt="Hello world",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason

    async def chat_stream():
        client = async_client(url)
        stream = await client.chat.completions.create(
            model="tiny-chat", max_tokens=10, temperature=0, stream=True, messages=[{"role": "user", "content": "Hi"}]
        )
        parts = [c async for c in stream]
        full = await client.chat.completions.create(
            model="tiny-chat", max_tokens=10, temperature=0, messages=[{"role": "user", "content": "Hi"}]
        )
        return parts, full

    parts, full_chat = asyncio.run(chat_stream())
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == full_chat.choices[0].message.content

    # the raw wire format: SSE events, the last one `data: [DONE]`
    req = urllib.request.Request(
        f"{url}/v1/completions",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "tiny-chat", "prompt": "Hi", "max_tokens": 3, "stream": True}).encode(),
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_typed_errors_400_404(server):
    import openai

    engine, url = server
    client = sync_client(url)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt="Hi", n=129)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], top_p=1.5)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt="word " * 300, max_tokens=10)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="Hi")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    # BentoML's own answers are OpenAI-shaped too: an unknown path, and the internal batch
    # route, which outsiders never reach (test_internal_routes_are_unreachable_from_outside)
    for path, body, status in [("/v1/nope", {}, 404), ("/internal/generate_batch", {"x": 1}, 404)]:
        req = urllib.request.Request(
            url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == status
        assert set(json.loads(err.value.read())["error"]) == {"message", "type", "param", "code"}


def test_256_concurrent_requests_all_succeed_and_are_batched(server):
    engine, url = server
    before = metrics(url)
    n, max_tokens = 256, 16

    async def run():
        client = async_client(url)

        async def one(i):
            if i % 2:
                r = await client.completions.create(
                    model="tiny-chat",
                    prompt=PROMPTS[i % 4],
                    max_tokens=max_tokens,
                    temperature=0 if i % 3 else 0.7,
                    seed=i,
                )
                return r.usage.completion_tokens
            r = await client.chat.completions.create(
                model="tiny-chat",
                max_tokens=max_tokens,
                temperature=0,
                messages=[{"role": "user", "content": PROMPTS[i % 4]}],
            )
            return r.usage.completion_tokens

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        return results, time.perf_counter() - started

    results, seconds = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == [], f"{len(errors)} of {n} failed, first: {errors[0]!r}"
    tokens = sum(results)
    after = metrics(url)
    batched = batches_over_one(after, engine) - batches_over_one(before, engine)
    steps = sample(after, "tuneloop_batch_size_count", engine=engine) - sample(
        before, "tuneloop_batch_size_count", engine=engine
    )
    rows = sample(after, "tuneloop_batch_size_sum", engine=engine) - sample(
        before, "tuneloop_batch_size_sum", engine=engine
    )
    print(
        f"\n{engine}: {n} concurrent requests in {seconds:.1f} s, {tokens / seconds:.0f} output tok/s, "
        f"{steps:.0f} batches/steps of mean size {rows / max(steps, 1):.1f}, {batched:.0f} of them > 1"
    )
    assert batched > 0
    assert rows / steps > 2  # really batched, not one at a time
    assert sample(after, "tuneloop_requests_rejected_total") == sample(before, "tuneloop_requests_rejected_total")
    assert sample(after, "tuneloop_num_requests_running") == 0 and sample(after, "tuneloop_num_requests_waiting") == 0
    assert (
        sample(after, "tuneloop_time_to_first_token_seconds_count")
        - sample(before, "tuneloop_time_to_first_token_seconds_count")
        >= n
    )
    if engine == "adaptive":
        assert sample(after, "tuneloop_internal_retries_total") == sample(before, "tuneloop_internal_retries_total")


def test_greedy_output_equals_single_request_generate(server, model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    engine, url = server
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    stop = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")})

    async def served():
        client = async_client(url)
        # concurrent, so that the server batches them
        return await asyncio.gather(
            *(
                client.completions.create(model="tiny-chat", prompt=p, max_tokens=10 + 5 * i, temperature=0)
                for i, p in enumerate(PROMPTS)
            )
        )

    for i, (p, got) in enumerate(zip(PROMPTS, asyncio.run(served()))):
        ids = tok(p, add_special_tokens=False)["input_ids"]
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=10 + 5 * i, eos_token_id=stop, pad_token_id=tok.pad_token_id
            ),
        )
        assert got.choices[0].text == tok.decode(out[0, len(ids) :], skip_special_tokens=True), p


def test_openapi_spec_matches_the_routes(server):
    engine, url = server
    with urllib.request.urlopen(f"{url}/docs.json", timeout=10) as r:
        spec = json.loads(r.read())
    paths = spec["paths"]
    assert "post" in paths["/v1/completions"] and "post" in paths["/v1/chat/completions"]
    assert "get" in paths["/v1/models"] and "get" in paths["/v1/models/{model}"]
    schemas = spec["components"]["schemas"]
    assert {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "n",
        "stream",
        "stream_options",
        "user",
    } <= set(schemas["CompletionRequest"]["properties"])
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    responses = paths["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "429", "503", "504"} <= set(responses) and "422" not in responses


def test_internal_routes_are_unreachable_from_outside(server):
    """The adaptive engine's self-call route answers 404 to every outside caller (well-formed,
    malformed or empty bodies) and is not in the served spec; the other engines have none."""
    import httpx

    engine, url = server
    attempts = [
        ("POST", {"json": {"request_ids": ["x"]}}),
        ("POST", {"json": {"request_ids": 5}}),
        ("POST", {"content": b"{not json"}),
        ("POST", {}),
        ("GET", {}),
        ("POST", {"json": {"request_ids": ["x"]}, "headers": {"x-tuneloop-internal": "guess"}}),
    ]
    for method, kw in attempts:
        r = httpx.request(method, f"{url}/internal/generate_batch", timeout=30, **kw)
        assert r.status_code == 404, (method, kw, r.status_code, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with urllib.request.urlopen(f"{url}/docs.json", timeout=10) as r:
        spec = json.loads(r.read())
    assert not [p for p in spec["paths"] if p.startswith("/internal")]
    client = sync_client(url)  # and the engine still works (adaptive: through that very route)
    assert client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=4).choices[0].text is not None


def test_schemathesis_finds_no_server_error_and_only_openai_shaped_errors(server):
    """Property-based requests from the served OpenAPI spec (valid and invalid ones), with
    the model names a real client sends (the served ones and an unknown one): no 5xx, every
    /v1 error in OpenAI's shape, every 200 JSON body valid against the documented schema."""
    engine, url = server
    seen = fuzz_openai_routes(url, ["tiny-chat:7", "tiny-chat@champion", "tiny-chat", "gpt-4o"])
    print(f"\n{engine}: {sum(seen.values())} requests, " + ", ".join(f"{k}={v}" for k, v in sorted(seen.items())))
    assert any(k[0] == "positive" and k[3] == 200 and "completions" in k[2] for k in seen)  # it reached the engine
    assert any(k[0] == "negative" and k[3] == 400 for k in seen)


# ---------------------------------------------------------------------------------------
# a server with room for two generations at a time


@pytest.fixture(scope="module", params=["continuous", "slots"])
def small_server(request, model_dir, tmp_path_factory):
    url, ctx = serve(
        model_dir,
        tmp_path_factory.mktemp("serve-small"),
        request.param,
        max_concurrency=2,
        retry_after_s=3,
        compile="false",
    )
    with ctx:
        yield url


def test_over_capacity_is_429_with_retry_after(small_server):
    import openai

    url = small_server

    async def run():
        client = async_client(url)
        return await asyncio.gather(
            *(
                client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=64, temperature=0)
                for _ in range(12)
            ),
            return_exceptions=True,
        )

    results = asyncio.run(run())
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert limited and all(not isinstance(r, Exception) or isinstance(r, openai.RateLimitError) for r in results)
    assert limited[0].response.headers["retry-after"] == "3"
    assert limited[0].body["type"] == "rate_limit_error"
    assert sample(metrics(url), "tuneloop_requests_rejected_total", reason="overloaded") >= len(limited)


def _wait_idle(url: str, timeout: float = 10) -> str:
    """Metrics once no generation is running or waiting (or after timeout)."""
    deadline = time.time() + timeout
    while True:
        now = metrics(url)
        if sample(now, "tuneloop_num_requests_running") + sample(now, "tuneloop_num_requests_waiting") == 0:
            return now
        if time.time() > deadline:
            return now
        time.sleep(0.1)


def test_client_that_disconnects_frees_its_slot(small_server):
    import httpx

    url = small_server
    before = _wait_idle(url)
    body = {"model": "tiny-chat", "prompt": "Hello", "max_tokens": 240, "temperature": 0}
    # Fill both slots with long streams, read a little, hang up.
    with httpx.Client(timeout=30) as http:
        for _ in range(2):
            with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())
    after_streams = _wait_idle(url)
    # A non-streaming client that gives up also frees its slot. How long 240 tokens of the
    # tiny model take depends on the machine (0.03-0.2 s), so a read timeout races the
    # answer; a client that hangs up right after sending its request does not.
    import json
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: "
            + parts.netloc.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
    time.sleep(0.5)  # the server reads the request and sees the hang-up
    now = _wait_idle(url)

    def disconnects(text):
        return sample(text, "tuneloop_requests_rejected_total", reason="client_disconnected")

    assert disconnects(after_streams) - disconnects(before) == 2
    assert disconnects(now) - disconnects(before) == 3
    generated = sample(now, "tuneloop_generation_tokens_total") - sample(before, "tuneloop_generation_tokens_total")
    assert generated < 3 * 240  # their generations stopped early
    # and the slots are free again
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text


def test_serves_a_bentoml_model_and_is_ready_only_after_warm_up(model_dir, tmp_path):
    """The packaging seam (serving.bento_model = a BentoML model tag) and readiness:
    /readyz is 503 while the model warms up, 200 after."""
    import shutil
    import signal
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BENTOML_HOME": str(tmp_path / "bentoml")}
    create = (
        "import bentoml, shutil, sys\n"
        "with bentoml.models.create('tiny-chat', labels={'mlflow_version': '7'}) as m:\n"
        "    shutil.copytree(sys.argv[1], m.path, dirs_exist_ok=True)\n"
        "print(m.tag)"
    )
    tag = (
        subprocess.run(
            [sys.executable, "-c", create, str(model_dir)], env=env, capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    port = free_port()
    env.update(
        {
            "TUNELOOP__SERVING__BENTO_MODEL": tag,
            "TUNELOOP_SERVE_ENGINE": "adaptive",
            "TUNELOOP_SERVE_MODEL_DIR": str(tmp_path / "not-used"),
            "TUNELOOP__SERVING__NUM_THREADS": "1",
            "TUNELOOP__SERVING__WARMUP_REQUESTS": "40",
            "TUNELOOP_HOME": str(tmp_path / "home"),
            **GATEWAY_OFF,
        }
    )
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bentoml",
                "serve",
                "bentos.service:TuneloopLLM",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    codes = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline and (not codes or codes[-1] != 200) and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    codes.append(r.status)
            except urllib.error.HTTPError as e:
                codes.append(e.code)
            except OSError:
                pass
            time.sleep(0.1)
        assert codes and codes[-1] == 200, log.read_text()[-2000:]
        comp = sync_client(f"http://127.0.0.1:{port}").completions.create(
            model="tuneloop-chat", prompt="Hi", max_tokens=3
        )
        assert comp.usage.completion_tokens > 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert 503 in codes  # the app was up, the warm-up not yet done
    text = log.read_text()
    assert "warm-up done" in text
    assert f"from {tmp_path / 'bentoml' / 'models' / 'tiny-chat'}" in text
    shutil.rmtree(tmp_path / "bentoml", ignore_errors=True)


def test_api_routes_make_spans_only_when_trace_requests_is_on(model_dir, tmp_path):
    """BentoML's OpenTelemetry spans (one per request, one per SSE write) were a third of the
    event loop's work and dropped at BentoML's default sample rate: the API routes make none
    unless serving.trace_requests is on. The access log shows a request's span ids."""
    lines = {}
    for on in (False, True):
        tmp = tmp_path / f"trace-{on}"
        tmp.mkdir()
        # spans are the API routes' business, not the engine's: the quickest start will do
        url, ctx = serve(model_dir, tmp, "continuous", trace_requests=on, compile="false")
        with ctx:
            sync_client(url).chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
            )
        log = next(tmp.glob("serve-*.log")).read_text()
        lines[on] = [line for line in log.splitlines() if "path=/v1/chat/completions" in line]
        assert len(lines[on]) == 1, log[-2000:]  # the access log line is there either way
    assert re.search(r"trace=[0-9a-f]{32}", lines[True][0])
    assert not re.search(r"trace=[0-9a-f]{32}", lines[False][0])
