"""PII redaction for the request log in its own process.

Presidio's analysis is Python that holds the GIL for milliseconds per text; run in the
server's process it stalls the event loop and the engine (measured: 16 % of output tokens/s
on the demo model with the gateway's PII off, against none with texts omitted). Here it
runs in a child process that the writer thread talks to over pipes (one JSON line per
batch of texts each way), so the server only serialises strings.

    python -m components.requestlog.redactor_process '<json: pii config, cache dir, key prefix>'

A child that dies or does not answer within the timeout is killed; the batch's texts are
then omitted (never written unredacted) and the next batch starts a new child.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

log = logging.getLogger("tuneloop.requestlog")


class RedactionFailed(Exception):
    pass


class ProcessRedactor:
    def __init__(self, pii_config: dict, cache_dir: str, key_prefix: str, timeout_s: float = 60.0):
        self.args = json.dumps({"pii": pii_config, "cache_dir": str(cache_dir), "key_prefix": key_prefix})
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._buf = b""

    def cpu_seconds(self) -> float | None:
        """CPU (user + system) the current child process has used, where /proc tells (Linux)."""
        proc = self._proc
        if proc is None:
            return None
        try:
            fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "components.requestlog.redactor_process", self.args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self._proc, self._buf = proc, b""
        reply = self._read(proc, 120.0)  # building the analyzer takes seconds
        if not reply.get("ready"):
            self._kill()
            raise RedactionFailed(reply.get("error", "the redaction process did not start"))
        return proc

    def _read(self, proc: subprocess.Popen, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._kill()
                raise RedactionFailed(f"the redaction process did not answer within {timeout:g} s")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self._kill()
                raise RedactionFailed("the redaction process exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _kill(self) -> None:
        if self._proc is not None:
            try:
                self._proc.kill()
                self._proc.wait(5)
            except Exception:  # noqa: BLE001 - gone already
                pass
        self._proc = None

    def warm_up(self) -> None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()

    def redact_many(self, texts: list[str]) -> list[str]:
        if not texts:
            return []
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            try:
                proc.stdin.write(json.dumps({"texts": texts}, ensure_ascii=False).encode() + b"\n")
                proc.stdin.flush()
            except OSError as exc:
                self._kill()
                raise RedactionFailed(f"the redaction process is gone ({exc})") from None
            reply = self._read(proc, self.timeout_s)
        if "error" in reply or len(reply.get("texts", ())) != len(texts):
            raise RedactionFailed(reply.get("error", "the redaction process answered the wrong number of texts"))
        return reply["texts"]

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                try:
                    self._proc.stdin.close()
                    self._proc.wait(5)
                except Exception:  # noqa: BLE001
                    pass
                self._kill()


def _main() -> None:  # pragma: no cover - runs in the child (tested through ProcessRedactor)
    from pathlib import Path

    from components.config import PiiConfig
    from components.gateway.pii import PiiRedactor

    out = sys.stdout.buffer
    try:
        os.nice(10)  # background work: the server's generation comes first
    except OSError:
        pass
    try:
        args = json.loads(sys.argv[1])
        redactor = PiiRedactor(PiiConfig.model_validate(args["pii"]), Path(args["cache_dir"]), args["key_prefix"])
    except Exception as exc:  # noqa: BLE001
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
        out.flush()
        return
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            texts = json.loads(line)["texts"]
            reply = {"texts": [redactor.redact(t)[0] for t in texts]}
        except Exception as exc:  # noqa: BLE001 - the parent omits this batch's texts
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply, ensure_ascii=False).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    _main()
