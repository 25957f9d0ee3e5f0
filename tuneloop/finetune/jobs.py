"""Fine-tuning jobs as OpenAI keeps them: the job, its events and its checkpoints, per owner.

One SQLite file under <home>/fine_tuning (WAL: the server, the dispatcher and each job's flow
run write to it from their own processes). A job's life, as OpenAI's statuses say it:

    validating_files -> queued -> running -> succeeded | failed | cancelled

The API creates it (validating_files: its files are checked and its limits counted), the
dispatcher (runner.py) moves it to queued and starts it when there is room (running), and the
flow run it becomes records its events, checkpoints and end. A cancel is recorded at once; the
dispatcher then stops the run.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

VALIDATING, QUEUED, RUNNING = "validating_files", "queued", "running"
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"
ACTIVE = (VALIDATING, QUEUED, RUNNING)
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)
JOB_ID_PREFIX = "ftjob-"

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    tier TEXT,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    body TEXT NOT NULL,          -- the job object as the API answers it (JSON)
    runner TEXT                  -- how it runs: {"kind": "embedded", "pid": ...} or {"kind": "prefect", "flow_run_id": ...}
);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, created_at);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, created_at);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    type TEXT NOT NULL,
    data TEXT
);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq);
CREATE TABLE IF NOT EXISTS checkpoints (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    step_number INTEGER NOT NULL,
    model TEXT NOT NULL,
    metrics TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_job ON checkpoints (job_id, step_number);
"""


class JobError(Exception):
    """A job operation that cannot be done; the message says why."""


class JobNotFound(JobError):
    pass


class JobLimit(JobError):
    """Over a team's fine-tuning limits (fine_tuning.tiers)."""


class NotCancellable(JobError):
    pass


def new_job_id() -> str:
    return JOB_ID_PREFIX + secrets.token_hex(12)


def _now() -> int:
    return int(time.time())


@dataclass
class Job:
    id: str
    owner: str
    tier: str | None
    body: dict[str, Any]
    runner: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return self.body["status"]

    def openai(self) -> dict[str, Any]:
        """The job as the API answers it (the owner is organization_id, as OpenAI names it)."""
        return {k: v for k, v in self.body.items() if not k.startswith("_")}


class JobStore:
    """The jobs of every owner, in one SQLite file (a process opens its own)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._db().executescript(SCHEMA)  # its own transaction

    @classmethod
    def from_config(cls, cfg) -> "JobStore":
        return cls(cfg.home / "fine_tuning" / "jobs.sqlite")

    # ---- plumbing ---------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=True)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: its reads and writes are one step)."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    @staticmethod
    def _job(row) -> Job:
        return Job(id=row[0], owner=row[1], tier=row[2], body=json.loads(row[3]), runner=json.loads(row[4] or "{}"))

    # ---- jobs -------------------------------------------------------------------------
    def create(self, owner: str, tier: str | None, body: dict[str, Any], limits=None) -> Job:
        """A new job in validating_files, if its owner is within `limits` (FineTuningTierLimits:
        jobs running and waiting; JobLimit otherwise). body: the job object without its id,
        status and times (they are set here)."""
        job_id = new_job_id()
        created = _now()
        body = {
            **body,
            "id": job_id,
            "object": "fine_tuning.job",
            "created_at": created,
            "status": VALIDATING,
            "organization_id": owner,
        }
        with self._tx() as db:
            if limits is not None:
                counts = dict(
                    db.execute(
                        "SELECT status, COUNT(*) FROM jobs WHERE owner = ? AND status IN (?, ?, ?) GROUP BY status",
                        (owner, *ACTIVE),
                    ).fetchall()
                )
                waiting = counts.get(VALIDATING, 0) + counts.get(QUEUED, 0)
                running = counts.get(RUNNING, 0)
                # a job waits only beyond the running places: max_running + max_queued in all
                if waiting + running >= limits.max_running_jobs + limits.max_queued_jobs:
                    raise JobLimit(
                        f"this team has {running} fine-tuning job(s) running and {waiting} waiting; its tier "
                        f"allows {limits.max_running_jobs} running and {limits.max_queued_jobs} waiting: cancel one "
                        "or wait for one to finish"
                    )
            db.execute(
                "INSERT INTO jobs (id, owner, tier, created_at, status, body) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, owner, tier, created, VALIDATING, json.dumps(body)),
            )
        self.event(job_id, f"Validating training file: {body.get('training_file')}")
        return Job(id=job_id, owner=owner, tier=tier, body=body)

    def get(self, job_id: str, owner: str | None = None) -> Job:
        """The job (JobNotFound for another owner's, as for one that does not exist)."""
        row = self._db().execute("SELECT id, owner, tier, body, runner FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or (owner is not None and row[1] != owner):
            raise JobNotFound(f"No fine-tuning job found with id {job_id!r}")
        return self._job(row)

    def list(self, owner: str, after: str | None = None, limit: int = 20) -> tuple[list[Job], bool]:
        """(a page of the owner's jobs, newest first, after the job `after`; whether more follow)."""
        db = self._db()
        query = "SELECT id, owner, tier, body, runner FROM jobs WHERE owner = ?"
        args: list[Any] = [owner]
        if after:  # rowid: the order jobs were created in, whatever their second
            anchor = db.execute("SELECT rowid FROM jobs WHERE id = ? AND owner = ?", (after, owner)).fetchone()
            if anchor is None:
                raise JobNotFound(f"No fine-tuning job found with id {after!r} (the `after` cursor)")
            query += " AND rowid < ?"
            args.append(anchor[0])
        rows = db.execute(query + " ORDER BY rowid DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [self._job(r) for r in rows[:limit]], len(rows) > limit

    def by_status(self, *statuses: str) -> list[Job]:
        """Every job in these statuses, oldest first (the dispatcher's queue order)."""
        marks = ",".join("?" * len(statuses))
        rows = (
            self._db()
            .execute(
                f"SELECT id, owner, tier, body, runner FROM jobs WHERE status IN ({marks}) ORDER BY rowid",
                statuses,
            )
            .fetchall()
        )
        return [self._job(r) for r in rows]

    def update(self, job_id: str, expect: tuple[str, ...] | None = None, runner: dict | None = None, **fields) -> Job:
        """Set fields of the job object (and the runner record) in one step; with `expect`, only
        while the job is in one of those statuses (JobError otherwise: someone moved it first)."""
        with self._tx() as db:
            row = db.execute("SELECT id, owner, tier, body, runner FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise JobNotFound(f"No fine-tuning job found with id {job_id!r}")
            job = self._job(row)
            if expect is not None and job.status not in expect:
                raise JobError(f"job {job_id} is {job.status}, not {' or '.join(expect)}")
            job.body.update(fields)
            if fields.get("status") in TERMINAL and job.body.get("finished_at") is None:
                job.body["finished_at"] = _now()
            if runner is not None:
                job.runner = {**job.runner, **runner}
            db.execute(
                "UPDATE jobs SET status = ?, body = ?, runner = ? WHERE id = ?",
                (job.body["status"], json.dumps(job.body), json.dumps(job.runner), job_id),
            )
        return job

    def cancel(self, job_id: str, owner: str) -> Job:
        """Mark the job cancelled (the dispatcher stops its run); NotCancellable once it ended."""
        self.get(job_id, owner)
        try:
            job = self.update(job_id, expect=ACTIVE, status=CANCELLED)
        except JobNotFound:
            raise
        except JobError:
            status = self.get(job_id).status
            raise NotCancellable(f"Job {job_id} has already {status}: only an active job can be cancelled") from None
        self.event(job_id, "Fine-tuning job cancelled by the user", level="warn")
        return job

    def fail(self, job_id: str, code: str, message: str, param: str | None = None) -> Job | None:
        """End the job as failed with OpenAI's error object (a no-op once it ended: a cancel wins)."""
        try:
            job = self.update(
                job_id, expect=ACTIVE, status=FAILED, error={"code": code, "message": message, "param": param}
            )
        except JobError:
            return None
        self.event(job_id, f"Fine-tuning job failed: {message}", level="error")
        return job

    def trained_tokens_since(self, owner: str, since: int) -> int:
        """Tokens the owner's jobs trained (or reserved, while they run) since a time."""
        total = 0
        for (body,) in self._db().execute("SELECT body FROM jobs WHERE owner = ? AND created_at >= ?", (owner, since)):
            job = json.loads(body)
            if job["status"] in (CANCELLED, FAILED) and not job.get("trained_tokens"):
                continue
            total += int(job.get("trained_tokens") or job.get("estimated_tokens") or 0)
        return total

    # ---- events and checkpoints ---------------------------------------------------------
    def event(
        self, job_id: str, message: str, level: str = "info", type: str = "message", data: dict | None = None
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO events (job_id, created_at, level, message, type, data) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, _now(), level, message[:4000], type, json.dumps(data) if data is not None else None),
            )

    def events(self, job_id: str, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        """A page of the job's events, newest first (OpenAI's order), after the event `after`."""
        query, args = "SELECT seq, created_at, level, message, type, data FROM events WHERE job_id = ?", [job_id]
        if after:
            seq = _seq(after)
            if seq is None:
                raise JobNotFound(f"No event found with id {after!r} (the `after` cursor)")
            query += " AND seq < ?"
            args.append(seq)
        rows = self._db().execute(query + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        out = [
            {
                "id": f"ftevent-{seq:016d}",
                "object": "fine_tuning.job.event",
                "created_at": created,
                "level": level,
                "message": message,
                "type": kind,
                "data": json.loads(data) if data else {},
            }
            for seq, created, level, message, kind, data in rows[:limit]
        ]
        return out, len(rows) > limit

    def checkpoint(self, job_id: str, step: int, model: str, metrics: dict[str, float]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO checkpoints (id, job_id, created_at, step_number, model, metrics) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (f"ftckpt-{job_id[len(JOB_ID_PREFIX) :]}-{step:08d}", job_id, _now(), step, model, json.dumps(metrics)),
            )

    def checkpoints(self, job_id: str, after: str | None = None, limit: int = 10) -> tuple[list[dict], bool]:
        query, args = "SELECT id, created_at, step_number, model, metrics FROM checkpoints WHERE job_id = ?", [job_id]
        if after:
            query += " AND id < ?"
            args.append(after)
        rows = self._db().execute(query + " ORDER BY id DESC LIMIT ?", (*args, limit + 1)).fetchall()
        out = [
            {
                "id": cid,
                "object": "fine_tuning.job.checkpoint",
                "created_at": created,
                "fine_tuned_model_checkpoint": model,
                "fine_tuning_job_id": job_id,
                "metrics": json.loads(metrics),
                "step_number": step,
            }
            for cid, created, step, model, metrics in rows[:limit]
        ]
        return out, len(rows) > limit


def _seq(event_id: str) -> int | None:
    prefix = "ftevent-"
    if event_id.startswith(prefix) and event_id[len(prefix) :].isdigit():
        return int(event_id[len(prefix) :])
    return None
