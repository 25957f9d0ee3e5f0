"""Files in an S3-compatible bucket (files.storage: s3://bucket/prefix):

    <prefix>/<owner folder>/<file id>.data   the content (boto3's managed upload: multipart
                                             when large), written first
    <prefix>/<owner folder>/<file id>.json   its metadata; the file exists once this does

An object is written whole or not at all (S3's PUT), so a reader never sees half a file.
Uploads are staged in a local folder (<home>/files-s3-staging) while they arrive and are
checked. The endpoint is files.s3_endpoint_url, else boto3's own (AWS_ENDPOINT_URL, then
AWS); credentials and region as boto3 finds them. A list reads each of the owner's metadata
objects (at most files.max_files_per_owner of them).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, cast

from tuneloop.files.store import FilesError, FileStore


def bucket_and_prefix(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not url.startswith("s3://") or not bucket:
        raise FilesError(f"files.storage {url!r}: expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


class S3FileStore(FileStore):
    def __init__(
        self,
        url: str,
        staging: Path,
        max_upload_bytes: int,
        max_files_per_owner: int,
        endpoint_url: str | None = None,
    ):
        import boto3
        from botocore.config import Config

        self.url = url
        self.bucket, self.prefix = bucket_and_prefix(url)
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5, read_timeout=60),
        )
        super().__init__(staging, max_upload_bytes, max_files_per_owner)

    def __str__(self) -> str:
        return self.url

    def _key(self, folder: str, name: str) -> str:
        return f"{self.prefix}/{folder}/{name}" if self.prefix else f"{folder}/{name}"

    def _put(self, folder: str, file_id: str, staged: Path, meta: dict) -> None:
        self.client.upload_file(str(staged), self.bucket, self._key(folder, f"{file_id}.data"))
        staged.unlink()
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._key(folder, f"{file_id}.json"),
            Body=json.dumps(meta, ensure_ascii=False).encode(),
            ContentType="application/json",
        )

    def _meta(self, folder: str, file_id: str) -> dict | None:
        return self._read_meta(self._key(folder, f"{file_id}.json"))

    def _read_meta(self, key: str) -> dict | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        return json.loads(body)

    def _metas(self, folder: str) -> list[dict]:
        out = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(folder, "file-")):
            for obj in page.get("Contents", []):
                if obj["Key"].endswith(".json"):
                    meta = self._read_meta(obj["Key"])
                    if meta is not None:  # None: deleted while listing
                        out.append(meta)
        return out

    def _remove(self, folder: str, file_id: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(folder, f"{file_id}.json"))
        self.client.delete_object(Bucket=self.bucket, Key=self._key(folder, f"{file_id}.data"))

    def _content(self, folder: str, file_id: str) -> BinaryIO:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(folder, f"{file_id}.data"))["Body"]
        except self.client.exceptions.NoSuchKey:
            raise FilesError(f"{file_id}: its metadata is stored and its content is missing") from None
        return cast(BinaryIO, body)  # botocore's StreamingBody: read(n), close()

    @contextmanager
    def _local(self, folder: str, file_id: str) -> Iterator[Path]:
        with self.staged() as path:
            self.client.download_file(self.bucket, self._key(folder, f"{file_id}.data"), str(path))
            yield path
