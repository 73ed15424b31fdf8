"""Running a model over managed KV caches, in four rooms, each standing on those before it:
`models` (loading a model and its weights, torch's threads), `replies` (sampling, grammars,
tool calls: what a reply may be, decoded token by token), `engine` (one sequence's state,
chunked prefill and decode over a policy-managed cache, continuous batching) and `chat` (chat
rendering, pins, `ChatSession` and the append-only `Conversation`). Imports `agent_kv.kv`
below it."""
