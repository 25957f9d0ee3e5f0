"""What a stored file is and what every place that keeps files does (FileStore): create one
from a staged upload, get, list, delete, read it back. Two backends implement the storage
half: a folder (local.py) and an S3-compatible bucket (s3.py).

A file belongs to one owner: the scope of the API key that uploaded it ("team:<name>" for a
key of a team, else "key:<id>"; "anonymous" when the gateway's auth is off). Every call names
the owner, and a file of another owner is not found, exactly as a file that does not exist:
nothing tells the two apart. Each owner's files live under a folder (or key prefix) named by
a hash of the owner, with the owner written in each file's metadata and checked again.

File ids are "file-" + 32 hex digits: the creation time in milliseconds (12 digits) then 80
random bits. Sorted, they are in the order the files were created, so a list cursor (`after`)
is an id comparison and still works when the file it names has been deleted.

Fine-tuning jobs read a file by id with the owner of the job: `open(file_id, owner)` (the
bytes, streamed) or `with path(file_id, owner) as p:` (a local file to hand to
tuneloop.data.formats.load_file: the stored file itself for a folder, a downloaded copy for
a bucket).
"""

from __future__ import annotations

import builtins
import hashlib
import os
import re
import secrets
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

PURPOSES = ("fine-tune",)  # the purposes this server keeps files for
ANONYMOUS = "anonymous"  # the owner of every file when the gateway's auth is off
FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")
STAGING_MAX_AGE_S = 24 * 3600  # a staged upload older than this was left by a crash


class FilesError(Exception):
    """A file operation that cannot be done; the message says why."""


class FileNotFound(FilesError):
    """No such file for this owner (it may not exist, or belong to someone else: never said which)."""


class TooManyFiles(FilesError):
    """The owner keeps files.max_files_per_owner files already."""


class FileTooLarge(FilesError):
    """Over files.max_upload_bytes."""


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int  # Unix seconds
    format: str = ""  # the data format the contract read it as: chat, legacy, alpaca or dolly
    rows: int = 0  # its examples (every row of it: a file with a bad row is not stored)

    def openai(self) -> dict:
        """OpenAI's File object (the owner, format and rows are this server's own, not shown)."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }

    def meta(self) -> dict:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: dict) -> StoredFile:
        return cls(**{k: meta[k] for k in cls.__dataclass_fields__ if k in meta})


def new_file_id(now_s: float | None = None) -> str:
    ms = int((time.time() if now_s is None else now_s) * 1000)
    return f"file-{ms:012x}{secrets.token_hex(10)}"


def owner_folder(owner: str) -> str:
    """The folder (key prefix) of an owner's files: any team name is safe as a path this way."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


class FileStore:
    """Files kept for their owners. The public methods are the interface (blocking: call them
    off the event loop); a backend implements the underscored ones."""

    def __init__(self, staging: Path, max_upload_bytes: int, max_files_per_owner: int):
        self.staging = staging
        self.max_upload_bytes = max_upload_bytes
        self.max_files_per_owner = max_files_per_owner
        # One create at a time in this process, so an owner's count and its new file agree.
        # Replicas sharing a store may each let one more in at the same instant: the limit is
        # a quota on storage, not a security boundary.
        self._lock = threading.Lock()
        staging.mkdir(parents=True, exist_ok=True)
        self._clean_staging()

    # ---- the interface ------------------------------------------------------------------
    @contextmanager
    def staged(self) -> Iterator[Path]:
        """A new path in this store's staging folder to write an upload to; create() takes
        the file from there, and whatever is left is removed on exit."""
        path = self.staging / f"upload-{uuid.uuid4().hex}"
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)

    def create(
        self, owner: str, staged: Path, filename: str, purpose: str, format: str = "", rows: int = 0
    ) -> StoredFile:
        """Keep the staged file (moved or uploaded: it is gone from staging afterwards)."""
        if purpose not in PURPOSES:
            raise FilesError(f"purpose {purpose!r} is not kept here; only {', '.join(PURPOSES)}")
        size = staged.stat().st_size
        if size > self.max_upload_bytes:
            raise FileTooLarge(f"the file ({size} bytes) is over files.max_upload_bytes ({self.max_upload_bytes})")
        with self._lock:
            self.check_room(owner)
            stored = StoredFile(new_file_id(), owner, filename, purpose, size, int(time.time()), format, rows)
            self._put(owner_folder(owner), stored.id, staged, stored.meta())
        return stored

    def check_room(self, owner: str) -> None:
        """TooManyFiles when the owner may keep no more files."""
        if self.count(owner) >= self.max_files_per_owner:
            raise TooManyFiles(
                f"this key's team keeps {self.max_files_per_owner} files already, the most it may "
                "(files.max_files_per_owner); delete some (DELETE /v1/files/{file_id}) and upload again"
            )

    def get(self, file_id: str, owner: str) -> StoredFile:
        if not FILE_ID.match(file_id):
            raise FileNotFound(f"No such File object: {file_id}")
        meta = self._meta(owner_folder(owner), file_id)
        if meta is None or meta.get("owner") != owner:
            raise FileNotFound(f"No such File object: {file_id}")
        return StoredFile.from_meta(meta)

    def list(self, owner: str, purpose: str | None = None) -> list[StoredFile]:
        """The owner's files, oldest first."""
        files = [StoredFile.from_meta(m) for m in self._metas(owner_folder(owner)) if m.get("owner") == owner]
        return sorted((f for f in files if purpose is None or f.purpose == purpose), key=lambda f: f.id)

    def count(self, owner: str) -> int:
        return len(self.list(owner))

    def delete(self, file_id: str, owner: str) -> StoredFile:
        stored = self.get(file_id, owner)
        self._remove(owner_folder(owner), file_id)
        return stored

    def open(self, file_id: str, owner: str) -> BinaryIO:
        """The file's bytes as a binary stream (close it)."""
        self.get(file_id, owner)
        return self._content(owner_folder(owner), file_id)

    @contextmanager
    def path(self, file_id: str, owner: str) -> Iterator[Path]:
        """A local path of the file's content while the block runs (read only)."""
        self.get(file_id, owner)
        with self._local(owner_folder(owner), file_id) as path:
            yield path

    # ---- a backend's part -----------------------------------------------------------------
    def _put(self, folder: str, file_id: str, staged: Path, meta: dict) -> None:
        """Keep the content, then the metadata (a file exists once its metadata does)."""
        raise NotImplementedError

    def _meta(self, folder: str, file_id: str) -> dict | None:
        raise NotImplementedError

    def _metas(self, folder: str) -> builtins.list[dict]:  # (`list` is a method here)
        raise NotImplementedError

    def _remove(self, folder: str, file_id: str) -> None:
        """The metadata first (the file is gone), then the content."""
        raise NotImplementedError

    def _content(self, folder: str, file_id: str) -> BinaryIO:
        raise NotImplementedError

    @contextmanager
    def _local(self, folder: str, file_id: str) -> Iterator[Path]:
        raise NotImplementedError
        yield  # pragma: no cover

    def _clean_staging(self) -> None:
        cutoff = time.time() - STAGING_MAX_AGE_S
        for path in self.staging.glob("*"):
            try:
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
            except OSError:
                pass  # another replica removed it first


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
