"""One hostile request harms no one else: the cases a hostile client found, each against a real
`bentoml serve` on 127.0.0.1 (auth on, the gateway's PII checks in their own process, the slots
engine in its own process), bounded in count and time.

- oversized bodies: 413 before they are read, the worker's memory flat, another client unhurt;
- a prompt longer than the context window: refused before PII analysis or the tokenizer;
- a PII-heavy prompt beside 16 other tenants' streams with personal data: none of them fails,
  the checks' process is never restarted, the request log writes on time;
- one tenant's n=128 request and its flood: its share only, another tenant unhurt;
- 2,000 unknown paths: /metrics stays small and clean; a %0A path forges no log line;
- a SIGKILLed engine: clean errors, /readyz red, /livez green, served again;
- SIGTERM mid-stream: the stream finishes, new requests are refused, every request is logged.

The environment override under a hung Redis is in test_packaging.py (a deployed bento), the
planted secrets in test_privacy.py, schemathesis with auth on in test_gateway_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time

import httpx
import pytest

from tests.support import ROOT
from tests.support.servers import free_port, service
from tests.support.serving_tiny_model import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PII_LINE = "Call me at +1 212-555-{:04d} or write to jane{}@mail-provider.org, card 4111 1111 1111 1111. "


def _processes(root_pid: int) -> list:
    import psutil

    try:
        return psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _find(root_pid: int, marker: str):
    import psutil

    for p in _processes(root_pid):
        try:
            if marker in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            continue
    # the engine process runs in a session of its own, but it is still the worker's child
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tuneloop.config import load_config
    from tuneloop.gateway.keys import open_key_store

    tmp = tmp_path_factory.mktemp("hostile")
    # A context window of 16k positions: a 100 KB prompt passes the cheap bound and reaches
    # the PII analysis (which is what the PII case is about); it is refused after.
    model = build_tiny_model(tmp / "model", context_length=16384)
    home = tmp / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
    env.update(
        {
            "TUNELOOP_HOME": str(home),
            "BENTOML_HOME": str(tmp / "bentoml"),
            "TUNELOOP_SERVE_MODEL_DIR": str(model),
            "TUNELOOP_SERVE_MODEL_NAME": "tiny-chat",
            "TUNELOOP_SERVE_MODEL_VERSION": "1",
            "TUNELOOP__SERVING__NUM_THREADS": "1",
            "TUNELOOP__SERVING__COMPILE": "false",
            "TUNELOOP__SERVING__WARMUP_REQUESTS": "2",
            "TUNELOOP__SERVING__MAX_CONCURRENCY": "64",
            "TUNELOOP__SERVING__SHUTDOWN_GRACE_S": "60",
            "TUNELOOP__GATEWAY__CACHE__ENABLED": "false",
            "TUNELOOP__GATEWAY__FILTER__CLASSIFIER": "null",
        }
    )
    cfg = load_config(environ={"TUNELOOP_HOME": str(home)})
    cfg.home.mkdir(parents=True, exist_ok=True)
    store = open_key_store(cfg)
    keys = {
        name: store.create(name, tier)[1]
        for name, tier in [
            ("heavy", "paid"),
            ("hog", "paid"),
            ("other", "paid"),
            *[(f"tenant{i}", "paid") for i in range(16)],
        ]
    }
    store.close()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "serve.log"
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
    with service(cmd, f"{url}/readyz", log, env=env, timeout=300, cwd=ROOT) as proc:
        yield {"url": url, "keys": keys, "log": log, "proc": proc, "home": home, "cfg": cfg}


def _h(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _chat(content: str, **kw) -> dict:
    return {"model": "tiny-chat", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


def _worker(server):
    return _find(server["proc"].pid, "_bentoml_impl.worker.service")


# ---------------------------------------------------------------------------------------


def test_oversized_bodies_are_refused_before_they_are_read(server):
    url, key = server["url"], server["keys"]["other"]
    worker = _worker(server)
    rss_before = worker.memory_info().rss
    t = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions",
        headers=_h(key),
        timeout=30,
        content=json.dumps(_chat("x" * (10 * 2**20))).encode(),
    )
    took = time.perf_counter() - t
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    assert took < 3.0, took

    # 100 MB announced, a few bytes sent: the answer comes from the header alone
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        t = time.perf_counter()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b'\r\nContent-Length: 104857600\r\n\r\n{"mod'
        )
        answer = b""
        while b"request_too_large" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:300]
        assert time.perf_counter() - t < 2.0

    ok = httpx.post(url + "/v1/chat/completions", headers=_h(key), json=_chat("hello"), timeout=30)
    assert ok.status_code == 200
    assert worker.memory_info().rss - rss_before < 100 * 2**20  # 10 MB refused: no copies kept


def test_a_prompt_longer_than_the_context_is_refused_at_once(server):
    url, key = server["url"], server["keys"]["other"]
    t = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", headers=_h(key), json=_chat("lorem ipsum " * 200_000), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert "characters" in r.json()["error"]["message"]
    assert time.perf_counter() - t < 3.0
    ids = httpx.post(
        url + "/v1/completions",
        headers=_h(key),
        timeout=60,
        json={"model": "tiny-chat", "prompt": [5] * 20_000, "max_tokens": 2},
    )
    assert ids.status_code == 400 and ids.json()["error"]["code"] == "context_length_exceeded"


def test_a_pii_heavy_prompt_fails_no_other_tenant(server):
    """100 KB dense with phone numbers, emails and cards (analysed in windows, in its own turn)
    beside 16 streams of other tenants whose prompts hold personal data too."""
    url, keys = server["url"], server["keys"]
    heavy = "".join(PII_LINE.format(100 + i % 90, i) for i in range(1100))
    assert len(heavy) > 100_000
    restarts_before = server["log"].read_text().count("restarted (start")

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:

            async def heavy_one():
                return await client.post(url + "/v1/chat/completions", headers=_h(keys["heavy"]), json=_chat(heavy))

            async def stream(i):
                body = _chat(PII_LINE.format(150 + i, i) + f"Question {i}: how are you?", stream=True, max_tokens=24)
                async with client.stream(
                    "POST", url + "/v1/chat/completions", headers=_h(keys[f"tenant{i}"]), json=body
                ) as r:
                    text = (await r.aread()).decode()
                return r.status_code, text

            started = time.perf_counter()
            results = await asyncio.gather(heavy_one(), *(stream(i) for i in range(16)))
            return results, time.perf_counter() - started

    (heavy_r, *streams), seconds = asyncio.run(main())
    for status, text in streams:
        assert status == 200 and '"error"' not in text and "[DONE]" in text, text[-500:]
        assert "212-555-" not in text  # their own PII never reaches their answers either
    assert heavy_r.status_code in (400, 503), heavy_r.text[:300]  # its own refusal, whichever comes first
    assert server["log"].read_text().count("restarted (start") == restarts_before  # the checks kept running
    print(f"\nheavy prompt: {heavy_r.status_code} {heavy_r.json()['error']['code']}; 16 streams in {seconds:.1f} s")


def test_one_tenant_takes_its_share_and_no_more(server):
    url, keys = server["url"], server["keys"]
    # 4 prompts x n=128: more generations than any key may hold at once, refused outright
    r = httpx.post(
        url + "/v1/completions",
        headers=_h(keys["hog"]),
        timeout=30,
        json={"model": "tiny-chat", "prompt": ["a", "b", "c", "d"], "n": 128, "max_tokens": 400},
    )
    assert r.status_code == 400 and "API key may hold" in r.json()["error"]["message"], r.text[:300]

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=128)) as client:

            async def hog(i):
                return await client.post(
                    url + "/v1/chat/completions",
                    headers=_h(keys["hog"]),
                    json=_chat(f"flood {i}", max_tokens=120, ignore_eos=True),
                )

            async def other(i):
                await asyncio.sleep(0.3)  # while the flood holds its share
                return await client.post(
                    url + "/v1/chat/completions",
                    headers=_h(keys["other"]),
                    json=_chat(f"my question {i}", max_tokens=4),
                )

            return await asyncio.gather(*(hog(i) for i in range(64)), *(other(i) for i in range(12)))

    results = asyncio.run(main())
    hogs, others = results[:64], results[64:]
    refused = [r for r in hogs if r.status_code == 429]
    assert 20 <= len(refused) <= 40, [r.status_code for r in hogs]  # its share: half of 64 places
    assert all("this API key holds" in r.json()["error"]["message"] for r in refused)
    assert [r.status_code for r in others] == [200] * 12, [r.text[:200] for r in others if r.status_code != 200]


def test_unknown_paths_neither_grow_metrics_nor_forge_log_lines(server):
    url = server["url"]
    before = httpx.get(url + "/metrics", timeout=30).text

    async def main():
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=32)) as client:
            sem = asyncio.Semaphore(32)

            async def one(i):
                async with sem:
                    # As real clients do (the openai SDK retries twice): a request sent on a kept-alive
                    # connection the server closed at that moment is sent again. uvicorn closes a
                    # connection idle 5 s, and under uvloop its timer runs before the read waiting
                    # beside it, so a server stalled that long by a loaded CI machine drops a request.
                    for attempt in range(3):
                        try:
                            return await client.get(f"{url}/probe-{i}%00%01x/{i * 7919}")
                        except (httpx.ReadError, httpx.RemoteProtocolError):
                            dropped.append(i)
                            if attempt == 2:
                                raise

            return await asyncio.gather(*(one(i) for i in range(2000)))

    dropped: list[int] = []
    statuses = {r.status_code for r in asyncio.run(main())}
    assert statuses == {404}, statuses
    assert len(dropped) <= 20, f"{len(dropped)} of 2000 connections dropped"  # a race, not a habit
    after = httpx.get(url + "/metrics", timeout=30).text
    assert len(after) - len(before) < 50_000, (len(before), len(after))
    assert "\x00" not in after and "probe-" not in after and "/{unknown}" in after

    forged = "FORGED-LINE tuneloop gave away the keys"
    r = httpx.get(url + "/x%0A" + forged.replace(" ", "%20") + "%0D%0A", timeout=30)
    assert r.status_code == 404
    time.sleep(1.0)
    lines = server["log"].read_text().splitlines()
    assert not any(line.startswith("FORGED-LINE") for line in lines)
    assert any("\\x0aFORGED-LINE" in line for line in lines)  # logged, escaped, on its own request's line


def test_a_killed_engine_is_restarted_and_liveness_stays_green(server):
    url, key = server["url"], server["keys"]["other"]
    engine = _find(server["proc"].pid, "tuneloop.serving.engine_process")
    assert engine is not None, [p.cmdline() for p in _processes(server["proc"].pid)]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:

            async def stream(i):
                body = _chat(f"tell me a long story {i}", stream=True, max_tokens=8000, ignore_eos=True)
                async with client.stream("POST", url + "/v1/chat/completions", headers=_h(key), json=body) as r:
                    return r.status_code, (await r.aread()).decode()

            tasks = [asyncio.ensure_future(stream(i)) for i in range(8)]
            await asyncio.sleep(1.0)
            engine.send_signal(signal.SIGKILL)
            killed = time.perf_counter()
            results = await asyncio.gather(*tasks)
            statuses = []
            back = None
            while time.perf_counter() - killed < 120:
                ready = (await client.get(url + "/readyz")).status_code
                live = (await client.get(url + "/livez")).status_code
                statuses.append((round(time.perf_counter() - killed, 1), ready, live))
                if ready == 200:
                    back = time.perf_counter() - killed
                    break
                refused = await client.post(url + "/v1/chat/completions", headers=_h(key), json=_chat("anyone?"))
                assert refused.status_code == 503 and "Retry-After" in refused.headers, refused.text
                await asyncio.sleep(0.5)
            answer = await client.post(url + "/v1/chat/completions", headers=_h(key), json=_chat("back?"))
            return results, statuses, back, answer

    results, statuses, back, answer = asyncio.run(main())
    for status, text in results:  # each ended cleanly: an error event, never a hang or a reset
        assert status == 200 and ("error" in text or "[DONE]" in text), text[-300:]
    assert any("error" in text for _, text in results)
    assert all(live == 200 for _, _, live in statuses), statuses  # liveness never failed: it recovers itself
    assert statuses[0][1] == 503, statuses  # readiness went red at once
    assert back is not None and back < 90, statuses
    assert answer.status_code == 200, answer.text
    print(f"\nengine killed: ready again after {back:.1f} s")


def test_sigterm_lets_the_stream_in_flight_finish_and_logs_it(server):
    """Last: it stops the server."""
    from tuneloop.requestlog.store import read_records

    url, key, proc = server["url"], server["keys"]["other"], server["proc"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:

            async def long_stream():
                body = _chat("a long answer please", stream=True, max_tokens=3000, ignore_eos=True)
                async with client.stream("POST", url + "/v1/chat/completions", headers=_h(key), json=body) as r:
                    return r.status_code, (await r.aread()).decode(), r.headers.get("x-request-id")

            task = asyncio.ensure_future(long_stream())
            await asyncio.sleep(1.5)
            proc.send_signal(signal.SIGTERM)  # bentoml serve, as Kubernetes stops the pod
            await asyncio.sleep(1.0)
            during = []
            for _ in range(3):
                try:
                    during.append((await client.get(url + "/readyz")).status_code)
                except httpx.TransportError:
                    during.append("closed")
                await asyncio.sleep(0.2)
            return await task, during

    (status, text, request_id), during = asyncio.run(main())
    assert status == 200 and '"finish_reason":"length"' in text and '"error"' not in text, text[-400:]
    assert all(s != 200 for s in during), during  # not ready while draining (or no longer listening)
    proc.wait(timeout=90)
    logged = {r["request_id"] for r in read_records(None, server["home"], "requests")}
    assert request_id in logged
