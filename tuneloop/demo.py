"""The closed loop on one machine, as `tuneloop demo` runs it after the first training.

A real `tuneloop serve` of the champion's bento, driven by the official `openai` client
with a demo API key, through the gateway and the request log:

  1. traffic from the training distribution, then the monitoring flow: no drift;
  2. shifted traffic (tuneloop/data/sample.py: shifted_prompts) and one feedback
     correction, then the monitoring flow again: drift, and the `tuneloop.retrain.requested`
     event with the data path (base set + feedback rows) in its payload;
  3. the retrain that event asks for: the training flow on that data, from the champion
     (monitoring.retrain_init_from), blessed and promoted only if it beats the champion;
  4. the running server moves to the new champion in place (serving.follow_champion_s),
     while a client streams all along; the demo counts its failures (there should be none).

Step 3 depends on where Prefect runs. On the ephemeral Prefect API of the embedded defaults
there are no deployments and no worker to run the training deployment's trigger, so the
loop runs the flow the trigger would run, with the event's own parameters (retrain="flow").
With a Prefect server (prefect.api_url) where `prefect deploy --all` registered the
deployments and a worker serves their pool, the event's trigger runs it and the loop waits
for the new champion (retrain="trigger"; tests/e2e/test_loop_e2e.py runs that path).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import httpx

from tuneloop.data.dataset import prepare_dataset
from tuneloop.data.sample import shifted_prompts
from tuneloop.ports import free_port, stop_process_group
from tuneloop.registry import ModelRegistry

CALM_REQUESTS = 60  # of each kind, by default


def create(client, model: str, prompt, **params):
    """A chat completion for messages, a (legacy) completion for a raw prompt string: traffic
    the way the champion was trained (legacy prompt/completion rows are raw text)."""
    if isinstance(prompt, str):
        return client.completions.create(model=model, prompt=prompt, **params)
    return client.chat.completions.create(model=model, messages=prompt, **params)


@dataclass
class Streamer:
    """A client that streams completions until stopped, counting what it saw."""

    client: object
    model: str
    prompts: list  # each a chat request's messages or a completions request's raw prompt
    served: list[str] = field(default_factory=list)  # the `model` of each finished stream
    failures: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # prompts the content filter refused (400 content_filter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "Streamer":
        self._thread = threading.Thread(target=self._run, name="demo-streamer", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        rng = random.Random(7)
        while not self._stop.is_set():
            prompt = rng.choice(self.prompts)
            try:
                chunks = list(create(self.client, self.model, prompt, max_tokens=8, stream=True))
                self.served.append(chunks[0].model)
            except Exception as exc:  # noqa: BLE001 - counted and reported, never hidden
                if _filtered(exc):  # the gateway's answer to a flagged prompt: counted apart
                    self.refused.append(str(prompt)[:200])
                else:
                    self.failures.append(repr(exc)[:300])
            self._stop.wait(0.3)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)


def request_prompt(example):
    """What a client would send for a training example (its prompt side): the messages of a
    conversation, the raw prompt of a legacy row."""
    if example.messages:
        return [dict(m) for m in example.messages[:-1]]
    return example.prompt or ""


def start_server(cfg, port: int, log_path: Path) -> subprocess.Popen:
    """`tuneloop serve` in its own process group (the deployed bento, on its packaged config:
    it follows the registry's champion every serving.follow_champion_s)."""
    log = open(log_path, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "tuneloop.cli", "serve", "--port", str(port)]
        + (["--config", str(cfg.source)] if cfg.source else []),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the server exited ({proc.returncode}) before it was ready; its log "
                f"{log_path}:\n{log_path.read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}/readyz not ready after {timeout:.0f} s; log {log_path}")


def _filtered(exc: Exception) -> bool:
    """A 400 content_filter: the gateway refused the prompt (a false positive on ordinary traffic
    is counted and reported; it is the filter's answer, not a failure of the server)."""
    return getattr(exc, "code", None) == "content_filter"


def send(client, model: str, prompts: list, workers: int = 4, refused: list | None = None) -> list[str]:
    """One completion per prompt (a few at a time); returns each request's x-request-id. A prompt
    the content filter refuses goes into `refused` (its request is logged all the same)."""

    def one(prompt):
        try:
            raw = create(client.with_raw_response, model, prompt, max_tokens=8)
        except Exception as exc:
            if refused is None or not _filtered(exc):
                raise
            refused.append(str(prompt)[:200])
            return exc.response.headers.get("x-request-id", "")
        raw.parse()
        return raw.headers.get("x-request-id", "")

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, prompts))


def served_version(url: str, key: str) -> str:
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run_loop(
    cfg,
    config_path: str | None,
    say: Callable[[str], None],
    rule: Callable[[str], None],
    retrain: str = "auto",
    retrain_timeout_s: float = 900,
    requests: int = CALM_REQUESTS,
) -> dict:
    """Steps 1-4 above against a served champion; returns what happened (also for tests).

    retrain: "flow" (run the training flow here), "trigger" (the training deployment's
    trigger runs it on a worker; wait for the new champion), "auto" (trigger when a Prefect
    server is configured, else flow). requests: how many of each kind of traffic (with the
    streaming client's, at least monitoring.drift.min_requests per window)."""
    if retrain == "auto":
        retrain = "trigger" if (cfg.prefect.api_url or os.environ.get("PREFECT_API_URL")) else "flow"
    if retrain not in ("flow", "trigger"):
        raise ValueError(f"retrain must be auto, flow or trigger, got {retrain!r}")
    import openai

    from flows.monitoring import monitoring_flow
    from flows.training import training_flow
    from tuneloop.gateway.pipeline import open_key_store

    out: dict = {"stream_failures": [], "retrain": None, "filter_refusals": []}
    logs = cfg.home / "demo"
    logs.mkdir(parents=True, exist_ok=True)
    record, key = open_key_store(cfg).create(f"demo-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}", "enterprise")
    out["key_id"], out["key"] = record.id, key
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = logs / "serve.log"
    rule("5a. serve the champion")
    server = start_server(cfg, port, log_path)
    streamer = None
    try:
        wait_ready(url, server, log_path)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        first = served_version(url, key)
        name = first.split(":")[0]
        out["served_before"], out["model"], out["url"] = first, name, url
        say(f"serving {first} on {url}/v1 (log {log_path})")

        prepared = prepare_dataset(cfg)
        calm = [request_prompt(e) for e in prepared.train]
        streamer = Streamer(client, name, calm).start()  # streams through everything below

        rule("5b. traffic like the training data -> monitoring")
        since = datetime.now(timezone.utc).isoformat()
        send(client, name, random.Random(0).sample(calm, min(requests, len(calm))), refused=out["filter_refusals"])
        time.sleep(cfg.request_log.flush_interval_s + 0.5)  # one flush interval: the log has them
        calm_result = monitoring_flow(config_path=config_path, since=since)
        out["calm"] = _verdict(calm_result)
        say(f"monitoring: {out['calm']['verdict']}  scores {out['calm']['scores']}")

        rule("5c. shifted traffic + feedback -> monitoring")
        since = datetime.now(timezone.utc).isoformat()
        legacy = all(isinstance(p, str) for p in calm)  # shifted traffic the same way
        shifted = [t if legacy else [{"role": "user", "content": t}] for t in shifted_prompts(requests)]
        ids = send(client, name, shifted, refused=out["filter_refusals"])
        client.post(
            "/feedback",
            cast_to=object,
            body={
                "request_id": ids[0],
                "rating": -1,
                "correction": "Pack light layers and book the museum early.",
                "comment": "tuneloop demo: a corrected answer becomes a training row",
            },
        )
        time.sleep(cfg.request_log.flush_interval_s + 0.5)
        shifted_result = monitoring_flow(config_path=config_path, since=since)
        out["shifted"] = _verdict(shifted_result)
        out["report"] = shifted_result.get("report")
        say(f"monitoring: {out['shifted']['verdict']}  scores {out['shifted']['scores']}")
        say(
            f"events: {', '.join(out['shifted']['events']) or 'none'}"
            + (f"  ({shifted_result['debounced']})" if shifted_result.get("debounced") else "")
        )

        event = next((e for e in shifted_result["events"] if e["event"] == "tuneloop.retrain.requested"), None)
        if event is not None:
            p = event["payload"]
            rule("5d. the retrain the event requests")
            say(f"data {p['data_path']} ({p['feedback_rows']} feedback row(s)), weights from the {p['init_from']}")
            before = out["champion_before"] = _champion_version(cfg)
            if retrain == "flow":
                say("no worker on the ephemeral Prefect API: running the flow the training deployment's trigger runs")
                summary = training_flow(config_path=config_path, data=p["data_path"], init_from=p["init_from"])
                out["retrain"] = {
                    k: summary.get(k)
                    for k in ("blessed", "promoted", "reasons", "champion_after", "init_from", "challenger")
                }
                promoted = summary["promoted"]
            else:
                say(
                    f"the training deployment's trigger runs it on a worker; waiting up to {retrain_timeout_s:.0f} s "
                    "for a new champion"
                )
                promoted = _wait(
                    lambda: _champion_version(cfg) != before,
                    retrain_timeout_s,
                    say,
                    "waiting for the triggered training run",
                )
                out["retrain"] = {"promoted": promoted, "champion_after": _champion_version(cfg)}
            if promoted:
                want = f"{name}:{_champion_version(cfg)}"
                rule("5e. the running server moves to the new champion")
                _wait(lambda: served_version(url, key) == want, 180, say, f"waiting for the server to serve {want}")
                time.sleep(2)  # a few more streams on the new version
                out["served_after"] = served_version(url, key)
                say(f"serving {out['served_after']} (was {first})")
            else:
                reasons = "; ".join(out["retrain"].get("reasons") or ["no new champion within the timeout"])
                say(f"the retrained candidate was not promoted; the server keeps {first} ({reasons})")
    finally:
        if streamer is not None:
            streamer.stop()
            out["streams"], out["stream_failures"] = len(streamer.served), streamer.failures
            out["filter_refusals"] += streamer.refused
            out["streamed_versions"] = sorted(set(streamer.served))
        stop_process_group(server, term_wait=60)
    out["champion"] = _champion_version(cfg)
    return out


def _champion_version(cfg) -> str | None:
    champion = ModelRegistry.from_config(cfg).champion()
    return champion.version if champion else None


def _wait(done: Callable[[], bool], timeout: float, say: Callable[[str], None], what: str) -> bool:
    started = time.time()
    last = started
    while not done():
        if time.time() - started > timeout:
            return False
        if time.time() - last >= 15:
            say(f"{what} ({time.time() - started:.0f} s)")
            last = time.time()
        time.sleep(1)
    return True


def _verdict(result: dict) -> dict:
    d = result["drift"]
    verdict = ("drift detected" if d["detected"] else "no drift") if d["judged"] else f"not judged: {d['reason']}"
    return {
        "verdict": verdict,
        "detected": d["detected"],
        "judged": d["judged"],
        "scores": {k: round(v, 3) for k, v in d["scores"].items() if v is not None},
        "events": [e["event"] for e in result["events"]],
        "requests": result["window"]["requests"],
    }
