"""The request log (tuneloop/requestlog), in-process over a live engine.

Under concurrent load every finished request (ok, refused, invalid, streamed, cached,
left by its client) is logged exactly once with what it was (logged == served); texts are
redacted (by the gateway, else by the writer) and nothing of a key is written; a database
that fails spills to local segments; a crash-cut line is skipped; feedback is stored with
the log; `tuneloop logs tail|export` read it back. The same through `bentoml serve` with
SIGTERM: test_gateway_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support import ROOT
from tests.support.gateway import PLANTED, PLANTED_TEXT, ScriptedModel, assert_clean, bearer, gateway_config
from tests.support.serving import make_server, raw


def run_logged(loaded, cfg, test, backend=None):
    """`await test(app, gateway, request_log)` with the gateway and the request log of cfg."""
    from tuneloop.api.app import create_app
    from tuneloop.gateway.pipeline import Gateway
    from tuneloop.requestlog.writer import open_request_log
    from tuneloop.serving.continuous_engine import ContinuousEngine

    async def main():
        engine = backend
        if engine is None:
            engine = ContinuousEngine(loaded, num_blocks=64, page_size=32, max_batch_tokens=256)
        engine.launch() if hasattr(engine, "launch") else None
        g = Gateway.from_config(cfg, load_classifier=False)
        request_log = open_request_log(cfg, g.pii)
        app = create_app()
        app.state.gateway, app.state.request_log = g, request_log
        app.state.server = make_server(loaded, engine)
        try:
            return await test(app, g, request_log)
        finally:
            if hasattr(engine, "stop"):
                engine.stop()
            await g.close()
            request_log.close()

    return asyncio.run(main())


def logged(cfg, stream="requests") -> list[dict]:
    from tuneloop.requestlog.store import read_records

    return read_records(cfg.request_log.url, cfg.home, stream)


def make_key(cfg, tier="enterprise") -> tuple[str, str]:
    from tuneloop.gateway.keys import open_key_store

    store = open_key_store(cfg)
    try:
        record, key = store.create("log-test", tier)
        return key, record.id
    finally:
        store.close()


def as_logged(rec: dict, texts: list[str]) -> bool:
    """The record holds the texts the client got, or, where the log's writer redacted them (a
    sampled answer of the tiny model may look like personal data: CI's 'ck.etD' was taken for a
    URL), a redaction of each: the same text before the first placeholder and after the last."""
    if rec["completions"] == texts:
        return True
    if not rec["completion_redacted"] or len(rec["completions"]) != len(texts):
        return False
    for logged_text, text in zip(rec["completions"], texts):
        parts = re.split(r"<[A-Z_]+>", logged_text)
        if len(parts) < 2 or not (text.startswith(parts[0]) and text.endswith(parts[-1])):
            return False
    return True


def test_every_request_is_logged_exactly_once_under_concurrent_load(loaded, tmp_path):
    # one key sends all 96: no fair share to keep for other tenants here (admission.py)
    cfg = gateway_config(tmp_path, cache={"enabled": True}, max_share_per_key=1.0)
    key, key_id = make_key(cfg)

    async def test(app, g, request_log):
        client = raw(app)
        h = bearer(key)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
        kinds = []

        async def one(i: int):
            kind = ("chat", "stream", "completion", "invalid", "badkey", "cached", "models", "sampled")[i % 8]
            if kind == "chat":
                r = await client.post("/v1/chat/completions", json={**chat, "temperature": 0.7}, headers=h)
            elif kind == "stream":
                r = await client.post(
                    "/v1/chat/completions",
                    headers=h,
                    json={**chat, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5},
                )
            elif kind == "completion":
                r = await client.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": f"n{i}", "max_tokens": 3, "temperature": 0.9},
                    headers=h,
                )
            elif kind == "invalid":
                r = await client.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1}, headers=h
                )
            elif kind == "badkey":
                r = await client.get("/v1/models", headers=bearer("tl-000000000000_nope"))
            elif kind == "cached":
                r = await client.post("/v1/chat/completions", json={**chat, "temperature": 0}, headers=h)
            elif kind == "models":
                r = await client.get("/v1/models", headers=h)
            else:
                r = await client.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "s", "max_tokens": 2, "seed": i}, headers=h
                )
            kinds.append((kind, r))

        await one(5)  # a deterministic answer in the cache first: the burst's copies of it hit
        await asyncio.gather(*(one(i) for i in range(96) if i != 5))
        await client.aclose()
        request_log.flush()
        return kinds

    served = run_logged(loaded, cfg, test)
    records = logged(cfg)
    by_id = {}
    for r in records:
        assert r["request_id"] not in by_id, "a request was logged twice"
        by_id[r["request_id"]] = r
    assert len(records) == len(served) == 96
    for kind, resp in served:
        rec = by_id[resp.headers["x-request-id"]]
        assert rec["status"] == resp.status_code, (kind, rec)
        assert rec["route"] == resp.request.url.path
        if kind == "badkey":
            assert rec["status"] == 401 and rec["error_code"] == "invalid_api_key" and rec["key_id"] is None
            continue
        assert rec["key_id"] == key_id and rec["model"] == "tiny" and rec["model_version"] == "3"
        if kind == "invalid":
            assert rec["status"] == 400 and rec["error_type"] == "invalid_request_error"
            continue
        if kind == "models":
            continue
        if kind == "stream":
            usage = [
                json.loads(line[5:])
                for line in resp.text.splitlines()
                if line.startswith("data: {") and '"usage":{' in line
            ][-1]["usage"]
            text = "".join(
                json.loads(line[5:])["choices"][0]["delta"].get("content", "")
                for line in resp.text.splitlines()
                if line.startswith("data: {") and '"choices":[{' in line
            )
            assert rec["stream"] is True and as_logged(rec, [text]), rec
        else:
            body = resp.json()
            usage = body["usage"]
            assert rec["response_id"] == body["id"]
            texts = [c.get("text", c.get("message", {}).get("content")) for c in body["choices"]]
            assert as_logged(rec, texts), rec
        assert rec["prompt_tokens"] == usage["prompt_tokens"]
        assert rec["completion_tokens"] == usage["completion_tokens"]
        assert rec["latency_s"] > 0 and rec["engine"] == "continuous"
        if kind != "cached" or rec["cache"] == "miss":
            assert rec["ttft_s"] is not None and 0 < rec["ttft_s"] <= rec["latency_s"]
    cached = [by_id[r.headers["x-request-id"]]["cache"] for k, r in served if k == "cached"]
    assert cached.count("hit") >= 1 and set(cached) <= {"hit", "miss"}
    assert {by_id[r.headers["x-request-id"]]["cache"] for k, r in served if k == "sampled"} == {"miss"}
    # nothing of the key itself is written anywhere
    for path in (tmp_path / "requests").glob("*.jsonl"):
        assert key not in path.read_text() and key.split("_", 1)[1] not in path.read_text()


def test_the_logs_own_cpu_is_counted_by_part(loaded, tmp_path):
    """tuneloop_request_log_cpu_seconds_total{part}: what the log costs the server (the serving
    benchmark reports its share of the server's CPU): the records' making and hand-over on the
    event loop, the writer, and the redaction process's start-up (the gateway's PII is off here,
    so the writer has every text redacted there)."""
    import prometheus_client as prom

    from tuneloop.requestlog.writer import RequestLogMetrics

    cfg = gateway_config(tmp_path, pii={"mode": "off", "outputs": "off"})
    key, _ = make_key(cfg)
    registry = prom.CollectorRegistry()

    async def test(app, g, request_log):
        request_log.metrics = RequestLogMetrics(registry)
        client = raw(app)
        for i in range(12):
            r = await client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": f"mail me at a{i}@corp.io", "max_tokens": 3},
                headers=bearer(key),
            )
            assert r.status_code == 200
        await client.aclose()
        assert request_log.flush() == 12

    run_logged(loaded, cfg, test)
    spent = {
        part: registry.get_sample_value("tuneloop_request_log_cpu_seconds_total", {"part": part})
        for part in ("requests", "writer", "redactor_start")
    }
    assert all(v is not None and v > 0 for v in spent.values()), spent
    # (the redaction itself, part redactor, counts the child's clock ticks of 10 ms: possibly none for 12 texts)
    assert all("@corp.io" not in str(r["prompt"]) for r in logged(cfg))


def test_logged_texts_are_redacted_by_the_gateway_or_else_by_the_writer(loaded, tmp_path):
    answer = "Sure! " + PLANTED_TEXT + " Anything else?"
    items = [f"My {k} is {v}." for k, v in PLANTED.items()]
    first, second = " ".join(items[:4]), " ".join(items[4:])  # each fits the tiny model's context
    for pii in ({"mode": "redact", "outputs": "redact"}, {"mode": "off", "outputs": "off"}):
        home = tmp_path / pii["mode"]
        cfg = gateway_config(home, auth="off", pii=pii)
        model = ScriptedModel(loaded.tokenizer, answer)

        async def test(app, g, request_log):
            client = raw(app)
            r1 = await client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": first}], "stream": True},
            )
            r2 = await client.post("/v1/completions", json={"model": "tiny", "prompt": second})
            r3 = await client.post("/v1/moderations", json={"input": ["fine", PLANTED_TEXT]})
            await client.aclose()
            return [r1, r2, r3]

        responses = run_logged(loaded, cfg, test, backend=model)
        assert [r.status_code for r in responses[:2]] == [200, 200]
        records = logged(cfg)
        assert len(records) == 3
        text = "\n".join(p.read_text() for p in (home / "requests").glob("*.jsonl"))
        assert_clean(text, f"the request log (gateway pii {pii})")
        chat = next(r for r in records if r["route"] == "/v1/chat/completions")
        assert "<EMAIL_ADDRESS>" in chat["prompt"][0]["content"] and "Anything else?" in chat["completions"][0]
        assert chat["prompt_redacted"] and chat["completion_redacted"]
        if pii["mode"] == "redact":
            assert "EMAIL_ADDRESS" in chat["pii_entities"]


def test_a_cache_hit_is_logged_as_its_miss_was_without_analysing_it_again(loaded, tmp_path):
    """The cache entry keeps the prompt as the gateway redacted it (same request, same policy:
    the key carries both), so a hit's record carries the same redacted prompt and entities as
    the miss's, with no PII analysis of the prompt or of the answer in the log's writer."""
    answer = "Sure! " + PLANTED_TEXT + " Anything else?"
    prompt = " ".join(f"My {k} is {v}." for k, v in list(PLANTED.items())[:4])
    cfg = gateway_config(tmp_path, auth="off", pii={"mode": "redact", "outputs": "redact"}, cache={"enabled": True})
    model = ScriptedModel(loaded.tokenizer, answer)

    async def test(app, g, request_log):
        client = raw(app)
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "temperature": 0}
        out = [
            await client.post("/v1/chat/completions", json={**body, "stream": stream}) for stream in (True, True, False)
        ]
        await client.aclose()
        return out

    responses = run_logged(loaded, cfg, test, backend=model)
    assert [r.headers["x-cache"] for r in responses] == ["miss", "hit", "hit"]
    records = {r["request_id"]: r for r in logged(cfg)}
    miss, *hits = [records[r.headers["x-request-id"]] for r in responses]
    assert_clean("\n".join(p.read_text() for p in (tmp_path / "requests").glob("*.jsonl")), "the request log")
    assert "<EMAIL_ADDRESS>" in miss["prompt"][0]["content"] and miss["pii_entities"]
    for hit in hits:
        assert hit["cache"] == "hit"
        assert hit["prompt"] == miss["prompt"] and hit["pii_entities"] == miss["pii_entities"]
        assert hit["prompt_redacted"] and hit["completion_redacted"]
        assert hit["completions"] == miss["completions"]


def test_texts_are_omitted_when_no_redaction_can_run(loaded, tmp_path):
    from tuneloop.requestlog.store import SegmentSink
    from tuneloop.requestlog.writer import RequestLog

    def broken():
        raise RuntimeError("no analyzer here")

    sink = SegmentSink(tmp_path / "log", 1 << 20, 3600)
    request_log = RequestLog(sink, 0.05, "redacted", broken)
    request_log.submit(
        {
            "kind": "request",
            "request_id": "req_1",
            "time": "2026-12-01T00:00:00.000Z",
            "prompt": PLANTED_TEXT,
            "completions": [PLANTED_TEXT],
        }
    )
    request_log.close()
    (rec,) = [json.loads(line) for p in (tmp_path / "log").glob("*.jsonl") for line in p.read_text().splitlines()]
    assert rec["prompt"] is None and rec["completions"] is None and "did not start" in rec["texts_omitted"]


def test_the_redaction_process_fails_closed_and_comes_back(tmp_path):
    from tuneloop.config import PiiConfig
    from tuneloop.requestlog.redactor_process import ProcessRedactor
    from tuneloop.requestlog.store import SegmentSink
    from tuneloop.requestlog.writer import RequestLog

    redactor = ProcessRedactor(PiiConfig().model_dump(mode="json"), str(tmp_path / "gateway"), "tl-")
    request_log = RequestLog(SegmentSink(tmp_path / "log", 1 << 20, 3600), 60, "redacted", lambda: redactor)
    request_log.warm_up()

    def rec(i):
        return {
            "kind": "request",
            "request_id": f"r{i}",
            "time": f"2026-12-01T00:00:0{i}.000Z",
            "prompt": [{"role": "user", "content": PLANTED_TEXT}],
            "completions": [PLANTED["email"]],
        }

    request_log.submit(rec(1))
    request_log.flush()
    first = redactor.guard.pid
    os.kill(first, signal.SIGKILL)  # a fault: the child dies between batches
    while redactor.guard.pid == first:
        time.sleep(0.01)
    request_log.submit(rec(2))
    request_log.flush()  # a new child answers this batch
    redactor.timeout_s = 0.001  # a fault: the child does not answer in time
    request_log.submit(rec(3))
    request_log.flush()
    redactor.timeout_s = 60
    request_log.close()
    records = {
        r["request_id"]: r
        for p in (tmp_path / "log").glob("*.jsonl")
        for r in map(json.loads, p.read_text().splitlines())
    }
    assert_clean(json.dumps(records), "the log")
    for i in ("r1", "r2"):
        assert "<EMAIL_ADDRESS>" in records[i]["prompt"][0]["content"] and records[i]["completions"] == [
            "<EMAIL_ADDRESS>"
        ]
    assert records["r3"]["prompt"] is None and records["r3"]["texts_omitted"] == "redaction failed"


def test_a_failing_database_spills_to_local_segments_and_nothing_is_lost(tmp_path):
    from tuneloop.requestlog.store import SegmentSink, SqlSink, read_records
    from tuneloop.requestlog.writer import RequestLog

    url = f"sqlite:///{tmp_path / 'log.db'}"
    sql = SqlSink(url)
    spill = SegmentSink(tmp_path / "spill", 1 << 20, 3600)
    request_log = RequestLog(sql, 0.05, "omit", None, spill)

    def rec(i):
        return {
            "kind": "request",
            "request_id": f"req_{i:032x}",
            "time": f"2026-12-01T00:00:{i:02d}.000Z",
            "status": 200,
        }

    for i in range(5):
        request_log.submit(rec(i))
    request_log.flush()
    good_write = sql.write
    sql.write = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("database went away"))  # a fault
    for i in range(5, 12):
        request_log.submit(rec(i))
    request_log.flush()
    sql.write = good_write
    request_log.submit(rec(12))
    request_log.close()
    in_db = read_records(url, tmp_path, "requests")
    spilled = read_records(str(tmp_path / "spill"), tmp_path, "requests")
    assert [r["request_id"] for r in in_db] == [rec(i)["request_id"] for i in (*range(5), 12)]
    assert [r["request_id"] for r in spilled] == [rec(i)["request_id"] for i in range(5, 12)]
    assert request_log.spilled == 7


def test_a_line_cut_by_a_crash_is_skipped_and_segments_rotate(tmp_path):
    from tuneloop.requestlog.store import SegmentSink, read_records

    sink = SegmentSink(tmp_path, max_bytes=300, max_age_s=3600)
    for i in range(10):
        sink.write(
            "requests",
            [{"kind": "request", "request_id": f"r{i}", "time": f"2026-12-01T00:00:{i:02d}.000Z", "pad": "x" * 80}],
        )
    sink.close()
    segments = sorted(tmp_path.glob("requests-*.jsonl"))
    assert len(segments) > 2
    with open(segments[-1], "a") as f:
        f.write('{"kind": "request", "request_id": "cut", "ti')  # the writer died mid-line
    assert [r["request_id"] for r in read_records(str(tmp_path), tmp_path)] == [f"r{i}" for i in range(10)]


def test_feedback_is_stored_with_the_log_and_bad_feedback_gets_400(loaded, tmp_path):
    cfg = gateway_config(tmp_path)
    key, key_id = make_key(cfg)
    other_key, _ = make_key(cfg)

    async def test(app, g, request_log):
        client = raw(app)
        h = bearer(key)
        r = await client.post(
            "/v1/chat/completions",
            headers=h,
            json={"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 3},
        )
        rid, body_id = r.headers["x-request-id"], r.json()["id"]
        ok1 = await client.post(
            "/v1/feedback",
            headers=h,
            json={"request_id": rid, "rating": -1, "correction": "4", "comment": "mail me at a@b.com"},
        )
        ok2 = await client.post("/v1/feedback", headers=h, json={"request_id": body_id, "rating": 1})
        import httpx
        import openai

        official = openai.AsyncOpenAI(
            base_url="http://test/v1",
            api_key=key,
            max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test"),
        )
        via_sdk = await official.post("/feedback", body={"request_id": rid, "rating": 0}, cast_to=object)
        assert via_sdk["object"] == "feedback" and via_sdk["id"].startswith("fb_")  # the README's SDK call
        bad = [
            await client.post("/v1/feedback", headers=h, json=b)
            for b in (
                {"request_id": rid},
                {"request_id": "nope", "rating": 1},
                {"request_id": rid, "rating": 5},
                {"request_id": rid, "correction": ""},
                {"request_id": rid, "rating": 1, "extra": 1},
            )
        ]
        anon = await client.post("/v1/feedback", json={"request_id": rid, "rating": 1})
        stranger = await client.post(
            "/v1/feedback", headers=bearer(other_key), json={"request_id": rid, "correction": "five"}
        )
        assert stranger.status_code == 200  # accepted, but it never becomes training data (below)
        app.state.request_log = None
        off = await client.post("/v1/feedback", headers=h, json={"request_id": rid, "rating": 1})
        app.state.request_log = request_log
        await client.aclose()
        return rid, body_id, ok1, ok2, bad, anon, off

    rid, body_id, ok1, ok2, bad, anon, off = run_logged(loaded, cfg, test)
    assert ok1.status_code == ok2.status_code == 200
    assert ok1.json()["object"] == "feedback" and ok1.json()["request_id"] == rid
    assert [b.status_code for b in bad] == [400] * 5
    assert all(b.json()["error"]["type"] == "invalid_request_error" for b in bad)
    assert anon.status_code == 401 and off.status_code == 404
    fb = logged(cfg, "feedback")
    assert [(f["request_id"], f["rating"], f["key_id"]) for f in fb][:2] == [(rid, -1, key_id), (body_id, 1, key_id)]
    assert fb[0]["correction"] == "4" and "a@b.com" not in fb[0]["comment"]
    requests = logged(cfg)
    assert {r["route"] for r in requests} == {"/v1/chat/completions", "/v1/feedback"}
    # corrections -> candidate training rows in the training set's format, with lineage
    from tuneloop.data.dataset import prepare_dataset
    from tuneloop.requestlog.feedback import export_feedback_dataset

    lineage = export_feedback_dataset(cfg, tmp_path / "fb" / "rows.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "fb" / "rows.jsonl").read_text().splitlines()]
    assert rows == [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    assert lineage["feedback_ids"] == [fb[0]["feedback_id"]]
    assert lineage["rejected"] == {"no correction (rating only)": 2, "from another key than the request": 1}
    prepared = prepare_dataset(cfg, train_path=tmp_path / "fb" / "rows.jsonl", eval_path=tmp_path / "fb" / "rows.jsonl")
    assert len(prepared.train) == 1 and not prepared.rejects


def test_logs_cli_tails_and_exports(tmp_path):
    from tuneloop.requestlog.store import SegmentSink

    sink = SegmentSink(tmp_path / "home" / "requests", 1 << 20, 3600)
    from datetime import datetime, timedelta, timezone

    now = datetime.now(timezone.utc)
    rows = [
        {
            "kind": "request",
            "request_id": f"req_{i:032x}",
            "status": 200 if i % 3 else 500,
            "route": "/v1/x",
            "time": (now - timedelta(minutes=95 - 10 * i)).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        }
        for i in range(9)
    ]
    sink.write("requests", rows)
    sink.close()
    env = {"TUNELOOP_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "COLUMNS": "240"}

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "tuneloop.cli", "logs", *args], capture_output=True, text=True, cwd=ROOT, env=env
        )

    tail = cli("tail", "-n", "3", "--json")
    assert tail.returncode == 0, tail.stderr
    assert [json.loads(line)["request_id"] for line in tail.stdout.splitlines()] == [r["request_id"] for r in rows[-3:]]
    human = cli("tail", "-n", "2")
    assert rows[-1]["request_id"] in human.stdout and "/v1/x" in human.stdout
    out = tmp_path / "last-hour.parquet"
    exp = cli("export", "--since", "1h", "--format", "parquet", "--output", str(out))
    assert exp.returncode == 0, exp.stderr
    import pandas as pd

    frame = pd.read_parquet(out)
    assert sorted(frame["request_id"]) == sorted(
        r["request_id"]
        for r in rows
        if r["time"] >= (now - timedelta(hours=1)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )
    bad = cli("export", "--since", "yesterday-ish")
    assert bad.returncode == 2 and "not a duration" in bad.stderr


@pytest.fixture
def s3_server(tmp_path, monkeypatch):
    """An S3-compatible server on 127.0.0.1 in its own process (moto's server: no MinIO
    package here), a bucket, and boto3 pointed at it through the standard environment."""
    import boto3

    from tests.support.servers import free_port, service

    port = free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with service(cmd, f"http://127.0.0.1:{port}/moto-api/", tmp_path / "s3.log", timeout=60):
        for k, v in {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(k, v)
        client = boto3.client("s3")
        client.create_bucket(Bucket="logs")
        yield client


def test_an_s3_bucket_gets_every_segment_once_closed_and_a_failed_upload_is_retried(s3_server, tmp_path):
    import os

    from tuneloop.requestlog.store import open_sink, read_records
    from tuneloop.requestlog.writer import RequestLog

    url, home = "s3://logs/tuneloop/requests", tmp_path / "home"
    sink = open_sink(url, home, segment_max_bytes=400, segment_max_age_s=3600)
    request_log = RequestLog(sink, 0.05, "omit", None, None)

    def rec(i):
        return {
            "kind": "request",
            "request_id": f"req_{i:032x}",
            "time": f"2026-12-01T00:00:{i:02d}.000Z",
            "status": 200,
            "pad": "x" * 60,
        }

    def keys():
        return [o["Key"] for o in s3_server.list_objects_v2(Bucket="logs").get("Contents", [])]

    for i in range(10):
        request_log.submit(rec(i))
        request_log.flush()
    assert len(keys()) >= 2 and all(k.startswith("tuneloop/requests/requests-") for k in keys())
    # readers see the bucket plus what is still staged here, each record once
    assert [r["request_id"] for r in read_records(url, home)] == [rec(i)["request_id"] for i in range(10)]

    uploaded = len(keys())
    good_put = sink._client.put_object
    sink._client.put_object = lambda **kw: (_ for _ in ()).throw(ConnectionError("bucket unreachable"))  # a fault
    for i in range(10, 16):
        request_log.submit(rec(i))
        request_log.flush()
    assert len(keys()) == uploaded  # nothing went up, nothing was lost: it is staged
    assert [r["request_id"] for r in read_records(url, home)] == [rec(i)["request_id"] for i in range(16)]
    sink._client.put_object = good_put
    request_log.submit(rec(16))
    request_log.close()  # shutdown: the open segment goes up too
    assert not list((home / "requests-s3-staging").glob("*.jsonl"))
    assert [r["request_id"] for r in read_records(url, home)] == [rec(i)["request_id"] for i in range(17)]

    # a segment a crashed process (gone pid) left staged goes up when the next writer starts
    from tuneloop.requestlog.record import HOST

    dead = 2**22 + 7
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
    orphan = home / "requests-s3-staging" / f"requests-20261201T000100000000Z-{HOST}-{dead}-1.jsonl"
    orphan.write_text(json.dumps(rec(40)) + "\n" + '{"kind": "request", "cut')
    open_sink(url, home).close()
    assert not orphan.exists()
    assert [r["request_id"] for r in read_records(url, home)][-1] == rec(40)["request_id"]


def test_preference_feedback_becomes_dpo_pairs(loaded, tmp_path):
    """POST /v1/feedback with a `preference` (chosen, rejected) for a logged chat request is
    validated, stored redacted with the log, and exported with corrections and ratings as
    preference pairs in OpenAI's DPO format: only from the key that made the request."""
    cfg = gateway_config(tmp_path)
    key, key_id = make_key(cfg)
    other_key, _ = make_key(cfg)

    async def test(app, g, request_log):
        client = raw(app)
        h = bearer(key)

        async def chat(content: str, **sampling) -> str:
            r = await client.post(
                "/v1/chat/completions",
                headers=h,
                json={"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **sampling},
            )
            assert r.status_code == 200
            return r.headers["x-request-id"]

        asked = await chat("2+2?", temperature=0)
        rated = [await chat("Name a colour.", temperature=1.0, seed=s) for s in (1, 2)]

        async def feedback(body: dict, as_key: str = key):
            return await client.post("/v1/feedback", headers=bearer(as_key), json=body)

        pref = {"chosen": "4, mail a@b.com", "rejected": "5"}
        ok = [
            await feedback({"request_id": asked, "preference": pref}),
            await feedback({"request_id": asked, "correction": "Four."}),
            await feedback({"request_id": rated[0], "rating": 1}),
            await feedback({"request_id": rated[1], "rating": -1}),
            await feedback({"request_id": asked, "preference": {"chosen": "six", "rejected": "7"}}, other_key),
        ]
        bad = [
            await feedback(b)
            for b in (
                {"request_id": asked, "preference": {"chosen": "same", "rejected": "same"}},
                {"request_id": asked, "preference": {"chosen": "4"}},
                {"request_id": asked, "preference": {"chosen": "", "rejected": "5"}},
                {"request_id": asked, "preference": {"chosen": "4", "rejected": "5", "extra": 1}},
            )
        ]
        await client.aclose()
        request_log.flush()
        return asked, rated, ok, bad

    asked, rated, ok, bad = run_logged(loaded, cfg, test)
    assert [r.status_code for r in ok] == [200] * 5
    assert [b.status_code for b in bad] == [400] * 4
    assert "nothing to prefer" in bad[0].json()["error"]["message"]
    stored = logged(cfg, "feedback")
    assert (
        stored[0]["rejected"] == "5"
        and stored[0]["chosen"].startswith("4, mail ")
        and "a@b.com" not in stored[0]["chosen"]
    )

    requests = {r["request_id"]: r for r in logged(cfg)}
    answer = requests[asked]["completions"][0]
    colours = [requests[r]["completions"][0] for r in rated]
    assert answer.strip() and colours[0] != colours[1]  # what the tiny model wrote: a pair to make

    from tuneloop.data.formats import load_file
    from tuneloop.requestlog.feedback import export_preference_dataset

    out = tmp_path / "prefs" / "pairs.jsonl"
    lineage = export_preference_dataset(cfg, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]

    def row(prompt: str, chosen: str, rejected: str) -> dict:
        return {
            "input": {"messages": [{"role": "user", "content": prompt}]},
            "preferred_output": [{"role": "assistant", "content": chosen}],
            "non_preferred_output": [{"role": "assistant", "content": rejected}],
        }

    assert rows == [
        row("2+2?", stored[0]["chosen"], "5"),  # the preference, as stored (redacted)
        row("2+2?", "Four.", answer),  # the correction preferred to the answer it corrects
        row("Name a colour.", colours[0], colours[1]),  # the rating +1 answer over the -1 one
    ]
    assert lineage["sources"] == {"preference": 1, "correction": 1, "ratings": 1}
    assert lineage["rejected"] == {"from another key than the request": 1}
    assert len(lineage["feedback_ids"]) == 4
    loaded_back = load_file(out)  # the file meets the data contract: a preference tuning file
    assert loaded_back.format == "dpo" and len(loaded_back.examples) == 3 and not loaded_back.rejects


def test_a_choice_that_stops_at_its_first_token_still_has_a_time_to_first_token(loaded, tmp_path):
    """A sampled answer may open with a stop token (no text, zero completion tokens): the model
    still produced a first token, so the record's ttft_s is set (CI once saw it None under load).
    The stop token is forced here with logit_bias."""
    cfg = gateway_config(tmp_path, auth="off")
    stop = min(loaded.stop_ids)

    async def test(app, g, request_log):
        client = raw(app)
        out = [
            await client.post(
                "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": "hi",
                    "max_tokens": 4,
                    "stream": stream,
                    "logit_bias": {str(stop): 100},
                },
            )
            for stream in (False, True)
        ]
        await client.aclose()
        request_log.flush()
        return out

    responses = run_logged(loaded, cfg, test)
    records = {r["request_id"]: r for r in logged(cfg)}
    for resp in responses:
        assert resp.status_code == 200
        rec = records[resp.headers["x-request-id"]]
        assert rec["completion_tokens"] == 0 and rec["completions"] == [""], rec
        assert rec["ttft_s"] is not None and 0 < rec["ttft_s"] <= rec["latency_s"]
