"""/v1/files, OpenAI's Files API for fine-tuning data, in process through the gateway's hooks:
the official SDK's create / list / retrieve / content / delete; a file seen only by keys of
its owner's scope (404 for everyone else, never 403); uploads checked against the data
contract (bad rows refused with their line numbers, non-JSONL refused, nothing kept);
uploads bounded by files.max_upload_bytes as they stream, not by serving.max_request_bytes;
pagination; files kept across store instances; the limit of files per owner."""

from __future__ import annotations

import asyncio
import json
import re
import tracemalloc
from types import SimpleNamespace

import openai
import pytest

from tests.support.gateway import bearer, gateway_config
from tests.support.serving import make_server, raw, sdk
from tuneloop.api.app import create_app
from tuneloop.data.formats import load_file
from tuneloop.files import ANONYMOUS, FileNotFound
from tuneloop.files.local import LocalFileStore
from tuneloop.files.store import owner_folder
from tuneloop.gateway.pipeline import Gateway

FILE_KEYS = {"id", "object", "bytes", "created_at", "filename", "purpose", "status", "expires_at", "status_details"}


def rows(n: int, start: int = 0, pad: str = "") -> bytes:
    """n chat rows in OpenAI's fine-tuning format, one a line."""
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}{pad}"}, {"role": "assistant", "content": f"a{i}"}]})
        + "\n"
        for i in range(start, start + n)
    ).encode()


class LogSink:
    """A request log that keeps what it is given (the records as the log would write them)."""

    def __init__(self):
        self.records: list[dict] = []

    def submit(self, record: dict) -> None:
        self.records.append(record)

    def account(self, seconds: float) -> None:
        pass


def run(loaded, tmp_path, test, cfg=None, max_upload_bytes=64 * 2**20, max_files=100, max_request_bytes=4 * 2**20):
    """`test(app, store, gateway)` against the app with a folder store (and the gateway when cfg)."""

    async def main():
        gateway = Gateway.from_config(cfg, load_classifier=False) if cfg is not None else None
        app = create_app(max_request_bytes=max_request_bytes)
        app.state.gateway, app.state.request_log = gateway, LogSink()
        app.state.files = store = LocalFileStore(tmp_path / "files", max_upload_bytes, max_files)
        app.state.server = make_server(loaded, SimpleNamespace(engine="none"))  # no generation here
        try:
            return await test(app, store, gateway)
        finally:
            if gateway is not None:
                await gateway.close()

    return asyncio.run(main())


def err(r) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    return body["error"]


def as_client(app, key: str):
    client = sdk(app)
    client.api_key = key
    return client


def test_files_through_the_sdk_are_seen_only_by_their_teams_keys(loaded, tmp_path):
    data = rows(3, pad=" marker-7f3a")  # a text that must never reach the log

    async def test(app, store, gateway):
        keys = {
            name: gateway.keys.create(name, "paid", team=team)[1]
            for name, team in [("alice", "research"), ("bob", "research"), ("eve", "sales"), ("mallory", None)]
        }
        alice, bob = as_client(app, keys["alice"]), as_client(app, keys["bob"])
        made = await alice.files.create(file=("train.jsonl", data), purpose="fine-tune")
        assert re.fullmatch(r"file-[0-9a-f]{32}", made.id)
        assert (made.object, made.bytes, made.filename, made.purpose, made.status, made.expires_at) == (
            "file",
            len(data),
            "train.jsonl",
            "fine-tune",
            "processed",
            None,
        )
        http = raw(app)
        r = await http.get(f"/v1/files/{made.id}", headers=bearer(keys["alice"]))
        assert set(r.json()) == FILE_KEYS and "x-ratelimit-remaining-requests" in r.headers  # behind the key's limits

        # The same team's other key: it is theirs too.
        assert (await bob.files.retrieve(made.id)).id == made.id
        assert [f.id async for f in bob.files.list()] == [made.id]
        assert (await bob.files.content(made.id)).content == data

        # Another team, and a key without a team: as if it did not exist (404, never 403).
        for outsider in ("eve", "mallory"):
            other = as_client(app, keys[outsider])
            for call in (other.files.retrieve, other.files.content, other.files.delete):
                with pytest.raises(openai.NotFoundError) as caught:
                    await call(made.id)
                assert caught.value.body["message"] == f"No such File object: {made.id}"
            assert [f async for f in other.files.list()] == []
        unknown = "file-" + "0" * 32
        r = await http.get(f"/v1/files/{unknown}", headers=bearer(keys["eve"]))
        assert r.status_code == 404 and err(r)["message"] == f"No such File object: {unknown}"  # the same answer
        r = await http.get(f"/v1/files/{made.id}")
        assert r.status_code == 401
        r = await http.post("/v1/files", files={"file": ("x.jsonl", data)}, data={"purpose": "fine-tune"})
        assert r.status_code == 401  # no key, no upload

        deleted = await bob.files.delete(made.id)
        assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "file", True)
        with pytest.raises(openai.NotFoundError):
            await alice.files.retrieve(made.id)

        # The log has each request (the key, the file's id), never the file's content.
        logged = app.state.request_log.records
        upload = next(r for r in logged if r["method"] == "POST" and r["route"] == "/v1/files")
        assert upload["status"] == 200 and upload["response_id"] == made.id and upload["tenant"] == "team:research"
        assert upload["prompt"] is None
        assert "marker-7f3a" not in json.dumps(logged)

    run(loaded, tmp_path, test, cfg=gateway_config(tmp_path))


def test_an_upload_with_bad_rows_is_refused_with_their_line_numbers_and_nothing_is_kept(loaded, tmp_path):
    good = rows(5).decode().splitlines()
    lines = good[:2] + ['{"messages": []}', "not json", ""] + [json.dumps({"prompt": "p"})] * 25 + good[2:]

    async def test(app, store, gateway):
        client = sdk(app)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="fine-tune")
        e = caught.value.body
        assert (e["param"], e["code"]) == ("file", "invalid_file")
        msg = e["message"]
        assert msg.startswith("bad.jsonl: 27 of 32 rows do not meet the data contract (chat format)"), msg
        assert "line 3: field 'messages' is empty" in msg and "line 4: invalid JSON" in msg
        assert "line 6: missing field 'messages'" in msg and "line 23:" in msg  # the 20th bad row
        assert "line 24:" not in msg and msg.endswith("; and 7 more")
        assert str(store.staging) not in msg  # the client's name for the file, not the server's path

        # A file with no usable row at all, and one that is wholly fine for another format.
        with pytest.raises(openai.BadRequestError, match="1 of 1 rows"):
            await client.files.create(file=("x.jsonl", b'{"messages": "hi"}\n'), purpose="fine-tune")
        legacy = b'{"prompt": "2+2=", "completion": " 4"}\n'
        assert (await client.files.create(file=("legacy.jsonl", legacy), purpose="fine-tune")).bytes == len(legacy)
        assert [f.filename async for f in client.files.list()] == ["legacy.jsonl"]
        assert list(store.staging.iterdir()) == []

    run(loaded, tmp_path, test)


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("train.jsonl", b"\xff\xfe{\x00", "train.jsonl:1: not UTF-8 text (byte 0xff at offset 0)"),
        ("data.csv", b"question,answer\nwhat,that\n", "data.csv: no JSON object rows to tell the format from"),
        ("empty.jsonl", b"", "empty.jsonl: empty file, no rows"),
        ("other.jsonl", b'{"text": "hello"}\n', "other.jsonl: unknown format: keys seen ['text']"),
    ],
)
def test_a_file_that_is_not_jsonl_training_data_is_refused(loaded, tmp_path, name, content, says):
    async def test(app, store, gateway):
        r = await raw(app).post("/v1/files", files={"file": (name, content)}, data={"purpose": "fine-tune"})
        assert r.status_code == 400, r.text
        assert err(r)["message"].startswith(says) and err(r)["param"] == "file", err(r)
        assert store.list(ANONYMOUS) == []

    run(loaded, tmp_path, test)


def test_the_form_is_checked_naming_the_field(loaded, tmp_path):
    async def test(app, store, gateway):
        http = raw(app)

        async def refused(param, data):
            r = await http.post("/v1/files", files={"file": ("t.jsonl", rows(1))}, data=data)
            assert r.status_code == 400, r.text
            assert err(r)["param"] == param, err(r)
            return err(r)["message"]

        assert "'batch' is not supported here" in await refused("purpose", {"purpose": "batch"})
        assert "you must provide 'purpose'" in await refused("purpose", {})
        r = await http.post("/v1/files", files={"purpose": (None, "fine-tune")})  # a form without a file part
        assert r.status_code == 400 and "you must provide 'file'" in err(r)["message"] and err(r)["param"] == "file"
        r = await http.post("/v1/files", files={"purpose": (None, "fine-tune"), "file": (None, "inline text")})
        assert r.status_code == 400 and err(r)["param"] == "file"  # a field, not a file part
        assert "do not expire" in await refused(
            "expires_after", {"purpose": "fine-tune", "expires_after[anchor]": "created_at"}
        )
        assert "Unrecognized" in await refused("colour", {"purpose": "fine-tune", "colour": "red"})
        r = await http.post("/v1/files", json={"purpose": "fine-tune"})  # not a form at all
        assert r.status_code == 400 and "multipart/form-data" in err(r)["message"] and err(r)["param"] == "file"
        for bad in ("file-123", "../../etc/passwd", "file-" + "g" * 32):
            r = await http.get(f"/v1/files/{bad}/content")
            assert r.status_code == 404, (bad, r.text)

    run(loaded, tmp_path, test)


def test_an_upload_is_bounded_by_its_own_limit_as_it_streams(loaded, tmp_path):
    limit = 1 << 20  # files.max_upload_bytes here; serving.max_request_bytes is 64 KiB

    async def test(app, store, gateway):
        client, http = sdk(app), raw(app)
        # Over the server's general body limit, within the files limit: taken.
        big = rows(4000, pad="x" * 60)
        assert 64 * 1024 < len(big) < limit
        assert (await client.files.create(file=("big.jsonl", big), purpose="fine-tune")).bytes == len(big)
        r = await http.post("/v1/embeddings", json={"model": "m", "input": "x" * 70_000})
        assert r.status_code == 413  # the other routes keep theirs

        # Declared over it: refused before a byte of it is read.
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=("huge.jsonl", rows(20_000, pad="x" * 60)), purpose="fine-tune")
        assert caught.value.status_code == 413 and "files.max_upload_bytes" in caught.value.body["message"]

        # Sent without a length (chunked), 32 MiB: refused once past the limit, never held whole.
        boundary, chunk, total, sent = "b0und4ry", b"x" * (64 * 1024), 32 << 20, 0
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="endless.jsonl"\r\n\r\n'
        ).encode()

        async def body():
            nonlocal sent
            yield head
            while sent < total:
                sent += len(chunk)
                yield chunk
            yield f"\r\n--{boundary}--\r\n".encode()

        tracemalloc.start()
        try:
            r = await http.post(
                "/v1/files", content=body(), headers={"content-type": f"multipart/form-data; boundary={boundary}"}
            )
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.status_code == 413, r.text
        assert "files.max_upload_bytes" in err(r)["message"] and err(r)["code"] == "request_too_large"
        assert sent <= limit + 64 * 1024 + 2 * len(chunk), sent  # the client was stopped near the limit
        assert peak < 8 << 20, peak  # the 32 MiB never in memory (Starlette spools past 1 MiB to disk)
        assert list(store.staging.iterdir()) == [] and [f.filename for f in store.list(ANONYMOUS)] == ["big.jsonl"]

    run(loaded, tmp_path, test, max_upload_bytes=limit, max_request_bytes=64 * 1024)


def test_the_list_pages_with_after_and_limit_in_either_order(loaded, tmp_path):
    async def test(app, store, gateway):
        client, http = sdk(app), raw(app)
        ids = [(await client.files.create(file=(f"f{i}.jsonl", rows(1, i)), purpose="fine-tune")).id for i in range(5)]
        assert ids == sorted(ids)  # ids sort as the files were made
        newest = ids[::-1]

        page = (await http.get("/v1/files", params={"limit": 2})).json()
        assert [f["id"] for f in page["data"]] == newest[:2]
        assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == (
            "list",
            newest[0],
            newest[1],
            True,
        )
        page = (await http.get("/v1/files", params={"limit": 2, "after": page["last_id"]})).json()
        assert [f["id"] for f in page["data"]] == newest[2:4] and page["has_more"]
        page = (await http.get("/v1/files", params={"limit": 2, "after": page["last_id"]})).json()
        assert [f["id"] for f in page["data"]] == newest[4:] and not page["has_more"]
        page = (await http.get("/v1/files", params={"order": "asc", "limit": 3, "after": ids[0]})).json()
        assert [f["id"] for f in page["data"]] == ids[1:4] and page["has_more"]

        # The SDK follows the pages itself; a deleted cursor still places the next page.
        assert [f.id async for f in client.files.list(limit=2)] == newest
        await client.files.delete(ids[2])
        assert [f.id async for f in client.files.list(after=ids[2], order="asc")] == ids[3:]
        assert [f async for f in client.files.list(purpose="batch")] == []
        empty = (await http.get("/v1/files", params={"purpose": "batch"})).json()
        assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}

        for params, param in (
            ({"limit": 0}, "limit"),
            ({"limit": 10_001}, "limit"),
            ({"limit": "ten"}, "limit"),
            ({"order": "sideways"}, "order"),
            ({"after": "nope"}, "after"),
        ):
            r = await http.get("/v1/files", params=params)
            assert r.status_code == 400 and err(r)["param"] == param, (params, r.text)

    run(loaded, tmp_path, test)


def test_files_persist_across_store_instances_and_an_owner_keeps_at_most_its_limit(loaded, tmp_path):
    async def test(app, store, gateway):
        client = sdk(app)
        kept = [await client.files.create(file=(f"f{i}.jsonl", rows(2, i)), purpose="fine-tune") for i in range(2)]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.files.create(file=("third.jsonl", rows(1)), purpose="fine-tune")
        assert caught.value.body["code"] == "files_limit_exceeded" and "max_files_per_owner" in str(caught.value)
        await client.files.delete(kept[0].id)
        kept.append(await client.files.create(file=("third.jsonl", rows(1)), purpose="fine-tune"))
        return [f.id for f in kept[1:]]

    ids = run(loaded, tmp_path, test, max_files=2)

    # A new store on the same folder (a restarted server, a training job) finds them.
    again = LocalFileStore(tmp_path / "files", 1 << 20, 2)
    found = again.list(ANONYMOUS)
    assert [f.id for f in found] == ids and [(f.format, f.rows) for f in found] == [("chat", 2), ("chat", 1)]
    with again.open(ids[0], ANONYMOUS) as fh:
        assert fh.read() == rows(2, 1)
    with again.path(ids[0], ANONYMOUS) as path:  # what a fine-tuning job hands to the loader
        assert [e.completion for e in load_file(path).examples] == ["a1", "a2"]
    for owner, file_id in (("team:other", ids[0]), (ANONYMOUS, "../" + ids[0]), (ANONYMOUS, "file-" + "1" * 32)):
        with pytest.raises(FileNotFound):
            again.get(file_id, owner)
    folder = tmp_path / "files" / owner_folder(ANONYMOUS)
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{i}.{ext}" for i in ids for ext in ("data", "json"))


def test_a_client_that_leaves_mid_upload_leaves_nothing_behind(loaded, tmp_path):
    async def test(app, store, gateway):
        boundary = "b0und4ry"
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="t.jsonl"\r\n\r\n'.encode()
        messages = [
            {"type": "http.request", "body": head + rows(50), "more_body": True},
            {"type": "http.disconnect"},
        ]
        sent: list[dict] = []

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/files",
            "raw_path": b"/v1/files",
            "query_string": b"",
            "headers": [(b"content-type", f"multipart/form-data; boundary={boundary}".encode())],
            "scheme": "http",
            "server": ("test", 80),
            "client": ("127.0.0.1", 1),
            "http_version": "1.1",
            "root_path": "",
        }
        await app(scope, receive, send)
        assert sent[0]["status"] == 499
        assert [r["status"] for r in app.state.request_log.records] == [499]
        assert list(store.staging.iterdir()) == [] and store.list(ANONYMOUS) == []

    run(loaded, tmp_path, test)
