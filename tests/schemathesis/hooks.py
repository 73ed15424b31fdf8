"""Schemathesis hooks for `tests/test_openapi_conformance.py`: generated chat requests ask
for at most 4 tokens, so each one the model runs takes a fraction of a second on a CPU (the
checks are about the API's shape, not about how long the model writes)."""

import json

import llguidance
import schemathesis

from agent_kv.errors import GrammarError
from agent_kv.runtime.replies.json_schemas import check_schema, closed

CHAT_PATHS = ("/chat", "/v1/chat/completions")
MAX_TOKENS = 4


@schemathesis.hook
def map_body(ctx, body):
    if ctx.operation.path not in CHAT_PATHS or not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    return body


@schemathesis.hook
def before_call(ctx, case, kwargs):
    """Every phase's requests (the coverage phase's too, which `map_body` does not see)
    keep the rules of `_semantic_fixes`."""
    body = case.body
    if case.operation.path in (*CHAT_PATHS, "/tokenize") and isinstance(body, dict):
        if isinstance(body.get("messages"), list):
            _semantic_fixes(body["messages"], openai=case.operation.path != "/chat")
        _reply_fixes(body)


def _semantic_fixes(messages: list, openai: bool) -> None:
    """Make generated messages keep the rules a JSON Schema cannot state, which the API
    documents and answers with a 400 (`tests/test_api_tools.py` and
    `tests/test_frameworks.py` test them): a `tool_call_id` names a call of an earlier
    assistant message (on the OpenAI route, where a tool message must name one, a tool message
    answering none becomes a user message), a call's arguments are a JSON object's text, no
    content holds an image part (a server started without `--drop-image-parts`), and a
    message's `name` is the name of the call a tool message answers or, on another message,
    absent (SmolLM2's template renders no names). Bodies of the wrong shape (negative cases)
    are left alone."""
    called = {}
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [
                part
                for part in content
                if not (isinstance(part, dict) and part.get("type") == "image_url")
            ]
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            if not isinstance(call, dict):
                continue
            function = call.get("function")
            if isinstance(call.get("id"), str) and isinstance(function, dict):
                called[call["id"]] = function.get("name")
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                if not _json_object(function["arguments"]):
                    function["arguments"] = "{}"
        answers = message.get("tool_call_id")
        if message.get("role") == "tool" and isinstance(answers, str) and answers not in called:
            message.pop("tool_call_id")
            if openai:
                message["role"] = "user"
        if isinstance(message.get("name"), str):
            answered = message.get("tool_call_id") if message.get("role") == "tool" else None
            if isinstance(answered, str) and answered in called:
                message["name"] = called[answered]
            else:
                message.pop("name")


def _json_object(text) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def _reply_fixes(body: dict) -> None:
    """Make generated tool and format fields keep the rules a JSON Schema cannot state,
    which the API documents and answers with a 400 (`tests/test_api_tools.py` tests them):
    tool names unique, a named `tool_choice` naming an offered tool, `required` with tools,
    object schemas for parameters, and schemas `check_schema` takes and llguidance compiles.
    Bodies of the wrong shape are left alone."""
    tools = body.get("tools")
    if isinstance(tools, list):
        names, kept = set(), []
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str):
                kept.append(tool)
                continue
            if name in names:
                continue
            names.add(name)
            parameters = function.get("parameters")
            if isinstance(parameters, dict) and not _usable(parameters, tool=True):
                function["parameters"] = {}
            kept.append(tool)
        body["tools"] = kept
    else:
        names = set()
    choice = body.get("tool_choice")
    if choice == "required" and not names:
        body.pop("tool_choice")
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
        if isinstance(named, str) and named not in names:
            body.pop("tool_choice")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
        schema = fmt["json_schema"].get("schema")
        if isinstance(schema, dict) and not _usable(schema, tool=False):
            fmt["json_schema"]["schema"] = {}


def _usable(schema: dict, tool: bool) -> bool:
    """Whether the API takes `schema` (as a tool's parameters when `tool`)."""
    try:
        check_schema(schema, "schema")
    except GrammarError:
        return False
    if tool and (schema or {"type": "object"}).get("type", "object") != "object":
        return False
    return _compiles(closed(schema) or {"type": "object"})


def _compiles(schema) -> bool:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (TypeError, ValueError):
        return False
    return not llguidance.LLMatcher.validate_grammar(grammar)
