"""Files kept for fine-tuning (OpenAI's Files API, tuneloop/api/files.py): uploaded data
checked against the data contract (contract.py), kept per owner (a key's team) in a folder
(local.py) or an S3-compatible bucket (s3.py) behind one interface (store.py: FileStore).

    store = open_file_store(cfg)
    with store.path(file_id, owner) as path:   # what a fine-tuning job reads
        load_file(path)
"""

from __future__ import annotations

from tuneloop.config import TuneloopConfig
from tuneloop.files.local import LocalFileStore
from tuneloop.files.s3 import S3FileStore
from tuneloop.files.store import ANONYMOUS, FileNotFound, FilesError, FileStore, StoredFile

__all__ = ["ANONYMOUS", "FileNotFound", "FileStore", "FilesError", "StoredFile", "open_file_store"]


def open_file_store(cfg: TuneloopConfig) -> FileStore:
    """The deployment's file store, from the config's `files` section."""
    f = cfg.files
    if f.storage and f.storage.startswith("s3://"):
        return S3FileStore(
            f.storage, cfg.home / "files-s3-staging", f.max_upload_bytes, f.max_files_per_owner, f.s3_endpoint_url
        )
    if f.storage:
        root = cfg.resolve(f.storage.removeprefix("file://"))
    else:
        root = cfg.home / "files"
    return LocalFileStore(root, f.max_upload_bytes, f.max_files_per_owner)
