"""Vendor the response schemas our routes answer with from OpenAI's published OpenAPI spec.

    python tests/support/openai_schemas/extract.py SPEC [--source TEXT] [-o OUT]

SPEC is openapi.yaml (or openapi.json) of https://github.com/openai/openai-openapi. Writes one
JSON Schema (draft 2020-12) document whose `$defs` hold the ROOTS below and every schema they
reference, transitively, under their names in the spec's components/schemas. What changes on
the way (see README.md): `$ref`s point at `#/$defs/<name>`; OpenAPI's `nullable: true` becomes a
"null" type (or an anyOf with one); `$recursiveRef: "#"` becomes a `$ref` to its own schema;
the documentation-only keywords (description, title, example, discriminator, x-*) are dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOTS = [
    # /v1/chat/completions
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ChatCompletionMessageToolCall",
    "ChatCompletionMessageToolCalls",
    "ChatCompletionMessageToolCallChunk",
    # /v1/completions, /v1/embeddings, /v1/models, every error body
    "CreateCompletionResponse",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "ErrorResponse",
    # /v1/responses: the response object and its stream (the whole union, and the members we send)
    "Response",
    "ResponseStreamEvent",
    "ResponseCreatedEvent",
    "ResponseInProgressEvent",
    "ResponseOutputItemAddedEvent",
    "ResponseOutputItemDoneEvent",
    "ResponseContentPartAddedEvent",
    "ResponseContentPartDoneEvent",
    "ResponseTextDeltaEvent",
    "ResponseTextDoneEvent",
    "ResponseFunctionCallArgumentsDeltaEvent",
    "ResponseFunctionCallArgumentsDoneEvent",
    "ResponseCompletedEvent",
    "ResponseErrorEvent",
]

SPEC_PREFIX = "#/components/schemas/"
DROPPED = {"description", "title", "example", "examples", "discriminator", "$recursiveAnchor"}
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
SCHEMA_LISTS = {"allOf", "anyOf", "oneOf", "prefixItems"}
SCHEMA_ONE = {
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
}


def load_spec(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    import yaml

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        """Safe loading without YAML 1.1's timestamps: a date-like scalar stays the string the
        JSON form of the spec has."""

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    return yaml.load(text, Loader=Loader)


def convert(node, owner: str, refs: set[str], anchored: bool = False):
    """One schema of the spec as JSON Schema 2020-12; collects the names it references.
    `anchored`: the top of `owner` is a `$recursiveAnchor`, so `$recursiveRef: "#"` is `owner`."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        raise TypeError(f"{owner}: a schema that is not an object: {node!r}")
    out: dict = {}
    for key, value in node.items():
        if key in DROPPED or key.startswith("x-") or key == "nullable":
            continue
        if key == "$ref":
            if not value.startswith(SPEC_PREFIX):
                raise ValueError(f"{owner}: a $ref outside components/schemas: {value}")
            name = value[len(SPEC_PREFIX) :]
            refs.add(name)
            out[key] = f"#/$defs/{name}"
        elif key == "$recursiveRef":
            if value != "#" or not anchored:
                raise ValueError(f"{owner}: a $recursiveRef this script does not know: {value}")
            out["$ref"] = f"#/$defs/{owner}"
        elif key in SCHEMA_MAPS:
            out[key] = {k: convert(v, owner, refs, anchored) for k, v in value.items()}
        elif key in SCHEMA_LISTS:
            out[key] = [convert(v, owner, refs, anchored) for v in value]
        elif key in SCHEMA_ONE:
            out[key] = convert(value, owner, refs, anchored)
        else:  # validation keywords and values (type, enum, required, default, format, ...)
            out[key] = value
    if node.get("nullable") is True:
        out = nullable(out)
    return out


def nullable(schema: dict) -> dict:
    """OpenAPI 3.0's `nullable: true` in JSON Schema: null is one more type (and enum value),
    or, where the schema names no type ($ref, anyOf), one more alternative."""
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        schema = {**schema, "type": [*types, "null"] if "null" not in types else types}
        if "enum" in schema and None not in schema["enum"]:
            schema["enum"] = [*schema["enum"], None]
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


def extract(spec: dict, roots: list[str], source: str) -> dict:
    schemas = spec["components"]["schemas"]
    defs: dict = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in defs:
            continue
        if name not in schemas:
            raise KeyError(f"{name} is not in the spec's components/schemas")
        refs: set[str] = set()
        defs[name] = convert(schemas[name], name, refs, anchored=schemas[name].get("$recursiveAnchor") is True)
        todo.extend(sorted(refs - defs.keys()))
    version = spec.get("info", {}).get("version", "?")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (
            f"Vendored from OpenAI's OpenAPI spec (info.version {version}; {source}) by "
            "tests/support/openai_schemas/extract.py: the schemas named in its ROOTS and all they "
            "reference. See README.md for what was changed."
        ),
        "$defs": dict(sorted(defs.items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, help="openapi.yaml or openapi.json of openai/openai-openapi")
    parser.add_argument("--source", default="openai/openai-openapi", help="where the spec came from (repo@commit)")
    parser.add_argument("-o", "--out", type=Path, default=Path(__file__).with_name("schemas.json"))
    args = parser.parse_args(argv)
    doc = extract(load_spec(args.spec), ROOTS, args.source)
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(doc['$defs'])} schemas", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
