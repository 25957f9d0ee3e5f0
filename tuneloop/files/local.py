"""Files in a folder (the default: <home>/files):

    <root>/<owner folder>/<file id>.data   the content, as uploaded
    <root>/<owner folder>/<file id>.json   its metadata (StoredFile); the file exists once this does
    <root>/.staging/                       uploads being written and checked

Every write is atomic: the content is staged in the same file system and renamed into place,
the metadata written to a temporary file and renamed; both fsynced, then the folder. A crash
leaves either the whole file or no file (at worst content without metadata: never listed).
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from tuneloop.files.store import FileStore, fsync_file


class LocalFileStore(FileStore):
    def __init__(self, root: Path, max_upload_bytes: int, max_files_per_owner: int):
        self.root = root
        super().__init__(root / ".staging", max_upload_bytes, max_files_per_owner)

    def __str__(self) -> str:
        return str(self.root)

    def _paths(self, folder: str, file_id: str) -> tuple[Path, Path]:
        base = self.root / folder
        return base / f"{file_id}.data", base / f"{file_id}.json"

    def _put(self, folder: str, file_id: str, staged: Path, meta: dict) -> None:
        data, meta_path = self._paths(folder, file_id)
        data.parent.mkdir(parents=True, exist_ok=True)
        fsync_file(staged)
        os.replace(staged, data)
        tmp = meta_path.with_name(f".{meta_path.name}.{uuid.uuid4().hex}")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(meta, fh, ensure_ascii=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, meta_path)
        fsync_file(data.parent)

    def _meta(self, folder: str, file_id: str) -> dict | None:
        _, meta_path = self._paths(folder, file_id)
        try:
            return json.loads(meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    def _metas(self, folder: str) -> list[dict]:
        out = []
        for path in (self.root / folder).glob("file-*.json"):
            try:
                out.append(json.loads(path.read_text(encoding="utf-8")))
            except FileNotFoundError:
                continue  # deleted while listing
        return out

    def _remove(self, folder: str, file_id: str) -> None:
        data, meta_path = self._paths(folder, file_id)
        meta_path.unlink(missing_ok=True)
        data.unlink(missing_ok=True)
        fsync_file(data.parent)

    def _content(self, folder: str, file_id: str) -> BinaryIO:
        return open(self._paths(folder, file_id)[0], "rb")

    @contextmanager
    def _local(self, folder: str, file_id: str) -> Iterator[Path]:
        yield self._paths(folder, file_id)[0]
