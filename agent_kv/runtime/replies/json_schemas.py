"""Client JSON Schemas (tool parameters, reply formats) as the constrained decoder takes
them: checked for size, depth and text, closed where they list properties, and embedded in a
larger document with their references kept working."""

from __future__ import annotations

import json
from typing import Any

from agent_kv.errors import ConfigError, GrammarError
from agent_kv.valid_text import check_unicode

MAX_SCHEMA_DEPTH = 32
"""The deepest nesting of objects and lists one schema may have."""
MAX_SCHEMA_BYTES = 32 * 1024
"""The longest one schema may be, as JSON text (bytes). llguidance compiles larger ones
slowly (seconds for thousands of properties) and can fail only while decoding."""
DATA_KEYWORDS = ("const", "enum", "default", "examples")
"""Keywords whose values are JSON data, not schemas: `closed` leaves them as they are."""


def check_schema(schema: Any, what: str) -> None:
    """Refuse a schema the decoder should not be given.

    Args:
        schema: the schema, as parsed JSON.
        what: how error messages name it (e.g. "tool 'search' parameters").

    Raises:
        GrammarError: nesting deeper than `MAX_SCHEMA_DEPTH`, JSON text over
            `MAX_SCHEMA_BYTES`, or a string or key that is not valid Unicode (a lone
            surrogate).
    """
    try:
        _check_tree(schema, what)
    except ConfigError as err:  # a lone surrogate
        raise GrammarError(str(err)) from None
    size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{what} are {size} bytes of JSON: at most {MAX_SCHEMA_BYTES}")


def _check_tree(schema: Any, what: str) -> None:
    """`check_schema`'s depth and text checks, without recursion."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{what} nest deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(value, str):
            check_unicode(value, what)
        elif isinstance(value, dict):
            for key, item in value.items():
                check_unicode(str(key), what)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def closed(schema: Any) -> Any:
    """`schema` with every object schema that lists `properties` and leaves
    `additionalProperties` unset closed (`additionalProperties: false`), as OpenAI's strict
    mode requires of its schemas: decoded under an open object, a small model keeps
    inventing keys until `max_tokens`. Values of `DATA_KEYWORDS` and anything not a schema
    are returned as they are (copies). Call `check_schema` first (it bounds the depth)."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in DATA_KEYWORDS else closed(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def embedded(schemas: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Schemas gathered under one document's `$defs`, so that each can be placed anywhere in
    it (`{"$ref": refs[name]}`) with its own references still resolving: each schema goes to
    `$defs/<name>` with its `$defs` / `definitions` beside it as `$defs/<name>.<def>`, and
    every local `$ref` in it (`#`, `#/properties/...`, `#/$defs/X/...`,
    `#/definitions/X/...`) is rewritten to match.

    Returns:
        `(defs, refs)`: the `$defs` mapping, and each name's `$ref`.
    """
    defs, refs = {}, {}
    for name, schema in schemas.items():
        body = dict(schema)
        local = {**body.pop("definitions", {}), **body.pop("$defs", {})}
        defs[name] = _rebased(body, name)
        for key, value in local.items():
            defs[f"{name}.{key}"] = _rebased(value, name)
        refs[name] = f"#/$defs/{name}"
    return defs, refs


def _rebased(schema: Any, name: str) -> Any:
    """`schema` with its local `$ref`s pointing into `$defs/<name>` (see `embedded`)."""
    if isinstance(schema, list):
        return [_rebased(item, name) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = _rebased_ref(value[1:], name)
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, name)
    return out


def _rebased_ref(path: str, name: str) -> str:
    """A JSON pointer of the original schema (`""`, `/properties/a`, `/$defs/X/...`) as one
    into the embedding document."""
    for section in ("/$defs/", "/definitions/"):
        if path.startswith(section):
            head, _, rest = path[len(section) :].partition("/")
            return f"#/$defs/{name}.{head}" + (f"/{rest}" if rest else "")
    return f"#/$defs/{name}{path}"
