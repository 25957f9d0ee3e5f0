"""The Files API's S3 backend (tuneloop/files/s3.py) against a real S3-compatible server on
127.0.0.1 (moto's server in its own process): the store's whole interface, files kept across
instances, owners kept apart, and the SDK's upload / list / content / delete through the app
with the bucket behind it."""

from __future__ import annotations

import asyncio
import json
import sys
from contextlib import ExitStack
from types import SimpleNamespace

import openai
import pytest

from tests.support.servers import free_port, service
from tests.support.serving import make_server, sdk
from tuneloop.api.app import create_app
from tuneloop.config import TuneloopConfig
from tuneloop.data.formats import load_file
from tuneloop.files import ANONYMOUS, FileNotFound, open_file_store
from tuneloop.files.s3 import S3FileStore
from tuneloop.files.store import TooManyFiles, owner_folder

BUCKET = "tuneloop-files"


def rows(n: int, start: int = 0) -> bytes:
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})
        + "\n"
        for i in range(start, start + n)
    ).encode()


@pytest.fixture
def s3(tmp_path, monkeypatch):
    """moto's S3 server on a free port, a bucket, and credentials in the environment; the
    endpoint is given to the store through files.s3_endpoint_url."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with ExitStack() as stack:
        try:
            stack.enter_context(service(cmd, f"{endpoint}/moto-api/", tmp_path / "s3.log", timeout=60))
        except Exception as exc:  # noqa: BLE001 - no S3 server here: nothing to test against
            pytest.skip(f"moto's S3 server could not start on 127.0.0.1 ({type(exc).__name__}: {str(exc)[:300]})")
        for k, v in {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # the store gets its endpoint from the config
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        yield SimpleNamespace(endpoint=endpoint, client=client)


def open_store(tmp_path, s3, max_files=100) -> S3FileStore:
    cfg = TuneloopConfig.model_validate(
        {
            "paths": {"home": str(tmp_path / "home")},
            "files": {
                "storage": f"s3://{BUCKET}/team-data/files",
                "s3_endpoint_url": s3.endpoint,
                "max_files_per_owner": max_files,
            },
        }
    )
    store = open_file_store(cfg)
    assert isinstance(store, S3FileStore)
    return store


def test_the_s3_store_keeps_files_per_owner_across_instances(tmp_path, s3):
    store = open_store(tmp_path, s3, max_files=2)
    team, other = "team:research", "team:sales"
    made = []
    for i in range(2):
        with store.staged() as path:
            path.write_bytes(rows(2, i))
            made.append(store.create(team, path, f"f{i}.jsonl", "fine-tune", "chat", 2))
            assert not path.exists()  # uploaded, gone from staging
    with store.staged() as path, pytest.raises(TooManyFiles):
        path.write_bytes(rows(1))
        store.create(team, path, "third.jsonl", "fine-tune")
    assert list(store.staging.iterdir()) == []

    keys = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket=BUCKET)["Contents"])
    folder = owner_folder(team)
    assert keys == sorted(f"team-data/files/{folder}/{f.id}.{ext}" for f in made for ext in ("data", "json"))

    again = open_store(tmp_path, s3)  # a restarted server, or a training job
    assert [f.id for f in again.list(team)] == [f.id for f in made]
    assert again.get(made[1].id, team) == made[1]
    with again.open(made[0].id, team) as fh:
        assert fh.read() == rows(2, 0)
    with again.path(made[1].id, team) as local:  # a downloaded copy for the loader
        assert [e.completion for e in load_file(local).examples] == ["a1", "a2"]
    assert not local.exists()
    for owner in (other, ANONYMOUS):
        assert again.list(owner) == []
        for call in (again.get, again.open, again.delete):
            with pytest.raises(FileNotFound):
                call(made[0].id, owner)

    assert again.delete(made[0].id, team).id == made[0].id
    with pytest.raises(FileNotFound):
        again.get(made[0].id, team)
    assert [f.id for f in again.list(team)] == [made[1].id]
    left = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket=BUCKET)["Contents"])
    assert left == sorted(f"team-data/files/{folder}/{made[1].id}.{ext}" for ext in ("data", "json"))


def test_the_sdk_uploads_to_the_bucket_through_the_api(loaded, tmp_path, s3):
    data = rows(3)

    async def main():
        app = create_app()
        app.state.files = open_store(tmp_path, s3)
        app.state.server = make_server(loaded, SimpleNamespace(engine="none"))
        client = sdk(app)
        made = await client.files.create(file=("train.jsonl", data), purpose="fine-tune")
        assert [f.id async for f in client.files.list()] == [made.id]
        assert (await client.files.content(made.id)).content == data
        with pytest.raises(openai.BadRequestError, match="bad.jsonl: no JSON object rows"):
            await client.files.create(file=("bad.jsonl", b"nope\n"), purpose="fine-tune")
        assert (await client.files.delete(made.id)).deleted
        return made.id

    file_id = asyncio.run(main())
    assert s3.client.list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0, file_id
