"""The slots engine's prefix cache through the real thing: `bentoml serve` (the engine in its own
process, the fused forward), driven by the official `openai` SDK, two servers side by side, one
with serving.prefix_cache on (the default) and one with it off.

A request whose long system prompt a slot still holds reports it in
usage.prompt_tokens_details.cached_tokens (chat, completions, the streamed usage chunk, the
Responses API's input_tokens_details), prefills only the rest (prompt_tokens - cached_tokens),
gets its first token sooner by a clear margin (the median of interleaved requests with the
prompt held and with a prompt no slot holds, on the same server), and answers as the server
without the cache does, token for token. The model is a random Llama big enough that
prefilling ~700 tokens takes a few hundred ms on one thread while the rest takes tens.
Which slot, adapters, weight swaps: tests/unit/test_prefix_cache.py."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.servers import GATEWAY_OFF, free_port, services
from tests.support.serving_tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

SYSTEM = (
    "A model server answers completions and chat completions over HTTP. Tokens are generated one at a "
    "time; batching shares the work between requests. "
) * 20
QUESTIONS = ["Hello world", "The quick brown fox jumps over", "x", "Continuous batching lets requests join", "Hi"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny serving model's tokenizer and chat template with a larger random Llama: 6 layers
    of 256, a 1024-token window."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = build_tiny_model(tmp_path_factory.mktemp("prefix-served"), context_length=1024, architecture="llama")
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _spec(model_dir: Path, tmp: Path, prefix_cache: bool) -> tuple[str, dict]:
    port = free_port()
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "BENTOML_HOME": str(tmp / "bentoml"),
        "TUNELOOP_HOME": str(tmp / "home"),
        "TUNELOOP_SERVE_MODEL_DIR": str(model_dir),
        "TUNELOOP_SERVE_ENGINE": "slots",
        "TUNELOOP_SERVE_MODEL_NAME": "tiny-chat",
        "TUNELOOP__SERVING__NUM_THREADS": "1",  # the machine has 2 shared cores; leave one to the clients
        "TUNELOOP__SERVING__DTYPE": "float32",
        "TUNELOOP__SERVING__MAX_BATCH_SIZE": "8",
        "TUNELOOP__SERVING__PREFIX_CACHE": str(prefix_cache).lower(),
        **GATEWAY_OFF,
    }
    cmd = [sys.executable, "-m", "bentoml", "serve", "bentos.service:TuneloopLLM", "--host", "127.0.0.1"]
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"serve-prefix-cache-{'on' if prefix_cache else 'off'}.log"
    return url, dict(
        cmd=[*cmd, "--port", str(port)], ready_url=f"{url}/readyz", log=log, env=env, timeout=300, cwd=ROOT
    )


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """{"on": url, "off": url}: the same model served with the prefix cache on and off."""
    tmp = tmp_path_factory.mktemp("serve-prefix")
    on, on_spec = _spec(model_dir, tmp, True)
    off, off_spec = _spec(model_dir, tmp, False)
    with services(on_spec, off_spec):
        yield {"on": on, "off": off}


def client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def messages(question: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def first_token(c, msgs: list[dict]) -> tuple[float, str, object]:
    """(seconds to the first content chunk, the answer, the streamed usage) of a streamed greedy chat."""
    started = time.perf_counter()
    stream = c.chat.completions.create(
        model="tiny-chat",
        messages=msgs,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft, text, usage = None, "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - started
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    return ttft if ttft is not None else time.perf_counter() - started, text, usage


def test_a_held_system_prompt_is_reported_cached_and_the_first_token_comes_sooner(servers):
    on = client(servers["on"])
    first = on.chat.completions.create(model="tiny-chat", messages=messages(QUESTIONS[0]), max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens > 600
    held, cold = [], []
    for i in range(5):  # interleaved, so that both kinds see the same load on a shared machine
        held.append(first_token(on, messages(QUESTIONS[i])))
        # a system prompt no slot holds: it differs from every earlier one within a few tokens
        cold.append(first_token(on, messages(QUESTIONS[i], system=f"Request {i}: {SYSTEM}")))
    for _, _, usage in held:
        details = usage.prompt_tokens_details
        assert details.cached_tokens > 600 and usage.prompt_tokens - details.cached_tokens < 30, usage
    for _, _, usage in cold:
        assert usage.prompt_tokens > 600 and usage.prompt_tokens_details.cached_tokens == 0, usage
    held_s, cold_s = statistics.median(t for t, _, _ in held), statistics.median(t for t, _, _ in cold)
    print(f"\nfirst token, median of 5: system prompt held {held_s * 1000:.0f} ms, not held {cold_s * 1000:.0f} ms")
    assert held_s < 0.5 * cold_s


def test_cached_answers_equal_the_uncached_servers_on_every_route(servers):
    on, off = client(servers["on"]), client(servers["off"])
    for c in (on, off):  # each server's slots hold the system prompt after this
        c.chat.completions.create(model="tiny-chat", messages=messages("warm"), max_tokens=2, temperature=0)
    answers = {}
    for name, c in (("on", on), ("off", off)):
        chats = [
            c.chat.completions.create(model="tiny-chat", messages=messages(q), max_tokens=12, temperature=0)
            for q in QUESTIONS
        ]
        answers[name] = [r.choices[0].message.content for r in chats]
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in chats]
        if name == "on":
            assert min(cached) > 600, cached
        else:
            assert cached == [0] * len(QUESTIONS)
        # completions, with the prompt as token ids and as text; the Responses API
        prompt = SYSTEM + " And now a completion:"
        comp = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0)
        again = c.completions.create(model="tiny-chat", prompt=prompt + " again", max_tokens=12, temperature=0)
        assert comp.usage.prompt_tokens > 600
        resp = c.responses.create(
            model="tiny-chat", instructions=SYSTEM, input=QUESTIONS[1], max_output_tokens=16, temperature=0
        )
        answers[name] += [comp.choices[0].text, again.choices[0].text, resp.output_text]
        if name == "on":
            assert again.usage.prompt_tokens_details.cached_tokens > 600
            assert resp.usage.input_tokens_details.cached_tokens > 600
        else:
            assert again.usage.prompt_tokens_details.cached_tokens == 0
            assert resp.usage.input_tokens_details.cached_tokens == 0
    assert answers["on"] == answers["off"]
    assert len(set(answers["on"])) > 3  # the questions get different answers: the comparison means something
