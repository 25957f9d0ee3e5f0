"""Where request-log records go, and how people and flows read them back.

Two streams: `requests` (one record per finished /v1 request) and `feedback` (what
clients said about a request, POST /v1/feedback).

Sinks, named by `request_log.url`:
  None or a folder path / file:// URL  append-only JSON Lines segments, one writer per file
      (`<stream>-<UTC start>-<host>-<pid>-<n>.jsonl`), rotated by size and age; every
      batch is written, flushed and fsync'ed before the writer takes the next.
  s3://bucket/prefix  the same segments, staged locally and uploaded to an S3-compatible
      bucket when each one is closed (rotation, shutdown); readers list the bucket.
  a SQLAlchemy URL (sqlite:///..., postgresql+psycopg://...)  one table per stream
      (`tuneloop_requests`, `tuneloop_feedback`), a batch per transaction.
Readers take the same URL and merge whatever the writers (replicas, restarts) left.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

from tuneloop.requestlog.record import HOST

log = logging.getLogger(__name__)

STREAMS = ("requests", "feedback")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class LogError(Exception):
    """A request-log location or query that cannot be used; the message says why."""


def parse_since(value: str | None, now: datetime | None = None) -> datetime | None:
    """'15m', '2h', '7d' (before now) or an ISO 8601 time -> an aware UTC datetime."""
    if value is None or value == "":
        return None
    now = now or datetime.now(timezone.utc)
    m = _DURATION.match(value)
    if m:
        return now - timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise LogError(f"not a duration (e.g. 15m, 2h, 7d) or an ISO 8601 time: {value!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def record_time(record: dict) -> datetime:
    return datetime.fromisoformat(str(record.get("time", "")).replace("Z", "+00:00"))


def is_s3_url(url: str | None) -> bool:
    return bool(url) and url.startswith("s3://")


def is_sql_url(url: str | None) -> bool:
    return bool(url) and "://" in url and not url.startswith(("file://", "s3://"))


def _folder(url: str | None, home: Path) -> Path:
    if not url:
        return home / "requests"
    if url.startswith("file://"):
        return Path(url[len("file://") :])
    return Path(url).expanduser()


def open_sink(url: str | None, home: Path, segment_max_bytes: int = 64 << 20, segment_max_age_s: float = 3600):
    if is_s3_url(url):
        return S3Sink(url, home / "requests-s3-staging", segment_max_bytes, segment_max_age_s)
    if is_sql_url(url):
        return SqlSink(url)
    return SegmentSink(_folder(url, home), segment_max_bytes, segment_max_age_s)


def describe(url: str | None, home: Path) -> str:
    return _redact_url(url) if is_sql_url(url) or is_s3_url(url) else str(_folder(url, home))


def _redact_url(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


# ---------------------------------------------------------------------------------------
# JSON Lines segments


class SegmentSink:
    """Append-only JSONL segments in a folder; this process's own files only."""

    def __init__(self, folder: Path, max_bytes: int, max_age_s: float):
        self.folder = Path(folder)
        self.max_bytes, self.max_age_s = int(max_bytes), float(max_age_s)
        self._files: dict[str, tuple[Any, float, Path]] = {}  # stream -> (file, opened, path)
        self._seq = 0

    def _file(self, stream: str):
        current = self._files.get(stream)
        if current is not None:
            f, opened, path = current
            if f.tell() < self.max_bytes and time.monotonic() - opened < self.max_age_s:
                return f
            f.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        path = self.folder / f"{stream}-{stamp}-{HOST}-{os.getpid()}-{self._seq}.jsonl"
        f = open(path, "a", encoding="utf-8")
        self._files[stream] = (f, time.monotonic(), path)
        return f

    def write(self, stream: str, records: list[dict]) -> None:
        if not records:
            return
        f = self._file(stream)
        f.write("".join(json.dumps(r, ensure_ascii=False, separators=(",", ":"), default=str) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())

    def close(self) -> None:
        for f, _, _ in self._files.values():
            f.close()
        self._files.clear()

    def __str__(self) -> str:
        return str(self.folder)


def _segments(folder: Path, stream: str) -> list[Path]:
    return sorted(folder.glob(f"{stream}-*.jsonl"))


def _read_segment(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        yield from _parse_lines(f)


def _parse_lines(lines: Iterable[str]) -> Iterator[dict]:
    for line in lines:
        if not line.endswith("\n"):
            return  # a line cut short by a crash: the writer never finished it
        line = line.strip()
        if line:
            try:
                yield json.loads(line)
            except ValueError:
                continue


# ---------------------------------------------------------------------------------------
# S3-compatible bucket


def _bucket_and_prefix(url: str) -> tuple[str, str]:
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise LogError(f"request_log.url {url!r}: no bucket (s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def _s3_client():
    import boto3
    from botocore.config import Config

    # endpoint (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3), region and credentials as boto3 finds them
    return boto3.client(
        "s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5, read_timeout=30)
    )


class S3Sink(SegmentSink):
    """Segments staged in a local folder exactly as SegmentSink writes them (fsynced every
    flush: a crash loses at most one flush interval), each uploaded to s3://bucket/prefix/
    once it is closed: when it rotates (segment_max_mb / segment_max_age_s) and at shutdown.
    A failed upload leaves the file staged and is tried again at the next write; staged files
    of this host's processes that are gone (a crash) are uploaded at start. An object is
    written whole (one PUT), so a reader never sees half a segment."""

    def __init__(self, url: str, staging: Path, max_bytes: int, max_age_s: float):
        super().__init__(staging, max_bytes, max_age_s)
        self.url = url
        self.bucket, self.prefix = _bucket_and_prefix(url)
        self._client = _s3_client()
        self._upload_closed(include_dead=True)

    def _key(self, path: Path) -> str:
        return f"{self.prefix}/{path.name}" if self.prefix else path.name

    def _upload_closed(self, include_dead: bool = False) -> None:
        open_paths = {p for _, _, p in self._files.values()}
        for path in sorted(self.folder.glob("*.jsonl")) if self.folder.exists() else []:
            if path in open_paths:
                continue
            mine = _segment_owner(path) == (HOST, os.getpid())
            if not (mine or (include_dead and _owner_gone(path))):
                continue
            try:
                self._client.put_object(
                    Bucket=self.bucket, Key=self._key(path), Body=path.read_bytes(), ContentType="application/x-ndjson"
                )
            except Exception as exc:  # noqa: BLE001 - kept staged, tried again at the next write
                log.warning("request log: uploading %s to %s failed (kept, will retry): %s", path.name, self.url, exc)
                return
            path.unlink()

    def write(self, stream: str, records: list[dict]) -> None:
        super().write(stream, records)  # may rotate: the closed segment is uploaded next
        self._upload_closed()

    def close(self) -> None:
        super().close()
        self._upload_closed()

    def read(self, stream: str) -> Iterator[dict]:
        paginator = self._client.get_paginator("list_objects_v2")
        start = f"{self.prefix}/{stream}-" if self.prefix else f"{stream}-"
        for page in paginator.paginate(Bucket=self.bucket, Prefix=start):
            for obj in sorted(page.get("Contents", []), key=lambda o: o["Key"]):
                body = self._client.get_object(Bucket=self.bucket, Key=obj["Key"])["Body"].read().decode("utf-8")
                yield from _parse_lines(body.splitlines(keepends=True))
        for path in _segments(self.folder, stream):  # staged here, not uploaded yet
            yield from _read_segment(path)

    def __str__(self) -> str:
        return f"{self.url} (staged in {self.folder})"


class _S3Reader(S3Sink):
    """S3Sink's reading half: lists the bucket and this host's staged files, uploads nothing."""

    def __init__(self, url: str, home: Path):  # noqa: D107 - no SegmentSink state, no start-up upload
        self.url, self.folder, self._files = url, home / "requests-s3-staging", {}
        self.bucket, self.prefix = _bucket_and_prefix(url)
        self._client = _s3_client()


def _segment_owner(path: Path) -> tuple[str, int] | None:
    """(host, pid) from `<stream>-<stamp>-<host>-<pid>-<n>.jsonl`."""
    parts = path.stem.split("-")
    try:
        return "-".join(parts[2:-2]), int(parts[-2])
    except (ValueError, IndexError):
        return None


def _owner_gone(path: Path) -> bool:
    owner = _segment_owner(path)
    if owner is None or owner[0] != HOST:
        return False
    try:
        os.kill(owner[1], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# ---------------------------------------------------------------------------------------
# SQL


class SqlSink:
    """One table per stream: indexed columns for the queries, the whole record as JSON."""

    def __init__(self, url: str):
        import sqlalchemy as sa

        self.url = url
        self.engine = sa.create_engine(url, pool_pre_ping=True)
        self.meta = sa.MetaData()
        self.tables = {
            stream: sa.Table(
                f"tuneloop_{stream}",
                self.meta,
                sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
                sa.Column("request_id", sa.String(64), index=True),
                sa.Column("time", sa.String(32), index=True),
                sa.Column("record", sa.Text, nullable=False),
            )
            for stream in STREAMS
        }
        self.meta.create_all(self.engine)

    def write(self, stream: str, records: list[dict]) -> None:
        if not records:
            return
        rows = [
            {
                "request_id": r.get("request_id"),
                "time": r.get("time"),
                "record": json.dumps(r, ensure_ascii=False, default=str),
            }
            for r in records
        ]
        with self.engine.begin() as conn:
            conn.execute(self.tables[stream].insert(), rows)

    def read(self, stream: str, since: datetime | None) -> Iterator[dict]:
        t = self.tables[stream]
        q = t.select().order_by(t.c.time, t.c.seq)
        if since is not None:  # the stored times are ISO UTC strings: they sort as times do
            q = q.where(
                t.c.time >= since.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
            )
        with self.engine.connect() as conn:
            for row in conn.execute(q):
                yield json.loads(row.record)

    def close(self) -> None:
        self.engine.dispose()

    def __str__(self) -> str:
        return _redact_url(self.url)


# ---------------------------------------------------------------------------------------
# reading


def read_records(
    url: str | None, home: Path, stream: str = "requests", since: datetime | None = None, until: datetime | None = None
) -> list[dict]:
    """Every record of the stream in [since, until), oldest first, from every writer."""
    if stream not in STREAMS:
        raise LogError(f"unknown log stream {stream!r} (one of {', '.join(STREAMS)})")
    if is_s3_url(url):
        records = list(_S3Reader(url, home).read(stream))
    elif is_sql_url(url):
        sink = SqlSink(url)
        try:
            records = list(sink.read(stream, since))
        finally:
            sink.close()
    else:
        folder = _folder(url, home)
        records = []
        for path in _segments(folder, stream):
            records.extend(_read_segment(path))
    out = []
    for r in records:
        try:
            t = record_time(r)
        except ValueError:
            continue
        if (since is None or t >= since) and (until is None or t < until):
            out.append(r)
    out.sort(key=lambda r: r.get("time", ""))
    return out


def write_export(records: Iterable[dict], path: Path | None, fmt: str) -> int:
    """records as jsonl / csv / parquet to path (jsonl to stdout when path is None)."""
    records = list(records)
    if fmt == "jsonl":
        lines = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
        if path is None:
            sys.stdout.write(lines)
        else:
            Path(path).write_text(lines, encoding="utf-8")
        return len(records)
    if path is None:
        raise LogError(f"--format {fmt} needs --output FILE")
    import pandas as pd

    frame = pd.DataFrame(
        [
            {k: (json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v) for k, v in r.items()}
            for r in records
        ]
    )
    if fmt == "csv":
        frame.to_csv(path, index=False)
    elif fmt == "parquet":
        frame.to_parquet(path, index=False)
    else:
        raise LogError(f"unknown export format {fmt!r} (jsonl, csv or parquet)")
    return len(records)
