"""A bento's server, started for real: infra validation and the foreground `tuneloop serve`.

infra_validate (TFX's InfraValidator): `bentoml serve <bento>` on a free local port, wait
for /readyz, one /v1/completions and one /v1/chat/completions, stop it; never raises for a
bad bento, the result says why and carries the end of the server's log. run_server is what
`tuneloop serve` runs in the foreground. Both end a server whose service cannot start (a
model that does not load, a failed warm-up) at its first failure: BentoML would restart its
worker forever (startup_failure reads why from the output).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from tuneloop.config import TuneloopConfig
from tuneloop.gateway.keys import PEPPER_ENV, KeyStore
from tuneloop.packaging.common import bentoml_env, say
from tuneloop.ports import die_with_parent, free_port, stop_process_group


@dataclass
class InfraValidation:
    passed: bool
    bento_tag: str
    reason: str  # why it failed, or a one-line summary of what passed
    seconds_to_ready: float | None = None
    seconds: float = 0.0
    completion: str | None = None  # what the bento answered
    chat: str | None = None
    log_path: str | None = None
    log_tail: str = ""


@dataclass
class ServeCommand:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    what: str = ""  # what it serves, in words


def serve_command(cfg: TuneloopConfig, bento_tag: str, host: str = "127.0.0.1", port: int = 3000) -> ServeCommand:
    """How to start a built bento against this config's BentoML store."""
    argv = [sys.executable, "-m", "bentoml", "serve", bento_tag, "--host", host, "--port", str(port)]
    cfg.home.mkdir(parents=True, exist_ok=True)
    return ServeCommand(argv, bentoml_env(cfg), cfg.home, f"bento {bento_tag}")


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# Lines a server that will never get ready writes: BentoML's own when the service's
# __init__ raised (model that does not load), and bentos/service.py's when warm-up failed.
STARTUP_FAILURES = ("Application startup failed", "warm-up failed")


def startup_failure(text: str) -> str | None:
    """Why a server failed to start, from its output, or None while no failure is there.

    The exception line of the first failure: ServingSetupError's where the service raised
    one (it names what to fix), else the last one raised before BentoML gave up.
    """
    at = min((i for i in (text.find(m) for m in STARTUP_FAILURES) if i >= 0), default=-1)
    if at < 0:
        return None
    errors = re.findall(r"^([A-Za-z_][\w.]*(?:Error|Exception)\b.*)$", text[:at], flags=re.MULTILINE)
    if not errors:
        return next(m for m in STARTUP_FAILURES if m in text)
    chosen = next((e for e in errors if re.match(r"[\w.]*ServingSetupError\b", e)), errors[-1])
    return re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=\w+:)", "", chosen)[:500]  # no module path


def _startup_failure(log_path: Path) -> str | None:
    return startup_failure(_tail(log_path, 200_000))


def _check_answers(client, base: str) -> tuple[str, str, str]:
    """One completion and one chat completion; returns (model id, completion, chat) or raises ValueError."""
    r = client.get(f"{base}/v1/models")
    if r.status_code != 200:
        raise ValueError(f"GET /v1/models answered {r.status_code}: {r.text[:300]}")
    models = r.json().get("data") or []
    if not models or not models[0].get("id"):
        raise ValueError(f"GET /v1/models listed no model: {r.text[:300]}")
    model = models[0]["id"]

    r = client.post(
        f"{base}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    )
    if r.status_code != 200:
        raise ValueError(f"POST /v1/completions answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    choice = (body.get("choices") or [{}])[0]
    if body.get("object") != "text_completion" or not _answered(choice.get("text"), choice, body):
        raise ValueError(f"POST /v1/completions: not an OpenAI completion with an answer: {r.text[:300]}")
    completion = choice["text"]

    r = client.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0},
    )
    if r.status_code != 200:
        raise ValueError(f"POST /v1/chat/completions answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    if (
        body.get("object") != "chat.completion"
        or message.get("role") != "assistant"
        or not _answered(message.get("content"), choice, body)
    ):
        raise ValueError(f"POST /v1/chat/completions: not an OpenAI chat completion with an answer: {r.text[:300]}")
    return model, completion, message["content"]


def _answered(text: str | None, choice: dict, body: dict) -> bool:
    """Text came back -- or the model read the prompt and chose to stop at once: an
    end-of-text first token is a working model, not a broken server. (The stop token is
    not part of the text, nor of usage.completion_tokens, so that answer has 0 tokens.)"""
    usage = body.get("usage") or {}
    if not isinstance(text, str) or "total_tokens" not in usage or usage.get("prompt_tokens", 0) < 1:
        return False
    return bool(text) or choice.get("finish_reason") == "stop"


def infra_validate(
    bento_tag: str, cfg: TuneloopConfig, timeout: float | None = None, progress: Callable[[str], None] | None = None
) -> InfraValidation:
    """Start the built bento with `bentoml serve` on a free local port, ask it one
    completion and one chat completion, stop it. Never raises for a bad bento: the
    result says passed or failed, why, and the end of the server's log."""
    port = free_port()
    log_dir = cfg.home / "infra-validation"
    log_dir.mkdir(parents=True, exist_ok=True)
    say(progress, f"infra validation: `bentoml serve {bento_tag}` on 127.0.0.1:{port}")
    command = serve_command(cfg, bento_tag, port=port)
    if not cfg.bento.validation_compile:
        command.env["TUNELOOP__SERVING__COMPILE"] = "false"  # bento.validation_compile (config.py says why)
    headers = _validation_key(cfg, log_dir / f"keys-{port}", command.env)
    try:
        return check_server(
            command,
            port,
            log_dir / f"{bento_tag.replace(':', '-')}.log",
            timeout or cfg.bento.validation_timeout_s,
            label=bento_tag,
            headers=headers,
        )
    finally:
        shutil.rmtree(log_dir / f"keys-{port}", ignore_errors=True)


def _validation_key(cfg: TuneloopConfig, folder: Path, env: dict[str, str]) -> dict[str, str]:
    """A throwaway key store with one key for the validation run (the deployment's own store
    gets no validation keys); the request headers that carry it."""
    if cfg.gateway.auth == "off":
        return {}
    pepper = secrets.token_hex(32)
    url = f"sqlite:///{folder / 'keys.db'}"
    tiers = cfg.gateway.tiers
    tier = max(tiers, key=lambda t: (tiers[t].requests_per_minute, tiers[t].tokens_per_minute))
    store = KeyStore(url, pepper.encode(), cfg.gateway.key_prefix, tiers=list(tiers))
    _, key = store.create("infra-validation", tier)
    store.close()
    env.update({"TUNELOOP__GATEWAY__KEY_STORE_URL": url, PEPPER_ENV: pepper})
    return {"Authorization": f"Bearer {key}"}


def check_server(
    command: ServeCommand, port: int, log_path: Path, timeout: float, label: str, headers: dict[str, str] | None = None
) -> InfraValidation:
    """Run a serve command until /readyz, check the OpenAI answers, always stop it."""
    started = time.perf_counter()
    base = f"http://127.0.0.1:{port}"

    def result(passed: bool, reason: str, **kw) -> InfraValidation:
        return InfraValidation(
            passed,
            label,
            reason,
            seconds=round(time.perf_counter() - started, 1),
            log_path=str(log_path),
            log_tail=_tail(log_path),
            **kw,
        )

    with open(log_path, "w") as fh:
        # its own group: stopping it stops its workers; and it stops if this process is killed first
        proc = subprocess.Popen(
            die_with_parent(command.argv),
            cwd=command.cwd,
            env=command.env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with httpx.Client(timeout=60, headers=headers) as client:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    return result(False, f"the server exited (code {proc.returncode}) before it was ready")
                crashed = _startup_failure(log_path)
                if crashed:
                    # BentoML restarts a crashed worker forever; one crash is the answer.
                    return result(False, f"the service failed to start: {crashed}")
                if time.monotonic() > deadline:
                    return result(False, f"not ready after {timeout:.0f} s (GET /readyz never answered 200)")
                try:
                    if client.get(f"{base}/readyz", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass  # not listening yet
                time.sleep(0.5)
            ready = round(time.perf_counter() - started, 1)
            try:
                model, completion, chat = _check_answers(client, base)
            except (ValueError, httpx.HTTPError) as exc:
                return result(False, f"ready after {ready} s, but {exc}", seconds_to_ready=ready)
        return result(
            True,
            f"ready after {ready} s; {model} answered a completion and a chat completion",
            seconds_to_ready=ready,
            completion=completion,
            chat=chat,
        )
    finally:
        stop_process_group(proc)


@dataclass
class ServeOutcome:
    exit_code: int
    failure: str | None = None  # the one-line reason when the server could not start


def run_server(command: ServeCommand, host: str, port: int, out=None) -> ServeOutcome:
    """Run a serve command in the foreground until it ends; what `tuneloop serve` does.

    Its output passes through. When the service cannot start (a model that does not load,
    a failed warm-up), BentoML would restart its worker forever: the first failure ends the
    server instead, with its reason. SIGINT / SIGTERM go to the server's process group, so
    it drains and stops as it would on its own. Once /readyz answers 200 one line says so.
    """
    out = out or sys.stdout
    proc = subprocess.Popen(
        command.argv,
        cwd=command.cwd,
        env=command.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
        errors="replace",
    )

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.perf_counter()

    def announce_ready() -> None:
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        print(
                            f"tuneloop: ready after {time.perf_counter() - started:.0f} s; OpenAI API on {url}/v1",
                            file=out,
                            flush=True,
                        )
                        return
            except OSError:
                pass
            time.sleep(0.5)

    threading.Thread(target=announce_ready, name="readyz-watch", daemon=True).start()
    recent: deque[str] = deque(maxlen=400)  # enough for the traceback before BentoML's line
    failure = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            recent.append(line)
            if any(marker in line for marker in STARTUP_FAILURES):
                failure = startup_failure("".join(recent))
                break
    finally:
        if failure is not None or proc.poll() is None:  # failed, or we are leaving early
            stop_process_group(proc)
        proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure is not None:
        return ServeOutcome(1, failure)
    return ServeOutcome(proc.returncode if proc.returncode >= 0 else 128 - proc.returncode)
