"""The engine: one sequence's state (`SequenceState`), chunked prefill and decode over a
policy-managed KV cache, one forward call and the policy's eviction after it, the compiled
decode step, shared pinned prefixes, and continuous batching of many sequences."""
