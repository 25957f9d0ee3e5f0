"""Schemathesis over a served OpenAI API: what test_serving_api.py runs against each engine
and test_gateway_serve.py through the gateway with auth on."""

from __future__ import annotations

import json
import urllib.request

FREE_FORM = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
)


def fuzz_openai_routes(
    url: str, model_names: list[str], headers: dict | None = None, max_examples: int = 60
) -> dict[tuple, int]:
    """Schemathesis over every /v1 operation of the served spec; asserts no 5xx and only
    OpenAI-shaped errors; returns how often each (mode, method, path, status) was seen."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import response_schema_conformance

    with urllib.request.urlopen(f"{url}/docs.json", timeout=10) as r:
        spec = json.loads(r.read())
    names = {"type": "string", "enum": model_names}
    for request in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        spec["components"]["schemas"][request]["properties"]["model"] = names
    for param in spec["paths"]["/v1/models/{model}"]["get"]["parameters"]:
        param["schema"] = names
    # Free-form JSON fields (a schema, a grammar, tools) that random data almost never makes
    # valid: left out of the valid requests, so some of them are answered 200; the invalid
    # requests still send them (their spec is untouched).
    positive = json.loads(json.dumps(spec))
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        props = positive["components"]["schemas"][request]["properties"]
        for field in FREE_FORM:
            if field in props:
                props[field] = {"type": "null"}
    # A chat message's rules across fields (content may be null only on an assistant message
    # that calls tools; a tool message answers a call): valid requests keep plain messages.
    message = positive["components"]["schemas"]["ChatMessage"]
    message["properties"]["role"] = {"type": "string", "enum": ["system", "user", "assistant", "developer"]}
    content = message["properties"]["content"]
    content["anyOf"] = [option for option in content.get("anyOf", []) if option.get("type") != "null"]
    for field in ("tool_calls", "tool_call_id"):
        message["properties"][field] = {"type": "null"}
    message["required"] = sorted({*message.get("required", []), "role", "content"})
    schemas = {
        GenerationMode.POSITIVE: schemathesis.openapi.from_dict(positive),
        GenerationMode.NEGATIVE: schemathesis.openapi.from_dict(spec),
    }
    seen: dict[tuple, int] = {}
    failures: list[str] = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for result in schemas[mode].get_all_operations():
            op = result.ok()
            if not op.path.startswith("/v1"):
                continue

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=max_examples,
                deadline=None,
                phases=[Phase.generate],
                database=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
            )
            def check(case):  # run at once, inside this loop's turn (hypothesis refuses defaults here)
                response = case.call(base_url=url, timeout=60, headers=headers)
                key = (mode.value, op.method.upper(), op.path, response.status_code)  # noqa: B023
                seen[key] = seen.get(key, 0) + 1
                where = f"{key}: {case.body!r:.300}"
                if response.status_code >= 500:
                    failures.append(f"{where} -> {response.text[:300]}")
                elif response.status_code >= 400:
                    error = response.json().get("error")
                    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
                        failures.append(f"{where} -> not OpenAI-shaped: {response.text[:300]}")
                elif "json" in response.headers.get("content-type", [""])[0]:
                    try:
                        case.validate_response(response, checks=[response_schema_conformance])
                    except Exception as exc:  # noqa: BLE001 - collected and reported below
                        failures.append(f"{where} -> {str(exc)[:300]}")

            try:
                check()
            except hypothesis.errors.Unsatisfiable:
                pass  # no invalid request exists for a route without parameters
    assert not failures, "\n".join(failures[:10])
    return seen
