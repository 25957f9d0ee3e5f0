"""An upload checked against the data contract before it is stored: the loader every training
run uses (tuneloop/data/formats.py load_file: chat, legacy, Alpaca or Dolly rows, or OpenAI's
DPO preference pairs, JSONL or a JSON array), so a file the Files API keeps is a file a
fine-tuning job can read; Checked.format says which ("dpo": a preference tuning file).

The whole file or nothing: a file with any row the loader rejects is refused, its message
listing the first MAX_LISTED bad rows with their line (or record) numbers and reasons and
how many there are; so is a file that is not UTF-8, not JSON rows, of no known format or
without a row, or one that mixes preference pairs with supervised rows. Nothing of a refused
file is kept.

The check runs in a child process (`python -m tuneloop.files.contract <path> <filename>`,
at a lower priority): the loader parses the whole file, and for a 64 MiB file that took 3.3 s
holding the GIL and 470 MB more memory (measured on this project's 2-core machine), which
in the server's process would stall every generation and keep the memory. The child prints
one JSON line and exits, so the server gets back a few hundred bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tuneloop.data.formats import DataError, LoadResult, load_file
from tuneloop.files.store import FilesError

MAX_LISTED = 20  # bad rows named in a refusal
CHECK_TIMEOUT_S = 300.0  # far above a 64 MiB file's few seconds
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding tuneloop/, for the child


class UploadRefused(FilesError):
    """The file does not meet the data contract; the message says where and why."""


@dataclass(frozen=True)
class Checked:
    format: str
    rows: int


def check_upload(path: Path, filename: str) -> Checked:
    """The file's format and rows, or UploadRefused (in this process)."""
    try:
        result = load_file(path)
    except DataError as exc:
        # The loader names the staged path; the client knows the file by its name.
        raise UploadRefused(str(exc).replace(str(path), filename)) from None
    if result.rejects:
        raise UploadRefused(refusal(result, filename))
    if not result.examples:
        raise UploadRefused(f"{filename}: no rows")
    return Checked(result.format, len(result.examples))


def refusal(result: LoadResult, filename: str) -> str:
    bad, total = result.rejects, len(result.rejects) + len(result.examples)
    listed = "; ".join(
        f"{'record ' + str(r.source_record) if r.source_record is not None else 'line ' + str(r.source_line)}: {r.reason}"
        for r in bad[:MAX_LISTED]
    )
    more = f"; and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
    return (
        f"{filename}: {len(bad)} of {total} rows do not meet the data contract ({result.format} format), "
        f"so the file was not stored; fix them and upload it again: {listed}{more}"
    )


def check_upload_in_child(path: Path, filename: str, timeout_s: float = CHECK_TIMEOUT_S) -> Checked:
    """check_upload in a child process (blocking: call it off the event loop)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])),
    }
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tuneloop.files.contract", str(path), filename],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise FilesError(f"checking the file took longer than {timeout_s:g} s; it was not stored") from None
    try:
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise FilesError(
            f"the file could not be checked (the check exited {out.returncode}: {out.stderr.strip()[-500:]})"
        ) from None
    if "refused" in answer:
        raise UploadRefused(answer["refused"])
    return Checked(answer["format"], answer["rows"])


def main(argv: list[str]) -> int:
    try:
        os.nice(10)  # behind the server's own work
    except OSError:
        pass
    path, filename = Path(argv[0]), argv[1]
    try:
        checked = check_upload(path, filename)
    except UploadRefused as exc:
        print(json.dumps({"refused": str(exc)}))
        return 0
    print(json.dumps({"format": checked.format, "rows": checked.rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
