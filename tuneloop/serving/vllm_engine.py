"""The "vllm" engine: vLLM's OpenAI server as the bento's generation process.

Where vLLM is the better engine (GPU hosts; on this CPU, real models: docs/benchmarks.md),
tuneloop keeps everything in front of the engine -- its routes, parameter checks, chat
template, stop strings, admission, deadlines, metrics, and later the gateway and request
log -- and hands the generation itself to vLLM. vLLM runs as a child process in its own
process group, on 127.0.0.1 only, from its own Python (`serving.vllm_python`, default the
venv `make vllm-venv` builds: vLLM pins another transformers than tuneloop).

Each GenerationStream becomes one streamed POST /v1/completions with the prompt as token
ids and `return_token_ids` (vLLM's extension), so tokens come back as ids, which tuneloop's
TextAssembler turns into text as for every other engine. Sampling parameters map one to
one (vLLM applies logit_bias, penalties, seed and ignore_eos itself); logprobs come back as
`token_id:N` strings (`return_tokens_as_token_ids`). Cancelling a stream closes its HTTP
request, which makes vLLM abort the generation. If the vLLM process dies, every running
request fails with 503 and is_running (what /readyz reads) turns false.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import httpx

from tuneloop.ports import free_port, stop_process_group
from tuneloop.serving.engine import GenerationStream, LoadedModel
from tuneloop.serving.errors import InternalError, InvalidRequest, ServingSetupError, Unavailable

log = logging.getLogger(__name__)

ENGINE_MODEL_NAME = "tuneloop-engine"  # what vLLM serves the folder as (internal; never shown to clients)


def vllm_dtype(serving_dtype: str) -> str:
    """vLLM's --dtype for serving.dtype: float32 for auto and float32 (the reference's answers;
    vLLM's bfloat16 answered 12 of 24 prompts as float32 does on SmolLM2-135M), bfloat16 for
    bfloat16-lossy."""
    return "bfloat16" if serving_dtype == "bfloat16-lossy" else "float32"


class VLLMEngine:
    """An API Backend (tuneloop/api/server.py) over a vLLM OpenAI server child process."""

    engine = "vllm"

    def __init__(
        self,
        loaded: LoadedModel,
        python: Path,
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_gib: float | None = None,
        extra_args: list[str] | None = None,
        ready_timeout_s: float = 600.0,
        log_path: Path | None = None,
    ):
        if not Path(python).exists():
            raise ServingSetupError(
                f"serving.engine is vllm but there is no vLLM Python at {python}: "
                "run `make vllm-venv`, or set serving.vllm_python"
            )
        self.loaded = loaded
        self.python = Path(python)
        self.dtype = dtype
        self.max_model_len = min(max_model_len or loaded.context_length, loaded.context_length)
        self.kv_cache_gib = kv_cache_gib
        self.extra_args = list(extra_args or [])
        self.ready_timeout_s = ready_timeout_s
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = threading.Event()  # start-up is over (serving, or failed: see is_running)
        self.failed: str | None = None  # why the child did not come up, or died
        self._proc: subprocess.Popen | None = None
        self._client = None  # httpx.AsyncClient, made on the event loop that submits
        self._streams: dict[str, GenerationStream] = {}  # running, for a dead child to fail them
        self._stopping = False  # stop() was called: the child's exit is expected

    # ---- lifecycle --------------------------------------------------------------------
    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.loaded.path),
            "--served-model-name",
            ENGINE_MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            *self.extra_args,
        ]

    def launch(self) -> None:
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        if self.kv_cache_gib is not None:  # vLLM's CPU backend takes whole GiB
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.kv_cache_gib)))
        out = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        log.info("vllm engine: starting %s", " ".join(self.command()))
        self._proc = subprocess.Popen(
            self.command(), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        threading.Thread(target=self._watch, name="vllm-engine-watch", daemon=True).start()

    def _watch(self) -> None:
        """Wait for vLLM's /health; then notice if the child dies."""
        started = time.monotonic()
        while not self.ready.is_set():
            if self._proc.poll() is not None:
                self._died(f"vLLM exited with code {self._proc.returncode} before it was ready{self._log_hint()}")
                return
            if time.monotonic() - started > self.ready_timeout_s:
                self._died(f"vLLM was not ready after {self.ready_timeout_s:.0f} s{self._log_hint()}")
                self.stop()
                return
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        log.info("vllm engine: ready in %.0f s on %s", time.monotonic() - started, self.url)
                        self.ready.set()
            except OSError:
                time.sleep(0.5)
        code = self._proc.wait()
        if not self._stopping:
            self._died(f"vLLM exited with code {code}{self._log_hint()}")

    def _log_hint(self) -> str:
        return f" (its log: {self.log_path})" if self.log_path else ""

    def _died(self, why: str) -> None:
        self.failed = why
        self.ready.set()  # start-up is over, badly: whoever waits for it reads is_running / failed
        log.error("vllm engine: %s", why)
        error = Unavailable(f"the generation engine died: {why}", retry_after_s=1)
        for stream in list(self._streams.values()):
            stream.finish("error", error)

    def stop(self, timeout: float = 20.0) -> None:
        self._stopping = True
        if self._proc is not None and self._proc.poll() is None:
            stop_process_group(self._proc, term_wait=timeout, kill_wait=5)

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.failed is None

    @property
    def context_length(self) -> int:
        return self.max_model_len

    # ---- requests ---------------------------------------------------------------------
    def submit(self, stream: GenerationStream) -> None:
        """Start stream's generation (call on its event loop)."""
        if not self.ready.is_set() or not self.is_running:
            raise Unavailable(
                f"the generation engine is not ready{': ' + self.failed if self.failed else ''}", retry_after_s=2
            )
        stream.claimed = True
        task = stream.loop.create_task(self._generate(stream))
        stream.add_cancel_hook(task.cancel)

    def body(self, stream: GenerationStream) -> dict:
        p = stream.params
        body = {
            "model": ENGINE_MODEL_NAME,
            "prompt": stream.prompt_ids,
            "max_tokens": p.max_new_tokens,
            "temperature": 0.0 if p.greedy else p.temperature,
            "top_p": p.top_p,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": p.ignore_eos,
            "skip_special_tokens": False,
            # the same stop tokens as every engine (eos, <|im_end|>); none with ignore_eos
            "stop_token_ids": [] if p.ignore_eos else sorted(self.loaded.stop_ids),
        }
        if p.seed is not None:
            body["seed"] = p.seed % 2**63
        if p.presence_penalty:
            body["presence_penalty"] = p.presence_penalty
        if p.frequency_penalty:
            body["frequency_penalty"] = p.frequency_penalty
        if p.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in p.logit_bias}
        if p.logprobs is not None:
            body["logprobs"] = p.logprobs
            body["return_tokens_as_token_ids"] = True
        return body

    async def _generate(self, stream: GenerationStream) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url,
                timeout=httpx.Timeout(None, connect=5.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        self._streams[stream.request_id] = stream
        finish = "length"
        try:
            async with self._client.stream("POST", "/v1/completions", json=self.body(stream)) as r:
                if r.status_code != 200:
                    raise _engine_error(r.status_code, (await r.aread()).decode(errors="replace"))
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise _engine_error(int(event["error"].get("code") or 500), data)
                    for choice in event.get("choices", []):
                        ids = list(choice.get("token_ids") or [])
                        reason = choice.get("finish_reason")
                        if reason == "stop" and ids and ids[-1] in self.loaded.stop_ids:
                            ids.pop()  # a stop token ends the text; it is not part of it
                        if ids:
                            stream.emit(ids, _logprobs(choice.get("logprobs"), len(ids), stream.params.logprobs))
                        if reason is not None:
                            finish = "stop" if reason == "stop" else "length"
            stream.finish(finish)
        except asyncio.CancelledError:
            raise  # the stream was cancelled: closing the request made vLLM abort it
        except (InvalidRequest, InternalError, Unavailable) as exc:
            stream.finish("error", exc)
        except httpx.HTTPError as exc:
            stream.finish(
                "error", Unavailable(f"the generation engine did not answer ({type(exc).__name__})", retry_after_s=1)
            )
        except Exception as exc:  # noqa: BLE001 - this request fails, with the reason in the log
            log.exception("vllm engine: request %s failed", stream.request_id)
            stream.finish("error", exc)
        finally:
            self._streams.pop(stream.request_id, None)


def _engine_error(status: int, text: str):
    message = text[:500]
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    if 400 <= status < 500:
        return InvalidRequest(f"the engine refused the request: {message}")
    return InternalError(f"the engine failed: {message}")


def _logprobs(obj: dict | None, n: int, top: int | None):
    """vLLM's completions logprobs (tokens as `token_id:N`) as the stream's entries."""
    if top is None or not obj:
        return None
    entries = []
    for own, alternatives in list(zip(obj.get("token_logprobs") or [], obj.get("top_logprobs") or []))[:n]:
        pairs = sorted(
            ((int(k.split(":", 1)[1]), float(v)) for k, v in (alternatives or {}).items()), key=lambda kv: -kv[1]
        )
        entries.append((float(own), pairs[:top]))
    return entries
