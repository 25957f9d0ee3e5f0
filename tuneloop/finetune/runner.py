"""The dispatcher: takes fine-tuning jobs from validating_files to queued to running, and
watches them run.

A thread of the server (one per replica; several may run against one job store: a job is
claimed by a compare-and-set on its status, so it starts once). Every fine_tuning.poll_interval_s:

1. validating_files: the job's files are checked (they exist, are the owner's, and hold the
   rows its method trains on: chat rows for supervised, preference rows for dpo); a job whose
   files fail ends failed (invalid_training_file / invalid_validation_file), else queued.
2. queued, oldest first: started while fewer than fine_tuning.max_running run on the whole
   store and fewer than the owner's tier allows (max_running_jobs) run for its owner. Started
   means a run of the training flow with the job's id: `embedded`, a child process of this
   server (`python -m flows.run_job JOB`, its own session, its log under
   <home>/fine_tuning/logs); `prefect`, a flow run of fine_tuning.deployment for a worker.
3. running: a cancelled job's run is stopped (SIGTERM, then SIGKILL; or Prefect's cancel);
   a run past fine_tuning.job_timeout_s is stopped and its job fails (job_timeout); a run that
   ended without ending its job (killed, crashed) fails it (run_crashed) with its log's tail.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from tuneloop.config import REPO_ROOT, FineTuningTierLimits
from tuneloop.data.formats import PREFERENCE_FORMATS
from tuneloop.files import FilesError
from tuneloop.finetune.jobs import CANCELLED, QUEUED, RUNNING, VALIDATING, JobError, JobStore
from tuneloop.ports import stop_process_group

log = logging.getLogger("tuneloop.finetune")
HOST = socket.gethostname()


def limits_for(cfg, tier: str | None) -> FineTuningTierLimits:
    return cfg.fine_tuning.tiers.get(tier or "", None) or FineTuningTierLimits()


class Dispatcher:
    def __init__(self, cfg, store: JobStore, files: Any, config_path: str | None = None):
        self.cfg = cfg
        self.store = store
        self.files = files
        self.config_path = config_path
        self._procs: dict[str, subprocess.Popen] = {}  # job id -> the embedded run this process started
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- life ------------------------------------------------------------------------
    def start(self) -> None:
        self._fail_orphans()
        self._thread = threading.Thread(target=self._loop, name="fine-tuning-dispatcher", daemon=True)
        self._thread.start()

    def _fail_orphans(self) -> None:
        """Jobs a server on this host was running in a child process that is gone (that server
        was killed, or the machine restarted): nobody watches them any more, so they fail."""
        for job in self.store.by_status(RUNNING):
            runner = job.runner
            if runner.get("kind") != "embedded" or runner.get("host") != HOST:
                continue
            if not _alive(runner.get("pid"), job.id):
                self.store.fail(
                    job.id,
                    "run_crashed",
                    f"the server running this job stopped and its run is gone: {_tail(runner.get('log'))}",
                )

    def wake(self) -> None:
        """Look now (a job was created or cancelled), not at the next poll."""
        self._wake.set()

    def stop(self, stop_runs: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if stop_runs:  # the server goes away: its runs would be orphans nobody watches
            for job_id, proc in list(self._procs.items()):
                if proc.poll() is None:
                    stop_process_group(proc)
                    self.store.fail(job_id, "server_stopped", "the server running this job stopped; create it again")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # the dispatcher must outlive one bad turn
                log.exception("fine-tuning dispatcher turn failed")
            self._wake.wait(self.cfg.fine_tuning.poll_interval_s)
            self._wake.clear()

    # ---- one turn ----------------------------------------------------------------------
    def tick(self) -> None:
        for job in self.store.by_status(VALIDATING):
            self._validate(job)
        self._watch()
        self._start_queued()

    def _validate(self, job) -> None:
        body = job.body
        wants_pairs = (body.get("method") or {}).get("type") == "dpo"
        for param in ("training_file", "validation_file"):
            file_id = body.get(param)
            if not file_id:
                continue
            try:
                stored = self.files.get(file_id, job.owner)
            except FilesError as exc:
                self.store.fail(job.id, f"invalid_{param}", f"{param} {file_id}: {exc}", param=param)
                return
            is_pairs = stored.format in PREFERENCE_FORMATS
            if is_pairs != wants_pairs:
                kind = "preference rows (OpenAI's DPO format)" if wants_pairs else "chat or prompt/completion rows"
                self.store.fail(
                    job.id,
                    f"invalid_{param}",
                    f"{param} {file_id} holds {stored.format} rows; method {'dpo' if wants_pairs else 'supervised'} "
                    f"trains on {kind}",
                    param=param,
                )
                return
        try:
            self.store.update(job.id, expect=(VALIDATING,), status=QUEUED)
        except JobError:
            return  # cancelled meanwhile
        self.store.event(job.id, "Files validated, moving job to queued state")

    def _start_queued(self) -> None:
        running = self.store.by_status(RUNNING)
        room = self.cfg.fine_tuning.max_running - len(running)
        per_owner: dict[str, int] = {}
        for job in running:
            per_owner[job.owner] = per_owner.get(job.owner, 0) + 1
        for job in self.store.by_status(QUEUED):
            if room <= 0:
                return
            if per_owner.get(job.owner, 0) >= limits_for(self.cfg, job.tier).max_running_jobs:
                continue  # its team's running places are taken: the next team's job goes first
            try:
                self.store.update(job.id, expect=(QUEUED,), status=RUNNING)
            except JobError:
                continue  # cancelled, or another replica took it
            try:
                runner = self._launch(job)
            except Exception as exc:
                log.exception("could not start fine-tuning job %s", job.id)
                self.store.fail(job.id, "run_not_started", f"the job's run could not start: {exc}")
                continue
            self.store.update(job.id, runner={**runner, "host": HOST, "started": time.time()})
            self.store.event(job.id, "Fine-tuning job started")
            room -= 1
            per_owner[job.owner] = per_owner.get(job.owner, 0) + 1

    def _launch(self, job) -> dict[str, Any]:
        if self.cfg.fine_tuning.runner == "prefect":
            from prefect.deployments import run_deployment

            run = run_deployment(
                name=self.cfg.fine_tuning.deployment,
                parameters={"config_path": self.config_path, "job_id": job.id},
                timeout=0,
                tags=["fine-tuning-job", job.id],
            )
            return {"kind": "prefect", "flow_run_id": str(run.id)}
        if not (REPO_ROOT / "flows" / "run_job.py").exists():
            raise RuntimeError(
                "this server has no training code beside it (a packaged bento carries the server only): "
                "set fine_tuning.runner: prefect and run a Prefect worker from the project's checkout"
            )
        logs = self.cfg.home / "fine_tuning" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "flows.run_job", job.id]
        if self.config_path:
            cmd += ["--config", str(self.config_path)]
        with open(logs / f"{job.id}.log", "ab") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=str(REPO_ROOT),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the server does not reach it; a cancel stops its group
            )
        self._procs[job.id] = proc
        return {"kind": "embedded", "pid": proc.pid, "log": str(logs / f"{job.id}.log")}

    def _watch(self) -> None:
        timeout = self.cfg.fine_tuning.job_timeout_s
        for job_id, proc in list(self._procs.items()):
            job = self.store.get(job_id)
            code = proc.poll()
            if job.status == CANCELLED and code is None:
                stop_process_group(proc)
                continue
            if (
                job.status == RUNNING
                and code is None
                and time.time() - job.runner.get("started", time.time()) > timeout
            ):
                stop_process_group(proc)
                self.store.fail(job_id, "job_timeout", f"the job ran over {timeout:.0f} s (fine_tuning.job_timeout_s)")
                continue
            if code is not None:
                del self._procs[job_id]
                if self.store.get(job_id).status == RUNNING:  # it ended without saying how
                    self.store.fail(
                        job_id, "run_crashed", f"the job's run exited with code {code}: {_tail(job.runner.get('log'))}"
                    )
        for job in self.store.by_status(RUNNING, CANCELLED):
            if job.runner.get("kind") == "prefect" and not job.runner.get("ended"):
                self._watch_prefect(job, timeout)

    def _watch_prefect(self, job, timeout: float) -> None:
        from prefect import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            run = client.read_flow_run(job.runner["flow_run_id"])
            state = run.state
            if job.status == CANCELLED and state is not None and not state.is_final():
                client.set_flow_run_state(run.id, Cancelling(), force=True)
                return
            if job.status == RUNNING and time.time() - job.runner.get("started", time.time()) > timeout:
                client.set_flow_run_state(run.id, Cancelling(), force=True)
                self.store.fail(job.id, "job_timeout", f"the job ran over {timeout:.0f} s (fine_tuning.job_timeout_s)")
                return
            if state is not None and state.is_final():
                self.store.update(job.id, runner={"ended": state.type.value})
                if self.store.get(job.id).status == RUNNING:
                    self.store.fail(job.id, "run_crashed", f"the flow run ended {state.name}: {state.message or ''}")


def _alive(pid: int | None, job_id: str) -> bool:
    """Whether `pid` is still this job's run (a pid of a dead run may belong to another process by now)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return job_id.encode() in f.read()
    except OSError:
        return False


def _tail(path: str | None, lines: int = 8) -> str:
    if not path or not Path(path).exists():
        return "no log"
    with open(path, errors="replace") as f:
        return " | ".join(line.rstrip() for line in deque(f, maxlen=lines))[-1500:]
