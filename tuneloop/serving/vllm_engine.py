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
`token_id:N` strings (`return_tokens_as_token_ids`). The prompt tokens vLLM's prefix cache
reused come in the usage of its last chunk (--enable-prompt-tokens-details), and become the
stream's cached_tokens. Cancelling a stream closes its HTTP
request, which makes vLLM abort the generation. If the vLLM process dies, every running
request fails with 503 and is_running (what /readyz reads) turns false.

LoRA adapters (serving.lora): vLLM runs with --enable-lora (--max-loras and --max-cpu-loras
serving.lora.max_loaded: adapters in one batch and held; --max-lora-rank the smallest rank
vLLM accepts >= serving.lora.max_rank) and VLLM_ALLOW_RUNTIME_LORA_UPDATING, so that an
adapter is registered at runtime the first time a request names it (POST
/v1/load_lora_adapter with its name and folder), and its requests then name it as their
model; vLLM applies each row's adapter in its batch (its punica kernels) and keeps the
least recently used ones out of memory beyond --max-cpu-loras, reading them again from their
folder when asked. Adapters are checked here first (lora.py's AdapterChecker), so a bad one
is the same 400 as with the slots engine. vLLM's CPU backend turns torch.compile off when
LoRA is on (vllm/platforms/cpu.py); serving.lora.enabled: false keeps it for the base alone.

vLLM 0.32's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py) gather each token's adapter
weights with its slot index, and a token without an adapter has index -1: Python's last
slot, not none. A base request batched beside adapter requests was answered with whatever
adapter sat in the last slot (seen in test_serving_vllm.py: base rows wrong, adapter rows
right). So with LoRA on, base requests name an adapter too: a zero one (rank 1, B = 0, on
one projection) that this engine writes at start, with a slot of its own (--max-loras is
serving.lora.max_loaded + 1). It computes nothing more than the -1 rows did.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx

from tuneloop.config import ServingLoraConfig
from tuneloop.ports import free_port, stop_process_group
from tuneloop.serving.constraints import JSON_OPTIONS, Constraint, gbnf_to_lark
from tuneloop.serving.engine import GenerationStream, LoadedModel
from tuneloop.serving.errors import InternalError, InvalidRequest, ServingSetupError, Unavailable
from tuneloop.serving.lora import AdapterChecker, AdapterError, AdapterRef, AdaptersNotServed, config_targets

log = logging.getLogger(__name__)

ENGINE_MODEL_NAME = "tuneloop-engine"  # what vLLM serves the folder as (internal; never shown to clients)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what its --max-lora-rank accepts (vllm/config/lora.py)


# Whether vLLM serves LoRA on the model's architecture (its model class is SupportsLoRA);
# run with vLLM's Python, the model folder as argv[1]; prints one JSON line.
LORA_PROBE = """
import json, sys
from transformers import AutoConfig
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_lora
arch = (AutoConfig.from_pretrained(sys.argv[1]).architectures or ["?"])[0]
cls = ModelRegistry._try_load_model_cls(arch)
print(json.dumps({"architecture": arch, "lora": bool(cls is not None and supports_lora(cls))}))
"""
BASE_ADAPTER = "tuneloop-base"  # the zero adapter base requests name when LoRA is on (module docstring)


def write_zero_adapter(folder: Path, module: str, out_features: int, in_features: int) -> Path:
    """A peft-format LoRA of rank 1 on `module` whose B is zero: the base model's answers."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": 1,
        "lora_alpha": 1,
        "target_modules": [module.rsplit(".", 1)[1]],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    shapes = {"lora_A": [1, in_features], "lora_B": [out_features, 1]}
    header, at = {}, 0
    for which, shape in shapes.items():
        size = 4 * shape[0] * shape[1]
        header[f"base_model.model.{module}.{which}.weight"] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [at, at + size],
        }
        at += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(at))
    return folder


def vllm_lora_rank(max_rank: int) -> int:
    """vLLM's --max-lora-rank for serving.lora.max_rank: the smallest value it accepts that is not below it."""
    return next((r for r in VLLM_LORA_RANKS if r >= max_rank), VLLM_LORA_RANKS[-1])


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
        lora: ServingLoraConfig | None = None,
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
        # LoRA adapters: registered with vLLM on first use (name -> its folder, or the
        # registration under way); checked here first, as the slots engine does.
        self.lora = lora if lora is not None else ServingLoraConfig()
        self.supports_adapters = self.lora.enabled
        self.adapter_refusal = None if self.lora.enabled else "serving.lora.enabled is false"
        self._adapters: dict[str, tuple[str, asyncio.Task]] = {}
        self._adapter_checker: AdapterChecker | None = None
        self.base_adapter: AdapterRef | None = None  # what base requests name with LoRA on (module docstring)
        self._scratch: Path | None = None
        self._start_lock = threading.Lock()  # stop() against a start still under way (launch)

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
            # constraints go to the same grammar library as in tuneloop's engines (our Lark
            # grammars use its %json; JSON is written the same way: JSON_OPTIONS)
            "--structured-outputs-config",
            json.dumps({"backend": "guidance"}),
            # its prefix cache's reused tokens in usage (stream_options below): usage's cached_tokens
            "--enable-prompt-tokens-details",
            *self.lora_args(),
            *self.extra_args,
        ]

    def lora_args(self) -> list[str]:
        if not self.supports_adapters:
            return []
        held = str(self.lora.max_loaded + 1)  # and the base's zero adapter
        return [
            "--enable-lora",
            "--max-loras",
            held,
            "--max-cpu-loras",
            held,
            "--max-lora-rank",
            str(vllm_lora_rank(self.lora.max_rank)),
        ]

    def launch(self) -> None:
        """Start vLLM (on a thread: with serving.lora on, vLLM's Python is first asked whether it
        serves LoRA adapters on this architecture, ~7 s; it refuses to start with --enable-lora
        where it does not, e.g. GPT-2, the demo model's)."""
        threading.Thread(target=self._start, name="vllm-engine-watch", daemon=True).start()

    def _start(self) -> None:
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        if self.supports_adapters:
            self._check_lora_support()
        if self.supports_adapters:  # /v1/load_lora_adapter: adapters registered while it serves
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
            self._write_base_adapter()
        if self.kv_cache_gib is not None:  # vLLM's CPU backend takes whole GiB
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.kv_cache_gib)))
        out = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        with self._start_lock:
            if self._stopping:
                return
            log.info("vllm engine: starting %s", " ".join(self.command()))
            self._proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._watch()

    def _check_lora_support(self) -> None:
        """Ask vLLM's Python whether its model class for this architecture serves LoRA."""
        try:
            out = subprocess.run(
                [str(self.python), "-c", LORA_PROBE, str(self.loaded.path)],
                capture_output=True,
                text=True,
                timeout=180,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
            )
            found = json.loads(out.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            found = {"architecture": "?", "lora": False, "error": f"{type(exc).__name__}: {exc}"}
        if not found.get("lora"):
            self.supports_adapters = False
            self.adapter_refusal = (
                f"vLLM serves no LoRA adapters for {found['architecture']}"
                if "error" not in found
                else f"vLLM's LoRA support could not be checked ({found['error']})"
            )
            log.warning("vllm engine: without LoRA adapters: %s", self.adapter_refusal)

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

    def _write_base_adapter(self) -> None:
        from transformers import AutoConfig

        targets = config_targets(AutoConfig.from_pretrained(self.loaded.path))
        if not targets:
            log.warning(
                "vllm engine: no zero adapter for %s's architecture: base requests batched beside adapter "
                "requests may be answered with an adapter (vLLM's CPU LoRA ops; see vllm_engine.py)",
                self.loaded.path,
            )
            return
        module, (out_features, in_features) = next(iter(targets.items()))
        self._scratch = Path(tempfile.mkdtemp(prefix="tuneloop-vllm-"))
        folder = write_zero_adapter(self._scratch / "base-adapter", module, out_features, in_features)
        self.base_adapter = AdapterRef(BASE_ADAPTER, str(folder))

    def stop(self, timeout: float = 20.0) -> None:
        with self._start_lock:
            self._stopping = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            stop_process_group(proc, term_wait=timeout, kill_wait=5)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

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
        if stream.params.adapter is not None:
            self.check_adapter(stream.params.adapter)
        stream.claimed = True
        task = stream.loop.create_task(self._generate(stream))
        stream.add_cancel_hook(task.cancel)

    def check_adapter(self, ref: AdapterRef) -> None:
        """Raise AdaptersNotServed or AdapterError (400s) for a request naming `ref` that cannot be served."""
        if not self.supports_adapters:
            raise AdaptersNotServed(
                f"model {ref.name!r} is a LoRA adapter and this server serves none: {self.adapter_refusal}"
            )
        if self._adapter_checker is None:
            from transformers import AutoConfig

            self._adapter_checker = AdapterChecker(
                config_targets(AutoConfig.from_pretrained(self.loaded.path)), self.lora.max_rank
            )
        self._adapter_checker.check(ref)

    def _adapter_of(self, stream: GenerationStream) -> AdapterRef | None:
        """The adapter vLLM runs the stream with: its own, or for a base request the zero one."""
        return stream.params.adapter if stream.params.adapter is not None else self.base_adapter

    async def _register(self, ref: AdapterRef) -> None:
        """Register the adapter with vLLM once: its first request starts it, the others wait
        for the same registration (a task of its own, so a request that goes away stops
        only its own wait)."""
        known = self._adapters.get(ref.name)
        failed = known is not None and known[1].done() and (known[1].cancelled() or known[1].exception() is not None)
        if known is None or known[0] != ref.path or failed:
            task = asyncio.get_running_loop().create_task(self._load_adapter(ref, again=known is not None))
            known = self._adapters[ref.name] = (ref.path, task)
        await asyncio.shield(known[1])

    async def _load_adapter(self, ref: AdapterRef, again: bool) -> None:
        started = time.perf_counter()
        r = await self._client.post(
            "/v1/load_lora_adapter", json={"lora_name": ref.name, "lora_path": ref.path, "load_inplace": again}
        )
        if r.status_code != 200 and "already been loaded" not in r.text:
            message = r.text[:500]
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise AdapterError(f"adapter {ref.name!r} cannot be served: vLLM did not load it: {message}")
        log.info("vllm engine: adapter %s registered in %.0f ms", ref.name, (time.perf_counter() - started) * 1000)

    def body(self, stream: GenerationStream) -> dict:
        p, adapter = stream.params, self._adapter_of(stream)
        body = {
            # an adapter's requests name it: vLLM applies it to their rows
            "model": adapter.name if adapter is not None else ENGINE_MODEL_NAME,
            "prompt": stream.prompt_ids,
            "max_tokens": p.max_new_tokens,
            "temperature": 0.0 if p.greedy else p.temperature,
            "top_p": p.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},  # a last chunk with usage: its cached_tokens
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
        if p.constraint is not None:  # vLLM's structured outputs, by its llguidance backend (command())
            body["structured_outputs"] = vllm_structured_outputs(p.constraint)
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
            adapter = self._adapter_of(stream)
            if adapter is not None:
                await self._register(adapter)
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
                    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
                    stream.note_cached(int(details.get("cached_tokens") or 0))
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
        except (InvalidRequest, InternalError, Unavailable) as exc:  # AdapterError is an InvalidRequest
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


def vllm_structured_outputs(c: Constraint) -> dict:
    """A constraint as vLLM's `structured_outputs` request field."""
    if c.kind in ("json_schema", "json_object"):
        schema = json.loads(c.spec) if c.kind == "json_schema" else {"type": "object"}
        return {"json": {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema}
    if c.kind == "choice":
        return {"choice": json.loads(c.spec)}
    if c.kind == "grammar" and "::=" in c.spec:  # GBNF: as Lark, as our engines read it
        return {"grammar": gbnf_to_lark(c.spec)}
    return {c.kind: c.spec}  # regex, grammar
