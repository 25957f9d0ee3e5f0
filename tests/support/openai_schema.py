"""Check a response body against OpenAI's published schema for it.

    from tests.support.openai_schema import validate
    validate("CreateChatCompletionResponse", r.json())
    validate("ResponseStreamEvent", event)

The schemas are the components/schemas of OpenAI's OpenAPI spec, vendored as JSON Schema
2020-12 in tests/support/openai_schemas/schemas.json (where they came from: its README.md). A
name is the spec's schema name, a key of that file's `$defs`: `names()` lists them. Extra
properties are allowed where the spec allows them (almost everywhere), as for OpenAI's own
answers; formats (`unixtime`, ...) are not checked.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import cache
from pathlib import Path

SCHEMAS = Path(__file__).with_name("openai_schemas") / "schemas.json"
MAX_ERRORS = 5


@cache
def _document() -> dict:
    return json.loads(SCHEMAS.read_text(encoding="utf-8"))


def names() -> list[str]:
    """Every schema name `validate` knows."""
    return sorted(_document()["$defs"])


@cache
def _validator(name: str):
    import jsonschema

    doc = _document()
    if name not in doc["$defs"]:
        close = [n for n in doc["$defs"] if name.lower() in n.lower()][:10]
        raise KeyError(f"no vendored OpenAI schema {name!r}; similar: {close}")
    return jsonschema.Draft202012Validator({**doc, "$ref": f"#/$defs/{name}"})


def validate(name: str, obj) -> None:
    """Raise AssertionError naming where `obj` breaks OpenAI's schema `name` and how."""
    errors = [leaf for e in _validator(name).iter_errors(obj) for leaf in _explain(e)]
    if not errors:
        return
    errors.sort(key=lambda e: [str(p) for p in e.absolute_path])
    lines = [_describe(e) for e in errors[:MAX_ERRORS]]
    more = f"\n  ... and {len(errors) - MAX_ERRORS} more" if len(errors) > MAX_ERRORS else ""
    raise AssertionError(f"not a valid OpenAI {name}:\n  " + "\n  ".join(lines) + more)


def _explain(error) -> list:
    """The errors to show for one: for an anyOf/oneOf failure, those inside the alternative the
    object was meant to be, the one whose `type` (the spec's discriminator) and JSON type it
    matches; where that is not one alternative, jsonschema's best match."""
    import jsonschema.exceptions

    if not error.context:
        return [error]
    branches: dict = defaultdict(list)
    for e in error.context:
        branches[e.relative_schema_path[0]].append(e)
    meant = [errs for errs in branches.values() if not any(_wrong_kind(e, error) for e in errs)]
    if len(meant) == 1:
        return [leaf for e in meant[0] for leaf in _explain(e)]
    return [jsonschema.exceptions.best_match([error])]


def _wrong_kind(e, parent) -> bool:
    """An error that says the object is another alternative altogether: a different JSON type,
    or another value of its `type` / `object` tag."""
    at = list(e.absolute_path)[len(parent.absolute_path) :]
    if not at:
        return e.validator == "type"
    return at in (["type"], ["object"]) and e.validator in ("enum", "const")


def _describe(e) -> str:
    path = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
    schema = "/".join(str(p) for p in e.absolute_schema_path)
    message = e.message if len(e.message) <= 300 else e.message[:300] + "..."
    return f"at {path}: {message}  (schema: {schema})"
