"""The KV cache itself: the store (two precisions, scores, pins, exact bytes), its
transformers `Cache` adapter and attention function, rotary re-rotation, CONF-KV's
confidence, the policies that evict and quantize, and the budgets and policy settings the
front ends parse. Imports nothing of agent_kv above it (`kernels` and `agent_kv.errors`
only); importing this package loads nothing (`policy_names` needs no torch)."""
