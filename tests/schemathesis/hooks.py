"""Schemathesis hooks for `tests/test_openapi_conformance.py`: generated chat requests ask
for at most 4 tokens, so each one the model runs takes a fraction of a second on a CPU (the
checks are about the API's shape, not about how long the model writes)."""

import schemathesis

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
