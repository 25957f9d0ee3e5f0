"""The gateway's test setup, shared by the in-process gateway, request-log and checks'-process
tests: a config with the checks in threads unless asked otherwise, the bearer header, the
planted personal data and secrets that must never leak, a backend that records what the model
was given, and a model that answers with fixed text (one that repeats PII back)."""

from __future__ import annotations

import asyncio
from pathlib import Path


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def gateway_config(home: Path, **gateway):
    from tuneloop.config import TuneloopConfig

    # The checks in threads of this process: these tests replace the analyzer to make faults;
    # the checks' own process is tested in test_gateway_guard_process.py and the served stack.
    base = {"pii": {"mode": "off", "outputs": "off"}, "filter": {"classifier": None}, "checks_in": "thread"}
    return TuneloopConfig.model_validate({"paths": {"home": str(home)}, "gateway": _merge(base, gateway)})


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


PLANTED = {
    "email": "jane.doe@example.org",
    "phone": "+1 212-555-0199",
    "card": "4111 1111 1111 1111",
    "iban": "DE89 3704 0044 0532 0130 00",
    "ip": "192.168.13.77",
    "ssn": "078-05-1121",
    "openai key": "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
    "github token": "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
}


PLANTED_TEXT = " ".join(f"My {k} is {v}." for k, v in PLANTED.items())


class RecordingBackend:
    """Wraps the real engine and keeps the prompt ids it was given (what the model sees)."""

    def __init__(self, inner):
        self.inner = inner
        self.engine = inner.engine if hasattr(inner, "engine") else "continuous"
        self.prompts: list[list[int]] = []

    def submit(self, stream):
        self.prompts.append(list(stream.prompt_ids))
        self.inner.submit(stream)


class ScriptedModel:
    """A model that answers with fixed text (a model that repeats PII back), token by token:
    stands in for the model only, so the output side of the real redaction is tested."""

    engine = "scripted"

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def submit(self, stream):
        top = stream.params.logprobs

        async def run():
            for i in range(0, len(self.ids), 2):  # two tokens per step: entities split across chunks
                ids = self.ids[i : i + 2]
                # when asked: each token's logprob (-0.5) and `top` alternatives (the token itself first)
                stream.emit(ids, None if top is None else [(-0.5, [(t, -0.5), (0, -3.0)][:top]) for t in ids])
                await asyncio.sleep(0)
            stream.finish("stop")

        stream.claimed = True
        asyncio.get_running_loop().create_task(run())


def assert_clean(text: str, where: str) -> None:
    for label, value in PLANTED.items():
        assert value not in text, f"{label} ({value}) leaked in {where}: {text!r}"
    for secret in (PLANTED["openai key"], PLANTED["github token"]):
        for i in range(0, len(secret) - 8):
            assert secret[i : i + 8] not in text, f"part of a secret leaked in {where}"
