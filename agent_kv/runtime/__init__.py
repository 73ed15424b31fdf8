"""Running a model over managed KV caches: model loading and torch's threads, the engine
(chunked prefill, decode, batched decode, teacher-forced scoring), sampling, one sequence's
state (`SequenceState`), the chat session over it (`ChatSession`) and the append-only
`Conversation`. Imports `agent_kv.kv` below it."""
